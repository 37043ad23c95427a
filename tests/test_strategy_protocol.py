"""The strategy protocol: phases are objects the base class checks, hooks are abstract, and the orchestrator
drains a phase without aggregation, so a method needs no phase-name comparison and no hand drain."""

from __future__ import annotations

import ast
from collections.abc import Iterator

import pytest
import torch
from conftest import ROOT, metrics_rows, read_summary, run_cli, write_recipe

from fl_lightning.federation.types import ClientSpec, ClientTask, ClientUpdate
from fl_lightning.strategies import FedAvg, Standalone
from fl_lightning.strategies.base import Phase, Strategy, phase_table
from fl_lightning.strategies.dsfl import DSFL
from fl_lightning.strategies.fedmd import FedMD


@pytest.fixture(autouse=True)
def _trust_this_module(monkeypatch):
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "conftest,test_strategy_protocol")


class TwoPhases(Standalone):
    """Every sampled client trains its own model, then the even-numbered ones train once more in a second phase
    that the server does not aggregate: the orchestrator must run and drain it."""

    def phases(self) -> tuple[Phase, ...]:
        return (
            Phase("train", self.configure_round, self.client_update, self.count_uploads),
            Phase("again", self.configure_again, self.train_again),
        )

    def setup(self, server):
        super().setup(server)
        self.counted: list[int] = []

    def count_uploads(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        ids = [update.client.id for update in updates]
        self.counted.append(len(ids))
        return {"server/uploads": float(len(ids))}

    def configure_again(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        return [ClientTask(c, rnd) for c in clients if c.id % 2 == 0]

    def train_again(self, task: ClientTask, ctx) -> ClientUpdate:
        TRAINED_AGAIN.append((task.round, task.client.id, task.phase))
        return self.client_update(task, ctx)


TRAINED_AGAIN: list[tuple[int, int, str]] = []  # what the second phase's clients did, in the process that ran them


class LeavesOneBehind(FedAvg):
    """An aggregation that stops after the first update: the orchestrator must refuse it."""

    def aggregate(self, rnd, updates):
        return super().aggregate(rnd, iter([next(updates)]))


def test_a_one_phase_method_missing_a_hook_cannot_be_made():
    class NoAggregate(Strategy):
        def configure_round(self, rnd, clients):
            return []

        def client_update(self, task, ctx):
            raise AssertionError

        def evaluate(self, evaluator):
            return {}

        @property
        def monitor(self):
            return "x"

    with pytest.raises(TypeError, match="abstract method '?aggregate"):
        NoAggregate()


def test_a_method_with_its_own_phases_needs_no_one_phase_hooks():
    class OnlyPhases(Strategy):
        def phases(self):
            return (Phase("train", lambda rnd, clients: [], lambda task, ctx: None),)

        def evaluate(self, evaluator):
            return {}

        @property
        def monitor(self):
            return "x"

    strategy = OnlyPhases()
    assert [p.name for p in phase_table(strategy)] == ["train"] and phase_table(strategy)[0].aggregate is None


def test_the_old_tuple_of_phase_names_is_refused_when_the_class_is_made():
    with pytest.raises(TypeError, match=r"Old\.phases = \('a', 'b'\) is the old form; define `def phases\(self\)"):

        class Old(FedAvg):
            phases = ("a", "b")


@pytest.mark.parametrize(
    ("phases", "message"),
    [
        ((), "must return a non-empty tuple of Phase objects, got none"),
        (("train",), "must return a non-empty tuple of Phase objects, got str"),
        (
            (Phase("a", print, print), Phase("a", print, print)),
            r"names \['a'\] more than once; give each phase its own name",
        ),
        (tuple(Phase(f"p{i}", print, print) for i in range(11)), "has 11 phases; a round has at most 10"),
    ],
)
def test_phase_table_refuses_what_the_round_loop_cannot_run(phases, message):
    class Bad(FedAvg):
        def phases(self):
            return phases

    with pytest.raises(TypeError, match=message):
        phase_table(Bad())


def test_the_multi_phase_methods_name_their_phases_in_order():
    assert [p.name for p in phase_table(FedMD())] == ["transfer", "communicate", "digest"]
    assert [p.aggregate is None for p in phase_table(FedMD())] == [True, False, True]
    assert [p.name for p in phase_table(DSFL())] == ["train", "distill"]
    assert [p.aggregate is None for p in phase_table(Standalone())] == [True]


def test_no_strategy_compares_phase_names():
    """A phase is a method, not a string a hook compares: no ``phase ==`` / ``task.phase`` in a strategy file."""
    found = []
    for path in sorted((ROOT / "fl_lightning" / "strategies").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = [n for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))]
                if any((getattr(n, "id", None) or getattr(n, "attr", None)) == "phase" for n in names):
                    found.append(f"{path.name}:{node.lineno}")
    assert found == []


def test_the_orchestrator_runs_and_drains_a_phase_without_aggregation(tmp_path):
    """Clients of the unaggregated phase train (their steps count, their loss is logged) and the round goes on."""
    TRAINED_AGAIN.clear()
    recipe = write_recipe(tmp_path / "r.yaml", strategy={"class_path": "test_strategy_protocol.TwoPhases"})
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run")) == 0
    rows = metrics_rows(tmp_path / "run")
    assert [int(r["round"]) for r in rows] == [2, 4]
    sampled = 4  # 8 clients, fraction 0.5
    assert {phase for _, _, phase in TRAINED_AGAIN} == {"again"} and all(i % 2 == 0 for _, i, _ in TRAINED_AGAIN)
    assert {rnd for rnd, _, _ in TRAINED_AGAIN} == {1, 2, 3, 4}  # the drained phase ran every round
    for row in rows:
        again = sum(rnd == int(row["round"]) for rnd, _, _ in TRAINED_AGAIN)
        assert float(row["server/uploads"]) == sampled and int(row["clients"]) == sampled + again
    assert read_summary(tmp_path / "run")["rounds"] == 4


def test_an_aggregation_that_leaves_updates_is_refused_naming_the_phase(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", strategy={"class_path": "test_strategy_protocol.LeavesOneBehind"})
    with pytest.raises(RuntimeError, match="LeavesOneBehind's aggregate of phase 'train' did not consume every"):
        run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run"))


def test_asynchronous_rounds_refuse_a_method_of_several_phases(tmp_path):
    from fl_lightning.federation.errors import ConfigError
    from fl_lightning.run.asynchrony import AsynchronousRounds, AsynchronousSchedule

    with pytest.raises(ConfigError, match=r"several phases per round \(transfer, communicate, digest\)"):
        AsynchronousRounds(AsynchronousSchedule(), phase_table(FedMD()), [], None, 0, None)


def test_the_public_exchange_refuses_a_size_beyond_its_set_and_replies_only_to_uploaders():
    from fl_lightning.federation.errors import ConfigError
    from fl_lightning.federation.types import ClientSpec
    from fl_lightning.strategies.public_exchange import PublicExchange

    with pytest.raises(ConfigError, match=r"^FedMD public_size 9 must be between 1 and the public set's 8 examples"):
        PublicExchange("FedMD", 8, 9, "public_size", "public", seed=0)
    exchange = PublicExchange("DS-FL", 8, 3, "open_size", "open", seed=0)
    tasks = exchange.tasks(2, [ClientSpec(0, "all", ("m",)), ClientSpec(1, "all", ("m",))])
    positions = [t.downlink["open_positions"].tensors["positions"].tolist() for t in tasks]
    assert positions[0] == positions[1] == exchange.subset(2).tolist() and len(positions[0]) == 3
    assert exchange.reply(2, [], "global_soft_labels", {"probs": torch.ones(3, 10)}) == []
    assert exchange.reply(2, [tasks[1].client], "global_soft_labels", None) == []
    (reply,) = exchange.reply(2, [tasks[1].client], "global_soft_labels", {"probs": torch.ones(3, 10)})
    assert reply.client.id == 1 and reply.downlink["global_soft_labels"].nbytes == 3 * 10 * 4
