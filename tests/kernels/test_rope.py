import pytest
import torch

from tests.kernels.helpers import DTYPES, as_float64, assert_close, leaf
from tigon.kernels import reference
from tigon.kernels.ops import rope as rope_module
from tigon.kernels.ops.rope import rope


def rotary_tables(positions: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Real rotary cos/sin tables (max_positions, head_dim), halves equal, as Llama builds them."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    freqs = torch.arange(positions, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def hf_layout(batch, heads, seq_len, head_dim, dtype, device) -> torch.Tensor:
    """A (B, H, S, D) leaf that is a transposed view of (B, S, H, D), as Hugging Face attention makes q and k."""
    x = torch.randn(batch, seq_len, heads, head_dim, device=device).to(dtype).transpose(1, 2)
    return x.requires_grad_(True)


def run_case(
    q, k, cos, sin, dtype, position_ids=None, check_layout=True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward and backward of `rope` against `reference.rope` on float64 copies of every input."""
    q_out, k_out = rope(q, k, cos, sin, position_ids)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), (dq_out.clone(), dk_out.clone()))

    q64, k64 = as_float64(q), as_float64(k)
    q_ref, k_ref = reference.rope(q64, k64, cos.double(), sin.double(), position_ids)
    torch.autograd.backward((q_ref, k_ref), (dq_out.double(), dk_out.double()))

    assert q_out.dtype == q.dtype and k_out.dtype == k.dtype
    if check_layout:
        # The layout reaches attention: SDPA's cuDNN backend (PyTorch's default on Hopper) reads the output gradient
        # with the output's strides, which follow the query's; transformers' layout is the one that matches.
        assert q_out.stride() == q.stride() and k_out.stride() == k.stride(), "outputs must keep the input layout"
    assert_close(q_out, q_ref, dtype, "q_out")
    assert_close(k_out, k_ref, dtype, "k_out")
    assert_close(q.grad, q64.grad, dtype, "dq")
    assert_close(k.grad, k64.grad, dtype, "dk")
    return q_out, k_out, q.grad, k.grad


def random_case(batch, q_heads, k_heads, seq_len, head_dim, dtype, device, cos_dtype=None, hf=True):
    """Random q/k and random cos/sin (halves differ), per token (batch, seq_len, head_dim)."""
    torch.manual_seed(1000 * head_dim + 10 * seq_len + q_heads)
    if hf:
        q = hf_layout(batch, q_heads, seq_len, head_dim, dtype, device)
        k = hf_layout(batch, k_heads, seq_len, head_dim, dtype, device)
    else:
        q = leaf(torch.randn(batch, q_heads, seq_len, head_dim, device=device), dtype)
        k = leaf(torch.randn(batch, k_heads, seq_len, head_dim, device=device), dtype)
    cos_dtype = cos_dtype or dtype
    cos = torch.randn(batch, seq_len, head_dim, device=device).to(cos_dtype)
    sin = torch.randn(batch, seq_len, head_dim, device=device).to(cos_dtype)
    return run_case(q, k, cos, sin, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [2, 6, 10, 64, 128])
def test_head_dims(head_dim, dtype, device):
    random_case(2, 4, 1, 7, head_dim, dtype, device)


@pytest.mark.parametrize("seq_len", [1, 7, 37])
@pytest.mark.parametrize("heads", [(4, 1), (6, 2), (3, 3)])
def test_seq_lens_and_grouped_heads(seq_len, heads, device):
    random_case(2, *heads, seq_len, 6, torch.float32, device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_bhsd(dtype, device):
    random_case(2, 6, 2, 5, 10, dtype, device, hf=False)


@pytest.mark.parametrize(("dtype", "cos_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_cos_sin_in_another_dtype(dtype, cos_dtype, device):
    random_case(2, 4, 2, 7, 64, dtype, device, cos_dtype=cos_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_real_rotary_tables_broadcast_over_batch(dtype, device):
    torch.manual_seed(3)
    cos, sin = rotary_tables(9, 64, device)
    q, k = hf_layout(3, 4, 9, 64, dtype, device), hf_layout(3, 2, 9, 64, dtype, device)
    run_case(q, k, cos[None].float(), sin[None].float(), dtype)  # (1, S, D): batch stride 0
    q.grad = k.grad = None
    run_case(q, k, cos.float(), sin.float(), dtype)  # (S, D)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_positions_index_the_table(dtype, device):
    """Packed sequences restart their positions; cos/sin are (max_positions, D) tables."""
    torch.manual_seed(4)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8]], device=device)
    cos, sin = rotary_tables(16, 10, device)
    q, k = hf_layout(2, 6, 9, 10, dtype, device), hf_layout(2, 2, 9, 10, dtype, device)
    q_out, k_out, _, _ = run_case(q, k, cos.to(dtype), sin.to(dtype), dtype, position_ids=packed)
    # A token at position 0 is not rotated at all.
    torch.testing.assert_close(q_out[0, :, 4], q.detach()[0, :, 4])

    q.grad = k.grad = None
    run_case(q, k, cos.float(), sin.float(), dtype, position_ids=packed[:1].int())  # (1, S), int32
    q.grad = k.grad = None
    run_case(q, k, cos.float(), sin.float(), dtype, position_ids=packed[1])  # (S,)


def test_heads_split_over_a_second_grid_dimension(device, monkeypatch):
    """With tiles capped at 8 elements, D=10 (BLOCK_HALF 8) gives one head per program: 6 head blocks."""
    monkeypatch.setattr(rope_module, "MAX_TILE", 8)
    assert rope_module._launch_config(6, 2, 10)[:4] == (1, 1, 8, 6)
    random_case(2, 6, 2, 3, 10, torch.float32, device)


def test_random_tables_with_positions(device):
    """Random tables (halves differ) through position_ids prove the general formula on that path too."""
    torch.manual_seed(5)
    cos, sin = torch.randn(12, 6, device=device), torch.randn(12, 6, device=device)
    positions = torch.randint(0, 12, (2, 7), device=device)
    q, k = hf_layout(2, 4, 7, 6, torch.float32, device), hf_layout(2, 1, 7, 6, torch.float32, device)
    run_case(q, k, cos, sin, torch.float32, position_ids=positions)


def test_strided_views_of_a_fused_projection(device):
    """q and k sliced out of one fused qkv projection: non-dense views, read in place, written densely."""
    torch.manual_seed(6)
    batch, seq_len, q_heads, k_heads, head_dim = 2, 5, 4, 2, 6
    qkv = torch.randn(batch, seq_len, q_heads + 2 * k_heads, head_dim, device=device).transpose(1, 2)
    q = qkv[:, :q_heads].detach().requires_grad_(True)
    k = qkv[:, q_heads : q_heads + k_heads].detach().requires_grad_(True)
    cos = torch.randn(batch, seq_len, head_dim, device=device)
    sin = torch.randn(batch, seq_len, head_dim, device=device)
    q_out, k_out, _, _ = run_case(q, k, cos, sin, torch.float32, check_layout=False)
    assert q_out.stride() != q.stride() and k_out.stride() != k.stride()  # outputs have their own strides


def test_gradients_of_a_partial_loss(device):
    """Only q_out in the loss: dk is zero, and the expanded incoming gradient is read through stride 0."""
    torch.manual_seed(7)
    q, k = hf_layout(1, 2, 3, 4, torch.float32, device), hf_layout(1, 1, 3, 4, torch.float32, device)
    cos, sin = torch.randn(1, 3, 4, device=device), torch.randn(1, 3, 4, device=device)
    q_out, _ = rope(q, k, cos, sin)
    q_out.sum().backward()
    q64 = as_float64(q)
    reference.rope(q64, as_float64(k), cos.double(), sin.double())[0].sum().backward()
    assert_close(q.grad, q64.grad, torch.float32, "dq")
    assert torch.count_nonzero(k.grad) == 0


def test_no_gradient_for_cos_and_sin(device):
    q, k = hf_layout(1, 2, 3, 4, torch.float32, device), hf_layout(1, 1, 3, 4, torch.float32, device)
    cos = torch.randn(1, 3, 4, device=device, requires_grad=True)
    sin = torch.randn(1, 3, 4, device=device, requires_grad=True)
    q_out, k_out = rope(q, k, cos, sin)
    (q_out.sum() + k_out.sum()).backward()
    assert cos.grad is None and sin.grad is None


def test_empty_sequence(device):
    q, k = torch.randn(2, 4, 0, 8, device=device), torch.randn(2, 1, 0, 8, device=device)
    q_out, k_out = rope(q, k, torch.randn(2, 0, 8, device=device), torch.randn(2, 0, 8, device=device))
    assert q_out.shape == q.shape and k_out.shape == k.shape


def test_bad_inputs(device):
    def t(*shape, dtype=torch.float32):
        return torch.ones(*shape, device=device, dtype=dtype)

    q, k, cos, sin = t(2, 4, 5, 8), t(2, 2, 5, 8), t(2, 5, 8), t(2, 5, 8)
    with pytest.raises(TypeError, match="q has dtype torch.int64"):
        rope(t(2, 4, 5, 8, dtype=torch.long), k, cos, sin)
    with pytest.raises(TypeError, match="sin has dtype torch.int32"):
        rope(q, k, cos, t(2, 5, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="must be 4-D"):
        rope(t(2, 5, 8), k, cos, sin)
    with pytest.raises(ValueError, match="must agree in batch, seq_len and head_dim"):
        rope(q, t(2, 2, 6, 8), cos, sin)
    with pytest.raises(ValueError, match="RoPE needs an even head dim"):
        rope(t(2, 4, 5, 7), t(2, 2, 5, 7), t(2, 5, 7), t(2, 5, 7))
    with pytest.raises(ValueError, match="cos has shape .* but sin has shape"):
        rope(q, k, cos, t(1, 5, 8))
    with pytest.raises(ValueError, match="last dim 4 but the head dim"):
        rope(q, k, t(2, 5, 4), t(2, 5, 4))
    with pytest.raises(ValueError, match="without position_ids they must be per token"):
        rope(q, k, t(3, 5, 8), t(3, 5, 8))
    with pytest.raises(ValueError, match="without position_ids they must be per token"):
        rope(q, k, t(16, 8), t(16, 8))
    with pytest.raises(TypeError, match="position_ids has dtype torch.float32"):
        rope(q, k, t(16, 8), t(16, 8), t(2, 5))
    with pytest.raises(TypeError, match="position_ids must be a torch.Tensor"):
        rope(q, k, t(16, 8), t(16, 8), [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"position_ids has shape \(2, 4\)"):
        rope(q, k, t(16, 8), t(16, 8), t(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="must be 2-D tables"):
        rope(q, k, t(1, 16, 8), t(1, 16, 8), t(2, 5, dtype=torch.long))


def test_inputs_on_another_device():
    q, k = torch.ones(1, 2, 3, 4), torch.ones(1, 1, 3, 4)
    cos = torch.ones(1, 3, 4)
    with pytest.raises(ValueError, match="sin is on meta"):
        rope(q, k, cos, torch.ones(1, 3, 4, device="meta"))
    with pytest.raises(ValueError, match="position_ids is on meta"):
        rope(q, k, torch.ones(8, 4), torch.ones(8, 4), torch.zeros(1, 3, dtype=torch.long, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 32, 8, 2048, 128), (3, 28, 4, 1027, 80), (1, 12, 12, 333, 256)])
def test_gpu_real_sizes(shape, dtype):
    batch, q_heads, k_heads, seq_len, head_dim = shape
    random_case(batch, q_heads, k_heads, seq_len, head_dim, dtype, "cuda")
    random_case(batch, q_heads, k_heads, seq_len, head_dim, dtype, "cuda", cos_dtype=torch.float32, hf=False)
    cos, sin = rotary_tables(2 * seq_len, head_dim, "cuda")
    positions = torch.arange(seq_len, device="cuda").remainder(seq_len // 3 + 1).expand(batch, seq_len)
    q = hf_layout(batch, q_heads, seq_len, head_dim, dtype, "cuda")
    k = hf_layout(batch, k_heads, seq_len, head_dim, dtype, "cuda")
    run_case(q, k, cos.float(), sin.float(), dtype, position_ids=positions)


@pytest.mark.gpu
def test_gpu_token_counts_share_one_compiled_kernel():
    """A packed micro-batch's token count changes every step; crossing a multiple of 16 compiles nothing new."""
    from triton import knobs

    cos, sin = (table.float() for table in rotary_tables(8192, 64, "cuda"))

    def rotate(tokens: int) -> None:
        q, k = hf_layout(1, 32, tokens, 64, torch.bfloat16, "cuda"), hf_layout(1, 8, tokens, 64, torch.bfloat16, "cuda")
        positions = torch.arange(tokens, device="cuda").remainder(1000)[None]
        q_out, k_out = rope(q, k, cos, sin, positions)
        (q_out.float().sum() + k_out.float().sum()).backward()

    rotate(4096)
    compiled = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *args, **kwargs: compiled.append(kwargs["repr"])
    try:
        for tokens in (4097, 4100, 4112, 4103):
            rotate(tokens)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = previous
    assert compiled == []
