"""Checkpoints across nodes that share no filesystem, on the CPU over gloo.

Two "nodes" are two `torchrun --nnodes 2 --node_rank R` agents of one process each, meeting on localhost.
Each has its own run directories (`node0/`, `node1/`); the only place they share is the object-store prefix
`checkpoint.remote_dir` (a directory URL, `file://...`). Each node trains the same runs in turn:

- `full`:    6 steps, a checkpoint every 2 steps;
- `killed`:  the same run stopped after step 3 (run directory and prefix `resumed`);
- `resumed`: `killed` continued to step 6, each node reading the step-3 checkpoint back from the store.

Checked: the resumed per-step losses equal the uninterrupted run's exactly on both nodes, the store holds the
newest `keep_last` checkpoints with every rank's files and a manifest of them all, and no checkpoint stays in a
node's own run directory. A run killed while FSDP2 writes a checkpoint in the background resumes from the one
before, and async and sync saves resume to the same losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.configs import tiny_config
from tests.runtime.worker_groups import free_port, worker_env, write_configs
from tigon.runtime import checkpoint as ckpt
from tigon.runtime.config import ConfigError
from tigon.runtime.storage import RunStorage

WORKER = """
import json, os, sys
import torch.distributed as dist
from tigon.runtime.checkpoint import CheckpointError
from tigon.runtime.config import load_config
from tigon.runtime.distributed import wait_for_idle_process_groups
from tigon.runtime.trainer import train

die_at = os.environ.get("TEST_DIE_WRITING")
if die_at:  # the process dies (as under kill -9) while the background writer writes checkpoint `die_at`
    import torch.distributed.checkpoint.filesystem as filesystem
    write_data = filesystem.FileSystemWriter.write_data
    def dying(self, plan, planner):
        if die_at in str(self.path):
            os._exit(9)
        return write_data(self, plan, planner)
    filesystem.FileSystemWriter.write_data = dying

if "RANK" in os.environ:
    dist.init_process_group("gloo")  # once for all runs; each run ends at a barrier, the group stays
out = sys.argv[1]
for path in sys.argv[2:]:
    name = os.path.basename(path).removesuffix(".yaml")
    try:
        result = train(load_config(path))
        record = {"losses": result.losses, "resumed_from": result.resumed_from_step, "world": result.world_size}
    except CheckpointError as error:
        record = {"error": str(error)}
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{out}/{name}-rank{rank}.json", "w") as file:
        json.dump(record, file)
if dist.is_initialized():  # every rank ends its runs, or fails them together (CheckpointError), and gets here
    wait_for_idle_process_groups()  # after a failed run gloo's threads may still hold tensors; exiting then aborts
    dist.destroy_process_group()
"""


def node_config(home: Path, name: str, max_steps: int, parallelism: dict, **checkpoint):
    """A tiny run (configs.tiny_config, micro-batch 2) in `home/name`, resuming, a checkpoint every 2 steps.
    The data is read from `home`'s parent, the same for every node (as a cluster reads one dataset URL)."""
    return tiny_config(
        home.parent,
        training={"micro_batch_size": 2, "max_steps": max_steps},
        parallelism=parallelism,
        checkpoint={"every_steps": 2, "keep_last": 2, "resume": True, "export": False, **checkpoint},
        logging={"run_dir": str(home / name), "tensorboard": False, "progress_bar": False, "every_steps": 1},
    )


def launch_nodes(tmp_path: Path, runs: dict[str, dict], timeout: float = 600) -> list[dict[str, dict]]:
    """Train `runs` (name: node_config's arguments but `home` and `name`; a `store` names the run's prefix under
    `tmp_path/store`) on two one-process nodes, each in its own directory `nodeR/`; each node's record of each run
    (losses, resumed_from, or the CheckpointError's message)."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    port = free_port()
    agents = []
    for node in range(2):
        home = tmp_path / f"node{node}"
        configs = {name: node_config(home, name, **sections) for name, sections in runs.items()}
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
        command += ["--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port)]
        agents.append(
            subprocess.Popen(
                [*command, str(worker), str(home), *write_configs(home, configs)],
                cwd=home,
                env=worker_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [agent.communicate(timeout=timeout)[0] for agent in agents]
    failed = [f"node {node}:\n{output[-6000:]}" for node, output in enumerate(outputs) if agents[node].returncode]
    assert not failed, "\n".join(failed)
    return [
        {name: json.loads((tmp_path / f"node{node}" / f"{name}-rank{node}.json").read_text()) for name in runs}
        for node in range(2)
    ]


def check_two_nodes(tmp_path: Path, parallelism: dict, **resumed_checkpoint) -> list[dict]:
    """full / killed / resumed on two nodes through the store; the resumed run repeats the full one exactly."""
    store = {name: (tmp_path / "store" / name).as_uri() for name in ("full", "resumed")}
    runs = {
        "full": {"max_steps": 6, "parallelism": parallelism, "remote_dir": store["full"]},
        "killed": {"max_steps": 3, "parallelism": parallelism, "remote_dir": store["resumed"], **resumed_checkpoint},
        "resumed": {"max_steps": 6, "parallelism": parallelism, "remote_dir": store["resumed"], **resumed_checkpoint},
    }
    nodes = launch_nodes(tmp_path, runs)
    full = nodes[0]["full"]["losses"]
    assert len(full) == 6 and full[-1] < full[0], full
    for node in nodes:
        assert node["full"]["world"] == 2 and node["full"]["losses"] == full
        assert node["killed"]["losses"] == full[:3]
        assert node["resumed"]["resumed_from"] == 3 and node["resumed"]["losses"] == full, (node["resumed"], full)
    store = RunStorage((tmp_path / "store" / "resumed").as_uri())
    assert store.checkpoint_steps() == [4, 6]
    listing = store.committed(ckpt.CHECKPOINTS, "step-6")
    assert {"state.json", "manifest.json", "rng-rank0.pt", "rng-rank1.pt"} <= set(listing), listing
    manifest = json.loads((tmp_path / "store" / "resumed" / "checkpoints" / "step-6" / "manifest.json").read_text())
    assert set(manifest["files"]) == set(listing) - {"manifest.json"}
    for node in range(2):
        local = tmp_path / f"node{node}" / "resumed" / "checkpoints"
        assert not list(local.iterdir()), list(local.iterdir())  # the store holds them; nothing staged is left
    return nodes


def test_ddp_on_two_nodes_without_a_shared_run_directory(tmp_path):
    nodes = check_two_nodes(tmp_path, {"strategy": "ddp"})
    listing = RunStorage((tmp_path / "store" / "resumed").as_uri()).committed(ckpt.CHECKPOINTS, "step-6")
    assert {"model.pt", "optimizer.pt", "scheduler.pt"} <= set(listing), listing
    assert nodes[1]["resumed"]["resumed_from"] == 3


def test_fsdp2_on_two_nodes_resumes_sync_and_async_saves_to_the_same_losses(tmp_path):
    """`full` saves synchronously; `killed` and `resumed` save in the background (checkpoint.async_save)."""
    check_two_nodes(tmp_path, {"strategy": "fsdp"}, async_save=True)
    listing = RunStorage((tmp_path / "store" / "resumed").as_uri()).committed(ckpt.CHECKPOINTS, "step-6")
    shards = sorted(name for name in listing if name.startswith("dcp/"))
    assert shards == ["dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"], shards


def test_nodes_that_share_nothing_and_have_no_store_are_told_the_fix(tmp_path):
    nodes = launch_nodes(tmp_path, {"alone": {"max_steps": 2, "parallelism": {"strategy": "ddp"}}})
    for node in nodes:
        error = node["alone"]["error"]
        assert "ranks [1] do not see" in error and "Set checkpoint.remote_dir" in error, error


def test_a_run_killed_during_an_async_save_resumes_from_the_checkpoint_before(tmp_path):
    """One FSDP2 process: the process dies while its background writer writes step 4; the run resumes from step
    2 (the partial step 4 is removed) and repeats the uninterrupted run's losses."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    home = tmp_path / "node"  # the data is read from tmp_path
    full = node_config(home, "full", 6, {"strategy": "fsdp"})
    run = node_config(home, "run", 6, {"strategy": "fsdp"}, async_save=True)
    files = write_configs(tmp_path / "configs", {"full": full, "run": run})
    env = worker_env()
    done = subprocess.run(
        [sys.executable, str(worker), str(tmp_path), files[0]], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-6000:]
    dies = subprocess.run(
        [sys.executable, str(worker), str(tmp_path), files[1]],
        env={**env, "TEST_DIE_WRITING": ".tmp-step-4"},
        capture_output=True,
        text=True,
    )
    assert dies.returncode == 9, dies.stderr[-6000:]
    root = home / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step-4", "step-2"]
    done = subprocess.run(
        [sys.executable, str(worker), str(tmp_path), files[1]], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-6000:]
    want = json.loads((tmp_path / "full-rank0.json").read_text())["losses"]
    resumed = json.loads((tmp_path / "run-rank0.json").read_text())
    assert resumed["resumed_from"] == 2 and resumed["losses"] == want, (resumed, want)
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6"]


@pytest.mark.parametrize(
    ("sections", "problem"),
    [({"strategy": "deepspeed"}, "'deepspeed'"), ({"strategy": "ddp"}, "'ddp'")],
)
def test_async_save_needs_fsdp(tmp_path, sections, problem):
    with pytest.raises(ConfigError, match=f"checkpoint.async_save .*strategy {problem}"):
        node_config(tmp_path / "node", "x", 2, sections, async_save=True)
