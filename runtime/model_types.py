"""What a transformers `model_type` builds: its auto class, and where its language model's config fields go.

A vision-language model (Qwen2-VL, Gemma 3, Llama 4, Llava, ...) is built as its `*ForConditionalGeneration`
class, vision tower included, through `AutoModelForImageTextToText`; every other model through
`AutoModelForCausalLM`. Text-only fine-tuning feeds such a model tokens alone: its language model and head train,
its vision tower gets no gradient. Its config nests the language model's fields under `text_config` (and the
vision tower's under `vision_config`), so `model.config_overrides` does too, and the tokenizer's vocabulary and
special tokens go there (docs/runtime.md, "Vision-language models").
"""

from __future__ import annotations

from tigon.runtime.config import ConfigError

TEXT_CONFIG = "text_config"


def is_vision_language(model_type: str) -> bool:
    """Whether transformers builds `model_type` as an image-text-to-text model (`*ForConditionalGeneration`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def auto_model_class(model_type: str) -> type:
    """The transformers auto class that builds or loads `model_type` for training on text."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(model_type) else AutoModelForCausalLM


def nests_text_config(config_class: type) -> bool:
    """Whether a transformers config class keeps its language model's fields in a `text_config`."""
    return TEXT_CONFIG in getattr(config_class, "sub_configs", {})


def text_overrides(config_class: type, overrides: dict) -> tuple[dict, str]:
    """The dict of `overrides` that holds the language model's fields, and its key path under
    `model.config_overrides`: `overrides` itself, or its `text_config` (added when missing) for a config that nests
    one. Callers pass a copy they may change."""
    if not nests_text_config(config_class):
        return overrides, ""
    text = overrides.setdefault(TEXT_CONFIG, {})
    if not isinstance(text, dict):
        raise ConfigError(
            f"model.config_overrides.{TEXT_CONFIG}: a mapping of config fields, not {type(text).__name__} ({text!r})"
        )
    return text, f".{TEXT_CONFIG}"


def sub_config_class(config_class: type, name: str, overrides: dict) -> type:
    """The config class of `config_class`'s sub-config `name` (`text_config`, `vision_config`, ...): its own, or
    for a sub-config any model may fill (Llava's language model), the one its `model_type` override or default
    names."""
    from transformers import CONFIG_MAPPING, AutoConfig

    sub = config_class.sub_configs[name]
    if sub is not AutoConfig:
        return sub
    model_type = overrides.get("model_type") or getattr(config_class(), name).model_type
    return CONFIG_MAPPING[model_type]
