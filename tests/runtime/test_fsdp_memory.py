"""The planner's FSDP2 gradient terms against what FSDP2 really holds between micro-batches, on the CPU: the
runtime's FSDPStrategy (2 ranks over gloo) runs the first micro-batch of an accumulation step of a small float32
Llama, and each rank counts the gradient bytes it holds before the next: every parameter's unsharded float32
gradient when the reduce-scatter waits for the step's last micro-batch, only its own shard with
`parallelism.accumulate_sharded`."""

from __future__ import annotations

from transformers import LlamaConfig

from tests.runtime.configs import tiny_config
from tests.runtime.worker_groups import launch_worker
from tigon.runtime import planner
from tigon.runtime.planner import ModelShape, Setting

MODEL = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "tie_word_embeddings": False,
}

# FSDP2's accumulated gradients: each parameter's local shard of its sharded `.grad` (after a reduce-scatter),
# and the unsharded gradient each FSDPParam keeps while the reduce-scatter waits, upcast to the float32 reduce
# dtype under bf16 mixed precision, else its unsharded parameter's own (private attributes: FSDP2 has no public
# view of them)
WORKER = """
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from transformers import LlamaConfig, LlamaForCausalLM
from tigon.runtime.config import load_config
from tigon.runtime.distributed import env_from_environ
from tigon.runtime.strategies import build_strategy

def gradient_bytes(model):
    sharded = sum(p.grad.to_local().nbytes for p in model.parameters() if p.grad is not None)
    whole = 0
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for param in group.fsdp_params if group else ():
            for held in (param.unsharded_accumulated_grad, param._unsharded_param.grad):
                whole += held.nbytes if held is not None else 0
    return sharded + whole

dist.init_process_group("gloo")
env, out = env_from_environ(), sys.argv[1]
record = {}
for path in sys.argv[3:]:
    config = load_config(path)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**json.loads(sys.argv[2])))
    strategy = build_strategy(model, config, env, torch.device("cpu"), total_steps=1)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(env.rank))
    with strategy.accumulating(last=False):
        strategy.backward(strategy.model(input_ids=ids, labels=ids).loss)
    record[config.name] = gradient_bytes(model)
with open(f"{out}/rank{dist.get_rank()}.json", "w") as file:
    json.dump(record, file)
dist.barrier()  # no rank leaves while gloo's threads still serve another's collective
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # the record is written: skip interpreter teardown, where gloo's threads can abort a loaded machine
"""


def test_the_planner_counts_the_gradients_fsdp2_holds_between_micro_batches(tmp_path):
    ranks = 2
    configs = {
        f"{precision}-{kind}": tiny_config(
            tmp_path,
            name=f"{precision}-{kind}",
            training={"micro_batch_size": 1, "gradient_accumulation_steps": 2, "precision": precision},
            parallelism={"strategy": "fsdp", "accumulate_sharded": kind == "sharded"},
        )
        for precision in ("fp32", "bf16")
        for kind in ("whole", "sharded")
    }
    held = launch_worker(tmp_path, WORKER, ranks, MODEL, configs)

    shape = ModelShape.from_hf_config(LlamaConfig(**MODEL))
    for precision in ("fp32", "bf16"):
        work = planner.workload(configs[f"{precision}-sharded"], world_size=ranks, shape=shape)
        whole = planner.estimate(work, Setting(1, 2, False, False)).parts["gradients"]
        sharded = planner.estimate(work, Setting(1, 2, False, False, accumulate_sharded=True)).parts["gradients"]
        assert whole == shape.params * 4 and sharded == shape.params * 4 // ranks
        for rank in held:
            assert rank[f"{precision}-whole"] == whole, (precision, rank, whole)
        # the shards split each parameter's rows: together exactly the model's gradients, each rank about half
        assert sum(rank[f"{precision}-sharded"] for rank in held) == shape.params * 4
        assert all(abs(rank[f"{precision}-sharded"] - sharded) < 0.05 * sharded for rank in held), (held, sharded)
