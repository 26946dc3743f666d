"""Gated MoE experts over token-expert pairs sorted by expert, with torch's grouped GEMM, saving only gate_up.

The forward is transformers' "grouped_mm" experts function (transformers 5.x, 3-D `gate_up_proj`
[E, 2I, H] and `down_proj` [E, H, I]) with tigon's packed activation: sort the T x K pairs by expert,
gather their hidden states, `gate_up = x @ W1[e]^T`, `a = act(gate) * up`, `y = a @ W2[e]^T`; then one
kernel reads each token's K rows of y where the sort put them, scales each by its routing weight and sums
them in float32, rounding once (transformers scales, un-sorts and sums in three passes over T x K rows,
and where the router keeps its weights in float32, as DeepSeek-V2's does, in float32 rows). Run under
autograd, transformers' function keeps four (T x K)-row tensors for the backward, the gathered inputs (H
wide), gate_up (2I), a (I) and y (H), and three int64 index vectors. Here only gate_up and the sort order
are kept: 2I of those 2H + 3I values a row, at Qwen3-30B-A3B's H = 2048, I = 768, K = 8 24 KiB a token
instead of 100 KiB, in the backward of each layer (with gradient checkpointing, of the one layer being
recomputed).

The backward recomputes the rest instead of reading it, and adds no GEMM. It never rebuilds `y`: the
routing weight's gradient `<dout, y> = <dout @ W2[e], a>` uses `g = dout @ W2[e]`, the product the
activation's gradient needs anyway (times the routing weight), the same identity Liger-Kernel's fused
MoE uses. One kernel then reads g and gate_up once: it recomputes `a` in float32, sums `g * a` into
the routing weight's gradient (float32), writes d(gate_up) over gate_up and `a` (rounded as the
forward rounds it) over g, for the down weight's gradient. The gathered inputs are gathered again
for the gate_up weight's gradient. The gradients are the same functions as transformers', rounded
at different points (the routing weight's and the activation's fewer times).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.kernels import reference
from tigon.kernels.ops.gated_activation import NUM_WARPS, _activation_and_derivative, packed_forward
from tigon.kernels.utils import DATA_COUNTS, LAUNCH_OPTIONS, check_float, check_same_device, next_power_of_2, use_triton

ACTIVATIONS = ("silu", "gelu_tanh", "gelu_erf")
BACKWARD_ELEMENTS = 4096  # elements of one program's BLOCK_M x BLOCK_N tile
BACKWARD_MAX_BLOCK_N = 256


@triton.jit(do_not_specialize=DATA_COUNTS)
def _routed_gate_backward_kernel(
    GRAD_ACT,
    GATE_UP,
    WEIGHTS,
    GRAD_WEIGHTS,
    n_rows,
    n_cols,
    stride_grad,
    stride_gate_up,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rows of `GRAD_ACT` (d(a) over the routing weight) and `GATE_UP`: writes d(gate_up) over GATE_UP,
    `a = act(gate) * up` over GRAD_ACT and `sum(GRAD_ACT * a)` to GRAD_WEIGHTS. A program owns whole rows."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    weight = tl.load(WEIGHTS + rows, mask=row_mask, other=0.0).to(tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        grad_act = GRAD_ACT + rows[:, None] * stride_grad + cols[None, :]
        gate = GATE_UP + rows[:, None] * stride_gate_up + cols[None, :]
        g = tl.load(grad_act, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate + n_cols, mask=mask, other=0.0).to(tl.float32)
        act, derivative = _activation_and_derivative(x, ACTIVATION)
        a = (act * u).to(GRAD_ACT.dtype.element_ty)  # the forward's output, rounded as it was
        total += tl.sum(g * a.to(tl.float32), axis=1)
        g = g * weight[:, None]
        # Each program reads its elements before writing the same positions: safe in place.
        tl.store(gate, (g * u * derivative).to(GATE_UP.dtype.element_ty), mask=mask)
        tl.store(gate + n_cols, (g * act).to(GATE_UP.dtype.element_ty), mask=mask)
        tl.store(grad_act, a, mask=mask)
    tl.store(GRAD_WEIGHTS + rows, total, mask=row_mask)


@triton.jit
def _weighted_sum_kernel(ROWS, POSITION, WEIGHTS, OUT, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """OUT[t] = sum over k of WEIGHTS[t, k] * ROWS[POSITION[t, k]], in float32 and rounded once: one program
    per token and block of BLOCK_H columns."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(POSITION + token * TOP_K + k).to(tl.int64)
        weight = tl.load(WEIGHTS + token * TOP_K + k).to(tl.float32)
        total += weight * tl.load(ROWS + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + token * hidden + cols, total.to(OUT.dtype.element_ty), mask=mask)


def weighted_sum(rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's routing-weighted sum of its K expert outputs: `rows` (T x K, H) in expert order,
    `position` (T, K) where each token's pairs sit in it, `weights` (T, K). Returns (T, H) in rows' dtype."""
    tokens, top_k = weights.shape
    hidden = rows.shape[1]
    out = torch.empty(tokens, hidden, dtype=rows.dtype, device=rows.device)
    if tokens > 0:
        block = min(next_power_of_2(hidden), 1024)
        _weighted_sum_kernel[(tokens, triton.cdiv(hidden, block))](
            rows, position, weights.contiguous(), out, hidden, TOP_K=top_k, BLOCK_H=block, **LAUNCH_OPTIONS
        )
    return out


def routed_gate_backward(
    grad_act: torch.Tensor, gate_up: torch.Tensor, weights: torch.Tensor, activation: str
) -> torch.Tensor:
    """The backward of `weights * (act(gate) * up)` per row, given `grad_act`, the gradient of that product
    over `weights`: writes d(gate_up) over gate_up and act(gate) * up over grad_act; returns d(weights) in
    float32."""
    n_rows, n_cols = grad_act.shape
    grad_weights = torch.empty(n_rows, dtype=torch.float32, device=grad_act.device)
    if n_rows > 0:
        block_n = min(next_power_of_2(n_cols), BACKWARD_MAX_BLOCK_N)
        block_m = BACKWARD_ELEMENTS // block_n
        _routed_gate_backward_kernel[(triton.cdiv(n_rows, block_m),)](
            grad_act,
            gate_up,
            weights,
            grad_weights,
            n_rows,
            n_cols,
            grad_act.stride(0),
            gate_up.stride(0),
            ACTIVATION=activation,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=NUM_WARPS,
            **LAUNCH_OPTIONS,
        )
    return grad_weights


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def grouped_mm_available(*weights: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs on these expert weights: CUDA at SM80+ (SM90 before torch 2.9), or
    the CPU from torch 2.9 with 16-byte aligned data (the conditions transformers' grouped_mm experts check)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = weights[0].device
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        return capability >= (8, 0) if _torch_version() >= (2, 9) else capability[0] == 9
    aligned = all(weight.data_ptr() % 16 == 0 for weight in weights)
    return device.type == "cpu" and _torch_version() >= (2, 9) and aligned


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM: `a`'s rows (or, for two 2-D operands, `a`'s columns and `b`'s rows) split into
    groups at the int32 `offsets`, group i multiplied by `b[i]`."""
    function = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return function(a, b, offs=offsets)


def route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets): the token-expert pairs (flattened T x K) sorted by expert, and the int32 end of
    each expert's rows in that order, computed as transformers' grouped_mm experts do."""
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    device = top_k_index.device
    # histc instead of bincount keeps CUDA graphs possible; the CPU's histc takes only floats.
    counts = torch.histc(
        expert_ids.float() if device.type in ("cpu", "mps") else expert_ids.int(),
        bins=num_experts,
        min=0,
        max=num_experts - 1,
    )
    return order, torch.cumsum(counts, dim=0, dtype=torch.int32)


class MoEExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation):
        n_tokens, top_k = top_k_index.shape
        order, offsets = route(top_k_index, gate_up_proj.shape[0])
        gate_up = grouped_mm(hidden_states[order // top_k], gate_up_proj.transpose(-2, -1), offsets)
        expert_out = grouped_mm(packed_forward(gate_up, activation), down_proj.transpose(-2, -1), offsets)
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=order.device)
        out = weighted_sum(expert_out, position.view(n_tokens, top_k), top_k_weights)
        ctx.save_for_backward(hidden_states, gate_up_proj, down_proj, top_k_weights, gate_up, order, offsets)
        ctx.activation = activation
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden_states, gate_up_proj, down_proj, top_k_weights, gate_up, order, offsets = ctx.saved_tensors
        need_hidden, need_gate_up_proj, need_down_proj, _, need_weights, _ = ctx.needs_input_grad
        rows = order // top_k_weights.shape[1]
        weights = top_k_weights.reshape(-1)[order]
        grad_hidden = grad_gate_up_proj = grad_down_proj = grad_weights = None
        grad_out = grad[rows]  # d(weighted expert output), one row per pair, in expert order
        act = grouped_mm(grad_out, down_proj, offsets)  # d(act) over the routing weight, then act itself
        grad_pairs = routed_gate_backward(act, gate_up, weights, ctx.activation)  # gate_up: now its gradient
        if need_weights:
            grad_weights = torch.zeros_like(grad_pairs).index_put_((order,), grad_pairs, accumulate=True)
            grad_weights = grad_weights.view(top_k_weights.shape).to(top_k_weights.dtype)
        # The weight gradients come out (E, out, in), the parameters' own layout: no copy for .grad.
        if need_down_proj:
            grad_down_proj = grouped_mm(grad_out.mul_(weights.unsqueeze(-1)).t(), act, offsets)
        del grad_out, act
        if need_gate_up_proj:
            grad_gate_up_proj = grouped_mm(gate_up.t(), hidden_states[rows], offsets)
        if need_hidden:
            grad_rows = grouped_mm(gate_up, gate_up_proj, offsets)
            del gate_up
            grad_hidden = torch.zeros_like(hidden_states).index_put_((rows,), grad_rows, accumulate=True)
        return grad_hidden, grad_gate_up_proj, grad_down_proj, None, grad_weights, None


def check_moe_experts_inputs(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str,
) -> None:
    for name, tensor in (("hidden_states", hidden_states), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        check_float(name, tensor)
    check_float("top_k_weights", top_k_weights)
    others = dict(gate_up_proj=gate_up_proj, down_proj=down_proj, top_k_index=top_k_index, top_k_weights=top_k_weights)
    check_same_device("hidden_states", hidden_states, **others)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
    if hidden_states.dim() != 2 or down_proj.dim() != 3 or gate_up_proj.dim() != 3:
        raise ValueError(
            f"hidden_states must be (tokens, H), gate_up_proj (E, 2I, H) and down_proj (E, H, I); got shapes "
            f"{tuple(hidden_states.shape)}, {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}"
        )
    experts, hidden, inner = down_proj.shape
    if gate_up_proj.shape != (experts, 2 * inner, hidden) or hidden_states.shape[1] != hidden:
        raise ValueError(
            f"gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} do not fit "
            f"hidden_states {tuple(hidden_states.shape)}: they must be (E, 2I, H) (gate rows first) and (E, H, I)"
        )
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool or top_k_index.dim() != 2:
        raise ValueError(
            f"top_k_index must be an integer (tokens, top_k) tensor of expert ids; got {top_k_index.dtype} "
            f"{tuple(top_k_index.shape)}"
        )
    if top_k_weights.shape != top_k_index.shape or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} must both be "
            f"(tokens, top_k) with the {hidden_states.shape[0]} tokens of hidden_states"
        )
    dtypes = {hidden_states.dtype, gate_up_proj.dtype, down_proj.dtype}
    if len(dtypes) > 1:
        raise TypeError(
            f"hidden_states, gate_up_proj and down_proj must share one dtype (the grouped GEMM takes one); got "
            f"{hidden_states.dtype}, {gate_up_proj.dtype} and {down_proj.dtype}; cast them first"
        )
    if top_k_weights.dtype not in (hidden_states.dtype, torch.float32):
        raise TypeError(
            f"top_k_weights must be the experts' dtype ({hidden_states.dtype}) or float32 (a router that keeps "
            f"its weights in float32); got {top_k_weights.dtype}: cast them first"
        )


def moe_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Gated experts: for each token t, `sum_k top_k_weights[t, k] * expert(top_k_index[t, k], hidden_states[t])`
    with `expert(e, x) = down_proj[e] @ (act(gate) * up)`, `gate, up = (gate_up_proj[e] @ x).chunk(2)`.

    hidden_states (T, H); gate_up_proj (E, 2I, H), gate rows first; down_proj (E, H, I); top_k_index and
    top_k_weights (T, top_k); one float dtype, top_k_weights that or float32 (each token's weighted sum is
    taken in float32 either way); `activation` "silu" (SwiGLU), "gelu_tanh" or "gelu_erf"
    (GeGLU). Expert ids must lie in [0, E): like transformers, this does not check them (a device sync).
    Returns (T, H). Where torch's grouped GEMM does not run (`grouped_mm_available`) or on CPU tensors without
    TRITON_INTERPRET=1, the reference runs instead (transformers' eager loop, which keeps far more for backward).
    """
    check_moe_experts_inputs(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation)
    if not use_triton("moe_experts", hidden_states) or not grouped_mm_available(gate_up_proj, down_proj):
        return reference.moe_experts(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation)
    return MoEExpertsFunction.apply(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation)
