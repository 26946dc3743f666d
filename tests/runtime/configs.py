"""Run configs for the runtime tests: one builder (`run_config`), the tiny Llama run (`tiny_config`) most tests
train and its variants (`resumable_config`, `adapter_config`), the smallest run around a data section
(`data_config`), the preference and distillation runs (`preference_config`, `distill_config`, `objective_config`)
with their records and saved tiny models, and TRL's trainer on the same run (`trl_trainer`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tigon.runtime.config import RunConfig, parse_config
from tigon.runtime.tasks import write_arithmetic_dataset
from tigon.runtime.tokenizer import build_char_tokenizer

COMPILED = {"compile": True, "compile_backend": "aot_eager"}  # training.compile as the CPU runs it (no C++ build)
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


def quiet_run(tmp_path: Path, model: dict, data: dict, **training) -> dict:
    """The sections of a tiny test run: `model`, `data`, a learning rate of 1e-2 held constant (`training` adds to
    that section), no kernels, no checkpoints or export, quiet logging to `tmp_path/run`."""
    return {
        "model": model,
        "data": data,
        "training": {"learning_rate": 1e-2, "lr_schedule": "constant", **training},
        "kernels": {"enabled": False},
        "checkpoint": {"export": False, "resume": False},
        "logging": {"run_dir": str(tmp_path / "run"), "tensorboard": False, "progress_bar": False, "every_steps": 1},
    }


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
    model = {"config_name": "llama", "config_overrides": dict(TINY_MODEL), "tokenizer": "char"}
    data = {"train": str(train_file), "eval": str(eval_file), "format": "instruction", "max_seq_len": 48}
    raw = quiet_run(tmp_path, model, data, max_steps=8, micro_batch_size=4, seed=0)
    return run_config(raw, **sections)


def data_config(train: str | Path, **data) -> RunConfig:
    """The smallest valid run around a data section that reads `train`: a char-tokenized Llama, one step."""
    model = {"config_name": "llama", "tokenizer": "char"}
    return run_config({"model": model, "data": {"train": str(train), **data}, "training": {"max_steps": 1}})


PAIRS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
    for a, b in [(3, 4), (12, 9), (40, 2), (7, 77), (5, 5), (31, 18), (2, 60), (9, 9)]
]

KTO_RECORDS = [
    {"prompt": pair["prompt"], "completion": pair[key], "label": key == "chosen"}
    for pair in PAIRS
    for key in ("chosen", "rejected")
]

TRL_ARGS = {  # the run preference_config describes: AdamW (betas 0.9/0.95), constant lr 1e-2, clipping at 1, fp32
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "learning_rate": 1e-2,
    "lr_scheduler_type": "constant",
    "max_steps": 4,
    "logging_steps": 1,
    "max_length": 32,
    "adam_beta2": 0.95,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "bf16": False,  # TRL turns on bf16 autocast by default, on the CPU too
    "report_to": "none",
    "use_cpu": True,
    "save_strategy": "no",
    "seed": 0,
}

DISTILL_RECORDS = [
    {"instruction": f"{a}+{b}=", "response": str(a + b)} for a, b in [(3, 4), (12, 9), (40, 2), (7, 77)] * 2
]

DISTILL_OBJECTIVE = {"type": "distill", "alpha": 0.3, "beta": 0.4, "temperature": 2.0}

DISTILL_STEPS = 3

OBJECTIVES = {  # name: objective section (distill: distill_config's teacher and mix)
    "dpo": {"type": "dpo"},
    "kto-precomputed": {"type": "kto", "reference": "precomputed"},
    "orpo": {"type": "orpo"},
    "distill": {},
    "distill-precomputed": {},
}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def save_tiny_llama(directory: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer, 32-wide Llama and tigon's character tokenizer, saved with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tigon.runtime.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **{**TINY_MODEL, **overrides},
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_model_dir(tmp_path: Path) -> Path:
    """A tiny Llama (random init, seed 0) and the char tokenizer, saved as a from_pretrained directory."""
    directory = tmp_path / "model"
    return directory if directory.is_dir() else save_tiny_llama(directory, tie_word_embeddings=False)


def preference_config(tmp_path: Path, objective: dict | str, records: list[dict] = PAIRS, **sections):
    """A run of 4 steps of 4 pairs x 2 micro-batches (the whole data set each step) on the tiny model."""
    model = {"path": str(tiny_model_dir(tmp_path))}
    data = {"train": str(write_jsonl(tmp_path / "train.jsonl", records)), "max_seq_len": 32}
    raw = quiet_run(tmp_path, model, data, max_steps=4, micro_batch_size=4, gradient_accumulation_steps=2)
    return run_config({**raw, "objective": objective}, **sections)


def trl_trainer(tmp_path: Path, config_class, trainer_class, records: list[dict], peft_config=None, **settings):
    """TRL's `trainer_class` built on `records` from tiny_model_dir, with TRL_ARGS and `settings` (and a PEFT
    adapter from `peft_config`), not yet trained."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    model_dir = tiny_model_dir(tmp_path)
    return trainer_class(
        model=str(model_dir),
        args=config_class(output_dir=str(tmp_path / "trl"), **{**TRL_ARGS, **settings}),
        train_dataset=Dataset.from_list(records),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        **({"peft_config": peft_config} if peft_config is not None else {}),
    )


def save_llama(directory: Path, seed: int, hidden: int, vocab_extra: int = 0, init: float = 0.02) -> Path:
    """A tiny Llama (random init from `seed`, weights of standard deviation `init`: larger gives the peaked
    distributions of a trained model) and the char tokenizer, saved for from_pretrained."""
    import transformers

    if directory.is_dir():
        return directory
    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        vocab_size=len(tokenizer) + vocab_extra,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=init,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def distill_config(tmp_path: Path, objective: dict | None = None, precompute: bool = False, **sections):
    """3 steps of 4 sequences (2 x 2 micro-batches: the whole data set each step) distilling a 48-wide teacher
    into a 32-wide student (`precompute`: objective.teacher.precompute)."""
    teacher = save_llama(tmp_path / "teacher", seed=1, hidden=48, init=0.3)
    model = {"path": str(save_llama(tmp_path / "student", seed=0, hidden=32))}
    records = write_jsonl(tmp_path / "train.jsonl", DISTILL_RECORDS)
    data = {"train": str(records), "format": "instruction", "max_seq_len": 16}
    raw = quiet_run(tmp_path, model, data, max_steps=DISTILL_STEPS, micro_batch_size=2, gradient_accumulation_steps=2)
    teacher_section = {"path": str(teacher), "precompute": precompute}
    objective = {**DISTILL_OBJECTIVE, "teacher": teacher_section, **(objective or {})}
    return run_config({**raw, "objective": objective}, **sections)


def resumable_config(tmp_path: Path, name: str, max_steps: int, export: bool, **sections):
    """A tiny run (tiny_config) with checkpoints every 3 steps and resume on."""
    training = {"micro_batch_size": 2, "max_steps": max_steps, **sections.pop("training", {})}
    return tiny_config(
        tmp_path,
        training=training,
        checkpoint={"every_steps": 3, "keep_last": 2, "resume": True, "export": export},
        eval={"metrics": ["loss", "exact_match"], "max_batches": 1},
        logging={"run_dir": str(tmp_path / name), "tensorboard": False, "progress_bar": False, "every_steps": 1},
        **sections,
    )


def adapter_config(tmp_path, trainer: str, n_train: int = 40, **sections):
    """A tiny run for `trainer`: micro-batch 2 x accumulation 2, cosine schedule with warmup and clipping, so every
    piece the trainers share is exercised."""
    training = {
        "max_steps": 6,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "lr_schedule": "cosine",
        "warmup_steps": 2,
        "weight_decay": 0.1,
        "max_grad_norm": 0.5,
        **sections.pop("training", {}),
    }
    return tiny_config(
        tmp_path,
        n_train=n_train,  # 40: about 3 steps per epoch, so the run crosses epochs (the data order reshuffles)
        trainer=trainer,
        training=training,
        data={"max_seq_len": 32},
        eval={"metrics": ["loss"], "max_batches": 1, **sections.pop("eval", {})},
        logging={
            "run_dir": str(tmp_path / f"run-{trainer}"),
            "tensorboard": False,
            "progress_bar": False,
            **sections.pop("logging", {}),
        },
        **sections,
    )


def objective_config(tmp_path, objective: str, trainer: str, **sections):
    """2 steps of 2 x 2 micro-batches (pairs, KTO completions, or distillation's sequences) on the tiny Llama of
    preference_config (distill_config's student and teacher for distill), evaluated on the training records."""
    sections = {
        "trainer": trainer,
        "training": {"max_steps": 2, "micro_batch_size": 2, **sections.pop("training", {})},
        "data": {"eval": str(tmp_path / "train.jsonl")},
        "logging": {"run_dir": str(tmp_path / trainer), **sections.pop("logging", {})},
        **sections,
    }
    if objective.startswith("distill"):
        return distill_config(tmp_path, precompute=objective == "distill-precomputed", **sections)
    records = KTO_RECORDS if objective.startswith("kto") else PAIRS
    return preference_config(tmp_path, OBJECTIVES[objective], records, **sections)


def llama_1b_shape():
    """The planner's shape of Llama-3.2-1B (tied embeddings), from its config."""
    from transformers import LlamaConfig

    from tigon.runtime.planner import ModelShape

    return ModelShape.from_hf_config(
        LlamaConfig(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=True,
        )
    )
