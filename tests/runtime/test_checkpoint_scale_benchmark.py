"""benchmarks/checkpoint_scale.py cannot rot: its tiny rehearsal on the CPU, 2 ranks over gloo, as on the GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.checkpoint_scale import SHAPES
from tests.runtime.worker_groups import process_env

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_rehearsal_saves_sync_and_async_and_resumes_to_the_same_losses(tmp_path):
    out = tmp_path / "checkpoint-scale.json"
    command = [sys.executable, "-m", "benchmarks.checkpoint_scale", "--shape", "tiny", "--nproc", "2"]
    command += ["--run-dir", str(tmp_path / "run"), "--out", str(out)]
    env = process_env()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["config"] == SHAPES["tiny"]
    assert [row["mode"] for row in report["results"]] == ["sync", "async"]
    assert [row["saved_at_step"] for row in report["results"]] == [2, 4]
    for row in report["results"]:
        assert row["losses_equal"] and row["resumed_losses"] == row["losses"] and len(row["losses"]) == 2, row
        assert row["bytes_written"] > 12 * report["parameters"]  # fp32 weights and AdamW's two moments
        assert 0 < row["stall_seconds"] <= row["durable_seconds"]
    sync, background = report["results"]
    assert sync["stall_seconds"] == sync["durable_seconds"]
    assert abs(sync["bytes_written"] - background["bytes_written"]) < 1024  # state.json holds 2 more losses
    assert "| async | 4 |" in done.stdout
    assert not list((tmp_path / "run").glob("*/checkpoints/step-*"))  # each mode's checkpoint removed
