"""runtime.executor batched: clients of one architecture trained as one vmapped computation.

Batched and sequential runs of the same recipe and seed must give every client and the server the same
weights to float tolerance (vmapped convolutions use other kernels, so not bit for bit; each tensor within a
relative L2 distance, ``L2_RTOL`` below), and the summary
must say how many fits really ran batched, so that a test cannot pass by silently running sequentially.
The same holds in lockstep (``runtime.lockstep``: every client of a group in every step, batches padded),
whose summary must show padded steps and none by shape.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_resumed_equals, marked_beyond

from fl_lightning.cli.commands import fit_from_argv
from fl_lightning.client.batched.fits import _ALONE
from fl_lightning.federation.errors import ConfigError
from fl_lightning.run.checkpoint import load_checkpoint
from fl_lightning.run.client_store import load_client_states

ROUNDS = "2"


@pytest.fixture(autouse=True)
def _full_float32_on_cuda():
    """On a GPU, convolutions default to TF32 (10-bit mantissa): batched (grouped) and sequential convolutions
    then differ by about 1e-3, which says nothing about batching. Compare in full float32 there."""
    settings = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = settings


ROOT = Path(__file__).resolve().parents[1]
BATCH_NORM_CNN = '{"global": {"builder": "digits_cnn", "args": {"batch_norm": true}}}'
BATCH_NORM_KD = (
    '{"aux": {"builder": "digits_cnn", "args": {"width": 0.25, "batch_norm": true}}, '
    '"target": {"builder": "digits_cnn", "args": {"batch_norm": true}}}'
)


def _tensors(obj, prefix=""):
    """Every tensor of a nested checkpoint entry, by a path name."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key], f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{prefix}/{i}")
    elif callable(getattr(obj, "state_dict", None)):
        yield from _tensors(obj.state_dict(), prefix)


# Batched (vmapped) and sequential steps round differently (other convolution kernels), and over a run those
# differences do not stay at float32's 1e-7: where two max-pooled values lie within a rounding of each other, the
# argmax, and with it where a gradient goes, flips, and later steps carry the flip on. On one CPU (AMD EPYC, AVX2)
# that put single weights of the quickstart's CNN 8.5e-5 apart after one round, 7.7 times an elementwise tolerance
# of 1e-5 + 1e-4 |w|, and FedAdam's and MergedCodist's 4e-4, where other CPUs passed. A flip moves few elements, so
# each tensor is compared whole: the L2 distance of the two runs' tensors must stay under 3e-3 of its norm, plus a
# floor of 1e-5 per element (root mean square) for tensors near zero (Adam's second moments). Those runs measured
# at most 2.3e-4 of the norm on weights; a batched step that loses one client's gradient once measured 7e-3 to
# 6e-2 (test_a_batched_step_that_loses_one_clients_gradient_fails_the_comparison), and 0.5 on FedAdam's moments.
L2_RTOL, RMS_ATOL = 3e-3, 1e-5


def _assert_close_tensor(name, actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), name
        return
    distance = (actual.double() - expected.double()).norm().item()
    bound = L2_RTOL * expected.double().norm().item() + RMS_ATOL * expected.numel() ** 0.5
    assert distance <= bound, f"{name}: L2 distance {distance:.3g} over the bound {bound:.3g} (relative L2 tolerance)"


def _assert_close_runs(sequential, weights, batched, batched_weights):
    """Every tensor of the two runs' checkpoints within the relative L2 tolerance above, and every final metric close:
    losses to 1e-3, accuracies to 0.01 (a flipped tie can flip a prediction: 1 of the digits' 359 test images)."""
    assert weights.keys() == batched_weights.keys() and weights
    for name, value in weights.items():
        _assert_close_tensor(name, batched_weights[name], value)
    for metric, value in sequential["final"].items():
        if "acc" in metric or "share" in metric:
            assert batched["final"][metric] == pytest.approx(value, abs=0.01), metric
        else:
            assert batched["final"][metric] == pytest.approx(value, rel=1e-3, abs=1e-5), metric


def _assert_in_lockstep(summary):
    """Every group step of the run held all its group's clients in one call, some of them with padded batches."""
    lockstep = summary["executor"]["lockstep"]
    assert summary["executor"]["batched_fits"] > 0 and "refused" not in lockstep, summary["executor"]
    assert lockstep["steps"] > 0 and lockstep["padded_client_steps"] > 0 and lockstep["by_shape_steps"] == 0, lockstep


def _run(tmp_path, recipe, executor, *extra):
    out = tmp_path / executor
    if executor == "lockstep":  # the batched executor, every client of a group in every step
        executor, extra = "batched", ("--runtime.lockstep", "true", *extra)
    argv = ["--config", str(ROOT / "recipes" / recipe), "--rounds", ROUNDS, "--eval_every", "1", "--seed", "3"]
    argv += ["--output_dir", str(out), "--runtime.progress", "false", "--runtime.executor", executor, *extra]
    summary = fit_from_argv(argv)
    checkpoint = load_checkpoint(out / "checkpoints" / "last.ckpt")
    states = dict(_tensors(checkpoint["strategy"], "server")) | dict(_tensors(load_client_states(checkpoint), "client"))
    return summary, states


@pytest.mark.parametrize(
    "recipe, extra",
    marked_beyond(
        1,
        [
            ("quickstart.yaml", ()),  # FedAvg, SGD with momentum, a CNN
            # two roles; the target's KD step runs the auxiliary teacher per client. Full KD weight from round 1: with
            # the recipe's ramp, round 2 is so ill-conditioned that even 1 vs 2 CPU threads in the sequential loop
            # move target weights by 4.4e-4, which says nothing about batching
            ("digits_ondevice_kd.yaml", ("--strategy.init_args.ramp_rounds", "0")),
            (
                "digits_fedadam.yaml",
                ("--training.optimizer_state", "per_client"),
            ),  # the server's Adam; client SGD state kept
            # a role name with a dot (not a valid module name: the batched step keys roles by position)
            (
                "quickstart.yaml",
                ("--models", '{"a.b": {"builder": "digits_cnn"}}', "--population.tiers", "[{roles: [a.b]}]"),
            ),
            # paper 001's one state per role, taken at each phase's start (the order-free form batched clients can run)
            (
                "digits_ondevice_kd.yaml",
                ("--strategy.init_args.ramp_rounds", "0", "--training.optimizer_state", "shared_per_phase"),
            ),
            # batch norm: running statistics are updated in place inside the vmapped forward (vmap's rule dropped
            # the update of a strided running mean: relative error ~1 before the statistics were kept contiguous)
            ("quickstart.yaml", ("--models", BATCH_NORM_CNN)),
            # batch norm in both roles: the teacher's (evaluation mode) statistics and every num_batches_tracked sit in
            # strided rows, the trained role's running statistics in blocks
            (
                "digits_ondevice_kd.yaml",
                ("--strategy.init_args.ramp_rounds", "0", "--training.optimizer_state", "shared_per_phase")
                + ("--models", BATCH_NORM_KD),
            ),
            # the optimizer rules' other branches, on whole parameter rows: clipping per client, Nesterov with
            # weight decay, Adam (with batch norm) and AdamW with each client's own moments and step count. Few
            # steps: Adam divides by the root of tiny second moments, which blows float noise up to the learning
            # rate where a gradient is ~0 (AdamW's moments of a bias before batch norm are pure noise)
            (
                "quickstart.yaml",
                ("--training.grad_clip_norm", "0.5", "--training.optimizer.init_args.nesterov", "true")
                + ("--training.optimizer.init_args.weight_decay", "0.001"),
            ),
            (
                "quickstart.yaml",
                ("--training.optimizer", "{class_path: torch.optim.Adam, init_args: {lr: 0.01, weight_decay: 0.01}}")
                + (
                    "--training.optimizer_state",
                    "per_client",
                    "--models",
                    BATCH_NORM_CNN,
                    "--training.local_steps",
                    "3",
                ),
            ),
            (
                "quickstart.yaml",
                ("--training.optimizer", "{class_path: torch.optim.AdamW, init_args: {lr: 0.01, weight_decay: 0.01}}")
                + ("--training.optimizer_state", "per_client", "--training.local_steps", "2"),
            ),
            # the server seeds its distillation from torch's random state after the clients' updates: the batched
            # executor must leave that state as the last client left it (the server's weights differed by ~0.1)
            ("digits_merged_codist.yaml", ()),
        ],
        pytest.mark.full,  # the rest of the methods: the release check (README, Tests)
    ),
)
def test_batched_and_sequential_runs_give_the_same_weights(tmp_path, recipe, extra):
    sequential, weights = _run(tmp_path, recipe, "sequential", *extra)
    batched, batched_weights = _run(tmp_path, recipe, "batched", *extra)
    assert batched["executor"]["batched_fits"] > 0  # the fits really ran as vmapped groups
    assert "executor" not in sequential and "lockstep" not in batched["executor"]
    _assert_close_runs(sequential, weights, batched, batched_weights)
    lockstep, lockstep_weights = _run(tmp_path, recipe, "lockstep", *extra)
    _assert_in_lockstep(lockstep)
    _assert_close_runs(sequential, weights, lockstep, lockstep_weights)


def test_a_batched_step_that_loses_one_clients_gradient_fails_the_comparison(tmp_path, monkeypatch):
    """The tolerance of the comparison above still sees a batching bug: the first client of each group losing its
    gradient in one step (one of about five steps of one of ten clients) fails it."""
    from fl_lightning.client.batched import group_training

    sequential, weights = _run(tmp_path, "quickstart.yaml", "sequential")
    gradients = group_training.GroupTraining._gradients

    def losing_one(self, *args, **kwargs):
        grads, rest = gradients(self, *args, **kwargs)
        if self.step_index == 2:
            for rows in grads.values():
                rows[0].zero_()
        return grads, rest

    monkeypatch.setattr(group_training.GroupTraining, "_gradients", losing_one)
    batched, batched_weights = _run(tmp_path, "quickstart.yaml", "batched")
    assert batched["executor"]["batched_fits"] > 0
    with pytest.raises(AssertionError, match="relative L2 tolerance"):
        _assert_close_runs(sequential, weights, batched, batched_weights)


def test_a_model_with_dropout_runs_sequentially_from_the_start_with_the_sequential_numbers(
    tmp_path, monkeypatch, caplog
):
    """Dropout draws each client's masks from the client's own random stream, which one vmapped step cannot: the
    executor sees the layers before it builds any group (no stacked state, no failed first step), says so once in
    the log and per fit in summary.json, and trains every fit as the sequential loop does, bit for bit."""
    from fl_lightning.client.batched import fits as batched_module

    model = ("--models", '{"global": {"builder": "fedhe_cnn0", "args": {"image_size": 8}}}')  # dropout 0.2, twice
    sequential, weights = _run(tmp_path, "quickstart.yaml", "sequential", *model)
    attempts, group_training = [], batched_module.GroupTraining
    monkeypatch.setattr(batched_module, "GroupTraining", lambda *a: attempts.append(1) or group_training(*a))
    with caplog.at_level("WARNING", logger=batched_module.__name__):
        batched, batched_weights = _run(tmp_path, "quickstart.yaml", "batched", *model)
    fits = 2 * 10  # 2 rounds x 10 clients
    why = (
        "random layers (global: features.3 (Dropout), global: features.8 (Dropout)): one vmapped step cannot draw "
        "from each client's own stream"
    )
    assert attempts == [] and batched["executor"] == {
        "mode": "batched",
        "batched_fits": 0,
        "sequential_fits": fits,
        "sequential_reasons": {why: fits},
    }
    warnings = [r.getMessage() for r in caplog.records if "random layer" in r.getMessage()]
    assert len(warnings) == 1 and "role 'global' has dropout" in warnings[0], warnings
    assert batched["final"] == sequential["final"]
    assert weights.keys() == batched_weights.keys() and weights
    assert all(torch.equal(batched_weights[name], value) for name, value in weights.items())


def test_a_personalized_method_keeps_each_clients_own_weights(tmp_path):
    """Standalone: per-client weights persist across rounds; batched clients must not mix them up."""
    base = ("--strategy", "fl_lightning.strategies.Standalone", "--training.local_steps", "3")
    _, weights = _run(tmp_path, "quickstart.yaml", "sequential", *base)
    personal = [n for n in weights if n.startswith("client/") and "weights" in n]
    assert len({n.split("/")[1] for n in personal}) >= 10  # every trained client has its own state
    for executor in ("batched", "lockstep"):
        batched, batched_weights = _run(tmp_path, "quickstart.yaml", executor, *base)
        assert batched["executor"]["batched_fits"] > 0
        for name in personal:
            _assert_close_tensor(name, batched_weights[name], weights[name])
    _assert_in_lockstep(batched)


@pytest.mark.parametrize(
    "recipe, extra",
    [
        ("digits_fedhe.yaml", ()),
        # SGD: with the recipe's Adam (lr 1e-3) on near-zero gradients of dead units, even 1 vs 2 CPU threads
        # in the sequential loop move Felo's feature sums by 5e-3 after one round, which says nothing of batching
        ("digits_felo.yaml", ("--training.optimizer", "torch.optim.SGD", "--training.optimizer.lr", "0.05")),
    ],
)
def test_steps_that_record_what_they_observe_train_batched(tmp_path, recipe, extra):
    """FedHe and Felo collect each step's training-mode logits (and features): their steps return them as a
    record, which reaches each client's own collector; the uploaded class statistics must match too (in lockstep,
    records cut to each client's real rows)."""
    sequential, weights = _run(tmp_path, recipe, "sequential", *extra)
    batched, batched_weights = _run(tmp_path, recipe, "batched", *extra)
    assert batched["executor"]["batched_fits"] > 0
    _assert_close_runs(sequential, weights, batched, batched_weights)
    lockstep, lockstep_weights = _run(tmp_path, recipe, "lockstep", *extra)
    _assert_in_lockstep(lockstep)
    _assert_close_runs(sequential, weights, lockstep, lockstep_weights)


# FedProto's CNNs meet a max-pool near-tie within 2 rounds: vmapped and plain convolutions round differently, and
# where two pooled values are one float apart the argmax, and with it where a gradient goes, flips (client 7's
# conv weights then differ by 3.5e-5). Without lockstep that client's step ran alone by plain autograd; in lockstep
# every step is vmapped. Its step's handling of padded rows is compared on MLP roles, which have no max pool.
FEDPROTO_MLPS = (
    "--models",
    (
        '{"cnn_small": {"builder": "digits_mlp", "args": {"hidden": 64, "depth": 1}}, '
        '"cnn_large": {"builder": "digits_mlp", "args": {"hidden": 64, "depth": 3}}, '
        '"mlp": {"builder": "digits_mlp", "args": {"hidden": 64, "depth": 2}}}'
    ),
)


# FedMD's recipe starts with 5 + 5 epochs of transfer learning, over which float differences grow chaotically:
# its sequential runs with 1 and with 2 CPU threads differ by up to 1.06 after 2 rounds; 1 + 1 epochs do not
FEDMD_SHORT = ("--strategy.init_args.public_epochs", "1", "--strategy.init_args.private_epochs", "1")


# FedPCL's frozen CNN backbones round differently vmapped (as FedProto's CNNs above): a projection unit at its ReLU's
# edge then flips, and the temperature of 0.07 summed over 15 prototype sets carries it on (one client's projection
# bias 1.5% apart after one round of training). Its steps are compared over frozen MLP backbones, which have no
# max pool (those runs give the same numbers bit for bit here).
FEDPCL_MLPS = (
    "--models",
    (
        '{"cnn_small": {"builder": "frozen_backbones", "args": {"backbones": [{"builder": "digits_mlp", '
        '"args": {"hidden": 64, "depth": 1}}]}}, '
        '"cnn_large": {"builder": "frozen_backbones", "args": {"backbones": [{"builder": "digits_mlp", '
        '"args": {"hidden": 64, "depth": 3}}]}}, '
        '"mlp": {"builder": "frozen_backbones", "args": {"backbones": [{"builder": "digits_mlp", '
        '"args": {"hidden": 64, "depth": 2}}]}}}'
    ),
)


@pytest.mark.parametrize(
    "recipe, extra",
    marked_beyond(
        1,
        [
            ("digits_dsfl.yaml", ()),
            ("digits_fedmd.yaml", FEDMD_SHORT),
            ("digits_fedgems.yaml", ()),
            ("digits_heterofl.yaml", ()),
            ("digits_fedgkt.yaml", ()),  # its server's logits for each of a client's examples
            ("digits_fd.yaml", ()),  # a teacher per label, its logits handed out as a record
            ("digits_fedproto.yaml", ()),  # prototypes per class, its representations handed out as a record
            ("digits_fedgen.yaml", ()),  # generated features and their labels in the batch
            # the server's prototypes per class; on MLP roles: a client's CNN meets a max-pool near-tie in round 2 (see
            # FEDPROTO_MLPS below), whose 1.5e-5 in its conv weights the server's 100 epochs carry into its prototypes
            ("digits_fedtgp.yaml", FEDPROTO_MLPS),
            ("digits_fedhkd.yaml", FEDPROTO_MLPS),  # global means and soft predictions per class, each role averaged
            ("digits_fpl.yaml", FEDPROTO_MLPS),  # cluster prototypes; the last epoch's representations as records
            ("digits_fedsa.yaml", FEDPROTO_MLPS),  # the anchors and the head's logits of them; prototypes as records
            ("digits_fedl2g.yaml", ("--strategy.init_args.warm_up_rounds", "0")),  # guiding vectors per class
            # every client's prototypes as anchors; frozen backbones under the projection
            ("digits_fedpcl.yaml", FEDPCL_MLPS),
            ("digits_fedntd.yaml", ()),  # one frozen global model that every client of the round distils from
            ("digits_ccvr.yaml", ()),  # FedAvg's steps, then every client's class moments and the calibration
        ],
        pytest.mark.full,  # the rest of the methods: the release check (README, Tests)
    ),
)
def test_distillation_steps_and_masked_logits_train_batched(tmp_path, monkeypatch, recipe, extra):
    """Steps closing over server knowledge per client (FedGEMS' teacher and public labels, FedGKT's teacher
    for each example, HeteroFL's absent classes) or taking their targets in the batch (DS-FL, FedMD's digest)
    run as vmapped groups."""
    from fl_lightning.client.batched import fits as batched_module

    sequential, weights = _run(tmp_path, recipe, "sequential", *extra)
    lone, run_part = [], batched_module.BatchedFit._run_part

    def counting(self, part):
        lone.append(len(part) == 1)
        return run_part(self, part)

    monkeypatch.setattr(batched_module.BatchedFit, "_run_part", counting)
    batched, batched_weights = _run(tmp_path, recipe, "batched", *extra)
    counts = batched["executor"]
    # every fit batched but a client alone in its group (HeteroFL's width tiers leave one now and then)
    assert counts["batched_fits"] > 0 and counts["sequential_fits"] == sum(lone), counts
    assert counts.get("sequential_reasons", {}) == ({_ALONE: sum(lone)} if sum(lone) else {}), counts
    _assert_close_runs(sequential, weights, batched, batched_weights)


@pytest.mark.parametrize(
    "recipe, extra",
    marked_beyond(
        1,
        [
            ("digits_dsfl.yaml", ()),  # soft targets in the batch: KL over the real rows
            ("digits_fedmd.yaml", FEDMD_SHORT),  # L1 to the consensus over the real rows
            ("digits_fedgems.yaml", ()),  # cross-entropy of labels it computes (real_labels), KL over the real rows
            ("digits_heterofl.yaml", ()),
            ("digits_fedgkt.yaml", ()),
            ("digits_fd.yaml", ()),  # a teacher per label: PAD labels indexed as class 0, left out of the mean
            ("digits_fedproto.yaml", FEDPROTO_MLPS),  # prototypes indexed by label, the distance over the real rows
            ("digits_fedgen.yaml", FEDPROTO_MLPS),  # labels of generated rows: PAD in padded rows (real_labels)
            ("digits_fedtgp.yaml", FEDPROTO_MLPS),  # as FedProto
            ("digits_fedhkd.yaml", FEDPROTO_MLPS),  # means indexed by label, both distances over the real rows
            ("digits_fpl.yaml", FEDPROTO_MLPS),  # clusters compared by label, both losses over the real rows
            ("digits_fedsa.yaml", FEDPROTO_MLPS),  # anchors indexed by label, the MSE and the CE over the real rows
            ("digits_fedpcl.yaml", FEDPCL_MLPS),  # padded rows neither anchors nor contrasted
            ("digits_fedpcl.yaml", (*FEDPCL_MLPS, "--strategy.init_args.loss", "prototype_ce")),  # nor in the CE's mean
            ("digits_feddf.yaml", ()),
            ("digits_periodic_codist.yaml", ()),
            ("digits_fedgh.yaml", ()),
            # guiding vectors indexed by label, the distance over the real rows; both rounds train
            ("digits_fedl2g.yaml", ("--strategy.init_args.warm_up_rounds", "0")),
            ("digits_lg_fedavg.yaml", ()),
            ("digits_weak_only.yaml", ()),
            ("digits_strong_only.yaml", ()),
            ("digits_fedntd.yaml", ()),  # the not-true classes gathered per row; PAD rows left out of the KL
        ],
        pytest.mark.full,  # the rest of the methods: the release check (README, Tests)
    ),
)
def test_every_batchable_method_gives_the_sequential_numbers_in_lockstep(tmp_path, recipe, extra):
    """Each method's steps with padded batches: every group step of all its clients, the same weights."""
    sequential, weights = _run(tmp_path, recipe, "sequential", *extra)
    lockstep, lockstep_weights = _run(tmp_path, recipe, "lockstep", *extra)
    _assert_in_lockstep(lockstep)
    _assert_close_runs(sequential, weights, lockstep, lockstep_weights)


def test_a_pure_step_over_each_client_s_own_reference_models_runs_alone_as_sequentially(tmp_path):
    """MOON's step is pure (CUDA graphs replay it) but closes over the client's frozen global and previous
    models. Sequentially one copy of each is refilled every fit; a fit the batched executor pauses runs
    after the next client's update would refill it, so there each client gets its own copies, and clients
    whose closures hold different modules are never grouped."""
    sequential, weights = _run(tmp_path, "digits_moon.yaml", "sequential")
    batched, batched_weights = _run(tmp_path, "digits_moon.yaml", "batched")
    assert batched["executor"]["batched_fits"] == 0 and batched["executor"]["sequential_fits"] > 0
    assert set(batched["executor"]["sequential_reasons"]) == {_ALONE}
    assert weights.keys() == batched_weights.keys() and weights
    for name, value in weights.items():
        assert torch.equal(batched_weights[name], value), name  # the sequential loop, bit for bit
    assert batched["final"] == sequential["final"]


def test_an_unmarked_step_runs_sequentially_with_the_same_numbers(tmp_path, monkeypatch):
    """A step not marked vmappable (FD's, its mark taken away: a strategy's step may have side effects) runs
    every fit through the sequential loop inside the batched executor, identical bit for bit."""
    from fl_lightning.strategies import fd

    monkeypatch.setattr(fd, "vmappable", lambda step: step)  # applied at each client_update: unmarked
    sequential, weights = _run(tmp_path, "digits_fd.yaml", "sequential")
    batched, batched_weights = _run(tmp_path, "digits_fd.yaml", "batched")
    counts = batched["executor"]
    assert counts["batched_fits"] == 0 and counts["sequential_fits"] > 0
    assert counts["sequential_reasons"] == {"the step is not marked pure (@vmappable)": counts["sequential_fits"]}
    assert batched["final"] == sequential["final"]
    for name, value in weights.items():
        assert torch.equal(batched_weights[name], value), name


@pytest.mark.full  # two FedPAC runs; the mechanism is tested above on FD's step in the default suite
def test_fedpac_s_frozen_part_steps_run_sequentially_with_the_reason_and_the_same_numbers(tmp_path):
    """FedPAC freezes the head, then the extractor, by leaving its gradient None; its steps are not marked pure, so the
    batched executor runs every fit as the sequential loop does and says why."""
    sequential, weights = _run(tmp_path, "digits_fedpac.yaml", "sequential")
    batched, batched_weights = _run(tmp_path, "digits_fedpac.yaml", "batched")
    counts = batched["executor"]
    assert counts["batched_fits"] == 0 and counts["sequential_fits"] > 0
    assert counts["sequential_reasons"] == {"the step is not marked pure (@vmappable)": counts["sequential_fits"]}
    assert batched["final"] == sequential["final"]
    for name, value in weights.items():
        assert torch.equal(batched_weights[name], value), name


@pytest.mark.parametrize("recipe", marked_beyond(1, ["digits_fml.yaml", "digits_fedkd.yaml", "digits_fedmrl.yaml"]))
def test_models_trained_together_run_one_client_at_a_time_and_the_summary_says_so(tmp_path, recipe):
    """FML's, FedKD's and FedMRL's fit_jointly trains two models per client outside loop.fit: the batched executor
    runs it as the sequential loop does, bit for bit, and counts each such fit with its reason. (FedKD's W_h and
    FedMRL's projector are modules of their own there, not the one instance the sequential loop reuses: a paused
    client's would be refilled by the next.)"""
    sequential, weights = _run(tmp_path, recipe, "sequential")
    batched, batched_weights = _run(tmp_path, recipe, "batched")
    fits = 2 * 15  # 2 rounds x 15 clients
    assert batched["executor"] == {
        "mode": "batched",
        "batched_fits": 0,
        "sequential_fits": fits,
        "sequential_reasons": {"models trained together (fit_jointly) train one client at a time": fits},
    }
    assert batched["final"] == sequential["final"]
    assert weights.keys() == batched_weights.keys() and weights
    assert all(torch.equal(batched_weights[name], value) for name, value in weights.items())


def test_fedetf_trains_beta_beside_the_model_one_client_at_a_time_and_personalises_the_same(tmp_path):
    """FedETF's beta trains with the model (fit_jointly) and its last round fine-tunes every client's ETF and
    projection: the batched executor runs all of it as the sequential loop does, bit for bit, and says why."""
    extra = ("--strategy.init_args.finetune_cycles", "1")
    sequential, weights = _run(tmp_path, "digits_fedetf.yaml", "sequential", *extra)
    batched, batched_weights = _run(tmp_path, "digits_fedetf.yaml", "batched", *extra)
    fits = 2 * 10 + 20  # 2 rounds x 10 sampled clients, then every client's personalisation
    assert batched["executor"]["sequential_reasons"] == {
        "models trained together (fit_jointly) train one client at a time": fits
    }
    assert batched["final"] == sequential["final"] and "personal/test_acc" in batched["final"]
    assert weights.keys() == batched_weights.keys() and weights
    assert all(torch.equal(batched_weights[name], value) for name, value in weights.items())


def test_fednh_trains_its_scale_beside_the_extractor_one_client_at_a_time(tmp_path):
    """FedNH's scale trains with the extractor (fit_jointly): the batched executor runs it as the sequential loop
    does, bit for bit, and says why."""
    sequential, weights = _run(tmp_path, "digits_fednh.yaml", "sequential")
    batched, batched_weights = _run(tmp_path, "digits_fednh.yaml", "batched")
    assert batched["executor"]["sequential_reasons"] == {
        "models trained together (fit_jointly) train one client at a time": 2 * 10
    }
    assert batched["final"] == sequential["final"]
    assert weights.keys() == batched_weights.keys() and weights
    assert all(torch.equal(batched_weights[name], value) for name, value in weights.items())


def test_fedktl_batches_its_first_rounds_fits_and_trains_model_and_projection_together_after(tmp_path):
    """FedKTL's round 1 is the ArcFace step alone, pure, so batched; from round 2 each client trains its model and
    the projection to the generator's latents together (fit_jointly), one client at a time, and the summary
    says so."""
    # the server's Adam barely moving: its first steps on F and the centroids are about +-lr whatever the
    # gradient's size, which turns the float noise of round 1's batched convolutions into differences of lr
    still = ("--strategy.init_args.server_epochs", "1", "--strategy.init_args.server_lr", "1e-9")
    sequential, weights = _run(tmp_path, "digits_fedktl.yaml", "sequential", *still)
    batched, batched_weights = _run(tmp_path, "digits_fedktl.yaml", "batched", *still)
    counts = batched["executor"]
    assert counts["batched_fits"] == 15 and counts["sequential_fits"] == 15, counts
    assert counts["sequential_reasons"] == {"models trained together (fit_jointly) train one client at a time": 15}
    _assert_close_runs(sequential, weights, batched, batched_weights)


def test_asynchronous_rounds_train_one_arrival_at_a_time_and_the_summary_says_so(tmp_path):
    sequential, weights = _run(tmp_path, "digits_fedhe_async.yaml", "sequential")
    batched, batched_weights = _run(tmp_path, "digits_fedhe_async.yaml", "batched")
    assert batched["executor"] == {"mode": "sequential", "why": "asynchronous rounds train one arrival at a time"}
    assert "executor" not in sequential
    assert batched["final"] == sequential["final"]
    assert weights.keys() == batched_weights.keys() and all(
        torch.equal(batched_weights[k], v) for k, v in weights.items()
    )


def test_batched_with_a_shared_optimizer_state_is_refused(tmp_path):
    """Refused before anything is written (in a folder of its own: runs/quickstart may hold the README's run)."""
    with pytest.raises(ConfigError, match="optimizer_state shared"):
        fit_from_argv(
            ["--config", str(ROOT / "recipes" / "quickstart.yaml"), "--runtime.executor", "batched"]
            + ["--training.optimizer_state", "shared", "--rounds", "1", "--output_dir", str(tmp_path / "run")]
        )
    assert not (tmp_path / "run").exists()


def test_auto_trains_sequentially_on_every_device_and_batched_refuses_a_shared_optimizer_state():
    """``auto`` is the measured best, sequential until a GPU measurement shows batching faster; ``batched`` is
    asked for, and refused with paper 001's optimizer_state shared (each client continues the previous one's)."""
    from fl_lightning.client import LocalTraining
    from fl_lightning.run.runtime import Runtime, resolve_executor

    shared, reset = LocalTraining(optimizer_state="shared"), LocalTraining()
    assert resolve_executor(Runtime(), reset) == "sequential"
    assert resolve_executor(Runtime(), shared) == "sequential"
    assert resolve_executor(Runtime(executor="batched"), reset) == "batched"
    with pytest.raises(ConfigError, match="optimizer_state shared_per_phase"):
        resolve_executor(Runtime(executor="batched"), shared)


def test_a_batched_run_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path):
    """shared_per_phase carries one optimizer state across phases and rounds: it must survive the checkpoint."""
    common = ["--config", str(ROOT / "recipes" / "digits_ondevice_kd.yaml"), "--rounds", "3", "--eval_every", "1"]
    common += ["--runtime.progress", "false", "--runtime.executor", "batched"]
    common += ["--training.optimizer_state", "shared_per_phase"]
    full = fit_from_argv([*common, "--output_dir", str(tmp_path / "full")])
    fit_from_argv([*common, "--output_dir", str(tmp_path / "cut"), "--stop_after", "1"])
    resumed = fit_from_argv([*common, "--output_dir", str(tmp_path / "cut"), "--resume", "auto"])
    assert resumed["final"] == full["final"]
    assert_resumed_equals(tmp_path / "cut", tmp_path / "full")  # every row, the optimizer state, the weights


def test_a_client_error_inside_a_batched_chunk_stops_the_run_as_sequentially(tmp_path):
    """An injected NaN update under divergence: stop raises the same one-sentence error in both modes."""
    from fl_lightning.run.robustness import Diverged

    errors = []
    for executor in ("sequential", "batched"):
        argv = ["--config", str(ROOT / "recipes" / "quickstart.yaml"), "--rounds", "2", "--runtime.progress", "false"]
        argv += ["--runtime.executor", executor, "--output_dir", str(tmp_path / executor)]
        argv += ["--faults", "{nan: 0.3}"]
        with pytest.raises(Diverged) as caught:
            fit_from_argv(argv)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and "an injected nan fault" in errors[0]


@pytest.mark.parametrize("per_example", [True, False])
def test_gathered_and_augmented_at_once_equals_client_by_client(per_example):
    """The batched executor gathers every client's batch in one indexing call and crops / flips them in one
    call with each client's own draws: bit for bit what each client's own stream gives, in the same order."""
    from fl_lightning.client.batched.group_training import gather, gatherable
    from fl_lightning.client.batches import batch_stream
    from fl_lightning.data.transforms import CropFlip

    x, y = torch.randn(40, 3, 8, 8), torch.randint(0, 10, (40,))
    pools = [torch.arange(0, 13), torch.arange(13, 31), torch.arange(31, 40)]
    augment = CropFlip(padding=2, per_example=per_example)

    def streams():
        return [batch_stream(x, y, idx, 4, 6, torch.Generator().manual_seed(k), augment) for k, idx in enumerate(pools)]

    expected = [list(s) for s in streams()]
    together = streams()
    assert gatherable(together)
    for step in range(6):
        parts = [s.next_parts() for s in together]
        for size in {len(chosen) for chosen, _ in parts}:  # one shape at a time, as the executor groups them
            members = [k for k, (chosen, _) in enumerate(parts) if len(chosen) == size]
            xb, yb = gather(together[0], [parts[k] for k in members])
            for j, k in enumerate(members):
                assert torch.equal(xb[j], expected[k][step][0]) and torch.equal(yb[j], expected[k][step][1])
    assert all(s.next_parts() is None for s in together)


def test_a_step_drawing_a_second_stream_runs_in_both_executors(tmp_path):
    """On-device KD's joint mode draws unlabeled batches with next() inside its step: not vmappable, so the
    batched executor runs the target phase sequentially with the client's restored state (the auxiliary
    phase, the default step, still runs batched)."""
    joint = ("--strategy.init_args.kd_mode", "joint", "--strategy.init_args.ramp_rounds", "0")
    _, weights = _run(tmp_path, "digits_ondevice_kd.yaml", "sequential", *joint)
    batched, batched_weights = _run(tmp_path, "digits_ondevice_kd.yaml", "batched", *joint)
    assert batched["executor"]["sequential_fits"] == 2 * 4  # 2 rounds x the 4 strong clients' joint fits
    assert batched["executor"]["sequential_reasons"] == {"the step is not marked pure (@vmappable)": 8}
    assert batched["executor"]["batched_fits"] > 0
    for name, value in weights.items():
        _assert_close_tensor(name, batched_weights[name], value)


def test_a_cancelled_client_thread_ends_whether_paused_or_not_started():
    """A chunk that stops (another client failed) cancels its clients; none may be left waiting."""
    from fl_lightning.client.batched.executor import _Coroutine
    from fl_lightning.client.batched.fit_request import FitRequest

    reached = []

    def job():
        reached.append("before" if loop.fit_runner is coroutine else "no runner")  # its fits go to the executor
        coroutine.pause(FitRequest("r", iter(()), None, None, 1, {}, (), {}, (None, None)))
        reached.append("after")  # never: the pause raises once cancelled

    loop = SimpleNamespace(fit_runner=None)
    coroutine = _Coroutine(job, fits=None, loop=loop)
    idle = _Coroutine(lambda: reached.append("idle ran"), fits=None, loop=loop)
    coroutine.advance()  # runs to its pause
    assert coroutine.request is not None and not coroutine.done
    assert loop.fit_runner is None  # the client holds the loop's fits during its turns only
    coroutine.cancel()
    idle.cancel()  # never started: it must not run its job
    assert coroutine.done and idle.done and reached == ["before"]
    assert not coroutine._thread.is_alive() and not idle._thread.is_alive()


def test_a_tensor_two_roles_share_is_reparametrized_once_and_given_back():
    """Two roles that share a submodule (and a module with tied weights): one name reaches every place the
    tensor is held, and after the step the module holds its original Parameter again."""
    from fl_lightning.client.batched.reparametrize import Reparametrization

    shared = torch.nn.Linear(2, 2)
    roles = torch.nn.ModuleDict({"role0": torch.nn.Sequential(shared), "role1": torch.nn.Sequential(shared)})
    original = shared.weight
    reparametrize = Reparametrization(roles)
    with reparametrize({"role1.0.weight": torch.ones(2, 2)}):
        assert torch.equal(roles["role0"][0].weight, torch.ones(2, 2))  # the other role sees it too
    assert shared.weight is original
    # given under both names (as reparametrized_loss gives a shared tensor), the original still comes back
    with reparametrize({"role0.0.weight": torch.ones(2, 2), "role1.0.weight": torch.ones(2, 2)}):
        assert torch.equal(shared.weight, torch.ones(2, 2))
    assert shared.weight is original
    with pytest.raises(KeyError), reparametrize({"role0.0.weight": torch.zeros(2, 2)}):  # an error inside
        raise KeyError("in the step")
    assert shared.weight is original


@pytest.mark.parametrize("contiguous", [(), [("w",), ("count",)], [("w",), ("b",), ("count",)]])
def test_the_flat_store_gives_views_and_moves_only_the_chosen_clients(contiguous):
    """Stacked tensors of several dtypes live in one flat buffer per label and dtype: views equal the tensors
    put in (contiguous where asked: vmap's batch norm needs it), a write through a view reaches the buffer,
    and a gather / scatter of clients 0 and 2 leaves client 1 alone."""
    from fl_lightning.client.batched.flat_store import FlatStore

    tensors = {
        ("w",): torch.arange(24.0).view(3, 2, 4),
        ("b",): torch.tensor([1.0, 2.0, 3.0]),  # one number per client: a [3] tensor
        ("count",): torch.tensor([5, 6, 7]),  # int64 (batch norm's num_batches_tracked): a buffer of its own
    }
    store = FlatStore(tensors, lambda key: "blocks" if key in contiguous else "rows")
    assert len(store.flats) == 2 + (0 < len(contiguous) < 3)  # float32 rows and / or blocks, int64
    views = store.views()
    index = torch.tensor([0, 2])
    for key, t in tensors.items():
        assert torch.equal(views[key], t) and views[key].dtype == t.dtype
        assert views[key].is_contiguous() or key not in contiguous
        assert store.views(store.select(1, 2))[key].is_contiguous() or key not in contiguous
        assert store.views(store.gather(index))[key].is_contiguous() or key not in contiguous
    views[("w",)][1, 0, 0] = -1.0  # in place through a view
    assert store.views()[("w",)][1, 0, 0] == -1.0
    store.views(store.select(1, 2))[("b",)].add_(10.0)  # clients 1 and 2 as views
    assert store.views()[("b",)].tolist() == [1.0, 12.0, 13.0]
    gathered = store.gather(index)
    chosen = store.views(gathered)
    assert torch.equal(chosen[("w",)], tensors[("w",)][[0, 2]])
    chosen[("w",)].zero_()
    chosen[("count",)].add_(1)
    store.scatter(gathered)
    after = store.views()
    assert after[("w",)][0].abs().sum() == 0 and after[("w",)][2].abs().sum() == 0
    assert after[("w",)][1, 0, 0] == -1.0 and after[("w",)][1, 1, 3] == 15.0  # client 1 untouched
    assert after[("count",)].tolist() == [6, 6, 8]


def test_parameter_and_moment_rows_line_up_so_a_rule_runs_on_whole_rows():
    """The trained parameters and a moment in rows of one layout: an update of the whole rows is the update of
    every tensor, and split gives each tensor's view of a row (as inside vmap) or of the rows."""
    from fl_lightning.client.batched.flat_store import FlatStore

    tensors = {
        ("p", "a"): torch.randn(4, 3, 2),
        ("p", "b"): torch.randn(4, 5),
        ("m", "a"): torch.ones(4, 3, 2),
        ("m", "b"): torch.full((4, 5), 2.0),
    }
    store = FlatStore(tensors, lambda key: "params" if key[0] == "p" else "moment")
    selection = store.gather(torch.tensor([1, 3]))
    params, moments = store.rows(selection, "params"), store.rows(selection, "moment")
    (kind,) = params
    assert params[kind].shape == (2, 11) and moments[kind].shape == (2, 11)
    params[kind].sub_(moments[kind], alpha=0.5)  # one whole-row update
    store.scatter(selection)
    after = store.views()
    for name, step in (("a", 0.5), ("b", 1.0)):
        expected = tensors[("p", name)].clone()
        expected[[1, 3]] -= step
        assert torch.allclose(after[("p", name)], expected)
    one_row = store.split("params", {kind: store.rows(store.select(0, 4), "params")[kind][2]})
    assert one_row[("p", "a")].shape == (3, 2) and torch.equal(one_row[("p", "b")], after[("p", "b")][2])


@pytest.mark.slow  # two opt-in settings together, four runs
def test_bf16_mixed_trains_batched_as_close_to_float32_as_sequentially(tmp_path):
    """bf16-mixed with batch norm runs batched (vmap's batch-norm rule rejected a bf16 input with float32
    statistics, so every fit fell back to the sequential loop), and in lockstep, and its weights are as near the
    32-true run's as the sequential bf16 run's are: bf16 rounding, not batching, sets the distance."""
    extra = ("--models", BATCH_NORM_CNN, "--training.local_steps", "3")
    _, full = _run(tmp_path / "full", "quickstart.yaml", "sequential", *extra)
    mixed = ("--runtime.precision", "bf16-mixed", *extra)
    _, sequential = _run(tmp_path / "mixed", "quickstart.yaml", "sequential", *mixed)
    batched, batched_weights = _run(tmp_path / "mixed", "quickstart.yaml", "batched", *mixed)
    assert batched["executor"]["batched_fits"] > 0 and batched["executor"]["sequential_fits"] == 0
    lockstep, lockstep_weights = _run(tmp_path / "mixed", "quickstart.yaml", "lockstep", *mixed)
    _assert_in_lockstep(lockstep)  # batch norm over the real rows of a float32 copy of the bf16 input

    def distance(weights):  # the largest difference from the 32-true weights, relative to the tensor's scale
        return max(
            ((weights[n] - v).abs().max() / v.abs().max().clamp(min=1e-6)).item()
            for n, v in full.items()
            if v.is_floating_point()
        )

    assert 0 < distance(batched_weights) <= 2 * distance(sequential)
    assert 0 < distance(lockstep_weights) <= 2 * distance(sequential)
