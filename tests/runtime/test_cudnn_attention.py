"""cuDNN's ragged attention: its shape buckets, the ragged layout it is handed, and where it does not run.

The kernel itself runs only on a Hopper or Blackwell GPU (test_cudnn_attention_gpu.py); its inputs, its op's
shapes under fake tensors and the selective recomputation's view of it are checked here.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tigon.runtime import cudnn_attention
from tigon.runtime.recompute import is_attention


@pytest.mark.parametrize(("count", "smallest", "expected"), [(1, 16, 16), (16, 16, 16), (17, 16, 32), (0, 64, 64),
                                                              (4096, 64, 4096), (4097, 64, 8192)])  # fmt: skip
def test_buckets_are_powers_of_two_from_the_smallest(count, smallest, expected):
    assert cudnn_attention.bucket(count, smallest) == expected


def test_the_ragged_layout_pads_with_empty_documents():
    starts = torch.tensor([0, 3, 10, 11], dtype=torch.int32)  # documents of 3, 7 and 1 tokens
    lengths, q_offsets, kv_offsets, stats_offsets = cudnn_attention.ragged_layout(starts, 5, 4, 2, 8)
    assert lengths.shape == (5, 1, 1, 1) and lengths.dtype == torch.int32
    assert lengths.flatten().tolist() == [3, 7, 1, 0, 0]
    assert q_offsets.shape == (6, 1, 1, 1) and q_offsets.dtype == torch.int64
    assert q_offsets.flatten().tolist() == [0, 96, 320, 352, 352, 352]  # tokens x 4 heads x 8
    assert kv_offsets.flatten().tolist() == [0, 48, 160, 176, 176, 176]  # tokens x 2 heads x 8
    assert stats_offsets.flatten().tolist() == [0, 12, 40, 44, 44, 44]  # tokens x 4 heads


def test_it_does_not_run_on_the_cpu_or_in_float32():
    q, k = torch.zeros(10, 4, 64, dtype=torch.bfloat16), torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    assert not cudnn_attention.supports(q, k, 0.0, None)
    assert not cudnn_attention.supports(q.float(), k.float(), 0.0, None)


def test_the_op_has_the_shapes_of_its_inputs_under_fake_tensors():
    """What torch.compile and the selective recomputation see: the output like q, one float32 per token and head."""
    with FakeTensorMode():
        q, k, v = torch.empty(300, 8, 64, dtype=torch.bfloat16), *torch.empty(2, 300, 2, 64, dtype=torch.bfloat16)
        starts = torch.empty(4, dtype=torch.int32)
        out, stats = cudnn_attention.attention_op(q, k, v, starts, 200, 0.125)
        grads = torch.ops.tigon.cudnn_varlen_attention_backward(out, q, k, v, out, stats, starts, 200, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert stats.shape == (300, 8) and stats.dtype == torch.float32
    assert [tuple(g.shape) for g in grads] == [(300, 8, 64), (300, 2, 64), (300, 2, 64)]


def test_selective_recomputation_keeps_its_output():
    assert is_attention(torch.ops.tigon.cudnn_varlen_attention.default)
