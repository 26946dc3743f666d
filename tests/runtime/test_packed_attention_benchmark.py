"""benchmarks/packed_attention.py cannot rot: its data, and a tiny run whose variants train the same documents."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.packed_attention import documents, packed_rows, row_documents
from tests.runtime.worker_groups import process_env

ROOT = Path(__file__).resolve().parents[2]


def test_documents_are_seeded_mixed_lengths_and_rows_give_them_back():
    docs = documents(20000, vocab=50, low=10, high=250, seed=3)
    assert docs == documents(20000, vocab=50, low=10, high=250, seed=3)
    lengths = [len(doc) for doc in docs]
    assert sum(lengths) >= 20000 and min(lengths) >= 10 and max(lengths) <= 250
    assert sum(length < 50 for length in lengths) > sum(length > 200 for length in lengths)  # log-uniform: short ones
    spec = {"rows": 4, "warmup": 1, "steps": 2, "seq": 256, "shape": {"vocab_size": 50}, "low": 10, "high": 250}
    dataset = packed_rows({**spec, "seed": 3})
    given_back = [doc for index in range(len(dataset)) for doc in row_documents(dataset[index])]
    assert given_back == docs[: len(given_back)] and len(dataset) >= 12


def test_tiny_run_trains_the_same_documents_in_every_variant(tmp_path):
    """tigon (varlen), HF on DataCollatorWithFlattening and HF on padded rows: the same first loss; Liger says why
    it cannot run."""
    env = process_env()
    out = tmp_path / "packed.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.packed_attention",
        "--tiny",
        "--variants",
        "tigon,hf,hf-padded,hf-liger",
    ]
    command += ["--seqs", "256", "--steps", "1", "--warmup", "0", "--out", str(out)]
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=600)
    runs = {run["variant"]: run for run in json.loads(out.read_text())["runs"]}
    tigon, hf = runs["tigon"], runs["hf"]
    assert abs(tigon["losses"][0] - hf["losses"][0]) < 1e-5 * hf["losses"][0]
    assert tigon["real_tokens_per_step"] == hf["real_tokens_per_step"] == runs["hf-padded"]["real_tokens_per_step"]
    assert abs(runs["hf-padded"]["losses"][0] - hf["losses"][0]) < 1e-5 * hf["losses"][0]
    assert "document boundaries" in tigon["attention"] and "bool mask" in hf["attention"]
    if not torch.cuda.is_available():
        assert runs["hf-liger"]["unavailable"] == "Liger-Kernel needs a CUDA GPU"
    assert "| 256 | tigon |" in out.with_suffix(".md").read_text()
