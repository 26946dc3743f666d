"""The training image: the Dockerfile passes hadolint, its pins agree with the lock file and with
pyproject.toml's requirements, and the entrypoint warms the kernels and then runs the command.
(No Docker engine here: the image itself is not built in these tests.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.docker import BIN, DOCKER, DOCKERFILE, dockerfile_args, lock_pins, tool
from tigon.platform import image as tigon_image

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def input_pins() -> dict[str, str]:
    pins = {}
    for line in (DOCKER / "requirements.in").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", f"requirements.in pins exactly: {line}"
            pins[canonicalize_name(requirement.name)] = specifier.version
    return pins


def pyproject_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + extras["runtime"] + extras["platform"] + extras["hf"]
    return [Requirement(r) for r in wanted if not r.startswith("tigon")]


def test_hadolint_passes():
    result = subprocess.run(
        [tool("hadolint"), "--config", str(DOCKER / ".hadolint.yaml"), str(DOCKERFILE)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_scripts_pass_shellcheck():
    scripts = [DOCKER / "entrypoint.sh", ROOT / "deploy" / "kind" / "quickstart.sh"]
    result = subprocess.run([tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(os.access(s, os.X_OK) for s in scripts)


def test_dockerfile_is_multi_stage_non_root_and_pinned():
    text = DOCKERFILE.read_text()
    args = {name: values[0] for name, values in dockerfile_args().items()}
    stages = re.findall(r"^FROM (\S+)(?: AS ([\w-]+))?", text, re.MULTILINE)
    assert [name for _, name in stages] == ["build-base-cuda", "build-base-cpu", "build", "runtime"]
    for image, name in stages:
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        if name == "build":  # the base stage of the variant
            assert resolved == f"build-base-{args['VARIANT']}" and image == "build-base-${VARIANT}"
            continue
        assert re.match(r"^[\w./-]+:[\w.-]+$", resolved) and not resolved.endswith(":latest"), resolved
    final = text[text.index("AS runtime") :]
    (user,) = re.findall(r"^USER (\S+)", final, re.MULTILINE)
    assert user.split(":")[0] not in ("0", "root")
    assert "COPY --from=build /opt/venv /opt/venv" in final
    assert re.search(r'^ENTRYPOINT \[.*"/usr/local/bin/tigon-entrypoint"\]', final, re.MULTILINE)
    assert "--require-hashes" in text and "TRITON_CACHE_DIR=/cache/triton" in final
    for name, values in dockerfile_args().items():
        assert len(set(values)) == 1, f"ARG {name} has different defaults in the two stages: {values}"


def test_flash_attn_compiles_for_the_named_gpus_without_a_prebuilt_download():
    """flash-attn's setup.py takes its GPU list from FLASH_ATTN_CUDA_ARCHS (TORCH_CUDA_ARCH_LIST does not reach its
    kernels) and first tries to download a prebuilt wheel unless FLASH_ATTENTION_FORCE_BUILD=TRUE."""
    from tigon.platform.image import training_image_spec

    text = DOCKERFILE.read_text().replace("\\\n", " ")
    (run,) = [line for line in text.splitlines() if line.startswith("RUN") and "flash-attn==" in line]
    (spec_command,) = [c for c in training_image_spec().commands if "flash-attn==" in c]
    archs = dockerfile_args()["FLASH_ATTN_CUDA_ARCHS"][0].strip('"')
    assert re.fullmatch(r"\d+(;\d+)*", archs), archs  # e.g. 90;100, flash-attn's format (no dots)
    for command in (run, spec_command):
        assert "FLASH_ATTN_CUDA_ARCHS=" in command and "FLASH_ATTENTION_FORCE_BUILD=TRUE" in command
        assert "--no-binary flash-attn" in command and "TORCH_CUDA_ARCH_LIST" not in command
    assert archs in spec_command


def test_cpu_variant_is_a_cpu_image():
    """VARIANT=cpu builds on plain Ubuntu with PyTorch's CPU wheel and the lock without CUDA packages, and skips
    flash-attn; the CUDA devel base is only the cuda variant's."""
    text = DOCKERFILE.read_text()
    args = {name: values[0] for name, values in dockerfile_args().items()}
    bases = dict((name, image) for image, name in re.findall(r"^FROM (\S+) AS ([\w-]+)", text, re.MULTILINE))
    assert bases["build-base-cpu"] == "ubuntu:${UBUNTU_VERSION}" and "cuda" not in bases["build-base-cpu"]
    assert bases["build-base-cuda"].startswith("nvidia/cuda:") and args["VARIANT"] == "cuda"
    assert args["TORCH_CPU_INDEX"] == "https://download.pytorch.org/whl/cpu"
    runs = [line for line in text.replace("\\\n", " ").splitlines() if line.startswith("RUN")]
    (install,) = [run for run in runs if "requirements-cpu.lock" in run]
    cpu_branch, cuda_branch = install.split("else", 1)
    assert 'if [ "${VARIANT}" = "cpu" ]' in cpu_branch and "--require-hashes" in cpu_branch
    assert '--index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}+cpu"' in cpu_branch
    assert "/tmp/requirements.lock" in cuda_branch and "torch.version.cuda is None" in cuda_branch
    (flash,) = [run for run in runs if "flash-attn==" in run]
    assert flash.startswith('RUN if [ "${VARIANT}" = "cuda" ]')
    assert "cpu" in tigon_image.VARIANTS and "docker/requirements-cpu.lock" in tigon_image.BUILD_INPUTS["cpu"]


def test_cpu_lock_is_the_lock_without_torch_and_cuda():
    assert tigon_image.main(["cpu-lock", "--check"]) == 0, "run python -m tigon.platform.image cpu-lock"
    cuda, cpu = (DOCKER / "requirements.lock").read_text(), tigon_image.CPU_LOCK.read_text()
    blocks = {re.split(r"[=\s]", b, maxsplit=1)[0]: b for b in re.split(r"\n(?=[a-z0-9])", cuda)[1:]}
    kept = {re.split(r"[=\s]", b, maxsplit=1)[0]: b for b in re.split(r"\n(?=[a-z0-9])", cpu)[1:]}
    dropped = set(blocks) - set(kept)
    assert "torch" in dropped and "nvidia-cudnn-cu13" in dropped and "cuda-bindings" in dropped
    assert all(name == "torch" or name.startswith(("nvidia-", "cuda-")) for name in dropped), dropped
    assert all(kept[name] == blocks[name] and "--hash=sha256:" in kept[name] for name in kept)
    assert {"triton", "sympy", "networkx", "transformers", "flytekit"} <= set(kept)  # CPU torch and tigon need them


def test_lock_is_complete_and_hashed():
    text = (DOCKER / "requirements.lock").read_text()
    pins = lock_pins()
    assert len(pins) > 100
    blocks = re.split(r"\n(?=[a-z0-9])", text.split("\n", 2)[2])
    assert all("--hash=sha256:" in block for block in blocks if "==" in block)
    assert "--python-version " + dockerfile_args()["PYTHON_VERSION"][0] in text
    assert all(lock_pins().get(name) == version for name, version in input_pins().items()), "regenerate the lock"


def test_pins_satisfy_pyproject():
    pins = lock_pins()
    for requirement in pyproject_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} (pyproject.toml) is not in docker/requirements.lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"the image pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )


def test_dockerfile_versions_match_the_lock():
    args = {name: values[0] for name, values in dockerfile_args().items()}
    pins = lock_pins()
    assert args["TORCH_VERSION"] == pins["torch"]
    assert args["TRITON_VERSION"] == pins["triton"]
    assert "flash-attn" not in pins and re.match(r"^\d+\.\d+\.\d+(\.post\d+)?$", args["FLASH_ATTN_VERSION"])
    cuda_major = args["CUDA_VERSION"].split(".")[0]
    assert pins.get(f"nvidia-cudnn-cu{cuda_major}") or pins.get("nvidia-cuda-runtime", "").startswith(cuda_major)


def run_entrypoint(env: dict[str, str], *command: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment["PATH"] = f"{BIN}{os.pathsep}{environment.get('PATH', '')}"
    environment.update(env)
    return subprocess.run(
        ["bash", str(DOCKER / "entrypoint.sh"), *command],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_entrypoint_warms_up_then_execs(tmp_path):
    result = run_entrypoint(
        {
            "TIGON_WARMUP": "1",
            "TIGON_WARMUP_ARGS": "--hidden 4096 --ops rms_norm,swiglu",
            "TRITON_CACHE_DIR": str(tmp_path),
        },
        "python",
        "-c",
        "print('command ran')",
    )
    assert result.returncode == 0, result.stderr
    assert "tigon kernel warm-up on cpu (interpreter)" in result.stdout
    assert result.stdout.rstrip().endswith("command ran")
    assert "kernel warm-up done in" in result.stderr


def test_entrypoint_skip_and_failure_modes():
    for off in ("0", ""):  # off unless a train pod asks for it
        skipped = run_entrypoint({"TIGON_WARMUP": off}, "echo", "ok")
        assert skipped.returncode == 0 and skipped.stdout == "ok\n" and "warm-up" not in skipped.stderr
    tolerant = run_entrypoint({"TIGON_WARMUP": "1", "TIGON_WARMUP_ARGS": "--hidden 63 --head-dim 15"}, "echo", "ok")
    assert tolerant.returncode == 0 and tolerant.stdout.endswith("ok\n")
    assert "head_dim must be even" in tolerant.stderr and "continuing" in tolerant.stderr
    strict = run_entrypoint(
        {"TIGON_WARMUP": "1", "TIGON_WARMUP_ARGS": "--hidden 63 --head-dim 15", "TIGON_WARMUP_STRICT": "1"}, "echo"
    )
    assert strict.returncode == 1 and "stopping" in strict.stderr
    nothing = run_entrypoint({"TIGON_WARMUP": "0"})
    assert nothing.returncode == 2 and "no command given" in nothing.stderr


def test_entrypoint_warms_up_for_the_runs_model_and_says_how_long(tmp_path):
    """The warm-up settings tigon gives a run's pods run through the entrypoint; it logs the family and the time."""
    from tigon.platform.jobs import warmup_env
    from tigon.runtime.config import load_config

    env = warmup_env(load_config(str(ROOT / "examples" / "demo.yaml")))
    env["TIGON_WARMUP_ARGS"] += " --ops rms_norm"  # one op keeps the interpreter run short
    result = run_entrypoint({**env, "TRITON_CACHE_DIR": str(tmp_path)}, "python", "-c", "print('command ran')")
    assert result.returncode == 0, result.stderr
    assert "tigon kernel warm-up on cpu (interpreter), family llama" in result.stdout
    assert re.search(r"kernel warm-up done in \d+ s", result.stderr) and result.stdout.endswith("command ran\n")
