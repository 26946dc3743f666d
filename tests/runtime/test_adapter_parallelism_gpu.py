"""The adapters' parallelism on one GPU (marker `gpu`): what the CPU tests cannot show.

On a GPU, Lightning's strategies move the module between devices: `ModelParallelStrategy` moves it to the GPU
in its setup (which would take FSDP2's CPU-offloaded parameters off the CPU), and the DDP and one-device
strategies move it to the CPU in their teardown, before the adapter's final evaluation and export. The HF
Trainer would move a model to the GPU at construction too. In one process, bf16, each adapter's run gives the
torch trainer's per-step losses under the same strategy within RELATIVE_TOLERANCE (one GPU: the same kernels
on the same data, measured under 3e-8), and the run started again at its last step finishes. The preference
objectives and distillation, through the fused ops' Triton kernels in bf16, give the torch trainer's per-step
losses and metrics under both adapters within the same tolerance (absolute near 0, where the rewards start).
A precomputed distillation teacher, its hidden states stored in bf16, gives the per-step losses and held-out
metrics of the teacher beside the student within the same tolerance.
"""

from __future__ import annotations

import pytest

from tests.runtime.configs import adapter_config, objective_config
from tests.runtime.worker_groups import assert_close, logged_steps
from tigon.runtime.trainer import train

RELATIVE_TOLERANCE = 1e-4
PARALLELISM = {"fsdp-offload": {"strategy": "fsdp", "cpu_offload": True}, "ddp": {}}


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", list(PARALLELISM))
def test_adapters_on_one_gpu_match_the_torch_trainer_and_finish_a_run_resumed_at_its_end(tmp_path, strategy):
    def config(trainer: str):
        return adapter_config(
            tmp_path,
            trainer,
            training={"max_steps": 4, "precision": "bf16"},
            parallelism=PARALLELISM[strategy],
            checkpoint={"every_steps": 2, "keep_last": 1, "resume": True, "export": True},
            logging={"run_dir": str(tmp_path / trainer)},
        )

    reference = train(config("torch"))
    assert reference.device.startswith("cuda") and reference.losses[-1] < reference.losses[0]
    for trainer in ("hf", "lightning"):
        result = train(config(trainer))
        worst = max(abs(a - b) / abs(b) for a, b in zip(result.losses, reference.losses, strict=True))
        print(f"{trainer} {strategy}: worst relative loss difference to the torch trainer {worst:.2e}")
        assert worst < RELATIVE_TOLERANCE, (trainer, result.losses, reference.losses)
        again = train(config(trainer))
        assert again.resumed_from_step == 4 and again.losses == result.losses and again.export_dir, trainer


@pytest.mark.gpu
@pytest.mark.parametrize("objective", ["dpo", "kto-precomputed", "distill", "distill-precomputed"])
def test_adapters_train_objectives_on_one_gpu_to_the_torch_trainers_losses_and_metrics(tmp_path, objective):
    results = {
        trainer: train(objective_config(tmp_path, objective, trainer, training={"max_steps": 3, "precision": "bf16"}))
        for trainer in ("torch", "hf", "lightning")
    }
    reference = results["torch"]
    assert reference.device.startswith("cuda")
    names = ["loss", *reference.objective_metrics]
    want = [{name: step[name] for name in names} for step in logged_steps(reference.run_dir)]
    for trainer in ("hf", "lightning"):
        got = [{name: step[name] for name in names} for step in logged_steps(results[trainer].run_dir)]
        assert len(got) == len(want) == 3, (trainer, got, want)
        worst = max(
            assert_close(a, b, RELATIVE_TOLERANCE, (trainer, step))
            for step, (a, b) in enumerate(zip(got, want, strict=True), 1)
        )
        worst = max(
            worst, assert_close(results[trainer].eval_metrics, reference.eval_metrics, RELATIVE_TOLERANCE, trainer)
        )
        print(f"{trainer} {objective}: worst difference to the torch trainer {worst:.2e}")


def precomputed_against_beside(tmp_path) -> float:
    """The worst relative difference of a bf16 distill run with objective.teacher.precompute to the run with the
    teacher beside the student, over the per-step loss, ce_loss and distill_loss and the held-out metrics."""
    from tests.runtime.configs import distill_config

    held_out = {"eval": str(tmp_path / "train.jsonl")}
    results = [
        train(
            distill_config(
                tmp_path,
                precompute=precompute,
                training={"precision": "bf16"},
                data=held_out,
                logging={"run_dir": str(tmp_path / f"precompute-{precompute}")},
            )
        )
        for precompute in (False, True)
    ]
    names = ("loss", "ce_loss", "distill_loss")
    beside, precomputed = (
        {(step["step"], name): step[name] for step in logged_steps(r.run_dir) for name in names} for r in results
    )
    assert len(beside) == 9, beside
    worst = assert_close(precomputed, beside, RELATIVE_TOLERANCE, "steps")
    return max(worst, assert_close(results[1].eval_metrics, results[0].eval_metrics, RELATIVE_TOLERANCE, "eval"))


@pytest.mark.gpu
def test_a_precomputed_teacher_in_bf16_matches_the_teacher_beside(tmp_path):
    worst = precomputed_against_beside(tmp_path)
    print(f"precomputed teacher, bf16: worst relative difference to the teacher beside {worst:.2e}")
