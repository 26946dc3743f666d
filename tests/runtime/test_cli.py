"""The `tigon` command: train, schema, demo-data; config errors exit 2 with the key path and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.runtime.configs import tiny_config
from tests.runtime.worker_groups import process_env
from tigon.runtime import cli


def run_module(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tigon.runtime", *args],
        cwd=cwd,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def write_config(tmp_path: Path, **changes) -> Path:
    raw = tiny_config(tmp_path).model_dump(mode="json", exclude_defaults=True)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        raw.setdefault(section, {})[key] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_train_command_runs_with_overrides(tmp_path, capsys):
    config = write_config(tmp_path)
    run_dir = tmp_path / "cli-run"
    status = cli.main(["train", str(config), "--set", "training.max_steps=2", "--set", f"logging.run_dir={run_dir}"])
    assert status == 0
    assert "tigon run finished: 2 optimizer steps" in capsys.readouterr().out
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


@pytest.mark.parametrize(
    "changes, overrides, expected",
    [
        ({"training__micro_batch_size": "eight"}, [], "training.micro_batch_size: Input should be a valid integer"),
        ({"training__learning_rte": 0.1}, [], "training.learning_rte: unknown key (did you mean 'learning_rate'?)"),
        ({}, ["kernels.rmsnorm=false"], "kernels.rmsnorm: unknown key (did you mean 'rms_norm'?)"),
        ({}, ["training.max_steps"], "must look like key.path=value"),
        ({}, ["parallelism.cpu_offload=true"], "parallelism.cpu_offload needs strategy 'fsdp' or 'deepspeed'"),
        ({"data__train": "missing.jsonl"}, [], "missing.jsonl does not exist"),
    ],
)
def test_bad_config_exits_2_with_the_key_path(tmp_path, capsys, monkeypatch, changes, overrides, expected):
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, **changes)
    sets = [arg for override in overrides for arg in ("--set", override)]
    assert cli.main(["train", str(config), *sets]) == 2
    assert expected in capsys.readouterr().err


def test_config_error_in_a_real_process_has_no_traceback(tmp_path):
    config = write_config(tmp_path, training__learning_rte=0.1)
    done = run_module("train", str(config), "--set", "training.micro_batch_size=eight", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "training.learning_rte: unknown key (did you mean 'learning_rate'?)" in done.stderr
    assert "training.micro_batch_size: Input should be a valid integer" in done.stderr
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert cli.main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml does not exist" in capsys.readouterr().err


def test_schema_command_prints_the_json_schema(capsys):
    assert cli.main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"model", "data", "training", "parallelism", "lora", "checkpoint"} <= set(schema["properties"])


def test_demo_data_command_writes_instruction_jsonl(tmp_path, capsys):
    path = tmp_path / "arith.jsonl"
    assert cli.main(["demo-data", str(path), "--examples", "5", "--seed", "3"]) == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 5 and all(set(r) == {"instruction", "response"} for r in records)
    assert cli.main(["demo-data", str(path), "--examples", "0"]) == 2


def test_console_script_and_module_entry_point(tmp_path):
    done = run_module("schema", cwd=tmp_path)
    assert done.returncode == 0 and json.loads(done.stdout)["title"] == "RunConfig"
    script = Path(sys.executable).parent / "tigon"
    if script.exists():
        done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "demo-data" in done.stdout


@pytest.mark.parametrize("gpus", ["-2", "0", "two"])
def test_plan_refuses_a_gpu_count_below_one(tmp_path, capsys, gpus):
    config = write_config(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", str(config), "--gpus", gpus])
    assert exit_.value.code == 2
    assert "argument --gpus" in capsys.readouterr().err


def test_config_directory_and_locked_run_dir_exit_2_without_a_traceback(tmp_path, capsys):
    from tigon.runtime.lock import RunDirLock

    assert cli.main(["train", str(tmp_path)]) == 2
    assert f"error: config path {tmp_path} is a directory" in capsys.readouterr().err
    config = write_config(tmp_path)
    run_dir = tmp_path / "held"
    lock = RunDirLock(run_dir).acquire()
    try:
        assert cli.main(["train", str(config), "--set", f"logging.run_dir={run_dir}"]) == 2
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert f"error: logging.run_dir {run_dir} is in use by another run: pid {os.getpid()}" in err
    assert "Traceback" not in err
