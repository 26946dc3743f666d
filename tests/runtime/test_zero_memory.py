"""The planner's DeepSpeed terms against what DeepSpeed really holds, on the CPU: the runtime's engine (ZeRO-1, 2
and 3, on one rank and on two over gloo) trains a small bf16 Llama two steps, and each rank counts the bytes its
optimizer and model hold after a step and after a backward, and the bytes the optimizer step allocates.

The GPU peaks (activations beside these, the gathered layers, the reduce-scatter's copy, where the step peaks)
are docs/planner.md's measured rows; here the persistent parts and the step's transient match exactly, up to
bookkeeping scalars (`allocations.SCALAR_BYTES`: step counts, the gradient norm, the overflow flag)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig

from tests.runtime.allocations import SCALAR_BYTES
from tests.runtime.configs import llama_1b_shape, tiny_config
from tests.runtime.worker_groups import launch_worker
from tigon.runtime import planner
from tigon.runtime.planner import ModelShape

# every matrix over ZeRO-3's persistence threshold (1e5 elements), so only the norms stay whole on every rank
MODEL = {
    "hidden_size": 320,
    "intermediate_size": 640,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 512,
    "tie_word_embeddings": True,
}
STAGES = (1, 2, 3)  # ZeRO-3 last: it replaces torch.nn.functional.linear for the rest of the process

WORKER = """
import json, sys
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from tests.runtime.allocations import NewStorages, held_bytes
from tigon.runtime.config import load_config
from tigon.runtime.distributed import env_from_environ
from tigon.runtime.strategies import build_strategy

dist.init_process_group("gloo")
env, out = env_from_environ(), sys.argv[1]
record = {}
for path in sys.argv[3:]:
    config = load_config(path)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**json.loads(sys.argv[2]))).to(torch.bfloat16)
    strategy = build_strategy(model, config, env, torch.device("cpu"), total_steps=2)
    for group in strategy.engine.basic_optimizer.param_groups:
        group["foreach"] = True  # torch's AdamW default on CUDA tensors (on CPU ones it picks the single-tensor loop)
    optimizer = strategy.engine.optimizer
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(env.rank))
    for _ in range(2):  # the first step creates AdamW's moments; the second is a steady one
        after_step = held_bytes(optimizer, model)
        strategy.backward(strategy.model(input_ids=ids, labels=ids).loss)
        after_backward = held_bytes(optimizer, model)
        with NewStorages() as step:
            strategy.step()
    stage = config.parallelism.stage
    record[stage] = {"after_step": held_bytes(optimizer, model), "before": after_step,
                     "after_backward": after_backward, "step_peak": step.peak}
with open(f"{out}/rank{dist.get_rank()}.json", "w") as file:
    json.dump(record, file)
dist.destroy_process_group()
"""


def run_ranks(tmp_path, ranks: int) -> tuple[list[dict], dict]:
    """Each rank's record of the three stages, and the stages' run configs."""
    configs = {
        f"zero{stage}": tiny_config(
            tmp_path,
            model={"dtype": "bfloat16"},
            training={"precision": "bf16", "max_grad_norm": 1.0},
            parallelism={"strategy": "deepspeed", "zero_stage": stage},
        )
        for stage in STAGES
    }
    records = launch_worker(tmp_path, WORKER, ranks, MODEL, configs)
    return records, configs


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_planner_counts_what_deepspeed_holds_and_allocates_at_the_step(tmp_path, ranks):
    """Per rank: the weights, float32 master weights and AdamW moments held after a step (ZeRO-3 also its gradient
    partition and reduce bucket), the gradient partition a ZeRO-1/2 backward adds (a parameter straddling two
    ranks' partitions held whole by both), and the step's float32 gradient with AdamW's buffer, all as
    `planner.zero_bytes` counts them."""
    shape = ModelShape.from_hf_config(LlamaConfig(**MODEL))
    records, configs = run_ranks(tmp_path, ranks)
    for stage in STAGES:
        work = planner.workload(configs[f"zero{stage}"], world_size=ranks, shape=shape)
        zero = planner.zero_bytes(work, shape.params * 2, 2)
        per_rank = zip(
            *(planner.partition_gradients(group, ranks) for group in planner.trainable_groups(work)), strict=True
        )
        gradients = [2 * sum(held) for held in per_rank]  # ZeRO-1/2: the parameters overlapping each rank's share
        if stage == 3:
            gradients = [zero.grads] * ranks
        elif ranks == 2:
            assert min(gradients) > shape.params  # each rank holds a straddling parameter beyond its half
        persistent = zero.weights + zero.states + (zero.grads + zero.bucket if stage == 3 else 0)
        for rank, record in enumerate(r[str(stage)] for r in records):
            assert record["after_step"] == record["before"] == persistent, (stage, rank)
            assert record["after_backward"] - record["after_step"] == (0 if stage == 3 else gradients[rank])
            assert 0 <= record["step_peak"] - zero.step < SCALAR_BYTES, (stage, rank)
        assert zero.grads == max(gradients)
        # the estimate's optimizer moment is these parts: what the step holds and allocates, and the overhead
        optimizer = planner.OVERHEAD + zero.gathered + persistent + zero.step + (0 if stage == 3 else zero.grads)
        assert planner.estimate(work, planner.Setting(1, 1, False, False)).moments["optimizer"] == optimizer


def test_the_planner_uses_deepspeeds_defaults_where_the_runtime_leaves_them(tmp_path):
    """Bucket, sub-group and persistence sizes are DeepSpeed's own defaults, which the runtime's config keeps (it only
    caps the bucket at the trainable count)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from tigon.runtime.deepspeed_engine import deepspeed_config

    defaults = DeepSpeedZeroConfig()
    assert defaults.reduce_bucket_size == planner.REDUCE_BUCKET_SIZE
    assert defaults.sub_group_size == planner.ZERO_SUB_GROUP
    assert defaults.param_persistence_threshold == planner.PERSISTENCE_THRESHOLD
    config = tiny_config(tmp_path, parallelism={"strategy": "deepspeed", "zero_stage": 3})
    zero = deepspeed_config(config, world_size=2, trainable=10**12)["zero_optimization"]
    assert zero["reduce_bucket_size"] == planner.REDUCE_BUCKET_SIZE
    assert not {"sub_group_size", "param_persistence_threshold", "stage3_param_persistence_threshold"} & set(zero)


def test_zero3_steps_sub_groups_of_a_billion_partition_elements():
    """Llama-3.2-1B (tied; embedding 128256 x 2048, 60.8M a layer): on one GPU the first sub-group closes at the
    parameter that takes it past 1e9 elements, the 13th layer's o_proj; on two each partition is half a parameter and
    the matrices' 618M elements are one sub-group. The step allocates 8 bytes an element of it, ZeRO-1/2 of the
    matrices' partition."""
    shape = llama_1b_shape()
    embedding, attention = 128256 * 2048, 2 * 2048 * 2048 + 2 * 2048 * 512
    layer = attention + 3 * 2048 * 8192
    work = planner.Workload(shape, 4096, 2, 2, False, "sdpa", strategy="deepspeed", zero_stage=3)
    assert planner.optimizer_group(work) == embedding + 12 * layer + attention == 1_002_962_944
    assert planner.zero_bytes(work, shape.params * 2, 2).step == 8 * 1_002_962_944
    two = dataclasses.replace(work, world_size=2)
    assert planner.optimizer_group(two) == (embedding + 16 * layer) // 2
    assert planner.optimizer_group(dataclasses.replace(two, zero_stage=2)) == (embedding + 16 * layer) // 2
