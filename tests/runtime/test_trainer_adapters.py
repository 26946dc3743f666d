"""One config, three trainers: the plain PyTorch loop, HF `Trainer` and Lightning reach the same losses.

The adapters share the torch trainer's model building, data order, optimizer, schedule and loss
normalization (sum over label tokens / label tokens of the whole step), so on the CPU in fp32 the
per-step losses agree to rounding: stated tolerance 1e-4 relative (measured far below that). They
also share its checkpoints: a run stopped at step k and resumed repeats the uninterrupted losses
exactly, and the export loads with `from_pretrained`.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

from tests.runtime.configs import OBJECTIVES, TINY_MODEL, adapter_config, objective_config
from tests.runtime.worker_groups import RELATIVE_TOLERANCE, assert_close, capture_before_export
from tigon.runtime import checkpoint as ckpt
from tigon.runtime.config import ConfigError
from tigon.runtime.storage import RunStorage
from tigon.runtime.trainer import train

pytest.importorskip("transformers")
pytest.importorskip("lightning")


def test_torch_hf_and_lightning_reach_the_same_losses(tmp_path):
    """Also the same evaluations: at step 0, every 2 steps and at the end, in the metrics file too."""
    results = {
        name: train(adapter_config(tmp_path, name, eval={"every_steps": 2})) for name in ("torch", "hf", "lightning")
    }
    reference = results["torch"].losses
    assert len(reference) == 6 and reference[-1] < reference[0], reference
    for name in ("hf", "lightning"):
        losses = results[name].losses
        assert results[name].steps == 6 and len(losses) == 6, (name, losses)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        print(f"{name}: worst relative loss difference to torch {worst:.2e}")
        assert worst < RELATIVE_TOLERANCE, (name, worst, losses, reference)
        history, reference_history = results[name].eval_history, results["torch"].eval_history
        assert [e["step"] for e in history] == [e["step"] for e in reference_history] == [0, 2, 4, 6], history
        for got, want in zip(history, reference_history, strict=True):
            assert abs(got["loss"] - want["loss"]) < RELATIVE_TOLERANCE * want["loss"], (name, got, want)
        assert results[name].eval_metrics == {k: v for k, v in history[-1].items() if k != "step"}, name
        metrics = [json.loads(line) for line in (tmp_path / f"run-{name}" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics if "eval_loss" in m] == [0, 2, 4, 6], name


@pytest.mark.parametrize(
    ("trainer", "sections", "message"),
    [
        ("hf", {"training": {"precision": "fp16"}, "parallelism": {"strategy": "fsdp"}}, "gradient scaler"),
    ],
)
def test_options_an_adapter_cannot_honour_fail_clearly(tmp_path, trainer, sections, message):
    with pytest.raises(ConfigError, match=message):
        train(adapter_config(tmp_path, trainer, **sections))


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_adapter_resumes_exactly_from_its_checkpoint(tmp_path, trainer):
    """Stop at step 3 (its checkpoint), lose the run directory, resume from the object store to step 7: the
    uninterrupted run's losses, bit for bit.

    Dropout is on (so the restored RNG states matter), an epoch is 3 steps (the position crosses epochs) and
    the schedule is constant after warmup (so the shortened run follows the full run's learning rates).
    """
    remote = f"memory://tigon-tests/{uuid.uuid4().hex}/run"

    def config(name: str, max_steps: int, remote_dir: str | None = remote):
        return adapter_config(
            tmp_path,
            trainer,
            model={"config_overrides": {**TINY_MODEL, "attention_dropout": 0.2}},
            training={"max_steps": max_steps, "lr_schedule": "constant"},
            checkpoint={"every_steps": 3, "keep_last": 2, "resume": True, "export": True, "remote_dir": remote_dir},
            eval={"metrics": []},
            logging={"run_dir": str(tmp_path / name)},
        )

    full = train(config("full", 7, None))
    assert full.resumed_from_step is None and len(full.losses) == 7
    killed = train(config("pod-1", 3))
    assert killed.losses == full.losses[:3]
    shutil.rmtree(tmp_path / "pod-1")  # the pod is gone, its disk with it
    resumed = train(config("pod-2", 7))
    assert resumed.resumed_from_step == 3 and resumed.steps == 7
    assert resumed.losses == full.losses, (resumed.losses, full.losses)
    run_dir = tmp_path / "pod-2"
    assert [path.name for _, path in ckpt.list_checkpoints(run_dir)] == ["step-6", "step-7"]
    assert RunStorage(remote).checkpoint_steps() == [6, 7]
    assert resumed.export_url == RunStorage(remote).export_url
    state = json.loads((run_dir / "checkpoints" / "step-7" / "state.json").read_text())
    assert state["step"] == 7 and state["epoch"] == 2 and state["losses"] == full.losses
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 5, 6, 7], "the new pod's metrics.jsonl starts after the checkpoint"
    assert (run_dir / "loss.png").stat().st_size > 0 and (run_dir / "summary.json").is_file()
    again = train(config("pod-2", 7))  # resumed at its last step: nothing left to train
    assert again.resumed_from_step == 7 and again.losses == full.losses
    fsspec.filesystem("memory").rm(remote, recursive=True)


@pytest.mark.parametrize(("trainer", "lora"), [("hf", False), ("lightning", True)])
def test_adapter_export_loads_with_from_pretrained(tmp_path, monkeypatch, trainer, lora):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 20, 21, 14, 22, 30]])
    captured = capture_before_export(monkeypatch, ids)
    config = adapter_config(
        tmp_path,
        trainer,
        training={"max_steps": 2},
        lora={"enabled": lora, "r": 4},
        checkpoint={"export": True, "merge_lora": True},
        eval={"metrics": []},
    )
    result = train(config)
    assert Path(result.export_dir) == Path(config.logging.run_dir) / "export"
    loaded = AutoModelForCausalLM.from_pretrained(result.export_dir)
    assert not any("lora" in name for name, _ in loaded.named_parameters())
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert torch.allclose(got, captured["logits"], atol=1e-5), "the export holds the trained weights"


def test_hf_and_lightning_ddp_two_processes_match_the_torch_trainer_and_resume_exactly(tmp_path):
    """torchrun, 2 ranks x micro-batch 2 x accumulation 2 with HF's Trainer (DDP through accelerate, gloo) and
    with Lightning (its DDP strategy, gloo) == the torch trainer in one process with micro-batch 2 x
    accumulation 4, within RELATIVE_TOLERANCE. Each adapter, stopped at its step-3 checkpoint and resumed on
    2 ranks, repeats its uninterrupted losses exactly."""
    from tests.runtime.worker_groups import launch

    def config(trainer: str, run: str, max_steps: int, **sections):
        return adapter_config(
            tmp_path,
            trainer,
            training={"max_steps": max_steps, "lr_schedule": "constant", **sections.pop("training", {})},
            checkpoint={"every_steps": 3, "keep_last": 2, "resume": True, "export": False},
            eval={"metrics": ["loss"], "max_batches": None},  # the whole held-out set on 1 and 2 ranks
            logging={"run_dir": str(tmp_path / run)},
            **sections,
        )

    configs = {}
    for name in ("hf", "lightning"):
        configs[name] = config(name, name, 6)
        configs[f"{name}-killed"] = config(name, f"{name}-resumed", 3)
        configs[f"{name}-resumed"] = config(name, f"{name}-resumed", 6)
    runs = launch(tmp_path, configs)
    torch_run = train(config("torch", "torch", 6, training={"gradient_accumulation_steps": 4}))
    reference = torch_run.losses
    assert len(reference) == 6 and reference[-1] < reference[0]
    for name in ("hf", "lightning"):
        losses = runs[name]["losses"]
        assert len(losses) == 6, (name, losses)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        print(f"{name} DDP: worst relative loss difference to torch {worst:.2e}")
        assert worst < RELATIVE_TOLERANCE, (name, losses, reference)
        eval_loss = runs[name]["eval"]["loss"]
        assert abs(eval_loss - torch_run.eval_metrics["loss"]) < RELATIVE_TOLERANCE * reference[-1], name
        assert runs[f"{name}-killed"]["losses"] == losses[:3], name
        resumed = runs[f"{name}-resumed"]
        assert resumed["resumed_from"] == 3 and resumed["losses"] == losses, (name, resumed, losses)
        names = sorted(p.name for p in (tmp_path / f"{name}-resumed" / "checkpoints").iterdir())
        assert names == ["step-3", "step-6"], (name, names)
        assert sorted(p.name for p in (tmp_path / f"{name}-resumed" / "checkpoints" / "step-6").glob("rng-*")) == [
            "rng-rank0.pt",
            "rng-rank1.pt",
        ]


# The preference objectives and distillation under the adapters. Their fused ops are checked against their PyTorch
# references by the kernel tests and against TRL by tests/runtime/test_objectives.py; here the trainers are compared,
# so the ops run their PyTorch reference (TRITON_INTERPRET unset), not Triton's interpreter, which would take nine
# tenths of each run.
OBJECTIVE_TOLERANCE = 1e-6  # fp32, one process, the same ops in the same order; measured: equal bit for bit


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_hf_and_lightning_train_each_objective_to_the_torch_trainers_losses_and_metrics(
    tmp_path, monkeypatch, recwarn, one_thread, objective
):
    """The same config under the three trainers: per-step losses and TRL's metrics (distill: its two terms) in
    metrics.jsonl, the run report's last-step metrics, and the held-out evaluation, within OBJECTIVE_TOLERANCE.
    DPO keeps a frozen reference copy, KTO precomputes its reference log-probs. The adapters' own logging
    (TensorBoard, under hf/ and lightning/) carries the metrics too. The model (from from_pretrained, in eval mode)
    trains in train mode under Lightning too: Lightning warns of no module in eval mode (the frozen model is no
    submodule)."""
    from tests.runtime.worker_groups import logged_steps, tensorboard_tags

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    results = {
        name: train(objective_config(tmp_path, objective, name, logging={"tensorboard": True}))
        for name in ("torch", "hf", "lightning")
    }
    reference = results["torch"]
    names = ["loss", *reference.objective_metrics]
    want = [{name: step[name] for name in names} for step in logged_steps(reference.run_dir)]
    assert len(want) == 2 and len(names) > 2, want
    assert "rewards/margins" in names or {"ce_loss", "distill_loss"} <= set(names), names
    for trainer in ("hf", "lightning"):
        result = results[trainer]
        got = [{name: step[name] for name in names} for step in logged_steps(result.run_dir)]
        assert len(got) == 2, (trainer, got)
        worst = max(
            assert_close(a, b, OBJECTIVE_TOLERANCE, (trainer, step))
            for step, (a, b) in enumerate(zip(got, want, strict=True), 1)
        )
        assert result.losses == [step["loss"] for step in got], trainer
        assert_close(result.objective_metrics, reference.objective_metrics, OBJECTIVE_TOLERANCE, trainer)
        worst = max(
            worst, assert_close(result.eval_metrics, reference.eval_metrics, OBJECTIVE_TOLERANCE, (trainer, "eval"))
        )
        print(f"{trainer} {objective}: worst difference to torch {worst:.2e}")
        tags = tensorboard_tags(tmp_path / trainer / "tensorboard")
        own = "rewards/margins" if "rewards/margins" in names else "distill_loss"
        assert any(tag.endswith(f"{trainer}/{own}") for tag in tags), (trainer, sorted(tags))
    assert not [str(w.message) for w in recwarn if "in eval mode at the start of training" in str(w.message)]


@pytest.mark.parametrize(("trainer", "objective"), [("hf", "dpo"), ("lightning", "distill")])
def test_an_adapter_resumes_an_objective_run_exactly(tmp_path, monkeypatch, one_thread, trainer, objective):
    """Stopped at its step-2 checkpoint and resumed to step 4, the run repeats the uninterrupted losses and last
    metrics bit for bit: the reference copy (or the teacher) is made before the checkpoint is loaded."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    resume = {"checkpoint": {"every_steps": 2, "resume": True}, "logging": {"run_dir": str(tmp_path / "resumed")}}
    whole = train(objective_config(tmp_path, objective, trainer, training={"max_steps": 4}))
    train(objective_config(tmp_path, objective, trainer, training={"max_steps": 2}, **resume))
    resumed = train(objective_config(tmp_path, objective, trainer, training={"max_steps": 4}, **resume))
    assert resumed.resumed_from_step == 2 and resumed.losses == whole.losses, (resumed.losses, whole.losses)
    assert resumed.objective_metrics == whole.objective_metrics


def test_hf_and_lightning_dpo_on_two_processes_under_ddp_fsdp2_and_zero2_match_one_process(
    tmp_path, monkeypatch, one_thread
):
    """torchrun, 2 ranks x micro-batch 2 x accumulation 2 (gloo) == the same adapter in one process with micro-batch
    4 x accumulation 2: the same global batch of 8 pairs. DDP is accelerate's (HF) or Lightning's DDPStrategy;
    FSDP2 (the policy and the frozen reference copy sharded) and DeepSpeed ZeRO-2 as the adapters run them for
    sft. Per step losses and TRL's metrics, and the held-out evaluation, within 1e-5 relative (1e-5 absolute near
    0): gloo sums the gradients, FSDP2 and ZeRO-2 reduce-scatter them, in another order than one process adds
    them."""
    from tests.runtime.worker_groups import launch, logged_steps

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    trainers, strategies = ("hf", "lightning"), ("ddp", "fsdp", "deepspeed")
    steps = {"max_steps": 3}
    runs = {
        f"{name}-{strategy}": objective_config(
            tmp_path,
            "dpo",
            name,
            training=steps,
            parallelism={"strategy": strategy},
            logging={"run_dir": f"{tmp_path}/{name}-{strategy}"},
        )
        for name in trainers
        for strategy in strategies
    }
    records = launch(tmp_path, runs)
    for name in trainers:
        single = train(objective_config(tmp_path, "dpo", name, training={**steps, "micro_batch_size": 4}))
        names = ["loss", *single.objective_metrics]
        want = [{key: step[key] for key in names} for step in logged_steps(single.run_dir)]
        assert len(want) == 3, want
        for strategy in strategies:
            record = records[f"{name}-{strategy}"]
            got = [{key: step[key] for key in names} for step in logged_steps(tmp_path / f"{name}-{strategy}")]
            assert record["losses"] == [step["loss"] for step in got], (name, strategy)
            worst = max(
                assert_close(a, b, 1e-5, (name, strategy, step))
                for step, (a, b) in enumerate(zip(got, want, strict=True), 1)
            )
            worst = max(worst, assert_close(record["eval"], single.eval_metrics, 1e-5, (name, strategy, "eval")))
            print(f"{name} {strategy}: worst difference to one process {worst:.2e}")
