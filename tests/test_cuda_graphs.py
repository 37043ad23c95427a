"""``runtime.cuda_graphs`` on a CPU: the replay logic, with :class:`CheckedReruns` standing in for CUDA graphs.

A CUDA graph replays the kernels, tensor addresses and Python values of its capture. The stand-in reruns
the step instead and raises when the rerun's operations, Python arguments or outside tensors' addresses
differ from the capture's, which is exactly where a real graph would have computed something else than
the eager step. So a run that passes here with the eager run's numbers replays faithfully on a GPU, up to
what only a GPU shows (whether torch can capture the step's kernels; tests/test_cuda.py runs it there).
"""

import copy
import dataclasses
import functools
import json
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import marked_beyond
from torch import nn

from fl_lightning.cli.commands import fit_from_argv
from fl_lightning.client import graphs
from fl_lightning.client.graphs import capture
from fl_lightning.client.graphs.replay import StepGraphs
from fl_lightning.client.graphs.trace import CheckedReruns, ReplayMismatch, capturable_adam_on_cpu
from fl_lightning.client.steps import vmappable
from fl_lightning.federation.errors import ConfigError
from fl_lightning.run.arguments import UserError
from fl_lightning.run.checkpoint import tensors_by_path
from fl_lightning.run.robustness import Diverged


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(graphs, "backend_for", lambda device: CheckedReruns(device))
    with capturable_adam_on_cpu():  # Adam replays in capturable mode, which torch runs on CPU only so patched
        yield


def _run(tmp_path, name, recipe, *extra, graphs_on=False):
    argv = ["--config", f"recipes/{recipe}", "--rounds", "3", "--output_dir", str(tmp_path / name)]
    argv += ["--runtime.progress", "false", *extra]
    if graphs_on:
        argv += ["--runtime.cuda_graphs", "true"]
    fit_from_argv(argv)
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    weights = torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True)
    return summary, weights


SGD = ["--training.optimizer", "{class_path: torch.optim.SGD, init_args: {lr: 0.05, momentum: 0.9}}"]
# the eager twin of a graphed Adam run: graphs switch Adam to capturable mode, which rounds differently
CAPTURABLE = ["--training.optimizer.init_args.capturable", "true"]
ADAMW = ["--training.optimizer", "{class_path: torch.optim.AdamW, init_args: {lr: 0.003, weight_decay: 0.0}}"]


@pytest.mark.parametrize(
    ("recipe", "extra", "replayed_share"),
    marked_beyond(
        1,
        [
            ("quickstart.yaml", [], 0.5),  # optimizer state reset each fit: a fit's first step makes the momenta
            ("quickstart.yaml", ["--training.optimizer_state", "per_client"], 0.5),  # a client's momenta copied in
            ("digits_ondevice_kd.yaml", [], 0.5),  # a teacher, a KD weight ramped each round, a local temperature
            # a record of training-mode logits handed out each step; the server's logits, sent anew each round,
            # reach the step through ClientContext.on_device (one address), so fits keep their graphs
            ("digits_fedhe.yaml", SGD, 0.4),
            # its recipe's Adam, one state per client: step counts and moments copied in, zeroed at a first fit
            ("digits_fedhe.yaml", [], 0.4),
            ("digits_felo.yaml", [], 0.5),  # server features and logits by class, Adam per client
            ("digits_fedgems.yaml", [], 0.5),  # a distillation step over the server's logits and public labels
            ("digits_heterofl.yaml", [], 0.5),  # logits of a client's absent classes masked
            # models trained together (fit_jointly): mentor, mentee and W_h each clipped and stepped after one backward;
            # W_h is one instance (ctx.helper) that every fit starts with a fresh, zeroed momentum
            ("digits_fedkd.yaml", [], 0.5),
            (
                "digits_fml.yaml",
                ["--training.optimizer", "{class_path: torch.optim.Adam, init_args: {lr: 0.003}}"],
                0.5,
            ),
            # a constant learning rate: at a cosine schedule's last round, 0, capturable Adam writes NaN (see below)
            (
                "quickstart.yaml",
                [*ADAMW, "--training.lr_schedule", "fl_lightning.federation.schedules.ConstantLR"],
                0.5,
            ),
        ],
        pytest.mark.full,
    ),
)
def test_replayed_steps_give_the_eager_run_bit_for_bit(tmp_path, stand_in, recipe, extra, replayed_share):
    adam = "Adam" in " ".join(extra) or (not extra and ("fedhe" in recipe or "felo" in recipe))
    eager, eager_ckpt = _run(tmp_path, "eager", recipe, *extra, *(CAPTURABLE if adam else []))
    replayed, replayed_ckpt = _run(tmp_path, "graphs", recipe, *extra, graphs_on=True)
    assert replayed["final"] == eager["final"]
    eager_tensors, replayed_tensors = tensors_by_path(eager_ckpt), tensors_by_path(replayed_ckpt)
    assert replayed_tensors.keys() == eager_tensors.keys()
    assert all(torch.equal(t, eager_tensors[k]) for k, t in replayed_tensors.items())
    counts = replayed["cuda_graphs"]
    total = counts["graphed_steps"] + counts["eager_steps"]
    assert counts["captures"] > 0 and counts["graphed_steps"] > replayed_share * total, counts
    # a fit that starts from a fresh optimizer state replays its first step too (zeroed momenta or moments)
    assert not [reason for reason in counts["eager_reasons"] if "optimizer's state" in reason], counts
    assert "cuda_graphs" not in eager


@pytest.mark.full  # FedKD twice, 6 rounds in all
def test_models_trained_together_capture_their_graphs_once_for_every_client_and_round(tmp_path, stand_in):
    """FedKD's fits (mentor, mentee and each client's W_h, fit_jointly) share graphs across clients and rounds:
    rounds 3 and 4 capture nothing new. With a new W_h module per fit every fit captured again (150 graphs
    in 5 rounds against 18, measured when ``ctx.helper`` was added)."""
    two, _ = _run(tmp_path, "two", "digits_fedkd.yaml", "--rounds", "2", graphs_on=True)
    four, _ = _run(tmp_path, "four", "digits_fedkd.yaml", "--rounds", "4", graphs_on=True)
    assert two["cuda_graphs"]["captures"] == four["cuda_graphs"]["captures"] > 0
    replayed = four["cuda_graphs"]["graphed_steps"] - two["cuda_graphs"]["graphed_steps"]
    assert four["cuda_graphs"]["eager_steps"] == two["cuda_graphs"]["eager_steps"] and replayed > 0


DIGITS_RECIPES = sorted(path.name for path in Path("recipes").glob("digits_*.yaml"))
KEY_COSTS = {"a key's first step (captured if the key recurs)", "a key's second step (run, then captured)"}
# FedKTL's joint step (from round 2) picks its generated images by the step index in Python, so it is not marked
# pure and runs eagerly by design (docs/algorithms.md); its round-1 step replays
EAGER_BY_DESIGN = {"digits_fedktl.yaml"}
# FedPAC's two stages freeze one part of the model by leaving its gradient None (the optimizer then skips it, weight
# decay and momentum too); a replayed step would give it zeros instead, so neither step is marked pure
NEVER_REPLAYED = {"digits_fedpac.yaml"}


@pytest.mark.full  # every digits recipe twice, 3 rounds each: about 7 minutes of CPU
@pytest.mark.parametrize("recipe", DIGITS_RECIPES)
def test_every_digits_method_replays_its_steps_as_they_run_eagerly(tmp_path, stand_in, recipe):
    """Every method whose clients train through the loop replays most of its steps, and ends where its eager
    twin does, every tensor of the final checkpoint bit for bit. A step that stops being pure shows here
    as eager steps with a reason; a closure that takes in the strategy again (new tensors every round) or
    server knowledge that bypasses ``ctx.on_device`` as a share below 40 % (FedHe, the lowest, replays 50 %
    of its steps in 3 rounds, 6 % with a new key every fit)."""
    from fl_lightning.run.recipes import load_recipe

    optimizer = load_recipe(Path("recipes") / recipe)["training"].get("optimizer", {}).get("class_path", "")
    eager, eager_ckpt = _run(tmp_path, "eager", recipe, *(CAPTURABLE if "Adam" in optimizer else []))
    replayed, replayed_ckpt = _run(tmp_path, "graphs", recipe, graphs_on=True)
    assert replayed["final"] == eager["final"]
    eager_tensors, replayed_tensors = tensors_by_path(eager_ckpt), tensors_by_path(replayed_ckpt)
    assert replayed_tensors.keys() == eager_tensors.keys()
    assert all(torch.equal(t, eager_tensors[k]) for k, t in replayed_tensors.items())
    counts = replayed["cuda_graphs"]
    if recipe in EAGER_BY_DESIGN:
        assert counts["graphed_steps"] > 0, counts
        return
    if recipe in NEVER_REPLAYED:
        assert counts["graphed_steps"] == 0, counts
        assert set(counts["eager_reasons"]) == {"the step is not marked pure (@vmappable)"}, counts
        return
    assert set(counts["eager_reasons"]) <= KEY_COSTS, counts
    assert counts["graphed_steps"] >= 0.4 * (counts["graphed_steps"] + counts["eager_steps"]), counts


def test_steps_that_cannot_be_replayed_run_eagerly_with_the_reason(tmp_path, stand_in, monkeypatch):
    from fl_lightning.strategies import fedproto

    monkeypatch.setattr(fedproto, "vmappable", lambda step: step)  # an unmarked step: it may have side effects
    summary, _ = _run(tmp_path, "proto", "digits_fedproto.yaml", graphs_on=True)
    reasons = summary["cuda_graphs"]["eager_reasons"]
    assert summary["cuda_graphs"]["graphed_steps"] == 0 and list(reasons) == [
        "the step is not marked pure (@vmappable)"
    ]
    rmsprop = "{class_path: torch.optim.RMSprop, init_args: {lr: 0.001}}"
    summary, _ = _run(tmp_path, "rmsprop", "quickstart.yaml", "--training.optimizer", rmsprop, graphs_on=True)
    assert list(summary["cuda_graphs"]["eager_reasons"]) == [
        "the optimizer is RMSprop (graphs replay SGD, Adam and AdamW steps)"
    ]


# ------------------------------------------------------------------------------------------------ units
class _Net(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.norm, self.head = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.head(self.dropout(F.relu(self.norm(self.body(x)))))


def _batches(shapes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in shapes]


# foreach=True throughout: SGD's default on CUDA (one kernel per list), where a CPU defaults to a per-tensor loop
def _fit(step, shapes, graphs_on: bool, runner: StepGraphs | None = None, net=None, optimizer=None):
    net = net or _Net()
    optimizer = optimizer or torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=True)
    if graphs_on:
        runner = runner or StepGraphs(CheckedReruns("cpu"))
        result = runner.run_steps(net, optimizer, _batches(shapes), step, 1.0, None)
    else:
        result = _eager_fit(net, optimizer, _batches(shapes), step)
    return net, optimizer, result


def _eager_fit(net, optimizer, batches, step):
    net.train()
    total = 0.0
    for i, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        loss = step(net, batch, i)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        total += loss.item()
    return {"loss": total / len(batches)}


def _state(net, optimizer):
    momenta = [optimizer.state[p]["momentum_buffer"] for p in net.parameters()]
    return [t.clone() for t in [*net.state_dict().values(), *momenta]]


def _cross_entropy(scale):
    @vmappable
    def step(module, batch, i):
        x, y = batch
        return scale * F.cross_entropy(module(x), y)

    return step


def test_a_fit_replays_per_batch_shape_and_equals_the_eager_fit():
    shapes = [5, 5, 5, 3, 5, 3, 3]
    step = _cross_entropy(1.0)
    eager_net, eager_opt, eager = _fit(step, shapes, graphs_on=False)
    runner = StepGraphs(CheckedReruns("cpu"))
    net, opt, replayed = _fit(step, shapes, graphs_on=True, runner=runner)
    assert all(torch.equal(a, b) for a, b in zip(_state(net, opt), _state(eager_net, eager_opt)))
    assert replayed["loss"] == pytest.approx(eager["loss"], rel=1e-6)
    # each shape: its first step runs eagerly, its second runs for real and is captured, the rest replay
    assert runner.counts == {"graphed_steps": 3, "eager_steps": 4, "captures": 2, "dropped": 0}
    assert runner.backend.replays == 3
    opt.state.clear()  # a fresh state: the next fit replays from its first step, on zeroed momenta
    eager_opt.state.clear()
    _fit(step, [5, 5], True, runner, net, opt)
    _fit(step, [5, 5], False, None, eager_net, eager_opt)
    assert runner.counts["graphed_steps"] == 5
    assert all(torch.equal(a, b) for a, b in zip(_state(net, opt), _state(eager_net, eager_opt)))


def test_a_new_closure_value_captures_a_new_graph():
    net, runner = _Net(), StepGraphs(CheckedReruns("cpu"))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    eager_net = _Net()
    eager_opt = torch.optim.SGD(eager_net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    for scale in (1.0, 0.5, 0.5):  # a KD weight ramped between rounds, then held
        _fit(_cross_entropy(scale), [4, 4, 4], True, runner, net, optimizer)
        _fit(_cross_entropy(scale), [4, 4, 4], False, None, eager_net, eager_opt)
    assert runner.counts["captures"] == 2 and runner.counts["graphed_steps"] == 1 + 1 + 3
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), eager_net.state_dict().values()))


def test_a_learning_rate_change_captures_a_new_graph():
    net, runner = _Net(), StepGraphs(CheckedReruns("cpu"))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    _fit(_cross_entropy(1.0), [4, 4], True, runner, net, optimizer)
    optimizer.param_groups[0]["lr"] = 0.01
    _fit(_cross_entropy(1.0), [4, 4], True, runner, net, optimizer)
    assert runner.counts["captures"] == 2


class _Knob:
    def __init__(self):
        self.inner = types.SimpleNamespace(scale=1.0)


def test_the_stand_in_fails_where_a_graph_would_replay_a_stale_value():
    """A value read three objects deep is outside the key: a real graph would keep the captured 1.0."""
    holder = types.SimpleNamespace(knob=_Knob())

    @vmappable
    def step(module, batch, i):
        x, y = batch
        return holder.knob.inner.scale * F.cross_entropy(module(x), y)

    net, runner = _Net(), StepGraphs(CheckedReruns("cpu"))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    _fit(step, [4, 4], True, runner, net, optimizer)
    holder.knob.inner.scale = 2.0
    with pytest.raises(ReplayMismatch, match="differs from the capture"):
        _fit(step, [4, 4], True, runner, net, optimizer)


def test_strategy_attributes_in_the_closure_are_part_of_the_key():
    strategy = types.SimpleNamespace(temperature=3.0)

    @vmappable
    def step(module, batch, i):
        x, y = batch
        return F.cross_entropy(module(x) / strategy.temperature, y)

    net, runner = _Net(), StepGraphs(CheckedReruns("cpu"))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    _fit(step, [4, 4], True, runner, net, optimizer)
    strategy.temperature = 1.0
    _fit(step, [4, 4], True, runner, net, optimizer)  # no mismatch: a new key, a new capture
    assert runner.counts["captures"] == 2


@pytest.mark.parametrize(
    ("step", "net", "reason"),
    [
        (_cross_entropy(1.0), _Net(dropout=0.5), "draws random numbers"),
        (vmappable(lambda m, b, i: F.cross_entropy(m(b[0]), b[1]) * float(b[1].max() + 1)), _Net(), "reads a tensor"),
    ],
)
def test_random_draws_and_host_reads_keep_a_step_eager(step, net, reason):
    runner = StepGraphs(CheckedReruns("cpu"))
    _fit(step, [4, 4, 4], True, runner, net)
    assert runner.counts["graphed_steps"] == 0 and runner.counts["captures"] == 0
    assert [r for r in runner.eager_reasons if reason in r], runner.eager_reasons


def test_an_unmarked_step_and_an_adam_outside_capturable_mode_stay_eager():
    runner = StepGraphs(CheckedReruns("cpu"))
    net = _Net()
    _fit(lambda m, b, i: F.cross_entropy(m(b[0]), b[1]), [4, 4], True, runner, net)
    adam = torch.optim.Adam(net.parameters())  # not prepared: its bias corrections are host numbers
    _fit(_cross_entropy(1.0), [4, 4], True, runner, net, adam)
    assert runner.counts["graphed_steps"] == 0
    assert runner.eager_reasons == {
        "the step is not marked pure (@vmappable)": 2,
        "the Adam optimizer is not in capturable mode (an optimizer of the method's own)": 2,
    }


def test_the_stand_in_fails_a_replay_of_adam_s_default_step():
    """Why Adam replays only in capturable mode: its default step makes host values from its step count
    (bias corrections handed to the kernels as numbers; on a CPU also a new tensor for the increment),
    which a graph would repeat from its capture."""
    net = _Net()
    adam = torch.optim.Adam(net.parameters(), lr=0.01, foreach=True)
    body = functools.partial(capture._step, net, adam, _batches([4])[0], 0, _cross_entropy(1.0), None)
    body()  # the state exists, as at any capture (a key's second step)
    handle = CheckedReruns("cpu").capture(lambda: (adam.zero_grad(), body())[1])
    with pytest.raises(ReplayMismatch, match="differs from the capture"):
        for _ in range(2):  # at the latest one step later: other bias corrections, which a graph would not have
            handle.replay()


def test_a_fit_at_learning_rate_0_runs_adam_s_default_step_and_keeps_the_weights(tmp_path, stand_in):
    """A cosine schedule's last round has a learning rate of 0, where capturable Adam computes 0 / 0 for
    a parameter whose second moment is 0 (the eager run with ``capturable: true`` diverges there); with
    graphs such a fit runs Adam's default step, which leaves the weights as they are."""
    summary, weights = _run(tmp_path, "graphs", "quickstart.yaml", *ADAMW, graphs_on=True)  # CosineLR, 3 rounds
    counts = summary["cuda_graphs"]
    zero_lr = [n for reason, n in counts["eager_reasons"].items() if reason.startswith("the learning rate is 0")]
    assert zero_lr and counts["graphed_steps"] > 0, counts
    assert all(torch.isfinite(t).all() for t in tensors_by_path(weights).values() if t.is_floating_point())
    with pytest.raises(Diverged, match="round 3 diverged"):  # what the replays would otherwise have given
        _run(tmp_path, "capturable", "quickstart.yaml", *ADAMW, *CAPTURABLE)
    _, default_weights = _run(tmp_path, "default", "quickstart.yaml", *ADAMW)
    # round 3 (lr 0) moves no parameter in either run: equal to the default Adam's to float rounding
    # (rounds 1-2 ran in capturable mode)
    final = {k: v for k, v in tensors_by_path(default_weights).items() if v.is_floating_point()}
    for k, v in tensors_by_path(weights).items():
        if k in final:
            torch.testing.assert_close(v, final[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_adam_in_capturable_mode_replays_as_it_runs_eagerly(kind):
    """Moments and step counts stay in the captured tensors: a client's state is copied in, a fresh one
    zeroed (Adam's own start), and every fit equals the eager capturable optimizer's bit for bit."""

    def adam(net):
        optimizer = getattr(torch.optim, kind)(net.parameters(), lr=0.01, weight_decay=1e-3, foreach=True)
        graphs.prepare_optimizer(optimizer)
        return optimizer

    def state(net, optimizer):
        moments = [optimizer.state[p][k] for p in net.parameters() for k in ("step", "exp_avg", "exp_avg_sq")]
        return [t.clone() for t in [*net.state_dict().values(), *moments]]

    with capturable_adam_on_cpu():
        step, runner = _cross_entropy(1.0), StepGraphs(CheckedReruns("cpu"))
        net, eager_net = _Net(), _Net()
        optimizer, eager_opt = adam(net), adam(eager_net)
        saved = {}
        for fit, (client, shapes) in enumerate([("a", [5, 5, 5, 3]), ("b", [5, 5]), ("a", [5, 5, 3]), ("c", [5])]):
            for o in (optimizer, eager_opt):  # optimizer_state per_client: each client's own state, or a fresh one
                o.state.clear()
                if (client, id(o)) in saved:
                    o.load_state_dict(saved[client, id(o)])
            _fit(step, shapes, True, runner, net, optimizer)
            _fit(step, shapes, False, None, eager_net, eager_opt)
            for o in (optimizer, eager_opt):
                saved[client, id(o)] = copy.deepcopy(o.state_dict())
            assert all(torch.equal(a, b) for a, b in zip(state(net, optimizer), state(eager_net, eager_opt))), fit
        assert saved["a", id(optimizer)]["state"][0]["step"].item() == 7  # client a's 4 + 3 steps
        # fit 1: 5 eager, 5 captured, 5 and 3 seen; fit 2 (fresh state) replays both; fit 3 (a's state copied in)
        # replays 5, 5 and captures 3; fit 4 (fresh) replays
        assert runner.counts == {"graphed_steps": 6, "eager_steps": 4, "captures": 2, "dropped": 0}


def test_server_knowledge_on_the_device_keeps_one_address_per_name_with_graphs_on():
    from types import SimpleNamespace

    from fl_lightning.client.context import ClientContext

    runner = StepGraphs(CheckedReruns("cpu"))
    first = runner.resident("logits", torch.ones(3, 3), torch.device("cpu"))
    source = torch.full((3, 3), 2.0)
    second = runner.resident("logits", source, torch.device("cpu"))
    assert second is first and torch.equal(first, source) and second is not source  # refilled, never an alias
    assert runner.resident("logits", torch.ones(4, 3), torch.device("cpu")) is not first  # another shape
    assert runner.resident("available", torch.ones(3, 3), torch.device("cpu")) is not first  # another name
    # through the client's context: the kept copy, unless the client's fits run later (the batched executor),
    # after the next client's update would have refilled it
    ctx = ClientContext.__new__(ClientContext)
    ctx._data = SimpleNamespace(x=torch.zeros(1))
    ctx.loop = SimpleNamespace(graphs=runner, fits_run_later=False)
    assert ctx.on_device("logits", source) is first
    ctx.loop.fits_run_later = True
    assert ctx.on_device("logits", source) is source and torch.equal(first, source)


def test_beyond_capacity_every_graph_is_dropped_at_once():
    """Freeing one graph clears the capture stream's cuBLAS workspace that the others use: all go together."""
    shapes = [2, 2, 3, 3, 4, 4, 2, 2, 2]
    runner = StepGraphs(CheckedReruns("cpu"), capacity=2)
    net, optimizer, _ = _fit(_cross_entropy(1.0), shapes, True, runner)
    eager_net, eager_opt, _ = _fit(_cross_entropy(1.0), shapes, False)
    # shapes 2 and 3 captured; capturing 4 drops both first; 2 is then new again: seen, captured, replayed
    assert runner.counts == {"graphed_steps": 1, "eager_steps": 8, "captures": 4, "dropped": 2}
    assert len(runner.graphs) == 2
    assert all(torch.equal(a, b) for a, b in zip(_state(net, optimizer), _state(eager_net, eager_opt)))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--runtime.accelerator", "cpu"], "needs a CUDA device"),
        (["--runtime.precision", "bf16-mixed"], "32-bit steps only"),
        (["--runtime.executor", "batched"], "runtime.executor sequential"),
    ],
)
def test_impossible_settings_are_refused_before_the_run(tmp_path, options, message):
    argv = ["--config", "recipes/quickstart.yaml", "--output_dir", str(tmp_path / "run"), "--runtime.cuda_graphs"]
    with pytest.raises((ConfigError, UserError), match=message):  # UserError: the recipe's own check
        fit_from_argv([*argv, "true", *options])
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow  # the flagship's ResNets on a CPU: half a minute
def test_the_flagship_replays_its_resnet_steps_as_run_eagerly(tmp_path, stand_in):
    """Paper 001 on CIFAR-10 shrunk (random pixels in the real pickle files): ResNet20s with batch norm, the
    auxiliary model as a training-mode teacher, augmentation, momentum carried from client to client."""
    from test_vision_data import write_cifar10

    write_cifar10(tmp_path / "data", per_batch=40, test=20)
    tiers = "[{name: strong, roles: [aux, target], count: 2}, {name: weak, roles: [aux]}]"
    shrink = ["--population.num_clients", "6", "--population.tiers", tiers, "--sampler.init_args.num_per_round", "3"]
    shrink += ["--training.local_steps", "4", "--data.init_args.data_dir", str(tmp_path / "data")]
    shrink += ["--data.init_args.download", "false", "--runtime.accelerator", "cpu"]
    shrink += ["--training.optimizer.init_args.foreach", "true"]  # torch's CUDA default; a CPU defaults to a loop
    eager, eager_ckpt = _run(tmp_path, "eager", "ondevice_kd_cifar10.yaml", *shrink)
    replayed, replayed_ckpt = _run(tmp_path, "graphs", "ondevice_kd_cifar10.yaml", *shrink, graphs_on=True)
    assert replayed["final"] == eager["final"]
    eager_tensors, replayed_tensors = tensors_by_path(eager_ckpt), tensors_by_path(replayed_ckpt)
    assert replayed_tensors.keys() == eager_tensors.keys()
    assert all(torch.equal(t, eager_tensors[k]) for k, t in replayed_tensors.items())
    counts = replayed["cuda_graphs"]
    assert counts["graphed_steps"] > counts["eager_steps"] > 0, counts


def test_a_batch_holding_other_things_than_tensors_runs_eagerly():
    @vmappable
    def step(module, batch, i):
        x, y, scale = batch
        return scale * F.cross_entropy(module(x), y)

    runner, net = StepGraphs(CheckedReruns("cpu")), _Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    runner.run_steps(net, optimizer, [(*b, 2.0) for b in _batches([4, 4])], step, None, None)
    assert runner.eager_reasons == {"a batch holds something other than tensors": 2}


def test_a_closure_holding_python_modules_and_cycles_is_keyed_without_recursing_forever():
    from torch.nn import functional  # a local: the step's closure holds the module itself

    loop = [1.0]
    loop.append(loop)  # a list that holds itself

    @vmappable
    def step(module, batch, i):
        x, y = batch
        return loop[0] * functional.cross_entropy(module(x), y) + 0 * len(loop) + 0 * (step is not None)

    runner, net = StepGraphs(CheckedReruns("cpu")), _Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    runner.run_steps(net, optimizer, _batches([4, 4, 4]), step, None, None)
    assert runner.counts["graphed_steps"] == 1 and runner.counts["captures"] == 1


def test_a_fit_started_after_a_drop_never_takes_a_kept_graph_of_another_fit():
    """Fit numbers are never reused. The first fit's third capture drops its first two and keeps the third; the
    next fit (another learning rate) must not match that graph by number (the stand-in raises if it does)."""
    runner, net = StepGraphs(CheckedReruns("cpu"), capacity=2), _Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    eager_net = _Net()
    eager_opt = torch.optim.SGD(eager_net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    for lr, shapes in ((0.1, [4, 4, 3, 3, 5, 5]), (0.05, [5, 5, 5])):
        for opt in (optimizer, eager_opt):
            opt.param_groups[0]["lr"] = lr
        _fit(_cross_entropy(1.0), shapes, True, runner, net, optimizer)
        _fit(_cross_entropy(1.0), shapes, False, None, eager_net, eager_opt)
    assert runner.counts["dropped"] == 2 and runner.counts["captures"] == 4
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), eager_net.state_dict().values()))


def test_a_parameter_frozen_between_fits_is_part_of_the_key():
    """A graph captured while the head trained would keep updating it after the strategy freezes it."""
    net, runner = _Net(), StepGraphs(CheckedReruns("cpu"))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    _fit(_cross_entropy(1.0), [4, 4, 4], True, runner, net, optimizer)
    net.head.requires_grad_(False)
    frozen = net.head.weight.detach().clone()
    _fit(_cross_entropy(1.0), [4, 4, 4], True, runner, net, optimizer)
    assert runner.counts["captures"] == 2
    assert torch.equal(net.head.weight, frozen)


class _Slotted:
    __slots__ = ("scale",)

    def __init__(self, scale):
        self.scale = scale


def test_slotted_objects_partials_and_numpy_numbers_in_a_closure_are_keyed_by_value():
    import functools

    import numpy as np

    holder, weights = _Slotted(1.0), [np.float32(1.0)]
    scaled = [functools.partial(torch.mul, other=1.0)]

    @vmappable
    def step(module, batch, i):
        x, y = batch
        loss = holder.scale * float(weights[0]) * F.cross_entropy(module(x), y)
        return scaled[0](loss)

    net, runner = _Net(), StepGraphs(CheckedReruns("cpu"))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    _fit(step, [4, 4, 4], True, runner, net, optimizer)
    holder.scale = 0.5  # each change in place is a new key (the stand-in would raise on a stale replay)
    _fit(step, [4, 4, 4], True, runner, net, optimizer)
    weights[0] = np.float32(0.25)
    _fit(step, [4, 4, 4], True, runner, net, optimizer)
    scaled[0] = functools.partial(torch.mul, other=2.0)
    _fit(step, [4, 4, 4], True, runner, net, optimizer)
    assert runner.counts["captures"] == 4 and runner.counts["graphed_steps"] == 4


def _freed(kept):
    """``kept`` as it is once its optimizer has been freed (on CUDA a graph does not keep its optimizer alive;
    on a CPU the stand-in's rerun holds the step, and with it the optimizer)."""

    class Gone:
        pass

    gone = Gone()
    owner = weakref.ref(gone)
    del gone
    assert owner() is None
    return dataclasses.replace(kept, owner=owner)


def test_an_optimizer_taking_a_freed_optimizer_s_id_gets_none_of_its_state_or_graphs():
    """Optimizers made per fit are freed and their ids reused: the state kept for the old one must not be
    installed into the new one, and no graph captured with the old state may replay (its memory goes)."""
    step, shapes = _cross_entropy(1.0), [5, 5, 5]
    runner = StepGraphs(CheckedReruns("cpu"))
    _, old, _ = _fit(step, shapes, graphs_on=True, runner=runner)
    assert runner.counts["captures"] == 1 and id(old) in runner.kept
    eager_net, eager_opt, _ = _fit(step, shapes, graphs_on=False, net=_Net())
    net = _Net()
    new = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=True)
    runner.kept[id(new)] = _freed(
        runner.kept.pop(id(old))
    )  # what CPython does when `old` is freed and `new` takes its id
    _fit(step, shapes, graphs_on=True, runner=runner, net=net, optimizer=new)
    assert set(new.state) == set(net.parameters())  # its own parameters' state only
    assert all(torch.equal(a, b) for a, b in zip(_state(net, new), _state(eager_net, eager_opt)))
    assert runner.counts["dropped"] == 1 and runner.kept[id(new)].owner() is new


def _swapped(value, old: int, new: int):
    """``value`` (a graph key) with the integer ``old`` (an object's id) replaced by ``new`` wherever it occurs."""
    if isinstance(value, tuple):
        return tuple(_swapped(v, old, new) for v in value)
    return new if value == old and type(value) is int else value


def test_a_graph_of_a_freed_optimizer_never_replays_for_one_that_took_its_id_with_a_state_of_its_own():
    """The same module, a new optimizer holding a loaded state and the freed one's id: its fit's key equals the
    old graphs' keys, and a replay would step the freed optimizer's state, not its own."""
    step, shapes = _cross_entropy(1.0), [5, 5, 5, 5]
    runner, net = StepGraphs(CheckedReruns("cpu")), _Net()
    old = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=True)
    runner.run_steps(net, old, _batches(shapes), step, 1.0, None)
    assert runner.counts["captures"] == 1
    new = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=True)
    new.load_state_dict(copy.deepcopy(old.state_dict()))  # a copy: load_state_dict keeps the tensors it is given
    eager_net = _Net()
    eager_net.load_state_dict(net.state_dict())
    eager_opt = torch.optim.SGD(eager_net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=True)
    eager_opt.load_state_dict(copy.deepcopy(old.state_dict()))
    # what CPython does when `old` is freed and `new` takes its id
    runner.kept[id(new)] = _freed(runner.kept.pop(id(old)))
    runner._fit_ids = {_swapped(key, id(old), id(new)): n for key, n in runner._fit_ids.items()}
    runner.run_steps(net, new, _batches(shapes, seed=2), step, 1.0, None)
    _eager_fit(eager_net, eager_opt, _batches(shapes, seed=2), step)
    assert all(torch.equal(a, b) for a, b in zip(_state(net, new), _state(eager_net, eager_opt)))
    assert runner.counts["dropped"] == 1
