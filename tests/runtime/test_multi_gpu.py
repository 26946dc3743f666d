"""The torch, HF and Lightning trainers under DDP, FSDP2 (over every GPU; hybrid: `hsdp`, shard groups of 2 GPUs, which
on 4 GPUs are 2 replicas; `fsdp-sharded`, accumulating the gradients sharded) and DeepSpeed ZeRO-2/3 on 1, 2, 4 and
8 GPUs over NCCL (marker `gpu`; needs 2 or more GPUs and DeepSpeed, whose wheel travels to the GPU machine; the 4-
and 8-GPU cases need as many):

    python -m pytest -m gpu tests/runtime/test_multi_gpu.py

Every case of CASES trains a tiny Llama (tests/runtime/configs.adapter_config: cosine schedule with warm-up,
clipping, weight decay, gradient accumulation, crossing epochs) for 6 steps at one global batch of 16 sequences,
spread as 1 GPU x micro-batch 4 x accumulation 4, 2 GPUs x 4 x 2, 4 GPUs x 2 x 2 and 8 GPUs x 1 x 2. On 4 or more
GPUs the one-GPU runs (split over GPUs 0 and 1) and the two-GPU group (GPUs 2 and 3) run at the same time, then
the four-GPU group, then on 8 the eight-GPU group; on 2 GPUs the one-GPU runs share GPUs 0 and 1 with the two-GPU
group (tiny models: they fit side by side).

Tolerances, per step's loss against the one-GPU run of the same case:

- fp32 cases, RELATIVE_TOLERANCE (1e-4): the same arithmetic, with the gradients summed over ranks in another
  order and cuBLAS free to pick another algorithm for another micro-batch. A sharding or normalization error
  (a rank's gradients lost or counted twice, the accumulation divided twice) moves the second step's loss by
  about 1e-2 or more; the measured worst differences are printed (docs/benchmarks.md keeps a run's).
- bf16 cases, BF16_TOLERANCE (1e-2): each forward rounds activations to bf16 (2^-8 relative), so a change of
  summation order flips roundings throughout the step, and six steps at learning rate 1e-2 carry such a change
  into the loss (measured up to 2.8e-4 on 4 H200s). 1e-2 stays below the 1e-2-and-up shift of a lost or doubled
  rank.

A killed rank: KILL_CASES train on all the GPUs (8, 4 or 2) under `torchrun --max-restarts`; the last rank
SIGKILLs itself as soon as the step-3 checkpoint is in place, torch elastic restarts the whole group, and the
run resumes from its newest checkpoint to the same per-step losses as the uninterrupted run on as many GPUs: bit
for bit under FSDP2 and ZeRO, and within DDP_RESUME_TOLERANCE under DDP. DDP sums each step's gradients in
buckets, and rebuilds its buckets in the order the gradients became ready after its first step; the first step
after a resume is such a first step, so NCCL reduces it in the initial layout and the sums differ in their last
bits (measured 8e-9 relative on the loss two steps later, on 4 H200s).

Alignment: OBJECTIVE_CASES train the preference objectives and distillation (tests/runtime/configs:
preference_config's 8 pairs or 16 KTO completions on the tiny Llama, distill_config's teacher and student) for 3
steps with a held-out evaluation, under DDP, FSDP2 and ZeRO-3, on 1, 2 and 4 GPUs at one global batch (8 pairs or
completions; distillation 4 packed sequences). DPO (frozen and precomputed reference), SimPO and distillation
average over pairs or tokens of the whole global batch, so each reaches the one-GPU run's per-step losses and
held-out metrics within the tolerances above. ORPO's NLL term is a mean over each micro-batch's tokens and KTO's
reference point a mean over each micro-batch's mismatched sequences (TRL's definitions, docs/runtime.md), so
their steps depend on which records share a micro-batch: they are held to DDP's run on as many GPUs instead.

A failing rank: on 2 GPUs under FSDP2, rank 1's third optimizer step raises (benchmarks/rank_fault); the job must
end with that rank's error in its log, not wait in NCCL's collectives. A hanging rank: the same, but rank 1 stops
for good; the job must end after the collective timeout (30 s here), through NCCL's watchdog.

Another number of GPUs: FSDP2 trained on every GPU to its step-3 checkpoint resumes on half of them with the
global batch kept, to the uninterrupted run's losses; and an elastic job of two 2-GPU "nodes" that loses one goes
on with the other after NCCL's collective timeout, to the same losses.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.runtime.configs import KTO_RECORDS, PAIRS, adapter_config, distill_config, preference_config
from tests.runtime.worker_groups import (
    assert_close,
    launch,
    train_losing_a_node,
    train_with_a_failing_rank,
    worst_relative,
)

RELATIVE_TOLERANCE = 1e-4
BF16_TOLERANCE = 1e-2
DDP_RESUME_TOLERANCE = 1e-6
GLOBAL_BATCH = 16
GROUP_TIMEOUT = 540  # seconds for one torchrun group's runs
LAYOUT = {1: (4, 4), 2: (4, 2), 4: (2, 2), 8: (1, 2)}  # GPUs: (micro-batch, accumulation), GLOBAL_BATCH a step
STRATEGIES = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp"},
    "hsdp": {"strategy": "fsdp", "shard_size": 2},  # on 4 GPUs 2 replicas of 2-GPU shard groups; on 2 or 1, fsdp
    "fsdp-sharded": {"strategy": "fsdp", "accumulate_sharded": True},  # a reduce-scatter every micro-batch
    "zero2": {"strategy": "deepspeed", "zero_stage": 2},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3},
}
CASES = {  # name: (trainer, strategy, kernels, precision)
    **{f"torch-{s}-kernels": ("torch", s, True, "fp32") for s in STRATEGIES},
    **{f"torch-{s}-eager": ("torch", s, False, "fp32") for s in STRATEGIES},
    **{f"hf-{s}-kernels": ("hf", s, True, "fp32") for s in STRATEGIES},
    **{f"lightning-{s}-kernels": ("lightning", s, True, "fp32") for s in STRATEGIES},
    **{f"torch-{s}-kernels-bf16": ("torch", s, True, "bf16") for s in STRATEGIES},
}
KILL_CASES = (
    "torch-fsdp-kernels",
    "torch-hsdp-kernels",
    "torch-zero3-kernels",
    "hf-zero2-kernels",
    "lightning-ddp-kernels",
)

PREFERENCE_OBJECTIVES = {  # name: (objective section, records)
    "dpo": ({"type": "dpo"}, PAIRS),
    "dpo-precomputed": ({"type": "dpo", "reference": "precomputed"}, PAIRS),
    "simpo": ({"type": "simpo"}, PAIRS),
    "orpo": ({"type": "orpo"}, PAIRS),
    "kto": ({"type": "kto"}, KTO_RECORDS),
}
SPLIT_BOUND = ("orpo", "kto")  # objectives whose step depends on which records share a micro-batch
OBJECTIVE_LAYOUT = {1: (4, 2), 2: (2, 2), 4: (1, 2)}  # GPUs: (micro-batch, accumulation) of 8 pairs a step
DISTILL_LAYOUT = {1: (2, 2), 2: (1, 2), 4: (1, 1)}  # 4 packed sequences a step
OBJECTIVE_STRATEGIES = {"ddp": STRATEGIES["ddp"], "fsdp": STRATEGIES["fsdp"], "zero3": STRATEGIES["zero3"]}
OBJECTIVE_CASES = {  # name: (trainer, objective, strategy, precision)
    **{
        f"{objective}-{strategy}": ("torch", objective, strategy, "fp32")
        for objective in (*PREFERENCE_OBJECTIVES, "distill")
        for strategy in OBJECTIVE_STRATEGIES
    },
    "hf-dpo-fsdp": ("hf", "dpo", "fsdp", "fp32"),
    "lightning-dpo-zero3": ("lightning", "dpo", "zero3", "fp32"),
    "dpo-fsdp-bf16": ("torch", "dpo", "fsdp", "bf16"),
    "distill-fsdp-bf16": ("torch", "distill", "fsdp", "bf16"),
}

KILL_WORKER = """
import json, os, signal, sys, threading, time
import torch
import torch.distributed as dist
from tigon.runtime.config import load_config
from tigon.runtime.trainer import train

backend = os.environ["TEST_BACKEND"]
if backend == "nccl":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# This restart's keys only: the store torch elastic hands a restarted group still holds the dead group's addresses.
store, _, _ = next(dist.rendezvous("env://", rank, world))
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
dist.init_process_group(backend, store=dist.PrefixStore(f"restart-{restart}", store), rank=rank, world_size=world)
out = sys.argv[1]


def kill_after_first_checkpoint(checkpoint: str, marker: str) -> None:
    while not os.path.isdir(checkpoint):
        time.sleep(0.001)
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


for path in sys.argv[2:]:
    config = load_config(path)
    name = os.path.basename(path).removesuffix(".yaml")
    if os.path.exists(f"{out}/{name}-rank0.json"):
        continue  # finished before an earlier case's restart
    marker = f"{out}/{name}.killed"
    if rank == world - 1 and not os.path.exists(marker):
        checkpoint = os.path.join(config.logging.run_dir, "checkpoints", "step-3")
        threading.Thread(target=kill_after_first_checkpoint, args=(checkpoint, marker), daemon=True).start()
    result = train(config)
    record = {"losses": result.losses, "resumed_from": result.resumed_from_step, "restarts": int(restart),
              "world_size": result.world_size}
    with open(f"{out}/{name}-rank{rank}.json", "w") as file:
        json.dump(record, file)
dist.destroy_process_group()
"""


def case_config(directory: Path, name: str, gpus: int):
    """The case's run on `gpus` GPUs: checkpoints every 3 steps, resume on, no export (the CPU tests cover it)."""
    trainer, strategy, kernels, precision = CASES[name]
    micro_batch, accumulation = LAYOUT[gpus]
    assert micro_batch * accumulation * gpus == GLOBAL_BATCH
    return adapter_config(
        directory,
        trainer,
        n_train=120,  # about 42 sequences: 2.6 global batches an epoch
        training={
            "micro_batch_size": micro_batch,
            "gradient_accumulation_steps": accumulation,
            "precision": precision,
        },
        parallelism=STRATEGIES[strategy],
        kernels={"enabled": kernels},
        checkpoint={"every_steps": 3, "keep_last": 2, "resume": True, "export": False},
        logging={"run_dir": str(directory / name)},
    )


def objective_case_config(directory: Path, name: str, gpus: int):
    """The objective case's run on `gpus` GPUs: 3 steps, evaluated on its training records."""
    trainer, objective, strategy, precision = OBJECTIVE_CASES[name]
    micro_batch, accumulation = (DISTILL_LAYOUT if objective == "distill" else OBJECTIVE_LAYOUT)[gpus]
    data = {"eval": str(directory / objective / "train.jsonl")}
    sections = {
        "trainer": trainer,
        "training": {
            "max_steps": 3,
            "micro_batch_size": micro_batch,
            "gradient_accumulation_steps": accumulation,
            "precision": precision,
        },
        "parallelism": OBJECTIVE_STRATEGIES[strategy],
        "logging": {"run_dir": str(directory / name)},
    }
    (directory / objective).mkdir(parents=True, exist_ok=True)
    if objective == "distill":
        return distill_config(directory / objective, data=data, **sections)
    section, records = PREFERENCE_OBJECTIVES[objective]
    return preference_config(directory / objective, section, records, data=data, **sections)


def group_configs(directory: Path, gpus: int, names: tuple[str, ...], config=case_config) -> dict[str, object]:
    """The cases `names` as runs on `gpus` GPUs (`config(directory, name, gpus)`), their files written."""
    directory.mkdir(parents=True, exist_ok=True)
    return {name: config(directory, name, gpus) for name in names}


def train_group(
    directory: Path, gpus: int, devices: str | None, names: tuple[str, ...], backend: str = "nccl", config=case_config
) -> dict[str, dict]:
    """The cases `names` in one `gpus`-process group on `devices` (CUDA_VISIBLE_DEVICES)."""
    configs = group_configs(directory, gpus, names, config)
    return launch(directory, configs, backend=backend, nproc=gpus, devices=devices, timeout=GROUP_TIMEOUT)


def train_all(
    root: Path, sizes: dict[int, str], backend: str = "nccl", names: tuple[str, ...] = tuple(CASES), config=case_config
) -> dict[int, dict[str, dict]]:
    """{GPUs: {case: rank 0's record}}: the one-GPU runs split over two single-GPU groups and run beside the
    two-GPU group, then the four-GPU group, then the eight-GPU one. `sizes` maps each group size to its devices,
    "a,b" for two. Every group's files are written before any starts (a saved test model seeds torch's global
    generator, which threads would share)."""
    half = len(names) // 2
    first = {  # directory: (GPUs, devices, names)
        "gpus-1a": (1, sizes[1].split(",")[0], names[:half]),
        "gpus-1b": (1, sizes[1].split(",")[-1], names[half:]),
        "gpus-2": (2, sizes[2], names),
    }
    configs = {name: group_configs(root / name, gpus, group, config) for name, (gpus, _, group) in first.items()}
    with ThreadPoolExecutor(3) as pool:
        futures = {
            name: pool.submit(launch, root / name, configs[name], backend, gpus, devices, GROUP_TIMEOUT)
            for name, (gpus, devices, _) in first.items()
        }
        runs = {1: futures["gpus-1a"].result() | futures["gpus-1b"].result(), 2: futures["gpus-2"].result()}
    for gpus in (4, 8):
        if gpus in sizes:
            runs[gpus] = train_group(root / f"gpus-{gpus}", gpus, sizes[gpus], names, backend, config)
    return runs


def train_killed(directory: Path, gpus: int, devices: str | None, backend: str = "nccl") -> dict[str, dict]:
    """KILL_CASES under `torchrun --max-restarts`, each losing its last rank once; rank 0's record of each."""
    directory.mkdir(parents=True, exist_ok=True)
    configs = {name: case_config(directory, name, gpus) for name in KILL_CASES}
    records = launch(
        directory,
        configs,
        backend,
        gpus,
        devices,
        timeout=GROUP_TIMEOUT,
        worker_source=KILL_WORKER,
        max_restarts=len(configs),
    )
    for name in KILL_CASES:
        assert (directory / f"{name}.killed").is_file(), name
    return records


def group_devices(largest: int) -> dict[int, str]:
    """{group size: its devices} for 1, 2 and, where the machine has them, 4 and up to `largest` GPUs; fails
    where the machine cannot run the module."""
    if torch.cuda.device_count() < 2:
        pytest.fail(f"needs 2 or more GPUs, found {torch.cuda.device_count()}: run on nvidia-h100-x2, -x4 or -x8")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("DeepSpeed is not installed: carry its wheel to the GPU machine")
    count = torch.cuda.device_count()
    sizes = {1: "0,1", 2: "2,3", 4: "0,1,2,3"} if count >= 4 else {1: "0,1", 2: "0,1"}
    if count >= 8 and largest >= 8:
        sizes[8] = ",".join(map(str, range(8)))
    return sizes


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict[int, dict[str, dict]]:
    """{GPUs: {case: rank 0's record}} for 1, 2 and (on a 4- or 8-GPU machine) 4 and 8 GPUs."""
    return train_all(tmp_path_factory.mktemp("multi-gpu"), group_devices(8))


@pytest.fixture(scope="module")
def objective_groups(tmp_path_factory) -> dict[int, dict[str, dict]]:
    """{GPUs: {objective case: rank 0's record}} for 1, 2 and (on a machine of 4 or more) 4 GPUs."""
    root = tmp_path_factory.mktemp("objectives")
    return train_all(root, group_devices(4), names=tuple(OBJECTIVE_CASES), config=objective_case_config)


@pytest.mark.gpu
@pytest.mark.parametrize("gpus", [2, 4, 8])
@pytest.mark.parametrize("name", list(CASES))
def test_several_gpus_reach_the_one_gpu_losses(groups, name, gpus):
    if gpus not in groups:
        pytest.skip(f"this machine has {torch.cuda.device_count()} GPUs; the {gpus}-GPU cases need {gpus}")
    reference, losses = groups[1][name]["losses"], groups[gpus][name]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    tolerance = BF16_TOLERANCE if CASES[name][3] == "bf16" else RELATIVE_TOLERANCE
    worst = worst_relative(losses, reference)
    print(f"{name} on {gpus} GPUs: worst relative loss difference to one GPU {worst:.2e}")
    assert worst < tolerance, (losses, reference)


@pytest.mark.gpu
def test_a_killed_rank_restarts_and_resumes_exactly(groups, tmp_path):
    """KILL_CASES on every GPU (8, 4 or 2), each losing its last rank after the step-3 checkpoint, against the same
    cases' uninterrupted runs on as many GPUs."""
    gpus = max(groups)
    records = train_killed(tmp_path, gpus, ",".join(str(gpu) for gpu in range(gpus)))
    for restarts, name in enumerate(KILL_CASES, start=1):
        record, full = records[name], groups[gpus][name]["losses"]
        resumed = record["resumed_from"]
        print(f"{name}: rank {gpus - 1} of {gpus} killed, restart {restarts} resumed from step {resumed}")
        assert record["restarts"] == restarts and record["resumed_from"] in (3, 6), record
        if CASES[name][1] == "ddp":
            assert worst_relative(record["losses"], full) < DDP_RESUME_TOLERANCE, (record["losses"], full)
        else:
            assert record["losses"] == full, (record["losses"], full)


@pytest.mark.gpu
def test_a_rank_that_fails_mid_run_ends_the_nccl_job_with_its_error(tmp_path):
    """2 GPUs, FSDP2 over NCCL: rank 1's third optimizer step raises while rank 0 goes on into the next step's
    collectives. The job ends (non-zero, within the helper's timeout: the failing rank aborts its NCCL group rather
    than wait in it) with that rank's error in the log, after the steps before it."""
    if torch.cuda.device_count() < 2:
        pytest.fail(f"needs 2 or more GPUs, found {torch.cuda.device_count()}: run on nvidia-h100-x2, -x4 or -x8")
    config = case_config(tmp_path, "torch-fsdp-kernels-bf16", 2)
    done = train_with_a_failing_rank(tmp_path, config, 2, devices="0,1")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "rank 1 of 2 failed: injected fault on rank 1 at optimizer step 3" in output, output[-3000:]
    steps = (Path(config.logging.run_dir) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in steps if '"loss"' in line] == [1, 2]


@pytest.mark.gpu
def test_a_run_resumed_on_half_the_gpus_continues_it(tmp_path):
    """FSDP2 over NCCL, fp32: the kernels case trained on every GPU (4, or 2) to its step-3 checkpoint, then resumed
    on half of them. The global batch is kept (accumulation doubles), DCP reshards the weights and AdamW's states,
    and the resumed steps reach the uninterrupted run's losses within RELATIVE_TOLERANCE."""
    gpus = min(torch.cuda.device_count(), 4)
    if gpus < 2:
        pytest.fail(f"needs 2 or more GPUs, found {torch.cuda.device_count()}: run on nvidia-h100-x2, -x4 or -x8")
    name = "torch-fsdp-kernels"
    full, moved = case_config(tmp_path / "full", name, gpus), case_config(tmp_path / "moved", name, gpus)
    first = moved.model_copy(update={"training": moved.training.model_copy(update={"max_steps": 3})})
    devices = ",".join(str(gpu) for gpu in range(gpus))
    runs = launch(tmp_path, {"full": full, "first": first}, "nccl", gpus, devices, GROUP_TIMEOUT)
    half = launch(tmp_path, {"half": moved}, "nccl", gpus // 2, devices, GROUP_TIMEOUT)["half"]
    assert runs["first"]["losses"] == runs["full"]["losses"][:3], runs
    assert half["resumed_from"] == 3 and half["world_size"] == gpus // 2, half
    worst = worst_relative(half["losses"], runs["full"]["losses"])
    print(f"{name}: {gpus} GPUs to step 3, resumed on {gpus // 2}: worst relative difference {worst:.2e}")
    assert worst < RELATIVE_TOLERANCE, (half["losses"], runs["full"]["losses"])


@pytest.mark.gpu
def test_copy_engine_gathers_train_bit_for_bit_as_nccl_gathers(tmp_path):
    """FSDP2 in bf16 on every GPU (up to 4), its weights gathered by NCCL and then by the GPUs' copy engines
    (`parallelism.copy_engine_gathers`): a gather moves the same bytes either way, so the losses are equal."""
    gpus = min(torch.cuda.device_count(), 4)
    if gpus < 2:
        pytest.fail(f"needs 2 or more GPUs, found {torch.cuda.device_count()}: run on nvidia-h100-x2, -x4 or -x8")
    nccl = case_config(tmp_path / "nccl", "torch-fsdp-kernels-bf16", gpus)
    copied = nccl.model_copy(
        update={
            "parallelism": nccl.parallelism.model_copy(update={"copy_engine_gathers": True}),
            "logging": nccl.logging.model_copy(update={"run_dir": str(tmp_path / "copied")}),
        }
    )
    devices = ",".join(str(gpu) for gpu in range(gpus))
    runs = launch(tmp_path, {"nccl": nccl, "copied": copied}, "nccl", gpus, devices, GROUP_TIMEOUT)
    print(f"{gpus} GPUs: NCCL's gathers {runs['nccl']['losses']}, copy engines' {runs['copied']['losses']}")
    assert len(runs["nccl"]["losses"]) > 3 and runs["copied"]["losses"] == runs["nccl"]["losses"], runs


@pytest.mark.gpu
def test_a_lost_node_leaves_the_nccl_job_on_the_gpus_left(tmp_path):
    """Two elastic "nodes" of 2 GPUs each (GPUs 0-1 and 2-3, `torchrun --nnodes 1:2`), FSDP2 over NCCL, fp32: the
    second node's workers stop for good in their fourth optimizer step and the node is then killed whole. NCCL
    sees no error from a peer that is gone; the first node's collectives time out after
    parallelism.collective_timeout_minutes (0.5), torch elastic restarts its workers on the node left, and the run
    resumes from its step-3 checkpoint on 2 GPUs with the global batch kept, to the uninterrupted 4-GPU run's
    losses within RELATIVE_TOLERANCE."""
    if torch.cuda.device_count() < 4:
        pytest.fail(f"needs 4 GPUs, found {torch.cuda.device_count()}: run on nvidia-h100-x4 or -x8")
    name = "torch-fsdp-kernels"
    full = launch(tmp_path, {"full": case_config(tmp_path / "full", name, 4)}, "nccl", 4, "0,1,2,3", GROUP_TIMEOUT)
    config = case_config(tmp_path / "elastic", name, 4)
    config.parallelism.collective_timeout_minutes = 0.5
    started = time.monotonic()
    output = train_losing_a_node(tmp_path / "elastic", config, nproc=2, devices=("0,1", "2,3"))
    seconds = time.monotonic() - started
    assert "resuming on 2 processes a run written by 4" in output, output[-6000:]
    run_dir = Path(config.logging.run_dir)
    state = json.loads((run_dir / "checkpoints" / "step-6" / "state.json").read_text())
    assert (state["world_size"], state["global_batch"]) == (2, GLOBAL_BATCH), state
    worst = worst_relative(state["losses"], full["full"]["losses"])
    print(
        f"{name}: a node of 2 GPUs lost after step 3, the job done on the 2 left in {seconds:.0f} s: worst "
        f"relative difference to the uninterrupted run {worst:.2e}"
    )
    assert worst < RELATIVE_TOLERANCE, (state["losses"], full["full"]["losses"])


@pytest.mark.gpu
def test_a_rank_that_hangs_ends_the_nccl_job_after_the_collective_timeout(tmp_path):
    """2 GPUs, FSDP2 over NCCL: rank 1 stops for good in its third optimizer step while rank 0 goes on into the next
    step's collectives. With parallelism.collective_timeout_minutes at 0.5, NCCL's watchdog on rank 0 times the
    waiting collective out after 30 s and takes the process down (torch's default error handling), torchrun stops
    rank 1, and the job ends non-zero, naming the timed-out collective, instead of waiting out the default 30
    minutes."""
    if torch.cuda.device_count() < 2:
        pytest.fail(f"needs 2 or more GPUs, found {torch.cuda.device_count()}: run on nvidia-h100-x2, -x4 or -x8")
    config = case_config(tmp_path, "torch-fsdp-kernels-bf16", 2)
    config.parallelism.collective_timeout_minutes = 0.5
    started = time.monotonic()
    done = train_with_a_failing_rank(tmp_path, config, 2, devices="0,1", kind="hang")
    seconds = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert re.search(r"Watchdog caught collective operation timeout: .*Timeout\(ms\)=30000", output), output[-3000:]
    steps = (Path(config.logging.run_dir) / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["step"] for line in steps if '"loss"' in line]
    assert logged[:2] == [1, 2] and max(logged) < 6, logged
    print(f"a rank hung at optimizer step 3: the job ended after {seconds:.0f} s (collective timeout 30 s)")


def tolerance_of(precision: str) -> float:
    return BF16_TOLERANCE if precision == "bf16" else RELATIVE_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("name", [name for name, case in OBJECTIVE_CASES.items() if case[1] not in SPLIT_BOUND])
def test_alignment_on_several_gpus_reaches_the_one_gpu_losses_and_metrics(objective_groups, name, gpus):
    if gpus not in objective_groups:
        pytest.skip(f"this machine has {torch.cuda.device_count()} GPUs; the {gpus}-GPU cases need {gpus}")
    reference, record = objective_groups[1][name], objective_groups[gpus][name]
    assert len(record["losses"]) == 3 and record["losses"][-1] < record["losses"][0], record["losses"]
    tolerance = tolerance_of(OBJECTIVE_CASES[name][3])
    worst = worst_relative(record["losses"], reference["losses"])
    assert worst < tolerance, (record["losses"], reference["losses"])
    split_free = {key: value for key, value in reference["eval"].items() if key != "nll_loss"}  # a micro-batch mean
    worst_eval = assert_close(
        {key: record["eval"][key] for key in split_free}, split_free, tolerance, (name, gpus, "held out")
    )
    print(f"{name} on {gpus} GPUs: worst relative difference to one GPU {worst:.2e} (held out {worst_eval:.2e})")


@pytest.mark.gpu
@pytest.mark.parametrize("gpus", [1, 2, 4])
@pytest.mark.parametrize("objective", SPLIT_BOUND)
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_split_bound_objectives_on_several_gpus_match_ddp(objective_groups, objective, strategy, gpus):
    if gpus not in objective_groups:
        pytest.skip(f"this machine has {torch.cuda.device_count()} GPUs; the {gpus}-GPU cases need {gpus}")
    ddp, record = objective_groups[gpus][f"{objective}-ddp"], objective_groups[gpus][f"{objective}-{strategy}"]
    assert len(record["losses"]) == 3 and record["losses"][-1] < record["losses"][0], record["losses"]
    worst = worst_relative(record["losses"], ddp["losses"])
    assert worst < RELATIVE_TOLERANCE, (record["losses"], ddp["losses"])
    worst_eval = assert_close(record["eval"], ddp["eval"], RELATIVE_TOLERANCE, (objective, strategy, gpus))
    print(f"{objective} {strategy} on {gpus} GPUs: worst difference to DDP {worst:.2e}, held out {worst_eval:.2e}")
