"""Experiment tracking: every metrics.jsonl row also goes to TensorBoard, wandb and/or MLflow.

`logging.backends` picks any subset. Each backend gets the same metric names as metrics.jsonl
(numbers only), the run's config once at the start, and step = the training step.
- tensorboard: event files in RUN_DIR/tensorboard (`tensorboard --logdir runs`).
- wandb: offline, into RUN_DIR/wandb, unless the user configured it (WANDB_MODE, or
  WANDB_API_KEY for online); `wandb sync RUN_DIR/wandb/offline-run-*` uploads later.
- mlflow: a local file store in RUN_DIR/mlruns unless MLFLOW_TRACKING_URI says otherwise
  (mlflow-skinny is enough).
A step's answers shown (logging.samples_per_step) go to each as a table: TensorBoard's text panel
("samples"), a wandb Table ("samples"), an MLflow artifact samples/step_N.jsonl.
Each is an optional extra (`pip install 'rlsys[tensorboard]'` etc.); a missing one is named
before anything starts.
"""

from __future__ import annotations

import math
import os
from contextlib import suppress
from pathlib import Path

from rlsys.errors import RunFailed
from rlsys.observability.samples import COLUMNS, markdown_table

EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
_NOT_METRICS = {"step", "timestamp"}


class TrackingError(RunFailed):
    """A tracking backend cannot be used (its package is missing, or it refused to start)."""


def numeric_metrics(row: dict) -> dict[str, float]:
    """The row's finite numbers (bools excluded), keyed as in metrics.jsonl."""
    return {key: float(value) for key, value in row.items()
            if key not in _NOT_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}: the config as the dotted names a command line overrides."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _missing(backend: str) -> TrackingError:
    return TrackingError(f"logging.backends has {backend!r} but its package is not installed: "
                         f"pip install 'rlsys[{EXTRAS[backend]}]'")


def _require(module: str, backend: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise _missing(backend) from None


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config: dict, run_name: str):
        _require("tensorboard", "tensorboard")
        import yaml

        self.log_dir = run_dir / "tensorboard"
        # Markdown code block: TensorBoard's text panel keeps the YAML's layout.
        self.config_text = "```\n" + yaml.safe_dump(config, sort_keys=False) + "```"
        self.writer = None  # opened by the first rewind (the run's start) or log

    def rewind(self, step: int) -> None:
        """Steps >= `step` will be logged again (a resume, or a recovery in this process): a new event
        file whose first event tells TensorBoard's readers to drop every earlier event at step >= `step`
        (SummaryWriter's purge_step; EventAccumulator purges on its SessionLog.START)."""
        from torch.utils.tensorboard import SummaryWriter

        if self.writer is not None:
            self.writer.close()
        # A fresh run's first writer purges nothing: there is nothing to drop.
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=step or None)
        if step == 0:
            self.writer.add_text("config", self.config_text, global_step=0)
        self.writer.flush()

    def _writer(self):
        if self.writer is None:
            self.rewind(0)
        return self.writer

    def log(self, row: dict) -> None:
        writer = self._writer()
        for key, value in numeric_metrics(row).items():
            writer.add_scalar(key, value, global_step=row["step"])
        writer.flush()

    def log_samples(self, step: int, rows: list[dict]) -> None:
        self._writer().add_text("samples", markdown_table(rows), global_step=step)
        self._writer().flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, config: dict, run_name: str, project: str):
        wandb = _require("wandb", "wandb")
        configured = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else None)
        try:
            self.run = wandb.init(project=project, name=run_name, id=_wandb_id(run_name), resume="allow",
                                  dir=str(run_dir), config=config, mode=configured or "offline",
                                  settings=wandb.Settings(console="off", silent=True))
        except Exception as error:  # noqa: BLE001 - wandb raises many kinds (auth, network, settings)
            raise TrackingError(f"wandb did not start: {error}") from error

    def log(self, row: dict) -> None:
        self.run.log(numeric_metrics(row), step=row["step"])

    def rewind(self, step: int) -> None:
        """Nothing to do: wandb ignores a step below the last one it got (with a warning), so a step run
        again keeps its first values there. Online, `wandb.init(resume_from=...)` could fork the run."""

    def log_samples(self, step: int, rows: list[dict]) -> None:
        import wandb

        table = wandb.Table(columns=list(COLUMNS), data=[[row.get(c) for c in COLUMNS] for row in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowTracker:
    """Through MlflowClient (no process-global active run)."""

    def __init__(self, run_dir: Path, config: dict, run_name: str, project: str):
        _require("mlflow", "mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps the file store (no database needed; `mlflow ui --backend-store-uri
            # RUN_DIR/mlruns` reads it) behind this opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        # MLflow params are short strings, at most 100 per batch: the flat config in batches.
        params = [Param(key, str(value)[:500]) for key, value in flatten(config).items()]
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, row: dict) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, row["step"]) for key, value in numeric_metrics(row).items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def rewind(self, step: int) -> None:
        """Nothing to do: MLflow cannot delete a logged point, so a step run again has two values in the
        metric's history; its latest (the run's) is the later timestamp."""

    def log_samples(self, step: int, rows: list[dict]) -> None:
        import json

        # An artifact per step (MLflow's log_table needs pandas, which mlflow-skinny does not bring)
        self.client.log_text(self.run_id, "".join(json.dumps(row) + "\n" for row in rows),
                             f"samples/step_{step:08d}.jsonl")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _wandb_id(run_name: str) -> str:
    """A stable id per run directory name, so a resumed run continues the same wandb run."""
    allowed = "".join(c if c.isalnum() or c in "-_" else "-" for c in run_name)
    return allowed[:64] or "rlsys-run"


class Trackers:
    """The run's backends, as one: `log(row)` after each step, `close()` at the end."""

    def __init__(self, backends: list[str], run_dir: Path, config: dict, project: str, run_name: str):
        self.trackers = []
        try:
            for backend in dict.fromkeys(backends):  # each once, in the order given
                if backend == "tensorboard":
                    self.trackers.append(TensorBoardTracker(run_dir, config, run_name))
                elif backend == "wandb":
                    self.trackers.append(WandbTracker(run_dir, config, run_name, project))
                elif backend == "mlflow":
                    self.trackers.append(MLflowTracker(run_dir, config, run_name, project))
                else:
                    raise TrackingError(f"unknown logging backend {backend!r} (tensorboard, wandb, mlflow)")
        except BaseException:
            self.close()
            raise

    def log(self, row: dict) -> None:
        for tracker in self.trackers:
            tracker.log(row)

    def rewind(self, step: int) -> None:
        """Steps >= `step` run again (the run continues from a checkpoint): each backend drops what it
        can of what it got for them."""
        for tracker in self.trackers:
            tracker.rewind(step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A step's answers shown (rlsys/observability/samples.py), as a table in each backend."""
        if rows:
            for tracker in self.trackers:
                tracker.log_samples(step, rows)

    def close(self) -> None:
        for tracker in self.trackers:
            with suppress(Exception):  # closing one must not keep the others open
                tracker.close()
        self.trackers = []


def check_backends_installed(backends: list[str]) -> None:
    """Raise TrackingError naming the extra of the first backend whose package is missing."""
    import importlib.util

    for backend in backends:
        if backend in EXTRAS and importlib.util.find_spec(EXTRAS[backend]) is None:
            raise _missing(backend)
