"""Vision-language models in the runtime: built from `model.config_name` with nested `text_config` / `vision_config`
overrides, or loaded from a `save_pretrained` directory, as their `*ForConditionalGeneration` class, and fine-tuned
on text; the override mistakes that are errors name the nested key (runtime/model_types.py, runtime/model.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from tests.runtime.configs import TINY_MODEL, tiny_config
from tigon.runtime import planner
from tigon.runtime.config import ConfigError
from tigon.runtime.model import build_model
from tigon.runtime.tokenizer import load_tokenizer
from tigon.runtime.trainer import train

ROOT = Path(__file__).resolve().parents[2]

# A 2-layer, 32-wide Qwen2-VL language model (its multimodal RoPE's sections for a 16-wide head) beside a one-layer
# vision tower
QWEN2_VL = {
    "text_config": {
        **TINY_MODEL,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
    },
    "vision_config": {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": 2},
}


def vl_config(tmp_path, overrides: dict | None = None, name: str = "qwen2_vl", **sections):
    model = {"config_name": name, "config_overrides": QWEN2_VL if overrides is None else overrides}
    return tiny_config(tmp_path, model=model, **sections)


def test_a_vision_language_model_fine_tunes_on_text_with_the_kernels(tmp_path):
    """The run builds Qwen2VLForConditionalGeneration, vision tower included; its language model takes the
    tokenizer's vocabulary in text_config, gets tigon's kernels and learns; the vision tower gets no gradient."""
    config = vl_config(
        tmp_path,
        data={"max_seq_len": 16},
        training={"max_steps": 6, "micro_batch_size": 2},
        kernels={"enabled": True},
    )
    vocab = len(load_tokenizer(config.model))
    model = build_model(config, vocab)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert model.config.text_config.vocab_size == vocab == model.get_input_embeddings().weight.shape[0]
    assert model.config.vision_config.depth == 1 and len(model.model.visual.blocks) == 1
    report = model.tigon_patch_report
    assert report.applied["gated_mlp"] == 2 and report.applied["fused_linear_cross_entropy"] == 1
    assert report.applied["layer_norm"] == 3  # the vision block's two LayerNorms and the patch merger's
    assert planner.model_shape(config).vocab == vocab  # the planner reads the same text_config

    result = train(config)
    assert result.steps == 6 and result.final_loss < 0.75 * result.losses[0], result.losses
    assert "gated_mlp x2" in result.kernels and "fused_linear_cross_entropy" in result.kernels


def test_the_documented_vision_language_model_trains_as_written(tmp_path):
    """docs/runtime.md's model section, as written, in a short run on the tests' arithmetic data."""
    section = (ROOT / "docs" / "runtime.md").read_text().split("\n## Vision-language models\n")[1].split("\n## ")[0]
    model = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", section, flags=re.S)[0])["model"]
    config = tiny_config(tmp_path, model=model, data={"max_seq_len": 16}, training={"max_steps": 4})
    assert type(build_model(config, len(load_tokenizer(config.model)))).__name__ == "Qwen2VLForConditionalGeneration"
    result = train(config)
    assert result.steps == 4 and result.final_loss < result.losses[0], result.losses


def test_a_saved_vision_language_model_loads_as_its_conditional_generation_class(tmp_path):
    """`model.path` on a `save_pretrained` directory of a vision-language model: the same class and weights."""
    built = build_model(vl_config(tmp_path), vocab_size=97)
    built.save_pretrained(tmp_path / "saved")
    config = tiny_config(tmp_path, model={"path": str(tmp_path / "saved"), "config_name": None, "tokenizer": "char"})
    loaded = build_model(config, vocab_size=97)
    assert type(loaded) is type(built)
    expected = built.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(value, expected[key]) for key, value in loaded.state_dict().items())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {**QWEN2_VL, "hidden_size": 64},
            "model.config_overrides.hidden_size: Qwen2VLConfig keeps its language model's fields in text_config; "
            "write it as model.config_overrides.text_config.hidden_size",
        ),
        (
            {**QWEN2_VL, "text_config": {**QWEN2_VL["text_config"], "hidden_sizee": 48}},
            "model.config_overrides.text_config.hidden_sizee: not a field of Qwen2VLTextConfig (did you mean "
            "'hidden_size'?)",
        ),
        (
            {**QWEN2_VL, "text_config": {**QWEN2_VL["text_config"], "num_key_value_heads": 3}},
            "model.config_overrides.text_config: num_attention_heads 2 is not a multiple of num_key_value_heads 3",
        ),
        (
            {**QWEN2_VL, "vision_config": {**QWEN2_VL["vision_config"], "num_head": 2}},
            "model.config_overrides.vision_config.num_head: not a field of Qwen2VLVisionConfig (did you mean "
            "'num_heads'?)",
        ),
        (
            {**QWEN2_VL, "text_config": {**QWEN2_VL["text_config"], "vocab_size": 10}},
            "model.config_overrides.text_config.vocab_size: 10 is smaller than the tokenizer's",
        ),
        (
            {**QWEN2_VL, "text_config": {**QWEN2_VL["text_config"], "max_position_embeddings": 32}},
            "lower it or set model.config_overrides.text_config.max_position_embeddings",
        ),
        ({"text_config": 3}, "model.config_overrides.text_config: a mapping of config fields, not int (3)"),
    ],
)
def test_nested_override_mistakes_name_the_nested_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(vl_config(tmp_path, overrides))


def test_a_language_model_any_model_fills_is_checked_as_that_model(tmp_path):
    """Llava's language model is whatever text_config.model_type names: its fields are checked as that model's."""
    overrides = {"text_config": {"model_type": "qwen2", "hidden_sizee": 48}}
    with pytest.raises(ConfigError, match=re.escape("text_config.hidden_sizee: not a field of Qwen2Config")):
        train(vl_config(tmp_path, overrides, name="llava"))


def test_the_planner_reads_a_per_layer_head_width_from_the_first_layer():
    """Gemma 4's config keeps head_dim per layer (its global layers' heads are wider): the planner's shape takes the
    first layer's instead of failing on the config's own."""
    from transformers import AutoConfig

    text = AutoConfig.for_model(
        "gemma4_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        hidden_size_per_layer_input=8,
        vocab_size=97,
        vocab_size_per_layer_input=97,
    )
    assert text.per_layer_config[1].head_dim == 32  # the global layer's, beside the sliding one's 16
    shape = planner.ModelShape.from_hf_config(text)
    assert shape.head_dim == 16 and shape.heads == 4 and shape.vocab == 97
