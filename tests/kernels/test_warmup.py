"""The kernel warm-up: on the CPU it runs every kernel through Triton's interpreter on tiny shapes,
checks it against the reference and reports; the CLI validates its arguments and writes a JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tigon.kernels.warmup import (
    OPS,
    Shapes,
    WarmupError,
    family_settings,
    main,
    shapes_from_model_config,
    warm_up,
)

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = Shapes(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, tokens=4096, vocab=128256)

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU (interpreter) path")


@cpu_only
def test_every_op_runs_on_tiny_shapes_through_the_interpreter(tmp_path):
    report = warm_up([LLAMA_8B], ops=list(OPS), cache_dir=str(tmp_path / "cache"))
    assert report.mode == "interpreter" and report.device == "cpu"
    assert [r.op for r in report.results] == list(OPS)
    assert report.ok, report.lines()
    assert all(r.error is not None and r.error < 1e-5 and r.dtype == "float32" for r in report.results)
    assert {r.shapes for r in report.results} >= {"tokens=8 width=64", "tokens=8 width=96"}
    losses = {r.op: r.shapes for r in report.results if "cross_entropy" in r.op}
    assert losses == {
        "cross_entropy": "tokens=8 vocab=37",
        "fused_linear_cross_entropy": "tokens=8 hidden=64 vocab=37",
    }
    assert report.cache_dir == str(tmp_path / "cache") and os.environ["TRITON_CACHE_DIR"] == report.cache_dir
    text = "\n".join(report.lines())
    assert "nothing compiled or cached (no GPU)" in text and "total" in text
    json.dumps(report.to_json())


@cpu_only
def test_family_picks_the_patched_ops():
    llama = warm_up([LLAMA_8B])
    gemma = warm_up([LLAMA_8B], family="gemma")
    phi3 = warm_up([LLAMA_8B], family="phi3")  # one fused gate_up_proj: the packed activation
    loss = "fused_linear_cross_entropy"  # the runtime's default loss
    assert [r.op for r in llama.results] == ["rms_norm", "fused_add_rms_norm", "rope", "swiglu", loss]
    assert [r.op for r in gemma.results] == ["rms_norm", "fused_add_rms_norm", "rope", "geglu", loss]
    qwen2_moe = warm_up([LLAMA_8B], family="qwen2_moe")  # a shared expert MLP and the experts
    assert [r.op for r in phi3.results] == ["rms_norm", "fused_add_rms_norm", "rope", "swiglu_packed", loss]
    assert [r.op for r in qwen2_moe.results][3:] == ["swiglu", "swiglu_packed", loss]
    nemotron = warm_up([LLAMA_8B], family="nemotron")  # LayerNorms, its squared-ReLU MLP
    assert [r.op for r in nemotron.results][3:] == ["layer_norm", "relu_squared", loss]
    assert llama.ok and gemma.ok and phi3.ok and qwen2_moe.ok and nemotron.ok


@cpu_only
@pytest.mark.parametrize("family, softcap", [("llama", None), ("gemma", None), ("gemma2", 30.0)])
def test_loss_ops_follow_the_familys_softcap(family, softcap):
    """Gemma 2 softcaps its logits (another kernel specialization), checked against the capped reference."""
    assert family_settings(family)["softcap"] == softcap
    tiny = Shapes(hidden=16, intermediate=32, heads=2, kv_heads=1, head_dim=8, tokens=5, vocab=37)
    report = warm_up([tiny], ops=["cross_entropy", "fused_linear_cross_entropy"], family=family)
    assert report.ok, report.lines()
    assert all(r.error < 1e-5 for r in report.results)


@cpu_only
def test_cli_reports_and_writes_json(tmp_path):
    """The entrypoint's call, in a fresh interpreter: it sets TRITON_INTERPRET itself on a CPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "report" / "warmup.json"
    command = [sys.executable, "-m", "tigon.kernels.warmup", "--hidden", "4096", "--heads", "32", "--kv-heads", "8"]
    command += ["--cache-dir", str(tmp_path / "cache"), "--json", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tigon kernel warm-up on cpu (interpreter)" in result.stdout
    report = json.loads(out.read_text())
    assert report["ok"] and report["mode"] == "interpreter"
    assert [r["op"] for r in report["results"]] == [
        "rms_norm",
        "fused_add_rms_norm",
        "rope",
        "swiglu",
        "fused_linear_cross_entropy",
    ]
    assert report["results"][-1]["shapes"] == "tokens=8 hidden=64 vocab=37"
    assert all(r["seconds"] > 0 for r in report["results"])
    assert not list(out.parent.glob(".*partial"))


@cpu_only
def test_model_config_gives_sizes_and_family(tmp_path):
    config = {"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576, "num_attention_heads": 16}
    config |= {"num_key_value_heads": 16, "head_dim": 256, "vocab_size": 256000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    sizes, family = shapes_from_model_config(tmp_path)
    assert family == "gemma"
    expected = {"hidden": 3072, "intermediate": 24576, "heads": 16, "kv_heads": 16, "head_dim": 256, "vocab": 256000}
    assert sizes == expected
    path = str(tmp_path / "config.json")
    assert main(["--model-config", path, "--ops", "rms_norm,fused_linear_cross_entropy"]) == 0
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "gemma2"}))
    assert shapes_from_model_config(tmp_path)[1] == "gemma2"  # its loss softcaps the logits
    multimodal = {"model_type": "gemma3", "text_config": config | {"model_type": "gemma3_text"}}
    (tmp_path / "config.json").write_text(json.dumps(multimodal))
    assert shapes_from_model_config(tmp_path)[1] == "gemma3_text"


@cpu_only
@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give --hidden"),
        (["--hidden", "0"], "hidden must be a positive integer"),
        (["--hidden", "100000"], "above the 65536"),
        (["--hidden", "64", "--head-dim", "15"], "head_dim must be even"),
        (["--hidden", "64", "--vocab", "0"], "vocab must be a positive integer"),
        (["--hidden", "64", "--ops", "rms_norm,softmax"], "unknown op(s) ['softmax']"),
        (["--hidden", "64", "--family", "gpt2"], "unknown model family 'gpt2'"),
        (["--model-config", "/nonexistent/config.json"], "does not exist"),
        (["--hidden", "64", "--device", "cuda"], "no CUDA GPU is visible"),
    ],
)
def test_bad_arguments_name_the_problem(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@cpu_only
def test_shapes_are_checked():
    with pytest.raises(WarmupError, match="tokens must be a positive integer"):
        warm_up([Shapes(hidden=64, intermediate=64, heads=1, kv_heads=1, head_dim=16, tokens=0)])
    with pytest.raises(WarmupError, match="no shapes"):
        warm_up([])
