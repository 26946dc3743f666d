"""The memory planner on the CPU: the estimate against hand-computed bytes, monotonicity, the choice, errors."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import LlamaConfig

from tests.kernels.helpers import saved_bytes
from tests.runtime.configs import TINY_MODEL, llama_1b_shape, tiny_config
from tigon.runtime import cli, planner
from tigon.runtime.config import ConfigError, parse_config
from tigon.runtime.planner import GiB, ModelShape, PlanError, Setting, Workload, estimate

TINY = ModelShape.from_hf_config(
    LlamaConfig(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=10,
        tie_word_embeddings=False,
    )
)
LLAMA_1B = llama_1b_shape()


def bf16_work(shape: ModelShape, seq_len: int, **changes) -> Workload:
    return Workload(shape, seq_len, weight_bytes=2, compute_bytes=2, autocast=False, attention="sdpa", **changes)


def test_parameter_count_matches_the_built_model():
    from transformers import LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
    )
    config.vocab_size = 300
    for tied in (False, True):
        config.tie_word_embeddings = tied
        model = LlamaForCausalLM(config)
        assert ModelShape.from_hf_config(config).params == sum(p.numel() for p in model.parameters())


def test_a_model_whose_every_layer_is_an_moe_block_has_no_dense_width():
    """Qwen 3.5 MoE's config has no intermediate_size: every layer is an MoE block, with a gated shared expert."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from tigon.runtime.planner import MoeShape

    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    text |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    config = AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=dict(depth=1, out_hidden_size=64))
    shape = ModelShape.from_hf_config(config)
    assert shape.intermediate == 0 and shape.moe == MoeShape(4, 32, 2, 2, 48, True, False)
    model = AutoModelForImageTextToText.from_config(config)
    block = model.model.language_model.layers[0].mlp
    assert shape.moe.params(64) == sum(p.numel() for p in block.parameters())


def test_estimate_matches_hand_computed_bytes():
    """h=8, i=16, 2 layers, 2 heads of 4 (1 kv head), V=10, untied; bf16, SDPA, 2 sequences of 4 tokens."""
    work = bf16_work(TINY, 4)
    # parameters: embed 80 + head 80 + 2 x (q 64 + k 32 + v 32 + o 64 + MLP 384 + norms 16) + final norm 8
    assert TINY.params == 1352
    persistent = 1352 * 2 + 2 * 1352 * 2 + planner.OVERHEAD  # bf16 weights + AdamW's two states

    # checkpointing off, kernels off; per token of a layer: norms 2 x (4h + 4 + 2h) = 104, q/k/v input 16,
    # attention: q, k, v repeated, output 2 x 4 x 8 + lse 4 x 2 + mask bias 2 x 4 = 80; MLP input 16,
    # MLP 3 x 2 x 16 = 96, down input 32
    layer = (104 + 16 + 80 + 16 + 96 + 32) * 8
    head = (52 + 16) * 8  # final norm + lm_head's input
    per_batch = 24 * 8 + 2 * 2 * 4 * 8  # ids/labels/positions + cos/sin
    backward = max(3 * 2 * 16, 3 * 2 * 8 + 4 * 8) * 8  # the MLP's gradients
    head_grad = 80 * 2
    # the peak is the loss: Hugging Face's ForCausalLMLoss peaks at 12 bytes per logit (2 x 4 tokens x V)
    loss = persistent + 2 * layer + head + per_batch + 12 * 8 * 10
    top = persistent + 2 * layer + head + per_batch + backward + head_grad
    got = estimate(work, Setting(2, 1, checkpointing=False, kernels=False))
    assert got.peak == loss > top and got.moment == "loss"

    # checkpointing on: each layer keeps its bf16 input (2 x 8 per token) and the bool mask (2 x 4 x 4);
    # the peak is at the first layer's backward: one recomputed layer plus every gradient
    kept = 2 * 8 * 8
    first = persistent + kept + layer + backward + 1352 * 2 + per_batch + 2 * 16
    got = estimate(work, Setting(2, 1, checkpointing=True, kernels=False))
    assert got.peak == first and got.moment == "backward (first layer)"

    # tigon kernels: a norm keeps its input and 1/rms (2h + 4 = 20 instead of 52); SwiGLU keeps gate and up
    # (2 x 2 x 16 = 64 instead of 96); the MLP's backward gradient is one intermediate (2 x 16 = 32); the fused
    # linear cross entropy keeps no lm_head input and no logits: the hidden gradient 2 x 8 x 8, the head's weight
    # gradient 2 x 10 x 8, the losses 4 x 8 and one chunk of 2 tokens x 10 x 2 bytes
    layer_k = (2 * 20 + 16 + 80 + 16 + 64 + 32) * 8
    head_k = 20 * 8
    backward_k = max(2 * 16, 3 * 2 * 8 + 4 * 8) * 8
    loss_k = persistent + 2 * layer_k + head_k + per_batch + (128 + 160 + 32 + 40)
    top_k = persistent + 2 * layer_k + head_k + per_batch + backward_k + head_grad
    first_k = persistent + layer_k + backward_k + 1352 * 2 + per_batch  # the lighter layers move the peak here
    assert first_k > top_k > loss_k
    got = estimate(work, Setting(2, 1, checkpointing=False, kernels=True))
    assert got.peak == first_k and got.moment == "backward (first layer)"


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("kernels", [False, True])
def test_more_tokens_need_more_memory(checkpointing, kernels):
    peaks = [
        estimate(bf16_work(LLAMA_1B, seq), Setting(micro, 1, checkpointing, kernels)).peak
        for seq, micro in ((1024, 1), (1024, 2), (2048, 2), (4096, 2), (4096, 8), (8192, 8))
    ]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)


@pytest.mark.parametrize("seq_len", [512, 4096])
def test_checkpointing_and_kernels_need_less_memory(seq_len):
    work = bf16_work(LLAMA_1B, seq_len)
    full = estimate(work, Setting(8, 1, False, False)).peak
    assert estimate(work, Setting(8, 1, True, False)).peak < full
    assert estimate(work, Setting(8, 1, False, True)).peak < full
    assert estimate(work, Setting(8, 1, True, True)).peak < estimate(work, Setting(8, 1, True, False)).peak


def test_accumulation_keeps_the_gradients_during_the_next_micro_batch():
    work = bf16_work(LLAMA_1B, 4096)
    one = estimate(work, Setting(4, 1, False, False))
    two = estimate(work, Setting(4, 2, False, False))
    assert one.moment == two.moment == "loss"
    assert two.peak - one.peak == LLAMA_1B.params * 2  # the bf16 gradients of every parameter


@pytest.mark.parametrize("world_size", [1, 4])
def test_fsdp2_accumulation_keeps_whole_float32_gradients_during_the_next_micro_batch(world_size):
    """FSDP2 reduce-scatters once a step: until then each rank holds every parameter's gradient unsharded, in
    float32 (on one H200, Llama-3.2-1B at 4 x 4096 tokens: 4.60 GiB more with accumulation 2, 1.24e9 x 4 bytes)."""
    work = bf16_work(LLAMA_1B, 4096, strategy="fsdp", world_size=world_size)
    one = estimate(work, Setting(4, 1, False, False))
    two = estimate(work, Setting(4, 2, False, False))
    assert two.moment == "loss" and two.parts["gradients"] == LLAMA_1B.params * 4
    assert two.peak - one.peak == LLAMA_1B.params * 4 - one.parts.get("gradients", 0)


def test_copy_engine_gathers_count_their_workspace_of_the_largest_shard():
    """`parallelism.copy_engine_gathers` keeps a symmetric-memory workspace, outside PyTorch's allocator, as large
    as the largest unit's shard: on Llama-3.2-1B (tied) a layer's or the embedding's, whichever is larger."""
    plain = bf16_work(LLAMA_1B, 4096, strategy="fsdp", world_size=4)
    copied = dataclasses.replace(plain, copy_engine_gathers=True)
    setting = Setting(4, 1, False, True)
    largest = max(LLAMA_1B.layer_params, LLAMA_1B.vocab * LLAMA_1B.hidden) * 2 // 4
    assert largest == LLAMA_1B.vocab * LLAMA_1B.hidden // 2  # the embedding: 262 M weights
    assert estimate(copied, setting).parts["overhead"] - estimate(plain, setting).parts["overhead"] == largest
    assert estimate(copied, setting).peak - estimate(plain, setting).peak == largest


def test_sharded_accumulation_keeps_only_each_ranks_shard_of_the_gradients():
    """With `parallelism.accumulate_sharded` every micro-batch reduce-scatters: between micro-batches a rank holds
    its shard of the gradients in the weights' dtype, not all of them in float32 (the CPU worker test of this
    counts the bytes FSDP2 really holds)."""
    work = bf16_work(LLAMA_1B, 4096, strategy="fsdp", world_size=4)
    whole = estimate(work, Setting(4, 2, False, True))
    sharded = estimate(work, Setting(4, 2, False, True, accumulate_sharded=True))
    assert whole.parts["gradients"] == LLAMA_1B.params * 4
    assert sharded.parts["gradients"] == LLAMA_1B.params * 2 // 4
    assert whole.peak - sharded.peak == LLAMA_1B.params * 4 - LLAMA_1B.params * 2 // 4
    # each micro-batch but the last adds a reduce-scatter of the float32 gradients (3/4 of them arrive elsewhere)
    extra = planner.sharded_accumulation_tokens(work, sharded.setting)
    assert extra == 0.5 * 4 * 0.75 * 2200 / 6
    slower = planner.relative_step_time(work, sharded.setting) / planner.relative_step_time(work, whole.setting)
    assert slower == pytest.approx(1 + extra / (4 * 4096 + 512 + planner.gather_tokens(work)))


def test_the_planner_accumulates_sharded_only_where_it_keeps_float32_gradients(tmp_path):
    """fp32 weights: the shards accumulate in float32 as the whole gradients would, so the planner tries it and,
    where memory is tight, takes it; bf16 weights: only where the config says so (the shards accumulate in
    bf16), and a run that fits nothing is told what it would need."""
    fp32_config = plan_config(tmp_path, parallelism={"strategy": "fsdp"})
    fp32_config.model.dtype = "float32"
    fp32 = planner.workload(fp32_config, world_size=4)
    bf16 = planner.workload(plan_config(tmp_path, parallelism={"strategy": "fsdp"}), world_size=4)
    current = Setting(8, 1, False, True)
    assert any(s.accumulate_sharded for s in planner.candidates(fp32, current))
    assert not any(s.accumulate_sharded for s in planner.candidates(bf16, current))
    assert not any(s.accumulate_sharded and s.accumulation == 1 for s in planner.candidates(fp32, current))
    consenting = dataclasses.replace(bf16, accumulate_sharded=True)
    assert any(s.accumulate_sharded for s in planner.candidates(consenting, current))
    one_gpu = planner.workload(fp32_config, world_size=1)
    assert not any(s.accumulate_sharded for s in planner.candidates(one_gpu, current))
    hybrid = dataclasses.replace(fp32, world_size=8, shard_size=4)  # 2 replicas: an all-reduce each micro-batch
    assert not any(s.accumulate_sharded for s in planner.candidates(hybrid, current))
    hybrid_consenting = dataclasses.replace(hybrid, accumulate_sharded=True)
    assert any(s.accumulate_sharded for s in planner.candidates(hybrid_consenting, current))

    plan = planner.make_plan(fp32_config, gpu_memory=12 * GiB, world_size=4)
    chosen = plan.chosen.setting
    assert chosen.accumulate_sharded and chosen.accumulation > 1, plan.table()
    assert "--set parallelism.accumulate_sharded=true" in plan.table()
    assert f"x accumulation {chosen.accumulation} sharded" in plan.table()
    assert planner.apply_plan(fp32_config, plan).parallelism.accumulate_sharded

    tight = plan_config(tmp_path, seq_len=8192, micro_batch=1, parallelism={"strategy": "fsdp"})
    tight.training.gradient_accumulation_steps = 8
    with pytest.raises(PlanError) as error:
        planner.make_plan(tight, gpu_memory=8 * GiB, world_size=2)
    sharded = estimate(
        planner.workload(tight, world_size=2),
        Setting(1, 8, True, True, accumulate_sharded=True),
    )
    assert f"parallelism.accumulate_sharded: true, {sharded.peak / GiB:.2f} GiB for that setting" in str(error.value)
    assert "the shards accumulate in bf16/fp16" in str(error.value)


def test_fused_loss_removes_the_logits():
    logits = estimate(bf16_work(LLAMA_1B, 4096, fused_loss=False), Setting(8, 1, True, True))
    fused = estimate(bf16_work(LLAMA_1B, 4096), Setting(8, 1, True, True))
    # 8 x 4096 tokens x 128256 x 12 bytes of loss buffers are gone
    assert logits.moment == "loss" and logits.parts["loss and logits"] == 12 * 8 * 4096 * 128256
    assert logits.peak - fused.peak > 8 * 4096 * 128256 * 8
    assert fused.moment != "loss"


def test_fused_loss_at_hidden_4096_holds_its_logits_in_the_head_gradient():
    """Llama-3-8B's head, 8192 tokens: the op's 1024-token chunk is a quarter of the head's gradient and more than
    the hidden gradient, so it lives in the head's gradient and the loss's own buffer is one 16 MiB tile of the
    filling of those rows (1024 columns x 8192 tokens)."""
    shape = dataclasses.replace(LLAMA_1B, hidden=4096)
    tokens, chunk_logits = 2 * 4096, 1024 * 128256 * 2
    fused = planner.loss_bytes(bf16_work(shape, 4096), 2, fused=True)
    assert fused == 2 * tokens * 4096 + 2 * 128256 * 4096 + 8 * tokens + 8192 * 1024 * 2
    # A frozen head (LoRA) has no gradient to hold them: one 1024-token chunk of logits.
    lora = planner.loss_bytes(bf16_work(shape, 4096, lora_rank=8), 2, fused=True)
    assert lora == 2 * tokens * 4096 + 8 * tokens + chunk_logits
    # At 32768 tokens the hidden gradient outweighs the chunk: a buffer of its own, as for Llama-3.2-1B's chunk,
    # which is half its head's gradient.
    long = planner.loss_bytes(bf16_work(shape, 4096), 8, fused=True)
    assert long == 2 * 4 * tokens * 4096 + 2 * 128256 * 4096 + 8 * 4 * tokens + chunk_logits
    small = planner.loss_bytes(bf16_work(LLAMA_1B, 4096), 2, fused=True)
    assert small == 2 * tokens * 2048 + 2 * 128256 * 2048 + 8 * tokens + chunk_logits


def test_loss_chunks_grow_only_into_memory_the_step_holds_anyway():
    work = bf16_work(LLAMA_1B, 4096)
    checkpointed = Setting(8, 1, True, True)  # the backward's recomputed layer peaks, far above the loss
    assert planner.loss_chunk_tokens(work, checkpointed) == planner.LOSS_CHUNK_LIMIT
    base, grown = estimate(work, checkpointed), estimate(work, checkpointed, loss_chunk_tokens=planner.LOSS_CHUNK_LIMIT)
    assert grown.peak == base.peak and grown.moment == base.moment != "loss"
    assert grown.moments["loss"] - base.moments["loss"] == (4096 - 1024) * 128256 * 2  # 3072 more tokens of logits
    assert grown.moments["loss"] <= planner.LOSS_CHUNK_MARGIN * base.peak
    # Without checkpointing the loss's moment is within a few percent of the peak: the op's own rule stays.
    assert planner.loss_chunk_tokens(work, Setting(8, 1, False, True)) is None
    assert planner.loss_chunk_tokens(work, Setting(8, 1, True, False)) is None  # no fused loss without the kernels
    assert planner.loss_chunk_tokens(bf16_work(LLAMA_1B, 4096, fused_loss=False), checkpointed) is None
    # A micro-batch of fewer tokens than the limit is one chunk; one the op's rule already covers gets None.
    assert planner.loss_chunk_tokens(bf16_work(LLAMA_1B, 2048), Setting(1, 1, True, True)) == 2048
    assert planner.loss_chunk_tokens(bf16_work(LLAMA_1B, 1024), Setting(1, 1, True, True)) is None


def test_sharding_divides_the_states():
    single = estimate(bf16_work(LLAMA_1B, 2048), Setting(1, 1, True, True))
    fsdp = estimate(bf16_work(LLAMA_1B, 2048, strategy="fsdp", world_size=8), Setting(1, 1, True, True))
    assert fsdp.parts["optimizer states"] == single.parts["optimizer states"] // 8
    assert fsdp.peak < single.peak
    # hybrid sharding: 8 ranks as 4 replicas of 2-rank shard groups hold what 2 ranks of plain FSDP2 hold
    hybrid_work = bf16_work(LLAMA_1B, 2048, strategy="fsdp", world_size=8, shard_size=2)
    two_ranks = bf16_work(LLAMA_1B, 2048, strategy="fsdp", world_size=2)
    assert estimate(hybrid_work, Setting(1, 1, True, True)) == estimate(two_ranks, Setting(1, 1, True, True))
    assert planner.gather_tokens(hybrid_work) == planner.gather_tokens(two_ranks)


def test_a_node_shard_group_is_the_ranks_of_a_node(tmp_path, monkeypatch):
    config = plan_config(tmp_path, parallelism={"strategy": "fsdp", "shard_size": "node"})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    work = planner.workload(config, world_size=16)
    assert (work.world_size, work.shards) == (16, 8)
    assert "fsdp x 16 (shard groups of 8)" in planner.make_plan(config, 141 * GiB, 16, work).table()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert planner.workload(config, world_size=4).shards == 4


def test_sharded_weights_make_each_micro_batch_cost_a_gather():
    """FSDP2 and ZeRO-3 gather the weights again every micro-batch, so under them a step of fewer, larger
    micro-batches ranks faster than the same tokens in more, smaller ones, by more than on one GPU; DDP and
    ZeRO-2 gather nothing."""
    one_big, two_small = Setting(8, 1, False, True), Setting(4, 2, False, True)
    for changes in ({}, {"world_size": 4}, {"world_size": 4, "strategy": "deepspeed", "zero_stage": 2}):
        assert planner.gather_tokens(bf16_work(LLAMA_1B, 4096, **changes)) == 0
    fsdp = bf16_work(LLAMA_1B, 4096, strategy="fsdp", world_size=4)
    zero3 = bf16_work(LLAMA_1B, 4096, strategy="deepspeed", zero_stage=3, world_size=4)
    # 2 passes x 2 bytes x 3/4 of the weights arrive a parameter, against 6 FLOPs a parameter a token
    assert planner.gather_tokens(fsdp) == planner.gather_tokens(zero3) == 2 * 2 * 0.75 * 2200 / 6
    assert planner.gather_tokens(bf16_work(LLAMA_1B, 4096, strategy="fsdp", world_size=2)) == 2 * 2 * 0.5 * 2200 / 6

    def slowdown(work):
        return planner.relative_step_time(work, two_small) / planner.relative_step_time(work, one_big)

    single = bf16_work(LLAMA_1B, 4096)
    assert slowdown(fsdp) == pytest.approx(
        2 * (16384 + 512 + planner.gather_tokens(fsdp)) / (32768 + 512 + planner.gather_tokens(fsdp))
    )
    assert slowdown(fsdp) > slowdown(single) > 1


def test_fp8_micro_batches_rank_in_the_order_measured():
    """An FP8 micro-batch costs more than a bf16 one (FP8_MICRO_BATCH_TOKENS), which puts the FP8 settings measured
    on 4 x H200 (Llama-3-8B, sequence 4096, FSDP2; docs/planner.md) in their measured order: micro-batch 8 with 22
    whole layers ahead of 2 x 4 with 24 selective (measured 1.19x faster; bf16's costs ranked it behind), and 8 with
    23 selective ahead of 4 x 2 keeping everything (1.03x)."""
    from benchmarks.presets import LLAMA_3_8B

    shape = ModelShape.from_hf_config(LlamaConfig(**LLAMA_3_8B))
    bf16 = bf16_work(shape, 4096, strategy="fsdp", world_size=4, compiled=True)
    fp8 = dataclasses.replace(bf16, fp8=True)
    whole_8, selective_2x4 = Setting(8, 1, True, True, 22, 0), Setting(2, 4, False, True, None, 24)
    selective_8, everything_4x2 = Setting(8, 1, False, True, None, 23), Setting(4, 2, False, True)

    def time(work, setting):
        return planner.relative_step_time(work, setting)

    assert time(fp8, whole_8) < time(fp8, selective_2x4) and time(bf16, whole_8) > time(bf16, selective_2x4)
    assert time(fp8, selective_8) < time(fp8, everything_4x2)


def plan_config(tmp_path, seq_len=4096, micro_batch=8, parallelism=None, **training):
    """tiny_config with Llama-3.2-1B widths (the planner reads only the config; nothing is built)."""
    overrides = {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    }
    return tiny_config(
        tmp_path,
        model={"config_name": "llama", "config_overrides": overrides, "tokenizer": "char", "dtype": "bfloat16"},
        data={"train": "unused.jsonl", "max_seq_len": seq_len},
        training={"max_steps": 1, "micro_batch_size": micro_batch, "precision": "bf16", **training},
        **({"parallelism": parallelism} if parallelism else {}),
    )


def test_plan_turns_checkpointing_off_when_memory_is_ample(tmp_path):
    config = plan_config(tmp_path, seq_len=1024, gradient_checkpointing=True)
    plan = planner.make_plan(config, gpu_memory=141 * GiB, world_size=1)
    assert plan.chosen.setting == Setting(8, 1, checkpointing=False, kernels=True)
    assert plan.current.setting == Setting(8, 1, checkpointing=True, kernels=False)
    table = plan.table()
    assert "plan: micro-batch 8 x accumulation 1, checkpointing off, kernels on" in table
    assert "--set training.gradient_checkpointing=false --set kernels.enabled=true" in table
    applied = planner.apply_plan(config, plan)
    assert not applied.training.gradient_checkpointing and applied.kernels.enabled
    assert applied.training.micro_batch_size == 8 and applied.data == config.data


def test_plan_turns_checkpointing_on_when_memory_is_tight(tmp_path):
    config = plan_config(tmp_path, seq_len=4096)
    work = planner.workload(config, world_size=1)
    settings = planner.candidates(work, planner.setting_of(config))
    smallest_off = min(estimate(work, s).peak for s in settings if not s.checkpointing)
    smallest_on = min(estimate(work, s).peak for s in settings if s.checkpointing)
    assert smallest_on < smallest_off
    gpu_memory = int(smallest_on / planner.FIT_FRACTION) + planner.CUDA_CONTEXT + GiB // 100
    plan = planner.make_plan(config, gpu_memory=gpu_memory, world_size=1, work=work)
    assert plan.chosen.setting.checkpointing
    assert plan.chosen.peak <= plan.budget < smallest_off
    # the global batch stays 8 sequences: the micro-batch shrinks and accumulation grows
    chosen = plan.chosen.setting
    assert chosen.micro_batch * chosen.accumulation == 8 and chosen.micro_batch < 8


def test_nothing_fits_names_the_smallest_setting(tmp_path):
    config = plan_config(tmp_path, seq_len=8192)
    with pytest.raises(PlanError) as error:
        planner.make_plan(config, gpu_memory=8 * GiB, world_size=1)
    message = str(error.value)
    smallest = min(
        estimate(planner.workload(config, 1), s).peak
        for s in planner.candidates(planner.workload(config, 1), planner.setting_of(config))
    )
    assert "nothing fits in 8.00 GiB" in message
    assert "micro-batch 1 x accumulation 8, checkpointing on, kernels on" in message
    assert f"needs {smallest / GiB:.2f} GiB" in message
    assert "data.max_seq_len" in message


def test_oom_advice_names_the_config_keys(tmp_path):
    config = plan_config(tmp_path, seq_len=4096, gradient_checkpointing=False)
    advice = planner.oom_advice(config, gpu_memory=80 * 10**9, world_size=1)
    work = planner.workload(config, 1)
    current = estimate(work, planner.setting_of(config)).peak
    assert advice.startswith(f"CUDA out of memory: the planner estimates this run's peak at {current / GiB:.2f} GiB")
    plan = planner.make_plan(config, 80 * 10**9, 1)
    for change in planner.config_changes(planner.setting_of(config), plan.chosen.setting):
        assert f"--set {change}" in advice
    assert "training.plan: auto" in advice
    assert "nothing fits" in planner.oom_advice(config, gpu_memory=4 * GiB, world_size=1)


def test_out_of_memory_error_keeps_torchs_account_of_the_allocation(tmp_path):
    """The advice first, then what torch measured (asked for, free, allocated, reserved but unallocated), which
    tells memory used from memory fragmented; torch's own advice is left out."""
    config = plan_config(tmp_path, seq_len=4096, gradient_checkpointing=False)
    config.training.gpu_memory = "80GB"
    account = (
        "Tried to allocate 3.91 GiB. GPU 0 has a total capacity of 139.80 GiB of which 2.12 GiB is free. Including "
        "non-PyTorch memory, this process has 137.66 GiB memory in use. Of the allocated memory 110.52 GiB is "
        "allocated by PyTorch, and 25.88 GiB is reserved by PyTorch but unallocated."
    )
    torch_error = torch.OutOfMemoryError(
        f"CUDA out of memory. {account} If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
        "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    error = planner.out_of_memory_error(config, torch_error)
    assert isinstance(error, planner.TrainingOutOfMemory)
    assert str(error) == f"{planner.oom_advice(config, 80 * 10**9)} (torch: {account})"


def test_parse_memory():
    assert planner.parse_memory("80GB") == 80 * 10**9
    assert planner.parse_memory("141GiB") == 141 * GiB
    assert planner.parse_memory("81920MiB") == 80 * GiB
    assert planner.parse_memory("80") == 80 * 10**9
    with pytest.raises(planner.ConfigError, match="write a size like 80GB"):
        planner.parse_memory("lots")


def test_plan_auto_without_a_gpu_keeps_the_setting(tmp_path, caplog):
    config = plan_config(tmp_path, plan="auto")
    with caplog.at_level(logging.WARNING, logger="tigon.runtime"):
        assert planner.planned_config(config) is config
    assert "training.plan: auto plans for a CUDA GPU and none is present" in caplog.text


def test_plan_command_prints_the_table(tmp_path, capsys):
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(plan_config(tmp_path).model_dump(mode="json", exclude_defaults=True)))
    assert cli.main(["plan", str(path), "--gpu-memory", "141GiB", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory 141.00 GiB" in out and "plan: micro-batch" in out and "(current)" in out
    assert cli.main(["plan", str(path), "--gpu-memory", "2GiB"]) == 2
    assert "error: nothing fits in 2.00 GiB" in capsys.readouterr().err


def test_training_gpu_memory_is_the_memory_planned_for(tmp_path, capsys):
    """`training.gpu_memory` is what the planner plans for, on a machine without a GPU too (the whole GPU's memory
    where that is less); --gpu-memory still wins on the command line."""
    import yaml

    config = plan_config(tmp_path)
    config.training.gpu_memory = "20GiB"
    plan = planner.make_plan(config, world_size=1)
    assert plan.gpu_memory == 20 * GiB and plan.chosen.peak <= plan.budget
    assert plan.budget == int((20 * GiB - planner.CUDA_CONTEXT) * planner.FIT_FRACTION)
    advice = planner.oom_advice(config, gpu_memory=20 * GiB, world_size=1)
    assert "within 20.00 GiB of GPU memory (training.gpu_memory)" in advice
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    assert cli.main(["plan", str(path), "--gpus", "1"]) == 0
    assert "GPU memory 20.00 GiB (training.gpu_memory), budget" in capsys.readouterr().out
    assert cli.main(["plan", str(path), "--gpus", "1", "--gpu-memory", "40GiB"]) == 0
    assert "GPU memory 40.00 GiB, budget" in capsys.readouterr().out
    config.training.gpu_memory = None
    with pytest.raises(ConfigError, match="no CUDA GPU here to plan for: pass --gpu-memory"):
        planner.make_plan(config, world_size=1)


def test_plan_checkpoints_only_as_many_layers_as_memory_needs(tmp_path, capsys):
    import yaml

    path = tmp_path / "run.yaml"
    config = plan_config(tmp_path)
    config.model.attn_implementation = "sdpa"  # the packed mask, which the checkpoints keep
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    assert cli.main(["plan", str(path), "--gpu-memory", "13GiB", "--gpus", "1"]) == 0  # 15 whole, 1 selective
    assert "plan: micro-batch 2 x accumulation 4, checkpointing 15 + 1 selective, kernels on" in capsys.readouterr().out
    assert cli.main(["plan", str(path), "--gpu-memory", "16GiB", "--gpus", "1"]) == 0  # 4 layers keep theirs
    out = capsys.readouterr().out
    assert "plan: micro-batch 1 x accumulation 8, checkpointing 12 selective, kernels on" in out
    assert "--set training.selective_layers=12" in out and "gradient_checkpointing" not in out.splitlines()[-1]
    assert len(out.splitlines()) < 40  # the table shows the fastest partial setting that fits, not every count
    config.training.compile = True  # compiled layers recompute selectively too
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    assert cli.main(["plan", str(path), "--gpu-memory", "16GiB", "--gpus", "1"]) == 0
    assert "plan: micro-batch 1 x accumulation 8, checkpointing 12 selective, kernels on" in capsys.readouterr().out
    config.training.precision = "fp8"  # a micro-batch costs FP8 more (FP8_MICRO_BATCH_TOKENS): the largest wins
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    assert cli.main(["plan", str(path), "--gpu-memory", "16GiB", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "plan: micro-batch 8 x accumulation 1, checkpointing 15 layers, kernels on" in out
    assert "compute bf16/fp16 (decoder Linear layers fp8)" in out
    config.training.precision = "bf16"
    config.model.attn_implementation = "eager"  # not one kernel whose output a layer can keep
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    assert cli.main(["plan", str(path), "--gpu-memory", "32GiB", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "checkpointing" in out and "selective" not in out
    config.model.attn_implementation = "sdpa"
    config.training.compile = False
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    assert cli.main(["plan", str(path), "--gpu-memory", "141GiB", "--gpus", "1"]) == 0
    assert "checkpointing off, kernels on" in capsys.readouterr().out


def test_partial_checkpointing_lies_between_none_and_every_layer():
    work = bf16_work(LLAMA_1B, 4096)
    none, every = (estimate(work, Setting(4, 1, on, True)).peak for on in (False, True))
    partial = [estimate(work, Setting(4, 1, True, True, n)).peak for n in range(1, work.shape.layers)]
    # all but the top layer: its activations stand in for the recomputed layer of full checkpointing
    assert every == min(partial) and max(partial) < none
    assert partial == sorted(partial, reverse=True)  # each layer checkpointed more keeps less
    assert partial[0] - partial[1] == partial[1] - partial[2] > 0  # one layer's activations less its input


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_norm_and_mlp_formulas_match_what_autograd_saves(kernels, frozen):
    """bf16 on the CPU (tigon's autograd functions save the same tensors on either device)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    from tigon.kernels.modules import GatedMLP, RMSNorm

    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_hidden_layers=1)
    shape = ModelShape.from_hf_config(config)
    norm, mlp = LlamaRMSNorm(64).to(torch.bfloat16), LlamaMLP(config).to(torch.bfloat16)
    if kernels:
        norm, mlp = RMSNorm.from_module(norm, in_place_backward=True), GatedMLP.from_module(mlp, config)
    lora = {"lora_rank": 4, "lora_targets": ("q_proj", "v_proj")} if frozen else {}
    for parameter in [*norm.parameters(), *mlp.parameters()]:
        parameter.requires_grad_(not frozen)  # LoRA on attention only: the norm and the MLP are frozen
    work = bf16_work(shape, 16, **lora)
    tokens = 3 * 16
    x = torch.randn(3, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    assert saved_bytes(lambda: norm(x), norm.parameters()) == planner.norm_bytes(work, kernels) * tokens
    assert saved_bytes(lambda: mlp(x), mlp.parameters()) == planner.mlp_bytes(work, kernels) * tokens


@pytest.mark.parametrize("kernels", [False, True])
def test_decoder_layer_formula_matches_what_autograd_saves(kernels, restore_rope):
    """A whole Llama decoder layer (SDPA with the packed mask, bf16): the saved bytes are layer_bytes exactly.

    On the CPU, SDPA saves what CUDA's memory-efficient kernel saves (q, k and v repeated, the output, the
    log-sum-exp, the mask as a bias); tigon's autograd functions run through Triton's interpreter.
    """
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from tigon.kernels.patching import apply
    from tigon.runtime.data import packed_attention_mask

    config = LlamaConfig(
        hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1
    )
    config._attn_implementation = "sdpa"
    holder = torch.nn.Module()
    holder.config, holder.layer = config, LlamaDecoderLayer(config, 0).to(torch.bfloat16)
    if kernels:
        assert apply(holder).applied == {"rms_norm": 2, "gated_mlp": 1, "rope": 1}
    x = torch.randn(3, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(16).repeat(3, 1)
    positions[1, 8:] = torch.arange(8)  # two documents in the second row
    cos, sin = LlamaRotaryEmbedding(config)(x, positions)
    mask = packed_attention_mask(positions, torch.bool)

    def layer(x):
        return holder.layer(x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=positions)

    shared = [cos, sin, mask, positions]  # the micro-batch's, shared by every layer
    measured = saved_bytes(lambda: layer(x), [*holder.layer.parameters(), *shared])
    work = bf16_work(ModelShape.from_hf_config(config), 16)
    assert measured == planner.layer_bytes(work, kernels) * 3 * 16


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_layer_config(tmp_path, quantize: str | None, kernels: bool, precision: str):
    """A tiny Llama (64 wide: bitsandbytes' CPU kernels quantize whole blocks of 64) with rank-4 adapters on all
    seven projections, built as a run builds it; bf16 weights under bf16 autocast, as a GPU run trains, or all
    float32."""
    dtype = "bfloat16" if precision == "bf16" else "float32"
    shape = {**TINY_MODEL, "hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4}
    return tiny_config(
        tmp_path,
        model={"config_overrides": shape, "dtype": dtype, "attn_implementation": "sdpa"},
        lora={"enabled": True, "r": 4, "target_modules": ALL_PROJECTIONS, "quantize_base": quantize},
        kernels={"enabled": kernels},
        training={"precision": precision},
        data={"max_seq_len": 16, "packing": False},
    )


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_a_lora_decoder_layer_saves_what_layer_bytes_says(tmp_path, quantize, kernels, precision, restore_rope):
    """QLoRA (a 4-bit bitsandbytes base) and LoRA on a dense base, built by build_model: a decoder layer's saved
    bytes are layer_bytes per token plus autocast's copies of the adapter weights, exactly.

    peft keeps the adapters in float32 and casts their input to it; under bf16 autocast each adapter's matmul
    then saves a bf16 copy of its own (three of the normed input for q, k and v, one of the attention output for
    o_proj), and the frozen base, 4-bit or not, saves nothing. All in float32, the adapters share the input.
    """
    import torch

    from tigon.runtime.batches import autocast
    from tigon.runtime.model import build_model

    config = lora_layer_config(tmp_path, quantize, kernels, precision)
    model = build_model(config, 64)
    base = model.get_base_model().model
    layer = base.layers[0]
    assert (type(layer.mlp.down_proj.base_layer).__name__ == "Linear4bit") == (quantize is not None)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    x = torch.randn(3, 16, 64, dtype=dtype, requires_grad=True)
    positions = torch.arange(16).repeat(3, 1)
    cos, sin = base.rotary_emb(x, positions)

    def run():
        with autocast(torch.device("cpu"), precision):
            layer(x, attention_mask=None, position_embeddings=(cos, sin), position_ids=positions)

    measured = saved_bytes(run, [*layer.parameters(), cos, sin, positions])
    work = planner.workload(config, world_size=1)
    assert work.attention == "sdpa_causal" and work.lora_copy_bytes == (2 if precision == "bf16" else 0)
    casts = planner.adapter_cast_bytes(work)
    widths = (6 * 64 + 192) + (64 + 16 + 16 + 64 + 192 + 192 + 64)  # in and out features of the seven adapters
    assert casts == (2 * 4 * widths if precision == "bf16" else 0)  # bf16 x rank 4
    assert measured == planner.layer_bytes(work, kernels) * 3 * 16 + casts


def lora_layer_peak(tmp_path, quantize: str | None, checkpointed: bool) -> tuple[int, int, int]:
    """(measured peak bytes, the planner's saved bytes, its adapter_forward_bytes per token) of a LoRA decoder
    layer's forward, or with `checkpointed` of the backward's recompute of it; run in a fresh process (below)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from tests.kernels.helpers import peak_bytes
    from tigon.runtime.batches import autocast
    from tigon.runtime.model import build_model

    config = lora_layer_config(tmp_path, quantize, kernels=False, precision="bf16")
    base = build_model(config, 64).get_base_model().model
    layer = base.layers[0]
    x = torch.randn(3, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(16).repeat(3, 1)
    cos, sin = base.rotary_emb(x, positions)

    def forward():
        with autocast(torch.device("cpu"), "bf16"):
            return layer(x, attention_mask=None, position_embeddings=(cos, sin), position_ids=positions)

    made_before = [*layer.parameters(), x, cos, sin, positions]
    if checkpointed:
        out = checkpoint(forward, use_reentrant=False)
        grad = torch.ones_like(out)
        measured = peak_bytes(lambda: out.backward(grad), [*made_before, out, grad])
    else:
        measured = peak_bytes(forward, made_before)
    work = planner.workload(config, world_size=1)
    saved = planner.layer_bytes(work, False) * 3 * 16 + planner.adapter_cast_bytes(work)
    return measured, saved, planner.adapter_forward_bytes(work, recompute=checkpointed)


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_a_lora_layer_peaks_in_its_widest_adapter_as_adapter_forward_bytes_says(tmp_path, quantize, checkpointed):
    """A LoRA decoder layer's forward (checkpointed: the backward's recompute of it) peaks in down_proj's adapter:
    beside the layer's saved bytes, the gated product and peft's float32 cast of it, the base layer's output, the
    adapter's and its scaled copy (the recompute stops before the scaled copy): adapter_forward_bytes, exactly.

    Hugging Face's eager layer, every tensor counted from the operation that makes it until it is freed. The
    residual stream and the MLP's normed input are live there too (c h each), as in any layer's forward, adapters
    or not; the planner counts neither. Measured in a fresh process, so that nothing an earlier test left in the
    test process counts toward the peak.
    """
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        measured, saved, transient = pool.submit(lora_layer_peak, tmp_path, quantize, checkpointed).result()
    assert transient == 192 * (2 + 4) + 64 * (2 + 2 * (1 if checkpointed else 2))
    assert measured == saved + transient * 3 * 16 + 2 * (2 * 64) * 3 * 16


def test_the_planner_counts_the_adapters_in_the_dtype_peft_keeps_them(tmp_path):
    """float32 adapters on a bf16 4-bit base: the estimate's weights are the base's plus the adapters' bytes, its
    gradients those bytes again and AdamW's states twice them."""
    import torch

    from tigon.runtime.model import build_model

    config = lora_layer_config(tmp_path, "nf4", kernels=True, precision="bf16")
    adapters = [p for p in build_model(config, 64).parameters() if p.requires_grad]
    work = planner.workload(config, world_size=1)
    assert {p.dtype for p in adapters} == {torch.float32} and sum(p.numel() for p in adapters) == work.trainable
    adapter_memory = sum(p.numel() * p.element_size() for p in adapters)
    base = work.shape.params * 2 - int(work.linear_params * (2 - planner.QUANTIZED_BYTES[True]))
    step = estimate(work, planner.setting_of(config))
    assert step.parts["weights"] == base + adapter_memory
    assert step.parts["optimizer states"] == 2 * adapter_memory
    fixed = step.parts["weights"] + step.parts["optimizer states"] + step.parts["overhead"]
    assert step.moments["optimizer"] - fixed == adapter_memory  # the gradients (one process: no DDP buckets)


def test_unpacked_sdpa_is_planned_as_plain_causal_attention(tmp_path, restore_rope):
    """packing off: one document per row, no mask; the layer saves what the unmasked formula says."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    packed = plan_config(tmp_path)
    packed.model.attn_implementation = "sdpa"
    unpacked = packed.model_copy(update={"data": packed.data.model_copy(update={"packing": False})})
    assert planner.workload(packed, world_size=1).attention == "sdpa"
    assert planner.workload(unpacked, world_size=1).attention == "sdpa_causal"

    config = LlamaConfig(
        hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1
    )
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16)
    x = torch.randn(3, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(16).repeat(3, 1)
    cos, sin = LlamaRotaryEmbedding(config)(x, positions)
    measured = saved_bytes(
        lambda: layer(x, attention_mask=None, position_embeddings=(cos, sin), position_ids=positions),
        [*layer.parameters(), cos, sin, positions],
    )
    work = dataclasses.replace(bf16_work(ModelShape.from_hf_config(config), 16), attention="sdpa_causal")
    assert measured == planner.layer_bytes(work, False) * 3 * 16


def test_packed_varlen_is_planned_without_the_mask(tmp_path):
    """auto (varlen on the GPU it plans for) and flex_attention keep no (B, T, T) mask: sdpa's packed estimate is
    larger by the mask its checkpoints keep and by its per-layer bias and repeated k and v, exactly."""
    packed = plan_config(tmp_path, gradient_checkpointing=True)
    setting = planner.setting_of(packed)

    def workload(attention: str) -> planner.Workload:
        model = packed.model.model_copy(update={"attn_implementation": attention})
        return planner.workload(packed.model_copy(update={"model": model}), world_size=1)

    auto, sdpa = workload("auto"), workload("sdpa")
    assert auto.attention == "varlen"
    assert planner.estimate(workload("flex_attention"), setting).peak == planner.estimate(auto, setting).peak
    q, kv, seq = 32 * 64, 8 * 64, 4096  # bf16: q, k and v repeated to every head, and the bias, against k, v
    assert planner.layer_bytes(sdpa, True) - planner.layer_bytes(auto, True) == 2 * (2 * q - 2 * kv) + 2 * seq
    masked, unmasked = planner.estimate(sdpa, setting), planner.estimate(auto, setting)
    assert masked.parts["activations"] - unmasked.parts["activations"] == 8 * seq**2  # the bool mask, micro-batch 8


@pytest.mark.parametrize("softcap", [None, 50.0])
def test_eager_attention_scores_formula_matches_what_autograd_saves(softcap):
    """Gemma 2's eager attention (bf16): beyond q and k, v repeated to every head, it saves the float32 softmax,
    its bf16 copy and, with softcapping, tanh's output: eager_scores_bytes per token."""
    import torch
    from transformers import Gemma2Config
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    config = Gemma2Config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=1,
        vocab_size=32,
        attn_logit_softcapping=softcap,
    )
    shape = ModelShape.from_hf_config(config)
    assert shape.attention_softcap == (softcap is not None) and shape.logit_softcap
    batch, seq, heads, groups, head_dim = 3, 16, 4, 2, 16
    attention = torch.nn.Module().train()
    attention.num_key_value_groups, attention.head_dim = groups, head_dim
    q = torch.randn(batch, heads, seq, head_dim, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, heads // groups, seq, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    mask = torch.zeros(batch, 1, seq, seq, dtype=torch.bfloat16)

    def scores(q):
        return eager_attention_forward(attention, q, k, v, mask, scaling=head_dim**-0.5, softcap=softcap)[0]

    per_token = saved_bytes(lambda: scores(q), [mask]) / (batch * seq)
    qkv = 2 * 3 * heads * head_dim  # q, and k and v repeated to every head
    work = dataclasses.replace(bf16_work(shape, seq), attention="eager")
    assert per_token - qkv == planner.eager_scores_bytes(work) == (8 if softcap else 6) * heads * seq


def test_a_sliding_window_shorter_than_the_sequence_is_planned_as_masked_sdpa(tmp_path):
    """transformers masks sliding-window layers when the window is shorter than the sequence, even for one
    document per row; a window that is off (Qwen2's use_sliding_window: false) or longer masks nothing."""
    from transformers import Gemma3TextConfig, Qwen2Config

    config = plan_config(tmp_path, seq_len=1024)
    config.model.attn_implementation = "sdpa"
    unpacked = config.model_copy(update={"data": config.data.model_copy(update={"packing": False})})
    gemma3 = ModelShape.from_hf_config(Gemma3TextConfig(sliding_window=512))
    assert gemma3.sliding_window == 512
    assert planner.attention_path(unpacked, gemma3) == "sdpa"
    assert planner.attention_path(unpacked, dataclasses.replace(gemma3, sliding_window=1024)) == "sdpa_causal"
    qwen2 = ModelShape.from_hf_config(Qwen2Config(sliding_window=256, use_sliding_window=False))
    assert qwen2.sliding_window is None and planner.attention_path(unpacked, qwen2) == "sdpa_causal"
    assert planner.attention_path(config, qwen2) == "sdpa"  # packed rows carry their documents' mask
    auto = config.model_copy(update={"model": config.model.model_copy(update={"attn_implementation": "auto"})})
    assert planner.attention_path(auto, gemma3) == "varlen"  # the window is the kernel's, not a mask's


# Tiny MoE configs of each family the planner models: 5 experts, 2 a token, each 40 wide; Qwen2-MoE's shared
# expert 56 wide; Qwen3-MoE renormalizing its top-k probabilities (Mixtral always does, Qwen2-MoE here not).
MOE_CASES = {
    "mixtral": {"num_local_experts": 5, "intermediate_size": 40},
    "qwen2_moe": {"num_experts": 5, "moe_intermediate_size": 40, "shared_expert_intermediate_size": 56},
    "qwen3_moe": {"num_experts": 5, "moe_intermediate_size": 40, "norm_topk_prob": True},
}


def moe_config(family: str, **changes):
    from transformers import AutoConfig

    sizes = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2}
    sizes |= {"num_hidden_layers": 1, "vocab_size": 100}
    return AutoConfig.for_model(family, **sizes | MOE_CASES[family] | changes)


@pytest.mark.parametrize("family", list(MOE_CASES))
def test_moe_parameter_count_matches_the_built_model(family):
    """Router, experts, the shared expert and its gate; Qwen2-MoE's dense layers (decoder_sparse_step,
    mlp_only_layers) counted with the dense MLP. Qwen3's q/k norms (2 x head_dim a layer) are not counted."""
    import torch
    from transformers import AutoModelForCausalLM

    sparse = {"decoder_sparse_step": 2, "mlp_only_layers": [1], "intermediate_size": 96}
    config = moe_config(family, num_hidden_layers=4, **(sparse if family == "qwen2_moe" else {}))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_hf_config(config)
    assert shape.moe.layers == (1 if family == "qwen2_moe" else 4)  # layer 3 only: 1 is dense, 0 and 2 not sparse
    qk_norms = 2 * shape.head_dim * shape.layers if family == "qwen3_moe" else 0
    assert shape.params + qk_norms == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("family", list(MOE_CASES))
def test_moe_block_formula_matches_what_autograd_saves(family, kernels, restore_rope):
    """One MoE block in bf16, transformers' grouped_mm experts (its default) or tigon's (moe_experts, Mixtral's
    float32 routing weights included): the saved bytes are moe_bytes a token, plus the experts' int32 offsets (4
    bytes an expert)."""
    import torch

    from tigon.kernels.patching import apply

    config = moe_config(family)
    config._experts_implementation = "grouped_mm"
    block_class = {"mixtral": "MixtralSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock"}
    module = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["_"])
    holder = torch.nn.Module()
    holder.config = config
    holder.mlp = getattr(module, block_class.get(family, "Qwen3MoeSparseMoeBlock"))(config).to(torch.bfloat16)
    if kernels:
        assert apply(holder).applied["gated_experts"] == 1
    x = torch.randn(3, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    shape = ModelShape.from_hf_config(config)
    measured = saved_bytes(lambda: holder.mlp(x), holder.mlp.parameters())
    assert measured == planner.moe_bytes(bf16_work(shape, 16), kernels) * 3 * 16 + 4 * shape.moe.experts


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_a_teacher_or_reference_adds_its_weights_hidden_states_and_forward(tmp_path, strategy):
    """sft -> distill with a 48-wide bf16 teacher, and sft -> dpo with its frozen copy (fp32 as the model): the
    persistent moments grow by the frozen model's weights (its parameters counted on the built model, halved by
    FSDP2 or DeepSpeed ZeRO-3 over 2 ranks), the loss moment also by its final hidden states (2 or 4 bytes x width
    per token) and, sharded, its head gathered whole, and its no-grad forward is a moment of its own."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from tests.runtime.configs import TINY_MODEL, save_llama

    teacher_dir = save_llama(tmp_path / "teacher", seed=1, hidden=48)
    teacher_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(teacher_dir).parameters())
    student_params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**TINY_MODEL, vocab_size=100)).parameters())
    setting = Setting(4, 2, False, False)
    sharded = strategy != "ddp"
    world = 2 if sharded else 1
    parallelism = {"strategy": "deepspeed", "zero_stage": 3} if strategy == "zero3" else {"strategy": strategy}
    base = estimate(planner.workload(tiny_config(tmp_path, parallelism=parallelism), world_size=world), setting)
    assert "frozen forward" not in base.moments
    teacher = {"type": "distill", "teacher": {"path": str(teacher_dir), "dtype": "bfloat16"}}
    for objective, params, size, hidden, width in [
        (teacher, teacher_params, 2, 48, 96),
        ({"type": "dpo"}, student_params, 4, TINY_MODEL["hidden_size"], TINY_MODEL["intermediate_size"]),
    ]:
        work = planner.workload(tiny_config(tmp_path, parallelism=parallelism, objective=objective), world_size=world)
        without = dataclasses.replace(work, frozen=None)
        got, alone = estimate(work, setting), estimate(without, setting)
        weights = params * size // world
        assert got.moments["optimizer"] - base.moments["optimizer"] == weights
        tokens = work.tokens(4)  # DPO: 4 pairs are 8 sequences
        read = size * hidden * tokens + (100 * hidden * size if sharded else 0)  # + the head, gathered
        teacher_logits = planner.loss_bytes(work, 4, True) - planner.loss_bytes(without, 4, True)  # distill's chunk
        assert got.moments["loss"] - alone.moments["loss"] == weights + read + teacher_logits
        forward = (4 * hidden + 3 * width) * size * tokens
        if sharded:  # two of its layers, its embedding and its head, gathered
            forward += (2 * work.frozen.shape.layer_params + 2 * 100 * hidden) * size
        assert planner.frozen_bytes(work, tokens) == (weights, read, forward)
        assert "frozen forward" in got.moments


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_precomputed_teacher_keeps_only_its_head_and_scores_the_data_before_training(tmp_path, strategy):
    """objective.teacher.precompute with a 48-wide bf16 teacher: every moment of training holds its head (100 x 48,
    whole) instead of its weights, so the estimate is lower by the teacher's weights less its head; the loss reads
    the same hidden states; there is no frozen forward, and its pass over the data is a moment of its own, the
    student as loaded beside the teacher as it would run beside it."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from tests.runtime.configs import TINY_MODEL, save_llama

    teacher_dir = save_llama(tmp_path / "teacher", seed=1, hidden=48)
    teacher_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(teacher_dir).parameters())
    world = 2 if strategy == "fsdp" else 1
    setting = Setting(4, 2, False, False)
    works = {
        precompute: planner.workload(
            tiny_config(
                tmp_path,
                parallelism={"strategy": strategy},
                objective={
                    "type": "distill",
                    "teacher": {"path": str(teacher_dir), "dtype": "bfloat16", "precompute": precompute},
                },
            ),
            world_size=world,
        )
        for precompute in (False, True)
    }
    beside, precomputed = (estimate(works[precompute], setting) for precompute in (False, True))
    head = 100 * 48 * 2
    lower = {
        moment: teacher_params * 2 // world - head
        for moment in ("optimizer", "backward (top layer)", "backward (first layer)")
    }
    lower["loss"] = teacher_params * 2 // world - (0 if world > 1 else head)  # sharded, beside: its head gathered
    for moment, want in lower.items():
        assert beside.moments[moment] - precomputed.moments[moment] == want, moment
    assert beside.moment == precomputed.moment and beside.peak - precomputed.peak == lower[beside.moment]
    tokens = works[True].tokens(4)
    assert planner.frozen_bytes(works[True], tokens) == (head, 2 * 48 * tokens, 0)
    assert "frozen forward" in beside.moments and "frozen forward" not in precomputed.moments
    student_params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**TINY_MODEL, vocab_size=100)).parameters())
    rows = 2 * 48 * tokens * world  # the round's hidden states, every rank's micro-batch
    teacher_beside = sum(planner.frozen_bytes(works[False], tokens))
    want = student_params * works[True].weight_bytes + planner.OVERHEAD + teacher_beside + rows
    assert precomputed.moments["teacher pass"] == want


def preference_work(tmp_path, objective, world_size: int = 1, **changes) -> Workload:
    """The planner's workload of plan_config (Llama-3.2-1B widths) under a preference objective."""
    raw = plan_config(tmp_path).model_dump(mode="json")
    raw["objective"] = objective
    raw["data"].pop("packing")  # unset, as in a config file: preference rows are padded unless it says otherwise
    for section, values in changes.items():
        raw[section] = {**raw[section], **values}
    return planner.workload(parse_config(raw), world_size=world_size)


@pytest.mark.parametrize("packing", [False, True])
def test_a_packed_or_padded_preference_row_saves_what_layer_bytes_says(packing, restore_rope):
    """A Llama decoder layer (SDPA, bf16) over a micro-batch of 2 pairs of 8-token sequences: padded, 4 rows with
    their (4, 1, 8, 8) mask; packed, one 32-token row with its block-diagonal mask. The saved bytes equal
    layer_bytes of the workload as attention sees it (`Workload.rows`: one row of 32 tokens when packed) x 32."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from tigon.runtime.data import packed_attention_mask

    config = LlamaConfig(
        hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1
    )
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16)
    positions = torch.arange(8).repeat(1, 4) if packing else torch.arange(8).repeat(4, 1)
    x = torch.randn(*positions.shape, 64, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(config)(x, positions)
    mask = packed_attention_mask(positions, torch.bool)
    measured = saved_bytes(
        lambda: layer(x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=positions),
        [*layer.parameters(), cos, sin, mask, positions],
    )
    work = bf16_work(ModelShape.from_hf_config(config), 8, loss="pairs", sequences=2, packed_rows=packing)
    assert work.tokens(2) == 32 and work.rows(2).seq_len == (32 if packing else 8)
    assert measured == planner.layer_bytes(work.rows(2), False) * 32


def test_the_fused_preference_op_keeps_what_the_planner_counts():
    """The fused DPO op (its chunked kernel, through Triton's interpreter) keeps the hidden states' gradient and the
    head's for the backward (its autograd node's saved tensors), in the dtype it reads them in: the `grads` part of
    preference_pass_bytes, exactly."""
    import torch

    from tigon.kernels import functional as F

    shape = dataclasses.replace(TINY, vocab=10, hidden=8)
    work = Workload(shape, 5, weight_bytes=4, compute_bytes=4, autocast=False, attention="varlen", loss="pairs")
    hidden = torch.randn(6, 5, 8, requires_grad=True)  # 3 pairs: chosen rows, then rejected
    weight = torch.randn(10, 8, requires_grad=True)
    target = torch.randint(0, 10, (6, 5))
    target[:, :2] = -100
    ref = torch.randn(6, dtype=torch.float64)
    loss, _ = F.fused_linear_dpo(hidden, weight, target, ref_logps=ref)
    assert type(loss.grad_fn).__name__ == "FusedLinearPreferenceFunctionBackward"
    kept = [tensor for tensor in loss.grad_fn.saved_tensors if tensor is not None]  # no bias: no bias gradient
    measured = sum(tensor.untyped_storage().nbytes() for tensor in kept)
    with_grads = planner.preference_pass_bytes(work, 6, 2, grads=True)
    without = planner.preference_pass_bytes(work, 6, 2, grads=False)
    assert measured == with_grads - without == 4 * (6 * 5 * 8 + 10 * 8)


def test_a_preference_micro_batch_is_its_pairs_sequences(tmp_path):
    """A micro-batch of 4 pairs is 8 sequences: with varlen (no mask) its layers and backward are sft's at
    micro-batch 8; the loss moment holds the fused preference op instead of the cross entropy; KTO's op runs on
    the completions only (half the hidden-state gradient), after its mismatched sequences' no-grad pass."""
    sft = planner.workload(plan_config(tmp_path), world_size=1)
    orpo = preference_work(tmp_path, "orpo")
    assert (orpo.loss, orpo.sequences, orpo.packed_rows, orpo.frozen) == ("pairs", 2, False, None)
    assert orpo.tokens(4) == sft.tokens(8) == 8 * 4096
    pairs, sequences = estimate(orpo, Setting(4, 1, False, True)), estimate(sft, Setting(8, 1, False, True))
    for moment in ("backward (first layer)", "backward (top layer)", "optimizer"):
        assert pairs.moments[moment] == sequences.moments[moment]
    loss = planner.preference_loss_bytes(orpo, 4)
    assert loss == planner.preference_pass_bytes(orpo, 8, 2, grads=True) + 8 * orpo.tokens(4)
    assert pairs.moments["loss"] - sequences.moments["loss"] == loss - planner.loss_bytes(sft, 8, True)
    kto = preference_work(tmp_path, {"type": "kto", "reference": "precomputed"})
    assert (kto.loss, kto.sequences, kto.reference_pass) == ("kto", 2, True)
    assert planner.preference_loss_bytes(kto, 4) == planner.preference_pass_bytes(kto, 4, 1, True) + 8 * kto.tokens(4)


def test_packed_pairs_under_sdpa_are_one_row_with_one_mask(tmp_path):
    """data.packing: true lays a micro-batch's 8 sequences in one row: under sdpa its mask and per-layer bias span
    8 x 4096 tokens (padded: each row's 4096), and the op's rows are a gathered copy of the hidden states beside the
    packed ones, with an int64 index; under varlen the layers are the padded rows' (no mask either way)."""
    sdpa = {"attn_implementation": "sdpa"}
    padded = preference_work(tmp_path, "dpo", model=sdpa)
    packed = preference_work(tmp_path, "dpo", model=sdpa, data={"packing": True})
    assert (padded.attention, packed.attention, packed.packed_rows) == ("sdpa", "sdpa", True)
    setting = Setting(4, 2, True, True)
    tokens = 8 * 4096
    row = tokens  # packed: one row of all 8 sequences
    got, base = estimate(packed, setting), estimate(padded, setting)
    assert got.moments["optimizer"] == base.moments["optimizer"]
    # the checkpoints keep the (rows, 1, T, T) bool mask: one 32768-token row against 8 rows of 4096
    first = got.moments["backward (first layer)"] - base.moments["backward (first layer)"]
    layer = (planner.layer_bytes(packed.rows(4), True) - planner.layer_bytes(padded.rows(4), True)) * tokens
    assert first == tokens * row - tokens * 4096 + layer
    assert layer == 2 * tokens * (row - 4096)  # the bias, c x the row's length a token
    gathered = planner.preference_loss_bytes(packed, 4) - planner.preference_loss_bytes(padded, 4)
    assert gathered == (2 * 2048 + 8) * tokens
    varlen = {"attn_implementation": "varlen"}
    unmasked = [preference_work(tmp_path, "dpo", model=varlen, data={"packing": p}) for p in (False, True)]
    assert planner.layer_bytes(unmasked[0].rows(4), True) == planner.layer_bytes(unmasked[1].rows(4), True)


def test_a_precomputed_reference_is_a_pass_over_the_whole_model_before_training(tmp_path):
    """reference: precomputed adds no frozen model, and a moment of its own: the whole model (under FSDP2 too, whose
    rank 0 scores the data before sharding), a no-grad forward over a micro-batch and sequence_logps' chunk."""
    precomputed = {"type": "dpo", "reference": "precomputed"}
    work = preference_work(tmp_path, precomputed, world_size=8, parallelism={"strategy": "fsdp"})
    assert work.frozen is None and work.reference_pass
    got = estimate(work, Setting(2, 4, True, True))
    whole = work.shape.params * 2
    assert got.moments["reference pass"] == planner.reference_pass_bytes(work, 2, whole)
    assert got.moments["reference pass"] > whole > got.moments["optimizer"]
    frozen = preference_work(tmp_path, "dpo")
    assert "reference pass" not in estimate(frozen, Setting(2, 4, True, True)).moments
    assert frozen.frozen is not None


def test_plan_auto_sizes_preference_and_distill_runs(tmp_path, capsys):
    """training.plan: auto is accepted for the preference objectives and distill; on a GPU that fits sft's
    micro-batch 8 without checkpointing, DPO with its frozen copy (twice the weights, two sequences a pair) needs
    a smaller micro-batch or checkpointing, and `tigon plan` says what a micro-batch item is and which loss runs."""
    import yaml

    from tigon.runtime.objectives import check_objective

    sft = plan_config(tmp_path, seq_len=1024)
    raw = sft.model_dump(mode="json")
    raw["data"].pop("format")
    raw["training"]["plan"] = "auto"
    distill = {"type": "distill", "teacher": {"path": "teacher"}}
    for objective in ("dpo", {"type": "kto", "reference": "precomputed"}, "orpo", distill):
        check_objective(parse_config({**raw, "objective": objective}))  # no refusal of training.plan: auto
    fastest = Setting(8, 1, False, True)
    mib = (estimate(planner.workload(sft, 1), fastest).peak / planner.FIT_FRACTION + planner.CUDA_CONTEXT) // 2**20
    gpu_memory = int(mib + 1) * 2**20  # sft's fastest setting just fits
    sft_plan = planner.make_plan(sft, gpu_memory=gpu_memory, world_size=1)
    assert sft_plan.chosen.setting == fastest
    dpo = parse_config({**raw, "objective": "dpo", "data": {**raw["data"], "packing": True}})
    dpo_plan = planner.make_plan(dpo, gpu_memory=gpu_memory, world_size=1)
    chosen = dpo_plan.chosen.setting
    assert chosen != sft_plan.chosen.setting and chosen.micro_batch * chosen.accumulation == 8
    assert dpo_plan.chosen.peak <= dpo_plan.budget < estimate(dpo_plan.work, fastest).peak
    applied = planner.apply_plan(dpo, dpo_plan)
    assert applied.training.micro_batch_size == chosen.micro_batch and applied.data.packing
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(dpo.model_dump(mode="json")))
    assert cli.main(["plan", str(path), "--gpu-memory", f"{int(mib + 1)}MiB", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "sequence 1024 (2 sequences an item, a pair, packed into one row)" in out
    assert "loss from the fused preference op" in out and "frozen model" in out


def test_distill_losses_keep_what_the_planner_counts():
    """Distillation's fused cross entropy and fused JSD (their kernels, through Triton's interpreter) each keep the
    hidden states' gradient and the head's (their autograd nodes' saved tensors): with the per-token results, the
    part of distill_loss_bytes that is not a chunk of logits, exactly."""
    import torch

    from tigon.kernels import functional as F

    shape = dataclasses.replace(TINY, vocab=10, hidden=8)
    work = Workload(shape, 12, weight_bytes=4, compute_bytes=4, autocast=False, attention="varlen", loss="distill")
    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    target = torch.randint(0, 10, (12,))
    kept = 0
    for loss in (
        F.fused_linear_cross_entropy(hidden, weight, target, reduction="sum"),
        F.fused_linear_jsd(hidden, weight, torch.randn(12, 8), torch.randn(10, 8), target, reduction="sum"),
    ):
        saved = [tensor for tensor in loss.grad_fn.saved_tensors if tensor is not None]  # no bias gradient
        assert type(loss.grad_fn).__name__.startswith("FusedLinear")
        kept += sum(tensor.untyped_storage().nbytes() for tensor in saved)
    assert kept == 2 * 4 * (12 * 8 + 10 * 8)
    chunk = planner.distill_loss_bytes(work, 1) - kept - (8 + 4) * 12
    assert chunk % (10 * 8) == 0 and chunk > 0  # whole rows of both heads' float32 logits


def test_the_planner_fills_memory_with_selective_layers_before_whole_ones():
    """On the Llama-3.2-1B shape, selective layers cost less time per byte saved than whole ones: a budget that
    everything-kept misses by a little gets selective layers and no whole one; a tighter one both."""
    work = Workload(LLAMA_1B, 4096, weight_bytes=2, compute_bytes=2, autocast=False, attention="varlen")
    current = Setting(8, 1, False, True)
    everything = estimate(work, current).peak
    selective_all = estimate(work, Setting(8, 1, False, True, None, 16)).peak
    whole = estimate(work, Setting(8, 1, True, True)).peak
    assert whole < selective_all < everything
    options = planner.candidates(work, current)

    def fastest_under(budget):
        fitting = [s for s in options if s.micro_batch == 8 and estimate(work, s).peak <= budget]
        return min(fitting, key=lambda s: planner.relative_step_time(work, s))

    loose = fastest_under(everything - 1)
    assert not loose.checkpointing and 0 < loose.selective_layers < 16
    tight = fastest_under((selective_all + whole) // 2)
    assert tight.checkpointing and tight.selective_layers == 16 - tight.checkpoint_layers
    assert estimate(work, tight).peak <= (selective_all + whole) // 2
    assert "selective" in tight.checkpointing_text()


def test_fp8_layers_keep_their_linear_inputs_as_fp8_casts():
    """Compiled FP8 layers keep one byte an element of q/k/v's, gate/up's and down_proj's inputs instead of bf16's
    two (on an H200 at the Llama-3-8B shape the estimate lands within 0.1% of the peak, docs/planner.md); a
    selective layer's kept outputs stay bf16."""
    work = bf16_work(LLAMA_1B, 4096)
    fp8 = dataclasses.replace(work, compiled=True, fp8=True)
    shape = work.shape
    assert planner.layer_bytes(work, True) - planner.layer_bytes(fp8, True) == 2 * shape.hidden + shape.intermediate
    assert planner.selective_layer_bytes(fp8) == planner.selective_layer_bytes(work)
