"""benchmarks/end_to_end.py cannot rot: its --tiny smoke run on the CPU, eager and tigon, each in a subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_end_to_end_run_writes_json_and_table(tmp_path):
    out = tmp_path / "e2e.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # CPU tensors take the reference path; the interpreter would be slow
    command = [sys.executable, "-m", "benchmarks.end_to_end", "--tiny", "--variants", "eager,tigon"]
    command += ["--seqs", "32", "--steps", "1", "--warmup", "1", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[1/2] eager at seq 32 x micro-batch 2" in done.stdout

    report = json.loads(out.read_text())
    runs = {run["variant"]: run for run in report["runs"]}
    assert set(runs) == {"eager", "tigon"}
    for name, run in runs.items():
        assert not run["oom"] and run["seq"] == 32 and run["micro_batch"] == 2 and run["checkpointing"]
        assert run["kernels"] == (name == "tigon")
        assert run["tokens_per_second"] > 0 and len(run["losses"]) == 2
        assert all(math.isfinite(loss) for loss in run["losses"])
        assert run["estimate_bytes"] > 0 and run["peak_bytes"] is None  # no CUDA peak on the CPU
    # same seed, same data, same initial weights: the kernels compute the same first loss
    assert abs(runs["eager"]["losses"][0] - runs["tigon"]["losses"][0]) < 1e-4
    assert math.isclose(runs["eager"]["losses"][0], math.log(512), rel_tol=0.05)  # random init over 512 tokens

    table = out.with_suffix(".md").read_text()
    assert "| eager | 32 | 2 x 1 | on | off |" in table and "| tigon | 32 | 2 x 1 | on | on |" in table
