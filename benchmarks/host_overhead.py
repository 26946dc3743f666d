"""Host time per call: each op's forward+backward at a tiny shape, where the GPU waits on Python.

    python -m benchmarks.host_overhead [--out host.json]
    python -m benchmarks.host_overhead --profile fused_linear_cross_entropy   # where its host time goes

Small models and small batches launch kernels faster than the GPU runs them only if the host keeps up.
At these shapes each kernel runs for a few microseconds, so a step launched back to back (one
synchronization at the end) measures the host's time per call: argument checks, the autograd
Function, Triton's launcher, allocations and the autograd engine. Same providers as the kernel
benchmark (tigon, eager, torch.compile, Liger-Kernel), same cases at tiny shapes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import triton

from benchmarks.harness import write_json_atomic
from benchmarks.kernels import (
    Case,
    cross_entropy_case,
    forward_backward,
    fused_add_rms_norm_case,
    fused_linear_cross_entropy_case,
    gated_case,
    jsd_case,
    kl_divergence_case,
    layer_norm_case,
    liger_version,
    rms_norm_case,
    rope_case,
)

CASES: list[tuple[str, str, Callable[[], Case]]] = [
    ("rms_norm", "32x256", lambda: rms_norm_case(32, 256)),
    ("fused_add_rms_norm", "32x256", lambda: fused_add_rms_norm_case(32, 256)),
    ("layer_norm", "32x256", lambda: layer_norm_case(32, 256)),
    ("rope", "q 2x4x16x64, k 2x2x16x64", lambda: rope_case(2, 4, 2, 16, 64)),
    ("swiglu", "32x512", lambda: gated_case(32, 512, "swiglu")),
    ("cross_entropy", "32x1000", lambda: cross_entropy_case(32, 1000)),
    ("fused_linear_cross_entropy", "32x256x1000", lambda: fused_linear_cross_entropy_case(32, 256, 1000)),
    ("kl_divergence", "32x1000", lambda: kl_divergence_case(32, 1000)),
    ("jsd", "32x1000", lambda: jsd_case(32, 1000)),
]
CALLS, ROUNDS = 400, 5


def host_us(step: Callable[[], object]) -> float:
    """Microseconds a call: the best of `ROUNDS` rounds of `CALLS` calls launched back to back (other work on the
    host only ever adds time), after a warm-up."""
    for _ in range(50):
        step()
    rounds = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(CALLS):
            step()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - started) / CALLS * 1e6)
    return min(rounds)


def profile(op: str, provider: str) -> None:
    """Print where the host's time goes in `CALLS` calls of one provider's step (cProfile, by own time)."""
    import cProfile
    import pstats

    make = next(make for name, _, make in CASES if name == op)
    case = make()
    step = forward_backward(case, case.providers[provider])
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CALLS):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON file for the results (written atomically)")
    parser.add_argument("--profile", metavar="OP[:PROVIDER]", help="profile one op's calls instead (default tigon)")
    args = parser.parse_args()
    if args.profile:
        op, _, provider = args.profile.partition(":")
        profile(op, provider or "tigon")
        return
    torch._dynamo.config.cache_size_limit = 64
    providers = ("tigon", "eager", "compile", "liger")
    print(f"{'op':28s} {'shape':26s} " + " ".join(f"{p:>9s}" for p in providers) + "   (us a forward+backward call)")
    results = []
    for op, shape, make in CASES:
        case = make()
        row = {}
        for provider, forward in case.providers.items():
            row[provider] = host_us(forward_backward(case, forward))
            results.append({"op": op, "shape": shape, "provider": provider, "host_us": row[provider]})
        cells = " ".join(f"{row[p]:9.1f}" if p in row else f"{'-':>9s}" for p in providers)
        print(f"{op:28s} {shape:26s} {cells}", flush=True)
    if args.out:
        payload = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "liger_kernel": liger_version(),
            "calls": CALLS,
            "rounds": ROUNDS,
            "results": results,
        }
        write_json_atomic(args.out, payload)
        print(f"wrote {len(results)} measurements to {args.out}")


if __name__ == "__main__":
    main()
