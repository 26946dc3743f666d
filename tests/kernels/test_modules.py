"""The nn.Module and functional wrappers against the Hugging Face modules they replace."""

import copy

import pytest
import torch
from torch import nn

from tests.kernels.helpers import assert_close
from tigon.kernels import functional, modules

transformers = pytest.importorskip("transformers")
from transformers.models.gemma import modeling_gemma  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402


def llama_config(**overrides):
    options = dict(
        hidden_size=48,
        intermediate_size=136,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=97,
        max_position_embeddings=64,
    )
    options.update(overrides)
    return transformers.LlamaConfig(**options)


def compare_modules(theirs: nn.Module, ours: nn.Module, x: torch.Tensor) -> None:
    x_theirs, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    expected, got = theirs(x_theirs), ours(x_ours)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    assert_close(got, expected, torch.float32, "output")
    assert_close(x_ours.grad, x_theirs.grad, torch.float32, "input grad")
    for (name, p_theirs), (_, p_ours) in zip(theirs.named_parameters(), ours.named_parameters(), strict=True):
        assert_close(p_ours.grad, p_theirs.grad, torch.float32, f"grad of {name}")


def test_rms_norm_module_matches_llama(device):
    torch.manual_seed(0)
    theirs = modeling_llama.LlamaRMSNorm(48, eps=1e-5).to(device)
    nn.init.uniform_(theirs.weight, 0.5, 1.5)
    ours = modules.RMSNorm.from_module(copy.deepcopy(theirs))
    assert ours.variance_epsilon == 1e-5
    compare_modules(theirs, ours, torch.randn(3, 5, 48, device=device))


def test_gemma_rms_norm_module_matches_gemma(device):
    torch.manual_seed(1)
    theirs = modeling_gemma.GemmaRMSNorm(48, eps=1e-6).to(device)
    nn.init.normal_(theirs.weight, std=0.3)
    ours = modules.GemmaRMSNorm.from_module(copy.deepcopy(theirs))
    compare_modules(theirs, ours, torch.randn(7, 48, device=device))


def test_from_module_shares_the_parameter():
    theirs = modeling_llama.LlamaRMSNorm(8)
    assert modules.RMSNorm.from_module(theirs).weight is theirs.weight


def test_layer_norm_module_matches_torch(device):
    torch.manual_seed(2)
    theirs = nn.LayerNorm(40, eps=1e-5).to(device)
    nn.init.normal_(theirs.weight)
    nn.init.normal_(theirs.bias)
    compare_modules(theirs, modules.LayerNorm.from_module(copy.deepcopy(theirs)), torch.randn(6, 40, device=device))


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_mlp_matches_llama_mlp(activation, device):
    torch.manual_seed(3)
    config = llama_config(hidden_act=activation)
    theirs = modeling_llama.LlamaMLP(config).to(device)
    ours = modules.GatedMLP.from_module(copy.deepcopy(theirs), config)
    compare_modules(theirs, ours, torch.randn(2, 9, 48, device=device))


def test_gated_mlp_built_fresh_has_llama_layout():
    mlp = modules.GatedMLP(llama_config())
    assert mlp.gate_proj.weight.shape == (136, 48) and mlp.down_proj.weight.shape == (48, 136)
    assert mlp(torch.randn(3, 48)).shape == (3, 48)


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="'relu' has no fused kernel"):
        modules.GatedMLP(llama_config(hidden_act="relu"))


def test_fused_add_rms_norm_module(device):
    torch.manual_seed(4)
    norm = modules.FusedAddRMSNorm(32).to(device)
    x, residual = torch.randn(4, 32, device=device), torch.randn(4, 32, device=device)
    y, new_residual = norm(x, residual)
    assert_close(new_residual, x + residual, torch.float32, "residual")
    assert_close(y, modeling_llama.LlamaRMSNorm(32, eps=1e-6).to(device)(x + residual), torch.float32, "y")


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_apply_rotary_pos_emb_matches_transformers(unsqueeze_dim, device):
    torch.manual_seed(5)
    config = llama_config()
    rotary = modeling_llama.LlamaRotaryEmbedding(config).to(device)
    batch, seq, head_dim = 2, 11, 12
    positions = torch.arange(seq, device=device)[None].expand(batch, -1)
    cos, sin = rotary(torch.randn(batch, seq, 48, device=device), positions)
    shape_q, shape_k = (batch, 4, seq, head_dim), (batch, 2, seq, head_dim)
    if unsqueeze_dim == 2:
        shape_q, shape_k = (batch, seq, 4, head_dim), (batch, seq, 2, head_dim)
    q, k = torch.randn(shape_q, device=device), torch.randn(shape_k, device=device)
    expected = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    got = functional.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    assert_close(got[0], expected[0], torch.float32, "q")
    assert_close(got[1], expected[1], torch.float32, "k")
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        functional.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)
