"""The preference objectives and distillation under DeepSpeed ZeRO-3, on the CPU with 2 processes over gloo.

One `torchrun --nproc_per_node 2` worker group (`worker_groups.launch`) trains each case under ZeRO-2 and under
ZeRO-3: 2 ranks x micro-batch 2 x accumulation 2, 2 steps, then a held-out evaluation. Under ZeRO-3 the policy's
lm_head is partitioned (the fused op runs as the head's forward, whose hooks gather it), and so are the frozen
reference copy and the teacher (engines of their own; a precomputed teacher's for its pass, its head gathered and
kept). The models' vocabulary is padded to VOCAB rows, so that
lm_head (VOCAB x 32) is past DeepSpeed's `stage3_param_persistence_threshold` (1e5 elements): below it ZeRO-3
keeps a parameter whole after its first gather, and a head read without gathering would pass unnoticed.

Per-step losses, the last step's TRL metrics (DPO's rewards/margins among them; KTO's kl; distillation's two terms)
and the evaluation agree within TOLERANCE relative plus ABSOLUTE (fp32: ZeRO-3 reduces each parameter's gradient
where ZeRO-2 reduces them in buckets, so the sums run in another order). The rewards, margins and KTO's kl are
differences of summed log-probs of about 25 nats, so their rounding is absolute, about 25 x 1e-7 (measured: at most
1.9e-6 on the log-probs, 1.9e-7 on the rewards, up to 1.1e-5 relative); ABSOLUTE covers it. A policy or frozen
head read without its gather fails outright: the fused op gets the rank's empty partition.
"""

from __future__ import annotations

import time

import pytest

from tests.runtime.configs import KTO_RECORDS, PAIRS, distill_config, preference_config, save_llama
from tests.runtime.worker_groups import launch, logged_steps

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
ABSOLUTE = 1e-5
VOCAB = 3200  # the char tokenizer's 100 tokens, padded: lm_head has 102,400 elements, past the threshold
CASES = {  # name: (objective, records); distill reads distill_config's records and teacher
    "dpo": ({"type": "dpo"}, PAIRS),
    "dpo-precomputed": ({"type": "dpo", "reference": "precomputed"}, PAIRS),
    "orpo": ({"type": "orpo"}, PAIRS),
    "kto": ({"type": "kto"}, KTO_RECORDS),
    "distill": (None, None),
}
NOT_COMPARED = {"step", "loss", "lr", "grad_norm", "epoch", "tokens_per_second", "memory_bytes", "tokens_seen"}
ADAPTER_CASES = [("dpo", "hf"), ("dpo", "lightning"), ("distill", "hf"), ("distill", "lightning")]
OFFLOADED = "dpo"  # also under ZeRO-3 with cpu_offload: the policy's and the reference's parameters on the CPU
# also under ZeRO-3 with objective.teacher.precompute (the teacher partitioned for its pass, its head gathered and
# kept), against the teacher beside the student under ZeRO-2
PRECOMPUTED = "distill"


def run_name(trainer: str, stage: int, offload: bool = False, precompute: bool = False) -> str:
    return f"{trainer}-zero{stage}" + ("-offload" if offload else "") + ("-precomputed" if precompute else "")


def case_config(
    tmp_path, name: str, stage: int, trainer: str = "torch", offload: bool = False, precompute: bool = False
):
    """`name`'s run under ZeRO `stage` with `trainer` (`offload`: parallelism.cpu_offload; `precompute`: distill's
    objective.teacher.precompute), in its own run directory."""
    directory = tmp_path / name
    held_out = {"eval": str(directory / "train.jsonl")}
    sections = {
        "trainer": trainer,
        "parallelism": {"strategy": "deepspeed", "zero_stage": stage, "cpu_offload": offload},
        "logging": {"run_dir": str(directory / run_name(trainer, stage, offload, precompute))},
    }
    if name == "distill":
        save_llama(directory / "teacher", seed=1, hidden=48, init=0.3, vocab_extra=VOCAB - 100)
        save_llama(directory / "student", seed=0, hidden=32, vocab_extra=VOCAB - 100)
        return distill_config(
            directory, precompute=precompute, training={"micro_batch_size": 1}, data=held_out, **sections
        )
    save_llama(directory / "model", seed=0, hidden=32, vocab_extra=VOCAB - 100)  # preference_config's model
    objective, records = CASES[name]
    training = {"micro_batch_size": 2, "max_steps": 2}
    return preference_config(directory, objective, records, training=training, data=held_out, **sections)


def test_objectives_under_zero3_match_zero2_in_every_trainer(tmp_path):
    started = time.perf_counter()
    zero3_runs = [(name, "torch", False, False) for name in CASES]
    zero3_runs += [(*case, False, False) for case in ADAPTER_CASES]
    zero3_runs += [(OFFLOADED, "torch", True, False), (PRECOMPUTED, "torch", False, True)]
    runs = {}
    for name in CASES:
        (tmp_path / name).mkdir()
        runs[f"{name}-torch-zero2"] = case_config(tmp_path, name, 2)
    for name, trainer, offload, precompute in zero3_runs:
        run = run_name(trainer, 3, offload, precompute)
        runs[f"{name}-{run}"] = case_config(tmp_path, name, 3, trainer, offload, precompute)
    records = launch(tmp_path, runs, timeout=900)
    for name, trainer, offload, precompute in zero3_runs:
        run = run_name(trainer, 3, offload, precompute)
        zero2, zero3 = records[f"{name}-torch-zero2"], records[f"{name}-{run}"]
        last2, last3 = (logged_steps(tmp_path / name / directory)[-1] for directory in ("torch-zero2", run))
        metrics = [key for key in last2 if key not in NOT_COMPARED]  # TRL's, or distillation's two terms
        assert {"distill": "distill_loss", "kto": "kl"}.get(name, "rewards/margins") in metrics, (name, metrics)
        pairs = [*zip(zero3["losses"], zero2["losses"], strict=True)]
        pairs += [(last3[key], last2[key]) for key in metrics]
        pairs += [(zero3["eval"][key], zero2["eval"][key]) for key in zero2["eval"]]
        worst = max(abs(a - b) for a, b in pairs)
        relative = max(abs(a - b) / abs(b) for a, b in pairs if abs(b) > 1e-2)
        print(f"{name} {run}: {len(pairs)} values, worst {worst:.1e} absolute, {relative:.1e} relative over 1e-2")
        assert zero2["losses"][-1] != zero2["losses"][0], (name, zero2["losses"])  # the model trained
        for got, want in pairs:
            assert abs(got - want) <= TOLERANCE * abs(want) + ABSOLUTE, (name, run, zero2, zero3, last2, last3)
    print(f"zero3 objectives: {time.perf_counter() - started:.1f} s")
