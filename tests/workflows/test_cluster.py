"""What a cluster gets, checked without one: the workflow serialized by flytekit with the image and inputs that
`tigon submit` sends, the train task the dynamic step compiles for each job template and node count, the
documented pyflyte commands, and how the train task's failures reach Flyte's retries."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import yaml

pytest.importorskip("flytekit")

import torch.distributed as dist  # noqa: E402
from flytekit import LaunchPlan as FlyteLaunchPlan  # noqa: E402
from flytekit import dynamic  # noqa: E402
from flytekit.configuration import ImageConfig, SerializationSettings  # noqa: E402
from flytekit.core.context_manager import ExecutionState, FlyteContextManager  # noqa: E402
from flytekit.core.type_engine import TypeEngine  # noqa: E402
from flytekit.exceptions.user import FlyteRecoverableException  # noqa: E402
from flytekit.models.launch_plan import LaunchPlan  # noqa: E402
from flytekit.models.task import TaskSpec  # noqa: E402
from flytekit.tools.translator import get_serializable  # noqa: E402
from flytekit.types.directory import FlyteDirectory  # noqa: E402

from tests.deploy.pod_security import restricted_violations  # noqa: E402
from tigon.platform.cli import main  # noqa: E402
from tigon.platform.jobs import warmup_env  # noqa: E402
from tigon.platform.templates import REPO_TEMPLATES, JobTemplate, load_templates  # noqa: E402
from tigon.runtime.config import ConfigError, apply_override, parse_config  # noqa: E402
from tigon.runtime.data import DataError  # noqa: E402
from workflows import finetune as wf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "examples" / "demo.yaml")
ON_OBJECT_STORE = ["--set", "data.train=s3://tigon-data/train.jsonl", "--set", "data.eval=s3://tigon-data/eval.jsonl"]
NODE_COUNTS = sorted({(name, n) for name, t in wf.TEMPLATES.items() for n in (t.nnodes, t.max_nnodes)})


def submitted(template: str, nodes: int = 0) -> tuple[SerializationSettings, dict[str, str]]:
    """What `tigon submit --dry-run` would run: the serialization settings pyflyte makes of its `--image`, and the
    workflow inputs it passes."""
    out = io.StringIO()
    argv = ["submit", DEMO, "--job-template", template, "--nodes", str(nodes), *ON_OBJECT_STORE, "--dry-run"]
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    command = shlex.split(out.getvalue())
    image = command[command.index("--image") + 1]
    image_config = ImageConfig.validate_image(None, "image", (image,))  # pyflyte run's own --image callback
    settings = SerializationSettings(image_config=image_config, project="ml", domain="development", version="v1")
    options = command[command.index("finetune") + 1 :]
    return settings, {key.removeprefix("--"): value for key, value in zip(options[::2], options[1::2], strict=True)}


@pytest.mark.parametrize("template", sorted(wf.TEMPLATES))
def test_submitted_workflow_serializes_with_every_task_in_the_templates_image(template):
    settings, _ = submitted(template)
    entities = OrderedDict()
    get_serializable(entities, settings, wf.finetune)
    (workflow,) = [spec for entity, spec in entities.items() if entity is wf.finetune]
    nodes = {node.id: node for node in workflow.template.nodes}
    assert {i: n.task_node.reference_id.name.rsplit(".", 1)[-1] for i, n in nodes.items()} == {
        "n0": "validate",
        "n1": "prepare_data",
        "n2": "train_with_template",
        "n3": "report",
    }
    assert [sorted(nodes[i].upstream_node_ids) for i in ("n0", "n1", "n2", "n3")] == [
        [],
        ["n0"],
        ["n0", "n1"],
        ["n0", "n2"],
    ]
    tasks = [spec.template for spec in entities.values() if isinstance(spec, TaskSpec)]
    assert len(tasks) == 4
    # no kernel warm-up in the tasks that run no kernels (the image's entrypoint warms up only on TIGON_WARMUP=1)
    assert all("TIGON_WARMUP" not in (t.container.env or {}) for t in tasks)
    assert {t.id.name.rsplit(".", 1)[-1]: t.container.image for t in tasks} == dict.fromkeys(
        ["validate", "prepare_data", "train_with_template", "report"], wf.TEMPLATES[template].image
    )


def compile_train_step(settings: SerializationSettings, inputs: dict[str, str]):
    """The dynamic train step as its pod compiles it: the node and the train task it hands to Flyte."""
    ctx = FlyteContextManager.current_context().with_serialization_settings(settings)
    with FlyteContextManager.with_context(ctx) as ctx:
        state = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
        with FlyteContextManager.with_context(ctx.with_execution_state(state)) as ctx:
            # the template validate hands on: the chosen one of the run's job_templates input
            chosen = wf.parse_templates(inputs.get("job_templates", wf.SUBMITTED_TEMPLATES))[inputs["job_template"]]
            values = {
                "config_yaml": inputs["config_yaml"],
                "packed": FlyteDirectory("s3://tigon-data/packed"),
                "template": chosen.model_dump_json(),
                "nodes": int(inputs["nodes"]),
            }
            hints = {"config_yaml": str, "packed": FlyteDirectory, "template": str, "nodes": int}
            literals = TypeEngine.dict_to_literal_map(ctx, values, type_hints=hints)
            # flytekit compiles a dynamic's body once per task object (a pod runs one step), so each case takes
            # a fresh task of the same function
            return dynamic(wf.train_with_template.task_function).dispatch_execute(ctx, literals)


@pytest.mark.parametrize("template, nodes", NODE_COUNTS)
def test_train_step_compiles_the_templates_train_task(template, nodes):
    settings, inputs = submitted(template, nodes)
    job = compile_train_step(settings, inputs)
    expected = wf.TEMPLATES[template].with_nodes(nodes)
    (node,) = job.nodes
    (task,) = job.tasks
    assert node.task_node.reference_id == task.id
    assert task.id.name == f"workflows.finetune.{wf.train_task_name(wf.TEMPLATES[template], nodes)}"
    if expected.nnodes == 1:  # a single elastic pod: torch elastic runs inside it, no PyTorchJob
        assert task.type == "python-task" and task.custom is None
    else:  # a PyTorchJob of nnodes workers with an elastic policy
        assert task.type == "pytorch"
        assert task.custom == {
            "workerReplicas": {"replicas": expected.nnodes},
            "elasticConfig": {
                "rdzvBackend": "c10d",
                "minReplicas": expected.nnodes,
                "maxReplicas": expected.nnodes,
                "nprocPerNode": expected.nproc_per_node,
                "maxRestarts": expected.max_restarts,
            },
        }
    pod = task.k8s_pod.pod_spec
    (container,) = pod["containers"]
    assert container["image"] == expected.image
    gpus = {"gpu": str(expected.gpus_per_node)} if expected.gpus_per_node else {}
    amounts = {"cpu": expected.cpu, "memory": expected.memory, **gpus}
    assert container["resources"] == {"requests": amounts, "limits": amounts}
    env = container.get("env", [])
    run_warmup = warmup_env(parse_config(yaml.safe_load(inputs["config_yaml"])))  # the demo model's sizes
    assert set(run_warmup) == {"TIGON_WARMUP", "TIGON_WARMUP_ARGS"}
    assert {e["name"]: e["value"] for e in env if "value" in e} == {**run_warmup, **expected.env}
    from_secrets = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in env if "valueFrom" in e}
    assert from_secrets == {name: ref.secret for name, ref in expected.secret_env.items()}
    assert pod.get("tolerations", []) == [t.model_dump(exclude_none=True) for t in expected.tolerations]
    assert pod.get("nodeSelector", {}) == expected.node_selector
    assert pod.get("priorityClassName") == expected.priority_class
    assert pod["serviceAccountName"] == expected.service_account
    resources = task.extended_resources
    assert resources.shared_memory.size_limit == expected.shared_memory  # Flyte mounts it at /dev/shm
    assert restricted_violations(pod) == []  # Pod Security "restricted", which the training namespaces enforce
    assert resources.shared_memory.mount_path == "/dev/shm"
    # the GPU type as Flyte's accelerator (a node selector on the cluster); CPU templates name none
    assert (resources.gpu_accelerator.device if resources.HasField("gpu_accelerator") else None) == expected.gpu_type
    assert task.metadata.retries.retries == expected.max_restarts  # Flyte retries of recoverable faults


def test_image_pull_secrets_reach_the_train_tasks_pod():
    template = wf.TEMPLATES["h100x8"].model_copy(update={"image_pull_secrets": ["ghcr-pull", "ecr-pull"]})
    train = wf._train_task(template, "train_with_pull_secrets")
    settings, _ = submitted("h100x8")
    pod = get_serializable(OrderedDict(), settings, train).template.k8s_pod.pod_spec
    assert pod["imagePullSecrets"] == [{"name": "ghcr-pull"}, {"name": "ecr-pull"}]
    shipped = get_serializable(OrderedDict(), settings, wf._train_task(wf.TEMPLATES["h100x8"], "train_h100x8")).template
    assert "imagePullSecrets" not in shipped.k8s_pod.pod_spec  # the shipped templates name none


def test_train_task_names_by_node_count():
    multi = wf.TEMPLATES["h100x8x2"]
    assert wf.train_task_name(multi) == wf.train_task_name(multi, 2) == "train_h100x8x2"
    assert wf.train_task_name(multi, 4) == "train_h100x8x2_4nodes"


def test_registered_workflow_carries_the_registering_machines_templates():
    """The job_templates input's default is fixed when the workflow is serialized: the templates of the machine
    that registers it (its launch plan's default), not those of the image the pods run."""
    settings, _ = submitted("h100x8")
    plan = get_serializable(OrderedDict(), settings, FlyteLaunchPlan.get_or_create(wf.finetune))
    assert isinstance(plan, LaunchPlan)
    default = plan.spec.default_inputs.parameters["job_templates"].default.scalar.primitive.string_value
    assert wf.parse_templates(default) == load_templates() == wf.TEMPLATES


def test_an_edited_template_reaches_the_task_that_runs(tmp_path):
    """A platform engineer's edit (GPUs per node, a toleration, a node selector, an env var, the image) is in the
    train task the dynamic step compiles and in the task its pod rebuilds, with no image rebuild."""
    edited_dir = tmp_path / "job-templates"
    edited_dir.mkdir()
    for path in REPO_TEMPLATES.glob("*.yaml"):
        raw = yaml.safe_load(path.read_text())
        if raw["name"] == "h100x8":
            raw.update(gpus_per_node=4, nproc_per_node=4, image="registry.example.com/tigon:0.1.0-cuda-edited")
            raw["tolerations"].append({"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"})
            raw["node_selector"] = {"pool": "h100-spot"}
            raw["env"]["NCCL_DEBUG"] = "INFO"
        (edited_dir / path.name).write_text(yaml.safe_dump(raw))
    edited = load_templates(edited_dir)
    job_templates = json.dumps({name: t.model_dump(mode="json") for name, t in edited.items()})
    settings, inputs = submitted("h100x8")
    validated = wf.validate(
        config=DEMO,
        config_yaml="",
        steps=0,
        run_dir="",
        job_template=wf.JobTemplateName("h100x8"),
        nodes=0,
        job_templates=job_templates,
    )
    assert JobTemplate.model_validate_json(validated.template) == edited["h100x8"]
    job = compile_train_step(settings, {**inputs, "job_templates": job_templates})
    (task,) = job.tasks
    pod = task.k8s_pod.pod_spec
    (container,) = pod["containers"]
    assert container["image"] == "registry.example.com/tigon:0.1.0-cuda-edited"
    assert container["resources"]["limits"]["gpu"] == "4"
    assert {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"pool": "h100-spot"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NCCL_DEBUG"] == "INFO"
    # the dynamic step read the model's sizes from the run's config: the pod's warm-up compiles for that model
    run_warmup = warmup_env(parse_config(yaml.safe_load(inputs["config_yaml"])))
    assert env["TIGON_WARMUP_ARGS"] == run_warmup["TIGON_WARMUP_ARGS"] and "--hidden " in env["TIGON_WARMUP_ARGS"]
    # the pod runs `pyflyte-execute ... --resolver <location> -- <loader args>`: it rebuilds the edited task
    args = container["args"]
    assert args[args.index("--resolver") + 1] == wf.TRAIN_TASK_RESOLVER.location
    rebuilt = wf.TRAIN_TASK_RESOLVER.load_task(args[args.index("--") + 1 :])
    assert rebuilt.task_config.nproc_per_node == 4 and rebuilt.name == task.id.name


def help_options(*args: str) -> set[str]:
    """The option names pyflyte's own help lists."""
    command = [sys.executable, "-m", "flytekit.clis.sdk_in_container.pyflyte", "run", *args, "--help"]
    env = {**os.environ, "COLUMNS": "200"}  # one option a line, unwrapped
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", result.stdout))


def documented_pyflyte_commands() -> list[str]:
    """Each `pyflyte run ...` in docs/platform.md and the README: code lines and inline code, comments cut off."""
    commands = []
    for doc in (ROOT / "docs" / "platform.md", ROOT / "README.md"):
        text = doc.read_text()
        blocks = re.findall(r"```\w*\n(.*?)```", text, flags=re.S)
        pieces = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
        pieces += re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " "))
        commands += [p[p.index("pyflyte run") :].split("#")[0] for p in pieces if "pyflyte run" in p]
    return commands


def test_documented_pyflyte_commands_use_the_option_names_pyflyte_accepts():
    """The workflow's inputs keep their underscores as pyflyte options (`--job_template`, never `--job-template`)."""
    workflow = help_options("workflows/finetune.py", "finetune")
    assert {"--config", "--steps", "--job_template", "--run_dir", "--nodes", "--config_yaml"} <= workflow
    accepted = workflow | help_options()
    commands = documented_pyflyte_commands()
    remote_runs = [c for c in commands if "--remote" in c and "--job_template" in c]
    assert remote_runs and all("--image " in c for c in remote_runs), remote_runs  # the template's image
    unknown = {c: sorted(set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", c)) - accepted) for c in commands}
    assert {c: u for c, u in unknown.items() if u} == {}
    _, inputs = submitted("h100x8")  # and what `tigon submit` passes
    assert {f"--{name}" for name in inputs} <= workflow


def test_a_config_file_the_task_cannot_read_says_how_to_send_it():
    with pytest.raises(ConfigError, match="does not exist here") as error:
        wf.resolve_config("/home/me/my.yaml", 0, "")
    assert "tigon submit CONFIG --job-template NAME" in str(error.value) and "--config_yaml" in str(error.value)


def test_submitted_data_dir_is_where_the_configs_data_is(monkeypatch):
    """`tigon submit` on the demo as it is: its data files go in the `data_dir` input, and the validate task reads
    the config's relative paths there. The copy hashes like the original, so the packed data's cache still hits."""
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["submit", DEMO, "--job-template", "cpu-small", "--steps", "2", "--dry-run"]) == 0
    command = shlex.split(out.getvalue())
    staged = command[command.index("--data_dir") + 1]
    try:
        checked = wf.validate(
            config="",
            config_yaml=command[command.index("--config_yaml") + 1],
            steps=0,
            run_dir="",
            job_template=wf.LOCAL_TEMPLATE,
            nodes=0,
            job_templates=wf.SUBMITTED_TEMPLATES,
            data_dir=FlyteDirectory(staged),
        )
        data = yaml.safe_load(checked.config_yaml)["data"]
        assert data["train"] == str(Path(staged, "train", "arithmetic-train.jsonl"))
        assert data["eval"] == str(Path(staged, "eval", "arithmetic-eval.jsonl"))
        assert checked.fingerprint == wf.data_fingerprint(wf.resolve_config(DEMO, 2, ""))
    finally:
        shutil.rmtree(staged)
    on_cluster = wf.resolve_config(DEMO, 2, "", data_root="s3://runs/abc/data")  # an uploaded data_dir's URL
    assert on_cluster.data.train == "s3://runs/abc/data/examples/data/arithmetic-train.jsonl"


def demo_config_yaml(*overrides: str) -> str:
    raw = yaml.safe_load(Path(DEMO).read_text())
    raw["data"].update(train=str(ROOT / raw["data"]["train"]), eval=str(ROOT / raw["data"]["eval"]))
    for override in overrides:
        apply_override(raw, override)
    return yaml.safe_dump(raw)


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_train_worker_raises_a_network_fault_as_recoverable(tmp_path, monkeypatch, single_process):
    """Rank 0 of 2 cannot serve the rendezvous store: its port is taken. A real DistNetworkError becomes
    FlyteRecoverableException, so Flyte retries the task (and the retry resumes from the latest checkpoint)."""
    with socket.socket(socket.AF_INET6) as taken:
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 and IPv6, as the store listens
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(FlyteRecoverableException, match="a retry resumes from the latest checkpoint") as error:
            wf.train_worker(demo_config_yaml(), FlyteDirectory(str(tmp_path)))
    assert isinstance(error.value.__cause__, dist.DistNetworkError)
    assert "EADDRINUSE" in str(error.value.__cause__)


@pytest.mark.parametrize(
    "overrides, raised, message",
    [
        (["training.precision=fp16", "model.dtype=float16"], ConfigError, "precision fp16 with model.dtype float16"),
        ([], DataError, "has no manifest.json"),
    ],
)
def test_train_worker_lets_the_runs_own_errors_through(tmp_path, single_process, overrides, raised, message):
    """A config error (fp16 training of fp16 weights) or a data error (packed data without its manifest) is raised
    as it is: Flyte does not retry it, since a retry would fail the same way."""
    with pytest.raises(raised, match=message) as error:
        wf.train_worker(demo_config_yaml(*overrides), FlyteDirectory(str(tmp_path)))
    assert not isinstance(error.value, FlyteRecoverableException)
