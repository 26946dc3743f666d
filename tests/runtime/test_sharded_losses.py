"""Fused linear cross entropy under sharded parameters, on the CPU with 2 processes over gloo.

Each test launches one `torchrun --nproc_per_node 2` group running this module's `main` (the worker):

- FSDP2 (`fully_shard` on each decoder layer, then the root) and DeepSpeed ZeRO-3 (`deepspeed.initialize`,
  stage 3): a tiny Llama patched with tigon's fused linear cross entropy (the Triton kernel through the
  interpreter, so the gradients computed in the forward are the ones tested) trains STEPS steps of SGD,
  each rank on its half of the global batch, for an untied lm_head, one tied to the embedding, and a
  frozen one; FSDP2 also with the lm_head as its own `fully_shard` unit (its weight is a sharded DTensor
  when the patched forward reads it). The per-step losses (mean over ranks) and the final parameters
  equal one process training the unpatched model on the whole batch within TOLERANCE (fp32).
- DTensor: `fused_linear_cross_entropy` on a weight `distribute_tensor`ed as Shard(0) over 2 ranks (odd
  vocabulary, so uneven shards) equals the unsharded call: loss, hidden gradient and each rank's weight
  gradient shard; fused_linear_jsd gathers a sharded student head the same way, and the preference
  losses (DPO here) reject a DTensor head with an error naming `full_tensor()`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.runtime.configs import TINY_MODEL
from tests.runtime.worker_groups import torchrun

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5  # fp32: max |difference| / max |reference|, per step loss and per parameter
STEPS = 3
LEARNING_RATE = 0.5  # plain SGD: parameter errors stay at rounding level (Adam's normalization amplifies them)
VOCAB = 67  # odd: the 2 shards of a Shard(0) head differ in size
GLOBAL_BATCH = 4
SEQ = 12
VARIANTS = {  # name: (tie_word_embeddings, lm_head frozen, lm_head its own FSDP unit)
    "untied": (False, False, False),
    "tied": (True, False, False),
    "frozen": (False, True, False),
    "head-unit": (False, False, True),
}


def tiny_llama(tied: bool, frozen: bool) -> torch.nn.Module:
    """A 2-layer Llama with the same initial weights in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        **TINY_MODEL,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    if frozen:
        model.lm_head.weight.requires_grad_(False)
    return model


def batch() -> torch.Tensor:
    """The global batch of token ids (labels are the ids: no ignored tokens, equal counts per rank)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)


def train_one_process(tied: bool, frozen: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the unpatched model, whole batch, one process; per-step losses and final parameters."""
    model = tiny_llama(tied, frozen)
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    ids, losses = batch(), []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def patched(tied: bool, frozen: bool) -> torch.nn.Module:
    """The tiny Llama with only tigon's fused linear cross entropy applied."""
    from tigon.kernels import apply

    model = tiny_llama(tied, frozen)
    report = apply(model, rms_norm=False, rope=False, swiglu=False, fused_linear_cross_entropy=True)
    assert report.applied == {"fused_linear_cross_entropy": 1}, report
    model.train()
    return model


def train_sharded(strategy: str, variant: str) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    """STEPS SGD steps of the patched model under `strategy`, this rank on its half of the batch."""
    import torch.distributed as dist

    from tigon.kernels.patching.causal_lm import gathered_in_own_forward

    tied, frozen, head_unit = VARIANTS[variant]
    model = patched(tied, frozen)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = GLOBAL_BATCH // world
    ids = batch()[rank * rows : (rank + 1) * rows]
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        if head_unit:
            fully_shard(model.lm_head)
        fully_shard(model)  # after this the parameters are DTensor shards
        assert gathered_in_own_forward(model.lm_head) == head_unit
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
        engine = model
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": rows,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 unless told
            "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
            "zero_allow_untested_optimizer": True,  # the client's torch SGD
            "steps_per_print": 2**31 - 1,
        }
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE),
            config=config,
            dist_init_required=False,
        )
        assert gathered_in_own_forward(model.lm_head)
    losses = []
    for _ in range(STEPS):
        out = engine(input_ids=ids, labels=ids)
        assert out.logits is None, "the fused loss did not run"
        if strategy == "fsdp":
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            engine.backward(out.loss)
            engine.step()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return losses, state if rank == 0 else None
    return losses, engine._zero3_consolidated_16bit_state_dict()


def dtensor_case() -> dict[str, torch.Tensor]:
    """The fused loss on a Shard(0) DTensor head (same hidden on both ranks) and on the full head."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

    from tigon.kernels.functional import fused_linear_cross_entropy, fused_linear_dpo, fused_linear_jsd

    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(13, 32, generator=generator)
    weight = torch.randn(VOCAB, 32, generator=generator)
    target = torch.randint(0, VOCAB, (13,), generator=generator)
    target[3] = -100

    full_hidden, full_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    full_loss = fused_linear_cross_entropy(full_hidden, full_weight, target)
    full_loss.backward()

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    shard_hidden = hidden.clone().requires_grad_()
    loss = fused_linear_cross_entropy(shard_hidden, sharded, target)
    loss.backward()
    assert isinstance(sharded.grad, DTensor) and sharded.grad.placements == (Shard(0),)

    teacher = torch.randn(VOCAB, 32, generator=generator)
    jsd_full = fused_linear_jsd(hidden, weight, hidden, teacher, target)
    jsd_sharded = fused_linear_jsd(hidden, distribute_tensor(weight, mesh, [Shard(0)]), hidden, teacher, target)
    try:
        fused_linear_dpo(hidden.reshape(1, 13, 32).expand(2, 13, 32), sharded, target.reshape(1, 13).expand(2, 13))
        dpo_error = ""
    except TypeError as error:
        dpo_error = str(error)
    return {
        "jsd_full": jsd_full,
        "jsd_sharded": jsd_sharded,
        "dpo_rejects_dtensor": torch.tensor("weight is a DTensor" in dpo_error and "full_tensor()" in dpo_error),
        "full_loss": full_loss.detach(),
        "full_grad_hidden": full_hidden.grad,
        "full_grad_weight": full_weight.grad,
        "loss": loss.detach(),
        "grad_hidden": shard_hidden.grad,
        "grad_weight_shard": sharded.grad.to_local(),
        "shard_rows": torch.tensor(sharded.to_local().shape[0]),
    }


def main(out_dir: str, case: str) -> None:
    """The worker: run `case` (fsdp, deepspeed or dtensor) and save rank-local results under `out_dir`."""
    import torch.distributed as dist

    from tigon.runtime.distributed import wait_for_idle_process_groups

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if case == "dtensor":
        torch.save(dtensor_case(), f"{out_dir}/dtensor-rank{rank}.pt")
    else:
        variants = [name for name in VARIANTS if case == "fsdp" or not VARIANTS[name][2]]
        for variant in variants:
            started = time.perf_counter()
            losses, state = train_sharded(case, variant)
            print(f"{case} {variant}: {time.perf_counter() - started:.1f} s", flush=True)
            if rank == 0:
                torch.save({"losses": losses, "state": state}, f"{out_dir}/{case}-{variant}.pt")
    wait_for_idle_process_groups()  # the gloo threads go idle before the process exits (see its docstring)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # After a DeepSpeed ZeRO-3 run on the CPU, interpreter finalization can abort in C++ teardown ("terminate
    # called without an active exception", with every result already saved). The results are on disk, so the
    # worker skips finalization.
    os._exit(0)


def launch(tmp_path: Path, case: str) -> None:
    """Run the worker for `case` in a 2-process torchrun group (Triton through its interpreter)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    command = [*torchrun(2), "-m", "tests.runtime.test_sharded_losses", str(tmp_path), case]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    print(done.stdout)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def check_against_one_process(tmp_path: Path, case: str, variants: list[str]) -> None:
    for variant in variants:
        tied, frozen, _ = VARIANTS[variant]
        got = torch.load(tmp_path / f"{case}-{variant}.pt", weights_only=True)
        losses, state = train_one_process(tied, frozen)
        loss_error = relative(torch.tensor(got["losses"]), torch.tensor(losses))
        assert got["losses"][-1] < got["losses"][0], (variant, got["losses"])
        assert loss_error < TOLERANCE, (variant, got["losses"], losses)
        missing = {name for name in state if name not in got["state"]}
        assert missing <= {"lm_head.weight"} and (not missing or tied), (variant, missing)
        errors = {name: relative(got["state"][name], state[name]) for name in state if name not in missing}
        print(f"{case} {variant}: loss error {loss_error:.1e}, worst parameter error {max(errors.values()):.1e}")
        assert max(errors.values()) < TOLERANCE, (variant, errors)
        initial = tiny_llama(tied, frozen).state_dict()
        moved = not torch.equal(got["state"]["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
        assert moved, variant
        if frozen:
            assert torch.equal(got["state"]["lm_head.weight"], initial["lm_head.weight"]), variant


def test_fsdp2_fused_loss_matches_one_process_tied_untied_frozen_and_head_unit(tmp_path):
    started = time.perf_counter()
    launch(tmp_path, "fsdp")
    check_against_one_process(tmp_path, "fsdp", list(VARIANTS))
    print(f"fsdp: {time.perf_counter() - started:.1f} s")


def test_deepspeed_zero3_fused_loss_matches_one_process_tied_untied_frozen(tmp_path):
    started = time.perf_counter()
    launch(tmp_path, "deepspeed")
    check_against_one_process(tmp_path, "deepspeed", ["untied", "tied", "frozen"])
    print(f"deepspeed: {time.perf_counter() - started:.1f} s")


def test_fused_linear_cross_entropy_on_a_shard0_dtensor_weight_equals_the_full_weight(tmp_path):
    launch(tmp_path, "dtensor")
    ranks = [torch.load(tmp_path / f"dtensor-rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    rows = [int(r["shard_rows"]) for r in ranks]
    assert rows == [34, 33], rows
    for rank, got in enumerate(ranks):
        assert relative(got["loss"], got["full_loss"]) < TOLERANCE
        assert relative(got["grad_hidden"], got["full_grad_hidden"]) < TOLERANCE
        start = sum(rows[:rank])
        want = got["full_grad_weight"][start : start + rows[rank]]
        assert relative(got["grad_weight_shard"], want) < TOLERANCE, rank
        assert got["full_grad_weight"].abs().max() > 0
        assert relative(got["jsd_sharded"], got["jsd_full"]) < TOLERANCE and got["jsd_full"] > 0
        assert got["dpo_rejects_dtensor"], "the preference losses must reject a DTensor head, naming full_tensor()"


if __name__ == "__main__":
    main(*sys.argv[1:])
