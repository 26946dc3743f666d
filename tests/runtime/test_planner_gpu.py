"""The planner's estimate against the measured peak (torch.cuda.max_memory_allocated) of real training steps.

Each case trains a small Llama (bf16, AdamW, SDPA, random tokens) for a few optimizer steps through
the torch trainer's step in a fresh process (benchmarks/end_to_end_runner.py's worker), so peaks do not mix;
the preference cases train through `train()` (benchmarks/preference_memory.py's worker).
"""

from __future__ import annotations

import pytest

from benchmarks.end_to_end_runner import run_in_subprocess
from benchmarks.preference_memory import CASES as PREFERENCE_CASES
from benchmarks.preference_memory import SMALL_LLAMA, describe, run_case


def small_llama_spec(**changes) -> dict:
    """One measurement of SMALL_LLAMA for benchmarks/end_to_end_runner.py: 4 sequences a step, two steps after a
    warm-up, on the whole GPU; `changes` set the rest."""
    return {"shape": SMALL_LLAMA, "micro_batch": 4, "steps": 2, "warmup": 1, "gpu_memory": None, **changes}


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [1024, 2048])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("variant", ["eager", "tigon"])
def test_estimate_within_ten_percent_of_the_measured_peak(variant, checkpointing, seq):
    spec = small_llama_spec(variant=variant, seq=seq, checkpointing=checkpointing)
    result = run_in_subprocess(spec, timeout=600)
    assert not result["oom"], result
    estimate, peak = result["estimate_bytes"], result["peak_bytes"]
    print(
        f"{variant} checkpointing={checkpointing} seq={seq}: estimate {estimate / 2**30:.3f} GiB, "
        f"measured {peak / 2**30:.3f} GiB, ratio {estimate / peak:.3f}"
    )
    assert abs(estimate - peak) <= 0.10 * peak, f"estimate {estimate} vs measured {peak} ({estimate / peak:.3f}x)"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_compiled_selective_layers_keep_what_the_planner_counts(precision):
    """Compiled layers (Inductor), every one selective, against the same compiled run keeping everything, in bf16
    and FP8 (whose compiled layers keep their Linear layers' inputs as FP8 casts, `linear_input_bytes`): both
    estimates within ten percent of the measured peaks, and the memory the selective layers free at least 90% of
    what the planner counts (the partitioner saves what the policy keeps and no more)."""
    peaks, estimates = {}, {}
    everything, selective = 0, SMALL_LLAMA["num_hidden_layers"]
    for count in (everything, selective):
        spec = small_llama_spec(
            variant="tigon", seq=2048, checkpointing=False, selective_layers=count, compile=True, precision=precision
        )
        result = run_in_subprocess(spec, timeout=600)
        assert not result["oom"], result
        peaks[count], estimates[count] = result["peak_bytes"], result["estimate_bytes"]
        print(
            f"compiled {precision}, {count} selective: estimate {estimates[count] / 2**30:.3f} GiB, "
            f"measured {peaks[count] / 2**30:.3f} GiB"
        )
    for count in (everything, selective):
        assert abs(estimates[count] - peaks[count]) <= 0.10 * peaks[count]
    freed, counted = peaks[everything] - peaks[selective], estimates[everything] - estimates[selective]
    assert freed >= 0.9 * counted, (freed, counted)


@pytest.mark.gpu
def test_out_of_memory_is_answered_with_the_planners_setting(tmp_path):
    """A Llama-3.2-1B-shaped run far past the GPU's memory: train() raises the planner's advice, not a bare OOM."""
    import json

    from benchmarks.presets import LLAMA_32_1B
    from tigon.runtime.config import parse_config
    from tigon.runtime.planner import TrainingOutOfMemory
    from tigon.runtime.trainer import train

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": "0123456789 " * 800}) + "\n" for _ in range(40)))
    config = parse_config(
        {
            "model": {
                "config_name": "llama",
                "config_overrides": LLAMA_32_1B,
                "tokenizer": "char",
                "dtype": "bfloat16",
            },
            "data": {"train": str(data), "max_seq_len": 8192},
            "training": {"max_steps": 1, "micro_batch_size": 32, "precision": "bf16"},
            "kernels": {"enabled": False},
            "checkpoint": {"export": False, "resume": False},
            "logging": {"run_dir": str(tmp_path / "run"), "tensorboard": False, "progress_bar": False},
        }
    )
    with pytest.raises(TrainingOutOfMemory) as error:
        train(config)
    message = str(error.value)
    assert message.startswith("CUDA out of memory: the planner estimates this run's peak at")
    assert "--set training.micro_batch_size=" in message and "training.plan: auto" in message
    assert "(torch: Tried to allocate" in message and "reserved by PyTorch but unallocated" in message


@pytest.mark.gpu
def test_a_run_stays_within_training_gpu_memory(tmp_path):
    """`training.gpu_memory` caps PyTorch's allocator: a setting that fits the GPU but not the cap stops with the
    planner's advice for the capped memory, and the planner's setting for the cap trains within it."""
    import gc
    import json

    import torch

    from benchmarks.presets import LLAMA_32_1B
    from tigon.runtime.config import parse_config
    from tigon.runtime.planner import TrainingOutOfMemory
    from tigon.runtime.trainer import train

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": "0123456789 " * 200}) + "\n" for _ in range(40)))

    def config(name: str, plan: str):
        return parse_config(
            {
                "model": {
                    "config_name": "llama",
                    "config_overrides": LLAMA_32_1B,
                    "tokenizer": "char",
                    "dtype": "bfloat16",
                },
                "data": {"train": str(data), "max_seq_len": 2048},
                "training": {
                    "max_steps": 2,
                    "micro_batch_size": 8,
                    "precision": "bf16",
                    "gpu_memory": "16GiB",
                    "plan": plan,
                },
                "checkpoint": {"export": False, "resume": False},
                "logging": {"run_dir": str(tmp_path / name), "tensorboard": False, "progress_bar": False},
            }
        )

    try:
        with pytest.raises(TrainingOutOfMemory) as error:  # about 26 GiB as configured
            train(config("manual", "manual"))
        message = str(error.value)
        del error  # its traceback holds the failed run's model and optimizer
        gc.collect()
        assert "within 16.00 GiB of GPU memory (training.gpu_memory)" in message, message
        assert "The fastest setting that fits is" in message, message
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        result = train(config("auto", "auto"))
        assert len(result.losses) == 2 and result.peak_memory_bytes <= 16 * 2**30, result.peak_memory_bytes
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(PREFERENCE_CASES))
def test_preference_estimate_within_ten_percent_of_the_measured_peak(case):
    """DPO, KTO and ORPO, padded and packed pairs, a frozen reference copy and a precomputed pass (sequence 1024,
    4 pairs a micro-batch, every sequence full length): the estimate against the run's measured peak."""
    result = run_case(case, seq=1024, micro_batch=4)
    assert "error" not in result and not result["oom"], result
    print(describe(result))
    estimate, peak = result["estimate_bytes"], result["peak_bytes"]
    assert abs(estimate - peak) <= 0.10 * peak, f"estimate {estimate} vs measured {peak} ({estimate / peak:.3f}x)"


ALLOCATOR_PROBE = """
import torch
from tigon.runtime.distributed import configure_allocator
configure_allocator()
x = torch.empty(1 << 20, device="cuda")
print(sorted({bool(segment.get("is_expandable")) for segment in torch.cuda.memory_snapshot()}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize(("setting", "expandable"), [(None, "[True]"), ("expandable_segments:False", "[False]")])
def test_the_runtime_allocates_in_expandable_segments_unless_told_otherwise(setting, expandable):
    import subprocess
    import sys

    from tests.runtime.worker_groups import process_env

    env = process_env()
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if setting is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = setting
    done = subprocess.run([sys.executable, "-c", ALLOCATOR_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == expandable, done.stdout
