"""`training.selective_layers`: decoder layers that keep their matmul and attention outputs and recompute only the
element-wise work. The recomputation repeats the same ops on the same inputs, so losses and gradients equal the
run without checkpointing bit for bit; what such a layer keeps is what the planner counts, byte for byte."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.runtime.configs import COMPILED, resumable_config, tiny_config
from tests.runtime.worker_groups import RELATIVE_TOLERANCE, launch, worst_relative
from tigon.kernels.patching import apply
from tigon.runtime import planner, recompute
from tigon.runtime.config import ConfigError
from tigon.runtime.model import build_model, checkpointable_layers
from tigon.runtime.planner import ModelShape, Workload
from tigon.runtime.trainer import train

LLAMA = LlamaConfig(
    hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2
)


def tiny_llama(kernels: bool) -> LlamaForCausalLM:
    config = copy.deepcopy(LLAMA)
    config.vocab_size = 97
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if kernels:
        apply(model)
    return model.train()


def cached_tensors(store) -> list[torch.Tensor]:
    """The tensors in a selective checkpoint's cache (dicts or lists of version-checked entries, by torch version)."""
    if isinstance(store, torch.Tensor):
        return [store]
    if isinstance(store, dict):
        return [t for value in store.values() for t in cached_tensors(value)]
    if isinstance(store, (list, tuple)):
        return [t for value in store for t in cached_tensors(value)]
    return cached_tensors(store.val) if hasattr(store, "val") else []


@pytest.fixture
def caches(monkeypatch):
    """The forward caches of every selective checkpoint that runs."""
    found = []
    make = recompute.create_selective_checkpoint_contexts

    def recording(policy):
        contexts = make(policy)
        found.append(contexts[0].storage)
        return contexts

    monkeypatch.setattr(recompute, "create_selective_checkpoint_contexts", recording)
    return found


@pytest.mark.parametrize("kernels", [False, True])
def test_selective_layers_give_the_losses_and_gradients_of_keeping_everything(kernels, caches):
    """The second layer selective, the first whole-checkpointed, against no checkpointing: bit for bit."""
    plain = tiny_llama(kernels)
    selective = copy.deepcopy(plain)
    layers = checkpointable_layers(selective)
    selective.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers[1].gradient_checkpointing = False
    assert recompute.enable_selective_recomputation(layers[1:]) == 1
    ids = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, selective):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for (name, a), b in zip(plain.named_parameters(), selective.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    assert len(caches) == 1  # the selective layer ran under its policy


@pytest.mark.parametrize("kernels", [False, True])
def test_a_selective_layer_keeps_what_the_planner_counts(kernels, caches):
    """A Llama decoder layer in bf16, SDPA: the cache holds the q, k, v, o, gate and up outputs and attention's
    output and log-sum-exp; with the layer's input, that is `selective_layer_bytes` exactly."""
    model = tiny_llama(kernels).to(torch.bfloat16)
    recompute.enable_selective_recomputation(checkpointable_layers(model))
    ids = torch.randint(0, 97, (3, 16))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in cached_tensors(caches[0])}
    loss.backward()  # which reads the cache
    assert cached_tensors(caches[0]) == []
    assert len(storages) == 8
    work = Workload(ModelShape.from_hf_config(LLAMA), 16, 2, 2, autocast=False, attention="sdpa")
    layer_input = 2 * LLAMA.hidden_size * 3 * 16
    assert sum(storages.values()) + layer_input == planner.selective_layer_bytes(work) * 3 * 16


@pytest.mark.parametrize("kernels", [False, True])
def test_a_compiled_selective_layer_keeps_what_the_planner_counts(kernels):
    """Compiled, the layer's graph saves through autograd's saved-tensor hooks: the same outputs as the eager layer
    (down_proj's is kept by the policy and read by nothing, so not saved), its input, and RoPE's cos and sin,
    which every layer shares."""
    torch._dynamo.reset()
    model = tiny_llama(kernels).to(torch.bfloat16)
    layers = checkpointable_layers(model)
    recompute.enable_selective_recomputation(layers, compiled=True)
    layers[0].compile(backend="aot_eager")
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, 97, (3, 16))
    hidden = model.model.embed_tokens(ids)
    positions = torch.arange(16)[None]
    cos_sin = model.model.rotary_emb(hidden, positions)
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layers[0](hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
    torch._dynamo.reset()
    activations = [nbytes for pointer, nbytes in saved.items() if pointer not in weights]
    assert len(activations) == 8 + 1 + 2
    work = Workload(ModelShape.from_hf_config(LLAMA), 16, 2, 2, autocast=False, attention="sdpa")
    shared = sum(t.untyped_storage().nbytes() for t in cos_sin)
    assert sum(activations) - shared == planner.selective_layer_bytes(work) * 3 * 16


def test_compiled_selective_layers_train_as_compiled_layers_without_checkpointing(tmp_path, monkeypatch):
    """Layer 0 whole, layer 1 selective, both compiled with the kernels inside: the recomputation repeats the
    compiled graph's ops on the same inputs, so the losses equal the run that keeps everything."""
    torch._dynamo.reset()
    decided = []
    policy = recompute.compiled_policy
    monkeypatch.setattr(recompute, "compiled_policy", lambda ctx, op, *a, **k: decided.append(op) or policy(ctx, op))
    training = {"max_steps": 3, "micro_batch_size": 2, **COMPILED}
    sections = dict(kernels={"enabled": True, "fused_linear_cross_entropy": False}, eval={"metrics": []})
    plain = train(tiny_config(tmp_path / "plain", training=training, **sections))
    mixed = {**training, "gradient_checkpointing": True, "checkpoint_layers": 1, "selective_layers": 1}
    assert decided == []
    run = train(tiny_config(tmp_path / "mixed", training=mixed, **sections))
    torch._dynamo.reset()
    assert torch.ops.aten.mm.default in decided  # the policy ran while the layer's graph was traced
    assert run.losses == plain.losses


def test_selective_lora_layers_keep_the_base_projections_only(tmp_path):
    """With LoRA the base layer's output is kept and the adapters recompute: the same bytes as without LoRA, and
    the same losses as without checkpointing."""
    training = {"max_steps": 3, "micro_batch_size": 2}
    sections = dict(lora={"enabled": True, "r": 4}, eval={"metrics": []})
    plain = train(tiny_config(tmp_path / "plain", training=training, **sections))
    selective = train(tiny_config(tmp_path / "selective", training={**training, "selective_layers": 2}, **sections))
    assert selective.losses == plain.losses
    model = build_model(tiny_config(tmp_path / "built", training={"selective_layers": 2}, **sections), 64)
    kept = recompute.kept_projections(checkpointable_layers(model)[0])
    assert len(kept) == 6 and all(type(module) is torch.nn.Linear for module in kept)


def test_the_runtime_places_whole_then_selective_layers(tmp_path):
    """checkpoint_layers 1 and selective_layers 5 on 2 layers: layer 0 whole, layer 1 selective; the losses of a
    run without checkpointing."""
    training = {"max_steps": 3, "micro_batch_size": 2}
    mixed = {**training, "gradient_checkpointing": True, "checkpoint_layers": 1, "selective_layers": 5}
    model = build_model(tiny_config(tmp_path / "built", training=mixed), 64)
    layers = checkpointable_layers(model)
    assert [layer.gradient_checkpointing for layer in layers] == [True, True]
    assert "context_fn" not in layers[0]._gradient_checkpointing_func.keywords
    assert "context_fn" in layers[1]._gradient_checkpointing_func.keywords
    plain = train(tiny_config(tmp_path / "plain", training=training))
    run = train(tiny_config(tmp_path / "mixed", training=mixed))
    assert run.losses == plain.losses


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_the_hf_trainer_and_lightning_train_selective_layers_as_without(tmp_path, trainer, caches):
    training = {"max_steps": 2, "micro_batch_size": 2}
    sections = dict(trainer=trainer, eval={"metrics": []})
    plain = train(tiny_config(tmp_path / "plain", training=training, **sections))
    assert caches == []
    selective = train(tiny_config(tmp_path / "selective", training={**training, "selective_layers": 2}, **sections))
    assert len(caches) == 2 * 2  # 2 layers, 2 steps: the framework kept the layers' policy
    assert selective.losses == plain.losses


def test_selective_layers_under_ddp_fsdp2_and_zero3_match_one_process(tmp_path):
    """2 gloo ranks, micro-batch 2 each, against one process without checkpointing at micro-batch 4: FSDP2 and
    ZeRO-3 gather a selective layer's weights again for its recomputation, which then reads the kept outputs."""
    selective = {"selective_layers": 2}
    runs = launch(
        tmp_path,
        {
            "ddp": resumable_config(tmp_path, "ddp", 4, False, training=selective),
            "fsdp": resumable_config(tmp_path, "fsdp", 4, False, training=selective, parallelism={"strategy": "fsdp"}),
            "zero3": resumable_config(
                tmp_path, "zero3", 4, False, training=selective, parallelism={"strategy": "deepspeed", "zero_stage": 3}
            ),
        },
    )
    single = train(resumable_config(tmp_path, "single", 4, False, training={"micro_batch_size": 4}))
    for name, run in runs.items():
        worst = worst_relative(run["losses"], single.losses)
        print(f"{name}: worst relative loss difference to one process {worst:.2e}")
        assert worst < RELATIVE_TOLERANCE, (name, run["losses"], single.losses)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"training": {"gradient_checkpointing": True, "selective_layers": 2}},
            "gradient_checkpointing on every layer: no layer is left .*set training.checkpoint_layers",
        ),
        (
            {"training": {"selective_layers": 2}, "lora": {"enabled": True, "quantize_base": "nf4"}},
            "with lora.quantize_base: .*use gradient_checkpointing instead",
        ),
    ],
)
def test_what_selective_layers_cannot_do_is_refused_at_load(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, **sections)


def test_eager_attention_is_refused_with_the_fix(tmp_path):
    """Eager attention is several ops (and flex attention, refused the same way, needs a GPU)."""
    config = tiny_config(tmp_path, training={"selective_layers": 1}, model={"attn_implementation": "eager"})
    with pytest.raises(ConfigError, match="eager attention is not one kernel.*auto, varlen or sdpa"):
        build_model(config, 64)
