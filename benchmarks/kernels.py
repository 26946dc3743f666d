"""Kernel benchmarks: tigon against HF eager, torch.compile and Liger-Kernel, forward+backward, bf16.

    python -m benchmarks.kernels --out results.json            # the main shapes and the sweeps
    python -m benchmarks.kernels --out r.json --only rms_norm  # one op

Each step is timed twice: launched from Python (`triton.testing.do_bench` median, launch overhead
included) and replayed from a CUDA graph (`do_bench_cudagraph` median, GPU time alone). The floor is
the fewest bytes that step must move over the measured copy bandwidth. Peak memory is what the
step allocates beyond its live inputs. tigon runs with `in_place_backward=True`, as the patched
models run it and as Liger-Kernel runs by default.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from benchmarks.harness import (
    Measurement,
    as_dicts,
    graph_median_ms,
    measure_copy_bandwidth,
    measure_matmul_rate,
    median_ms,
    peak_extra_mb,
    write_json_atomic,
)

DTYPE = torch.bfloat16
EPS = 1e-6


@dataclass
class Case:
    """Inputs that need gradients, the output gradients, the floor bytes, and one forward per provider."""

    leaves: list[torch.Tensor]
    grads: list[torch.Tensor]
    bytes_moved: int
    providers: dict[str, Callable[[], tuple[torch.Tensor, ...]]]
    flops: int = 0  # for matrix-bound steps: the floor is the larger of bytes/bandwidth and flops/rate


def hf_llama_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The body of transformers' LlamaRMSNorm.forward."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + EPS)
    return weight * hidden.to(input_dtype)


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin):
    """The body of transformers' apply_rotary_pos_emb (unsqueeze_dim=1)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + hf_rotate_half(q) * sin, k * cos + hf_rotate_half(k) * sin


def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def liger():
    try:
        from liger_kernel.transformers import functional
    except ImportError:
        return None
    return functional


def rms_norm_case(tokens: int, hidden: int) -> Case:
    from tigon.kernels.functional import rms_norm

    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    w = (torch.rand(hidden, device="cuda", dtype=DTYPE) + 0.5).requires_grad_(True)
    providers = {
        "tigon": lambda: (rms_norm(x, w, EPS, in_place_backward=True),),
        "eager": lambda: (hf_llama_rms_norm(x, w),),
        "compile": (lambda fn: lambda: (fn(x, w),))(compiled(hf_llama_rms_norm)),
    }
    if liger():
        providers["liger"] = lambda: (liger().liger_rms_norm(x, w, EPS),)
    return Case([x, w], [torch.randn_like(x)], 5 * x.numel() * x.element_size(), providers)


def fused_add_rms_norm_case(tokens: int, hidden: int) -> Case:
    from tigon.kernels.functional import fused_add_rms_norm

    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    r = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    w = (torch.rand(hidden, device="cuda", dtype=DTYPE) + 0.5).requires_grad_(True)

    def eager(x, r, w):
        s = x + r
        return hf_llama_rms_norm(s, w), s

    compiled_eager = compiled(eager)
    providers = {
        "tigon": lambda: fused_add_rms_norm(x, r, w, EPS, in_place_backward=True),
        "eager": lambda: eager(x, r, w),
        "compile": lambda: compiled_eager(x, r, w),
    }
    if liger():
        providers["liger"] = lambda: liger().liger_fused_add_rms_norm(x, r, w, EPS)
    grads = [torch.randn_like(x), torch.randn_like(x)]
    return Case([x, r, w], grads, 8 * x.numel() * x.element_size(), providers)


def layer_norm_case(tokens: int, hidden: int) -> Case:
    from tigon.kernels.functional import layer_norm

    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    w = (torch.rand(hidden, device="cuda", dtype=DTYPE) + 0.5).requires_grad_(True)
    b = torch.randn(hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    eager = lambda x, w, b: F.layer_norm(x, (hidden,), w, b, EPS)
    compiled_eager = compiled(eager)
    providers = {
        "tigon": lambda: (layer_norm(x, w, b, EPS, in_place_backward=True),),
        "eager": lambda: (eager(x, w, b),),
        "compile": lambda: (compiled_eager(x, w, b),),
    }
    if liger():
        providers["liger"] = lambda: (liger().liger_layer_norm(x, w, b, EPS),)
    return Case([x, w, b], [torch.randn_like(x)], 5 * x.numel() * x.element_size(), providers)


def rope_case(batch: int, q_heads: int, kv_heads: int, seq: int, head_dim: int) -> Case:
    """q and k as attention makes them: (B, S, H, D) projections viewed as (B, H, S, D)."""
    from tigon.kernels.functional import rope

    q_base = torch.randn(batch, seq, q_heads, head_dim, device="cuda", dtype=DTYPE, requires_grad=True)
    k_base = torch.randn(batch, seq, kv_heads, head_dim, device="cuda", dtype=DTYPE, requires_grad=True)
    angles = torch.rand(1, seq, head_dim // 2, device="cuda") * 100
    cos = torch.cat([angles.cos()] * 2, -1).to(DTYPE)
    sin = torch.cat([angles.sin()] * 2, -1).to(DTYPE)
    compiled_eager = compiled(hf_apply_rotary_pos_emb)
    qk = lambda: (q_base.transpose(1, 2), k_base.transpose(1, 2))
    providers = {
        "tigon": lambda: rope(*qk(), cos, sin),
        "eager": lambda: hf_apply_rotary_pos_emb(*qk(), cos, sin),
        "compile": lambda: compiled_eager(*qk(), cos, sin),
    }
    if liger():
        providers["liger"] = lambda: liger().liger_rope(*qk(), cos, sin)
    q_bytes = (q_base.numel() + k_base.numel()) * q_base.element_size()
    grads = [torch.randn_like(q_base).transpose(1, 2), torch.randn_like(k_base).transpose(1, 2)]
    return Case([q_base, k_base], grads, 4 * q_bytes + 4 * cos.numel() * cos.element_size(), providers)


def gated_case(tokens: int, inner: int, activation: str) -> Case:
    """The MLP activation; tigon runs it as its MLP module does (gradients over the inputs)."""
    from tigon.kernels.functional import geglu, swiglu

    a = torch.randn(tokens, inner, device="cuda", dtype=DTYPE, requires_grad=True)
    b = torch.randn(tokens, inner, device="cuda", dtype=DTYPE, requires_grad=True)
    if activation == "swiglu":
        eager = lambda a, b: F.silu(a) * b
        ours = lambda: (swiglu(a, b, in_place_backward=True),)
        theirs = "liger_swiglu"
    else:
        eager = lambda a, b: F.gelu(a, approximate="tanh") * b
        ours = lambda: (geglu(a, b, approximate="tanh", in_place_backward=True),)
        theirs = "liger_geglu"
    compiled_eager = compiled(eager)
    providers = {"tigon": ours, "eager": lambda: (eager(a, b),), "compile": lambda: (compiled_eager(a, b),)}
    if liger():
        providers["liger"] = lambda: (getattr(liger(), theirs)(a, b),)
    return Case([a, b], [torch.randn_like(a)], 8 * a.numel() * a.element_size(), providers)


def relu_squared_case(tokens: int, inner: int) -> Case:
    """Nemotron's MLP activation; tigon runs it as its module does (the gradient over the input)."""
    from tigon.kernels.functional import relu_squared

    x = torch.randn(tokens, inner, device="cuda", dtype=DTYPE, requires_grad=True)
    eager = lambda x: torch.square(F.relu(x))  # transformers' ReLUSquaredActivation
    compiled_eager = compiled(eager)
    providers = {
        "tigon": lambda: (relu_squared(x, in_place_backward=True),),
        "eager": lambda: (eager(x),),
        "compile": lambda: (compiled_eager(x),),
    }
    if liger():
        providers["liger"] = lambda: (liger().liger_relu_squared(x),)
    return Case([x], [torch.randn_like(x)], 5 * x.numel() * x.element_size(), providers)


def cross_entropy_case(tokens: int, vocab: int) -> Case:
    """Logits already computed; HF's loss upcasts them to float32 before cross entropy."""
    from tigon.kernels.functional import cross_entropy

    logits = torch.randn(tokens, vocab, device="cuda", dtype=DTYPE, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    eager = lambda logits: F.cross_entropy(logits.float(), target)
    compiled_eager = compiled(eager)
    providers = {
        "tigon": lambda: (cross_entropy(logits, target, check_targets=False),),
        "eager": lambda: (eager(logits),),
        "compile": lambda: (compiled_eager(logits),),
    }
    if liger():
        providers["liger"] = lambda: (liger().liger_cross_entropy(logits, target),)
    grad = torch.ones((), device="cuda")
    return Case([logits], [grad], 2 * logits.numel() * logits.element_size(), providers)


def fused_linear_cross_entropy_case(tokens: int, hidden: int, vocab: int) -> Case:
    """The LM head and its loss: `hidden @ weight.T` then cross entropy, forward+backward."""
    from tigon.kernels.functional import fused_linear_cross_entropy

    x = (torch.randn(tokens, hidden, device="cuda", dtype=DTYPE) * hidden**-0.5).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=DTYPE) * hidden**-0.5).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    eager = lambda x, w: F.cross_entropy((x @ w.T).float(), target)
    compiled_eager = compiled(eager)
    providers = {
        "tigon": lambda: (fused_linear_cross_entropy(x, w, target, check_targets=False),),
        "eager": lambda: (eager(x, w),),
        "compile": lambda: (compiled_eager(x, w),),
    }
    if liger():
        providers["liger"] = lambda: (liger().liger_fused_linear_cross_entropy(x, w, target),)
    grad = torch.ones((), device="cuda")
    bytes_moved = 2 * (x.numel() + w.numel()) * x.element_size()
    return Case([x, w], [grad], bytes_moved, providers, flops=6 * tokens * hidden * vocab)


def liger_chunked_loss():
    try:
        from liger_kernel import chunked_loss
    except ImportError:
        return None
    return chunked_loss


PREFERENCE_IGNORE = -100
PREFERENCE_BETA = 0.1


def preference_inputs(pairs: int, seq: int, hidden: int, vocab: int):
    """Liger-Kernel's DPO benchmark inputs: chosen rows then rejected rows (B = 2 * pairs), a head with bias,
    a quarter of the targets ignored."""
    torch.manual_seed(0)
    x = (torch.randn(2 * pairs, seq, hidden, device="cuda", dtype=DTYPE) * hidden**-0.5).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=DTYPE) * hidden**-0.5).requires_grad_(True)
    b = (torch.randn(vocab, device="cuda", dtype=DTYPE) * 0.1).requires_grad_(True)
    target = torch.randint(0, vocab, (2 * pairs, seq), device="cuda")
    target.view(-1)[torch.randperm(target.numel(), device="cuda")[: target.numel() // 4]] = PREFERENCE_IGNORE
    return x, w, b, target


def eager_sequence_logps(x, w, b, target):
    """TRL's per-sequence summed log-probs: full logits, upcast, log_softmax, gather, masked sum."""
    logits = F.linear(x, w, b).float()
    valid = target != PREFERENCE_IGNORE
    token = logits.log_softmax(-1).gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    return (token * valid).sum(-1), valid.sum(-1)


def dpo_case(pairs: int, seq: int, hidden: int, vocab: int, chunk_size: int | None = None) -> Case:
    """DPO with the reference model's log-probs computed from its hidden states and head in the same pass;
    `chunk_size` pairs a chunk for tigon (None: the op's rule)."""
    from tigon.kernels.functional import fused_linear_dpo

    x, w, b, target = preference_inputs(pairs, seq, hidden, vocab)
    ref_x = torch.randn_like(x, requires_grad=False) * hidden**-0.5
    ref_w = (w.detach() + 0.01 * torch.randn_like(w)).requires_grad_(False)
    ref_b = b.detach().clone()

    def eager(x, w, b):
        logps, _ = eager_sequence_logps(x, w, b, target)
        with torch.no_grad():
            ref, _ = eager_sequence_logps(ref_x, ref_w, ref_b, target)
        diff = (logps[:pairs] - logps[pairs:]) - (ref[:pairs] - ref[pairs:])
        return -F.logsigmoid(PREFERENCE_BETA * diff).mean()

    compiled_eager = compiled(eager)
    refs = {"ref_hidden": ref_x, "ref_weight": ref_w, "ref_bias": ref_b, "chunk_size": chunk_size}
    providers = {
        "tigon": lambda: (fused_linear_dpo(x, w, target, b, beta=PREFERENCE_BETA, check_targets=False, **refs)[0],),
        "eager": lambda: (eager(x, w, b),),
        "compile": lambda: (compiled_eager(x, w, b),),
    }
    if liger_chunked_loss():
        loss = liger_chunked_loss().LigerFusedLinearDPOLoss(
            ignore_index=PREFERENCE_IGNORE, beta=PREFERENCE_BETA, use_ref_model=True
        )
        providers["liger"] = lambda: (loss(w, x, target, b, ref_input=ref_x, ref_weight=ref_w, ref_bias=ref_b)[0],)
    tokens = 2 * pairs * seq
    bytes_moved = 2 * (2 * x.numel() + 2 * w.numel()) * x.element_size()
    return Case([x, w, b], [torch.ones((), device="cuda")], bytes_moved, providers, flops=8 * tokens * hidden * vocab)


def orpo_case(pairs: int, seq: int, hidden: int, vocab: int, chunk_size: int | None = None) -> Case:
    """ORPO: chosen NLL plus the odds-ratio term on length-normalized log-probs; no reference model;
    `chunk_size` pairs a chunk for tigon (None: the op's rule)."""
    from tigon.kernels.functional import fused_linear_orpo

    x, w, b, target = preference_inputs(pairs, seq, hidden, vocab)

    def eager(x, w, b):
        logps, counts = eager_sequence_logps(x, w, b, target)
        average = logps / counts
        chosen, rejected = average[:pairs], average[pairs:]
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        nll = -logps[:pairs].sum() / counts[:pairs].sum()
        return nll - PREFERENCE_BETA * F.logsigmoid(log_odds).mean()

    compiled_eager = compiled(eager)
    providers = {
        "tigon": lambda: (
            fused_linear_orpo(x, w, target, b, beta=PREFERENCE_BETA, check_targets=False, chunk_size=chunk_size)[0],
        ),
        "eager": lambda: (eager(x, w, b),),
        "compile": lambda: (compiled_eager(x, w, b),),
    }
    if liger_chunked_loss():
        loss = liger_chunked_loss().LigerFusedLinearORPOLoss(ignore_index=PREFERENCE_IGNORE, beta=PREFERENCE_BETA)
        providers["liger"] = lambda: (loss(w, x, target, b)[0],)
    tokens = 2 * pairs * seq
    bytes_moved = 2 * (x.numel() + w.numel()) * x.element_size()
    return Case([x, w, b], [torch.ones((), device="cuda")], bytes_moved, providers, flops=6 * tokens * hidden * vocab)


def kl_divergence_case(tokens: int, vocab: int) -> Case:
    """Student log-probabilities against teacher probabilities, "batchmean" (the true KL per token)."""
    from tigon.kernels.functional import kl_divergence

    x = torch.log_softmax(torch.randn(tokens, vocab, device="cuda"), -1).to(DTYPE).requires_grad_(True)
    y = torch.softmax(torch.randn(tokens, vocab, device="cuda"), -1).to(DTYPE)
    eager = lambda x: F.kl_div(x, y, reduction="batchmean")
    compiled_eager = compiled(eager)
    providers = {
        "tigon": lambda: (kl_divergence(x, y, reduction="batchmean"),),
        "eager": lambda: (eager(x),),
        "compile": lambda: (compiled_eager(x),),
    }
    if liger():
        providers["liger"] = lambda: (liger().liger_kl_div(x, y, reduction="batchmean"),)
    grad = torch.ones((), device="cuda")
    return Case([x], [grad], 3 * x.numel() * x.element_size(), providers)  # read x and y, write dx


def eager_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """TRL's generalized_jsd_loss on log-probabilities, in float32, "batchmean" over tokens."""
    log_q, log_p = student.float(), teacher.float()
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
    kl_p = F.kl_div(log_m, log_p, reduction="none", log_target=True)
    kl_q = F.kl_div(log_m, log_q, reduction="none", log_target=True)
    return (beta * kl_p + (1 - beta) * kl_q).sum() / student.shape[0]


def jsd_case(tokens: int, vocab: int) -> Case:
    """Generalized JSD (beta 0.5) on log-probabilities, as Liger-Kernel's benchmark_jsd."""
    from tigon.kernels.functional import jsd

    s = torch.log_softmax(torch.randn(tokens, vocab, device="cuda"), -1).to(DTYPE).requires_grad_(True)
    t = torch.log_softmax(torch.randn(tokens, vocab, device="cuda"), -1).to(DTYPE)
    compiled_eager = compiled(eager_jsd)
    providers = {
        "tigon": lambda: (jsd(s, t, beta=0.5),),
        "eager": lambda: (eager_jsd(s, t),),
        "compile": lambda: (compiled_eager(s, t),),
    }
    if liger():
        providers["liger"] = lambda: (liger().liger_jsd(s, t, None, 0.5),)
    grad = torch.ones((), device="cuda")
    return Case([s], [grad], 3 * s.numel() * s.element_size(), providers)  # read s, t; write ds


def fused_linear_jsd_case(tokens: int, hidden: int, vocab: int) -> Case:
    """Distillation head: student and teacher logits, log_softmax of both, JSD (beta 0.5); student gets grads."""
    from tigon.kernels.functional import fused_linear_jsd

    xs = (torch.randn(tokens, hidden, device="cuda", dtype=DTYPE) * hidden**-0.5).requires_grad_(True)
    ws = (torch.randn(vocab, hidden, device="cuda", dtype=DTYPE) * hidden**-0.5).requires_grad_(True)
    xt = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE) * hidden**-0.5
    wt = torch.randn(vocab, hidden, device="cuda", dtype=DTYPE) * hidden**-0.5

    def eager(xs, ws):
        student = torch.log_softmax((xs @ ws.T).float(), -1)
        teacher = torch.log_softmax((xt @ wt.T).float(), -1)
        return eager_jsd(student, teacher)

    compiled_eager = compiled(eager)
    providers = {
        "tigon": lambda: (fused_linear_jsd(xs, ws, xt, wt, beta=0.5),),
        "eager": lambda: (eager(xs, ws),),
        "compile": lambda: (compiled_eager(xs, ws),),
    }
    if liger():
        providers["liger"] = lambda: (liger().liger_fused_linear_jsd(xs, ws, xt, wt, None, 0.5, -100, 1.0),)
    grad = torch.ones((), device="cuda")
    bytes_moved = (2 * (xs.numel() + ws.numel()) + xt.numel() + wt.numel()) * xs.element_size()
    flops = 4 * 2 * tokens * hidden * vocab  # student and teacher logits, dhidden, dweight
    return Case([xs, ws], [grad], bytes_moved, providers, flops=flops)


def main_cases() -> list[tuple[str, str, Callable[[], Case]]]:
    return [
        ("rms_norm", "16384x4096", lambda: rms_norm_case(16384, 4096)),
        ("fused_add_rms_norm", "16384x4096", lambda: fused_add_rms_norm_case(16384, 4096)),
        ("layer_norm", "16384x4096", lambda: layer_norm_case(16384, 4096)),
        ("rope", "q 4x32x4096x128, k 4x8x4096x128", lambda: rope_case(4, 32, 8, 4096, 128)),
        ("swiglu", "8192x14336", lambda: gated_case(8192, 14336, "swiglu")),
        ("geglu", "8192x14336", lambda: gated_case(8192, 14336, "geglu")),
        ("relu_squared", "16384x9216", lambda: relu_squared_case(16384, 9216)),
        ("cross_entropy", "8192x128256", lambda: cross_entropy_case(8192, 128256)),
        ("fused_linear_cross_entropy", "8192x4096x128256", lambda: fused_linear_cross_entropy_case(8192, 4096, 128256)),
        ("kl_divergence", "8192x128256", lambda: kl_divergence_case(8192, 128256)),
        ("jsd", "8192x128256", lambda: jsd_case(8192, 128256)),
        *[  # Liger-Kernel's benchmark_fused_linear_jsd shapes: BT = 1024 .. 8192, H 4096, V 128256
            ("fused_linear_jsd", f"{bt}x4096x128256", lambda bt=bt: fused_linear_jsd_case(bt, 4096, 128256))
            for bt in (1024, 2048, 4096, 8192)
        ],
        ("fused_linear_dpo", "16 pairs x512x4096x128256", lambda: dpo_case(16, 512, 4096, 128256)),
        ("fused_linear_orpo", "16 pairs x512x4096x128256", lambda: orpo_case(16, 512, 4096, 128256)),
    ]


def sweep_cases() -> list[tuple[str, str, Callable[[], Case]]]:
    cases = []
    for hidden in (1024, 2048, 4096, 8192, 16384):
        cases.append(("rms_norm/hidden", f"16384x{hidden}", lambda h=hidden: rms_norm_case(16384, h)))
        cases.append(("layer_norm/hidden", f"16384x{hidden}", lambda h=hidden: layer_norm_case(16384, h)))
    for tokens in (1024, 4096, 16384, 65536):
        cases.append(("rms_norm/tokens", f"{tokens}x4096", lambda t=tokens: rms_norm_case(t, 4096)))
    for seq in (1024, 2048, 8192):
        cases.append(("rope/seq", f"4x32/8x{seq}x128", lambda s=seq: rope_case(4, 32, 8, s, 128)))
    for tokens in (1024, 4096, 16384):
        cases.append(("swiglu/tokens", f"{tokens}x14336", lambda t=tokens: gated_case(t, 14336, "swiglu")))
    for tokens, vocab in ((8192, 128256), (16384, 128256), (32768, 128256), (8192, 262144)):
        cases.append(
            (
                "fused_linear_cross_entropy/tokens",
                f"{tokens}x4096x{vocab}",
                lambda t=tokens, v=vocab: fused_linear_cross_entropy_case(t, 4096, v),
            )
        )
    for pairs in (2, 4, 8):
        cases.append(
            (
                "fused_linear_dpo/pairs",
                f"{pairs} pairs x512x4096x128256",
                lambda p=pairs: dpo_case(p, 512, 4096, 128256),
            )
        )
    return cases


def forward_backward(case: Case, forward: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[[], None]:
    """One provider's step: its forward, then the gradients of the case's leaves.

    autograd.grad, not backward: the op's own work, without accumulating into .grad.
    """
    return lambda: torch.autograd.grad(forward(), case.leaves, case.grads)


def run_case(
    op: str, shape: str, make: Callable[[], Case], copy_bw: float, matmul_rate: float, with_memory: bool
) -> list[Measurement]:
    case = make()
    floor_ms = max(case.bytes_moved / copy_bw, case.flops / matmul_rate) * 1e3
    results = []
    for provider, forward in case.providers.items():
        step = forward_backward(case, forward)
        try:
            step()  # compile and warm up outside the timed region
            ms = median_ms(step, case.leaves)
            graph_ms = graph_median_ms(step, case.leaves)
            peak = peak_extra_mb(step, case.leaves) if with_memory else float("nan")
        except Exception as error:  # a provider that fails at a shape is reported, not fatal
            print(f"  {op} {shape} {provider}: FAILED {type(error).__name__}: {error}", file=sys.stderr)
            continue
        best_ms = graph_ms if graph_ms == graph_ms else ms  # GPU time when the step could be graphed
        results.append(
            Measurement(op, provider, shape, ms, graph_ms, floor_ms, case.bytes_moved, peak, floor_ms / best_ms)
        )
        print(
            f"  {op:22s} {shape:34s} {provider:8s} {ms:8.3f} ms launched {graph_ms:8.3f} ms graphed "
            f"{100 * floor_ms / best_ms:5.1f}% of copy  peak +{peak:8.1f} MB",
            flush=True,
        )
    case = None
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the results (written atomically)")
    parser.add_argument(
        "--only", default=None, help="run only ops whose name starts with one of these (comma-separated)"
    )
    parser.add_argument("--no-sweeps", action="store_true", help="only the main shapes")
    parser.add_argument("--sweeps-only", action="store_true", help="only the size sweeps")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    started = time.time()
    copy_bw, matmul = measure_copy_bandwidth(), measure_matmul_rate()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s", flush=True)
    cases = [] if args.sweeps_only else [(op, shape, make, True) for op, shape, make in main_cases()]
    if not args.no_sweeps:
        cases += [(op, shape, make, op.startswith("fused_linear")) for op, shape, make in sweep_cases()]
    results = []
    for index, (op, shape, make, with_memory) in enumerate(cases, 1):
        if args.only and not op.startswith(tuple(args.only.split(","))):
            continue
        print(f"[{index}/{len(cases)}] {op} {shape}", flush=True)
        results += run_case(op, shape, make, copy_bw, matmul, with_memory)
    payload = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "liger_kernel": liger_version(),
        "copy_bandwidth_bytes_per_s": copy_bw,
        "bf16_matmul_flops_per_s": matmul,
        "seconds": time.time() - started,
        "results": as_dicts(results),
    }
    write_json_atomic(args.out, payload)
    print(f"wrote {len(results)} measurements to {args.out} in {payload['seconds']:.0f} s")


def liger_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liger-kernel")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
