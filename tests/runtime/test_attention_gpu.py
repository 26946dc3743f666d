"""Packed documents on a GPU: "varlen" through cuDNN's ragged kernel and PyTorch's flash kernel, and flex attention.

    python -m pytest -m gpu tests/runtime/test_attention_gpu.py

Under bf16 autocast each document of a packed batch gives the logits it gives alone, and the loss and gradients
are the dense-mask path's, to bf16's tolerance (relative error under 1e-2); the planner's attention formula is
what a layer saves.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from tests.kernels.helpers import saved_bytes
from tests.runtime.documents import packed_batch
from tigon.runtime import attention, cudnn_attention, planner
from tigon.runtime.data import model_inputs

pytestmark = pytest.mark.gpu
ROWS = [[1, 7, 130, 370], [3, 211, 50, 253], [517]]  # odd document lengths, 1 to 517 tokens; 9 padding
TOLERANCE = 1e-2  # bf16


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def models(implementation: str, model_class=LlamaForCausalLM, config_class=LlamaConfig, **overrides):
    """(sdpa model, `implementation` model): the same random float32 weights, grouped-query heads of 64; they run
    under bf16 autocast (precision: bf16), so attention is bf16 and the gradients float32."""
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
    config = config_class(**shape, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024, **overrides)
    torch.manual_seed(0)
    dense = model_class._from_config(copy.deepcopy(config), attn_implementation="sdpa").cuda()
    name = attention.transformers_name(implementation)
    other = model_class._from_config(copy.deepcopy(config), attn_implementation=name).cuda()
    other.load_state_dict(dense.state_dict())
    return dense, other


@pytest.fixture(params=["cudnn", "flash"])
def varlen_kernel(request, monkeypatch) -> str:
    """The kernel varlen attention runs: cuDNN's (its frontend installed) or PyTorch's flash (as without it)."""
    if request.param == "flash":
        monkeypatch.setattr(cudnn_attention, "frontend", lambda: None)
    else:
        assert cudnn_attention.frontend() is not None, "install nvidia-cudnn-frontend to test cuDNN's varlen kernel"
        torch.use_deterministic_algorithms(False)  # cuDNN's kernel runs only without them (the suite turns them on)
    return request.param


def bf16():
    return torch.autocast("cuda", torch.bfloat16)


def gradients(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_packed_documents_train_as_if_alone_through_varlen(varlen_kernel):
    q = torch.empty(1, 4, 64, dtype=torch.bfloat16, device="cuda")  # the kernel runs, not the per-document fallback
    runs = cudnn_attention.supports(q, q[:, :2], 0.0, None) or attention._kernel_options(q, q[:, :2], 0.0, None)
    assert runs and cudnn_attention.supports(q, q[:, :2], 0.0, None) == (varlen_kernel == "cudnn")
    trains_as_if_alone("varlen")


def test_packed_documents_train_as_if_alone_through_flex_attention():
    trains_as_if_alone("flex_attention")


def trains_as_if_alone(implementation: str) -> None:
    dense, other = models(implementation)
    batch = {key: value.cuda() for key, value in packed_batch(ROWS, vocab=1000).items()}
    inputs = model_inputs(batch, implementation)
    with bf16():
        dense_out = dense(**model_inputs(batch, "sdpa"), use_cache=False)
        out = other(**inputs, use_cache=False)
    dense_out.loss.backward()
    out.loss.backward()
    assert relative(out.loss, dense_out.loss) < TOLERANCE
    assert relative(gradients(other), gradients(dense)) < TOLERANCE
    flat_ids, flat_labels = inputs["input_ids"].flatten(), inputs["labels"].flatten()
    logits = out.logits.flatten(0, 1)  # varlen: one row of the documents, the padding dropped
    starts = (inputs["position_ids"].flatten() == 0).nonzero().flatten().tolist()
    with torch.no_grad(), bf16():
        for start, end in itertools.pairwise([*starts, flat_ids.numel()]):
            real = int((flat_labels[start:end] != -100).sum()) + 1  # the document without the padding after it
            alone = dense(input_ids=flat_ids[None, start : start + real]).logits[0]
            assert relative(logits[start : start + real], alone) < TOLERANCE, (start, real)


def test_a_sliding_window_applies_within_each_document():
    """Mistral with a 64-token window through the kernel's window (torch 2.11+) or per-document SDPA."""
    dense, varlen = models("varlen", MistralForCausalLM, MistralConfig, sliding_window=64)
    batch = {key: value.cuda() for key, value in packed_batch([[9, 300, 211], [520]], vocab=1000).items()}
    inputs = model_inputs(batch, "varlen")
    with torch.no_grad(), bf16():
        logits = varlen(**inputs, use_cache=False).logits[0]
        for start, end in itertools.pairwise(inputs["cu_seq_lens_q"].tolist()):
            alone = dense(input_ids=inputs["input_ids"][:, start:end]).logits[0]
            assert relative(logits[start:end], alone) < TOLERANCE, (start, end)


@pytest.mark.parametrize("kernels", [False, True])
def test_a_varlen_layer_saves_what_the_planner_counts(kernels, varlen_kernel, restore_rope):
    """A Llama decoder layer under varlen (bf16, packed documents): the planner's unmasked attention formula, and
    nothing of (T, T) size; beyond it only the flash kernel's 16-byte RNG state."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from tigon.kernels.patching import apply

    config = LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=1
    )
    config._attn_implementation = attention.transformers_name("varlen")
    holder = torch.nn.Module()
    holder.config, holder.layer = config, LlamaDecoderLayer(config, 0).to("cuda", torch.bfloat16)
    if kernels:
        apply(holder)
    batch = {key: value.cuda() for key, value in packed_batch(ROWS, vocab=1000).items()}
    inputs = model_inputs(batch, "varlen")
    positions, tokens = inputs["position_ids"], inputs["position_ids"].numel()
    x = torch.randn(1, tokens, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(config).cuda()(x, positions)
    boundaries = {key: inputs[key] for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}

    def layer():
        return holder.layer(x, position_embeddings=(cos, sin), position_ids=positions, **boundaries)

    shared = [cos, sin, positions, inputs["cu_seq_lens_q"]]
    measured = saved_bytes(layer, [*holder.layer.parameters(), *shared])
    shape = planner.ModelShape.from_hf_config(config)
    work = planner.Workload(shape, tokens, weight_bytes=2, compute_bytes=2, autocast=False, attention="varlen")
    counted = planner.layer_bytes(work, kernels) * tokens
    random_state = 16 if varlen_kernel == "flash" else 0
    assert measured - random_state == counted, (measured, counted)
