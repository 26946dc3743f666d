"""A batch's copy to the GPU is queued behind the GPU's work without the host waiting for it.

    python -m pytest -m gpu tests/runtime/test_host_copies_gpu.py

The trainer makes a step's inputs while the previous step runs; a copy that waited would idle the GPU anyway.
"""

from __future__ import annotations

import pytest
import torch

from tigon.runtime.host_copies import to_device

pytestmark = pytest.mark.gpu


def test_a_copy_larger_than_the_staging_buffer_does_not_wait_for_the_gpu():
    batch = torch.arange(4 << 20)  # 32 MiB of int64
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # about two seconds of GPU work
    copied = to_device(batch, "cuda")
    assert not torch.cuda.current_stream().query()  # the host came back while the GPU still sleeps
    assert torch.equal(copied.cpu(), batch)
