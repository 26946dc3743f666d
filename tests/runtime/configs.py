"""Run configs for the runtime tests: one builder (`run_config`), the tiny Llama run (`tiny_config`) most tests
train, and the smallest run around a data section (`data_config`)."""

from __future__ import annotations

from pathlib import Path

from tigon.runtime.config import RunConfig, parse_config
from tigon.runtime.tasks import write_arithmetic_dataset

TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


def run_config(raw: dict, **sections) -> RunConfig:
    """`raw` (a config file's sections) with `sections` merged in, validated: a dict updates its section's keys
    (one level deep), anything else replaces the section."""
    raw = dict(raw)
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(raw.get(section), dict):
            raw[section] = {**raw[section], **values}
        else:
            raw[section] = values
    return parse_config(raw)


def tiny_config(tmp_path: Path, n_train: int = 160, **sections) -> RunConfig:
    """A run small enough for the CPU test suite: a 2-layer, 32-wide Llama with tigon's character tokenizer on a
    generated arithmetic task (written under `tmp_path/data` once); `sections` as in `run_config`."""
    data_dir = tmp_path / "data"
    train_file, eval_file = data_dir / "train.jsonl", data_dir / "eval.jsonl"
    if not train_file.exists():
        held_out = write_arithmetic_dataset(eval_file, 24, seed=1, max_operand=49)
        write_arithmetic_dataset(
            train_file, n_train, seed=0, max_operand=49, exclude={r["instruction"] for r in held_out}
        )
    raw = {
        "model": {"config_name": "llama", "config_overrides": dict(TINY_MODEL), "tokenizer": "char"},
        "data": {"train": str(train_file), "eval": str(eval_file), "format": "instruction", "max_seq_len": 48},
        "training": {
            "max_steps": 8,
            "learning_rate": 1e-2,
            "lr_schedule": "constant",
            "micro_batch_size": 4,
            "seed": 0,
        },
        "kernels": {"enabled": False},
        "checkpoint": {"export": False, "resume": False},
        "logging": {"run_dir": str(tmp_path / "run"), "tensorboard": False, "progress_bar": False, "every_steps": 1},
    }
    return run_config(raw, **sections)


def data_config(train: str | Path, **data) -> RunConfig:
    """The smallest valid run around a data section that reads `train`: a char-tokenized Llama, one step."""
    model = {"config_name": "llama", "tokenizer": "char"}
    return run_config({"model": model, "data": {"train": str(train), **data}, "training": {"max_steps": 1}})
