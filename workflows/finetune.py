"""The fine-tune workflow: validate, prepare data (packed once, cached), train (distributed), evaluate, export, report.

    pyflyte run workflows/finetune.py finetune                          # the demo, locally on the CPU
    pyflyte run workflows/finetune.py finetune --config my.yaml --steps 200
    tigon submit my.yaml --job-template h100x8x2 --nodes 4              # checked locally, then pyflyte run --remote
    pyflyte run --remote -i IMAGE workflows/finetune.py finetune --config_yaml "$(cat my.yaml)" --job_template h100x8 \
        --data_dir ./data                                               # relative data paths are in ./data

Locally, the train task runs 2 worker processes over gloo through torch elastic (the kfpytorch
`Elastic` config of the `cpu-small` job template). On a cluster the same task becomes a single
elastic pod (`nnodes: 1`) or a PyTorchJob (`nnodes > 1`), configured by the chosen job template.
The job templates travel with the run as data: the `job_templates` input defaults to the templates of
the machine that registers the workflow (`deploy/job-templates/` or $TIGON_JOB_TEMPLATES), and the train
task is rebuilt from the chosen one in every pod (`TrainTaskResolver`), so an edited template takes effect
without rebuilding the image. A restarted worker resumes from the run's latest checkpoint; on a cluster
checkpoints and the export are copied to the run's object-store prefix (`tigon.runtime.storage`).
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

import fsspec
import yaml
from flytekit import Cache, Deck, current_context, dynamic, task, workflow
from flytekit.configuration import SerializationSettings
from flytekit.core.base_task import Task, TaskResolverMixin
from flytekit.core.task import TaskPlugins
from flytekit.exceptions.user import FlyteRecoverableException, FlyteUserRuntimeException
from flytekit.types.directory import FlyteDirectory
from flytekitplugins.kfpytorch import Elastic
from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

from tigon.platform.faults import is_retryable, lost_worker
from tigon.platform.jobs import flyte_task_options, job_name
from tigon.platform.submit import check_submission, resolve_data_path
from tigon.platform.templates import JobTemplate, load_templates
from tigon.runtime.config import ConfigError, RunConfig, apply_override, load_config, parse_config, read_yaml
from tigon.runtime.data import is_hub_dataset
from tigon.runtime.files import atomic_write_text
from tigon.runtime.storage import default_remote_dir, is_local_url

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = str(REPO / "examples" / "demo.yaml")
TEMPLATES = load_templates()
#: the templates as data: the default of the workflow's `job_templates` input, fixed when the workflow is registered
SUBMITTED_TEMPLATES = json.dumps({name: t.model_dump(mode="json") for name, t in TEMPLATES.items()}, sort_keys=True)
# An enum, so `pyflyte run` rejects an unknown template before submitting and lists those that exist.
JobTemplateName = enum.Enum("JobTemplateName", {name.replace("-", "_"): name for name in TEMPLATES}, type=str)
LOCAL_TEMPLATE = JobTemplateName("cpu-small")


def resolve_config(config: str, steps: int, run_dir: str, config_yaml: str = "", data_root: str = "") -> RunConfig:
    """The config (a file, or its YAML text from `tigon submit`) with the command line's overrides applied.

    `data_root`: where relative data paths point (the uploaded `data_dir`: a URL on a cluster, a directory
    locally); without it they are relative to the config file, or to the current directory.
    """
    overrides = []
    if steps:
        overrides += [f"training.max_steps={steps}", "training.epochs=null"]
    if run_dir:
        overrides.append(f"logging.run_dir={run_dir}")
    if config_yaml:
        raw = read_yaml(config_yaml) or {}
        for override in overrides:
            apply_override(raw, override)
        loaded, config_dir = parse_config(raw, "--config_yaml"), Path.cwd()
    elif not Path(config).is_file():
        raise ConfigError(
            f"config file {config} does not exist here (a pod cannot read your machine's files): submit with "
            '`tigon submit CONFIG --job-template NAME`, or pass the config\'s text with --config_yaml "$(cat CONFIG)"'
        )
    else:
        loaded, config_dir = load_config(config, overrides), Path(config).resolve().parent
    root, from_cwd = (data_root, False) if data_root else (config_dir, True)
    data = loaded.data.model_copy(
        update={
            "train": resolve_data_path(loaded.data.train, root, from_cwd),
            "eval": resolve_data_path(loaded.data.eval, root, from_cwd) if loaded.data.eval else None,
        }
    )
    return loaded.model_copy(update={"data": data})


def data_root(data_dir: FlyteDirectory | None) -> str:
    """Where the uploaded `data_dir` input is: its object-store URL on a cluster, its local path otherwise."""
    if data_dir is None:
        return ""
    return data_dir.remote_source or str(data_dir.path)


def _data_bytes(path: str):
    """The contents of a data file, or of each file of a directory in name order (paths or fsspec URLs)."""
    fs, root = fsspec.core.url_to_fs(path)
    files = sorted(fs.find(root)) if fs.isdir(root) else [root]
    for file in files:
        yield fs.cat_file(file)


def data_fingerprint(config: RunConfig) -> str:
    """Content hash of the data files (a Hub dataset's name and revision), the tokenizer choice, the data options
    and a preference objective: the cache key. Pin data.revision for a Hub dataset, or a new upload may hit an old
    packing."""
    digest = hashlib.sha256()
    for path in filter(None, [config.data.train, config.data.eval]):
        if is_hub_dataset(path):  # named, not read here: its revision (data.revision) stands for its content
            digest.update(json.dumps([path, config.data.revision]).encode())
            continue
        for content in _data_bytes(path):
            digest.update(content)
    options = config.data.model_dump(mode="json", exclude={"train", "eval", "cache_dir"})
    digest.update(json.dumps([config.model.tokenizer, config.model.path, config.model.revision, options]).encode())
    if config.objective.preference:  # preference records are tokenized per objective (pairs, or KTO's completions)
        digest.update(config.objective.type.encode())
    return digest.hexdigest()


def parse_templates(job_templates: str) -> dict[str, JobTemplate]:
    """The `job_templates` input (JSON: name -> template) as checked templates."""
    try:
        raw = json.loads(job_templates)
        return {name: JobTemplate.model_validate(template) for name, template in raw.items()}
    except (ValueError, AttributeError) as error:
        raise ConfigError(
            f"the job_templates input is not a JSON object of job templates ({error}); leave it at its default, "
            "the templates of the machine that registered the workflow"
        ) from None


class Validated(NamedTuple):
    config_yaml: str
    fingerprint: str
    template: str


@task
def validate(
    config: str,
    config_yaml: str,
    steps: int,
    run_dir: str,
    job_template: JobTemplateName,
    nodes: int,
    job_templates: str,
    data_dir: FlyteDirectory | None = None,
) -> Validated:
    """Load and check the config against the job template before any training task starts; on a cluster,
    point checkpoints and the export at the run's object-store prefix. Returns the chosen template (JSON) too."""
    resolved = resolve_config(config, steps, run_dir, config_yaml, data_root(data_dir))
    templates = parse_templates(job_templates)
    if job_template.value not in templates:
        raise ConfigError(
            f"job template {job_template.value!r} is not in the job_templates input; it has {sorted(templates)}"
        )
    chosen = templates[job_template.value]
    check_submission(resolved, chosen, nodes)
    if resolved.checkpoint.remote_dir is None:
        remote = default_remote_dir(current_context().raw_output_prefix, job_name(resolved.name))
        resolved = resolved.model_copy(
            update={"checkpoint": resolved.checkpoint.model_copy(update={"remote_dir": remote})}
        )
    config_text = yaml.safe_dump(resolved.model_dump(mode="json"), sort_keys=False)
    return Validated(config_text, data_fingerprint(resolved), chosen.model_dump_json())


def _local_data(config: RunConfig, cache_dir: Path) -> RunConfig:
    """The config with data URLs (s3://, gs://) replaced by local copies of the files."""
    local = {}
    for name in ("train", "eval"):
        path = getattr(config.data, name)
        if path and not is_local_url(path):
            local[name] = fsspec.open_local(f"simplecache::{path}", simplecache={"cache_storage": str(cache_dir)})
    return config.model_copy(update={"data": config.data.model_copy(update=local)}) if local else config


@task(cache=Cache(version="2", ignored_inputs=("config_yaml",)))
def prepare_data(config_yaml: str, fingerprint: str) -> FlyteDirectory:
    """Tokenize and pack the data once per fingerprint (data content, tokenizer, data options): the packed
    arrays and a manifest with the fingerprint and the tokenizer's identity, which the train task loads."""
    from tigon.runtime.packed import pack, save_packed
    from tigon.runtime.tokenizer import load_tokenizer

    working = Path(current_context().working_directory)
    config = _local_data(parse_config(read_yaml(config_yaml)), working / "data")
    packed = pack(config, load_tokenizer(config.model), fingerprint)
    return FlyteDirectory(str(save_packed(packed, working / "packed")))


def train_worker(config_yaml: str, packed: FlyteDirectory) -> str:
    """One torch elastic worker: train on the packed data (resuming from the latest checkpoint)."""
    from tigon.runtime.trainer import train

    config = parse_config(read_yaml(config_yaml))
    try:
        result = train(config, datasets=packed.download())
    except Exception as error:
        if is_retryable(error):
            raise FlyteRecoverableException(
                f"lost a peer, a node or the network; a retry resumes from the latest checkpoint: {error}"
            ) from error
        raise
    outcome = dataclasses.asdict(result)
    loss_png = Path(result.run_dir) / "loss.png"
    outcome["loss_png"] = base64.b64encode(loss_png.read_bytes()).decode() if loss_png.is_file() else ""
    return json.dumps(outcome)


def train_task_name(template: JobTemplate, nodes: int = 0) -> str:
    """`train_<template>` at the template's own node count, `train_<template>_<N>nodes` otherwise."""
    base = f"train_{template.name.replace('-', '_')}"
    return base if nodes in (0, template.nnodes) else f"{base}_{nodes}nodes"


@dataclasses.dataclass
class TrainElastic(Elastic):
    """kfpytorch's Elastic config, run by TrainElasticTask."""


class TrainElasticTask(PytorchElasticFunctionTask):
    """kfpytorch's elastic task, with one more fault worth a Flyte retry: a worker ended by a signal (eviction,
    preemption, a lost node) once torch elastic's restarts are used up. Workers' own errors are judged in
    `train_worker`."""

    def execute(self, **kwargs):
        try:
            return super().execute(**kwargs)
        except FlyteUserRuntimeException as error:
            lost = lost_worker(error.value)
            if lost is None:
                raise
            raise FlyteRecoverableException(f"{lost}; a retry resumes from the latest checkpoint") from error


TaskPlugins.register_pythontask_plugin(TrainElastic, TrainElasticTask)


class TrainTaskResolver(TaskResolverMixin):
    """Finds a train task in its pod by rebuilding it from the job template it was compiled with, which its
    container arguments carry; the image's own copy of the templates plays no part."""

    @property
    def location(self) -> str:
        return f"{__name__}.TRAIN_TASK_RESOLVER"

    def name(self) -> str:
        return "tigon train task resolver"

    def load_task(self, loader_args: list[str]) -> Task:
        if len(loader_args) != 4 or loader_args[0] != "job-template" or loader_args[2] != "task-name":
            raise ValueError(f"a train task's loader arguments are job-template JSON task-name NAME; got {loader_args}")
        return _train_task(JobTemplate.model_validate_json(loader_args[1]), loader_args[3])

    def loader_args(self, settings: SerializationSettings, t: Task) -> list[str]:
        return ["job-template", _TEMPLATE_OF[t.name].model_dump_json(), "task-name", t.name.rsplit(".", 1)[-1]]

    def get_all_tasks(self) -> list[Task]:
        return []

    def task_name(self, t: Task) -> str:
        """`workflows.finetune.<train task name>`, wherever the task is built (in a dynamic step's pod too)."""
        return f"{__name__}.{t.task_function.__name__}"


TRAIN_TASK_RESOLVER = TrainTaskResolver()
_TEMPLATE_OF: dict[str, JobTemplate] = {}  # task name -> the template it was built from


def _train_task(template: JobTemplate, name: str, config: RunConfig | None = None):
    """A train task configured by one job template (with its node count applied), found in its pod through
    TRAIN_TASK_RESOLVER; with the run's config, its pods warm the kernels up for the run's model."""
    function = types.FunctionType(train_worker.__code__, train_worker.__globals__, name)
    function.__qualname__, function.__module__ = name, __name__
    function.__annotations__ = train_worker.__annotations__
    options = flyte_task_options(template, config)
    elastic = options["task_config"]
    options["task_config"] = TrainElastic(**{f.name: getattr(elastic, f.name) for f in dataclasses.fields(elastic)})
    train = task(**options)(function)
    # Built inside the dynamic step, flytekit would give the task the step's own resolver (which looks tasks up by
    # module attribute) and prefix its name with the module of the script that started Python: set both here.
    train.set_resolver(TRAIN_TASK_RESOLVER)
    train._instantiated_in = __name__
    _TEMPLATE_OF[train.name] = template
    return train


@dynamic
def train_with_template(config_yaml: str, packed: FlyteDirectory, template: str, nodes: int) -> str:
    """Run the train task built from the chosen job template (JSON, as validated) at the run's node count."""
    chosen = JobTemplate.model_validate_json(template)
    config = parse_config(read_yaml(config_yaml))
    train = _train_task(chosen.with_nodes(nodes), train_task_name(chosen, nodes), config)
    return train(config_yaml=config_yaml, packed=packed)


@task(enable_deck=True)
def report(config_yaml: str, outcome: str) -> FlyteDirectory:
    """A Deck with the loss curve, throughput, memory and the effective config; returns the model."""
    result = json.loads(outcome)
    image = ""
    if result["loss_png"]:
        image = f'<img src="data:image/png;base64,{result["loss_png"]}" width="640">'
    losses = result["losses"]
    manifest = result["data_manifest"] or {}
    rows = {
        "steps": len(losses),
        "loss": f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-",
        "evaluation": ", ".join(f"{k} {v:.4f}" for k, v in result["eval_metrics"].items()) or "-",
        "last step": ", ".join(f"{k} {v:.4f}" for k, v in (result.get("objective_metrics") or {}).items()) or "-",
        "tokens/s": f"{result['tokens_per_second']:.0f}",
        "peak memory": f"{result['peak_memory_bytes'] / 2**30:.2f} GiB",
        "resumed from step": result["resumed_from_step"] or "-",
        "data": manifest.get("summary", "-"),
        "data fingerprint": manifest.get("fingerprint", "-"),
    }
    table = "".join(f"<tr><th>{k}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows.items())
    training = f"<h2>Training</h2>{image}<table>{table}</table>"
    config_html = f"<h2>Config</h2><pre>{html.escape(config_yaml)}</pre>"
    Deck("Training", training)
    Deck("Config", config_html)
    exported = result["export_url"] or result["export_dir"]
    current_context().default_deck.append(f"Model exported to {exported}")
    page = f"<html><body>{training}{config_html}</body></html>"
    remote = parse_config(read_yaml(config_yaml)).checkpoint.remote_dir
    if remote:
        fs, root = fsspec.core.url_to_fs(remote)
        fs.pipe_file(f"{root.rstrip('/')}/report.html", page.encode())
    else:
        atomic_write_text(Path(result["run_dir"]) / "report.html", page)
    return FlyteDirectory(exported)


@workflow
def finetune(
    config: str = DEMO_CONFIG,
    steps: int = 0,
    job_template: JobTemplateName = LOCAL_TEMPLATE,
    run_dir: str = "",
    nodes: int = 0,
    config_yaml: str = "",
    data_dir: FlyteDirectory | None = None,
    job_templates: str = SUBMITTED_TEMPLATES,
) -> FlyteDirectory:
    """Fine-tune a model from a tigon config; returns the exported `save_pretrained` directory.

    `nodes`: the run's node count, up to the job template's max_nnodes (0: the template's own).
    `config_yaml`: the config's text instead of a file (what `tigon submit` sends to a cluster).
    `data_dir`: a directory the config's relative data paths are in; pyflyte uploads a local one with the run.
    `job_templates`: the job templates (JSON); its default, the registering machine's, is what runs use.
    """
    checked = validate(
        config=config,
        config_yaml=config_yaml,
        steps=steps,
        run_dir=run_dir,
        job_template=job_template,
        nodes=nodes,
        job_templates=job_templates,
        data_dir=data_dir,
    )
    packed = prepare_data(config_yaml=checked.config_yaml, fingerprint=checked.fingerprint)
    outcome = train_with_template(
        config_yaml=checked.config_yaml, packed=packed, template=checked.template, nodes=nodes
    )
    return report(config_yaml=checked.config_yaml, outcome=outcome)
