"""Processes the runtime tests start: the environment of one run from the repository (`process_env`), and torchrun
worker groups that train run configs (gloo on the CPU, NCCL on GPUs) and record each rank's losses (`launch`), and
what a run leaves to compare: the logits of its export (`exported_logits`, `capture_before_export`), its logged
steps (`logged_steps`) and TensorBoard tags (`tensorboard_tags`), and values within a tolerance (`assert_close`);
and elastic jobs of two nodes that lose one (`train_losing_a_node`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
import yaml

from tigon.platform.jobs import ELASTIC_ENV
from tigon.runtime import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
LOGITS_TOLERANCE = 1e-3
RELATIVE_TOLERANCE = 1e-4  # per-step losses of two runs that differ only in how the work is split
IDS = torch.tensor([[1, 20, 21, 14, 22, 30, 25, 17]])

WORKER = """
import json, os, sys, time
started = time.perf_counter()
import torch.distributed as dist
from tigon.runtime.config import load_config
from tigon.runtime.trainer import train

backend = os.environ["TEST_BACKEND"]
if backend == "nccl":
    import torch
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(backend)  # once for all runs; each run ends at a barrier, the group stays
out = sys.argv[1]
print(f"imports {time.perf_counter() - started:.1f} s", flush=True)
for path in sys.argv[2:]:
    started = time.perf_counter()
    result = train(load_config(path))
    print(f"{path}: {time.perf_counter() - started:.1f} s", flush=True)
    name = os.path.basename(path).removesuffix(".yaml")
    record = {"losses": result.losses, "world_size": result.world_size, "resumed_from": result.resumed_from_step,
              "export_dir": result.export_dir, "eval": result.eval_metrics}
    with open(f"{out}/{name}-rank{dist.get_rank()}.json", "w") as file:
        json.dump(record, file)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # every record is written: skip interpreter teardown, where gloo's threads can abort a loaded machine
"""


def python_path() -> str:
    """The repository first, then the caller's PYTHONPATH (where a GPU machine keeps tigon and carried wheels)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def torchrun(ranks: int) -> list[str]:
    """The command that starts `ranks` local processes under torch elastic (what follows it: the script or -m)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]


def process_env(**variables: str) -> dict[str, str]:
    """The environment of a process started from the repository: tigon importable (`python_path`), Triton's
    interpreter off (CPU tensors take the reference path; the interpreter would be slow), and `variables`."""
    env = {**os.environ, "PYTHONPATH": python_path(), **variables}
    env.pop("TRITON_INTERPRET", None)
    return env


def script_env(out: Path, **variables: str) -> dict[str, str]:
    """The environment of a benchmark script run from the tests: this interpreter's `python3` first on PATH,
    results under `out` (OUT), Triton's interpreter off, and `variables`."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "OUT": str(out), **variables}
    env.pop("TRITON_INTERPRET", None)
    return env


def rank_fault_env(**fault: str) -> dict[str, str]:
    """benchmarks/rank_fault's variables (`fault`: FAULT_RANK, FAULT_AT_STEP, ...) with its folder first on
    PYTHONPATH, where Python finds its sitecustomize at start-up."""
    return {**fault, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "rank_fault"), python_path()])}


def worker_env() -> dict[str, str]:
    """`process_env` with one thread per process, for the members of a worker group."""
    return process_env(OMP_NUM_THREADS="1")


def write_configs(directory: Path, configs: dict[str, object]) -> list[str]:
    """Each run config as `directory/<name>.yaml`; their paths, in order."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for name, config in configs.items():
        path = directory / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        files.append(str(path))
    return files


def launch_worker(tmp_path: Path, source: str, ranks: int, model: dict, configs: dict[str, object]) -> list[dict]:
    """Run the worker script `source` on `ranks` gloo processes with `model` (a config dict, as JSON) and the
    `configs`' files as arguments; each rank's record, which the script writes to `tmp_path/rank<R>.json`."""
    worker = tmp_path / "worker.py"
    worker.write_text(source)
    files = write_configs(tmp_path / "configs", configs)
    done = subprocess.run(
        [*torchrun(ranks), str(worker), str(tmp_path), json.dumps(model), *files],
        cwd=tmp_path,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def train_with_a_failing_rank(
    tmp_path: Path, config, ranks: int, devices: str | None = None, kind: str = "raise"
) -> subprocess.CompletedProcess:
    """`tigon train` of `config` under torchrun on `ranks` processes, where rank 1's third optimizer step raises
    (`kind` "raise") or never returns ("hang"; benchmarks/rank_fault) while the others go on into the next step;
    the finished torchrun, its output captured. A job that does not end fails at the timeout."""
    (config_file,) = write_configs(tmp_path, {"run": config})
    env = process_env(OMP_NUM_THREADS="1", **rank_fault_env(FAULT_RANK="1", FAULT_AT_STEP="3", FAULT_KIND=kind))
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    command = [*torchrun(ranks), "-m", "tigon.runtime", "train", config_file]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def launch(
    tmp_path: Path,
    configs: dict[str, object],
    backend: str = "gloo",
    nproc: int = 2,
    devices: str | None = None,
    timeout: float = 300,
    worker_source: str = WORKER,
    max_restarts: int = 0,
) -> dict[str, dict]:
    """Train `configs` one after another in one `nproc`-process torchrun group; rank 0's record of each run.

    `devices` sets CUDA_VISIBLE_DEVICES for the group (e.g. "2,3"), so that groups can share a machine;
    `worker_source` replaces WORKER (it writes the same records), and torch elastic restarts the group up to
    `max_restarts` times."""
    worker = tmp_path / "worker.py"
    worker.write_text(worker_source)
    files = write_configs(tmp_path, configs)
    env = {**worker_env(), "TEST_BACKEND": backend}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    command = [*torchrun(nproc), "--max-restarts", str(max_restarts)]
    done = subprocess.run(
        [*command, str(worker), str(tmp_path), *files],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    print("\n".join(line for line in done.stdout.splitlines() if line.endswith(" s")))
    records = {}
    for name in configs:
        ranks = [json.loads((tmp_path / f"{name}-rank{rank}.json").read_text()) for rank in range(nproc)]
        assert ranks[0]["world_size"] == nproc, name
        assert all(rank["losses"] == ranks[0]["losses"] for rank in ranks), name
        records[name] = ranks[0]
    return records


def exported_logits(directory: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return model(input_ids=IDS).logits


def capture_before_export(monkeypatch, ids: torch.Tensor) -> dict:
    """Logits of the trained model just before the trainer exports it."""
    captured = {}
    original = ckpt.export_model

    def export(model, *args, **kwargs):
        model.eval()
        with torch.no_grad():
            captured["logits"] = model(input_ids=ids).logits
        return original(model, *args, **kwargs)

    monkeypatch.setattr(ckpt, "export_model", export)
    return captured


def logged_steps(run_dir: str | Path) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record]


def tensorboard_tags(directory) -> set[str]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    events = EventMultiplexer().AddRunsFromDirectory(str(directory))
    events.Reload()
    return {tag for run in events.Runs().values() for tag in run.get("scalars", [])}


def assert_close(got: dict, want: dict, tolerance: float, where) -> float:
    """The same names, and values within `tolerance` relative (absolute near 0: rewards start there); returns the
    worst difference so measured."""
    assert sorted(got) == sorted(want), (where, got, want)
    worst = 0.0
    for name, value in want.items():
        difference = abs(got[name] - value) / max(1.0, abs(value))
        assert difference <= tolerance, (where, name, got[name], value)
        worst = max(worst, difference)
    return worst


def worst_relative(got: list[float], want: list[float]) -> float:
    """The largest relative difference of two runs' per-step losses (same number of steps, at least one)."""
    assert len(got) == len(want) > 0
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def elastic_agent(config_file: str, port: int, host: bool, nproc: int, **variables: str) -> subprocess.Popen:
    """One node of an elastic job: a torch elastic agent of 1 to 2 nodes of `nproc` processes running `python -m
    tigon.runtime train`, restarting its workers up to 3 times; the node at `host` keeps the rendezvous store.
    `variables` go to its environment."""
    rendezvous = f"is_host={int(host)},last_call_timeout=1"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node", str(nproc)]
    command += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "elastic-test"]
    command += ["--rdzv_conf", rendezvous, "--max_restarts", "3", "-m", "tigon.runtime", "train", config_file]
    return subprocess.Popen(
        command,
        cwd=Path(config_file).parent,
        env={**worker_env(), **variables},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_checkpoint(config, step: int, node: subprocess.Popen, timeout: float) -> None:
    """Wait until the run's step-`step` checkpoint is in place; fail with `node`'s output if it ends first or the
    timeout passes."""
    state = Path(config.logging.run_dir) / "checkpoints" / f"step-{step}" / ckpt.STATE_FILE
    deadline = time.monotonic() + timeout
    while not state.is_file() and time.monotonic() < deadline and node.poll() is None:
        time.sleep(0.1)
    assert state.is_file(), node.communicate()[0][-6000:]


def train_losing_a_node(
    directory: Path, config, nproc: int = 1, devices: tuple[str, str] | None = None, timeout: float = 420
) -> str:
    """Train `config` as an elastic job of two nodes of `nproc` processes (on `devices`, CUDA_VISIBLE_DEVICES for
    each) and lose the second for good: its workers stop in their fourth optimizer step (benchmarks/rank_fault), so
    the run cannot end without it, and once the step-3 checkpoint is in place the node is killed whole (agent and
    workers, which torch elastic starts in sessions of their own). The first node's agent restarts its workers on
    the node left; its finished output (the job must end with status 0)."""
    (config_file,) = write_configs(directory, {"run": config})
    port = free_port()
    visible = [{"CUDA_VISIBLE_DEVICES": device} for device in devices] if devices else [{}, {}]
    survivor = elastic_agent(config_file, port, True, nproc, **visible[0])
    stuck = rank_fault_env(FAULT_RANK="any", FAULT_AT_STEP="4", FAULT_KIND="hang")
    lost = elastic_agent(config_file, port, False, nproc, **stuck, **visible[1])
    wait_for_checkpoint(config, 3, lost, timeout)
    for process in psutil.Process(lost.pid).children(recursive=True):
        process.kill()
    lost.kill()
    lost.wait()
    output = survivor.communicate(timeout=timeout)[0]
    assert survivor.returncode == 0, output[-6000:]
    return output


def train_gaining_a_node(directory: Path, config, timeout: float = 420) -> str:
    """Train `config` as an elastic job of one to two one-process nodes that starts with one: its worker stops in
    its fifth optimizer step while it trains alone (benchmarks/rank_fault), after the step-3 checkpoint, and there
    a second node joins. The first node's agent sees it waiting and restarts its workers, the rendezvous forms with
    both, and the run resumes on two processes. Both agents run with the platform's elastic environment
    (ELASTIC_ENV), without which the joining node waits for the new round's address until its timeout. The first
    node's finished output (the job must end with status 0 on both)."""
    (config_file,) = write_configs(directory, {"run": config})
    port = free_port()
    held = rank_fault_env(FAULT_RANK="any", FAULT_AT_STEP="5", FAULT_KIND="hang", FAULT_WORLD_SIZE="1")
    first = elastic_agent(config_file, port, True, 1, **held, **ELASTIC_ENV)
    wait_for_checkpoint(config, 3, first, timeout)
    second = elastic_agent(config_file, port, False, 1, **ELASTIC_ENV)
    output = first.communicate(timeout=timeout)[0]
    joined = second.communicate(timeout=timeout)[0]
    assert first.returncode == 0 and second.returncode == 0, (output[-6000:], joined[-3000:])
    return output
