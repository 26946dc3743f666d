"""The fine-tune workflow: prepare data, train (distributed), evaluate, export, report.

    pyflyte run workflows/finetune.py finetune                          # the demo, locally on the CPU
    pyflyte run workflows/finetune.py finetune --config my.yaml --steps 200
    pyflyte run --remote workflows/finetune.py finetune --config my.yaml --job_template h100x8

Locally, the train task runs 2 worker processes over gloo through torch elastic (the kfpytorch
`Elastic` config of the `cpu-small` job template). On a cluster the same task becomes a single
elastic pod (`nnodes: 1`) or a PyTorchJob (`nnodes > 1`), configured by the chosen job template
(`deploy/job-templates/`). A restarted worker resumes from the run's latest checkpoint.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import html
import json
import types
from pathlib import Path
from typing import NamedTuple

import yaml
from flytekit import Deck, current_context, dynamic, task, workflow
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.types.directory import FlyteDirectory

from tigon.platform.jobs import flyte_task_options
from tigon.platform.templates import load_templates
from tigon.runtime.checkpoint import atomic_write_text
from tigon.runtime.config import RunConfig, load_config, parse_config

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = str(REPO / "examples" / "demo.yaml")
TEMPLATES = load_templates()
# An enum, so `pyflyte run` rejects an unknown template before submitting and lists those that exist.
JobTemplateName = enum.Enum("JobTemplateName", {name.replace("-", "_"): name for name in TEMPLATES}, type=str)
LOCAL_TEMPLATE = JobTemplateName("cpu-small")


def resolve_config(config: str, steps: int, run_dir: str) -> RunConfig:
    """The config file with the command line's overrides applied; errors surface before any task runs."""
    overrides = []
    if steps:
        overrides += [f"training.max_steps={steps}", "training.epochs=null"]
    if run_dir:
        overrides.append(f"logging.run_dir={run_dir}")
    loaded = load_config(config, overrides)
    data_root = Path(config).resolve().parent
    data = loaded.data.model_copy(
        update={
            "train": _absolute(loaded.data.train, data_root),
            "eval": _absolute(loaded.data.eval, data_root) if loaded.data.eval else None,
        }
    )
    return loaded.model_copy(update={"data": data})


def _absolute(path: str, root: Path) -> str:
    """Relative data paths in a config are relative to the config file, wherever the task runs."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return str(candidate.resolve())
    return str((root / candidate).resolve())


def data_fingerprint(config: RunConfig) -> str:
    """Content hash of the data files, the tokenizer choice and the data options: the cache key."""
    digest = hashlib.sha256()
    for path in filter(None, [config.data.train, config.data.eval]):
        files = sorted(Path(path).rglob("*")) if Path(path).is_dir() else [Path(path)]
        for file in files:
            if file.is_file():
                digest.update(file.read_bytes())
    digest.update(json.dumps([config.model.tokenizer, config.model.path, config.data.model_dump()]).encode())
    return digest.hexdigest()


class Validated(NamedTuple):
    config_yaml: str
    fingerprint: str


@task
def validate(config: str, steps: int, run_dir: str) -> Validated:
    """Load and check the config (key paths, types, data paths) before any training task starts."""
    resolved = resolve_config(config, steps, run_dir)
    return Validated(yaml.safe_dump(resolved.model_dump(mode="json"), sort_keys=False), data_fingerprint(resolved))


@task(cache=True, cache_version="1")
def prepare_data(config_yaml: str, fingerprint: str) -> str:
    """Tokenize and pack the data once per content hash; returns the data summary (JSON)."""
    from tigon.runtime.data import build_datasets
    from tigon.runtime.tokenizer import load_tokenizer

    config = parse_config(yaml.safe_load(config_yaml))
    _, _, summary = build_datasets(config, load_tokenizer(config.model))
    return json.dumps({"fingerprint": fingerprint, "summary": str(summary)})


def train_worker(config_yaml: str, data_summary: str) -> str:
    """One torch elastic worker: train with the runtime (resuming from the latest checkpoint)."""
    from tigon.runtime.trainer import train

    config = parse_config(yaml.safe_load(config_yaml))
    try:
        result = train(config)
    except (RuntimeError, OSError) as error:
        if "NCCL" in str(error) or "connection" in str(error).lower():
            raise FlyteRecoverableException(
                f"lost a peer or the network; retry resumes from the checkpoint: {error}"
            ) from error
        raise
    return json.dumps({**dataclasses.asdict(result), "data": json.loads(data_summary)["summary"]})


def _train_task(template_name: str):
    """A train task configured by one job template, registered under its own module-level name."""
    name = f"train_{template_name.replace('-', '_')}"
    function = types.FunctionType(train_worker.__code__, train_worker.__globals__, name)
    function.__qualname__, function.__module__ = name, __name__
    function.__annotations__ = train_worker.__annotations__
    return name, task(**flyte_task_options(TEMPLATES[template_name]))(function)


TRAIN_TASKS = dict(_train_task(name) for name in TEMPLATES)
globals().update(TRAIN_TASKS)


@dynamic
def train_with_template(config_yaml: str, data_summary: str, job_template: JobTemplateName) -> str:
    """Run the train task of the chosen job template."""
    train_task = TRAIN_TASKS[f"train_{job_template.value.replace('-', '_')}"]
    return train_task(config_yaml=config_yaml, data_summary=data_summary)


@task(enable_deck=True)
def report(config_yaml: str, outcome: str) -> FlyteDirectory:
    """A Deck with the loss curve, throughput, memory and the effective config; returns the model."""
    result = json.loads(outcome)
    loss_png = Path(result["run_dir"]) / "loss.png"
    image = ""
    if loss_png.exists():
        image = f'<img src="data:image/png;base64,{base64.b64encode(loss_png.read_bytes()).decode()}" width="640">'
    losses = result["losses"]
    rows = {
        "steps": len(losses),
        "loss": f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-",
        "evaluation": ", ".join(f"{k} {v:.4f}" for k, v in result["eval_metrics"].items()) or "-",
        "tokens/s": f"{result['tokens_per_second']:.0f}",
        "peak memory": f"{result['peak_memory_bytes'] / 2**30:.2f} GiB",
        "resumed from step": result["resumed_from_step"] or "-",
        "data": result["data"],
    }
    table = "".join(f"<tr><th>{k}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows.items())
    training = f"<h2>Training</h2>{image}<table>{table}</table>"
    config_html = f"<h2>Config</h2><pre>{html.escape(config_yaml)}</pre>"
    Deck("Training", training)
    Deck("Config", config_html)
    current_context().default_deck.append(f"Model exported to {result['export_dir']}")
    atomic_write_text(Path(result["run_dir"]) / "report.html", f"<html><body>{training}{config_html}</body></html>")
    return FlyteDirectory(result["export_dir"])


@workflow
def finetune(
    config: str = DEMO_CONFIG,
    steps: int = 0,
    job_template: JobTemplateName = LOCAL_TEMPLATE,
    run_dir: str = "",
) -> FlyteDirectory:
    """Fine-tune a model from a tigon config; returns the exported `save_pretrained` directory."""
    checked = validate(config=config, steps=steps, run_dir=run_dir)
    summary = prepare_data(config_yaml=checked.config_yaml, fingerprint=checked.fingerprint)
    outcome = train_with_template(config_yaml=checked.config_yaml, data_summary=summary, job_template=job_template)
    return report(config_yaml=checked.config_yaml, outcome=outcome)
