"""Checks before a run goes to the cluster, and `tigon submit` (validate locally, then `pyflyte run --remote`).

    tigon submit my.yaml --job-template h100x8x2 --nodes 4 [--steps N] [--set key=value ...] [--dry-run]

The pyflyte command it runs sends the validated config as text (`--config_yaml`: the pods cannot read
the laptop's files) and the template's image as the default image (`--image`), so every task of the
workflow runs in it; a template's Kueue `queue` becomes an execution label (`--labels`), which Flyte puts on the
PyTorchJob it creates. Data files and `datasets` directories on the laptop are copied into one staging
directory, passed as the workflow's `--data_dir` (pyflyte uploads it to the object store), and the config
names them relative to it; s3:// and gs:// URLs, and absolute paths inside the image, are used as they are.

Everything that can be known on the laptop is checked there, before any container starts: the config
(unknown keys, wrong types, with the overrides applied), the job template (it must exist), the node
count (up to the template's `max_nnodes`), settings that need GPUs on a template without them, an image
whose tag can move (`latest`, no tag, a branch name: refused, since a restarted pod could pull other code), and
relative data paths that do not exist.
The workflow's validate task runs the same `check_submission` again, for runs started another way.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from tigon.platform.image import ImageError, check_pinned
from tigon.platform.jobs import KUEUE_QUEUE_LABEL
from tigon.platform.templates import JobTemplate, TemplateError, get_template
from tigon.runtime.config import ConfigError, RunConfig, load_config
from tigon.runtime.data import is_hub_dataset
from tigon.runtime.storage import is_local_url

WORKFLOW = Path(__file__).resolve().parents[1] / "workflows" / "finetune.py"
EXIT_ERROR = 2


class SubmissionError(ValueError):
    """A run that its job template cannot run; the message names the setting and the fix."""


def gpu_settings(config: RunConfig) -> list[str]:
    """The config's settings that only work on GPUs."""
    needs = []
    if config.parallelism.backend == "nccl":
        needs.append("parallelism.backend: nccl (use 'auto' or 'gloo' on CPUs)")
    if config.model.attn_implementation in ("flash_attention_2", "flex_attention"):
        needs.append(f"model.attn_implementation: {config.model.attn_implementation} (use 'auto' on CPUs)")
    return needs


def check_submission(config: RunConfig, template: JobTemplate, nodes: int = 0) -> JobTemplate:
    """The template as this run will use it (with its node count), or SubmissionError/TemplateError/ConfigError
    saying why not (settings that cannot run together fail here, not in the train pod)."""
    from tigon.runtime.run import check_config

    check_config(config)
    template = template.with_nodes(nodes or None)
    try:
        check_pinned(template.image)
    except ImageError as error:
        raise SubmissionError(f"job template {template.name!r}: {error}") from None
    check_fewer_nodes(config, template)
    needs = gpu_settings(config)
    if needs and not template.gpus_per_node:
        raise SubmissionError(
            f"job template {template.name!r} has no GPUs, but the config asks for them: {'; '.join(needs)}. "
            "Pick a GPU template (see `tigon templates`) or change those settings."
        )
    return template


def check_fewer_nodes(config: RunConfig, template: JobTemplate) -> None:
    """SubmissionError where a job that may go on with fewer nodes (the template's min_nnodes) could not resume
    there: its global batch must split over every node count it may run on, and DeepSpeed's partitions do not move."""
    fewest, nodes, per_node = template.fewest_nodes, template.nnodes, template.nproc_per_node
    if fewest == nodes:
        return
    if config.parallelism.strategy == "deepspeed":
        raise SubmissionError(
            f"job template {template.name!r} goes on with {fewest} of {nodes} nodes when nodes are lost, but "
            "DeepSpeed's ZeRO checkpoints load only on the number of processes that wrote them: train with "
            "parallelism.strategy fsdp, or pick a template without min_nnodes"
        )
    batch = config.training.global_batch(nodes * per_node)
    uneven = ", ".join(str(count) for count in range(fewest, nodes) if batch % (count * per_node))
    if uneven:
        raise SubmissionError(
            f"job template {template.name!r} goes on with {fewest} to {nodes} nodes of {per_node} processes, and the "
            f"run's global batch of {batch} sequences (micro_batch_size x gradient_accumulation_steps x "
            f"{nodes * per_node}) does not split evenly over {uneven} node(s); choose "
            "gradient_accumulation_steps so that every node count divides it"
        )


DATA_KEYS = ("train", "eval")


def resolve_data_path(path: str, root: str | Path, from_cwd: bool = False) -> str:
    """A config's data path: a relative one under `root` (a URL, or a directory wherever the code runs); URLs and
    absolute paths as they are. With `from_cwd` (`root` is the config file's directory), a relative path that
    exists from the current directory is taken from there, as configs are often written for the repository root."""
    if not is_local_url(path) or Path(path).is_absolute():
        return path
    if is_hub_dataset(path) and not (is_local_url(str(root)) and (Path(root) / path).exists()):
        return path  # a Hub dataset name (org/name); write ./dir for a directory under a remote root
    if not is_local_url(str(root)):
        return f"{str(root).rstrip('/')}/{path}"
    if from_cwd and Path(path).exists():
        return str(Path(path).resolve())
    return str((Path(root) / path).resolve())


def local_data(config: RunConfig, config_dir: Path) -> dict[str, Path]:
    """The config's data files and `datasets` directories on this machine (relative paths resolved as the workflow
    resolves them), which the pods cannot read: they are uploaded. A relative path that does not exist here is an
    error; an absolute one is taken to be in the image."""
    found, missing = {}, []
    for key in DATA_KEYS:
        path = getattr(config.data, key)
        if not path or not is_local_url(path) or "://" in path:
            continue
        location = Path(resolve_data_path(path, config_dir, from_cwd=True))
        if location.exists():
            found[key] = location
        elif not Path(path).is_absolute() and not is_hub_dataset(path):
            missing.append(f"data.{key}: {path}")
    if missing:
        raise SubmissionError(
            f"data not found on this machine: {'; '.join(missing)} (relative to {Path.cwd()} or to the config's "
            f"directory {config_dir}). Fix the path, or use s3:// or gs:// URLs, or absolute paths inside the "
            "training image."
        )
    return found


def stage_data(config: RunConfig, config_dir: Path, staging: Path) -> RunConfig:
    """Copy the run's local data into `staging` (`train/<name>`, `eval/<name>`) and point the config at those
    relative paths: `staging` becomes the workflow's `data_dir`, which pyflyte uploads to the object store."""
    moved = {}
    for key, source in local_data(config, config_dir).items():
        target = staging / key / source.name
        target.parent.mkdir(parents=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
        moved[key] = f"{key}/{source.name}"
    return config.model_copy(update={"data": config.data.model_copy(update=moved)})


def check_remote(config: RunConfig, config_dir: Path) -> None:
    """What a run on the cluster needs beyond `check_submission`: the workflow file here, data that exists."""
    if not WORKFLOW.is_file():
        raise SubmissionError(
            f"the workflow file {WORKFLOW} is missing: `tigon submit` runs from a tigon checkout "
            "(git clone, then pip install -e '.[platform]')"
        )
    local_data(config, config_dir)


def add_run_arguments(parser: argparse.ArgumentParser, config_help: str) -> None:
    """What `tigon submit` and `tigon render-job` both take: the run config, its job template and overrides."""
    parser.add_argument("config", help=config_help)
    parser.add_argument(
        "--job-template",
        "--job_template",  # pyflyte's spelling of the workflow input, accepted too
        required=True,
        help="job template name, e.g. h100x8 (see `tigon templates`)",
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def submit(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tigon submit", description="check a run locally, then start the Flyte workflow on the cluster"
    )
    add_run_arguments(parser, "YAML run config; local data files are uploaded with the run")
    parser.add_argument("--nodes", type=int, default=0, help="nodes for this run, up to the template's max_nnodes")
    parser.add_argument("--steps", type=int, default=0, help="training.max_steps for this run")
    parser.add_argument("--dry-run", action="store_true", help="check and print the pyflyte command; submit nothing")
    args, pyflyte_options = parser.parse_known_args(argv)
    if any(option in ("-i", "--image") or option.startswith("--image=") for option in pyflyte_options):
        print(
            "error: tigon submit runs every task in the job template's image; change `image` in the template "
            "(see `tigon templates`) instead of passing --image",
            file=sys.stderr,
        )
        return EXIT_ERROR
    overrides = list(args.overrides)
    if args.steps:
        overrides += [f"training.max_steps={args.steps}", "training.epochs=null"]
    try:
        config = load_config(args.config, overrides)
        template = check_submission(config, get_template(args.job_template), args.nodes)
        config_dir = Path(args.config).resolve().parent
        check_remote(config, config_dir)
    except (ConfigError, TemplateError, SubmissionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    staging = Path(tempfile.mkdtemp(prefix="tigon-data-"))
    config = stage_data(config, config_dir, staging)
    data_options = ["--data_dir", str(staging)] if any(staging.iterdir()) else []
    command = [
        sys.executable,
        "-m",
        "flytekit.clis.sdk_in_container.pyflyte",
        "run",
        "--remote",
        # validate, prepare_data and report run in the default image: the template's, as the train task does
        "--image",
        template.image,
        # Flyte labels every object of the execution with these, the train task's PyTorchJob included (Kueue)
        *(["--labels", f"{KUEUE_QUEUE_LABEL}={template.queue}"] if template.queue else []),
        *pyflyte_options,
        str(WORKFLOW),
        "finetune",
        "--config_yaml",
        yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False),
        "--job_template",
        template.name,
        "--nodes",
        str(template.nnodes),
        *data_options,
    ]
    if args.dry_run:
        print(shlex.join(command))
        if data_options:
            print(f"(the run's data is staged in {staging} for this command; remove it when done)", file=sys.stderr)
        else:
            shutil.rmtree(staging)
        return 0
    try:
        return subprocess.run(command, check=False).returncode  # pyflyte uploads data_dir before it returns
    finally:
        shutil.rmtree(staging)
