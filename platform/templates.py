"""Job templates: the YAML files platform engineers edit to say what a training job gets.

A template fixes the image, nodes and processes, GPUs, CPU and memory, shared memory, node
selectors, tolerations and environment (plain values, and values from Kubernetes Secrets such as
the Hugging Face token). Users pick one by name; the platform maps it to Flyte
task settings (`tigon.platform.jobs`) or to a PyTorchJob manifest.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tigon.runtime.config import format_errors

TEMPLATES_ENV = "TIGON_JOB_TEMPLATES"
#: the source of truth, in a checkout
REPO_TEMPLATES = Path(__file__).resolve().parents[1] / "deploy" / "job-templates"
#: its copy, installed with tigon (package data of tigon.platform): what an installed tigon, e.g. in a pod, reads
PACKAGED_TEMPLATES = Path(__file__).resolve().parent / "job-templates"


class Toleration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str
    operator: str = "Exists"
    value: str | None = None
    effect: str | None = None


class SecretRef(BaseModel):
    """An environment variable read from a key of a Kubernetes Secret (e.g. HF_TOKEN from `hf-token`)."""

    model_config = ConfigDict(extra="forbid")

    secret: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", description="the Secret's name")
    key: str = Field(description="the key inside the Secret")
    optional: bool = Field(True, description="start the pod when the Secret is absent (the variable is then unset)")


class JobTemplate(BaseModel):
    """What one named kind of training job gets on the cluster."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    description: str = ""
    image: str
    nnodes: int = Field(1, gt=0)
    nproc_per_node: int = Field(1, gt=0)
    max_nnodes: int = Field(1, gt=0, description="the most nodes a run may ask for with this template")
    min_nnodes: int | None = Field(
        None,
        gt=0,
        description="the fewest nodes a multi-node job goes on with: a node lost for good leaves the job on the "
        "nodes left (torch elastic re-forms the group, at least this many) and the run resumes from its newest "
        "checkpoint with its global batch kept; unset: every node of nnodes",
    )
    gpus_per_node: int = Field(0, ge=0)
    gpu_type: str | None = None
    cpu: str = "2"
    memory: str = "4Gi"
    shared_memory: str | None = "1Gi"
    max_restarts: int = Field(0, ge=0)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    priority_class: str | None = None
    queue: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Kueue LocalQueue of the template's PyTorchJobs (label kueue.x-k8s.io/queue-name): admitted "
        "whole, all pods at once, when the queue's quota holds them; unset: Kueue's LocalQueue named default in the "
        "namespace takes the job, if there is one",
    )
    service_account: str | None = "tigon-trainer"
    image_pull_secrets: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: dict[str, SecretRef] = Field(
        default_factory=dict, description="environment variables from Secrets, e.g. HF_TOKEN for gated models"
    )

    @model_validator(mode="after")
    def _consistent(self) -> JobTemplate:
        if self.nnodes > self.max_nnodes:
            raise ValueError(f"nnodes {self.nnodes} is above max_nnodes {self.max_nnodes}")
        if self.min_nnodes is not None and self.min_nnodes > self.max_nnodes:
            raise ValueError(f"min_nnodes {self.min_nnodes} is above max_nnodes {self.max_nnodes}")
        if self.gpus_per_node and self.nproc_per_node != self.gpus_per_node:
            raise ValueError(f"nproc_per_node {self.nproc_per_node} must equal gpus_per_node {self.gpus_per_node}")
        if self.gpu_type and not self.gpus_per_node:
            raise ValueError(f"gpu_type {self.gpu_type!r} needs gpus_per_node above 0; set both or neither")
        return self

    @property
    def fewest_nodes(self) -> int:
        """The fewest nodes the job trains on: min_nnodes, up to nnodes (a run that asks for fewer nodes)."""
        return min(self.min_nnodes or self.nnodes, self.nnodes)

    @property
    def elastic_nodes(self) -> int | str:
        """torch elastic's node count: `nnodes`, or `fewest:nnodes` for a job that goes on with fewer."""
        return self.nnodes if self.fewest_nodes == self.nnodes else f"{self.fewest_nodes}:{self.nnodes}"

    def with_nodes(self, nnodes: int | None) -> JobTemplate:
        """This template with a run's own node count, checked against the template's limit."""
        if not nnodes or nnodes == self.nnodes:
            return self
        if nnodes > self.max_nnodes:
            raise TemplateError(
                f"job template {self.name!r} allows at most {self.max_nnodes} node(s); {nnodes} were requested. "
                "Pick a larger template (see `tigon templates`) or fewer nodes."
            )
        return self.model_copy(update={"nnodes": nnodes})


class TemplateError(ValueError):
    """An unknown template, a malformed template file, or a request beyond a template's limits."""


def templates_dir() -> Path:
    """$TIGON_JOB_TEMPLATES if set, else the checkout's deploy/job-templates, else the copy installed with tigon."""
    if os.environ.get(TEMPLATES_ENV):
        return Path(os.environ[TEMPLATES_ENV])
    return REPO_TEMPLATES if REPO_TEMPLATES.is_dir() else PACKAGED_TEMPLATES


def load_templates(directory: Path | None = None) -> dict[str, JobTemplate]:
    """Every `*.yaml` template in the directory, by name; a malformed file names its key paths."""
    directory = Path(directory or templates_dir())
    if not directory.is_dir():
        raise TemplateError(f"job template directory {directory} does not exist; set {TEMPLATES_ENV}")
    templates = {}
    for path in sorted(directory.glob("*.yaml")):
        try:
            template = JobTemplate.model_validate(yaml.safe_load(path.read_text()) or {})
        except ValidationError as error:
            raise TemplateError(format_errors(error, str(path), JobTemplate, "job template")) from None
        if template.name != path.stem:
            raise TemplateError(f"{path}: name {template.name!r} must match the file name {path.stem!r}")
        templates[template.name] = template
    return templates


def get_template(name: str, directory: Path | None = None) -> JobTemplate:
    templates = load_templates(directory)
    if name not in templates:
        listing = "\n".join(f"  {t.name:12s} {t.description}" for t in templates.values())
        raise TemplateError(f"unknown job template {name!r}; these exist:\n{listing}")
    return templates[name]
