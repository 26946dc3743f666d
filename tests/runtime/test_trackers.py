"""`logging.trackers` for the torch, HF and Lightning trainers: TensorBoard, wandb (offline mode) and MLflow
(a local file store), the same runs for tigon's values and the frameworks' own."""

from __future__ import annotations

import json
import struct

import pytest

from tests.runtime.configs import adapter_config
from tests.runtime.worker_groups import tensorboard_tags
from tigon.runtime.trainer import train

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("wandb")

OWN_KEY = {"torch": None, "hf": "hf/loss", "lightning": "lightning/loss"}  # what the framework logs itself


@pytest.fixture
def offline_trackers(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    yield uri
    if mlflow.active_run() is not None:
        mlflow.end_run()


def wandb_offline_run(path) -> tuple[list[dict], dict]:
    """(history rows, summary) of an offline run's .wandb file: wandb's record log (blocks of 32 KiB, each record
    in chunks with a 7-byte header: CRC, length, FULL/FIRST/MIDDLE/LAST) of its protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending = path.read_bytes(), 7, b""  # the file starts with ':W&B', magic and version
    history, summary = [], {}
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            items = {"history": record.history.item, "summary": record.summary.update}.get(
                record.WhichOneof("record_type")
            )
            values = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items or []}
            if record.WhichOneof("record_type") == "history":
                history.append(values)
            else:
                summary.update(values)
    return history, summary


@pytest.mark.parametrize("trainer", ["torch", "hf", "lightning"])
def test_every_trainer_logs_config_metrics_plot_and_estimate_to_all_trackers(tmp_path, offline_trackers, trainer):
    logging = {"trackers": ["tensorboard", "wandb", "mlflow"], "mlflow_tracking_uri": offline_trackers}
    config = adapter_config(tmp_path, trainer, training={"max_steps": 3}, logging={**logging, "every_steps": 1})
    result = train(config)
    run_dir = tmp_path / f"run-{trainer}"

    client = mlflow.MlflowClient(offline_trackers)
    (run,) = client.search_runs([client.get_experiment_by_name("tigon").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == config.name
    assert run.data.params["training.max_steps"] == "3" and run.data.params["trainer"] == trainer
    history = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)]
    assert history == pytest.approx(result.losses)
    assert run.data.metrics["final_loss"] == pytest.approx(result.final_loss)
    assert run.data.metrics["planner/peak_bytes"] > 0 and "eval/loss" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"loss.png", "summary.json", "config.json"} <= artifacts
    if OWN_KEY[trainer]:
        assert OWN_KEY[trainer] in run.data.metrics

    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    history, summary = wandb_offline_run(next(wandb_run.glob("*.wandb")))
    assert [row["train/loss"] for row in history if "train/loss" in row] == pytest.approx(result.losses)
    assert summary["final_loss"] == pytest.approx(result.final_loss) and summary["planner/peak_bytes"] > 0
    assert any("plots/loss/path" in row for row in history)
    if OWN_KEY[trainer]:
        assert any(key.endswith(OWN_KEY[trainer]) for row in history for key in row), history
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert ids["mlflow"] == run.info.run_id and wandb_run.name.endswith(ids["wandb"])

    tags = tensorboard_tags(run_dir / "tensorboard")
    assert {"train/loss", "eval/loss"} <= tags
    if trainer != "torch":
        assert any(tag.endswith(OWN_KEY[trainer]) for tag in tags), tags


def test_a_tracker_without_its_package_fails_before_training(tmp_path, monkeypatch):
    from tigon.runtime import trackers
    from tigon.runtime.config import ConfigError

    monkeypatch.setitem(trackers.PACKAGES, "wandb", "tigon_absent_wandb")  # as if wandb were not installed
    config = adapter_config(tmp_path, "torch", logging={"trackers": ["tensorboard", "wandb"]})
    with pytest.raises(ConfigError, match=r"logging.trackers: \['wandb'\] need their packages: pip install wandb"):
        train(config)
    assert not (tmp_path / "run-torch" / "metrics.jsonl").exists()


def test_a_resumed_hf_run_continues_its_mlflow_and_wandb_runs(tmp_path, offline_trackers):
    logging = {"trackers": ["wandb", "mlflow"], "mlflow_tracking_uri": offline_trackers, "every_steps": 1}
    sections = {"checkpoint": {"every_steps": 2, "resume": True}, "logging": logging}
    first = train(adapter_config(tmp_path, "hf", training={"max_steps": 2}, **sections))
    ids = json.loads((tmp_path / "run-hf" / "trackers.json").read_text())
    resumed = train(adapter_config(tmp_path, "hf", training={"max_steps": 4}, **sections))
    assert resumed.resumed_from_step == 2 and json.loads((tmp_path / "run-hf" / "trackers.json").read_text()) == ids
    client = mlflow.MlflowClient(offline_trackers)
    (run,) = client.search_runs([client.get_experiment_by_name("tigon").experiment_id])
    assert run.info.run_id == ids["mlflow"] and run.info.status == "FINISHED"
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in history] == [1, 2, 3, 4]
    assert [m.value for m in history] == pytest.approx(first.losses + resumed.losses[2:])
