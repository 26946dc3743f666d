"""DDP, FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 on 2 GPUs over NCCL, with tigon's kernels (marker `gpu`, 2 GPUs).

The same checks as the CPU suite's gloo runs (tests/runtime/test_parallel.py: per-step losses against one
process, a killed run resumed exactly, the export's logits), on `nvidia-h200-x2`:

    python -m pytest -m gpu tests/runtime/test_parallel_gpu.py

It needs 2 GPUs, and DeepSpeed for its two cases (carry its wheel to the GPU machine).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.runtime.test_parallel import check_parallel_run

PARALLELISM = {
    "ddp": {"strategy": "ddp"},
    "fsdp2": {"strategy": "fsdp"},
    "zero2": {"strategy": "deepspeed", "zero_stage": 2},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3},
}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("name", list(PARALLELISM))
def test_patched_model_on_two_gpus_matches_one_and_resumes_exactly(tmp_path, name):
    parallelism = PARALLELISM[name]
    if parallelism["strategy"] == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.fail("DeepSpeed is not installed: carry its wheel to the GPU machine")
    check_parallel_run(tmp_path, backend="nccl", parallelism=parallelism, kernels={"enabled": True})
