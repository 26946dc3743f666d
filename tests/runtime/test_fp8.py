"""`training.precision: fp8`: the decoder layers' Linear layers in FP8, tigon's (tensorwise) or torchao's.

These machines have no FP8 GPU, so the tests set TIGON_FP8_EMULATE=1: torchao casts inputs, weights and output
gradients to FP8 with the same dynamic scales and runs the matmuls on the FP8 values in higher precision, and
tigon's layers run the CPU's own `torch._scaled_mm`. What a GPU adds (its FP8 tensor cores' accumulation) is
measured by `bash benchmarks/gpu_run.sh fp8`. The layers
are compiled with `aot_eager`, as in tests/runtime/test_compile.py, since fp8 requires training.compile.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.runtime.configs import COMPILED, TINY_MODEL, resumable_config, tiny_config
from tests.runtime.worker_groups import launch, worst_relative
from tigon.kernels.modules import FP8Linear
from tigon.runtime.config import ConfigError
from tigon.runtime.fp8 import EMULATE_VARIABLE, check_device
from tigon.runtime.model import build_model
from tigon.runtime.trainer import train

FP8 = {**COMPILED, "precision": "fp8"}
BF16 = {**COMPILED, "precision": "bf16"}
LAYER_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# FP8 (e4m3, 3 mantissa bits) against bf16 (7): each matmul's inputs carry about 2^-4 relative rounding error
# instead of 2^-8. Over 8 steps of the tiny Llama at learning rate 1e-2 the per-step losses moved apart by at
# most 9.7e-3 relative (tensorwise, tigon's layers) and 9.1e-3 (rowwise, torchao's); 2e-2 leaves twice that.
LOSS_TOLERANCE = 2e-2
# On two ranks each scales its half of the batch (tensorwise: one amax per rank's input), so the casts round
# differently from one process's: measured 5.5e-3 (DDP, tigon's layers), 3.8e-3 (FSDP2, torchao's) and 5.8e-3
# (FSDP2, tigon's) relative over 4 steps, the size of FP8's own rounding above (the same comparison in bf16:
# 1.5e-4; fp8 rowwise, whose input scales are per token: 1.5e-3).
RANKS_TOLERANCE = LOSS_TOLERANCE


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    monkeypatch.setenv(EMULATE_VARIABLE, "1")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def float8_names(model: torch.nn.Module, kind: type | None = None) -> list[str]:
    """The FP8 layers' names: tigon's and torchao's, or only those of `kind`."""
    from torchao.float8.float8_linear import Float8Linear

    kinds = kind or (FP8Linear, Float8Linear)
    return [name for name, module in model.named_modules() if isinstance(module, kinds)]


@pytest.mark.parametrize("kernels", [False, True])
def test_fp8_swaps_exactly_the_decoder_layers_linear_layers(tmp_path, kernels):
    """With tigon's kernels too: their gated MLP calls its projections as modules, so they convert alike."""
    model = build_model(tiny_config(tmp_path, training=FP8, kernels={"enabled": kernels}), 64)
    want = [
        f"model.layers.{i}.{'self_attn' if j < 4 else 'mlp'}.{name}"
        for i in range(2)
        for j, name in enumerate(LAYER_LINEARS)
    ]
    assert float8_names(model, FP8Linear) == want  # tensorwise on one process: tigon's casts
    assert [name for name in want if model.get_submodule(name).keep_input] == want[3::7]  # o_proj: attention's output
    assert model.tigon_fp8_layers == want
    assert type(model.lm_head) is torch.nn.Linear  # the fused loss reads its weight


@pytest.mark.parametrize(
    ("sections", "torchao"),
    [
        ({}, False),
        ({"training": {"fp8_scaling": "rowwise"}}, True),
        ({"parallelism": {"strategy": "fsdp"}}, True),
        ({"training": {"fp8_layers": "torchao"}}, True),
        ({"training": {"fp8_layers": "tigon"}, "parallelism": {"strategy": "fsdp"}}, False),
    ],
    ids=["tensorwise", "rowwise", "fsdp", "torchao-asked", "tigon-asked-under-fsdp"],
)
def test_fp8_layers_are_tigons_unless_rowwise_or_fsdp(tmp_path, sections, torchao):
    from torchao.float8.float8_linear import Float8Linear

    training = {**FP8, **sections.pop("training", {})}
    model = build_model(tiny_config(tmp_path, training=training, **sections), 64)
    assert len(float8_names(model, Float8Linear if torchao else FP8Linear)) == 14
    assert len(float8_names(model)) == 14


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tigons_fp8_layer_equals_torchaos(weight_dtype):
    """Forward and backward against torchao's Float8Linear (tensorwise, emulated here): the same FP8 operands, so
    the products differ only where torchao's emulation divides by a scale and `torch._scaled_mm` multiplies by
    its inverse, a float32 rounding that moves a bf16 result by one unit at most (the GPU test compares bits with
    torchao's own products). Outside autocast: under a CPU autocast torchao's emulated product runs in bf16."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=False, dtype=weight_dtype)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    grad = torch.randn(32, 48, dtype=torch.bfloat16)
    results = []
    for module in (FP8Linear.from_linear(linear), Float8Linear.from_float(copy.deepcopy(linear), config)):
        leaf = x.clone().requires_grad_()
        out = module(leaf)
        out.backward(grad)
        results.append((out, leaf.grad, module.weight.grad))
    for tigon, torchao in zip(*results, strict=True):
        assert tigon.dtype == torchao.dtype
        assert ((tigon.double() - torchao.double()).norm() / torchao.double().norm()).item() < 1e-4


def test_fp8_skips_layers_whose_dimensions_are_not_multiples_of_16(tmp_path):
    """intermediate_size 40: gate, up and down projections stay bf16 Linear layers."""
    config = tiny_config(tmp_path, training=FP8, model={"config_overrides": {**TINY_MODEL, "intermediate_size": 40}})
    model = build_model(config, 64)
    names = float8_names(model)
    assert names == [f"model.layers.{i}.self_attn.{name}" for i in range(2) for name in LAYER_LINEARS[:4]]
    assert type(model.model.layers[0].mlp.gate_proj) is torch.nn.Linear


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_trains_within_tolerance_of_bf16(tmp_path, scaling):
    sections = dict(eval={"metrics": []})
    bf16 = train(tiny_config(tmp_path / "bf16", training=BF16, **sections))
    fp8 = train(tiny_config(tmp_path / "fp8", training={**FP8, "fp8_scaling": scaling}, **sections))
    worst = worst_relative(fp8.losses, bf16.losses)
    print(f"fp8 {scaling} against bf16: worst relative per-step loss difference {worst:.2e}")
    assert fp8.losses != bf16.losses  # the FP8 casts ran
    assert worst < LOSS_TOLERANCE, (fp8.losses, bf16.losses)
    assert fp8.losses[-1] < fp8.losses[0] * 0.8  # and it learns


def test_fp8_with_selective_layers_trains_as_without_recomputation(tmp_path):
    """Both layers selective: the backward recomputes the FP8 casts of the kept outputs' consumers from the same
    values, so the losses equal the run that keeps everything."""
    sections = dict(eval={"metrics": []})
    plain = train(tiny_config(tmp_path / "plain", training=FP8, **sections))
    selective = train(tiny_config(tmp_path / "selective", training={**FP8, "selective_layers": 2}, **sections))
    assert selective.losses == plain.losses


def test_fp8_on_two_processes_matches_one_process(tmp_path):
    """2 ranks over gloo: DDP with tigon's layers; FSDP2 with torchao's, FP8 all-gather of the weights (tensorwise)
    and the scales precomputed after each step, with and without selective layers (whose recomputation reads the
    weights FSDP2 gathers again), and with tigon's (bf16 all-gather); against one fp8 process (tigon's layers)
    with the whole micro-batch."""
    training = {**FP8, "micro_batch_size": 2}
    fsdp = {"strategy": "fsdp"}
    runs = launch(
        tmp_path,
        {
            "ddp": resumable_config(tmp_path, "ddp", 4, False, training=training, parallelism={"strategy": "ddp"}),
            "fsdp": resumable_config(tmp_path, "fsdp", 4, False, training=training, parallelism=fsdp),
            "fsdp-tigon": resumable_config(
                tmp_path, "fsdp-tigon", 4, False, training={**training, "fp8_layers": "tigon"}, parallelism=fsdp
            ),
            "fsdp-selective": resumable_config(
                tmp_path, "fsdp-selective", 4, False, training={**training, "selective_layers": 2}, parallelism=fsdp
            ),
        },
    )
    single = train(resumable_config(tmp_path, "single", 4, False, training={**FP8, "micro_batch_size": 4}))
    for name, run in runs.items():
        worst = worst_relative(run["losses"], single.losses)
        print(f"{name} fp8: worst relative loss difference to one process {worst:.2e}")
        assert worst < RANKS_TOLERANCE, (name, run["losses"], single.losses)


def test_fp8_under_fsdp2_casts_weights_before_the_all_gather(tmp_path):
    """Tensorwise under FSDP2: the weights become torchao's FP8-cast-on-all-gather tensors, which
    `precompute_scales` finds after each optimizer step; rowwise keeps plain weights (bf16 all-gather)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    fsdp = {"strategy": "fsdp"}
    tensorwise = build_model(tiny_config(tmp_path, training=FP8, parallelism=fsdp), 64)
    weights = [tensorwise.get_submodule(name).weight for name in tensorwise.tigon_fp8_layers]
    assert len(weights) == 14 and all(isinstance(w, WeightWithDynamicFloat8CastTensor) for w in weights)
    rowwise = build_model(tiny_config(tmp_path, training={**FP8, "fp8_scaling": "rowwise"}, parallelism=fsdp), 64)
    assert not any(isinstance(p, WeightWithDynamicFloat8CastTensor) for p in rowwise.parameters())


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"lora": {"enabled": True}}, "fp8 with lora.enabled: .*LoRA"),
        ({"parallelism": {"strategy": "deepspeed"}}, "fp8 with parallelism.strategy deepspeed: .*ddp or fsdp"),
        ({"trainer": "hf"}, "fp8 with trainer 'hf': .*set trainer: torch"),
        ({"model": {"dtype": "float16"}}, "fp8 with model.dtype float16: .*bfloat16 or float32"),
        ({"training": {"compile": False}}, "fp8 with training.compile false: .*set training.compile: true"),
        (
            {"training": {"fp8_layers": "tigon", "fp8_scaling": "rowwise"}},
            "fp8 with training.fp8_layers tigon and fp8_scaling rowwise: .*set fp8_scaling: tensorwise",
        ),
        ({"data": {"max_seq_len": 40}}, "fp8 with data.max_seq_len 40: .*a multiple of 16"),
    ],
)
def test_fp8_refuses_what_it_cannot_run_with_the_fix(tmp_path, sections, message):
    training = {**FP8, **sections.pop("training", {})}
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, training=training, **sections)


@pytest.mark.parametrize(("name", "value"), [("fp8_scaling", "rowwise"), ("fp8_layers", "torchao")])
def test_fp8_settings_without_fp8_are_refused(tmp_path, name, value):
    with pytest.raises(ConfigError, match=f"training.{name} applies to precision fp8, not 'bf16'.*remove {name}"):
        tiny_config(tmp_path, training={"precision": "bf16", name: value})


def test_fp8_without_an_fp8_gpu_is_refused_with_the_fix(monkeypatch):
    monkeypatch.delenv(EMULATE_VARIABLE)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        check_device()  # an FP8 GPU: accepted
        return
    with pytest.raises(ConfigError, match="training.precision: fp8 needs .*compute capability 8.9.*precision: bf16"):
        check_device()
