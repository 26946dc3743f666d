"""FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 under the HF Trainer and Lightning adapters, on the CPU over gloo.

Each 2-process test launches one `torchrun --nproc_per_node 2` worker group (`worker_groups.launch`) that
trains, for each strategy, a tiny Llama built from a config:

- `full`:    6 steps of 2 ranks x micro-batch 2 x accumulation 2, checkpoints at steps 3 and 6, export;
- `killed`:  the same run stopped after its step-3 checkpoint (another run directory);
- `resumed`: `killed` continued to step 6 from that checkpoint;
- `again`:   `resumed` started once more: nothing is left to train, so the torch trainer loads the adapter's
             step-6 checkpoint (the same strategy's format), evaluates and exports.

The reference is the torch trainer in one process with micro-batch 2 x accumulation 4: the same global
batch, data order, optimizer, schedule, clipping and loss normalization. RELATIVE_TOLERANCE (1e-4 on each
step's loss, fp32) allows for the reductions summing over 2 ranks in another order (measured about 1e-8);
a sharding or normalization error (a rank's gradients lost or counted twice, the accumulation divided
twice) moves the second step's loss by about 1e-2 or more. bf16 runs are compared with the torch trainer
under the same strategy in the same group, within BF16_TOLERANCE (1e-3): the same sharding, autocast and
bf16 weights, with the loss scaled in another order in fp32 before the first bf16 rounding (measured
4e-8); the margin is for a perturbation that flips a bf16 rounding (2^-8 relative) somewhere.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.runtime.configs import adapter_config
from tests.runtime.worker_groups import LOGITS_TOLERANCE, exported_logits, launch, worst_relative
from tigon.runtime.trainer import train

pytest.importorskip("lightning")
pytest.importorskip("deepspeed")

RELATIVE_TOLERANCE = 1e-4
BF16_TOLERANCE = 1e-3
STRATEGIES = {
    "fsdp": {"strategy": "fsdp"},
    "zero2": {"strategy": "deepspeed", "zero_stage": 2},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3},
}
LAYOUT = {  # a file each strategy's checkpoint holds for rank 1
    "fsdp": "dcp/__1_0.distcp",
    "zero2": "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "zero3": "deepspeed/zero_pp_rank_1_mp_rank_00_model_states.pt",
}
LORA = {
    "lora": {"enabled": True, "r": 4},
    "training": {"gradient_checkpointing": True},
    "kernels": {"enabled": True, "rope": False},
}


def run(tmp_path: Path, trainer: str, name: str, max_steps: int, parallelism: dict | None = None, **sections):
    """A 2-rank adapter run (configs.adapter_config) with checkpoints every 3 steps and resume on."""
    training = {"max_steps": max_steps, "lr_schedule": "constant", **sections.pop("training", {})}
    return adapter_config(
        tmp_path,
        trainer,
        training=training,
        parallelism=parallelism or {},
        checkpoint={"every_steps": 3, "keep_last": 2, "resume": True, "export": True, **sections.pop("checkpoint", {})},
        eval={"metrics": ["loss"], "max_batches": None},  # the whole held-out set on 1 and 2 ranks
        logging={"run_dir": str(tmp_path / name)},
        **sections,
    )


def strategy_runs(tmp_path: Path, trainer: str) -> dict:
    """full / killed / resumed / again for each strategy of STRATEGIES under `trainer`."""
    configs = {}
    for name, parallelism in STRATEGIES.items():
        configs[name] = run(tmp_path, trainer, name, 6, parallelism)
        killed = run(tmp_path, trainer, f"{name}-resumed", 3, parallelism, checkpoint={"export": False})
        configs[f"{name}-killed"] = killed
        configs[f"{name}-resumed"] = run(tmp_path, trainer, f"{name}-resumed", 6, parallelism)
        configs[f"{name}-again"] = run(tmp_path, trainer, f"{name}-resumed", 6, parallelism)
    return configs


def check_strategy_runs(tmp_path: Path, trainer: str, runs: dict) -> None:
    """Against the torch trainer in one process: per-step losses, eval loss, exact resume, the finished run
    started again, checkpoints in the strategy's layout, and an export that loads with `from_pretrained`."""
    torch_run = train(run(tmp_path, "torch", "torch", 6, training={"gradient_accumulation_steps": 4}))
    reference = torch_run.losses
    assert len(reference) == 6 and reference[-1] < reference[0], reference
    want = exported_logits(torch_run.export_dir)
    for name in STRATEGIES:
        losses = runs[name]["losses"]
        worst = worst_relative(losses, reference)
        print(f"{trainer} {name}: worst relative loss difference to the torch trainer {worst:.2e}")
        assert len(losses) == 6 and worst < RELATIVE_TOLERANCE, (name, losses, reference)
        eval_loss = runs[name]["eval"]["loss"]
        assert abs(eval_loss - torch_run.eval_metrics["loss"]) < RELATIVE_TOLERANCE * eval_loss, name
        assert runs[f"{name}-killed"]["losses"] == losses[:3], name
        resumed, again = runs[f"{name}-resumed"], runs[f"{name}-again"]
        assert resumed["resumed_from"] == 3 and resumed["losses"] == losses, (name, resumed, losses)
        assert again["resumed_from"] == 6 and again["losses"] == losses, (name, again)
        assert again["eval"] == resumed["eval"], name
        checkpoints = tmp_path / f"{name}-resumed" / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-3", "step-6"], name
        assert (checkpoints / "step-6" / LAYOUT[name]).is_file(), name
        for record in (runs[name], again):
            got = exported_logits(record["export_dir"])
            assert (got - want).abs().max() < LOGITS_TOLERANCE, (name, (got - want).abs().max())


def check_bf16(runs: dict, adapter: str, reference: str) -> None:
    worst = worst_relative(runs[adapter]["losses"], runs[reference]["losses"])
    print(f"{adapter}: worst relative loss difference to {reference} {worst:.2e}")
    assert worst < BF16_TOLERANCE, (runs[adapter]["losses"], runs[reference]["losses"])


def check_lora(tmp_path: Path, runs: dict, name: str, monkeypatch) -> None:
    """LoRA (frozen base weights inside the shards), gradient checkpointing and the kernels (their CPU references)
    under a sharded adapter run: the torch trainer's losses in one process, and the merged export loads. The
    process's run takes the kernels' CPU references too (TRITON_INTERPRET unset, as in the worker group): the
    kernels themselves are tested against those references on their own, and the interpreter would take most of
    the test's time."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    one_process = {**LORA, "training": {**LORA["training"], "gradient_accumulation_steps": 4}}
    single = train(run(tmp_path, "torch", "single-lora", 4, **one_process))
    worst = worst_relative(runs[name]["losses"], single.losses)
    print(f"{name}: worst relative loss difference to the torch trainer {worst:.2e}")
    assert worst < RELATIVE_TOLERANCE, (runs[name]["losses"], single.losses)
    got, want = exported_logits(runs[name]["export_dir"]), exported_logits(single.export_dir)
    assert (got - want).abs().max() < LOGITS_TOLERANCE


def test_hf_trainer_with_fsdp2_and_deepspeed_zero2_zero3_matches_the_torch_trainer_resumes_and_exports(
    tmp_path, monkeypatch
):
    """Also: bf16 under FSDP2 and ZeRO-2 against the torch trainer's same strategy, and ZeRO-3 with LoRA,
    gradient checkpointing and the kernels."""
    started = time.perf_counter()
    bf16 = {"precision": "bf16", "max_steps": 4}
    configs = strategy_runs(tmp_path, "hf")
    for name in ("fsdp", "zero2"):
        for trainer in ("hf", "torch"):
            configs[f"{trainer}-{name}-bf16"] = run(
                tmp_path, trainer, f"{trainer}-{name}-bf16", 4, STRATEGIES[name], training=bf16
            )
    configs["hf-zero3-lora"] = run(tmp_path, "hf", "hf-zero3-lora", 4, STRATEGIES["zero3"], **LORA)
    runs = launch(tmp_path, configs)
    check_strategy_runs(tmp_path, "hf", runs)
    for name in ("fsdp", "zero2"):
        check_bf16(runs, f"hf-{name}-bf16", f"torch-{name}-bf16")
    check_lora(tmp_path, runs, "hf-zero3-lora", monkeypatch)
    print(f"hf: {time.perf_counter() - started:.1f} s")


def test_lightning_with_fsdp2_and_deepspeed_zero2_zero3_matches_the_torch_trainer_resumes_and_exports(
    tmp_path, monkeypatch
):
    """Also: FSDP2 with LoRA, gradient checkpointing and the kernels."""
    started = time.perf_counter()
    configs = strategy_runs(tmp_path, "lightning")
    configs["lightning-fsdp-lora"] = run(tmp_path, "lightning", "lightning-fsdp-lora", 4, STRATEGIES["fsdp"], **LORA)
    runs = launch(tmp_path, configs)
    check_strategy_runs(tmp_path, "lightning", runs)
    check_lora(tmp_path, runs, "lightning-fsdp-lora", monkeypatch)
    print(f"lightning: {time.perf_counter() - started:.1f} s")


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_adapter_in_one_process_with_fsdp2_and_deepspeed_cpu_offload_matches_the_torch_trainer(tmp_path, trainer):
    """In one process (a process group of one, made by the runtime): FSDP2 with a CPUOffloadPolicy and ZeRO-2 with
    its optimizer offloaded (DeepSpeed's CPU Adam; under HF accelerate makes it from tigon's AdamW, which must stay
    AdamW: decoupled weight decay) reach the torch trainer's losses, with weight decay on."""
    decay = {"weight_decay": 0.1}
    reference = train(run(tmp_path, "torch", "torch", 3, training={**decay, "gradient_accumulation_steps": 4}))
    for name, parallelism in [("fsdp", STRATEGIES["fsdp"]), ("zero2", STRATEGIES["zero2"])]:
        config = run(
            tmp_path, trainer, name, 3, {**parallelism, "cpu_offload": True}, training={**decay, "micro_batch_size": 4}
        )
        losses = train(config).losses
        worst = worst_relative(losses, reference.losses)
        print(f"{trainer} {name} with CPU offload: worst relative loss difference {worst:.2e}")
        assert worst < RELATIVE_TOLERANCE, (name, losses, reference.losses)
