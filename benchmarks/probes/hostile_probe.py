"""A fresh probe of hostile and broken inputs, as an adversarial user would try them: every case runs ``flrun`` in
its own process (6 GB of address space, a time limit) and is judged by what a user sees and what is left on disk.

Outcomes: ``handled`` (one sentence naming the problem, exit status 2, nothing of the user's touched; or the run
does the right thing), ``data lost`` (a file the user had changed or vanished), ``hang`` (past the time limit),
``traceback``, ``silent wrong`` (exit 0 where the input is wrong, or a wrong result without a word), ``unclear`` (a
refusal that is not one sentence naming the problem). The cases are other instances of the categories
tests/test_hostile_files.py and tests/test_bad_inputs.py hold, not the tests' own.

    python benchmarks/probes/hostile_probe.py             # every case, then the tally
    python benchmarks/probes/hostile_probe.py --only bomb # the cases whose name holds "bomb"
    python benchmarks/probes/hostile_probe.py --code DIR  # probe the fl_lightning of another checkout

Some cases mount a small tmpfs (a full disk); without the right to mount they say so and count as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
OUTCOMES = ("handled", "data lost", "hang", "traceback", "silent wrong", "unclear")
TIMEOUT = 180
TINY = {
    "rounds": 4,
    "eval_every": 1,
    "data": {
        "class_path": "fl_lightning.data.DigitsData",
        "init_args": {
            "partitioner": {
                "class_path": "fl_lightning.data.DirichletPartitioner",
                "init_args": {"alpha": 0.5, "min_partition_size": 10},
            }
        },
    },
    "models": {"global": {"builder": "digits_mlp", "args": {"hidden": 16}}},
    "population": {"num_clients": 6, "tiers": [{"name": "all", "roles": ["global"]}]},
    "strategy": {"class_path": "fl_lightning.strategies.FedAvg"},
    "training": {"optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}, "local_steps": 3},
    "runtime": {"progress": False},
}


@dataclass
class Result:
    rc: int | None
    err: str
    timed_out: bool

    def messages(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("flrun ")]


class Snapshot:
    """The files under a folder, to tell whether anything of the user's changed or vanished."""

    def __init__(self, root: Path):
        self.root = root
        self.files = self._read()

    def _read(self) -> dict[str, bytes]:
        return {str(p.relative_to(self.root)): p.read_bytes() for p in sorted(self.root.rglob("*")) if p.is_file()}

    def changed(self) -> bool:
        """Whether a file that was there changed or vanished (files added are not data lost)."""
        now = self._read()
        return any(now.get(name) != content for name, content in self.files.items())


class Lab:
    """A case's folder, a tiny recipe and ``flrun`` in a process of its own."""

    def __init__(self, folder: Path, code: Path):
        self.dir, self.code = folder, code

    def recipe(self, name: str = "r.yaml", text: str = "", **changes) -> Path:
        path = self.dir / name
        path.write_text(yaml.safe_dump({**TINY, **changes}) + text)
        return path

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        environ = {**os.environ, "PYTHONPATH": str(self.code), "WANDB_MODE": "offline", **(env or {})}
        return subprocess.Popen(
            [sys.executable, "-m", "fl_lightning", *args],
            cwd=self.dir,
            env=environ,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_bounded,  # noqa: PLW1509 - the probe starts processes from one thread
        )

    def flrun(self, *args: str, timeout: float = TIMEOUT, env: dict | None = None) -> Result:
        process = self.start(*args, env=env)
        try:
            _, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
            return Result(None, err, True)
        return Result(process.returncode, err, False)

    def run(self, name: str = "run", *extra: str, **changes) -> Path:
        out = self.dir / name
        result = self.flrun(
            "fit", "--config", str(self.recipe(f"{name}.yaml", **changes)), "--output_dir", str(out), *extra
        )
        if result.rc != 0:
            raise RuntimeError(f"the setup run failed: {result.err[-300:]}")
        return out


def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))


def judge(result: Result, says: tuple[str, ...], kept: Snapshot | None = None, expect: int = 2) -> tuple[str, str]:
    """The outcome of a command that must refuse (``expect`` 2) or succeed (0) without touching ``kept``."""
    if result.timed_out:
        return "hang", f"past {TIMEOUT} s"
    if "Traceback" in result.err:
        return "traceback", result.err.strip().splitlines()[-1][:160]
    if kept is not None and kept.changed():
        return "data lost", f"{kept.root} changed"
    if result.rc == 0 and expect != 0:
        return "silent wrong", "exit 0"
    if result.rc != expect:
        return "unclear", f"exit {result.rc}: {result.err.strip()[-160:]}"
    if expect == 0:
        return "handled", "ran"
    messages = result.messages()
    if len(messages) != 1 or len(messages[0]) > 700:
        return "unclear", f"{len(messages)} message lines, {sum(map(len, messages))} characters"
    missing = [word for word in says if word.lower() not in messages[0].lower()]
    return ("unclear", f"lacks {missing}: {messages[0][:160]}") if missing else ("handled", messages[0][:160])


CASES: list[tuple[str, str, Callable[[Lab], tuple[str, str]]]] = []


def case(kind: str, name: str):
    def register(fn):
        CASES.append((kind, name, fn))
        return fn

    return register


def bomb(levels: int, width: int = 10, key: str = "anchors") -> str:
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return f"{key}:\n" + "".join(f"  {line}\n" for line in lines)


def fit_refused(lab: Lab, recipe: Path, says: tuple[str, ...], *extra: str) -> tuple[str, str]:
    return judge(lab.flrun("fit", "--config", str(recipe), "--output_dir", str(lab.dir / "out"), *extra), says)


# ---------------------------------------------------------------------------------------------- data lost
def _foreign(lab: Lab, files: dict[str, bytes], *extra: str) -> tuple[str, str]:
    folder = lab.dir / "folder"
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    kept = Snapshot(folder)
    result = lab.flrun("fit", "--config", str(lab.recipe()), "--output_dir", str(folder), *extra)
    return judge(result, ("holds no flrun run",), kept)


case("data lost", "output_dir: a folder with a user's summary.json and results.csv")(
    lambda lab: _foreign(lab, {"summary.json": b'{"mine": 1}', "results.csv": b"a,b\n1,2\n"})
)
case("data lost", "output_dir: a folder holding a checkpoints/notes.tmp of the user's")(
    lambda lab: _foreign(lab, {"checkpoints/notes.tmp": b"draft"})
)
case("data lost", "output_dir: a TensorBoard folder, --resume auto")(
    lambda lab: _foreign(lab, {"events.out.tfevents.1.host": b"\x00" * 32}, "--resume", "auto")
)
case("data lost", "output_dir: a folder holding only config.yaml, --resume auto")(
    lambda lab: _foreign(lab, {"config.yaml": b"lr: 3\n"}, "--resume", "auto")
)
case("data lost", "output_dir: a folder with only .gitkeep")(lambda lab: _foreign(lab, {".gitkeep": b""}))
case("data lost", "output_dir: a Lightning folder with hparams.yaml and checkpoints/last.ckpt")(
    lambda lab: _foreign(
        lab, {"hparams.yaml": b"lr: 1\n", "checkpoints/last.ckpt": b"PK\x03\x04lightning"}, "--resume", "auto"
    )
)


@case("data lost", "output_dir: a folder whose metrics.csv links to a user's file")
def _linked_metrics(lab: Lab) -> tuple[str, str]:
    mine = lab.dir / "mine.csv"
    mine.write_text("precious\n")
    folder = lab.dir / "folder"
    folder.mkdir()
    (folder / "metrics.csv").symlink_to(mine)
    result = lab.flrun("fit", "--config", str(lab.recipe()), "--output_dir", str(folder))
    outcome = judge(result, ("holds no flrun run",))
    return ("data lost", "mine.csv changed") if mine.read_text() != "precious\n" else outcome


def _resume_other(lab: Lab, checkpoint: str, strip_marker: bool = False) -> tuple[str, str]:
    a, b = lab.run("A"), lab.run("B", seed=7)
    if strip_marker:
        (a / "run.json").unlink(missing_ok=True)
    kept = Snapshot(a)
    result = lab.flrun(
        "fit", "--config", str(lab.dir / "B.yaml"), "--output_dir", str(a), "--resume", str(b / checkpoint)
    )
    return judge(result, ("holds another run",), kept)


case("data lost", "--resume another run's previous.ckpt into a run directory")(
    lambda lab: _resume_other(lab, "checkpoints/previous.ckpt")
)
case("data lost", "--resume another run's last.ckpt into a run directory that lost its run.json")(
    lambda lab: _resume_other(lab, "checkpoints/last.ckpt", strip_marker=True)
)


@case("data lost", "--resume a copy of another run's checkpoint placed inside the run directory's folder")
def _copied_in(lab: Lab) -> tuple[str, str]:
    a, b = lab.run("A"), lab.run("B", seed=7)
    shutil.copy(b / "checkpoints/last.ckpt", a / "other.ckpt")
    kept = Snapshot(a)
    result = lab.flrun(
        "fit", "--config", str(lab.dir / "B.yaml"), "--output_dir", str(a), "--resume", str(a / "other.ckpt")
    )
    return judge(result, ("holds another run",), kept)


@case("data lost", "flrun data inspect into a user's folder holding partition.png")
def _inspect(lab: Lab) -> tuple[str, str]:
    folder = lab.dir / "plots"
    folder.mkdir()
    (folder / "partition.png").write_bytes(b"my own figure")
    kept = Snapshot(folder)
    result = lab.flrun("data", "inspect", "--config", str(lab.recipe()), "--output_dir", str(folder))
    return judge(result, ("holds no flrun run",), kept)


# ---------------------------------------------------------------------------------------------- time and memory
case("unbounded", "alias bomb, 9 levels of 10, under training in a recipe")(
    lambda lab: fit_refused(lab, lab.recipe(text=bomb(9, key="zzz")), ("aliases",))
)


@case("unbounded", "alias bomb, 8 levels of 12, in a base file")
def _base_bomb(lab: Lab) -> tuple[str, str]:
    (lab.dir / "common.yaml").write_text(bomb(8, 12))
    return fit_refused(lab, lab.recipe(text="base: common.yaml\n"), ("aliases", "common.yaml"))


@case("unbounded", "alias bomb in a sweep file's overrides")
def _sweep_bomb(lab: Lab) -> tuple[str, str]:
    sweep = _sweep(lab, extra=bomb(7).replace("anchors:", "overrides:\n  reference:", 1).replace("\n  a", "\n    a"))
    return judge(lab.flrun("sweep", "--config", str(sweep), "--output_dir", str(lab.dir / "s")), ("aliases",))


case("unbounded", "alias bomb as a command-line value")(
    lambda lab: fit_refused(
        lab,
        lab.recipe(),
        ("aliases",),
        "--reference",
        "{a: &a [1,1,1,1,1,1,1,1,1,1], b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], "
        "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], e: [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]}",
    )
)


@case("unbounded", "merge keys (<<) that multiply a mapping, 7 levels")
def _merge_bomb(lab: Lab) -> tuple[str, str]:
    lines = ["m0: &m0 {" + ", ".join(f"k{j}: [1, 2, 3]" for j in range(10)) + "}"]
    lines += [f"m{i}: &m{i} {{{', '.join(f'x{j}: *m{i - 1}' for j in range(10))}}}" for i in range(1, 7)]
    return fit_refused(lab, lab.recipe(text="zz:\n" + "".join(f"  {line}\n" for line in lines)), ("aliases",))


def _diamond(lab: Lab, files: int) -> Path:
    for i in range(files):
        (lab.dir / f"layer{i}.yaml").write_text(f"base: [layer{i + 1}.yaml, layer{i + 1}.yaml, layer{i + 1}.yaml]\n")
    (lab.dir / f"layer{files}.yaml").write_text(yaml.safe_dump(TINY))
    return lab.dir / "layer0.yaml"


@case("unbounded", "a diamond of 50 base files, three bases each, run end to end")
def _diamond_fit(lab: Lab) -> tuple[str, str]:
    return judge(lab.flrun("fit", "--config", str(_diamond(lab, 50)), "--output_dir", str(lab.dir / "o")), (), expect=0)


@case("unbounded", "a sweep whose base recipe is a diamond of 45 base files")
def _diamond_sweep(lab: Lab) -> tuple[str, str]:
    sweep = _sweep(lab, base=_diamond(lab, 45), extra="n_trials: 1\noverrides: {rounds: 1}\n")
    return judge(lab.flrun("sweep", "--config", str(sweep), "--output_dir", str(lab.dir / "s")), (), expect=0)


@case("unbounded", "a chain of 400 base files")
def _chain(lab: Lab) -> tuple[str, str]:
    for i in range(400):
        (lab.dir / f"c{i}.yaml").write_text(f"base: c{i + 1}.yaml\n")
    (lab.dir / "c400.yaml").write_text(yaml.safe_dump(TINY))
    return fit_refused(lab, lab.dir / "c0.yaml", ("64 levels",))


case("unbounded", "a flow mapping nested 50,000 deep")(
    lambda lab: fit_refused(lab, lab.recipe(text="zz: " + "{a: " * 50_000 + "1" + "}" * 50_000 + "\n"), ("deeper",))
)


@case("unbounded", "a block list nested 1,500 deep")
def _block_deep(lab: Lab) -> tuple[str, str]:
    text = "zz:\n" + "".join(" " * (2 * i + 2) + "-\n" for i in range(1500)) + " " * 3002 + "- 1\n"
    return fit_refused(lab, lab.recipe(text=text), ("deeper",))


case("unbounded", "a 12 MB recipe")(
    lambda lab: fit_refused(lab, lab.recipe(text="# " + "x" * 12_000_000 + "\n"), ("bytes",))
)


@case("unbounded", "rounds given a 200,000-element list (the message quotes it)")
def _long_value(lab: Lab) -> tuple[str, str]:
    recipe = lab.dir / "long.yaml"
    recipe.write_text(yaml.safe_dump({**TINY, "rounds": list(range(200_000))}, default_flow_style=True))
    return fit_refused(lab, recipe, ("rounds",))


case("unbounded", "--config /dev/zero")(lambda lab: fit_refused(lab, Path("/dev/zero"), ("not a regular file",)))
case("unbounded", "base: /dev/urandom")(
    lambda lab: fit_refused(lab, lab.recipe(text="base: /dev/urandom\n"), ("not a regular file",))
)


@case("unbounded", "--config a FIFO")
def _fifo_config(lab: Lab) -> tuple[str, str]:
    os.mkfifo(lab.dir / "recipe.fifo")
    return fit_refused(lab, lab.dir / "recipe.fifo", ("not a regular file",))


@case("unbounded", "flrun sweep --config a FIFO")
def _fifo_sweep(lab: Lab) -> tuple[str, str]:
    os.mkfifo(lab.dir / "sweep.fifo")
    return judge(lab.flrun("sweep", "--config", str(lab.dir / "sweep.fifo")), ("not a regular file",))


case("unbounded", "a command-line value nested 20,000 deep")(
    lambda lab: fit_refused(lab, lab.recipe(), ("deeper",), "--reference", "[" * 20_000 + "]" * 20_000)
)


# ---------------------------------------------------------------------------------------------- base files
def _base(lab: Lab, name: str, make: Callable[[Path], object], says: tuple[str, ...]) -> tuple[str, str]:
    make(lab.dir / name)
    return fit_refused(lab, lab.recipe("variant.yaml", text=f"base: {json.dumps(name)}\n"), says)


case("traceback", "base: a Latin-1 text file")(
    lambda lab: _base(lab, "latin.yaml", lambda p: p.write_bytes("rounds: 3 # é\n".encode("latin-1")), ("not a text",))
)
case("traceback", "base: a YAML list")(
    lambda lab: _base(lab, "list.yaml", lambda p: p.write_text("- 1\n- 2\n"), ("mapping",))
)
case("traceback", "base: a !!python/name tag")(
    lambda lab: _base(lab, "name.yaml", lambda p: p.write_text("rounds: !!python/name:os.system\n"), ("tag",))
)
case("traceback", "base: a !!python/object/new tag")(
    lambda lab: _base(
        lab, "new.yaml", lambda p: p.write_text("x: !!python/object/new:subprocess.Popen [[id]]\n"), ("tag",)
    )
)
case("traceback", "base: a dangling symbolic link")(
    lambda lab: _base(lab, "gone.yaml", lambda p: p.symlink_to(lab.dir / "nowhere.yaml"), ("does not exist",))
)


@case("traceback", "base: two links that point at each other")
def _mutual_links(lab: Lab) -> tuple[str, str]:
    (lab.dir / "b.yaml").symlink_to(lab.dir / "c.yaml")
    (lab.dir / "c.yaml").symlink_to(lab.dir / "b.yaml")
    return fit_refused(lab, lab.recipe("variant.yaml", text="base: b.yaml\n"), ("symbolic link",))


case("traceback", "base: a path through a file")(
    lambda lab: _base(lab, "afile/x.yaml", lambda p: (lab.dir / "afile").write_text("x"), ("does not exist",))
)
case("traceback", "base: an ftp:// URL")(lambda lab: _base(lab, "ftp://host/base.yaml", lambda p: None, ("URL",)))
case("traceback", "base: a name with a NUL byte")(lambda lab: _base(lab, "a\x00b.yaml", lambda p: None, ("file name",)))
case("traceback", "base: a 300-character name")(
    lambda lab: _base(lab, "n" * 300 + ".yaml", lambda p: None, ("cannot be read",))
)
case("traceback", "base: a number, not a file name")(
    lambda lab: fit_refused(lab, lab.recipe("variant.yaml", text="base: 42\n"), ("base",))
)
case("traceback", "--config with a !!python/object/apply tag")(
    lambda lab: fit_refused(lab, lab.recipe(text="x: !!python/object/apply:os.getcwd []\n"), ("tag",))
)


@case("traceback", "--config a recipe with a UTF-8 byte-order mark (must run)")
def _bom(lab: Lab) -> tuple[str, str]:
    recipe = lab.dir / "bom.yaml"
    recipe.write_bytes(b"\xef\xbb\xbf" + yaml.safe_dump(TINY).encode())
    return judge(lab.flrun("fit", "--config", str(recipe), "--output_dir", str(lab.dir / "o")), (), expect=0)


# ---------------------------------------------------------------------------------------------- the file system
case("traceback", "--output_dir under /proc/self")(
    lambda lab: fit_refused(lab, lab.recipe(), ("/proc",), "--output_dir", "/proc/self/flrun/run")
)
case("traceback", "--output_dir under /sys (read-only)")(
    lambda lab: fit_refused(lab, lab.recipe(), ("/sys",), "--output_dir", "/sys/flrun_run")
)


def _run_with(lab: Lab, name: str, make: Callable[[Path], object], says: tuple[str, ...]) -> tuple[str, str]:
    run = lab.run("run", "--stop_after", "2")
    target = run / name
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)
    make(target)
    kept = Snapshot(run)
    result = lab.flrun("fit", "--config", str(lab.dir / "run.yaml"), "--output_dir", str(run), "--resume", "auto")
    return judge(result, says, kept)


case("traceback", "run directory whose checkpoints is a file")(
    lambda lab: _run_with(lab, "checkpoints", lambda p: p.write_text("x"), ("checkpoints",))
)
case("traceback", "run directory whose summary.json is a directory")(
    lambda lab: _run_with(lab, "summary.json", lambda p: p.mkdir(), ("summary.json is a directory",))
)
case("traceback", "run directory whose partition.json is a FIFO")(
    lambda lab: _run_with(lab, "partition.json", os.mkfifo, ("partition.json", "not a regular file"))
)
case("traceback", "run directory whose config.yaml is a directory")(
    lambda lab: _run_with(lab, "config.yaml", lambda p: p.mkdir(), ("config.yaml is a directory",))
)


def _tmpfs(lab: Lab, size: str) -> Path | None:
    mount = lab.dir / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True, check=False
    )
    return mount if done.returncode == 0 else None


def _unmount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True, check=False)


def _full_disk(lab: Lab, size: str, body: Callable[[Path], tuple[str, str]]) -> tuple[str, str]:
    disk = _tmpfs(lab, size)
    if disk is None:
        return "skipped", "cannot mount a tmpfs here"
    try:
        return body(disk)
    finally:
        _unmount(disk)


@case("traceback", "a full disk at a fresh start (12 KiB)")
def _full_start(lab: Lab) -> tuple[str, str]:
    def body(disk: Path) -> tuple[str, str]:
        (disk / "filler").write_bytes(b"\x00" * 8 * 1024)
        return fit_refused(lab, lab.recipe(), ("No space left",), "--output_dir", str(disk / "run"))

    return _full_disk(lab, "12k", body)


@case("traceback", "a full disk in the middle of a personalized run, then a resume on the still-full disk")
def _full_resume(lab: Lab) -> tuple[str, str]:
    def body(disk: Path) -> tuple[str, str]:
        argv = [
            "fit",
            "--config",
            str(ROOT / "recipes/digits_lg_fedavg.yaml"),
            "--rounds",
            "30",
            "--output_dir",
            str(disk / "run"),
        ]
        first = judge(lab.flrun(*argv), ("No space left", "--resume auto"))
        if first[0] != "handled":
            return first
        return judge(lab.flrun(*argv, "--resume", "auto"), ("No space left",))

    return _full_disk(lab, "400k", body)


@case("traceback", "a full disk during a sweep")
def _full_sweep(lab: Lab) -> tuple[str, str]:
    def body(disk: Path) -> tuple[str, str]:
        sweep = _sweep(lab, extra="n_trials: 3\n")
        return judge(lab.flrun("sweep", "--config", str(sweep), "--output_dir", str(disk / "s")), ("full",))

    return _full_disk(lab, "200k", body)


case("traceback", "flrun report --output under /proc")(
    lambda lab: judge(lab.flrun("report", str(lab.run()), "--output", "/proc/self/x/report.md"), ("/proc",))
)


@case("traceback", "flrun report --output whose folder is a file")
def _report_file_parent(lab: Lab) -> tuple[str, str]:
    run = lab.run()
    (lab.dir / "reports").write_text("a file")
    return judge(lab.flrun("report", str(run), "--output", str(lab.dir / "reports/r.html")), ("reports",))


@case("traceback", "flrun report on a run whose summary.json is a directory")
def _report_summary_dir(lab: Lab) -> tuple[str, str]:
    run = lab.run()
    (run / "summary.json").unlink()
    (run / "summary.json").mkdir()
    return judge(lab.flrun("report", str(run), "--output", str(lab.dir / "r.md")), ("summary.json",))


@case("unbounded", "flrun report on a run whose metrics.csv is a FIFO")
def _report_fifo(lab: Lab) -> tuple[str, str]:
    run = lab.run()
    (run / "metrics.csv").unlink()
    os.mkfifo(run / "metrics.csv")
    result = lab.flrun("report", str(run), "--output", str(lab.dir / "r.md"))
    return judge(result, (), expect=0) if "metrics.csv" in result.err else ("silent wrong", "no warning")


# ---------------------------------------------------------------------------------------------- storage
def _sweep(lab: Lab, base: Path | None = None, extra: str = "", parameters: str | None = None) -> Path:
    base = base or lab.recipe("base.yaml", rounds=2)
    parameters = parameters or "  training.optimizer.init_args.lr: {type: float, low: 0.01, high: 0.2}\n"
    sweep = lab.dir / "sweep.yaml"
    sweep.write_text(f"base: {base}\nmetric: global/test_acc\nparameters:\n{parameters}{extra}")
    return sweep


def _storage(lab: Lab, url: str, says: tuple[str, ...], kept: Snapshot | None = None) -> tuple[str, str]:
    sweep = _sweep(lab, extra="n_trials: 1\n")
    return judge(
        lab.flrun("sweep", "--config", str(sweep), "--storage", url, "--output_dir", str(lab.dir / "s")), says, kept
    )


case("traceback", "--storage naming a directory")(
    lambda lab: _storage(lab, f"sqlite:///{lab.dir}", ("not a regular file",))
)
case("traceback", "--storage mysql:// without its driver")(
    lambda lab: _storage(lab, "mysql://me@db/studies", ("driver",))
)
case("traceback", "--storage redis://")(lambda lab: _storage(lab, "redis://localhost:6379", ("does not know",)))
case("traceback", "--storage ://")(lambda lab: _storage(lab, "://", ("not a database URL",)))


@case("silent wrong", "--storage a PNG file")
def _png_storage(lab: Lab) -> tuple[str, str]:
    (lab.dir / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 100)
    return _storage(lab, f"sqlite:///{lab.dir}/plot.png", ("not an SQLite database",), Snapshot(lab.dir / "plot.png"))


@case("silent wrong", "--storage a user's SQLite database holding a view and a table")
def _user_db(lab: Lab) -> tuple[str, str]:
    folder = lab.dir / "db"
    folder.mkdir()
    with sqlite3.connect(folder / "lab.db") as connection:
        connection.execute("CREATE TABLE samples (id INTEGER)")
        connection.execute("CREATE VIEW latest AS SELECT * FROM samples")
    return _storage(lab, f"sqlite:///{folder}/lab.db", ("not an Optuna study",), Snapshot(folder))


# ---------------------------------------------------------------------------------------------- signals and ranks
def _launched(lab: Lab, extra: list[str], act: Callable[[subprocess.Popen, Path], None]) -> Result:
    run = lab.dir / "run"
    recipe = lab.recipe(rounds=5000, eval_every=1000)
    process = lab.start("fit", "--config", str(recipe), "--output_dir", str(run), *extra)
    deadline = time.monotonic() + TIMEOUT
    while not (run / "checkpoints/last.ckpt").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    act(process, run)
    try:
        _, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        return Result(None, process.communicate()[1], True)
    return Result(process.returncode, err, False)


def _rank(launcher: int, rank: int) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                env = (entry / "environ").read_bytes().split(b"\0") if parent == launcher else []
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(entry.name)
    raise RuntimeError(f"no rank {rank} under {launcher}")


def _last_line(result: Result, says: tuple[str, ...], status: int) -> tuple[str, str]:
    if result.timed_out:
        return "hang", ""
    if "Traceback" in result.err or "gloo" in result.err:
        return "traceback", result.err.strip().splitlines()[0][:160]
    last = (result.err.strip().splitlines() or [""])[-1]
    missing = [word for word in says if word not in last]
    if result.rc != status or missing:
        return "unclear", f"exit {result.rc}, lacks {missing}: {last[:160]}"
    return "handled", last[:160]


case("traceback", "SIGTERM in the first rounds")(
    lambda lab: _last_line(
        _launched(lab, [], lambda p, run: p.send_signal(signal.SIGTERM)), ("SIGTERM", "--resume auto"), 143
    )
)
case("traceback", "SIGTERM to the launcher of 2 ranks")(
    lambda lab: _last_line(
        _launched(lab, ["--runtime.devices", "2"], lambda p, run: p.send_signal(signal.SIGTERM)),
        ("SIGTERM", "--resume auto"),
        143,
    )
)
case("traceback", "rank 0 of 2 killed with SIGKILL")(
    lambda lab: _last_line(
        _launched(lab, ["--runtime.devices", "2"], lambda p, run: os.kill(_rank(p.pid, 0), signal.SIGKILL)),
        ("rank 0 ended", "SIGKILL", "--resume auto"),
        137,
    )
)
case("traceback", "rank 1 of 2 ended by SIGTERM")(
    lambda lab: _last_line(
        _launched(lab, ["--runtime.devices", "2"], lambda p, run: os.kill(_rank(p.pid, 1), signal.SIGTERM)),
        ("rank 1 ended", "--resume auto"),
        143,
    )
)


# ---------------------------------------------------------------------------------------------- class paths
def _untrusted(lab: Lab, option: str, value: str, module: str, says: tuple[str, ...]) -> tuple[str, str]:
    marker = lab.dir / "imported"
    (lab.dir / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nclass Thing: pass\n")
    result = lab.flrun(
        "fit",
        "--config",
        str(lab.recipe()),
        "--output_dir",
        str(lab.dir / "o"),
        option,
        value,
        env={"PYTHONPATH": f"{lab.code}:{lab.dir}"},
    )
    outcome = judge(result, says)
    return ("silent wrong", "the module was imported (its code ran)") if marker.exists() else outcome


case("traceback", "--strategy naming an existing class of an untrusted module")(
    lambda lab: _untrusted(lab, "--strategy", "lab_strategy.Thing", "lab_strategy", ("FLRUN_TRUSTED_MODULES",))
)
case("traceback", "--sampler naming a missing class of an untrusted module")(
    lambda lab: _untrusted(lab, "--sampler", "lab_sampler.Nope", "lab_sampler", ("FLRUN_TRUSTED_MODULES",))
)
case("traceback", "--training.optimizer naming an untrusted module")(
    lambda lab: _untrusted(lab, "--training.optimizer", "lab_opt.Thing", "lab_opt", ("FLRUN_TRUSTED_MODULES",))
)
case("traceback", "--data as a class_path mapping into an untrusted module")(
    lambda lab: _untrusted(lab, "--data", "{class_path: lab_data.Thing}", "lab_data", ("FLRUN_TRUSTED_MODULES",))
)
case("traceback", "--logger naming an untrusted module")(
    lambda lab: _untrusted(lab, "--logger", "lab_logger.Thing", "lab_logger", ("lab_logger",))
)


# ---------------------------------------------------------------------------------------------- silent wrong
case("silent wrong", "a nested key twice (training.batch_size)")(
    lambda lab: fit_refused(lab, lab.recipe(text="zz: {batch_size: 8, batch_size: 32}\n"), ("twice",))
)


@case("silent wrong", "a key twice in a base file's strategy block")
def _base_twice(lab: Lab) -> tuple[str, str]:
    (lab.dir / "strategy.yaml").write_text(
        "strategy:\n  class_path: fl_lightning.strategies.FedAvg\n  class_path: fl_lightning.strategies.FedProto\n"
    )
    return fit_refused(lab, lab.recipe(text="base: strategy.yaml\n"), ("twice", "strategy.yaml"))


@case("silent wrong", "one sweep parameter given twice")
def _param_twice(lab: Lab) -> tuple[str, str]:
    parameters = (
        "  training.local_steps: {type: int, low: 1, high: 4}\n  training.local_steps: {type: int, low: 5, high: 9}\n"
    )
    return judge(lab.flrun("sweep", "--config", str(_sweep(lab, parameters=parameters))), ("twice",))


case("silent wrong", "a command-line mapping with a key twice")(
    lambda lab: fit_refused(lab, lab.recipe(), ("twice",), "--training", "{batch_size: 8, batch_size: 16}")
)


def _space(lab: Lab, parameter: str, says: tuple[str, ...]) -> tuple[str, str]:
    sweep = _sweep(lab, parameters=f"  {parameter}\n", extra="n_trials: 1\n")
    return judge(lab.flrun("sweep", "--config", str(sweep), "--output_dir", str(lab.dir / "s")), says)


case("silent wrong", "sweep choices given as a mapping")(
    lambda lab: _space(lab, "training.batch_size: {type: categorical, choices: {a: 8}}", ("choices",))
)
case("silent wrong", "sweep low: .nan")(
    lambda lab: _space(lab, "training.optimizer.init_args.lr: {type: float, low: .nan, high: 0.1}", ("finite",))
)
case("silent wrong", "sweep low: true")(
    lambda lab: _space(lab, "training.local_steps: {type: int, low: true, high: 4}", ("finite number",))
)
case("silent wrong", "sweep int step 0.5")(
    lambda lab: _space(lab, "training.local_steps: {type: int, low: 1, high: 4, step: 0.5}", ("whole number",))
)
case("silent wrong", "sweep log: 'yes'")(
    lambda lab: _space(
        lab, "training.optimizer.init_args.lr: {type: float, low: 0.01, high: 0.1, log: 'yes'}", ("log",)
    )
)
case("silent wrong", "sweep choices that are lists")(
    lambda lab: _space(lab, "training.batch_size: {type: categorical, choices: [[8], [16]]}", ("plain value",))
)
case("silent wrong", "sweep field misspelled (lo)")(
    lambda lab: _space(lab, "training.local_steps: {type: int, lo: 1, high: 4}", ("lo",))
)
case("silent wrong", "sweep float log with a step")(
    lambda lab: _space(
        lab, "training.optimizer.init_args.lr: {type: float, low: 0.01, high: 0.1, log: true, step: 0.01}", ("step",)
    )
)
case("silent wrong", "sweep int range ending at 2^60")(
    lambda lab: _space(lab, f"training.local_steps: {{type: int, low: 1, high: {2**60}}}", ("whole number",))
)


def _report(lab: Lab, damage: Callable[[Path], object], says: str) -> tuple[str, str]:
    run = lab.run()
    damage(run / "metrics.csv")
    result = lab.flrun("report", str(run), "--output", str(lab.dir / "r.html"))
    if result.rc != 0 or "Traceback" in result.err:
        return judge(result, (), expect=0)
    return ("handled", says) if says in result.err else ("silent wrong", "no warning")


case("silent wrong", "flrun report: metrics.csv cut in the middle of its last line")(
    lambda lab: _report(lab, lambda p: p.write_bytes(p.read_bytes()[:-7]), "cut short")
)
case("silent wrong", "flrun report: metrics.csv with its header only")(
    lambda lab: _report(lab, lambda p: p.write_text(p.read_text().splitlines(keepends=True)[0]), "cut short")
)


@case("silent wrong", "client-state files after three resumes of an LG-FedAvg run")
def _client_files(lab: Lab) -> tuple[str, str]:
    run = lab.dir / "lg"
    argv = [
        "fit",
        "--config",
        str(ROOT / "recipes/digits_lg_fedavg.yaml"),
        "--rounds",
        "8",
        "--eval_every",
        "4",
        "--output_dir",
        str(run),
    ]
    for stop in (2, 4, 6, 8):
        result = lab.flrun(*argv, "--stop_after", str(stop), *(["--resume", "auto"] if stop > 2 else []))
        if result.rc != 0:
            return judge(result, (), expect=0)
    program = (
        "import sys; from pathlib import Path; from fl_lightning.run.checkpoint import load_checkpoint; "
        "from fl_lightning.run.client_store import _versions; d = Path(sys.argv[1]) / 'checkpoints'; "
        "n = set().union(*({v.name(c) for c, v in _versions(load_checkpoint(d / k)['client_states']).items()} "
        "for k in ('last.ckpt', 'previous.ckpt'))); print(len({p.name for p in (d / 'clients').iterdir()} - n), len(n))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, str(run)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(lab.code)},
        check=False,
    )
    unnamed, named = done.stdout.split() if done.returncode == 0 else ("?", "?")
    return (
        ("handled", f"{named} files named, none other")
        if unnamed == "0"
        else ("silent wrong", f"{unnamed} unnamed files")
    )


case("silent wrong", "Dirichlet 0.01 over 60 clients with min_partition_size 0")(
    lambda lab: fit_refused(
        lab,
        lab.recipe(),
        ("without a training example",),
        "--population.num_clients",
        "60",
        "--data.init_args.partitioner",
        "{class_path: fl_lightning.data.DirichletPartitioner, init_args: {alpha: 0.01, min_partition_size: 0}}",
    )
)
case("silent wrong", "a local split that leaves one-example clients no training example")(
    lambda lab: fit_refused(
        lab,
        lab.recipe(),
        ("without a training example",),
        "--population.num_clients",
        "1000",
        "--data.init_args.partitioner",
        "fl_lightning.data.IidPartitioner",
        "--data.init_args.local_split",
        "[0.4, 0.6, 0.0]",
    )
)


# ---------------------------------------------------------------------------------------------- the probe
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases whose name holds this text")
    parser.add_argument("--code", default=str(ROOT), help="the checkout whose fl_lightning is probed")
    args = parser.parse_args()
    tally: Counter[str] = Counter()
    chosen = [c for c in CASES if not args.only or args.only in c[1]]
    for i, (kind, name, fn) in enumerate(chosen, 1):
        folder = Path(tempfile.mkdtemp(prefix="hostile-"))
        started = time.monotonic()
        try:
            outcome, note = fn(Lab(folder, Path(args.code)))
        except Exception as err:  # noqa: BLE001 - the probe itself failed to set the case up: say so, go on
            outcome, note = "skipped", f"setup failed: {err}"[:200]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        tally[outcome] += 1
        print(f"{i:3d} {outcome:>12}  [{kind}] {name} ({time.monotonic() - started:.0f} s): {note}", flush=True)
    print("\n" + ", ".join(f"{tally[o]} {o}" for o in (*OUTCOMES, "skipped") if tally[o] or o in OUTCOMES))
    print(f"{len(chosen)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
