"""The Python examples of the README and of docs/kernels.md run as written (in order, sharing one namespace)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_python_blocks(path: Path, at_least: int) -> dict:
    """Execute every ```python block of `path` in one namespace; return the namespace."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    assert len(blocks) >= at_least
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(path), "exec"), namespace)
    return namespace


def test_readme_python_examples_run(restore_rope):
    pytest.importorskip("transformers")
    namespace = run_python_blocks(ROOT / "README.md", at_least=2)
    assert "rms_norm x5" in str(namespace["report"])


def test_kernels_guide_python_examples_run(restore_modeling):  # it calls apply_to("llama")
    pytest.importorskip("transformers")
    namespace = run_python_blocks(ROOT / "docs" / "kernels.md", at_least=9)
    assert namespace["loss"].ndim == 0 and "fused_linear_cross_entropy x1" in str(namespace["report"])
    gemma4 = namespace["gemma4"]  # the double-wide MLP of the key-sharing layer, swapped at its own width
    assert (
        type(gemma4.model.layers[2].mlp).__name__ == "GatedMLP"
        and gemma4.model.layers[2].mlp.up_proj.out_features == 192
    )
    assert namespace["gemma4_report"].applied == {
        "rms_norm": 24,
        "gated_mlp": 3,
        "rope": 1,
        "fused_linear_cross_entropy": 1,
    }
