"""FP8 Linear layers of the Llama-3-8B shape, forward and backward: tigon's `fp8_linear` against torchao's
Float8Linear (tensorwise, compiled as the runtime compiles it) and a bf16 nn.Linear; and tigon's casts alone
against the copy rate.

    python -m benchmarks.fp8_linear --out bench-out/fp8-linear.json [--tokens 16384]

Each projection takes `--tokens` tokens (a micro-batch of 4 x 4096) with its weight in bf16, as the end-to-end
runs train it; timed launched from Python and replayed from a CUDA graph (GPU time alone: tigon's casts are
separate launches, which a lone small layer cannot hide behind its GPU work). A cast's floor is its bytes (read
the input once, write one byte per element for each layout) over the measured device-to-device copy rate; the
absolute maximum reads the input once more.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from benchmarks.harness import graph_median_ms, measure_copy_bandwidth, median_ms, write_report
from tigon.kernels.ops.fp8_linear import E4M3, E5M2, fp8_amax, fp8_cast, fp8_linear

#: (name, in_features, out_features) of a Llama-3-8B decoder layer's projections (q and o share a shape)
PROJECTIONS = [("q/o", 4096, 4096), ("k/v", 4096, 1024), ("gate/up", 4096, 14336), ("down", 14336, 4096)]


def torchao_linear(weight: torch.nn.Parameter):
    """torchao's tensorwise Float8Linear on `weight`, compiled."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="cuda", dtype=weight.dtype)
    linear.weight = weight
    module = Float8Linear.from_float(linear, Float8LinearConfig.from_recipe_name("tensorwise"))
    return torch.compile(module)


def projection_rows(name: str, k: int, n: int, tokens: int, bandwidth: float) -> tuple[list[dict], list[dict]]:
    """One projection's forward + backward per provider, and its input's casts and absolute maximum."""
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5)
    grad = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    providers = {"bf16 nn.Linear": lambda x: F.linear(x, weight), "tigon fp8": lambda x: fp8_linear(x, weight)}
    try:
        providers["torchao fp8 (compiled)"] = torchao_linear(weight)
    except ImportError:
        pass
    layers = []
    for provider, forward in providers.items():
        step = lambda forward=forward: forward(x).backward(grad)  # noqa: E731
        ms, graph_ms = median_ms(step, [x, weight]), graph_median_ms(step, [x, weight])
        times = {"ms": round(ms, 4), "graph_ms": round(graph_ms, 4)}
        layers.append({"projection": name, "k": k, "n": n, "provider": provider, **times})
    data = x.detach()
    amax = fp8_amax(data)
    amax_ms = triton.testing.do_bench(lambda: fp8_amax(data), return_mode="median")
    casts = []
    for dtype in (E4M3, E5M2):
        both_layouts = lambda dtype=dtype: fp8_cast(data, amax, dtype, True, True)  # noqa: E731
        cast_ms = triton.testing.do_bench(both_layouts, return_mode="median")
        casts.append(
            {
                "projection": name,
                "shape": f"{tokens} x {k}",
                "dtype": str(dtype).removeprefix("torch."),
                "cast_ms": round(cast_ms, 4),
                "cast_floor_ms": round(data.numel() * 4 / bandwidth * 1e3, 4),  # 2 bytes in, 1 + 1 out
                "amax_ms": round(amax_ms, 4),
                "amax_floor_ms": round(data.numel() * 2 / bandwidth * 1e3, 4),
            }
        )
    return layers, casts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    bandwidth = measure_copy_bandwidth()
    layers, casts = [], []
    for name, k, n in PROJECTIONS:
        rows = projection_rows(name, k, n, args.tokens, bandwidth)
        layers += rows[0]
        casts += rows[1]
    lines = ["| projection | in x out | provider | forward + backward (ms) | from a CUDA graph (ms) |"]
    lines += ["|---|---|---|---|---|"]
    lines += [
        f"| {r['projection']} | {r['k']} x {r['n']} | {r['provider']} | {r['ms']:.3f} | {r['graph_ms']:.3f} |"
        for r in layers
    ]
    lines += [
        "",
        "| input of | tensor | FP8 format | cast, both layouts (ms) | floor | absolute maximum (ms) | floor |",
    ]
    lines += ["|---|---|---|---|---|---|---|"]
    lines += [
        f"| {c['projection']} | {c['shape']} | {c['dtype']} | {c['cast_ms']:.3f} | {c['cast_floor_ms']:.3f} | "
        f"{c['amax_ms']:.3f} | {c['amax_floor_ms']:.3f} |"
        for c in casts
    ]
    device = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    payload = {"device": device, "tokens": args.tokens, "layers": layers, "casts": casts}
    write_report(args.out, payload, "\n".join(lines))


if __name__ == "__main__":
    main()
