"""The nn.Module and functional wrappers against the Hugging Face modules they replace."""

import copy
import importlib

import pytest
import torch
from torch import nn

from tests.kernels.families import moe_experts
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
        if p_theirs.requires_grad:  # frozen under LoRA
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


@pytest.mark.parametrize("in_place_backward", [False, True])
def test_offset_layer_norm_module_matches_nemotron(device, in_place_backward):
    from transformers.models.nemotron import modeling_nemotron

    torch.manual_seed(3)
    theirs = modeling_nemotron.NemotronLayerNorm1P(40, eps=1e-5).to(device)
    nn.init.normal_(theirs.weight, std=0.3)  # zero-centred, as Nemotron stores them: the scale is 1 + weight
    nn.init.normal_(theirs.bias)
    ours = modules.OffsetLayerNorm.from_module(copy.deepcopy(theirs), in_place_backward=in_place_backward)
    compare_modules(theirs, ours, torch.randn(6, 40, device=device))


def test_offset_layer_norm_keeps_the_input_dtype_under_cpu_autocast():
    """transformers' Nemotron norm casts only under CUDA's autocast: on the CPU it norms in the input's dtype."""
    from transformers.models.nemotron import modeling_nemotron

    theirs = modeling_nemotron.NemotronLayerNorm1P(16)
    nn.init.normal_(theirs.weight, std=0.3)
    ours = modules.OffsetLayerNorm.from_module(copy.deepcopy(theirs))
    x = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = theirs(x), ours(x)
    assert got.dtype == expected.dtype == torch.float32
    assert_close(got, expected, torch.float32, "output")


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_mlp_matches_llama_mlp(activation, device):
    torch.manual_seed(3)
    config = llama_config(hidden_act=activation)
    theirs = modeling_llama.LlamaMLP(config).to(device)
    ours = modules.GatedMLP.from_module(copy.deepcopy(theirs), config)
    compare_modules(theirs, ours, torch.randn(2, 9, 48, device=device))


def test_gated_mlp_matches_falcon_h1_mlp_with_its_multipliers(device):
    modeling_falcon_h1 = pytest.importorskip("transformers.models.falcon_h1.modeling_falcon_h1")
    torch.manual_seed(4)
    config = transformers.FalconH1Config(hidden_size=48, intermediate_size=136, mlp_multipliers=[0.8, 1.7])
    theirs = modeling_falcon_h1.FalconH1MLP(config).to(device)
    ours = modules.GatedMLP.from_module(copy.deepcopy(theirs), config)
    assert ours.multipliers == (0.8, 1.7)
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
    with pytest.raises(ValueError, match="unsqueeze_dim must be .* got 0 with cos/sin of shape"):
        functional.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)  # per-batch tables: not Pixtral's form


def test_apply_rotary_pos_emb_matches_pixtrals_shared_tables(device):
    """Pixtral's vision tower: `(S, D)` cos/sin shared by every head (`unsqueeze_dim=0`), its own 2-D frequencies."""
    from transformers.models.pixtral import modeling_pixtral

    torch.manual_seed(5)
    config = transformers.AutoConfig.for_model("pixtral", hidden_size=64, num_attention_heads=4, head_dim=16)
    rotary = modeling_pixtral.PixtralVisionRotaryEmbedding(config).to(device)
    positions = torch.tensor([[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2], [2, 0], [2, 2]], device=device)  # (h, w)
    cos, sin = rotary(torch.randn(1, 8, 64, device=device), positions)
    assert cos.shape == (8, 16)
    q, k = torch.randn(1, 4, 8, 16, device=device), torch.randn(1, 4, 8, 16, device=device)
    expected = modeling_pixtral.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)
    got = functional.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)
    assert_close(got[0], expected[0], torch.float32, "q")
    assert_close(got[1], expected[1], torch.float32, "k")


@pytest.mark.parametrize(("family", "activation"), [("phi3", "silu"), ("glm4", "gelu_pytorch_tanh"), ("phi3", "gelu")])
def test_packed_gated_mlp_matches_phi3_and_glm4_mlps(family, activation, device):
    torch.manual_seed(6)
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = transformers.AutoConfig.for_model(family, hidden_size=48, intermediate_size=67, hidden_act=activation)
    theirs = getattr(modeling, f"{family.capitalize()}MLP")(config).to(device)
    ours = modules.PackedGatedMLP.from_module(copy.deepcopy(theirs), config)
    compare_modules(theirs, ours, torch.randn(2, 9, 48, device=device))
    fresh = modules.PackedGatedMLP(config)
    assert fresh.state_dict().keys() == theirs.state_dict().keys()
    assert fresh.gate_up_proj.weight.shape == (2 * 67, 48) and fresh(torch.randn(3, 48)).shape == (3, 48)


def test_packed_gated_mlp_keeps_lora_adapters(device):
    peft = pytest.importorskip("peft")
    from transformers.models.phi3 import modeling_phi3

    torch.manual_seed(7)
    config = transformers.Phi3Config(hidden_size=48, intermediate_size=40)
    lora = peft.LoraConfig(r=4, target_modules=["gate_up_proj", "down_proj"], init_lora_weights=False)
    theirs = peft.get_peft_model(nn.Sequential(modeling_phi3.Phi3MLP(config)), lora).to(device)
    ours = copy.deepcopy(theirs)
    ours.base_model.model[0] = modules.PackedGatedMLP.from_module(ours.base_model.model[0], config)
    assert type(ours.base_model.model[0].gate_up_proj).__module__.startswith("peft")
    compare_modules(theirs, ours, torch.randn(2, 5, 48, device=device))
    assert ours.base_model.model[0].gate_up_proj.lora_A["default"].weight.grad is not None


def compare_experts(theirs: nn.Module, ours: nn.Module, device: str, tokens: int = 13) -> None:
    """Same output and gradients (hidden states, routing weights, both parameters) on random routing."""
    hidden = torch.randn(tokens, theirs.hidden_dim, device=device)
    index = torch.randint(0, theirs.num_experts, (tokens, 2), device=device)
    index[0] = torch.tensor([1, 3])  # expert 0 and 4 may get no token; 1 and 3 always get one
    weights = torch.rand(tokens, 2, device=device)
    inputs = [(hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)) for _ in range(2)]
    expected = theirs(inputs[0][0], index, inputs[0][1])
    got = ours(inputs[1][0], index, inputs[1][1])
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    assert_close(got, expected, torch.float32, "output")
    assert_close(inputs[1][0].grad, inputs[0][0].grad, torch.float32, "hidden states grad")
    assert_close(inputs[1][1].grad, inputs[0][1].grad, torch.float32, "routing weights grad")
    for name in ("gate_up_proj", "down_proj"):
        assert_close(getattr(ours, name).grad, getattr(theirs, name).grad, torch.float32, f"grad of {name}")


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_gated_experts_match_transformers_experts(family, implementation, device):
    torch.manual_seed(8)
    theirs, config = moe_experts(family, implementation)
    copied = copy.deepcopy(theirs).to(device)
    ours = modules.GatedExperts.from_module(copied, config)
    assert ours.config is copied.config and ours.num_experts == 5 and ours.intermediate_dim == 40
    assert ours.gate_up_proj is copied.gate_up_proj and ours.down_proj is copied.down_proj
    compare_experts(theirs.to(device), ours, device)


def test_gated_experts_built_fresh_have_the_transformers_layout():
    theirs, config = moe_experts("qwen3_moe", "eager")
    fresh = modules.GatedExperts(config)
    assert {name: p.shape for name, p in fresh.named_parameters()} == {
        name: p.shape for name, p in theirs.named_parameters()
    }
    fresh.load_state_dict(theirs.state_dict())
    compare_experts(theirs, fresh, "cpu", tokens=4)


def test_gated_experts_refuse_another_layout():
    theirs, config = moe_experts("mixtral", "eager")
    theirs.has_bias = True  # e.g. GPT-OSS's experts: biases, transposed, interleaved gate/up
    with pytest.raises(ValueError, match=r"MixtralExperts does not have the layout GatedExperts replaces.*has_bias"):
        modules.GatedExperts.from_module(theirs, config)
    config._experts_implementation = "no_such_kernel"
    with pytest.raises(ValueError, match="'no_such_kernel' is not an experts implementation"):
        modules.GatedExperts(config)(torch.randn(2, 48), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))


def test_gated_expert_mlp_has_mixtral_4x_expert_names_and_math(device):
    """transformers 4.x's MixtralBlockSparseTop2MLP: `w2(act(w1(x)) * w3(x))` (tests/compat compares whole
    4.x Mixtral models; this checks the module against that formula)."""
    torch.manual_seed(9)
    config = transformers.MixtralConfig(hidden_size=48, intermediate_size=40)
    ours = modules.GatedExpertMLP(config).to(device)
    assert [name for name, _ in ours.named_parameters()] == ["w1.weight", "w2.weight", "w3.weight"]
    theirs = copy.deepcopy(ours)
    theirs.forward = lambda x: theirs.w2(nn.functional.silu(theirs.w1(x)) * theirs.w3(x))
    compare_modules(theirs, ours, torch.randn(7, 48, device=device))
    shared = modules.GatedExpertMLP.from_module(theirs, config)
    assert shared.w1 is theirs.w1 and shared.w2 is theirs.w2 and shared.w3 is theirs.w3
