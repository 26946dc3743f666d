"""What a run shows and leaves behind: progress bar, metrics JSONL, TensorBoard, loss curve, summary.

Only rank 0 reports. `<run_dir>/metrics.jsonl` gets one JSON line per logged step and per
evaluation; whole files (`loss.png`, `summary.json`) are written to a temporary name and
renamed into place.
"""

from __future__ import annotations

import io
import json
import logging
import math
import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tigon.runtime.files import atomic_write_bytes, atomic_write_text
from tigon.runtime.profiling import profile_text
from tigon.runtime.trackers import Trackers

if TYPE_CHECKING:
    from tigon.runtime.config import RunConfig

logger = logging.getLogger("tigon.runtime")

METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"
SUMMARY_FILE = "summary.json"
PROFILE_FILE = "profile.json"  # logging.profile_step's step by kind of kernel
PROFILE_TRACE = "trace.json"  # and its Chrome trace
# an objective's metrics in the progress bar: preference (rewards) and distillation (its two terms)
OBJECTIVE_BAR = {"acc": "rewards/accuracies", "margin": "rewards/margins", "ce": "ce_loss", "distill": "distill_loss"}


def memory_bytes(device: torch.device) -> int:
    """Peak memory so far: allocated GPU bytes on CUDA, the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def format_count(value: float) -> str:
    for unit, scale in (("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def truncate_metrics(run_dir: str | Path, step: int) -> None:
    """On resume: drop records after the resumed step (a killed run may have logged past its checkpoint)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the kill
        if record.get("step", 0) <= step:
            kept.append(line)
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))


class Reporter:
    """Progress bar, metrics, TensorBoard, the other trackers and plots for one run; a no-op off rank 0."""

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        *,
        enabled: bool = True,
        progress_bar: bool = True,
        tensorboard: bool = True,
        log_every: int = 10,
        initial_step: int = 0,
        device: torch.device | None = None,
        trackers: Trackers | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.trackers = trackers or Trackers()
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_every = log_every
        self.device = device or torch.device("cpu")
        self.bar = None
        self.writer = None
        self.metrics_path = self.run_dir / METRICS_FILE
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if initial_step > 0:
            truncate_metrics(self.run_dir, initial_step)
        else:
            self.metrics_path.unlink(missing_ok=True)
        if progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=initial_step + 1)
            except ImportError:
                logger.warning(
                    "logging.tensorboard is on but the tensorboard package is missing; pip install tensorboard"
                )

    def _append(self, record: dict) -> None:
        with self.metrics_path.open("a") as file:
            file.write(json.dumps(record) + "\n")
            file.flush()

    def step(self, step: int, metrics: dict) -> None:
        """After each optimizer step: advance the bar; every `log_every` steps (and the last) log metrics."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                loss=f"{metrics['loss']:.4f}",
                tok_s=format_count(metrics.get("tokens_per_second", 0.0)),
                mem=format_bytes(metrics.get("memory_bytes", 0)),
                **{short: f"{metrics[name]:.3f}" for short, name in OBJECTIVE_BAR.items() if name in metrics},
                refresh=False,
            )
        if step % self.log_every == 0 or step == self.total_steps or step == 1:
            self._append({"step": step, **metrics})
            if self.writer is not None:
                for name, value in metrics.items():
                    if isinstance(value, (int, float)) and math.isfinite(value):
                        self.writer.add_scalar(f"train/{name}", value, step)
            self.trackers.log(metrics, step, "train")

    def evaluation(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self._append({"step": step, **{f"eval_{name}": value for name, value in metrics.items()}})
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(f"eval/{name}", value, step)
        self.trackers.log(metrics, step, "eval")
        text = ", ".join(f"{name} {value:.4f}" for name, value in metrics.items())
        message = f"eval at step {step}: {text}"
        if self.bar is not None:
            self.bar.write(message)
        else:
            logger.info("%s", message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None

    def finish(self, summary: dict, failed: bool = False) -> None:
        """Hand the run's final values, loss plot and summary file to the trackers and end their runs."""
        if not self.enabled:
            return
        self.trackers.finish(summary, [self.run_dir / LOSS_PLOT, self.run_dir / SUMMARY_FILE], failed=failed)

    def plot(self, losses: list[float], eval_history: list[dict]) -> Path | None:
        """Write `loss.png`: the training loss per step, and the evaluation loss where measured."""
        if not self.enabled or not losses:
            return None
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure

        figure = Figure(figsize=(7, 4), dpi=100)
        axes = figure.add_subplot()
        axes.plot(range(1, len(losses) + 1), losses, label="train loss", linewidth=1)
        points = [(record["step"], record["loss"]) for record in eval_history if "loss" in record]
        if points:
            axes.plot(*zip(*points, strict=True), "o-", label="eval loss")
        axes.set_xlabel("optimizer step")
        axes.set_ylabel("loss")
        axes.grid(alpha=0.3)
        handles, labels = axes.get_legend_handles_labels()
        matches = [(record["step"], record["exact_match"]) for record in eval_history if "exact_match" in record]
        if matches:
            twin = axes.twinx()
            twin.plot(*zip(*matches, strict=True), "s--", color="tab:green", label="eval exact match")
            twin.set_ylabel("exact match")
            twin.set_ylim(-0.02, 1.02)
            more_handles, more_labels = twin.get_legend_handles_labels()
            handles, labels = handles + more_handles, labels + more_labels
        figure.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
        figure.tight_layout(rect=(0, 0, 1, 0.93))
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        path = self.run_dir / LOSS_PLOT
        atomic_write_bytes(path, buffer.getvalue())
        return path


def make_reporter(
    config: RunConfig, total_steps: int, device: torch.device, enabled: bool = True, initial_step: int = 0
) -> Reporter:
    """The run's Reporter, with the configured trackers started on rank 0 (continued when resuming)."""
    run_dir = Path(config.logging.run_dir)
    trackers = Trackers.start(config, run_dir, resumed=initial_step > 0) if enabled else None
    return Reporter(
        run_dir,
        total_steps,
        enabled=enabled,
        progress_bar=config.logging.progress_bar,
        tensorboard="tensorboard" in config.logging.active_trackers,
        log_every=config.logging.every_steps,
        initial_step=initial_step,
        device=device,
        trackers=trackers,
    )


def final_values(result) -> dict:
    """What the trackers' summaries record at the end (`result` is a run.TrainResult)."""
    values = {"final_loss": result.final_loss, "steps": result.steps, "tokens_per_second": result.tokens_per_second}
    values.update({f"final_eval_{name}": value for name, value in result.eval_metrics.items()})
    values["peak_memory_bytes"] = result.peak_memory_bytes
    return values


def summary_text(result) -> str:
    """The end-of-run summary printed on rank 0 (`result` is a run.TrainResult)."""
    lines = [f"tigon run finished: {result.steps} optimizer steps"]
    if result.resumed_from_step:
        lines[0] += f" (resumed from step {result.resumed_from_step})"
    if result.losses:
        lines.append(f"  train loss        {result.losses[0]:.4f} -> {result.final_loss:.4f} (first -> final step)")
    for name, value in (result.objective_metrics or {}).items():
        lines.append(f"  {name:<17} {value:.4f} (final step)")
    history = result.eval_history
    if history:
        first, last = history[0], history[-1]
        for name in last:
            if name == "step":
                continue
            if len(history) > 1 and name in first:
                change = f"{first[name]:.4f} (step {first['step']}) -> {last[name]:.4f} (step {last['step']})"
                lines.append(f"  eval {name:<12} {change}")
            else:
                lines.append(f"  eval {name:<12} {last[name]:.4f} (step {last['step']})")
    lines.append(f"  throughput        {format_count(result.tokens_per_second)} tokens/s")
    where = "GPU allocated" if result.device.startswith("cuda") else "process resident"
    lines.append(f"  peak memory       {format_bytes(result.peak_memory_bytes)} ({where})")
    lines.append(f"  run directory     {result.run_dir}")
    lines.append(f"    metrics         {Path(result.run_dir) / METRICS_FILE}")
    lines.append(f"    loss curve      {Path(result.run_dir) / LOSS_PLOT}")
    if result.tensorboard_dir:
        lines.append(f"    tensorboard     {result.tensorboard_dir}")
    if result.checkpoint_dir:
        lines.append(f"    checkpoint      {result.checkpoint_dir}")
    if result.export_dir:
        lines.append(f"    export          {result.export_dir}")
    if result.hub_url:
        lines.append(f"    on the Hub      {result.hub_url}")
    if result.profile:
        lines.append(
            f"    profile         {Path(result.run_dir) / PROFILE_FILE}, {Path(result.run_dir) / PROFILE_TRACE}"
        )
        profiled = profile_text(result.profile).splitlines()
        lines.append(f"  profiled step     {profiled[0]}")
        lines += [f"  {line}" for line in profiled[1:]]
    return "\n".join(lines)


def write_summary(run_dir: str | Path, summary: dict) -> Path:
    path = Path(run_dir) / SUMMARY_FILE
    atomic_write_text(path, json.dumps(summary, indent=2, default=str) + "\n")
    return path
