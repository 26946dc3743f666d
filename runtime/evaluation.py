"""Evaluation, shared by the three trainers: the held-out loss (or a post-training objective's), exact match by
greedy decoding, and the run's schedule of evaluations (`Evaluation`)."""

from __future__ import annotations

import torch
from torch import nn

from tigon.runtime import checkpoint as ckpt
from tigon.runtime.batches import autocast, collate, eval_batches, label_tokens, token_loss_sum
from tigon.runtime.config import RunConfig
from tigon.runtime.data import generation_examples
from tigon.runtime.distill import evaluate_distill
from tigon.runtime.distributed import DistEnv, all_reduce_sum, unwrap
from tigon.runtime.objectives import evaluate_objective
from tigon.runtime.reporting import Reporter
from tigon.runtime.run import Prepared
from tigon.runtime.tasks import exact_match


def eval_loss(model: nn.Module, dataset, config: RunConfig, env: DistEnv, device: torch.device) -> float:
    """Token-level cross-entropy over the held-out sequences (this rank's share, summed over ranks)."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch_indices in eval_batches(dataset, config, env):
        batch = collate([dataset[i] for i in batch_indices or [0]])
        summed = token_loss_sum(model, batch, config.model.attn_implementation, device, config.training.precision)
        if batch_indices:
            totals[0] += summed
            totals[1] += label_tokens(batch["labels"])
    all_reduce_sum(totals, env)
    return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")


def exact_match_rate(
    model: nn.Module,
    tokenizer,
    examples: list[tuple[list[int], str]],
    config: RunConfig,
    env: DistEnv,
    device: torch.device,
    batch_size: int = 64,
) -> float:
    """Greedy-decode this rank's share of the prompts and score them; the fraction correct over all ranks.

    Prompts are batched by token length, so no padding (and no attention-mask subtleties) is involved.
    """
    # Sharded weights: every forward is a collective, so each rank decodes all prompts (the same calls on every
    # rank); the all-reduced counts are then world_size times larger, which leaves the fraction unchanged.
    share = examples if config.parallelism.shards_parameters else examples[env.rank :: env.world_size]
    if config.eval.max_batches is not None:
        share = share[: config.eval.max_batches * config.training.micro_batch_size]
    encoded = [(list(ids), response) for ids, response in share]
    longest = max((len(tokenizer.encode(r, add_special_tokens=False)) for _, r in encoded), default=1) + 1
    by_length: dict[int, list[tuple[list[int], str]]] = {}
    for ids, response in encoded:
        by_length.setdefault(len(ids), []).append((ids, response))
    limit = getattr(unwrap(model).config, "max_position_embeddings", None)
    correct = 0
    for length, group in sorted(by_length.items()):
        new_tokens = longest if limit is None else max(1, min(longest, limit - length))
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            input_ids = torch.tensor([ids for ids, _ in chunk], device=device)
            # decoding runs compiled layers eagerly: each step changes the cache, which they would recompile for
            with autocast(device, config.training.precision), torch.compiler.set_stance("force_eager"):
                output = unwrap(model).generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    use_cache=True,
                )
            for row, (_, response) in zip(output[:, length:].tolist(), chunk, strict=True):
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id)]
                correct += exact_match(tokenizer.decode(row, skip_special_tokens=True), response)
    totals = all_reduce_sum(torch.tensor([correct, len(share)], dtype=torch.float64, device=device), env)
    return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")


def evaluate(
    model: nn.Module,
    dataset,
    tokenizer,
    config: RunConfig,
    env: DistEnv,
    device: torch.device,
    examples: list[tuple[list[int], str]] | None = None,
) -> dict[str, float]:
    """The configured metrics; random states are left as they were, so evaluating never changes training."""
    metrics: dict[str, float] = {}
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        if "loss" in config.eval.metrics and config.objective.preference:
            metrics.update(evaluate_objective(unwrap(model), dataset, config, env, device))
        elif "loss" in config.eval.metrics and config.objective.type == "distill":
            metrics.update(evaluate_distill(unwrap(model), dataset, config, env, device))
        elif "loss" in config.eval.metrics:
            metrics["loss"] = eval_loss(unwrap(model), dataset, config, env, device)
        if "exact_match" in config.eval.metrics and examples:
            metrics["exact_match"] = exact_match_rate(model, tokenizer, examples, config, env, device)
    model.train(was_training)
    return metrics


class Evaluation:
    """The run's evaluation schedule, shared by the three trainers: at step 0 (when `eval.every_steps` is set, so
    the summary shows the metric move), every `eval.every_steps`, and at the last step. Each result goes to the
    run's `TrainState.eval_history` (so a checkpoint keeps it) and to the reporter."""

    def __init__(self, config: RunConfig, prepared: Prepared, state: ckpt.TrainState, reporter: Reporter):
        self.config, self.prepared, self.state, self.reporter = config, prepared, state, reporter
        self.enabled = prepared.eval_dataset is not None and bool(config.eval.metrics)
        self.examples = None
        if self.enabled and "exact_match" in config.eval.metrics:
            self.examples = prepared.eval_examples
            if self.examples is None:  # tokenized here, unless pre-packed data brought them
                self.examples = generation_examples(config, prepared.tokenizer)

    def run(self) -> None:
        if not self.enabled:
            return
        prepared = self.prepared
        metrics = evaluate(
            prepared.model, prepared.eval_dataset, prepared.tokenizer, self.config, prepared.env, prepared.device,
            self.examples,
        )  # fmt: skip
        self.state.eval_history.append({"step": self.state.step, **metrics})
        self.reporter.evaluation(self.state.step, metrics)

    def start(self) -> None:
        """Before the first step of a run that starts from scratch."""
        if self.state.step == 0 and self.config.eval.every_steps > 0:
            self.run()

    def step_done(self, total_steps: int) -> None:
        """After each optimizer step (`state.step` already advanced), before its checkpoint is written."""
        every = self.config.eval.every_steps
        if every > 0 and self.state.step % every == 0 and self.state.step != total_steps:
            self.run()

    def finish(self) -> None:
        """At the end: the last step's metrics, unless they were just taken."""
        history = self.state.eval_history
        if not history or history[-1]["step"] != self.state.step:
            self.run()
