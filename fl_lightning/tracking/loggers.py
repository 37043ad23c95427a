"""Experiment loggers: the CSV file every run writes (``metrics.csv``), Weights & Biases and TensorBoard.

``--logger wandb`` (or ``tensorboard``) adds a logger with default options; the class-path form sets
them, e.g. ``{class_path: fl_lightning.tracking.WandbLogger, init_args: {project: fl, tags: [cifar]}}``.
The CSV logger is always there, the last of the run's loggers; ``--logger csv`` (the default) names it alone.
"""

from __future__ import annotations

import csv
import io
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from ..federation.errors import ConfigError
from ..federation.files import atomic_write
from . import metric_keys as keys

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # wandb is imported when the logger starts, not with the package
    from wandb.sdk.wandb_run import Run

WandbMode = Literal["online", "offline", "disabled", "shared"]
# every mode wandb.init accepts (its Settings.mode; a test holds this to the installed wandb): "dryrun" is an old
# name of "offline" and "run" of "online"
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")


class RunLogger:
    """Receives the config once, metrics per round and the summary at the end."""

    def start(self, output_dir: Path, name: str, config: dict[str, Any], state: dict[str, Any] | None) -> None:
        """``state`` is what :meth:`state_dict` returned before a resume (e.g. the W&B run id)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_evaluation(self, history: list[dict[str, Any]]) -> None:
        """Optional: after each evaluation, before any logger's :meth:`log_metrics` of that round, the row of
        every evaluated round so far (those before a resume included), each with its ``round``."""

    def log_files(self, paths: list[Path]) -> None:
        """Optional: store files (checkpoints) with the run."""

    wants_images = False

    def log_image(self, key: str, path: Path) -> None:
        """Optional: an image of the run (the partition chart)."""

    def finish(self, summary: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}


class WandbLogger(RunLogger):
    """Weights & Biases. Works offline with ``WANDB_MODE=offline`` (or ``mode: offline``).

    Args:
        project: W&B project.
        entity: W&B entity (user or team); the default entity when not given.
        group: run group, e.g. a recipe or a sweep study; the run name's recipe when not given.
        tags: tags of the run.
        mode: ``online``, ``offline`` or ``disabled``; ``WANDB_MODE`` decides when not given.
        log_checkpoints: upload the final checkpoint as an artifact.
    """

    def __init__(
        self,
        project: str = "fl-lightning",
        entity: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        mode: WandbMode | None = None,
        log_checkpoints: bool = False,
    ):
        self.project, self.entity, self.group = project, entity, group
        self.tags, self.mode, self.log_checkpoints = tags or [], mode, log_checkpoints
        self.run: Run | None = None
        check_wandb_mode(mode)  # here, before the run folder is written, not in wandb.init's 20-line trace

    @property
    def started(self) -> Run:
        """The run :meth:`start` began (the orchestrator starts the logger before it logs anything)."""
        if self.run is None:
            raise RuntimeError("the wandb logger is used before its start")
        return self.run

    def start(self, output_dir, name, config, state):
        try:
            import wandb
        except ImportError:  # pragma: no cover - wandb is a dependency
            raise ConfigError("the wandb logger needs the wandb package: pip install wandb") from None
        run_id = (state or {}).get("run_id")
        try:
            self.run = wandb.init(
                project=self.project,
                entity=self.entity,
                group=self.group or name.split("/")[0],
                tags=self.tags,
                name=name,
                config=config,
                dir=str(output_dir),
                mode=cast("WandbMode | None", self.mode or os.environ.get("WANDB_MODE")),  # wandb checks the latter
                id=run_id,
                resume="allow" if run_id else None,
                reinit="finish_previous",
            )
        except wandb.errors.Error as err:  # no API key, a rejected key, no connection: wandb's own 30-line trace
            reason = (str(err).strip() or type(err).__name__).split(". ")[0].splitlines()[0].rstrip(".")
            raise ConfigError(
                f"the wandb logger could not start a run ({reason}); log in with `wandb login` (or set "
                "WANDB_API_KEY), or log without an account with WANDB_MODE=offline (sync later with `wandb sync`)."
            ) from None

    def log_metrics(self, metrics, step):
        self.started.log(metrics, step=step)

    wants_images = True

    def log_image(self, key, path):
        import wandb
        from PIL import Image

        with Image.open(path) as image:  # read now: the file may be gone when W&B writes the logged row
            self.started.log({key: wandb.Image(image.copy())}, commit=False)

    def log_files(self, paths):
        if self.log_checkpoints and paths:
            import wandb

            artifact = wandb.Artifact(f"{self.started.id}-checkpoint", type="model")
            for path in paths:
                artifact.add_file(str(path))
            self.started.log_artifact(artifact)

    def finish(self, summary):
        for section in ("final", "best"):
            for key, value in summary.get(section, {}).items():
                self.started.summary[f"{section}/{key}"] = value
        for key, value in summary.get("comm", {}).items():
            if isinstance(value, (int, float)):
                self.started.summary[f"comm/{key}"] = value
        offline, folder = self.started.offline, self.started.settings.sync_dir
        self.started.finish()
        if offline:  # flrun silences wandb's own lines (WANDB_SILENT), its sync hint among them
            log.info("W&B run saved offline; upload it with: wandb sync %s", shown_path(folder))

    def state_dict(self):
        return {"run_id": self.run.id} if self.run is not None else {}


def check_wandb_mode(mode: str | None) -> None:
    """Raises ConfigError for a mode (``mode``, else the environment's ``WANDB_MODE``) that wandb.init refuses."""
    given, value = ("the wandb logger's mode", mode) if mode is not None else ("WANDB_MODE", os.getenv("WANDB_MODE"))
    if value is not None and value not in WANDB_MODES:
        valid = ", ".join(WANDB_MODES[:-1]) + f" or {WANDB_MODES[-1]}"
        unset = " (or unset it)" if mode is None else ""
        raise ConfigError(f"{given} is {value!r}, which W&B does not know; set it to {valid}{unset}.")


def shown_path(path: str | Path) -> str:
    """``path`` relative to the current folder when it lies below it (as the user gave the run's folder)."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


class TensorBoardLogger(RunLogger):
    """TensorBoard event files under ``<output_dir>/tensorboard`` (needs the ``tensorboard`` package)."""

    def start(self, output_dir, name, config, state):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "the tensorboard logger needs the tensorboard package: pip install 'fl-lightning[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))

    def log_metrics(self, metrics, step):
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def finish(self, summary):
        self.writer.close()


class CsvLogger(RunLogger):
    """``<output_dir>/metrics.csv``: one row per evaluated round, its columns the union of the rows' keys
    (``round`` first, then in the order they first appear), blank where a round lacks one.

    The file is rewritten whole from the run's history at each evaluation, never appended to, and replaced
    atomically, so a run cut at any moment leaves the previous file or the new one, never half a row; a
    resumed run's file holds the rounds before the resume as its checkpoint recorded them.
    """

    FILE = "metrics.csv"

    def __init__(self) -> None:
        self.path: Path | None = None

    def start(self, output_dir, name, config, state):
        self.path = Path(output_dir) / self.FILE

    def log_metrics(self, metrics, step):
        """Nothing: a round without evaluation has no row in the file, and an evaluated one comes whole to
        :meth:`log_evaluation`."""

    def log_evaluation(self, history):
        if self.path is None:
            raise RuntimeError("the csv logger is used before its start")
        atomic_write(self.path, csv_text(history))


def csv_text(rows: list[dict[str, Any]]) -> str:
    """The CSV text of ``rows``: a header of the union of their keys (``round`` first), then a line per row."""
    columns: dict[str, None] = {keys.ROUND: None}
    for row in rows:
        columns.update(dict.fromkeys(row))
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(columns))
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


_SHORTHANDS: dict[str, type[RunLogger]] = {"wandb": WandbLogger, "tensorboard": TensorBoardLogger}


def resolve_loggers(spec: str | RunLogger | list | None) -> list[RunLogger]:
    """Turns ``--logger`` (a name, a logger, or a list of either) into logger objects, the CSV logger last.

    The CSV logger is in every list once: ``csv`` (or ``none``, or nothing) names it alone, a CsvLogger given
    as an object is the one used, and a list resolved again (with a logger added) keeps its CSV logger last.
    """
    items = spec if isinstance(spec, list) else [spec]
    loggers: list[RunLogger] = []
    csv_logger: RunLogger | None = None
    for item in items:
        if item is None or item in ("csv", "none"):
            continue
        if isinstance(item, CsvLogger):
            csv_logger = csv_logger or item
        elif isinstance(item, RunLogger):
            loggers.append(item)
        elif isinstance(item, str) and item in _SHORTHANDS:
            loggers.append(_SHORTHANDS[item]())
        else:
            raise ConfigError(f"unknown logger {item!r}; use csv, wandb, tensorboard or a class_path to a RunLogger.")
    return [*loggers, csv_logger or CsvLogger()]
