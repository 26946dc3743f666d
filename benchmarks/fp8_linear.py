"""FP8 Linear layers of the Llama-3-8B shape, forward and backward: tigon's `fp8_linear` against torchao's
Float8Linear (tensorwise, compiled as the runtime compiles it) and a bf16 nn.Linear; and tigon's casts alone
against the copy rate.

    python -m benchmarks.fp8_linear --out bench-out/fp8-linear.json [--tokens 16384]
    python -m benchmarks.fp8_linear --sweep --out bench-out/fp8-cast-sweep.json   # the casts' tiles and stores

Each projection takes `--tokens` tokens (a micro-batch of 4 x 4096) with its weight in bf16, as the end-to-end
runs train it; timed launched from Python and replayed from a CUDA graph (GPU time alone: tigon's casts are
separate launches, which a lone small layer cannot hide behind its GPU work). A cast's floor is its bytes (read
the input once, write one byte per element for each layout) over the measured device-to-device copy rate; the
absolute maximum reads the input once more. `--sweep` times the cast kernel at each tile and transposed store
(`fp8_linear._cast_config`, swapped for fixed variants as benchmarks/tune.py does) on the two input widths, both
formats, and a weight transposed alone.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from benchmarks.harness import graph_median_ms, measure_copy_bandwidth, median_ms, write_json_atomic, write_report
from tigon.kernels.ops import fp8_linear as fp8_module
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


#: (tile rows, tile columns, transposed layout as 4-byte words) the sweep tries
SWEEP_CONFIGS = [(r, c, words) for words in (False, True) for r, c in [(64, 64), (64, 128), (128, 64), (32, 128)]]


def sweep(tokens: int) -> list[dict]:
    """The cast kernel's time at each of `SWEEP_CONFIGS`, for both layouts of the two input widths (e4m3 and e5m2)
    and for a Llama-3-8B MLP weight transposed alone."""
    inputs = {k: torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) for k in (4096, 14336)}
    weight = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
    cases = [(f"{tokens} x {k}", x, dtype, True) for k, x in inputs.items() for dtype in (E4M3, E5M2)]
    cases.append(("weight 14336 x 4096, transposed alone", weight, E4M3, False))
    chosen, results = fp8_module._cast_config, []
    try:
        for block_rows, block_cols, words in SWEEP_CONFIGS:
            fp8_module._cast_config = lambda n_rows, rows, transposed, c=(block_rows, block_cols, words): (
                c[0],
                c[1],
                c[2] and rows and transposed and n_rows % 4 == 0,
            )
            for name, x, dtype, both in cases:
                amax = fp8_amax(x)
                ms = triton.testing.do_bench(
                    lambda x=x, amax=amax, dtype=dtype, both=both: fp8_cast(x, amax, dtype, both, True),
                    return_mode="median",
                )
                tile = f"{block_rows} x {block_cols}"
                store = "words" if words and both else "bytes"
                results.append(
                    {
                        "tensor": name,
                        "dtype": str(dtype).removeprefix("torch."),
                        "tile": tile,
                        "store": store,
                        "ms": round(ms, 4),
                    }
                )
                print(f"{name} {dtype} tile {tile} {store}: {ms:.3f} ms", flush=True)
    finally:
        fp8_module._cast_config = chosen
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--sweep", action="store_true", help="time the cast kernel's tiles and stores instead")
    args = parser.parse_args()
    device = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    if args.sweep:
        write_json_atomic(args.out, {"device": device, "tokens": args.tokens, "sweep": sweep(args.tokens)})
        return
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
    payload = {"device": device, "tokens": args.tokens, "layers": layers, "casts": casts}
    write_report(args.out, payload, "\n".join(lines))


if __name__ == "__main__":
    main()
