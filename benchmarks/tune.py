"""Launch-configuration sweep for the norm kernels: forward and backward launched and timed apart, and the
forward+backward step replayed from a CUDA graph (GPU time alone, what a training step sees).

    python -m benchmarks.tune --out tune.json                        # hidden 4096
    python -m benchmarks.tune --hidden 1024,2048,16384 --out tune.json

It swaps each op's config function for fixed variants, so the heuristics in `kernels/ops/` can be
set from measurements. Prints the best variant per (op, direction, shape).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.testing

from benchmarks.harness import graph_median_ms, write_json_atomic
from tigon.kernels.ops import layer_norm, rms_norm

DTYPE = torch.bfloat16


def time_directions(forward, leaves, grads) -> tuple[float, float]:
    forward_ms = triton.testing.do_bench(forward, warmup=25, rep=100, return_mode="median")
    outputs = forward()

    def backward():
        torch.autograd.backward(outputs, grads, retain_graph=True)

    backward_ms = triton.testing.do_bench(backward, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
    return forward_ms, backward_ms


def norm_variants(module, tokens: int, hidden: int, make_forward) -> list[dict]:
    results = []
    block_n = triton.next_power_of_2(hidden)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    original_forward, original_backward = module._forward_config, module._backward_config
    stages_options = (1, 2, 3) if hidden == 4096 else (1,)
    warp_options = (4, 8, 16, 32) if block_n >= 16384 else (4, 8, 16)  # a wide row spills under few warps
    for block_m, warps, per_sm, stages in itertools.product((1, 2, 4), warp_options, (1, 2, 4), stages_options):
        if block_m * block_n > 16384:
            continue
        programs = min(triton.cdiv(tokens, block_m), sms * per_sm)
        rows_per_program = triton.cdiv(triton.cdiv(tokens, programs), block_m) * block_m
        programs = triton.cdiv(tokens, rows_per_program)
        module._forward_config = lambda n_cols, c=(block_m, block_n, warps): c
        module._backward_config = (
            lambda n_rows, n_cols, device, c=(block_m, block_n, warps, stages, programs, rows_per_program): c
        )
        forward, leaves, grads = make_forward(tokens, hidden)
        try:
            forward_ms, backward_ms = time_directions(forward, leaves, grads)
            step_graph_ms = graph_median_ms(lambda f=forward, g=grads: torch.autograd.backward(f(), g), leaves)
        except Exception as error:  # a variant that does not compile (too many registers) is skipped
            print(f"  skipped block_m={block_m} warps={warps} per_sm={per_sm} stages={stages}: {type(error).__name__}")
            continue
        results.append(
            dict(
                block_m=block_m,
                warps=warps,
                per_sm=per_sm,
                stages=stages,
                forward_ms=forward_ms,
                backward_ms=backward_ms,
                step_graph_ms=step_graph_ms,
            )
        )
    module._forward_config, module._backward_config = original_forward, original_backward
    return results


def rms_norm_inputs(tokens, hidden):
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    w = torch.rand(hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    return (lambda: rms_norm.rms_norm(x, w)), [x, w], [torch.randn_like(x)]


def layer_norm_inputs(tokens, hidden):
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    w = torch.rand(hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    b = torch.rand(hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    return (lambda: layer_norm.layer_norm(x, w, b)), [x, w, b], [torch.randn_like(x)]


def best(rows: list[dict], key: str) -> dict:
    return min(rows, key=lambda r: r[key])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden", default="4096", help="comma-separated row widths (16384 rows each)")
    args = parser.parse_args()
    report = {}
    for hidden in (int(h) for h in args.hidden.split(",")):
        for name, module, inputs in (
            ("rms_norm", rms_norm, rms_norm_inputs),
            ("layer_norm", layer_norm, layer_norm_inputs),
        ):
            rows = norm_variants(module, 16384, hidden, inputs)
            report[f"{name}/16384x{hidden}"] = rows
            print(f"{name} 16384x{hidden}: best forward {best(rows, 'forward_ms')}", flush=True)
            print(f"{name} 16384x{hidden}: best backward {best(rows, 'backward_ms')}", flush=True)
            print(f"{name} 16384x{hidden}: best graphed step {best(rows, 'step_graph_ms')}", flush=True)
            for row in sorted(rows, key=lambda r: r["step_graph_ms"])[:6]:
                print(f"    {row}")
    write_json_atomic(args.out, report)


if __name__ == "__main__":
    main()
