"""benchmarks/end_to_end.py cannot rot: its --tiny smoke run on the CPU, every family's preset and code path.

The CLI run (each variant in its own subprocess, as on the GPU) covers a few families, since every
subprocess pays the imports; one more subprocess trains every family, eager then tigon, through the same
`worker`, and the presets' real configs are counted against their models' published sizes. The command line is
benchmarks/end_to_end.py; the presets, the runner and the reports are benchmarks/presets.py, end_to_end_runner.py
and end_to_end_report.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.end_to_end_report import markdown, merge_reports
from benchmarks.end_to_end_runner import _search, estimate_note
from benchmarks.presets import NOT_BENCHMARKED, PRESETS, parse_families
from tests.runtime.worker_groups import process_env

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_end_to_end_run_writes_json_and_table(tmp_path):
    """A dense family and an MoE one (the test below trains every family, in one process)."""
    out = tmp_path / "e2e.json"
    families = ["llama", "qwen3_moe"]
    command = [sys.executable, "-m", "benchmarks.end_to_end", "--tiny", "--family", ",".join(families)]
    command += ["--variants", "eager,liger,tigon", "--seqs", "32", "--steps", "1", "--warmup", "1", "--profile"]
    command += ["--trace-dir", str(tmp_path / "traces"), "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=process_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[1/6] llama eager at seq 32 x micro-batch 2" in done.stdout

    report = json.loads(out.read_text())
    assert list(report["families"]) == families
    assert report["families"]["qwen3_moe"]["source"] == "Qwen/Qwen3-30B-A3B"
    runs = {(run["family"], run["variant"]): run for run in report["runs"]}
    assert set(runs) == {(family, variant) for family in families for variant in ("eager", "liger", "tigon")}
    for family in families:
        assert "needs a CUDA GPU" in runs[family, "liger"]["unavailable"]  # reported, not an error
        for variant in ("eager", "tigon"):
            run = runs[family, variant]
            assert not run["oom"] and run["seq"] == 32 and run["micro_batch"] == 2 and run["checkpointing"]
            assert run["kernels"] == (variant == "tigon")
            assert run["tokens_per_second"] > 0 and len(run["losses"]) == 2
            assert all(math.isfinite(loss) for loss in run["losses"])
            assert run["peak_bytes"] is None  # no CUDA peak on the CPU
            profile = run["profile"]  # one more step, profiled: on the CPU, aten ops by their own time
            assert profile["kinds_ms"]["matmul"] > 0 and 0 < profile["busy_ms"] <= profile["step_ms"]
            assert math.isclose(sum(profile["kinds_ms"].values()), profile["busy_ms"])
            trace = json.loads((tmp_path / "traces" / f"{family}-{variant}-32.json").read_text())
            assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])  # the profiled step's ops
        # same seed, same data, same initial weights: the kernels compute the same first loss
        assert abs(runs[family, "eager"]["losses"][0] - runs[family, "tigon"]["losses"][0]) < 1e-4
        assert math.isclose(runs[family, "eager"]["losses"][0], math.log(512), rel_tol=0.05)  # random init
    for family in families:  # the planner counts the dense decoder and the MoE one: both are estimated
        for variant in ("eager", "tigon"):
            assert runs[family, variant]["estimate_bytes"] > 0 and "estimate_note" not in runs[family, variant]

    table = out.with_suffix(".md").read_text()
    assert "| llama | eager | 32 | 2 x 1 | on | off |" in table and "| llama | tigon | 32 | 2 x 1 | on | on |" in table
    assert "| qwen3_moe | tigon | 32 | 2 x 1 | on | on |" in table and "not modeled" not in table.split("Loss:")[0]
    assert "| qwen3_moe | liger | 32 | | | | not available: Liger-Kernel needs a CUDA GPU |" in table
    assert (
        "| family | variant | seq | step | busy | communication | attention | matmul |" in table
        and "| llama | tigon | 32 |" in table
    )
    check_merge(report, tmp_path)


def check_merge(report: dict, folder: Path) -> None:
    """Two device calls' reports, the first with a family skipped for time, join into one table and a plot."""
    skipped = {"seq": 32, "oom": False, "skipped": "time budget (1 s) spent"}
    first = {
        **report,
        "runs": [
            {"family": "qwen3_moe", "variant": run["variant"], **skipped} if run["family"] == "qwen3_moe" else run
            for run in report["runs"]
        ],
    }
    second = {**report, "families": {"qwen3_moe": report["families"]["qwen3_moe"]}}
    second["runs"] = [run for run in report["runs"] if run["family"] == "qwen3_moe"]
    paths = [folder / "first.json", folder / "second.json"]
    for path, part in zip(paths, (second, first), strict=True):  # the later call first: order must not matter
        path.write_text(json.dumps(part))
    merged_path = folder / "merged.json"
    command = [sys.executable, "-m", "benchmarks.end_to_end", "--merge", *map(str, paths), "--out", str(merged_path)]
    done = subprocess.run(command, cwd=ROOT, env=process_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    merged = json.loads(merged_path.read_text())
    assert list(merged["families"]) == ["llama", "qwen3_moe"]  # PRESETS order
    assert merged["runs"] == report["runs"]  # every measured run back, none of the skipped records
    assert merged_path.with_suffix(".png").stat().st_size > 10_000
    assert "| qwen3_moe | tigon | 32 | 2 x 1 | on | on |" in merged_path.with_suffix(".md").read_text()


_EVERY_FAMILY = """
import json
from benchmarks.end_to_end_runner import worker
from benchmarks.presets import PRESETS

rows = []
for family, preset in PRESETS.items():
    for variant in ("eager", "tigon"):  # eager first: tigon's RoPE patch is module-wide for the family
        spec = {"family": family, "shape": preset.tiny_shape(), "attention": preset.attention, "variant": variant,
                "seq": 32, "micro_batch": 2, "checkpointing": True, "steps": 1, "warmup": 1}
        try:
            rows.append(worker(spec))
        except Exception as error:  # recorded, so the other families still run
            rows.append({"family": family, "variant": variant, "error": f"{type(error).__name__}: {error}"})
print(json.dumps(rows))
"""


LLAMA4_OUTPUT = "MoeCausalLMOutputWithPast"  # what Llama 4's language model returns


def llama4_forward_is_broken() -> bool:
    """Whether this transformers' Llama4ForConditionalGeneration.forward reads `image_outputs` from its language
    model's output, which has none (transformers 5.24): it then fails on every call, with an image or without."""
    import inspect

    from transformers.models.llama4 import modeling_llama4

    return "outputs.image_outputs" in inspect.getsource(modeling_llama4.Llama4ForConditionalGeneration.forward)


def test_every_family_trains_the_same_first_loss_eager_and_with_tigon():
    """Every family's tiny model through the benchmark's worker, in one process (the imports once); a
    vision-language model as its *ForConditionalGeneration, on text.

    Gemma 2 trains at all only with its preset's eager attention (transformers refuses SDPA for it). Llama 4's
    multimodal model fails in transformers' own forward where that forward is broken, with and without tigon.
    """
    done = subprocess.run(
        [sys.executable, "-c", _EVERY_FAMILY], cwd=ROOT, env=process_env(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {(run["family"], run["variant"]): run for run in json.loads(done.stdout.strip().splitlines()[-1])}
    assert set(runs) == {(family, variant) for family in PRESETS for variant in ("eager", "tigon")}
    broken = {"llama4"} if llama4_forward_is_broken() else set()
    for family in PRESETS:
        eager, tigon = runs[family, "eager"], runs[family, "tigon"]
        if family in broken:
            for run in (eager, tigon):
                assert (
                    run["error"]
                    == "AttributeError: 'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'"
                )
            continue
        assert "error" not in eager and "error" not in tigon, (eager, tigon)
        assert eager["tokens_per_second"] > 0 and tigon["tokens_per_second"] > 0
        assert abs(eager["losses"][0] - tigon["losses"][0]) < 1e-4, family
        assert math.isclose(eager["losses"][0], math.log(512), rel_tol=0.05), family


def test_presets_cover_tigons_families_and_parse():
    from tigon.kernels.patching import FAMILIES

    assert set(PRESETS) | set(NOT_BENCHMARKED) == set(FAMILIES) and not set(PRESETS) & set(NOT_BENCHMARKED)
    with pytest.raises(ValueError, match="phi4_multimodal has no benchmark preset: its vision and audio towers"):
        parse_families("llama,phi4_multimodal")
    assert parse_families("all") == list(PRESETS)
    assert parse_families("qwen3, gemma2") == ["qwen3", "gemma2"]
    with pytest.raises(ValueError, match="unknown families"):
        parse_families("llama,gpt2")
    for family, preset in PRESETS.items():
        assert preset.family == family
        assert preset.liger is None or preset.liger.startswith("apply_liger_kernel_to_")
    assert PRESETS["qwen2_moe"].liger is None  # Liger-Kernel has no Qwen2-MoE function
    assert PRESETS["mistral3"].liger is None  # nor a Mistral 3 one
    assert PRESETS["llama4"].micro_batch_for(4) == 2 and PRESETS["llama"].micro_batch_for(4) == 4


def _build(model_type: str, config: dict) -> tuple[torch.nn.Module, object]:
    """The model the runtime builds from `config` (on the meta device), and its config."""
    from transformers import AutoConfig

    from tigon.runtime.model_types import auto_model_class

    hf_config = AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        return auto_model_class(model_type).from_config(hf_config), hf_config


def _count(model_type: str, config: dict) -> tuple[int, object]:
    """The parameters of the model the runtime builds from `config`, and its config."""
    model, hf_config = _build(model_type, config)
    return sum(p.numel() for p in model.parameters()), hf_config


def assert_rope_sections_span_the_frequencies(model: torch.nn.Module, text_config) -> None:
    """M-RoPE splits the language model's rotary frequencies into (time, height, width) sections, from the config
    or the model's default: they must add up to the frequencies there are."""
    configured = (getattr(text_config, "rope_parameters", None) or {}).get("mrope_section")
    for name, module in model.named_modules():
        inv_freq = getattr(module, "inv_freq", None)
        sections = getattr(module, "mrope_section", None) or configured
        if inv_freq is None or not sections or "visual" in name or "vision" in name:
            continue
        assert sum(sections) == inv_freq.shape[-1], (
            f"{name}: M-RoPE sections {sections}, {inv_freq.shape[-1]} frequencies"
        )


@pytest.mark.parametrize("family", list(PRESETS))
def test_preset_is_its_source_models_shape(family):
    """The real config, at its real depth (a vision-language model with its vision tower), has the named model's
    published parameter count (within 2%)."""
    preset = PRESETS[family]
    model, hf_config = _build(family, preset.full_shape())
    params, text = sum(p.numel() for p in model.parameters()), hf_config.get_text_config()
    assert_rope_sections_span_the_frequencies(model, text)
    assert hf_config.model_type == family
    assert abs(params - preset.params) <= 0.02 * preset.params, f"{preset.source}: {params:,} vs {preset.params:,.0f}"
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key in preset.config:  # Qwen 3.5 MoE has no dense MLP, so no intermediate_size
            assert getattr(text, key) == preset.config[key]  # nothing renamed or dropped by the config class
    if preset.vision is not None:
        for key, value in preset.vision.config.items():
            assert getattr(hf_config.vision_config, key) == value, key

    bench, bench_config = _count(family, preset.shape())  # shortened: fewer layers, the same widths
    assert bench_config.get_text_config().num_hidden_layers == (preset.layers or preset.config["num_hidden_layers"])
    for key, value in preset.reduced.items():  # DeepSeek-V4's fewer experts: in the benchmark shape, not the member's
        assert getattr(bench_config.get_text_config(), key) == value != getattr(hf_config.get_text_config(), key)
    assert bench >= 0.9e9  # ~1B-4B: AdamW in bf16 and the activations fit one GPU
    assert bench <= 4.5e9, bench  # one Llama 4 layer and its embeddings are 4.3B

    tiny, tiny_config = _count(family, preset.tiny_shape())
    assert tiny_config.model_type == family and tiny < 2e6 and tiny_config.get_text_config().vocab_size == 512


#: families whose blocks the planner's shape does not model yet: their benchmark rows say "not modeled"
PLANNER_UNMODELED = {
    "glm4_moe": "its routed and shared experts and dense first layers",
    "gpt_oss": "its experts (with biases) and attention sinks",
    "falcon_h1": "its Mamba-2 mixer beside attention",
    "llama4_text": "its experts beside a shared one, and dense layers of another width",
    "gemma4_text": "its per-layer input embeddings",
    "qwen3_next": "its Gated DeltaNet layers beside attention",
    "deepseek_v3": "its latent attention, routed and shared experts and dense first layers",
    "deepseek_v2": "its latent attention, routed and shared experts and dense first layers",
    "hunyuan_v1_moe": "its experts beside a shared MLP",
    "nemotron": "its ungated MLP (up, squared ReLU, down) and LayerNorms with biases",
    "deepseek_v4": "its hyper-connections, compressed attention and indexer, routed and shared experts",
} | {family: "its vision tower" for family, preset in PRESETS.items() if preset.vision is not None}


def test_the_planner_counts_every_presets_parameters():
    """The planner's shape (dense, or with its MoE block) counts every preset, real, shortened and tiny, within
    2%, except the families named in PLANNER_UNMODELED, whose estimate is left out as "not modeled" (and which
    leave that list once the planner counts them)."""
    from tigon.runtime.planner import ModelShape

    for family, preset in PRESETS.items():
        # a vision-language member's vision tower may be under 2% of it (Mistral Small 3.1's): its benchmark shapes
        full = [] if preset.vision else [preset.full_shape()]
        for config in (*full, preset.shape(), preset.tiny_shape()):
            params, hf_config = _count(family, config)
            note = estimate_note(ModelShape.from_hf_config(hf_config), params)
            assert (note is not None) == (family in PLANNER_UNMODELED), (family, note)


def test_a_shape_the_planner_does_not_count_is_not_modeled():
    """Where the planner's count is not the model's, the estimate is left out, says why, and the table shows
    "not modeled": here a Qwen3-MoE counted as the dense decoder the planner modeled before its MoE block."""
    from tigon.runtime.planner import ModelShape

    params, hf_config = _count("qwen3_moe", PRESETS["qwen3_moe"].shape())
    hf_config.num_experts = 0  # no MoE block: the dense MLP of intermediate_size in every layer
    note = estimate_note(ModelShape.from_hf_config(hf_config), params)
    assert note == "the planner's decoder shape counts 0.85B parameters, the model has 3.11B", note
    run = {"family": "qwen3_moe", "variant": "eager", "seq": 32, "oom": False, "micro_batch": 2, "accumulation": 1}
    run |= {"checkpointing": True, "kernels": False, "tokens_per_second": 1.0, "params": params}
    run |= {"estimate_bytes": None, "estimate_note": note, "peak_bytes": None}
    report = {"environment": {"torch": "2", "transformers": "5"}, "families": {}, "runs": [run]}
    assert "| qwen3_moe | eager | 32 | 2 x 1 | on | off | 1 | - | not modeled | - |" in markdown(report)


def test_published_sizes_match_the_exact_counts_where_known():
    """Exact totals published for three members (KerasHub presets), beyond the 2% of the test above."""
    exact = {"gemma": 2_506_172_416, "gemma2": 2_614_341_888, "gemma3_text": 999_885_952}
    for family, total in exact.items():
        assert _count(family, PRESETS[family].config)[0] == total, family


@pytest.mark.parametrize("answer", [None, 1024, 3072, 7168, 8192, 15360, 16384])
@pytest.mark.parametrize("guess", [1024, 8192, 16384])
def test_longest_search_finds_the_longest_fit_in_few_probes(guess, answer):
    """The search's answer is the longest multiple of the step that fits, from any guess, in O(log) probes."""
    probes: list[int] = []

    def fits(seq: int) -> bool:
        assert seq % 1024 == 0 and 1024 <= seq <= 16384, seq
        probes.append(seq)
        return answer is not None and seq <= answer

    assert _search(fits, guess, "tigon", limit=16384, step=1024) == answer
    assert len(probes) <= 2 * math.ceil(math.log2(16)) + 1, probes
    assert len(set(probes)) == len(probes), f"a length probed twice: {probes}"


def test_merge_keeps_each_variants_found_longest_over_not_run():
    """Two calls' longest searches: a found length (or None, nothing fits) beats an outcome beats 'not run'."""
    family = {"model": "m", "source": "s", "liger": None, "attention": "sdpa", "shape": {}}
    base = {"environment": {"gpu": None}, "settings": {"micro_batch": 1}, "runs": []}
    probe = {"family": "gemma", "variant": "tigon", "seq": 8192, "oom": False}
    first = {
        **base,
        "families": {"gemma": family, "llama": family},
        "longest": {"gemma": {"eager": 8192, "tigon": "not run: time budget (9 s) spent"}, "llama": {"eager": None}},
    }
    second = {
        **base,
        "families": {"gemma": family},
        "longest": {"gemma": {"eager": "not run: time budget (9 s) spent", "tigon": 8192, "liger": "not available"}},
        "longest_probes": [probe],
    }
    merged = merge_reports([first, second])
    assert list(merged["longest"]) == ["llama", "gemma"]  # PRESETS order
    assert merged["longest"]["gemma"] == {"eager": 8192, "tigon": 8192, "liger": "not available"}
    assert merged["longest"]["llama"] == {"eager": None} and merged["longest_probes"] == [probe]


def test_longest_table_reads_a_vision_language_models_context_from_its_text_config():
    """A vision-language preset's shape nests its language model under text_config: the context length is there."""
    shape = PRESETS["qwen2_vl"].shape()
    assert "max_position_embeddings" not in shape and shape["text_config"]["max_position_embeddings"] == 32768
    family = {"model": "m", "source": "s", "liger": None, "attention": "sdpa", "shape": shape}
    report = {
        "environment": {"gpu": None, "torch": "2", "transformers": "5"},
        "settings": {"micro_batch": 1},
        "families": {"qwen2_vl": family},
        "runs": [],
        "longest": {"qwen2_vl": {"tigon": 8192}},
        "longest_probes": [],
    }
    assert "| qwen2_vl | tigon | 8192 | 32768 | - | - | 0 |" in markdown(report)


def test_kernels_are_grouped_by_kind_from_their_names():
    """Names as an H200 profile of the 1B step shows them (cuBLAS, cuDNN, PyTorch's own, Triton's, AdamW's, NCCL's)."""
    from tigon.runtime.profiling import kind_of

    names = {
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0": (
            "attention"
        ),
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)": (
            "copies"
        ),
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor": (
            "pytorch elementwise"
        ),
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "_rms_norm_forward_kernel": "triton kernels",
        "_triton_rope": "triton kernels",
        "triton_poi_fused_add_0": "triton kernels",
        "Memset (Device)": "copies",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "communication",
        "Memcpy PtoP (Device -> Device)": "communication",  # a copy engine reading another GPU's memory
        "cudaLaunchKernelExC": "other",
    }
    assert {name: kind_of(name) for name in names} == names


def test_a_step_timeline_tells_exposed_communication_from_overlapped():
    """Two compute streams overlapping, a collective half under computation, a gap: each part counted once."""
    from tigon.runtime.profiling import covered, timeline

    assert covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == 4.0
    assert covered([]) == 0.0
    kernels = [
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", (0.0, 4.0)),
        ("_rms_norm_forward_kernel", (3.0, 5.0)),  # a second stream: overlaps the matmul by 1 ms
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", (4.0, 8.0)),  # 1 ms under computation, 3 ms exposed
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", (9.0, 10.0)),  # after a 1 ms gap
    ]
    assert timeline(kernels, wall_ms=12.0) == {
        "computing": 6.0,
        "communication exposed": 3.0,
        "communication overlapped": 1.0,
        "idle": 3.0,
    }


def test_recompute_curve_collects_and_plots_selective_and_whole_settings(tmp_path):
    """Two tiny runs as `gpu_run.sh recompute-curve` names them (selective, whole layers): collected as points
    with their settings and the planner's estimates, tabled, and drawn."""
    from benchmarks.recompute_curve import main as curve

    for name, flags in {
        "s2": ["--no-checkpointing", "--selective-layers", "2"],
        "1": ["--checkpoint-layers", "1"],
    }.items():
        command = [sys.executable, "-m", "benchmarks.end_to_end", "--tiny", "--family", "llama", "--variants", "tigon"]
        command += [
            *flags,
            "--seqs",
            "32",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--out",
            str(tmp_path / f"recompute-{name}.json"),
        ]
        done = subprocess.run(command, cwd=ROOT, env=process_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    points_file = tmp_path / "points.json"
    assert curve(["collect", str(tmp_path), "--out", str(points_file)]) == 0
    points = json.loads(points_file.read_text())
    assert sorted(p["recompute"] for p in points) == ["1 layers", "2 selective"]
    assert all(p["variant"] == "tigon" and p["tokens_per_second"] > 0 and p["estimate_gib"] > 0 for p in points)
    with pytest.raises(SystemExit):  # the CPU measures no peak
        curve(["plot", f"tiny={points_file}", "--out", str(tmp_path / "curve.png")])
    for point in points:  # as a GPU run reports them
        point["peak_gib"] = point["estimate_gib"]
    points_file.write_text(json.dumps(points))
    assert curve(["plot", f"tiny={points_file}", "--out", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
