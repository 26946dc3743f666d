"""benchmarks/step_timeline.py on a Chrome trace laid out as a profiled GPU step writes one."""

import json

from benchmarks import step_timeline

GEMM = "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN"
GATHER = "ncclDevKernel_AllGather_RING_LL"


def kernel(name: str, start_us: float, duration_us: float, stream: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start_us, "dur": duration_us, "args": {"stream": stream}}


def test_a_trace_is_laid_out_with_its_exposed_collectives_gaps_and_slower_products(tmp_path, capsys):
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},  # host ops are not kernels
        kernel(GEMM, 0, 1000, 7),  # alone: 1 ms
        kernel(GEMM, 1000, 1000, 7),  # alone
        kernel(GATHER, 2000, 3000, 20),  # under the next product for 1.5 ms, then 1.5 ms exposed
        kernel(GEMM, 2000, 1500, 7),  # beside the gather: 0.5 ms over the same kernel alone
        kernel("_rms_norm_forward_kernel", 6000, 500, 7),  # after a 1 ms gap
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 6500, "dur": 100},
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "timeline.json"
    assert step_timeline.main([str(trace), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["window_ms"] == 6.6
    assert report["timeline_ms"] == {
        "computing": 4.1,
        "communication exposed": 1.5,
        "communication overlapped": 1.5,
        "idle": 1.0,
    }
    assert report["exposed_collectives"] == [{"ms": 1.5, "collective": GATHER, "after": GEMM}]
    assert report["idle_gaps"] == [{"ms": 1.0, "after": GATHER, "before": "_rms_norm_forward_kernel"}]
    assert report["matmul_ms"] == 3.5
    assert report["matmul_beside_collectives"] == {"kernels": 1, "compared": 1, "extra_ms": 0.5}
    printed = capsys.readouterr().out
    assert "communication exposed" in printed and "+0.5 ms against the same kernels alone" in printed
