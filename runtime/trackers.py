"""Experiment trackers beside TensorBoard: Weights & Biases and MLflow, one run of each per training run.

    trackers = Trackers.start(config, run_dir, resumed=False)   # rank 0; `logging.trackers` picks them
    trackers.log({"loss": 2.3}, step=1, prefix="train")
    trackers.finish({"final_loss": 1.2}, [run_dir / "loss.png"])

The run ids are kept in `run_dir/trackers.json`, so a resumed run continues the same wandb and MLflow
runs. The wandb run is the process's current run (`wandb.run`) and the MLflow run its active run, so the
Hugging Face Trainer's and Lightning's own integrations log into them too. wandb follows its own settings
(`WANDB_MODE=offline`, `WANDB_API_KEY`, `WANDB_ENTITY`); MLflow logs to `logging.mlflow_tracking_uri`, else
`MLFLOW_TRACKING_URI`. Both packages are optional (`pip install tigon[trackers]`).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tigon.runtime import planner
from tigon.runtime.config import ConfigError
from tigon.runtime.files import atomic_write_text

if TYPE_CHECKING:
    from tigon.runtime.config import RunConfig

logger = logging.getLogger("tigon.runtime")

IDS_FILE = "trackers.json"
STEP_KEY = "train/global_step"  # the x-axis of every wandb chart, as the HF Trainer's integration defines it


PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # tracker -> the module it needs


def check_trackers(config: RunConfig) -> None:
    """Fail before training when a configured tracker's package is missing."""
    import importlib.util

    missing = [
        name
        for name in config.logging.active_trackers
        if name in PACKAGES and not importlib.util.find_spec(PACKAGES[name])
    ]
    if missing:
        raise ConfigError(
            f"logging.trackers: {missing} need their packages: pip install {' '.join(missing)} (or tigon[trackers]), "
            "or remove them from logging.trackers"
        )


def _flat(values: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys, for MLflow parameters."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def planner_estimate(config: RunConfig) -> dict[str, Any] | None:
    """The memory planner's peak estimate for this run's setting (per GPU), or None where it cannot size it."""
    try:
        estimate = planner.estimate(planner.workload(config), planner.setting_of(config))
    except (ConfigError, OSError, ValueError, KeyError, AttributeError) as error:
        logger.debug("no planner estimate for the trackers: %s", error)
        return None
    return {
        "peak_bytes": estimate.peak,
        "peak_moment": estimate.moment,
        **{f"{k}_bytes": v for k, v in estimate.parts.items()},
    }


class Trackers:
    """The wandb and MLflow runs of one training run; every method is a no-op for a tracker not configured."""

    def __init__(self, wandb_run=None, mlflow_run_id: str | None = None):
        self.wandb_run = wandb_run
        self.mlflow_run_id = mlflow_run_id

    @classmethod
    def start(cls, config: RunConfig, run_dir: Path, resumed: bool) -> Trackers:
        """Open (or, when `resumed`, continue) the configured runs and log the config and the planner's estimate."""
        names = config.logging.active_trackers
        if "wandb" not in names and "mlflow" not in names:
            return cls()
        ids_file = run_dir / IDS_FILE
        ids = json.loads(ids_file.read_text()) if resumed and ids_file.is_file() else {}
        settings = json.loads(config.model_dump_json())
        estimate = planner_estimate(config)
        trackers = cls()
        if "wandb" in names:
            trackers.wandb_run = _start_wandb(config, run_dir, ids.get("wandb"), settings)
            ids["wandb"] = trackers.wandb_run.id
        if "mlflow" in names:
            trackers.mlflow_run_id = _start_mlflow(config, ids.get("mlflow"), settings)
            ids["mlflow"] = trackers.mlflow_run_id
        atomic_write_text(ids_file, json.dumps(ids) + "\n")
        if estimate is not None:
            trackers.summary({f"planner/{key}": value for key, value in estimate.items()})
        return trackers

    def log(self, metrics: dict[str, Any], step: int, prefix: str) -> None:
        """Finite numbers of `metrics` as `<prefix>/<name>` at optimizer step `step`."""
        numbers = {
            f"{prefix}/{name}": float(value)
            for name, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        }
        if not numbers:
            return
        if self.wandb_run is not None:
            self.wandb_run.log({**numbers, STEP_KEY: step})
        if self.mlflow_run_id is not None:
            import mlflow

            mlflow.log_metrics(numbers, step=step, run_id=self.mlflow_run_id)

    def summary(self, values: dict[str, Any]) -> None:
        """Values that describe the whole run (final metrics, the planner's estimate): wandb's summary, MLflow
        metrics (numbers) and tags (text)."""
        if self.wandb_run is not None:
            for key, value in values.items():
                self.wandb_run.summary[key] = value
        if self.mlflow_run_id is not None:
            import mlflow

            client = mlflow.MlflowClient()
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    if math.isfinite(value):
                        client.log_metric(self.mlflow_run_id, key, float(value))
                elif value is not None:
                    client.set_tag(self.mlflow_run_id, key, str(value)[:5000])

    def finish(self, summary: dict[str, Any], files: list[Path], failed: bool = False) -> None:
        """Log the final values and files (the loss plot, the summary), then end the runs."""
        if not failed:
            self.summary(summary)
        existing = [path for path in files if path.is_file()]
        if self.wandb_run is not None:
            for path in existing:
                if path.suffix == ".png":
                    import wandb

                    self.wandb_run.log({f"plots/{path.stem}": wandb.Image(str(path))})
                else:
                    self.wandb_run.save(str(path), base_path=str(path.parent), policy="now")
            self.wandb_run.finish(exit_code=1 if failed else 0)
            self.wandb_run = None
        if self.mlflow_run_id is not None:
            import mlflow

            for path in existing:
                mlflow.MlflowClient().log_artifact(self.mlflow_run_id, str(path))
            if (active := mlflow.active_run()) is not None and active.info.run_id == self.mlflow_run_id:
                mlflow.end_run("FAILED" if failed else "FINISHED")
            else:
                mlflow.MlflowClient().set_terminated(self.mlflow_run_id, "FAILED" if failed else "FINISHED")
            self.mlflow_run_id = None


def _start_wandb(config: RunConfig, run_dir: Path, run_id: str | None, settings: dict):
    import wandb

    run = wandb.init(
        project=config.logging.project,
        name=config.name,
        id=run_id,
        resume="allow" if run_id else None,
        dir=str(run_dir),
        config=settings,
        reinit="finish_previous",
    )
    run.define_metric(STEP_KEY)
    run.define_metric("*", step_metric=STEP_KEY, step_sync=True)
    return run


def _start_mlflow(config: RunConfig, run_id: str | None, settings: dict) -> str:
    import mlflow

    if config.logging.mlflow_tracking_uri is not None:
        mlflow.set_tracking_uri(config.logging.mlflow_tracking_uri)
    if mlflow.active_run() is not None:
        mlflow.end_run()
    if run_id is None:
        mlflow.set_experiment(config.logging.project)
    run = mlflow.start_run(run_id=run_id, run_name=None if run_id else config.name)
    if run_id is None:
        flat = _flat(settings)
        items = [(key, json.dumps(value) if not isinstance(value, str) else value) for key, value in flat.items()]
        for start in range(0, len(items), 100):  # MLflow's batch limit
            mlflow.log_params(dict(items[start : start + 100]))
        mlflow.log_dict(settings, "config.json")
    return run.info.run_id
