"""benchmarks/trl_integration.py cannot rot: its --tiny rehearsal on the CPU, each trainer and variant a subprocess."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.presets import TINY
from benchmarks.trl_integration import worker
from tests.runtime.worker_groups import process_env

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("trl")


def test_tiny_run_writes_tokens_per_second_and_losses(tmp_path):
    """tigon's variant of both trainers (TRL's own runs the same code path with use_tigon left out; the parity tests
    compare the two)."""
    out = tmp_path / "trl.json"
    env = process_env(HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "benchmarks.trl_integration", "--tiny", "--variants", "tigon", "--seq", "32"]
    command += ["--steps", "1", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["seq"], report["batch"], report["steps"], report["warmup"]) == (32, 2, 1, 1)
    runs = {(run["trainer"], run["variant"]): run for run in report["runs"]}
    assert set(runs) == {("dpo", "tigon"), ("sft", "tigon")}
    for run in runs.values():
        assert run["tokens_per_second"] > 0 and len(run["losses"]) == 2 and run["peak_bytes"] is None
    assert runs["dpo", "tigon"]["losses"][0] == pytest.approx(math.log(2), rel=1e-6)  # policy == reference
    assert runs["sft", "tigon"]["losses"][0] == pytest.approx(math.log(TINY["vocab_size"]), rel=0.05)  # random init


def test_liger_is_recorded_unavailable_without_a_gpu():
    spec = {"trainer": "dpo", "variant": "liger", "shape": TINY, "seq": 32, "batch": 2, "steps": 1, "warmup": 1}
    assert worker(spec) == {"trainer": "dpo", "variant": "liger", "unavailable": "Liger-Kernel needs a CUDA GPU"}
