"""The fp8 benchmarks cannot rot: benchmarks/end_to_end.py's `--precision` and benchmarks/fp8_loss_curve.py, run
on the CPU with the FP8 matmuls emulated (TIGON_FP8_EMULATE=1, as in tests/runtime/test_fp8.py)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from benchmarks import end_to_end, fp8_loss_curve
from benchmarks.end_to_end_runner import ROOT, bench_config
from tigon.runtime.fp8 import EMULATE_VARIABLE

SPEC = {"shape": {"hidden_size": 64}, "seq": 32, "variant": "tigon", "warmup": 1, "steps": 1, "micro_batch": 2}


def test_end_to_end_passes_the_precision_and_fp8_needs_compile(capsys):
    config = bench_config({**SPEC, "checkpointing": True, "compile": True, "precision": "fp8"}, cuda=False)
    assert config.training.precision == "fp8" and config.training.compile
    assert bench_config({**SPEC, "checkpointing": True}, cuda=False).training.precision == "fp32"
    with pytest.raises(SystemExit):
        end_to_end.main(["--tiny", "--precision", "fp8", "--out", "unused.json"])
    assert "--precision fp8 trains compiled decoder layers (training.compile): add --compile" in capsys.readouterr().err


def test_compare_gives_the_relative_differences_to_bf16():
    losses = {"bf16": [2.0] * 10, "fp8-tensorwise": [2.2] + [2.0] * 8 + [1.9]}
    numbers = fp8_loss_curve.compare(losses)["fp8-tensorwise"]
    assert numbers["max"] == pytest.approx(0.1) and numbers["mean"] == pytest.approx(0.015)
    assert numbers["last_tenth_max"] == pytest.approx(0.05) and numbers["final_loss"] == 1.9
    assert numbers["last_tenth_loss"] == pytest.approx(-0.05)
    assert fp8_loss_curve.moving_mean([1.0, 2.0, 3.0, 5.0], 2) == [1.5, 2.5, 4.0]


def test_the_loss_curve_script_trains_bf16_and_both_fp8_scalings(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(EMULATE_VARIABLE, "1")
    monkeypatch.delenv("TRITON_INTERPRET")  # the demo's kernels take their references: the interpreter is slow
    monkeypatch.chdir(ROOT)  # the demo config's data paths are relative to the repository
    out = tmp_path / "fp8-loss.json"
    torch._dynamo.reset()
    arguments = ["--steps", "2", "--hidden", "64", "--compile-backend", "aot_eager", "--out", str(out)]
    fp8_loss_curve.main([*arguments, "--corpus", "stdlib", "--corpus-mb", "0.5", "--seeds", "2"])
    report = json.loads(out.read_text())
    assert list(report["losses"]) == ["bf16", "fp8-tensorwise", "bf16-seed1", "fp8-rowwise"]
    assert all(len(curve) == 2 and all(map(math.isfinite, curve)) for curve in report["losses"].values())
    for name in ("fp8-tensorwise", "fp8-rowwise"):
        assert 0 < report["comparison"][name]["max"] < 2e-2  # the casts ran, and stayed close
    assert report["comparison"]["bf16-seed1"]["max"] > 0  # another initialization and data order
    assert out.with_suffix(".png").stat().st_size > 0
    assert "fp8-rowwise against bf16 over 2 steps" in capsys.readouterr().out


def test_the_stdlib_corpus_is_real_source_text_up_to_its_size(tmp_path):
    path = fp8_loss_curve.stdlib_corpus(tmp_path / "corpus.jsonl", 200_000)
    documents = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    size = sum(map(len, documents))
    assert 200_000 <= size < 200_000 + max(map(len, documents))
    assert any("def " in text for text in documents) and all(documents)
    config = fp8_loss_curve.run_config(
        argparse.Namespace(
            steps=3,
            compile_backend="aot_eager",
            hidden=None,
            layers=None,
            learning_rate=3e-4,
            micro_batch=5,
            config=str(ROOT / "examples/demo.yaml"),
        ),
        {"precision": "bf16"},
        tmp_path / "run",
        path,
    )
    assert (config.data.train, config.data.format, config.data.eval) == (str(path), "text", None)
    assert config.data.max_seq_len == fp8_loss_curve.CORPUS_SEQ_LEN
    assert (config.training.learning_rate, config.training.micro_batch_size) == (3e-4, 5)


def test_the_stdlib_corpus_leaves_out_empty_files(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    (root / "package").mkdir(parents=True)
    (root / "package" / "__init__.py").write_text("")
    (root / "package" / "blank.py").write_text("\n  \n")
    (root / "package" / "code.py").write_text("def f():\n    return 1\n")
    monkeypatch.setattr(fp8_loss_curve.sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    path = fp8_loss_curve.stdlib_corpus(tmp_path / "corpus.jsonl", 10_000)
    assert [json.loads(line)["text"] for line in path.read_text().splitlines()] == ["def f():\n    return 1\n"]
