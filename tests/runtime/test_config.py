"""The config loader: key paths and suggestions in errors, overrides, JSON schema, the shipped examples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tigon.runtime.config import ConfigError, RunConfig, json_schema, load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("**/*.yaml")) + sorted((ROOT / "examples").glob("**/*.yml"))

MINIMAL = {
    "model": {"config_name": "llama", "tokenizer": "char"},
    "data": {"train": "train.jsonl"},
    "training": {"max_steps": 10},
}


def write(tmp_path: Path, raw) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw) if not isinstance(raw, str) else raw)
    return path


def with_change(section: str, key: str, value) -> dict:
    raw = json.loads(json.dumps(MINIMAL))
    raw.setdefault(section, {})[key] = value
    return raw


def test_minimal_config_gets_defaults(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    assert isinstance(config, RunConfig)
    assert config.trainer == "torch" and config.parallelism.strategy == "ddp" and config.kernels.enabled
    assert config.training.lr_schedule == "cosine" and config.checkpoint.keep_last == 2


@pytest.mark.parametrize(
    "section, key, expected",
    [
        ("training", "learning_rte", "training.learning_rte: unknown key (did you mean 'learning_rate'?)"),
        ("model", "dtpye", "model.dtpye: unknown key (did you mean 'dtype'?)"),
        ("checkpoint", "zzz", "checkpoint.zzz: unknown key (valid keys: every_steps, keep_last"),
    ],
)
def test_unknown_key_names_its_path_and_a_suggestion(tmp_path, section, key, expected):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, with_change(section, key, 1)))
    assert expected in str(error.value)
    assert str(tmp_path / "config.yaml") in str(error.value)


def test_unknown_top_level_section(tmp_path):
    raw = {**MINIMAL, "trainning": {}}
    with pytest.raises(ConfigError, match=r"trainning: unknown key \(did you mean 'training'\?\)"):
        load_config(write(tmp_path, raw))


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("training", "micro_batch_size", "eight", "training.micro_batch_size: Input should be a valid integer"),
        ("training", "learning_rate", -1, "training.learning_rate: Input should be greater than 0"),
        ("model", "dtype", "float8", "model.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
        ("parallelism", "zero_stage", 4, "parallelism.zero_stage"),
        ("eval", "metrics", ["bleu"], "eval.metrics.0"),
    ],
)
def test_wrong_type_names_its_key_path_and_value(tmp_path, section, key, value, expected):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, with_change(section, key, value)))
    assert expected in str(error.value)
    assert repr(value[0] if isinstance(value, list) else value) in str(error.value)


def test_every_problem_is_listed_at_once(tmp_path):
    raw = with_change("training", "micro_batch_size", "x")
    raw["data"]["packng"] = True
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, raw))
    assert "training.micro_batch_size" in str(error.value) and "data.packng" in str(error.value)


@pytest.mark.parametrize(
    "raw, expected",
    [
        (
            {**MINIMAL, "training": {"max_steps": 5, "epochs": 1}},
            "exactly one of training.max_steps or training.epochs",
        ),
        ({**MINIMAL, "model": {"config_name": "llama", "path": "x"}}, "exactly one of model.path"),
        ({**MINIMAL, "model": {"config_name": "llama"}}, "needs model.tokenizer"),
        ({"model": MINIMAL["model"], "training": MINIMAL["training"]}, "data: Field required"),
    ],
)
def test_cross_field_rules(tmp_path, raw, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_config(write(tmp_path, raw))


def test_overrides_set_nested_values_parsed_as_yaml(tmp_path):
    path = write(tmp_path, MINIMAL)
    config = load_config(
        path,
        [
            "training.max_steps=20",
            "kernels.enabled=false",
            "lora.target_modules=[q_proj, v_proj]",
            "model.config_overrides.hidden_size=64",
            "training.learning_rate=1e-3",
        ],
    )
    assert config.training.max_steps == 20 and config.kernels.enabled is False
    assert config.lora.target_modules == ["q_proj", "v_proj"]
    assert config.model.config_overrides == {"hidden_size": 64}
    assert config.training.learning_rate == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("training.max_steps", "must look like key.path=value"),
        ("training.max_steps.deep=1", "max_steps is not a section"),
        ("training.max_stepz=3", "training.max_stepz: unknown key (did you mean 'max_steps'?)"),
        ("training.max_steps=abc", "training.max_steps: Input should be a valid integer"),
    ],
)
def test_bad_overrides(tmp_path, override, expected):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, MINIMAL), [override])
    assert expected in str(error.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        (None, "does not exist"),
        ("model: [unclosed", "is not valid YAML"),
        ("- a\n- b\n", "must hold a mapping of sections, got list"),
    ],
)
def test_unreadable_files(tmp_path, text, expected):
    path = tmp_path / "missing.yaml" if text is None else write(tmp_path, text)
    with pytest.raises(ConfigError, match=expected):
        load_config(path)


def test_json_schema_export():
    schema = json.loads(json_schema())
    assert schema["title"] == "RunConfig" and schema["additionalProperties"] is False
    assert set(schema["required"]) == {"model", "data", "training"}
    training = schema["$defs"]["TrainingConfig"]
    assert training["additionalProperties"] is False
    assert training["properties"]["lr_schedule"]["enum"] == ["constant", "linear", "cosine"]
    assert "description" in training["properties"]["micro_batch_size"]


def test_examples_exist_and_all_load():
    from tigon.runtime.data import is_hub_dataset

    assert EXAMPLES, "examples/ must ship at least one config"
    for path in EXAMPLES:
        config = load_config(path)
        for data_file in (config.data.train, config.data.eval):
            if data_file is not None and not is_hub_dataset(data_file):  # a Hub name is fetched, not shipped
                assert (ROOT / data_file).exists(), (
                    f"{path.name}: {data_file} is missing (paths are relative to the repo)"
                )


def test_demo_example_is_a_tiny_llama_with_kernels():
    config = load_config(ROOT / "examples" / "demo.yaml")
    assert config.model.config_name == "llama" and config.model.tokenizer == "char"
    assert config.model.config_overrides["num_hidden_layers"] == 2
    assert 64 <= config.model.config_overrides["hidden_size"] <= 128
    assert config.data.format == "instruction" and config.kernels.enabled
    assert "exact_match" in config.eval.metrics
    sizes = [(ROOT / name).stat().st_size for name in (config.data.train, config.data.eval)]
    assert sum(sizes) < 300_000


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("training", "max_steps", True, "training.max_steps: Input should be a valid integer (got True)"),
        ("training", "micro_batch_size", 4.0, "training.micro_batch_size: Input should be a valid integer (got 4.0)"),
        ("training", "learning_rate", "3e-4x", "training.learning_rate: Input should be a valid number"),
        ("data", "packing", "no way", "data.packing: Input should be a valid boolean"),
        ("data", "train", "", "data.train: String should have at least 1 character"),
        ("logging", "run_dir", "", "logging.run_dir: String should have at least 1 character"),
        ("data", "text_field", "", "data.text_field: String should have at least 1 character"),
        ("parallelism", "zero_stage", 3, "parallelism.zero_stage is a DeepSpeed setting and strategy is 'ddp'"),
        ("parallelism", "shard_size", 2, "parallelism.shard_size is an FSDP2 setting and strategy is 'ddp'"),
        ("parallelism", "shard_size", "rack", "parallelism.shard_size"),
        ("training", "gpu_memory", "lots", "training.gpu_memory: Value error, GPU memory 'lots': write a size like"),
        ("training", "gpu_memory", "0GiB", "training.gpu_memory: Value error, '0GiB' is no memory at all"),
        (
            "parallelism",
            "accumulate_sharded",
            True,
            "parallelism.accumulate_sharded is an FSDP2 setting and strategy is 'ddp'",
        ),
        (
            "parallelism",
            "copy_engine_gathers",
            True,
            "parallelism.copy_engine_gathers replaces FSDP2's all-gathers and strategy is 'ddp'",
        ),
    ],
)
def test_silent_mistakes_are_errors(tmp_path, section, key, value, expected):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, with_change(section, key, value)))
    assert expected in str(error.value)


def test_yaml_floats_without_a_dot_are_numbers_and_zero_stage_round_trips(tmp_path):
    raw = with_change("training", "learning_rate", 1)
    text = yaml.safe_dump(raw).replace("learning_rate: 1", "learning_rate: 1e-4")
    config = load_config(write(tmp_path, text), ["training.weight_decay=5E-2"])
    assert config.training.learning_rate == 1e-4 and config.training.weight_decay == 0.05
    dumped = load_config(write(tmp_path, yaml.safe_dump(config.model_dump(mode="json"))))
    assert dumped == config and dumped.parallelism.zero_stage is None and dumped.parallelism.stage == 2
    fsdp = with_change("parallelism", "strategy", "fsdp")
    assert load_config(write(tmp_path, fsdp)).parallelism.shards_parameters


def test_config_path_that_is_a_directory(tmp_path):
    with pytest.raises(ConfigError, match=f"config path {tmp_path} is a directory; give a YAML file in it"):
        load_config(tmp_path)
