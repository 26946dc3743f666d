"""Job templates where tigon is installed, not checked out: in the training image, on a pod.

deploy/job-templates is the source of truth; platform/job-templates is its copy, shipped as package data.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import tomllib

from tigon.platform.image import image_tag
from tigon.platform.templates import PACKAGED_TEMPLATES, REPO_TEMPLATES, TEMPLATES_ENV, load_templates, templates_dir

ROOT = Path(__file__).resolve().parents[2]
# What docker/Dockerfile copies of the repository before `pip install`.
IMAGE_SOURCES = ["pyproject.toml", "README.md", "kernels", "runtime", "platform"]


def test_packaged_copy_equals_deploy_job_templates():
    deployed = {path.name: path.read_bytes() for path in REPO_TEMPLATES.glob("*.yaml")}
    packaged = {path.name: path.read_bytes() for path in PACKAGED_TEMPLATES.glob("*.yaml")}
    differ = sorted(name for name in deployed.keys() | packaged.keys() if deployed.get(name) != packaged.get(name))
    assert deployed and not differ, (
        f"platform/job-templates differs from deploy/job-templates in {differ}: "
        "rm platform/job-templates/*.yaml && cp deploy/job-templates/*.yaml platform/job-templates/"
    )


def test_templates_dir_is_the_env_var_then_the_checkout(monkeypatch, tmp_path):
    monkeypatch.setenv(TEMPLATES_ENV, str(tmp_path))
    assert templates_dir() == tmp_path
    monkeypatch.delenv(TEMPLATES_ENV)
    assert templates_dir() == REPO_TEMPLATES == ROOT / "deploy" / "job-templates"


def test_an_installed_tigon_and_the_workflow_find_the_packaged_templates(tmp_path, monkeypatch):
    """Install tigon from what the image copies, then import the workflow as a pod does (its file alone, next to
    an installed tigon); `python -S` keeps this checkout's editable install out of the way."""
    source = tmp_path / "src"
    source.mkdir()
    for name in IMAGE_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, "--target", str(site), str(source)], check=True, capture_output=True, timeout=300)
    pod = tmp_path / "pod"
    pod.mkdir()
    shutil.copy(ROOT / "workflows" / "finetune.py", pod)
    code = (
        f"import sys; sys.path[:0] = [{str(pod)!r}, {str(site)!r}, {sysconfig.get_paths()['purelib']!r}]\n"
        "import finetune, tigon.platform.templates as t\n"
        "print(t.templates_dir()); print(sorted(finetune.TEMPLATES))\n"
        "template = finetune.TEMPLATES['h100x8x2'].with_nodes(4).model_dump_json()\n"
        "args = ['job-template', template, 'task-name', 'train_h100x8x2_4nodes']\n"
        "print(finetune.TRAIN_TASK_RESOLVER.load_task(args).task_config.nnodes == 4)"
    )
    monkeypatch.delenv(TEMPLATES_ENV, raising=False)
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=pod, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    directory, names, has_task = result.stdout.splitlines()[-3:]
    assert directory == str(site / "tigon" / "platform" / "job-templates")
    assert names == str(sorted(path.stem for path in REPO_TEMPLATES.glob("*.yaml")))
    assert has_task == "True"


def test_shipped_templates_name_this_releases_image():
    """Image tags carry tigon's version and its build inputs' digest (`<version>-<variant>-<digest>`): a release's
    templates name the image built from that release, never a moving tag."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for template in load_templates(REPO_TEMPLATES).values():
        tag = template.image.rsplit(":", 1)[-1]
        assert tag in (image_tag("cuda"), image_tag("cpu")) and tag.startswith(f"{version}-"), template.image


def test_multi_node_templates_say_they_use_tcp_and_tune_nccl_sockets():
    """No template requests RDMA devices, so a multi-node one says it runs NCCL over TCP sockets and sets NCCL's
    socket transport up for it (interface, threads x sockets within NCCL's limit of 64, InfiniBand off)."""
    multi = [t for t in load_templates(REPO_TEMPLATES).values() if t.max_nnodes > 1]
    assert multi
    for template in multi:
        assert "TCP" in template.description, template.name
        env = template.env
        assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert int(env["NCCL_SOCKET_NTHREADS"]) * int(env["NCCL_NSOCKS_PERTHREAD"]) <= 64
