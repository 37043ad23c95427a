"""Every digits recipe on a CUDA device: runs only where a GPU is (benchmarks/gpu_check.sh runs it there).

The CPU suite cannot see a tensor left on the wrong device: FedHe and Felo indexed the server's class
knowledge (kept on the CPU) with labels on the GPU and failed in their first step on a GPU, which only a
run on a GPU showed. Each recipe runs 2 rounds with each executor (the default, sequential, and batched) and
must end with finite metrics; the methods whose server keeps tensors also resume on the GPU (checkpoints load
on the CPU, so their server state must come back where a fresh run has it) and must equal the uninterrupted
run.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from fl_lightning.cli.commands import fit_from_argv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("digits_*.yaml")) + ["quickstart.yaml"]
# server state that meets client uploads: weights and Adam moments, class banks, headers, low-rank updates
SERVER_STATE = ["fedadam", "periodic_codist", "merged_codist", "heterofl", "fedkd", "fedgh", "fedhe", "felo"]
SERVER_STATE += ["velo", "fd", "fedgen", "fedtgp"]  # FedGen: its generator and Adam; FedTGP: its prototype network
SERVER_STATE += ["fedl2g", "fedmrl"]
SERVER_STATE += ["fedktl", "fedpcl"]  # FedKTL: its ETF, feature transformer and centroids; FedPCL: every client's set
SERVER_STATE += ["fedhkd"]  # FedHKD: each role's model and the class means of representations and soft predictions
SERVER_STATE += ["fedpac"]  # FedPAC: each role's extractor, the prototypes and every client's combined head


def _argv(recipe: str, out: Path, rounds: int) -> list[str]:
    argv = ["--config", str(ROOT / "recipes" / recipe), "--rounds", str(rounds), "--eval_every", str(rounds)]
    return argv + ["--output_dir", str(out), "--runtime.progress", "false", "--runtime.accelerator", "cuda"]


@pytest.mark.parametrize("executor", ["sequential", "batched"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_digits_recipe_runs_on_cuda(tmp_path, recipe, executor):
    summary = fit_from_argv([*_argv(recipe, tmp_path, 2), "--runtime.executor", executor])
    metrics = {k: v for k, v in summary["final"].items() if k.endswith(("test_acc", "test_loss"))}
    assert metrics, summary["final"]
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("method", SERVER_STATE)
def test_a_run_resumed_on_cuda_equals_the_uninterrupted_one(tmp_path, method):
    recipe = f"digits_{method}.yaml"
    fit_from_argv(_argv(recipe, tmp_path / "full", 3))
    fit_from_argv([*_argv(recipe, tmp_path / "cut", 3), "--stop_after", "2"])
    fit_from_argv([*_argv(recipe, tmp_path / "cut", 3), "--resume", "auto"])
    full, resumed = (json.loads((tmp_path / run / "summary.json").read_text())["final"] for run in ("full", "cut"))
    assert full and resumed == full


ADAMW = ["--training.optimizer", "{class_path: torch.optim.AdamW, init_args: {lr: 0.003, weight_decay: 0.0}}"]


@pytest.mark.parametrize(
    ("recipe", "extra"),
    [
        ("quickstart.yaml", []),
        ("digits_ondevice_kd.yaml", []),
        # Adam, one state per client; graphs run it in capturable mode, so the eager twin does too
        ("digits_fedhe.yaml", ["--training.optimizer.init_args.capturable", "true"]),
        ("digits_fedkd.yaml", []),  # models trained together (fit_jointly), W_h one instance (ctx.helper)
    ],
)
def test_cuda_graphs_replay_the_steps_of_the_eager_run(tmp_path, recipe, extra):
    """runtime.cuda_graphs on a real GPU: the captures succeed, most steps replay, and the run ends where the
    eager sequential run does (the replayed kernels are the eager step's; tolerance for cuDNN's choices)."""
    argv = [*_argv(recipe, tmp_path / "eager", 3), "--runtime.executor", "sequential", *extra]
    eager = fit_from_argv(argv)
    extra = [a for a in extra if a not in ("--training.optimizer.init_args.capturable", "true")]
    argv = [*_argv(recipe, tmp_path / "graphs", 3), "--runtime.executor", "sequential", *extra]
    replayed = fit_from_argv([*argv, "--runtime.cuda_graphs", "true"])
    counts = replayed["cuda_graphs"]
    assert counts["captures"] > 0 and not [r for r in counts["eager_reasons"] if "capture failed" in r], counts
    assert counts["graphed_steps"] > counts["eager_steps"], counts
    assert replayed["final"].keys() == eager["final"].keys()
    for key, value in eager["final"].items():
        assert replayed["final"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_cuda_graphs_run_adam_at_learning_rate_0_with_its_default_step(tmp_path):
    """The quickstart's cosine schedule ends at lr 0, where capturable Adam writes NaN: the graphed run
    replays rounds 1-2 in capturable mode, runs round 3 with the default step and stays finite, near the
    default Adam's run (float32 bias corrections)."""
    argv = [*_argv("quickstart.yaml", tmp_path / "graphs", 3), "--runtime.executor", "sequential", *ADAMW]
    replayed = fit_from_argv([*argv, "--runtime.cuda_graphs", "true"])
    eager = fit_from_argv(
        [*_argv("quickstart.yaml", tmp_path / "eager", 3), "--runtime.executor", "sequential", *ADAMW]
    )
    counts = replayed["cuda_graphs"]
    assert counts["graphed_steps"] > 0 and any(r.startswith("the learning rate is 0") for r in counts["eager_reasons"])
    assert replayed["final"]["global/test_loss"] == pytest.approx(eager["final"]["global/test_loss"], rel=1e-2)


def test_cuda_graph_steps_replay_and_a_masked_step_is_refused_on_a_gpu():
    """StepGraphs with real CUDA graphs on a small batch-norm net: a pure step is captured and replayed and
    ends where eager steps do; a step with a boolean mask (a host sync) is refused and runs eagerly."""
    import torch.nn.functional as F

    from fl_lightning.client.graphs.replay import CudaGraphs, StepGraphs
    from fl_lightning.client.steps import vmappable

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(6)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]

    def net_and_sgd():
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
        )
        net = net.to(device)
        return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    @vmappable
    def pure(module, batch, i):
        return F.cross_entropy(module(batch[0]), batch[1])

    @vmappable
    def masked(module, batch, i):
        x, y = batch
        return F.cross_entropy(module(x)[y > 0], y[y > 0])

    for step, replays in ((pure, True), (masked, False)):
        eager_net, eager_sgd = net_and_sgd()
        for i, batch in enumerate(batches):
            eager_sgd.zero_grad(set_to_none=True)
            step(eager_net, batch, i).backward()
            eager_sgd.step()
        net, sgd = net_and_sgd()
        runner = StepGraphs(CudaGraphs(device))
        runner.run_steps(net, sgd, batches, step, None, None)
        assert (runner.counts["graphed_steps"] == 4) is replays, runner.summary()
        for a, b in zip(net.state_dict().values(), eager_net.state_dict().values()):
            assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)
        if not replays:
            assert [r for r in runner.eager_reasons if "boolean mask" in r], runner.eager_reasons


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_finite_sees_one_bad_element_in_large_gpu_tensors(dtype):
    """The uplink check's fused infinity norm must carry NaN through CUDA's chunked maximum (several
    chunks of 65,536 elements per tensor, and a CPU tensor beside the GPU ones)."""
    from fl_lightning.run.robustness import all_finite

    tensors = [torch.randn(300_000, device="cuda", dtype=dtype), torch.randn(5, 7, device="cuda", dtype=dtype)]
    tensors.append(torch.randn(9))
    assert all_finite(tensors)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for k, position in ((0, 0), (0, 200_001), (0, 299_999), (1, 34), (2, 4)):
            spoiled = [t.clone() for t in tensors]
            spoiled[k].view(-1)[position] = bad
            assert not all_finite(spoiled), (bad, k, position)
