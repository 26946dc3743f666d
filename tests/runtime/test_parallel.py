"""Parallelism beyond DDP, on the CPU with 2 processes over gloo: FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3.

Each test launches one `torchrun --nproc_per_node 2` worker group that trains several runs in turn
(the worker joins the process group once; the trainer leaves a group it did not create alone):

- `full`:    6 steps, checkpoints at steps 3 and 6, export;
- `killed`:  the same run stopped after its step-3 checkpoint (another run directory);
- `resumed`: `killed` continued to step 6 from that checkpoint.

Checked: the per-step losses of `full` equal one process with the same global batch (micro-batch 4)
within RELATIVE_TOLERANCE (fp32; the sharded reductions sum in another order), `resumed` repeats
`full` exactly, both ranks agree, and the export loads with `from_pretrained` and gives the same
logits as the one-process run's export (within LOGITS_TOLERANCE).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tests.runtime.configs import resumable_config, tiny_config
from tests.runtime.worker_groups import LOGITS_TOLERANCE, RELATIVE_TOLERANCE, exported_logits, launch
from tigon.runtime import checkpoint as ckpt
from tigon.runtime.config import ConfigError
from tigon.runtime.deepspeed_engine import import_deepspeed, supports_precision
from tigon.runtime.trainer import train

BF16_TOLERANCE = 2e-2  # bf16 weights in the forward (FSDP2) vs fp32 weights under bf16 autocast
FP16_TOLERANCE = 1e-3  # fp16 weights (FSDP2, DeepSpeed) vs fp32 weights under fp16 autocast; measured 4e-5


def check_parallel_run(tmp_path: Path, backend: str = "gloo", nproc: int = 2, **sections) -> dict[str, dict]:
    """Launch full / killed / resumed with `sections` on `nproc` ranks, each a micro-batch of 4 / nproc; compare
    with one process (micro-batch 4, DDP strategy)."""
    sections["training"] = {"micro_batch_size": 4 // nproc, **sections.get("training", {})}
    runs = launch(
        tmp_path,
        {
            "full": resumable_config(tmp_path, "full", 6, True, **sections),
            "killed": resumable_config(tmp_path, "resumed", 3, False, **sections),
            "resumed": resumable_config(tmp_path, "resumed", 6, False, **sections),
        },
        backend,
        nproc=nproc,
    )
    single = train(resumable_config(tmp_path, "single", 6, True, training={"micro_batch_size": 4}))
    full = runs["full"]["losses"]
    assert len(full) == 6 and full[-1] < full[0], full
    worst = max(abs(a - b) / abs(b) for a, b in zip(full, single.losses, strict=True))
    print(f"{sections}: worst relative loss difference to one process {worst:.2e}")
    assert worst < RELATIVE_TOLERANCE, (full, single.losses)
    assert (
        abs(runs["full"]["eval"]["loss"] - single.eval_metrics["loss"])
        < RELATIVE_TOLERANCE * single.eval_metrics["loss"]
    )
    assert runs["full"]["eval"]["exact_match"] == single.eval_metrics["exact_match"]

    assert runs["killed"]["losses"] == full[:3]
    assert runs["resumed"]["resumed_from"] == 3 and runs["resumed"]["losses"] == full, (runs["resumed"], full)
    checkpoints = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert checkpoints == ["step-3", "step-6"], checkpoints
    manifest = json.loads((tmp_path / "resumed" / "checkpoints" / "step-6" / "manifest.json").read_text())
    assert {"state.json", "rng-rank0.pt", "rng-rank1.pt"} <= set(manifest["files"]), manifest

    got, want = exported_logits(runs["full"]["export_dir"]), exported_logits(single.export_dir)
    assert (got - want).abs().max() < LOGITS_TOLERANCE, (got - want).abs().max()
    return runs


def assert_damage_is_named(step: Path, layout: str) -> None:
    """Every file of a strategy's layout is in the checkpoint's manifest; a shard with flipped bytes is named."""
    files = sorted(
        name for name in json.loads((step / "manifest.json").read_text())["files"] if name.startswith(layout)
    )
    on_disk = sorted(p.relative_to(step).as_posix() for p in (step / layout).rglob("*") if p.is_file())
    assert files == on_disk and files, (files, on_disk)
    shard = max(files, key=lambda name: (step / name).stat().st_size)
    data = bytearray((step / shard).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step / shard).write_bytes(bytes(data))
    assert ckpt.verify_checkpoint(step) == [f"{shard} is corrupted (its SHA-256 differs from the manifest's)"]


def test_fsdp2_matches_one_process_resumes_exactly_and_exports(tmp_path):
    check_parallel_run(tmp_path, parallelism={"strategy": "fsdp"})
    step = tmp_path / "full" / "checkpoints" / "step-6"
    assert (step / "dcp" / ".metadata").is_file() and (step / "rng-rank1.pt").is_file()
    assert_damage_is_named(step, "dcp")
    assert not [p for p in (tmp_path / "full" / "checkpoints").iterdir() if p.name.startswith(".")]


def test_fsdp2_accumulating_sharded_gradients_matches_one_process_under_every_trainer(tmp_path):
    """`parallelism.accumulate_sharded`: micro-batch 1 x accumulation 2 on each of 2 ranks, every micro-batch's
    gradients reduce-scattered into the shards (fp32 weights, so the shards accumulate in float32), under the torch
    trainer (resuming exactly), HF's and Lightning's, against one process's micro-batch of 4; the bytes it saves
    are counted in test_fsdp_memory.py."""
    sections = {
        "parallelism": {"strategy": "fsdp", "accumulate_sharded": True},
        "training": {"micro_batch_size": 1, "gradient_accumulation_steps": 2},
    }
    runs = launch(
        tmp_path,
        {
            "torch": resumable_config(tmp_path, "torch", 6, False, **sections),
            "killed": resumable_config(tmp_path, "resumed", 3, False, **sections),
            "resumed": resumable_config(tmp_path, "resumed", 6, False, **sections),
            **{
                name: resumable_config(tmp_path, name, 6, False, trainer=name, **sections)
                for name in ("hf", "lightning")
            },
        },
    )
    single = train(resumable_config(tmp_path, "single", 6, False, training={"micro_batch_size": 4}))
    assert single.losses[-1] < single.losses[0], single.losses
    for name in ("torch", "hf", "lightning"):
        worst = max(abs(a - b) / abs(b) for a, b in zip(runs[name]["losses"], single.losses, strict=True))
        print(f"{name}: worst relative loss difference to one process {worst:.2e}")
        assert worst < RELATIVE_TOLERANCE, (name, runs[name]["losses"], single.losses)
    assert runs["resumed"]["resumed_from"] == 3 and runs["resumed"]["losses"] == runs["torch"]["losses"]


def test_hybrid_sharded_fsdp2_matches_one_process_resumes_exactly_and_exports(tmp_path):
    """4 ranks as 2 replicas of 2-rank shard groups (`parallelism.shard_size: 2`): the checkpoint holds each weight
    in 2 shards (the replicas' copies written once), not 4."""
    from torch.distributed.checkpoint import FileSystemReader

    check_parallel_run(tmp_path, nproc=4, parallelism={"strategy": "fsdp", "shard_size": 2})
    metadata = FileSystemReader(str(tmp_path / "full" / "checkpoints" / "step-6" / "dcp")).read_metadata()
    weight = next(v for k, v in metadata.state_dict_metadata.items() if k.endswith("layers.0.mlp.up_proj.weight"))
    rows = weight.size[0]
    assert [chunk.sizes[0] for chunk in weight.chunks] == [rows // 2, rows // 2], weight.chunks


def test_a_shard_size_that_does_not_divide_the_ranks_fails_before_anything_is_built(tmp_path):
    from tigon.runtime.distributed import DistEnv, shard_ranks

    config = tiny_config(tmp_path, parallelism={"strategy": "fsdp", "shard_size": 3})
    with pytest.raises(ConfigError, match="does not divide the 4 ranks of this job into equal groups"):
        shard_ranks(config, DistEnv(world_size=4, local_world_size=4))
    node = tiny_config(tmp_path, parallelism={"strategy": "fsdp", "shard_size": "node"})
    assert shard_ranks(node, DistEnv(world_size=16, local_world_size=8)) == 8
    assert shard_ranks(tiny_config(tmp_path, parallelism={"strategy": "fsdp"}), DistEnv(world_size=16)) == 16
    assert shard_ranks(config, DistEnv(world_size=2, local_world_size=2)) == 2  # at least the ranks: every rank


def test_deepspeed_zero2_matches_one_process_resumes_exactly_and_exports(tmp_path):
    check_parallel_run(tmp_path, parallelism={"strategy": "deepspeed", "zero_stage": 2})
    step = tmp_path / "full" / "checkpoints" / "step-6"
    assert (step / "deepspeed" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    assert_damage_is_named(step, "deepspeed")


def test_deepspeed_zero3_matches_one_process_resumes_exactly_and_exports(tmp_path):
    check_parallel_run(tmp_path, parallelism={"strategy": "deepspeed", "zero_stage": 3})
    step = tmp_path / "full" / "checkpoints" / "step-6"
    assert (step / "deepspeed" / "zero_pp_rank_1_mp_rank_00_model_states.pt").is_file()


def test_fsdp2_rank1_builds_on_meta_and_receives_rank0_weights(tmp_path):
    """FSDP2 ranks but 0 build the model on the meta device and get rank 0's weights once it is sharded. Here the
    model is a from_pretrained directory with tied embeddings, smaller than the tokenizer (so it is resized on the
    meta device too): 2 ranks match one process, which loads the directory itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tigon.runtime.tokenizer import build_char_tokenizer

    overrides = tiny_config(tmp_path).model.config_overrides
    vocab = len(build_char_tokenizer()) - 3
    model_config = AutoConfig.for_model("llama", **overrides, vocab_size=vocab, tie_word_embeddings=True)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(model_config).save_pretrained(tmp_path / "pretrained")
    model = {"path": str(tmp_path / "pretrained"), "tokenizer": "char", "config_name": None, "config_overrides": {}}
    runs = launch(
        tmp_path, {"meta": resumable_config(tmp_path, "meta", 3, False, model=model, parallelism={"strategy": "fsdp"})}
    )
    single = train(resumable_config(tmp_path, "single", 3, False, model=model, training={"micro_batch_size": 4}))
    worst = max(abs(a - b) / abs(b) for a, b in zip(runs["meta"]["losses"], single.losses, strict=True))
    assert worst < RELATIVE_TOLERANCE, (runs["meta"]["losses"], single.losses)


def test_fp16_under_fsdp2_deepspeed_and_lightning_matches_ddp_and_resumes_exactly(tmp_path):
    """fp16 with a loss scaler in one 2-rank group: FSDP2's fp16 MixedPrecisionPolicy with a ShardedGradScaler,
    DeepSpeed ZeRO-2's fp16 engine (under the torch trainer and HF's), and Lightning's DDP with tigon's GradScaler,
    against the torch trainer's DDP
    under fp16 autocast, within FP16_TOLERANCE; the FSDP2 run resumes exactly, its scaler's state checkpointed.
    On a CPU whose oneDNN has no native fp16, DeepSpeed cannot run fp16: there both ZeRO-2 runs must fail up front
    with tigon's error instead."""
    fp16 = {"precision": "fp16"}
    fsdp, zero2 = {"strategy": "fsdp"}, {"strategy": "deepspeed", "zero_stage": 2}
    configs = {
        "ddp": resumable_config(tmp_path, "ddp", 4, False, training=fp16),
        "fsdp": resumable_config(tmp_path, "fsdp", 4, False, parallelism=fsdp, training=fp16),
        "fsdp-killed": resumable_config(tmp_path, "fsdp-resumed", 3, False, parallelism=fsdp, training=fp16),
        "fsdp-resumed": resumable_config(tmp_path, "fsdp-resumed", 4, False, parallelism=fsdp, training=fp16),
        "zero2": resumable_config(tmp_path, "zero2", 4, False, parallelism=zero2, training=fp16),
        "lightning": resumable_config(tmp_path, "lightning", 4, False, trainer="lightning", training=fp16),
        "hf-zero2": resumable_config(tmp_path, "hf-zero2", 4, False, trainer="hf", parallelism=zero2, training=fp16),
    }
    matched = ["fsdp", "zero2", "lightning", "hf-zero2"]
    if not supports_precision(import_deepspeed(torch.device("cpu")), "fp16"):
        # DeepSpeed's CPU accelerator runs fp16 only with oneDNN's native fp16 (AVX512-FP16): without it both
        # trainers stop before the engine is built, with the fix, and the other runs go on.
        for name in ("zero2", "hf-zero2"):
            with pytest.raises(ConfigError, match="accelerator cannot run fp16 on this machine.*precision bf16"):
                train(configs.pop(name))
            matched.remove(name)
    runs = launch(tmp_path, configs)
    reference = runs["ddp"]["losses"]
    assert len(reference) == 4 and reference[-1] < reference[0], reference
    for name in matched:
        worst = max(abs(a - b) / abs(b) for a, b in zip(runs[name]["losses"], reference, strict=True))
        print(f"{name} fp16: worst relative loss difference to DDP fp16 {worst:.2e}")
        assert worst < FP16_TOLERANCE, (name, runs[name]["losses"], reference)
    assert runs["fsdp-killed"]["losses"] == runs["fsdp"]["losses"][:3]
    assert runs["fsdp-resumed"]["resumed_from"] == 3 and runs["fsdp-resumed"]["losses"] == runs["fsdp"]["losses"]
    schedule = torch.load(tmp_path / "fsdp-resumed" / "checkpoints" / "step-3" / "scheduler.pt", weights_only=True)
    assert schedule["scaler"]["scale"] == 2.0**16, schedule


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"parallelism": {"cpu_offload": True}}, "parallelism.cpu_offload needs strategy 'fsdp' or 'deepspeed'"),
        (
            {"parallelism": {"strategy": "fsdp", "copy_engine_gathers": True}},
            "parallelism.copy_engine_gathers copies between GPUs' memories and this run is on cpu; set it to false",
        ),
        (
            {"parallelism": {"strategy": "fsdp"}, "trainer": "hf", "training": {"precision": "fp16"}},
            "fp16 with trainer 'hf' and parallelism.strategy 'fsdp' is not supported",
        ),
    ],
)
def test_parallelism_settings_that_cannot_run_fail_clearly(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        train(tiny_config(tmp_path, **sections))


LORA = {
    "lora": {"enabled": True, "r": 4},
    "training": {"gradient_checkpointing": True},
    "kernels": {"enabled": True, "rope": False},
}


def check_lora_run(tmp_path: Path, monkeypatch, parallelism: dict, more: dict | None = None) -> dict[str, dict]:
    """LoRA adapters (frozen base weights inside the sharded units), gradient checkpointing and tigon's kernels
    (their CPU references): 2 ranks match one process within RELATIVE_TOLERANCE (fp32), and the export holds
    the merged weights (plain from_pretrained, same logits as one process's export). The one process takes the
    CPU references too (TRITON_INTERPRET unset, as in the worker group): the kernels are tested against them on
    their own, and Triton's interpreter would take most of the test's time."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    runs = launch(
        tmp_path, {"lora": resumable_config(tmp_path, "lora", 4, True, parallelism=parallelism, **LORA), **(more or {})}
    )
    single = train(
        resumable_config(
            tmp_path, "single", 4, True, **{**LORA, "training": {**LORA["training"], "micro_batch_size": 4}}
        )
    )
    worst = max(abs(a - b) / abs(b) for a, b in zip(runs["lora"]["losses"], single.losses, strict=True))
    print(f"{parallelism} + LoRA: worst relative loss difference to one process {worst:.2e}")
    assert worst < RELATIVE_TOLERANCE, (runs["lora"]["losses"], single.losses)
    got, want = exported_logits(runs["lora"]["export_dir"]), exported_logits(single.export_dir)
    assert (got - want).abs().max() < LOGITS_TOLERANCE
    return runs


def test_fsdp2_with_lora_gradient_checkpointing_kernels_and_bf16(tmp_path, monkeypatch):
    """Also FSDP2's bf16 MixedPrecisionPolicy against one process's bf16 autocast, within BF16_TOLERANCE."""
    bf16 = {"gradient_checkpointing": True, "precision": "bf16"}
    more = {"bf16": resumable_config(tmp_path, "bf16", 4, False, parallelism={"strategy": "fsdp"}, training=bf16)}
    runs = check_lora_run(tmp_path, monkeypatch, {"strategy": "fsdp"}, more)
    single = train(resumable_config(tmp_path, "single-bf16", 4, False, training={**bf16, "micro_batch_size": 4}))
    worst = max(abs(a - b) / abs(b) for a, b in zip(runs["bf16"]["losses"], single.losses, strict=True))
    print(f"fsdp bf16: worst relative loss difference to one process {worst:.2e}")
    assert worst < BF16_TOLERANCE, (runs["bf16"]["losses"], single.losses)


def test_deepspeed_zero3_with_lora_gradient_checkpointing_and_kernels(tmp_path, monkeypatch):
    check_lora_run(tmp_path, monkeypatch, {"strategy": "deepspeed", "zero_stage": 3})


def test_a_zero3_run_leaves_torch_functional_linear_as_it_was(tmp_path):
    """DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear for the rest of the process ("This will persist
    unless manually reset"); the run puts it back, so the next run in the process saves what it should."""
    before = torch.nn.functional.linear
    zero3 = {"strategy": "deepspeed", "zero_stage": 3}
    result = train(tiny_config(tmp_path, training={"max_steps": 1, "micro_batch_size": 2}, parallelism=zero3))
    assert result.losses and torch.nn.functional.linear is before


def test_deepspeed_config_follows_the_run_config(tmp_path):
    """The DeepSpeed JSON built from the run's config: batch shape, clipping, precision, optimizer, ZeRO and offload."""
    from tigon.runtime.deepspeed_engine import deepspeed_config, trainable_elements

    config = tiny_config(
        tmp_path,
        training={"micro_batch_size": 2, "gradient_accumulation_steps": 3, "precision": "bf16", "weight_decay": 0.1},
        parallelism={"strategy": "deepspeed", "zero_stage": 3, "cpu_offload": True},
    )
    built = deepspeed_config(config, world_size=4)
    assert built["train_batch_size"] == 24 and built["train_micro_batch_size_per_gpu"] == 2
    assert built["gradient_accumulation_steps"] == 3 and built["gradient_clipping"] == 1.0
    assert built["bf16"] == {"enabled": True}
    assert built["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    }
    zero = built["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"

    assert zero["reduce_bucket_size"] == 500_000_000  # DeepSpeed's default when no model is given

    stage1 = config.model_copy(deep=True)
    stage1.parallelism.zero_stage, stage1.parallelism.cpu_offload, stage1.training.max_grad_norm = 1, False, None
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)
    assert trainable_elements(model) == 3 * 2 + 2
    built = deepspeed_config(stage1, world_size=4, trainable=trainable_elements(model))
    assert built["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 8}  # the bucket holds the trainable 8
    assert built["optimizer"]["params"]["torch_adam"] is True and built["gradient_clipping"] == 0.0
    assert deepspeed_config(stage1, 4, trainable=10**12)["zero_optimization"]["reduce_bucket_size"] == 500_000_000


def test_one_process_fsdp2_cpu_offload_and_zero1_match_ddp(tmp_path):
    """In one process (a process group of one, made by the runtime): FSDP2 with a CPUOffloadPolicy and DeepSpeed
    ZeRO-1 reach the plain run's per-step losses within RELATIVE_TOLERANCE. A second DeepSpeed run in the same
    process (ZeRO-2) works too: the first run's process group is gone, and DeepSpeed must not reuse its clone."""
    runs = {}
    for name, parallelism in [
        ("ddp", {}),
        ("fsdp-offload", {"strategy": "fsdp", "cpu_offload": True}),
        ("zero1", {"strategy": "deepspeed", "zero_stage": 1}),
        ("zero2", {"strategy": "deepspeed", "zero_stage": 2}),
    ]:
        config = resumable_config(tmp_path, name, 3, False, parallelism=parallelism, training={"micro_batch_size": 4})
        runs[name] = train(config.model_copy(update={"eval": config.eval.model_copy(update={"metrics": []})}))
    for name in ("fsdp-offload", "zero1", "zero2"):
        worst = max(abs(a - b) / abs(b) for a, b in zip(runs[name].losses, runs["ddp"].losses, strict=True))
        assert worst < RELATIVE_TOLERANCE, (name, runs[name].losses, runs["ddp"].losses)
        assert (tmp_path / name / "checkpoints" / "step-3").is_dir()


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_fsdp2_in_one_process_points_to_the_plain_model_unless_it_offloads(tmp_path, caplog, cpu_offload):
    """FSDP2 over one process shards nothing and costs its copies: the run says so, and names the fix; CPU
    offloading, which needs FSDP2, is left unremarked."""
    parallelism = {"strategy": "fsdp", "cpu_offload": cpu_offload}
    config = tiny_config(tmp_path, parallelism=parallelism, training={"max_steps": 1}, eval={"metrics": []})
    with caplog.at_level(logging.WARNING, logger="tigon.runtime"):
        train(config)
    warned = [r.getMessage() for r in caplog.records if "fsdp on one process shards nothing" in r.getMessage()]
    assert len(warned) == (0 if cpu_offload else 1)
    assert not warned or "parallelism.strategy: ddp trains the model itself" in warned[0]
