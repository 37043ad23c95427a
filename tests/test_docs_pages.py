"""Every command block and Python block of README.md, docs/tutorial.md and docs/howto/*.md runs as written, in
order, and the numbers a page quotes are what its commands give.

Each page runs in a fresh folder laid out as the root of a clone: copies of the repository's recipes/ and
sweeps/ (a page may save a file into sweeps/), a link to fl_lightning/ (so a page's ``export PYTHONPATH=.``
finds this tree's package, as in a clone), and, for every page but the README, the run that the README's
quickstart leaves in ``runs/quickstart/seed0``: a user who followed the README has it, and no page may
collide with it. The blocks run as ``tests/doc_blocks.py`` says (one terminal, ``WANDB_MODE=offline``).

A command that cannot run here is in its page's ``skipped`` list below, with the reason; every entry must
name a command the page shows. Nothing is shortened: a page's commands are the digits runs it shows, which
is why the pages that train are in the slow suite. The one page with nothing to run here is in the default
suite, and so is the check of every page's blocks and skip lists.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import ROOT, metrics_rows, read_summary
from doc_blocks import Terminal, command_words, commands, page_blocks, without_skipped
from local_slurm import why_not
from test_docs_images import results_are_recorded

NEEDS_ACCOUNT = "needs a W&B account online (the tests have none: WANDB_MODE=offline)"
PAPER_SCALE = "a paper-scale run: CIFAR-10 (flrun data fetch cifar10) and a GPU"
TESTS_THEMSELVES = "the test suite's own commands: CI runs them (.ci/run)"


@dataclass(frozen=True)
class Page:
    """A page: the commands not run here (command as the page writes it -> why), and what to check after."""

    skipped: dict[str, str] = field(default_factory=dict)
    check: Callable[[Path, str], None] | None = None
    slow: bool = True
    # commands run in another form here (command as the page writes it -> what runs); those of ``slurm`` need
    # the local Slurm cluster and are skipped, with its reason, where it cannot start
    stand_ins: dict[str, str] = field(default_factory=dict)
    slurm: dict[str, str] = field(default_factory=dict)
    # an optional extra the page's commands need (the module it installs): the page is skipped, saying so, without it
    needs: tuple[str, str] | None = None


# The vector instructions of PyTorch's CPU kernels (AVX2, AVX512, ...): float sums round in another order on
# another set, so a run's last digits depend on it. The pages quote what AVX2 kernels give and, where AVX-512
# ones give other digits, those too, in parentheses: "0.933 (0.936 with AVX-512)".
KERNELS = torch.backends.cpu.get_cpu_capability()
QUOTED_KERNELS = ("AVX2", "AVX512")
_NUMBER = r"(\d\.\d{%d})(?: \((\d\.\d{%d}) with AVX-512\))?"


def _quoted(page: str, pattern: str) -> list[str]:
    """The numbers ``pattern`` finds in ``page`` for this CPU's kernels. ``pattern`` is a regular expression in
    which ``#3`` (``#4``) stands for a number with 3 (4) decimals and, where the page gives one, the AVX-512
    kernels' own after it; on a CPU with other kernels than the pages quote, the test ends here, skipped."""
    regex = re.sub(r"#(\d)", lambda m: _NUMBER % (int(m[1]), int(m[1])), pattern)
    match = re.search(regex, " ".join((ROOT / page).read_text().split()))  # sentences as they read
    assert match, f"{page} no longer has the sentence {pattern!r}"
    if KERNELS not in QUOTED_KERNELS:
        pytest.skip(f"{page} quotes the numbers of AVX2 and AVX-512 kernels; this CPU's PyTorch kernels are {KERNELS}")
    quoted = match.groups()
    return [avx512 if KERNELS == "AVX512" and avx512 else avx2 for avx2, avx512 in zip(quoted[::2], quoted[1::2])]


def check_readme(folder: Path, log: str) -> None:
    run = folder / "runs/quickstart/seed0"
    for name in ("config.yaml", "metrics.csv", "summary.json", "partition.json", "checkpoints/last.ckpt"):
        assert (run / name).is_file(), f"the README says the quickstart writes {name}"
    # the README quotes seeds 1 and 2 as well, which no block runs as quoted: the test runs them
    terminal = Terminal.open(folder)
    for seed in (1, 2):
        terminal.bash(f"flrun fit --config recipes/quickstart.yaml --seed {seed} --output_dir runs/seed{seed}", "seed")
    seeds = (run, folder / "runs/seed1", folder / "runs/seed2")
    measured = [read_summary(path)["final"]["global/test_acc"] for path in seeds]
    assert list((folder / "runs/qs-seed1/wandb").glob("offline-run-*")), "--logger wandb logged no W&B run"
    assert (folder / "runs/inspect/quickstart_seed0.png").is_file() and (folder / "report.html").is_file()
    _check_the_end_of_run_example(read_summary(run))
    quoted = _quoted("README.md", r"\(#3 on a CPU; #3 and #3 with `--seed 1` and `--seed 2`")
    assert [f"{value:.3f}" for value in measured] == quoted


def _check_the_end_of_run_example(summary: dict) -> None:
    """The end of the quickstart as docs/reference/cli.md shows it (the time aside): the lines AVX2 kernels
    print, and on a CPU with AVX-512 ones, those lines with the numbers the page gives for them."""
    from fl_lightning.tracking.progress import run_summary

    page = (ROOT / "docs/reference/cli.md").read_text()
    shown = page.split("\nquickstart seed 0: ", 1)[1].split("```")[0].split("\n", 1)[1]
    printed = run_summary({**summary, "output_dir": "runs/quickstart/seed0"}).split("\n", 1)[1] + "\n"
    if KERNELS == "AVX512":
        sentences = " ".join(page.split())
        avx512 = re.search(r"AVX-512 ones print (best [\d.]+ \(round \d+\)) and (global/test_loss [\d.]+)\)", sentences)
        assert avx512, "docs/reference/cli.md no longer says what AVX-512 kernels print"
        shown = re.sub(r"best [\d.]+ \(round \d+\)", avx512[1], re.sub(r"global/test_loss [\d.]+", avx512[2], shown))
    elif KERNELS not in QUOTED_KERNELS:
        shown, printed = (re.sub(r"\d\.\d+", "#", text) for text in (shown, printed))  # the lines, not the digits
    assert shown == printed


def check_tutorial(folder: Path, log: str) -> None:
    runs = folder / "runs/tutorial"
    sweep = json.loads((folder / "runs/sweeps/digits_quickstart/sweep.json").read_text())
    assert sweep["trials"] == 6 and "Six trials run" in (ROOT / "docs/tutorial.md").read_text()
    # step 3's two runs share their data: the report draws their trade-off, as step 5 says
    assert "<h2>Trade-off: DigitsData, test_acc</h2>" in (runs / "report.html").read_text()
    _check_the_table_plan(log, "It lists the 63 runs (21 recipes x 3 seeds)", "docs/tutorial.md")
    _run_the_sweep_file_comment(folder)
    # the numbers last: on a CPU whose kernels the page does not quote, the test ends at the first of them
    skewed = read_summary(runs / "alpha0.1")["final"]["global/test_acc"]
    assert _quoted("docs/tutorial.md", r"final test accuracy drops to #3") == [f"{skewed:.3f}"]
    kd, alone = (read_summary(runs / name)["final"]["target/test_acc"] for name in ("ondevice_kd", "strong_only"))
    pattern = r"target model reaches #3 with distillation .* and #3 when the four"
    assert _quoted("docs/tutorial.md", pattern) == [f"{kd:.3f}", f"{alone:.3f}"]
    quoted = _quoted("docs/tutorial.md", r"\(validation accuracy #4; on the test set, #4\)")
    assert quoted == [f"{sweep['best_value']:.4f}", f"{sweep['best_test']['value']:.4f}"]
    results_are_recorded("report.png", folder)  # docs/img/report.png is the report of these runs


def _check_the_table_plan(log: str, sentence: str, page: str) -> None:
    """``flrun table paper-001/table-5 --dry_run`` printed the plan the page describes."""
    assert sentence in " ".join((ROOT / page).read_text().split())
    *total, recipes, seeds = (int(n) for n in re.findall(r"\d+", sentence))  # [63 runs] (21 recipes x 3 seeds)
    assert total in ([], [recipes * seeds]) and f"\n{recipes * seeds} runs: " in log
    planned = set(re.findall(r"^\s+\w+\s+(\w+) seed (\d+)\s", log, flags=re.MULTILINE))
    assert len({recipe for recipe, _ in planned}) == recipes and len({seed for _, seed in planned}) == seeds


def _run_the_sweep_file_comment(folder: Path) -> None:
    """The commands the shipped digits sweep file names in its header run too, after the tutorial's own study
    (its quick variant is a study of its own, not refused as a changed one)."""
    header = [line for line in (ROOT / "sweeps/digits_quickstart.yaml").read_text().splitlines() if line[:1] == "#"]
    shown = [line.lstrip("# ").split("  (")[0] for line in header if line.lstrip("# ").startswith("flrun sweep")]
    assert len(shown) == 2 and "--study_name quick -- --rounds 4" in shown[1]
    Terminal.open(folder).bash("\n".join(shown), "sweeps/digits_quickstart.yaml's header")
    assert json.loads((folder / "runs/sweeps/quick/sweep.json").read_text())["trials"] == 6


def check_paper_tables(folder: Path, log: str) -> None:
    assert "model:" in log or "models:" in log  # --print_config printed the recipe
    _check_the_table_plan(log, "the runs it needs (21 experiments x 3 seeds)", "docs/howto/paper_tables.md")


def check_new_method(folder: Path, log: str) -> None:
    assert "FD" in (folder / "runs/fd/config.yaml").read_text()
    assert 0.0 < read_summary(folder / "runs/fd")["final"]["personal/test_acc"] <= 1.0


def check_own_data(folder: Path, log: str) -> None:
    assert (folder / "runs/inspect/my_data_seed0.png").is_file()
    final = read_summary(folder / "runs/my_data/seed0")["final"]
    assert final["global/test_acc"] > 0.8 and "global/val_acc" in final  # real digits; the val split is there
    assert "fl_lightning.data.NpzData" in (folder / "runs/my_data/seed0/config.yaml").read_text()
    assert read_summary(folder / "runs/my_data/short")["rounds"] == 10
    # the table (breast cancer: its larger class is 63 %), the digits as images and as a datasets copy, the wine
    for run, least in (("my_table", 0.85), ("my_images", 0.8), ("my_hub", 0.8), ("my_wine", 0.8)):
        assert read_summary(folder / f"runs/{run}")["final"]["global/test_acc"] > least, run
    assert "my_wine.WineData" in (folder / "runs/my_wine/config.yaml").read_text()


def check_own_model(folder: Path, log: str) -> None:
    assert "my_models.tiny_cnn" in (folder / "runs/tiny_cnn/config.yaml").read_text()
    assert read_summary(folder / "runs/tiny_cnn")["final"]["global/test_acc"] > 0.5


def check_lightning_module(folder: Path, log: str) -> None:
    """The page says the run gives the built-in quickstart's numbers: the README's run is in the folder."""
    ours, builtin = read_summary(folder / "runs/lightning"), read_summary(folder / "runs/quickstart/seed0")
    assert ours["final"] == builtin["final"] and ours["best"] == builtin["best"]


def check_gpus_and_slurm(folder: Path, log: str) -> None:
    """Every way past one process the page shows ran the quickstart recipe to the README run's numbers."""
    builtin = read_summary(folder / "runs/quickstart/seed0")
    runs = ["runs/torchrun", "runs/two_machines"]
    runs += [run for run in ("runs/srun", "runs/chain") if (folder / run / "summary.json").exists()]
    for run in runs:
        assert read_summary(folder / run)["final"] == builtin["final"], run


def check_python_api(folder: Path, log: str) -> None:
    for run in ("runs/notebook/seed0", "runs/notebook/batch16", "runs/notebook/batch32"):
        assert read_summary(folder / run)["rounds"] == 5
    page = (ROOT / "docs/howto/python_api.md").read_text()
    said = re.search(r"print\(err\)  # (.*?); \.\.\.", page).group(1)
    assert said in log  # the error the page shows is the one printed


def check_sweep_on_validation(folder: Path, log: str) -> None:
    def trials(study: str) -> int:
        return json.loads((folder / "runs/sweeps" / study / "sweep.json").read_text())["trials"]

    assert (trials("my_sweep"), trials("quick")) == (20, 10)
    for seed in (0, 1, 2):
        assert read_summary(folder / f"runs/my_sweep_best/seed{seed}")["rounds"] == 40
    assert (folder / "report.html").is_file()


def check_privacy(folder: Path, log: str) -> None:
    """The accuracies, noise multipliers and epsilons the page quotes are its runs' own."""
    page = "docs/howto/privacy.md"
    text = " ".join((ROOT / page).read_text().split())

    def final(run: str, metric: str) -> str:
        return f"{read_summary(folder / run)['final'][metric]:.3f}"

    central = read_summary(folder / "runs/dp/eps8")["privacy"]
    local = read_summary(folder / "runs/dp/fd_local")["privacy"]
    assert read_summary(folder / "runs/dp/clip")["privacy"]["epsilon"] is None  # no noise: no guarantee
    said = re.search(r"noise multiplier of (\d\.\d{3}), spends epsilon (\d\.\d{3})", text).groups()
    assert said == (f"{central['noise_multiplier']:.3f}", f"{central['epsilon']:.3f}")
    assert (central["sampling_rate"], central["steps"], central["where"]) == (0.5, 20, "server")
    assert re.search(r"\(noise multiplier (\d\.\d{3}),", text)[1] == f"{local['noise_multiplier']:.3f}"
    assert local["epsilon"] <= 8.0 and local["where"] == "client"
    quoted = _quoted(page, r"final test accuracy of #3, the clipped one #3;.*? and reaches #3\.")
    assert quoted == [final(run, "global/test_acc") for run in ("runs/dp/none", "runs/dp/clip", "runs/dp/eps8")]
    quoted = _quoted(page, r"reach a test accuracy of #3 without privacy and #3 with it")
    assert quoted == [final(run, "personal/test_acc") for run in ("runs/dp/fd", "runs/dp/fd_local")]


def check_flower(folder: Path, log: str) -> None:
    fit = metrics_rows(folder / "runs/fedproto_fit")
    assert fit and fit[-1]["round"] == "3"
    for run in ("fedproto_simulation", "fedproto_loopback"):  # the page: the same metrics.csv, bit for bit
        assert metrics_rows(folder / "runs" / run) == fit, run
        flower = read_summary(folder / f"runs/{run}")["flower"]
        assert flower["supernodes"] == 2 and flower["client_state_bytes"] > 0
    assert (folder / "flower_report.html").is_file()


def check_wandb(folder: Path, log: str) -> None:
    for run in ("wandb_online/seed0", "wandb_offline/seed0", *(f"wandb_report/seed{s}" for s in (0, 1, 2))):
        (offline,) = (folder / "runs" / run / "wandb").glob("offline-run-*")
        assert f"upload it with: wandb sync {offline.relative_to(folder)}\n" in log
    (report_run,) = (folder / "report_wandb/wandb").glob("offline-run-*")
    assert f"upload it with: wandb sync {report_run.relative_to(folder)}\n" in log


INSTALL = {
    "python3 -m venv .venv": "makes the environment the tests run in",
    ". .venv/bin/activate": "enters the environment the tests run in",
    'pip install -e ".[dev]"': "installs the package: the tests run in the environment it made",
}

PAGES: dict[str, Page] = {
    "README.md": Page(
        skipped={
            **INSTALL,
            "optuna-dashboard sqlite:///runs/sweeps/digits_quickstart/study.db": "a web server that runs until "
            "stopped, from a package that is not a dependency",
            "flrun table paper-001/table-5 --n_jobs 8": "63 paper-scale runs: CIFAR-10, FEMNIST, Speech Commands "
            "and GPUs",
            "flrun data fetch cifar10 --data_dir data": "downloads CIFAR-10 over the network",
            "ruff check .": TESTS_THEMSELVES,
            "ruff format --check .": TESTS_THEMSELVES,
            "lint-imports": TESTS_THEMSELVES,
            "mypy": TESTS_THEMSELVES,
            "python -m pytest -q -n 2": TESTS_THEMSELVES,
            "python -m pytest -q -n 2 -m slow": TESTS_THEMSELVES,
        },
        check=check_readme,
    ),
    "docs/tutorial.md": Page(
        skipped=INSTALL,
        check=check_tutorial,
    ),
    "docs/howto/gpus_and_slurm.md": Page(
        skipped={
            "flrun fit --config recipes/ondevice_kd_cifar10.yaml --runtime.devices 4": f"4 ranks of {PAPER_SCALE}",
            "flrun table paper-001/table-5 --seeds 0 1 2 --n_jobs 8": "63 paper-scale runs on GPUs",
            "flrun sweep --config sweeps/ondevice_kd_cifar10.yaml --n_jobs 4": f"trials of {PAPER_SCALE}",
            "CUDA_VISIBLE_DEVICES=0,1 flrun sweep --config S --n_jobs 4": "S stands for your sweep file; two GPUs",
        },
        # R is the quickstart recipe and each command's run its own folder; 2 CPU ranks stand for 4 GPUs, two
        # agents on 127.0.0.1 (each in a folder of its own) for two machines
        stand_ins={
            "torchrun --nproc_per_node 4 --local-ranks-filter 0 -m fl_lightning fit --config R": "torchrun "
            "--nproc_per_node 2 --local-ranks-filter 0 -m fl_lightning fit --config recipes/quickstart.yaml "
            "--output_dir runs/torchrun",
            "torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint HOST:29500 "
            "--local-ranks-filter 0 -m fl_lightning fit --config R": "port=$((20000 + RANDOM % 20000)); agents=''; "
            "for machine in 0 1; do mkdir -p machine$machine; (cd machine$machine && torchrun --nnodes 2 "
            "--nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:$port --local-ranks-filter 0 -m "
            "fl_lightning fit --config ../recipes/quickstart.yaml --output_dir $PWD/../runs/two_machines) & "
            'agents="$agents $!"; done; for agent in $agents; do wait $agent; done',
        },
        slurm={
            "srun flrun fit --config recipes/ondevice_kd_cifar10.yaml --output_dir runs/kd_c10/seed0 --resume auto": (
                "srun -n 2 flrun fit --config recipes/quickstart.yaml --output_dir runs/srun --resume auto"
            ),
            "sbatch --array 1-4%1 job.sh": "printf '#!/bin/bash\\n#SBATCH --ntasks 2\\nsrun flrun fit --config "
            "recipes/quickstart.yaml --output_dir runs/chain --resume auto --stop_after $((SLURM_ARRAY_TASK_ID * 20))"
            "\\n' > job.sh && sbatch --wait --array 1-2%1 job.sh",
        },
        check=check_gpus_and_slurm,
    ),
    "docs/howto/flower.md": Page(
        skipped={
            'pip install -e ".[flower]"': "installs the package: the tests run in the environment it made",
            "flower-superlink --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key": (
                "a SuperLink for other machines, with your certificates"
            ),
            "flower-supernode --superlink superlink.example.org:8000 --root-certificates ca.crt --node-config "
            "'partition-id=0 num-partitions=2 fit-args=\"--data.init_args.data_dir /data\"'": "a site's machine",
            "flwr run . my-federation": "submits to your federation's SuperLink",
        },
        check=check_flower,
        needs=("flwr", 'pip install -e ".[flower]"'),
    ),
    "docs/howto/lightning_module.md": Page(check=check_lightning_module),
    "docs/howto/new_method.md": Page(check=check_new_method),
    "docs/howto/own_data.md": Page(check=check_own_data),
    "docs/howto/own_model.md": Page(check=check_own_model),
    "docs/howto/paper_tables.md": Page(
        skipped={
            "flrun fit --config recipes/ondevice_kd_cifar10.yaml": PAPER_SCALE,
            "flrun fit --config recipes/ondevice_kd_cifar10.yaml --seed $seed --output_dir runs/kd_c10/seed$seed": (
                PAPER_SCALE
            ),
            "flrun data inspect --config recipes/ondevice_kd_cifar10.yaml": "needs CIFAR-10's files "
            "(flrun data fetch cifar10)",
            "flrun table paper-001/table-5 --seeds 0 1 2 --n_jobs 8": "63 paper-scale runs on GPUs",
            "flrun table paper-001/table-5 -- --rounds 20": "63 runs on CIFAR-10, FEMNIST and Speech Commands",
        },
        check=check_paper_tables,
    ),
    "docs/howto/privacy.md": Page(
        skipped={'pip install -e ".[privacy]"': "installs the package: the tests run in the environment it made"},
        check=check_privacy,
    ),
    "docs/howto/python_api.md": Page(check=check_python_api),
    "docs/howto/sweep_on_validation.md": Page(
        skipped={
            "optuna-dashboard sqlite:///runs/sweeps/my_sweep/study.db": "a web server that runs until stopped, from "
            "a package that is not a dependency"
        },
        check=check_sweep_on_validation,
    ),
    "docs/howto/wandb.md": Page(
        skipped={
            "wandb login": NEEDS_ACCOUNT,
            "flrun report runs/wandb_report --output report.html --wandb my-team/fl-lightning": "saves a W&B Report: "
            + NEEDS_ACCOUNT,
        },
        check=check_wandb,
    ),
}


def test_every_page_of_the_manual_is_listed_and_its_skip_list_names_its_commands():
    pages = {"README.md", "docs/tutorial.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs/howto").glob("*.md"))}
    assert set(PAGES) == pages
    for name, page in PAGES.items():
        blocks = page_blocks((ROOT / name).read_text())
        shown = [words for block in blocks if block.language == "bash" for words in commands(block.code)]
        for command in [*page.skipped, *page.stand_ins, *page.slurm]:
            assert command_words(command) in shown, f"{name} shows no command {command!r} (its skip list is stale)"


@pytest.mark.parametrize("kernels, quoted", [("AVX2", ["0.933", "0.838"]), ("AVX512", ["0.936", "0.838"])])
def test_a_quoted_number_is_the_one_the_page_gives_for_this_cpu_s_kernels(monkeypatch, kernels, quoted):
    """The tutorial quotes "0.933 (0.936 with AVX-512) ... and 0.838": the AVX-512 figure where it gives one."""
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", kernels)
    assert _quoted("docs/tutorial.md", r"target model reaches #3 with distillation .* and #3 when the four") == quoted
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", "SVE256")  # an Arm CPU's: the pages quote none
    with pytest.raises(pytest.skip.Exception, match="this CPU's PyTorch kernels are SVE256"):
        _quoted("docs/tutorial.md", r"target model reaches #3")


def test_the_terminal_keeps_exports_skips_what_is_listed_and_fails_on_a_failing_command(tmp_path):
    terminal = Terminal.open(tmp_path)
    block = "export GREETING=hello\nfor n in 1 2; do\n  flrun fit --gpus $n   # needs a GPU\ndone"
    terminal.bash(without_skipped(block, {"flrun fit --gpus $n": "a GPU"}), "block 1")
    assert terminal.bash('echo "$GREETING"', "block 2") == "hello\n"  # one terminal: the export carried over
    assert terminal.python("import os; print(os.environ['WANDB_MODE'])", "block 3") == "offline\n"
    with pytest.raises(AssertionError, match="block 4 failed with exit status 1"):
        terminal.bash("true\nfalse\necho never", "block 4")


@pytest.fixture(scope="session")
def after_readme(tmp_path_factory) -> Path:
    """A folder holding what the README's quickstart leaves: ``runs/quickstart/seed0``."""
    folder = _clone_root(tmp_path_factory.mktemp("readme"))
    Terminal.open(folder).bash("flrun fit --config recipes/quickstart.yaml", "the README's quickstart")
    return folder / "runs/quickstart/seed0"


def _clone_root(folder: Path) -> Path:
    for name in ("recipes", "sweeps"):
        shutil.copytree(ROOT / name, folder / name)
    (folder / "fl_lightning").symlink_to(ROOT / "fl_lightning", target_is_directory=True)
    return folder


def _cases():
    for name, page in PAGES.items():
        yield pytest.param(name, marks=[pytest.mark.slow] if page.slow else [], id=name)


@pytest.mark.parametrize("name", _cases())
def test_the_page_runs_as_written(name, tmp_path, request):
    page = PAGES[name]
    if page.needs is not None:
        import importlib.util

        if importlib.util.find_spec(page.needs[0]) is None:
            pytest.skip(f"{name} needs the {page.needs[0]} package: {page.needs[1]}")
    folder = _clone_root(tmp_path)
    if name != "README.md" and page.slow:  # the pages with nothing to run need no quickstart run
        shutil.copytree(request.getfixturevalue("after_readme"), folder / "runs/quickstart/seed0")
    terminal = Terminal.open(folder)
    skipped, stand_ins = dict(page.skipped), dict(page.stand_ins)
    if page.slurm:  # the Slurm commands run on the local cluster, or are skipped saying why it cannot start
        reason = why_not()
        if reason is None:
            terminal.env["SLURM_CONF"] = request.getfixturevalue("slurm").env["SLURM_CONF"]
            stand_ins.update(page.slurm)
        else:
            skipped.update(dict.fromkeys(page.slurm, reason))
    for i, block in enumerate(page_blocks((ROOT / name).read_text()), start=1):
        where = f"{name}, block {i} ({block.language})"
        if block.file_name:
            terminal.save(block.file_name, block.code)
        elif block.language == "bash":
            terminal.bash(without_skipped(block.code, skipped, stand_ins), where)
        elif block.language == "python":
            terminal.python(block.code, where)
    if page.check:
        page.check(folder, "".join(terminal.log))
