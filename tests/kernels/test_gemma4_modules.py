"""Gemma 4's norm, GeGLU MLP (the double-wide one included) and one-tensor RoPE against transformers' own, forward
and backward, at odd sizes in fp32 and bf16 against a float64 run of the transformers module."""

import copy

import pytest
import torch

from tests.kernels.helpers import assert_close
from tigon.kernels import functional, modules

transformers = pytest.importorskip("transformers")
modeling_gemma4 = pytest.importorskip(
    "transformers.models.gemma4.modeling_gemma4", reason="the installed transformers predates Gemma 4"
)

DTYPES = [torch.float32, torch.bfloat16]


def text_config(**overrides) -> "transformers.Gemma4TextConfig":
    """Two full-attention layers, the second sharing the first's keys and values (so its MLP is double-wide)."""
    options = dict(
        hidden_size=48,
        intermediate_size=67,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=12,
        global_head_dim=20,
        layer_types=["full_attention", "full_attention"],
        num_kv_shared_layers=1,
        use_double_wide_mlp=True,
    )
    return transformers.Gemma4TextConfig(**{**options, **overrides})


def compare_with_float64(theirs: torch.nn.Module, ours: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype) -> None:
    """`ours` in `dtype` against `theirs` in float64 on the same input: output, input gradient, every weight's."""
    exact = copy.deepcopy(theirs).double()
    ours = ours.to(dtype)
    x64, x_ours = x.double().requires_grad_(True), x.to(dtype).requires_grad_(True)
    expected, got = exact(x64), ours(x_ours)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad.to(dtype))
    assert got.dtype == dtype
    assert_close(got, expected, dtype, "output")
    assert_close(x_ours.grad, x64.grad, dtype, "input grad")
    for (name, p_exact), (_, p_ours) in zip(exact.named_parameters(), ours.named_parameters(), strict=True):
        assert_close(p_ours.grad, p_exact.grad, dtype, f"grad of {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer", [0, 1], ids=["plain", "double-wide"])
def test_gated_mlp_matches_gemma4_mlp(layer, dtype, device):
    torch.manual_seed(layer)
    theirs = modeling_gemma4.Gemma4TextMLP(text_config(), layer).to(device)
    assert theirs.intermediate_size == 67 * (layer + 1)
    ours = modules.GatedMLP.from_module(copy.deepcopy(theirs), theirs.config)
    assert (ours.activation, ours.approximate) == ("geglu", "tanh")
    assert ours.gate_proj.weight.shape == (67 * (layer + 1), 48)
    compare_with_float64(theirs, ours, torch.randn(3, 7, 48, device=device), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_scale", [True, False], ids=["scaled", "weightless"])
def test_rms_norm_matches_gemma4_norm(with_scale, dtype, device):
    """Gemma 4 scales by `weight` (not Gemma's `1 + weight`) in float32 and casts once; the value norm and the MoE
    router's norm have no weight at all."""
    torch.manual_seed(2)
    theirs = modeling_gemma4.Gemma4RMSNorm(37, eps=1e-6, with_scale=with_scale).to(device)
    if with_scale:
        torch.nn.init.normal_(theirs.weight, mean=1.0, std=0.3)
    ours = modules.RMSNorm.from_module(copy.deepcopy(theirs), casting="gemma")
    assert (ours.weight is None) is not with_scale and ours.offset == 0.0
    compare_with_float64(theirs, ours, torch.randn(5, 3, 37, device=device) * 3, dtype)


def rotary_tables(layer_type: str, device: str, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 4's cos/sin for `layer_type`: the default RoPE for sliding layers, the proportional one (a quarter of
    the frequencies rotate, the rest are cos 1, sin 0) for full-attention layers."""
    config = text_config(layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0)
    rotary = modeling_gemma4.Gemma4TextRotaryEmbedding(config).to(device)
    positions = torch.arange(seq, device=device)[None].expand(batch, -1)
    return rotary(torch.randn(batch, seq, 48, device=device), positions, layer_type)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_one_tensor_rope_matches_gemma4(layer_type, unsqueeze_dim, dtype, device):
    torch.manual_seed(3)
    batch, seq, heads = 2, 11, 3
    cos, sin = rotary_tables(layer_type, device, batch, seq)
    head_dim = cos.shape[-1]
    assert head_dim == (20 if layer_type == "full_attention" else 12)
    shape = (batch, heads, seq, head_dim) if unsqueeze_dim == 1 else (batch, seq, heads, head_dim)
    x = torch.randn(shape, device=device)
    x64, x_ours = x.double().requires_grad_(True), x.to(dtype).requires_grad_(True)
    expected = modeling_gemma4.apply_rotary_pos_emb(x64, cos.double(), sin.double(), unsqueeze_dim=unsqueeze_dim)
    got = functional.apply_rotary_pos_emb_one(x_ours, cos, sin, unsqueeze_dim=unsqueeze_dim)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad.to(dtype))
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, expected, dtype, "rotated x")
    assert_close(x_ours.grad, x64.grad, dtype, "grad of x")
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        functional.apply_rotary_pos_emb_one(x, cos, sin, unsqueeze_dim=3)


def test_vision_tower_2d_rope_through_the_patched_function(device, monkeypatch):
    """The vision tower's multidimensional RoPE calls the module's `apply_rotary_pos_emb` once per axis, on slices of
    the head dim: with tigon's in its place it computes the same."""
    torch.manual_seed(4)
    batch, patches, heads, head_dim = 2, 9, 2, 16
    x = torch.randn(batch, patches, heads, head_dim, device=device)
    cos, sin = torch.randn(2, batch, patches, head_dim, device=device).unbind(0)
    positions = torch.randint(0, 3, (batch, patches, 2), device=device)
    expected = modeling_gemma4.apply_multidimensional_rope(x, cos, sin, positions)
    monkeypatch.setattr(modeling_gemma4, "apply_rotary_pos_emb", functional.apply_rotary_pos_emb_one)
    got = modeling_gemma4.apply_multidimensional_rope(x, cos, sin, positions)
    assert_close(got, expected, torch.float32, "vision RoPE")
