"""One config, three trainers: the plain PyTorch loop, HF `Trainer` and Lightning reach the same losses.

The adapters share the torch trainer's model building, data order, optimizer, schedule and loss
normalization (sum over label tokens / label tokens of the whole step), so on the CPU in fp32 the
per-step losses agree to rounding: stated tolerance 1e-4 relative (measured far below that).
"""

from __future__ import annotations

import pytest

from tests.runtime.test_trainer import tiny_config
from tigon.runtime.config import ConfigError
from tigon.runtime.trainer import train

pytest.importorskip("transformers")
pytest.importorskip("lightning")

RELATIVE_TOLERANCE = 1e-4


def adapter_config(tmp_path, trainer: str, **sections):
    # micro-batch 2 x accumulation 2, cosine schedule with warmup and clipping: every shared piece is exercised
    training = {
        "max_steps": 6,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "lr_schedule": "cosine",
        "warmup_steps": 2,
        "weight_decay": 0.1,
        "max_grad_norm": 0.5,
        **sections.pop("training", {}),
    }
    return tiny_config(
        tmp_path,
        n_train=40,  # about 3 steps per epoch: the run crosses epochs (the data order reshuffles)
        trainer=trainer,
        training=training,
        data={"max_seq_len": 32},
        eval={"metrics": ["loss"], "max_batches": 1, **sections.pop("eval", {})},
        logging={"run_dir": str(tmp_path / f"run-{trainer}"), "tensorboard": False, "progress_bar": False},
        **sections,
    )


def test_torch_hf_and_lightning_reach_the_same_losses(tmp_path):
    results = {name: train(adapter_config(tmp_path, name)) for name in ("torch", "hf", "lightning")}
    reference = results["torch"].losses
    assert len(reference) == 6 and reference[-1] < reference[0], reference
    for name in ("hf", "lightning"):
        losses = results[name].losses
        assert results[name].steps == 6 and len(losses) == 6, (name, losses)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        print(f"{name}: worst relative loss difference to torch {worst:.2e}")
        assert worst < RELATIVE_TOLERANCE, (name, worst, losses, reference)
        eval_loss, eval_reference = results[name].eval_metrics["loss"], results["torch"].eval_metrics["loss"]
        assert abs(eval_loss - eval_reference) < RELATIVE_TOLERANCE * eval_reference, (name, eval_loss)


@pytest.mark.parametrize(
    ("trainer", "sections", "message"),
    [
        ("hf", {"checkpoint": {"every_steps": 2, "export": False, "resume": False}}, "checkpoint.every_steps"),
        ("lightning", {"training": {"precision": "fp16"}}, "gradient scaler"),
        ("lightning", {"eval": {"every_steps": 2}}, "eval.every_steps"),
    ],
)
def test_options_an_adapter_cannot_honour_fail_clearly(tmp_path, trainer, sections, message):
    with pytest.raises(ConfigError, match=message):
        train(adapter_config(tmp_path, trainer, **sections))


def test_hf_trainer_ddp_two_processes_match_the_torch_trainer(tmp_path):
    """torchrun, 2 ranks x micro-batch 2 x accumulation 2 with HF's Trainer (DDP through accelerate, gloo) ==
    the torch trainer in one process with micro-batch 2 x accumulation 4, within RELATIVE_TOLERANCE."""
    from tests.runtime.test_parallel import launch

    every = {"eval": {"metrics": ["loss"], "max_batches": None}}  # the whole held-out set on 1 and 2 ranks
    runs = launch(tmp_path, {"hf": adapter_config(tmp_path, "hf", **every)})
    torch_run = train(adapter_config(tmp_path, "torch", training={"gradient_accumulation_steps": 4}, **every))
    losses, reference = runs["hf"]["losses"], torch_run.losses
    assert len(losses) == 6 and reference[-1] < reference[0]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    print(f"hf DDP: worst relative loss difference to torch {worst:.2e}")
    assert worst < RELATIVE_TOLERANCE, (losses, reference)
    assert abs(runs["hf"]["eval"]["loss"] - torch_run.eval_metrics["loss"]) < RELATIVE_TOLERANCE * reference[-1]
