"""QLoRA on the CPU: a tiny Llama's base in 4 bits (bitsandbytes), LoRA adapters trained on it with the kernels,
exact resume, a dense merged export, the planner's count and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.runtime.configs import TINY_MODEL, tiny_config
from tigon.runtime import planner
from tigon.runtime.config import ConfigError
from tigon.runtime.model import build_model
from tigon.runtime.quantization import dense_weight, merge_into_dense
from tigon.runtime.run import check_config
from tigon.runtime.trainer import train

bnb = pytest.importorskip("bitsandbytes")

QLORA = {"enabled": True, "r": 4, "quantize_base": "nf4", "target_modules": ["q_proj", "v_proj", "gate_proj"]}
# Widths that are multiples of 64: bitsandbytes' CPU kernels quantize a row in whole blocks of 64
MODEL = {"config_overrides": {**TINY_MODEL, "hidden_size": 64, "intermediate_size": 128}}


def qlora_config(tmp_path: Path, **sections):
    sections.setdefault("lora", QLORA)
    sections.setdefault("model", MODEL)
    return tiny_config(tmp_path, **sections)


def test_the_base_is_4_bit_the_head_is_not_and_only_adapters_train(tmp_path):
    model = build_model(qlora_config(tmp_path), 64)
    quantized = [name for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    assert not isinstance(model.get_output_embeddings(), bnb.nn.Linear4bit)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable), trainable
    up = model.get_base_model().model.layers[0].mlp.up_proj
    assert up.weight.dtype == torch.uint8 and dense_weight(up).shape == (128, 64)


def test_quantization_keeps_each_weight_near_its_value():
    """NF4 puts each weight on one of 16 levels scaled by its block's largest magnitude: the error stays within
    half the widest gap between levels (-1 and -0.6962: 0.1519 of the scale) and is not zero."""
    weight = torch.randn(64, 128)
    stored = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4", compress_statistics=False)
    stored = stored._quantize("cpu")
    error = (bnb.functional.dequantize_4bit(stored.data, stored.quant_state) - weight).abs()
    scale = weight.reshape(-1, 64).abs().amax(1, keepdim=True)
    assert 0 < error.max() and (error.reshape(-1, 64) <= 0.1520 * scale).all()


def test_the_merged_model_computes_what_the_4_bit_base_and_its_adapters_compute(tmp_path):
    model = build_model(qlora_config(tmp_path, lora={**QLORA, "double_quant": False}), 64)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: give the adapters an update to merge
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    tokens = torch.randint(1, 60, (2, 12), generator=generator)
    with torch.no_grad():
        adapted = model(tokens).logits
        dense = merge_into_dense(model, torch.float32)
        merged = dense(tokens).logits
    assert all(type(m) is not bnb.nn.Linear4bit for m in dense.modules())
    assert (adapted - merged).abs().max() < 1e-4 * adapted.abs().max()


def test_qlora_trains_with_the_kernels_resumes_exactly_and_exports_merged_dense(tmp_path):
    from transformers import AutoModelForCausalLM

    options = dict(
        training={"max_steps": 6, "micro_batch_size": 2, "learning_rate": 3e-2},
        data={"max_seq_len": 16},
        kernels={"enabled": True},
        checkpoint={"every_steps": 3, "resume": True, "export": True},
    )
    full = train(qlora_config(tmp_path / "full", **options))
    assert full.final_loss < full.losses[0], full.losses
    assert "gated_mlp x2" in full.kernels and "rms_norm" in full.kernels

    first_half = {**options, "training": {**options["training"], "max_steps": 3}}
    stopped = train(qlora_config(tmp_path / "resumed", **first_half))
    assert stopped.losses == full.losses[:3]
    resumed = train(qlora_config(tmp_path / "resumed", **options))
    assert resumed.resumed_from_step == 3 and resumed.losses == full.losses

    exported = AutoModelForCausalLM.from_pretrained(full.export_dir)
    assert all(type(m) is not bnb.nn.Linear4bit for m in exported.modules())
    assert exported.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    adapter = Path(f"{full.export_dir}-adapter")
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4


def test_planner_counts_the_base_in_4_bits(tmp_path):
    config = qlora_config(tmp_path)
    dense = config.model_copy(update={"lora": config.lora.model_copy(update={"quantize_base": None})})
    shape = planner.model_shape(config)
    full_weights = planner.workload(dense, world_size=1, shape=shape)
    quantized = planner.workload(config, world_size=1, shape=shape)
    setting = planner.setting_of(config)
    delta = (
        planner.estimate(full_weights, setting).parts["weights"] - planner.estimate(quantized, setting).parts["weights"]
    )
    linear = shape.layers * sum(a * b for a, b in map(shape.linear_shape, shape.linear_names))
    assert delta == pytest.approx(linear * (4 - planner.QUANTIZED_BYTES[True]), rel=1e-6)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"lora": {"quantize_base": "nf4"}}, "set lora.enabled: true"),
        ({"lora": QLORA, "parallelism": {"strategy": "fsdp"}}, "use strategy 'ddp'"),
    ],
)
def test_qlora_settings_that_cannot_run_are_named(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        check_config(qlora_config(tmp_path, **sections))


def test_widths_the_cpu_kernels_would_quantize_wrongly_are_refused(tmp_path):
    config = qlora_config(tmp_path, model={"config_overrides": TINY_MODEL})  # 32 wide
    with pytest.raises(ConfigError, match="not a multiple of 64"):
        build_model(config, 64)


@pytest.mark.gpu
def test_qlora_on_a_gpu_trains_in_bf16_with_the_kernels(tmp_path):
    """A 4-layer, 512-wide Llama, bf16 autocast, the kernels on: the loss falls and the merged export loads."""
    from transformers import AutoModelForCausalLM

    shape = {**TINY_MODEL, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4}
    shape |= {"num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256}
    config = qlora_config(
        tmp_path,
        model={"config_overrides": shape},
        data={"max_seq_len": 64},
        training={"max_steps": 30, "micro_batch_size": 4, "learning_rate": 3e-3, "precision": "bf16"},
        kernels={"enabled": True},
        checkpoint={"export": True},
    )
    result = train(config)
    assert result.device.startswith("cuda") and result.final_loss < 0.8 * result.losses[0], result.losses
    assert "gated_mlp x4" in result.kernels
    estimate = planner.estimate(planner.workload(config, world_size=1), planner.setting_of(config)).peak
    peak = result.peak_memory_bytes
    print(f"QLoRA on {torch.cuda.get_device_name()}: peak {peak / 2**20:.0f} MiB, planner {estimate / 2**20:.0f} MiB")
    exported = AutoModelForCausalLM.from_pretrained(result.export_dir)
    assert exported.model.layers[0].mlp.up_proj.weight.shape == (1408, 512)


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_the_hf_and_lightning_trainers_train_a_4_bit_base(tmp_path, trainer):
    result = train(qlora_config(tmp_path, trainer=trainer, training={"max_steps": 3, "learning_rate": 3e-2}))
    assert len(result.losses) == 3 and result.final_loss < result.losses[0], result.losses
