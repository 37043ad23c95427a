"""Personalized evaluation of a role's clients stacked (torch.func.vmap) equals one client at a time."""

import logging

import pytest
import torch
from conftest import ROOT, method_env, read_summary, run_cli
from torch import nn

from fl_lightning.client.evaluation import Evaluator, PersonalEvaluation
from fl_lightning.client.stacked_eval import StackedEvaluation
from fl_lightning.federation.population import Tier
from fl_lightning.models import FeatureClassifier, ModelSpec
from fl_lightning.strategies import FedHe

MODELS = {
    "mlp": ModelSpec("digits_mlp", {"hidden": 32}),
    "cnn": ModelSpec("digits_cnn", {"width": 0.5, "batch_norm": True}),
    "lstm": ModelSpec("test_stacked_eval.row_lstm"),
}
TIERS = [Tier("mlp", ["mlp"], count=5), Tier("cnn", ["cnn"], count=4), Tier("lstm", ["lstm"], count=3)]


class RowLSTM(nn.Module):
    """Reads an 8x8 digit row by row; vmap has no batching rule for ``aten::lstm``."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)

    def forward(self, x):
        return self.lstm(x.reshape(len(x), 8, 8))[0][:, -1]


def row_lstm(num_classes: int = 10) -> FeatureClassifier:
    return FeatureClassifier(RowLSTM(), nn.Linear(16, num_classes), 16, num_classes)


def _evaluate(server, strategy, clients_per_batch, states=None):
    plan = PersonalEvaluation(clients_per_batch=clients_per_batch)
    evaluator = Evaluator(server._loop, server.data, server.clients, states or {}, plan)
    metrics = evaluator.personalized(strategy.personal_weights)
    return metrics, evaluator, torch.get_rng_state()


@pytest.fixture
def fedhe(monkeypatch):
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "conftest,test_stacked_eval")
    strategy = FedHe()
    server = method_env(strategy, MODELS, TIERS, num_clients=12)
    # trained-looking clients: batch-norm statistics away from their initial 0 / 1, other weights perturbed
    states = {}
    for client in server.clients[::2]:
        weights = server.own_weights(client, None)
        generator = torch.Generator().manual_seed(client.id)
        states[client.id] = {
            "weights": {
                k: v + 0.3 * torch.rand(v.shape, generator=generator) if v.is_floating_point() else v + 3
                for k, v in weights.items()
            }
        }
    return server, strategy, states


def test_stacked_clients_score_as_one_at_a_time(fedhe, caplog):
    server, strategy, states = fedhe
    one_metrics, one, one_rng = _evaluate(server, strategy, 1, states)
    with caplog.at_level(logging.WARNING, logger="fl_lightning.client.evaluation"):
        stacked_metrics, evaluator, stacked_rng = _evaluate(server, strategy, 3, states)  # chunks of 3 and a rest
    assert [type(evaluator._stacked[role]).__name__ for role in ("mlp", "cnn", "lstm")] == [
        "StackedEvaluation",
        "StackedEvaluation",
        "NoneType",
    ]
    one, stacked = one.per_client, evaluator.per_client
    tier = {c.id: c.tier for c in server.clients}
    assert stacked.keys() == one.keys() and len(one) == 12
    for cid, acc in one.items():
        if tier[cid] == "cnn":  # a grouped convolution sums in another order: float tolerance
            assert stacked[cid] == pytest.approx(acc, abs=1 / 359)
        else:  # linear layers sum the same way stacked; the LSTM falls back to one at a time
            assert stacked[cid] == acc
    assert set(stacked_metrics) == set(one_metrics)
    for name, value in one_metrics.items():
        assert stacked_metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert stacked_metrics["personal/mlp/test_acc"] == one_metrics["personal/mlp/test_acc"]
    assert stacked_metrics["personal/lstm/test_acc"] == one_metrics["personal/lstm/test_acc"]
    assert len(set(one.values())) > 6  # the clients' models differ (own seeds, own states)
    assert torch.equal(stacked_rng, one_rng)  # initial weights drawn in the same client order
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "lstm's clients are evaluated one at a time"
    ]  # said once, for the role vmap cannot run


def test_clients_too_many_for_the_devices_memory_are_evaluated_in_halves_still_stacked(fedhe, monkeypatch, caplog):
    """Out of memory with a chunk of clients: its halves are evaluated stacked (the role is not given up to one
    client at a time), with the numbers of one at a time, and later chunks start from the size that fitted."""
    server, strategy, states = fedhe
    _, one, _ = _evaluate(server, strategy, 1, states)
    real, sizes = StackedEvaluation.scores, {}

    def scores(self, weights, x, y):
        sizes.setdefault(id(self), []).append(len(weights))  # per role (one stacked evaluation each)
        if len(weights) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, weights, x, y)

    monkeypatch.setattr(StackedEvaluation, "scores", scores)
    with caplog.at_level(logging.WARNING, logger="fl_lightning.client.evaluation"):
        _, evaluator, _ = _evaluate(server, strategy, 5, states)  # the mlp tier: a chunk of 5
    mlp, cnn = (sizes[id(evaluator._stacked[role])] for role in ("mlp", "cnn"))
    assert mlp == [5, 3, 2, 1, 2] and cnn == [4, 2, 2]  # 5 ran out: 3 (ran out: 2 and 1) and 2
    assert evaluator._most_stacked["mlp"] == evaluator._most_stacked["cnn"] == 2
    mlp.clear(), cnn.clear()
    evaluator.personalized(strategy.personal_weights)  # the next evaluation starts from the size that fitted
    assert mlp == [2, 2, 1] and cnn == [2, 2]
    tier = {c.id: c.tier for c in server.clients}
    for cid, acc in one.per_client.items():
        assert evaluator.per_client[cid] == (pytest.approx(acc, abs=1 / 359) if tier[cid] == "cnn" else acc)
    assert any("exceed the device's memory" in r.getMessage() for r in caplog.records)


def test_stacked_losses_match_test_step_on_the_cpu_mlp():
    torch.manual_seed(0)
    models = [MODELS["mlp"].build(num_classes=10) for _ in range(4)]
    x, y = torch.randn(37, 1, 8, 8), torch.randint(0, 10, (37,))
    stacked = StackedEvaluation(models[0], batch_size=16)  # three test batches: 16, 16, 5
    scores = stacked.scores([m.state_dict() for m in models], x, y)
    for model, (acc, loss) in zip(models, scores):
        logits = torch.cat([model.eval()(x[i : i + 16]) for i in range(0, 37, 16)])
        by_hand = sum(
            nn.functional.cross_entropy(model(x[i : i + 16]), y[i : i + 16], reduction="sum") for i in range(0, 37, 16)
        )
        assert acc == (logits.argmax(1) == y).sum().item() / 37
        assert loss == by_hand.item() / 37  # the same float32 sums, batch by batch


def test_an_lstm_raises_so_the_evaluator_falls_back():
    model = row_lstm()
    with pytest.raises(RuntimeError, match="lstm"):
        StackedEvaluation(model, batch_size=8).scores([model.state_dict()] * 2, torch.randn(4, 1, 8, 8), torch.zeros(4))


def test_the_option_through_fit(tmp_path, capsys):
    argv = ["fit", "--config", str(ROOT / "recipes" / "digits_fedhe.yaml"), "--runtime.progress", "false"]
    argv += ["--rounds", "2", "--eval_every", "1", "--seed", "0"]
    assert run_cli(*argv, "--output_dir", str(tmp_path / "one")) == 0
    assert run_cli(*argv, "--output_dir", str(tmp_path / "stacked"), "--evaluation.clients_per_batch", "8") == 0
    one, stacked = read_summary(tmp_path / "one"), read_summary(tmp_path / "stacked")
    assert stacked["final"]["personal/mlp/test_acc"] == one["final"]["personal/mlp/test_acc"]
    assert stacked["final"]["personal/test_loss"] == pytest.approx(one["final"]["personal/test_loss"], rel=1e-6)
    assert stacked["final"]["personal/test_acc"] == pytest.approx(one["final"]["personal/test_acc"], abs=1 / 359)
    assert run_cli(*argv, "--output_dir", str(tmp_path / "bad"), "--evaluation.clients_per_batch", "0") == 2
    err = capsys.readouterr().err.strip()
    assert "evaluation.clients_per_batch must be a whole number of at least 1" in err and "\n" not in err


class _Handed(Exception):
    """Stops an evaluation at its exchange: the share this rank hands to the others is what the test wants."""


def _as_two_ranks(monkeypatch, server, strategy, clients_per_batch, states):
    """The evaluation as rank 1 (up to its exchange, its share kept) and then as rank 0, which receives that
    share: rank 0's (metrics, evaluator, generator state), rank 0's and rank 1's shares, rank 1's generator."""
    from fl_lightning.client import evaluation
    from fl_lightning.distributed.ranks import Ranks

    shares = {}

    def hand_over(rank):
        def exchange(share):
            shares[rank] = share
            if rank == 1:
                raise _Handed
            return [share, shares[1]]

        return exchange

    for rank in (1, 0):  # rank 1's share first, then rank 0's run receives it
        monkeypatch.setattr(evaluation, "current_ranks", lambda rank=rank: Ranks(rank=rank, world=2))
        monkeypatch.setattr(evaluation, "exchange", hand_over(rank))
        torch.manual_seed(5)
        if rank == 1:
            with pytest.raises(_Handed):
                _evaluate(server, strategy, clients_per_batch, states)
            rank_1_rng = torch.get_rng_state()
        else:
            result = _evaluate(server, strategy, clients_per_batch, states)
    return result, shares, rank_1_rng


@pytest.mark.parametrize("clients_per_batch", [1, 3])
def test_ranks_each_evaluate_their_share_and_together_give_one_process_s_scores(fedhe, monkeypatch, clients_per_batch):
    """With two ranks, each evaluates every other client (or chunk of clients stacked: the chunks one process
    forms), draws every client's initial weights in client order all the same, and the exchanged shares give
    every rank the metrics of one process, bit for bit."""
    server, strategy, states = fedhe
    torch.manual_seed(5)
    one_metrics, one, one_rng = _evaluate(server, strategy, clients_per_batch, states)
    (metrics, evaluator, rng), shares, rank_1_rng = _as_two_ranks(
        monkeypatch, server, strategy, clients_per_batch, states
    )
    assert shares[0] and shares[1] and not shares[0].keys() & shares[1].keys()
    assert shares[0].keys() | shares[1].keys() == set(range(12))
    if clients_per_batch == 1:
        assert sorted(shares[1]) == [1, 3, 5, 7, 9, 11]
    assert metrics == one_metrics and evaluator.per_client == one.per_client
    assert torch.equal(rng, one_rng) and torch.equal(rank_1_rng, one_rng)


def test_a_role_vmap_runs_slowly_is_scored_one_at_a_time_from_its_first_chunk_with_ranks_or_without(fedhe, monkeypatch):
    """vmap's slow per-client fallback makes stacking useless for a role: the chunk that finds it out is scored
    one at a time too, so no score depends on which chunk that was (each rank finds it in a chunk of its own)."""
    real = StackedEvaluation.scores

    def slow(self, weights, x, y):  # a model vmap runs through its slow fallback; +100 marks a stacked score
        self.slow = True
        return [(acc + 100, loss) for acc, loss in real(self, weights, x, y)]

    monkeypatch.setattr(StackedEvaluation, "scores", slow)
    server, strategy, states = fedhe
    torch.manual_seed(5)
    one_metrics, one, _ = _evaluate(server, strategy, 2, states)
    (metrics, evaluator, _), _, _ = _as_two_ranks(monkeypatch, server, strategy, 2, states)
    assert max(one.per_client.values()) <= 1.0  # no score came from a slow stacked pass
    assert evaluator.per_client == one.per_client and metrics == one_metrics


def test_an_empty_local_split_fails_every_rank_before_any_exchange(fedhe, monkeypatch):
    """With ranks sharing a personalized evaluation on local test splits, a client's empty split is found by
    every rank up front (one message on each), not only by the rank that evaluates the client while the
    others wait at the exchange."""
    from fl_lightning.client import evaluation
    from fl_lightning.distributed.ranks import Ranks

    server, strategy, states = fedhe
    server.data.clients[0].test = server.data.clients[0].test[:0]
    monkeypatch.setattr(evaluation, "current_ranks", lambda: Ranks(rank=1, world=2))  # client 0 is rank 0's
    monkeypatch.setattr(evaluation, "exchange", lambda share: pytest.fail("exchanged before the check"))
    evaluator = Evaluator(server._loop, server.data, server.clients, states)
    with pytest.raises(ValueError, match="client 0 has an empty local test split"):
        evaluator.personalized(strategy.personal_weights, split="test")
