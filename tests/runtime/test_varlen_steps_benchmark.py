"""benchmarks/varlen_steps.py cannot rot: a tiny run of packed rows through varlen, and its static-shape mode (token
counts grown to a multiple, boundaries padded with empty documents) computes the same losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.runtime.worker_groups import process_env

ROOT = Path(__file__).resolve().parents[2]


def test_static_boundaries_train_the_same_losses(tmp_path):
    summaries = {}
    for mode in ("bf16-eager-mixed", "bf16-eager-mixed-64-static-nosync"):
        command = [sys.executable, "-m", "benchmarks.varlen_steps", str(tmp_path), mode, "1024", "3"]
        subprocess.run(command, cwd=ROOT, env=process_env(), check=True, capture_output=True, text=True, timeout=600)
        summaries[mode] = json.loads((tmp_path / f"varlen-steps-{mode}.json").read_text())
    plain, static = (summaries[mode]["micro_batches"] for mode in summaries)
    assert any(row["documents"] > 4 for row in plain)  # packed rows: boundaries inside them
    assert all(row["tokens"] % 64 == 0 for row in static)
    assert any(row["tokens"] % 64 for row in plain)
    for a, b in zip(plain[:2], static[:2], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    assert summaries["bf16-eager-mixed"]["summary"]["unsynced_tok_s"] > 0
