"""The plain PyTorch trainer on a tiny Llama: loss falls, accumulation and DDP change nothing but rounding.

`tiny_config` (tests/runtime/configs.py) builds a run of a 2-layer, 32-wide Llama with tigon's character
tokenizer on a generated arithmetic task.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.runtime.configs import TINY_MODEL, tiny_config
from tests.runtime.worker_groups import process_env, torchrun, train_with_a_failing_rank
from tigon.runtime.batches import (
    GlobalBatchSampler,
    balanced_slots,
    collate,
    item_costs,
    label_tokens,
    token_loss_sum,
    train_order,
)
from tigon.runtime.config import ConfigError, TrainingConfig
from tigon.runtime.optim import build_optimizer, lr_factor, param_groups
from tigon.runtime.trainer import train

ROOT = Path(__file__).resolve().parents[2]
# The fused loss without the layer kernels, for tests of the loss: those would only add Triton interpreter time
LOSS_KERNEL_ONLY = {"enabled": True, "rms_norm": False, "rope": False, "swiglu": False}


def test_loss_falls_with_kernels_and_run_dir_is_complete(tmp_path, restore_rope, capsys):
    """All three kernels on, run through Triton's interpreter on the CPU (RoPE there costs ~30 ms per token)."""
    config = tiny_config(
        tmp_path,
        data={"max_seq_len": 16},
        training={"max_steps": 6, "micro_batch_size": 2},
        kernels={"enabled": True},
        logging={"tensorboard": True, "every_steps": 2, "profile_step": 5},
        eval={"every_steps": 3, "metrics": ["loss"], "max_batches": 1},
    )
    result = train(config)
    assert result.steps == 6 and len(result.losses) == 6
    assert result.final_loss < 0.75 * result.losses[0], result.losses
    assert "rms_norm x5" in result.kernels and "gated_mlp x2" in result.kernels and "rope" in result.kernels
    assert [record["step"] for record in result.eval_history] == [0, 3, 6]
    assert result.eval_history[-1]["loss"] < result.eval_history[0]["loss"]
    assert result.tokens_per_second > 0 and result.peak_memory_bytes > 0

    run = Path(result.run_dir)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if "loss" in r]
    assert train_steps == [1, 2, 4, 6]
    assert {"loss", "lr", "grad_norm", "tokens_per_second", "memory_bytes"} <= set(records[1])
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 3, 6]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((run / "tensorboard").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["losses"] == result.losses
    assert not [p for p in run.iterdir() if p.name.startswith(".")], "temporary files left behind"
    profile = json.loads((run / "profile.json").read_text())  # step 5, on the CPU: aten ops by their own time
    assert profile == summary["profile"] == result.profile and profile["kinds_ms"]["matmul"] > 0
    assert 0 < profile["busy_ms"] <= profile["step_ms"]
    assert json.loads((run / "trace.json").read_text())["traceEvents"]

    printed = capsys.readouterr().out
    assert "tigon run finished: 6 optimizer steps" in printed
    assert f"{result.losses[0]:.4f} -> {result.final_loss:.4f}" in printed
    assert "tokens/s" in printed and "peak memory" in printed and str(run / "loss.png") in printed
    assert "profiled step" in printed and "matmul" in printed and "outside aten ops" in printed


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path):
    """2 x micro-batch 2 and 4 x micro-batch 1 == 1 x micro-batch 4: relative loss difference under 1e-5.

    Micro-batches hold different numbers of label tokens, so this only holds because every step's loss
    is normalized by the label tokens of the whole global batch (not averaged per micro-batch).
    """
    runs = {}
    for micro, accumulation in [(4, 1), (2, 2), (1, 4)]:
        config = tiny_config(
            tmp_path,
            training={"micro_batch_size": micro, "gradient_accumulation_steps": accumulation, "max_steps": 5},
            logging={"run_dir": str(tmp_path / f"run-{micro}x{accumulation}")},
        )
        runs[micro, accumulation] = train(config).losses
    reference = runs[4, 1]
    assert reference[-1] < reference[0]
    for key, losses in runs.items():
        for step, (got, want) in enumerate(zip(losses, reference, strict=True), start=1):
            assert abs(got - want) <= 1e-5 * abs(want), (key, step, got, want)


def test_loss_is_token_mean_over_label_tokens(tmp_path):
    """token_loss_sum / label tokens equals the Hugging Face model's own (shifted, mean) loss."""
    from tigon.runtime.data import build_datasets
    from tigon.runtime.model import build_model
    from tigon.runtime.tokenizer import load_tokenizer

    config = tiny_config(tmp_path)
    tokenizer = load_tokenizer(config.model)
    dataset, _, _ = build_datasets(config, tokenizer)
    torch.manual_seed(0)
    model = build_model(config, len(tokenizer), tokenizer)
    batch = collate([dataset[i] for i in range(3)])
    summed = token_loss_sum(model, batch, "sdpa", torch.device("cpu"), "fp32")
    from tigon.runtime.data import model_inputs

    expected = model(**model_inputs(batch, "sdpa")).loss
    assert torch.allclose(summed / label_tokens(batch["labels"]), expected, rtol=1e-5)


def test_fused_loss_switch_keeps_the_loss_sum(tmp_path):
    """kernels.fused_linear_cross_entropy: the training loss without logits equals the one from full logits, and so
    does the fused loss over only the positions with a label (the instructions' prompts carry none)."""
    from tigon.runtime.data import build_datasets
    from tigon.runtime.model import build_model
    from tigon.runtime.tokenizer import load_tokenizer

    sums = {}
    for fused, skip in ((True, True), (True, False), (False, True)):
        config = tiny_config(tmp_path, kernels={**LOSS_KERNEL_ONLY, "fused_linear_cross_entropy": fused})
        tokenizer = load_tokenizer(config.model)
        dataset, _, _ = build_datasets(config, tokenizer)
        torch.manual_seed(0)
        model = build_model(config, len(tokenizer), tokenizer).train()  # the fused loss is the training path
        assert ("fused_linear_cross_entropy" in model.tigon_patch_report.applied) is fused
        keywords = []
        model.register_forward_pre_hook(
            lambda _, args, kwargs, seen=keywords: seen.append(set(kwargs)), with_kwargs=True
        )
        batch = collate([dataset[i] for i in range(3)])
        sums[fused, skip] = token_loss_sum(model, batch, "sdpa", torch.device("cpu"), "fp32", skip)
        assert ("loss_positions" in keywords[0]) is (fused and skip)
    assert torch.allclose(sums[True, True], sums[False, True], rtol=1e-6)
    assert torch.allclose(sums[True, False], sums[False, True], rtol=1e-6)


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_the_adapters_skip_the_prompts_with_the_same_losses(tmp_path, trainer, monkeypatch):
    """kernels.skip_unlabelled under the HF Trainer and Lightning (the torch trainer's loss: the test above): the
    micro-batches carry loss positions (the arithmetic prompts are most of each row) and the run's losses are those
    of the run without."""
    pytest.importorskip("lightning")
    import tigon.runtime.data as data
    from tests.runtime.configs import adapter_config
    from tests.runtime.worker_groups import RELATIVE_TOLERANCE

    found = []
    positions_with_loss = data.positions_with_loss
    monkeypatch.setattr(
        data, "positions_with_loss", lambda labels: found.append(positions_with_loss(labels)) or found[-1]
    )
    losses = {}
    for skip in (False, True):
        kernels = {**LOSS_KERNEL_ONLY, "skip_unlabelled": skip}
        config = adapter_config(tmp_path, trainer, kernels=kernels, logging={"run_dir": str(tmp_path / f"run-{skip}")})
        losses[skip] = train(config).losses
        assert bool(found) is skip and all(positions is not None for positions in found)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False], strict=True))
    assert len(losses[True]) == 6 and worst < RELATIVE_TOLERANCE, losses


def test_a_prepared_model_checks_its_labels_on_the_host(tmp_path):
    """`prepare` checks the data's labels against the tokenizer once and builds the model with the fused loss's
    device check off (it would sync every forward); a model built on its own keeps that check."""
    from tigon.kernels.patching.causal_lm import CHECK_TARGETS
    from tigon.runtime.model import build_model
    from tigon.runtime.run import prepare
    from tigon.runtime.tokenizer import load_tokenizer

    config = tiny_config(tmp_path, kernels=LOSS_KERNEL_ONLY)
    prepared = prepare(config)
    assert prepared.model.__dict__[CHECK_TARGETS] is False
    tokenizer = load_tokenizer(config.model)
    assert build_model(config, len(tokenizer), tokenizer).__dict__[CHECK_TARGETS] is True
    batch = collate([prepared.train_dataset[0]])
    batch["labels"][0, -1] = len(tokenizer) + 7
    model = build_model(config, len(tokenizer), tokenizer).train()
    with pytest.raises(ValueError, match=f"= {len(tokenizer) + 7} is out of range"):
        token_loss_sum(model, batch, "sdpa", torch.device("cpu"), "fp32")


def test_loss_chunk_tokens_from_the_config_reach_the_model(tmp_path):
    """kernels.loss_chunk_tokens: a number is the fused loss's chunk; auto lets the planner choose (here: the op's
    own rule, since a micro-batch of this tiny run is one chunk under it); the loss is the same either way."""
    from tigon.kernels.patching.causal_lm import LOSS_CHUNK_TOKENS
    from tigon.runtime.data import build_datasets
    from tigon.runtime.model import build_model
    from tigon.runtime.tokenizer import load_tokenizer

    sums = {}
    for chunk in ("auto", 5):
        config = tiny_config(tmp_path, kernels={**LOSS_KERNEL_ONLY, "loss_chunk_tokens": chunk})
        tokenizer = load_tokenizer(config.model)
        dataset, _, _ = build_datasets(config, tokenizer)
        torch.manual_seed(0)
        model = build_model(config, len(tokenizer), tokenizer).train()
        assert model.__dict__[LOSS_CHUNK_TOKENS] == (None if chunk == "auto" else chunk)
        sums[chunk] = token_loss_sum(
            model, collate([dataset[i] for i in range(3)]), "sdpa", torch.device("cpu"), "fp32"
        )
    assert torch.allclose(sums["auto"], sums[5], rtol=1e-6)


def test_auto_loss_chunk_leaves_models_outside_the_kernel_table_alone(tmp_path):
    """A family the kernels do not patch has no fused loss: auto resolves to None without asking the planner
    (whose decoder shape does not fit GPT-2's config)."""
    import transformers

    from tigon.runtime.model import loss_chunk_tokens

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    assert loss_chunk_tokens(gpt2, tiny_config(tmp_path)) is None


def test_auto_loss_chunk_keeps_the_ops_rule_for_a_shape_the_planner_does_not_count(tmp_path):
    """A larger chunk is chosen from the planner's estimate of where the step peaks; for a model whose parameters
    the planner's decoder shape does not count (Nemotron's ungated MLP), that estimate is another model's, so auto
    keeps the op's own rule. Llama at the same widths gets the larger chunk."""
    import transformers

    from tigon.runtime.model import loss_chunk_tokens

    training = {"micro_batch_size": 4, "precision": "bf16", "gradient_checkpointing": True}
    model = {"config_name": "llama", "tokenizer": "char", "dtype": "bfloat16"}
    config = tiny_config(
        tmp_path, data={"max_seq_len": 4096}, training=training, model=model, kernels={"enabled": True}
    )
    heads = dict(num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    widths = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, vocab_size=128256, **heads)
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**widths))
        nemotron = transformers.NemotronForCausalLM(transformers.NemotronConfig(**widths))
    assert loss_chunk_tokens(llama, config) == 4096
    assert loss_chunk_tokens(nemotron, config) is None
    with torch.device("meta"):  # a vision-language model: its language tower is what the planner's shape counts
        llava = transformers.LlavaForConditionalGeneration(
            transformers.LlavaConfig(
                text_config=transformers.LlamaConfig(**widths),
                vision_config={"hidden_size": 256, "num_attention_heads": 4},
            )
        )
    assert loss_chunk_tokens(llava, config) == 4096


def _ddp_worker(tmp_path: Path) -> Path:
    """A script for torchrun: `tigon train CONFIG` through the CLI, then this rank's losses and parameters."""
    script = tmp_path / "ddp_worker.py"
    script.write_text(
        "import json, os, sys, torch\n"
        "from tigon.runtime import cli, trainer\n"
        "captured = {}\n"
        "prepare, train = trainer.prepare, trainer.train\n"
        "trainer.prepare = lambda config, *rest: captured.setdefault('prepared', prepare(config, *rest))\n"
        "trainer.train = lambda config, *rest: captured.setdefault('result', train(config, *rest))\n"
        "status = cli.main(['train', sys.argv[1]])\n"
        "result, model = captured['result'], captured['prepared'].model\n"
        "params = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])\n"
        "record = {'status': status, 'losses': result.losses, 'world_size': result.world_size,\n"
        "          'checksum': params.sum().item(), 'first': params[:64].tolist()}\n"
        "with open(sys.argv[2] + f\"/rank{os.environ['RANK']}.json\", 'w') as f:\n"
        "    json.dump(record, f)\n"
    )
    return script


def test_ddp_two_processes_over_gloo_agree_with_one_process(tmp_path):
    """torchrun (the `tigon train` CLI in each process), 2 ranks x micro-batch 2 == 1 process x micro-batch 4.

    Tolerance: relative loss difference under 1e-4 per step (the gloo all-reduce sums gradients in another
    order than one process does).
    """
    import yaml

    config = tiny_config(tmp_path, training={"micro_batch_size": 2, "max_steps": 6})
    config_file = tmp_path / "ddp.yaml"
    raw = config.model_dump(mode="json")
    raw["logging"]["run_dir"] = str(tmp_path / "ddp-run")
    raw["checkpoint"] = {**raw["checkpoint"], "every_steps": 3, "export": True}
    config_file.write_text(yaml.safe_dump(raw))
    env = process_env(OMP_NUM_THREADS="1")
    command = [*torchrun(2), str(_ddp_worker(tmp_path)), str(config_file), str(tmp_path)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["world_size"] == 2 and ranks[0]["status"] == ranks[1]["status"] == 0
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["first"] == ranks[1]["first"] and ranks[0]["checksum"] == ranks[1]["checksum"]
    losses = ranks[0]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert (tmp_path / "ddp-run" / "checkpoints" / "step-6" / "rng-rank1.pt").is_file()
    assert (tmp_path / "ddp-run" / "export" / "config.json").is_file()

    single = train(tiny_config(tmp_path, training={"micro_batch_size": 4, "max_steps": 6}))
    for got, want in zip(losses, single.losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (losses, single.losses)


def test_exact_match_evaluation_by_greedy_decoding(tmp_path):
    config = tiny_config(tmp_path, training={"max_steps": 2}, eval={"metrics": ["loss", "exact_match"]})
    result = train(config)
    assert set(result.eval_metrics) == {"loss", "exact_match"}
    assert 0.0 <= result.eval_metrics["exact_match"] <= 1.0
    assert math.isfinite(result.eval_metrics["loss"])


def test_epochs_bf16_autocast_and_gradient_checkpointing(tmp_path):
    config = tiny_config(
        tmp_path,
        n_train=48,
        training={
            "max_steps": None,
            "epochs": 2,
            "precision": "bf16",
            "gradient_checkpointing": True,
            "micro_batch_size": 2,
        },
        eval={"metrics": []},
    )
    result = train(config)
    from tigon.runtime.data import build_datasets
    from tigon.runtime.tokenizer import load_tokenizer

    dataset, _, _ = build_datasets(config, load_tokenizer(config.model))
    assert result.steps == 2 * (len(dataset) // 2)
    assert all(math.isfinite(loss) for loss in result.losses) and result.losses[-1] < result.losses[0]


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
def test_each_step_trains_the_inputs_made_while_the_previous_step_ran(tmp_path, monkeypatch, attention):
    """Two epochs with an evaluation between steps: every step's inputs are made once, ahead of it (across the epoch
    boundary too), and the losses are those of a run that makes each step's inputs when the step starts."""
    from tigon.runtime import torch_trainer

    def run(name):
        config = tiny_config(
            tmp_path / name,
            n_train=40,
            model={"attn_implementation": attention},
            training={"max_steps": None, "epochs": 2, "micro_batch_size": 1, "gradient_accumulation_steps": 2},
            eval={"every_steps": 3, "metrics": []},
        )
        return config, train(config)

    made = []
    step_inputs = torch_trainer.step_inputs
    monkeypatch.setattr(torch_trainer, "step_inputs", lambda *args: made.append(args) or step_inputs(*args))
    config, ahead = run("ahead")
    from tigon.runtime.data import build_datasets
    from tigon.runtime.tokenizer import load_tokenizer

    per_epoch = len(build_datasets(config, load_tokenizer(config.model))[0]) // 2
    assert per_epoch >= 2 and ahead.steps == 2 * per_epoch, (per_epoch, ahead.steps)
    assert len(made) == ahead.steps  # none made twice, none made and dropped

    monkeypatch.setattr(torch_trainer.InputsAhead, "make_ahead", lambda self, position: None)
    made.clear()
    _, at_start = run("at_start")
    assert len(made) == at_start.steps
    assert ahead.losses == at_start.losses


def test_next_position_rolls_over_into_the_next_epoch():
    from tigon.runtime.torch_trainer import next_position

    assert next_position((0, 0), 3) == (0, 1)
    assert next_position((0, 2), 3) == (1, 0)
    assert next_position((4, 0), 1) == (5, 0)


def test_lora_trains_only_adapters(tmp_path):
    config = tiny_config(tmp_path, training={"max_steps": 3}, lora={"enabled": True, "r": 4})
    from tigon.runtime import trainer

    prepared = trainer.prepare(config)
    before = {n: p.detach().clone() for n, p in prepared.model.named_parameters()}
    trainer.train_prepared(config, prepared)
    changed = {n for n, p in prepared.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in name for name in changed)


def test_global_batch_order_does_not_depend_on_the_split():
    def step_indices(micro, accumulation, world):
        samplers = [GlobalBatchSampler(40, micro, accumulation, world, rank, seed=3) for rank in range(world)]
        return [
            sorted(i for s in samplers for mb in s.micro_batches(epoch, batch) for i in mb)
            for epoch in range(2)
            for batch in range(samplers[0].batches_per_epoch)
        ]

    reference = step_indices(4, 1, 1)
    assert step_indices(2, 2, 1) == reference == step_indices(2, 1, 2) == step_indices(1, 2, 2)
    assert reference[0] != reference[10], "epochs must be reshuffled"
    rank0 = GlobalBatchSampler(40, 2, 1, 2, 0, seed=3).micro_batches(0, 0)[0]
    rank1 = GlobalBatchSampler(40, 2, 1, 2, 1, seed=3).micro_batches(0, 0)[0]
    assert not set(rank0) & set(rank1)


def row_costs(n_rows: int, seed: int = 0) -> list[int]:
    """Tokens per packed row of mixed-length documents filled in order: rows of 4096 slots, 55-100% real tokens."""
    generator = torch.Generator().manual_seed(seed)
    return (2250 + torch.randint(0, 1847, (n_rows,), generator=generator)).tolist()


def micro_batch_spread(samplers: list[GlobalBatchSampler], costs: list[int], batch: int) -> float:
    """Summed over the global batch's micro-batch positions: the fullest rank's tokens over the mean rank's."""
    per_rank = [[sum(costs[i] for i in mb) for mb in s.micro_batches(0, batch)] for s in samplers]
    fullest = sum(max(ranks) for ranks in zip(*per_rank, strict=True))
    return fullest * len(samplers) / sum(map(sum, per_rank))


@pytest.mark.parametrize("micro, accumulation, world", [(4, 2, 4), (8, 1, 4), (2, 4, 2)])
def test_balanced_micro_batches_train_the_same_global_batch_with_even_tokens(micro, accumulation, world):
    """With costs, each global batch's rows are dealt so the ranks' micro-batches hold about as many tokens; the
    global batch itself, and so the step, is the one the plain order gives."""
    costs = row_costs(400)

    def samplers(with_costs: bool) -> list[GlobalBatchSampler]:
        return [
            GlobalBatchSampler(400, micro, accumulation, world, rank, seed=3, costs=costs if with_costs else None)
            for rank in range(world)
        ]

    plain, balanced = samplers(False), samplers(True)
    for batch in range(plain[0].batches_per_epoch):
        dealt = [mb for s in balanced for mb in s.micro_batches(0, batch)]
        assert all(len(mb) == micro for mb in dealt)
        assert sorted(i for mb in dealt for i in mb) == sorted(
            i for s in plain for mb in s.micro_batches(0, batch) for i in mb
        )
    plain_spread, balanced_spread = (
        sum(micro_batch_spread(s, costs, batch) for batch in range(10)) / 10 for s in (plain, balanced)
    )
    assert plain_spread > 1.04 and balanced_spread < 1.01, (plain_spread, balanced_spread)


def test_balanced_slots_even_out_costs_deterministically():
    assert balanced_slots([0, 1, 2, 3, 4, 5], [9, 1, 1, 8, 1, 2], slots=2, size=3) == [
        [0, 1, 2],
        [3, 4, 5],
    ]  # 11 and 11
    costs = row_costs(64, seed=1)
    items = list(range(63, -1, -1))
    groups = balanced_slots(items, costs, slots=8, size=8)
    assert groups == balanced_slots(items, costs, slots=8, size=8)
    totals = [sum(costs[i] for i in group) for group in groups]
    assert max(totals) - min(totals) < 0.005 * sum(totals) / 8, totals
    assert all(group == sorted(group, reverse=True) for group in groups)  # each group keeps the items' order
    with pytest.raises(ValueError, match="6 items cannot fill 4 groups of 2"):
        balanced_slots(list(range(6)), [1] * 6, slots=4, size=2)
    with pytest.raises(ValueError, match="costs has 3 entries for 4 items"):
        GlobalBatchSampler(4, 1, 1, 1, 0, seed=0, costs=[1, 2, 3])


def test_items_cost_their_unpadded_tokens_only_under_varlen_attention(tmp_path, caplog):
    """Varlen attention drops a packed row's padding, so rows cost their tokens up to the last labelled one; under
    other attention, or with data.balance_micro_batches off, every row costs the same (no costs). The torch
    trainer's ranks and the HF Trainer's stream deal the same micro-batches, and each says so once."""
    from tests.runtime.configs import adapter_config
    from tigon.runtime.data import build_datasets, labelled_lengths
    from tigon.runtime.hf_trainer import epoch_order
    from tigon.runtime.tokenizer import load_tokenizer

    config = adapter_config(tmp_path, "torch", model={"attn_implementation": "varlen"})
    dataset, _, _ = build_datasets(config, load_tokenizer(config.model))
    costs = item_costs(config, dataset)
    assert costs == labelled_lengths(dataset.labels).tolist() and len(set(costs)) > 1
    off = config.model_copy(update={"data": config.data.model_copy(update={"balance_micro_batches": False})})
    sdpa = config.model_copy(update={"model": config.model.model_copy(update={"attn_implementation": "sdpa"})})
    assert item_costs(off, dataset) is None and item_costs(sdpa, dataset) is None

    world = 2
    balanced = "micro-batches balanced: each global batch's rows dealt by their unpadded tokens"
    with caplog.at_level("INFO", logger="tigon.runtime"):
        ranks = [train_order(config, dataset, world, rank) for rank in range(world)]
        assert caplog.messages.count(balanced) == 1  # rank 0's
        stream = epoch_order(config, dataset, world, log=True)  # accelerate deals micro-batch k to rank k % W
        assert caplog.messages.count(balanced) == 2
    plain = GlobalBatchSampler(len(dataset), 2, 2, world, 0, seed=config.training.seed)
    assert any(ranks[0].micro_batches(0, b) != plain.micro_batches(0, b) for b in range(plain.batches_per_epoch))
    for batch in range(stream.batches_per_epoch):
        dealt = stream.micro_batches(0, batch)
        assert [dealt[k::world] for k in range(world)] == [r.micro_batches(0, batch) for r in ranks]


def test_learning_rate_schedules():
    def factors(schedule):
        training = TrainingConfig(max_steps=10, lr_schedule=schedule, warmup_steps=2)
        return [lr_factor(step, training, 10) for step in range(10)]

    assert factors("constant") == [0.5] + [1.0] * 9
    linear, cosine = factors("linear"), factors("cosine")
    assert linear[:3] == [0.5, 1.0, 1.0] and linear[-1] == pytest.approx(1 - 7 / 8)
    assert (
        cosine[2] == 1.0
        and cosine[6] == pytest.approx(0.5)
        and all(a >= b for a, b in zip(cosine[2:], cosine[3:], strict=False))
    )


def test_weight_decay_skips_norms_and_biases(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=50)
    )
    model.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(16))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert {names[id(p)] for p in no_decay["params"]} >= {"model.norm.weight", "model.layers.0.self_attn.q_proj.bias"}
    assert no_decay["weight_decay"] == 0.0
    optimizer = build_optimizer(model, TrainingConfig(max_steps=1, weight_decay=0.1))
    assert len(optimizer.param_groups) == 2


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"trainer": "hf", "eval": {"every_steps": 2}, "data": {"eval": None}}, "data.eval is not"),
        ({"training": {"micro_batch_size": 64}}, "fill no global batch"),
        ({"data": {"max_seq_len": 128}}, "max_position_embeddings"),
        ({"eval": {"metrics": ["exact_match"]}, "data": {"format": "text", "text_field": "instruction"}}, "'chat'"),
        ({"lora": {"enabled": True, "target_modules": ["qkv"]}}, "lora.target_modules"),
        ({"model": {"path": "/nonexistent/model", "config_name": None}}, "/nonexistent/model does not exist"),
        ({"logging": {"profile_step": 99}}, "logging.profile_step: 99 is past the run's last step"),
        ({"trainer": "lightning", "logging": {"profile_step": 1}}, "profiles a step of the torch trainer"),
        (
            {"model": {"config_overrides": {**TINY_MODEL, "hidden_sizee": 48}}},
            "model.config_overrides.hidden_sizee: not a field of LlamaConfig (did you mean 'hidden_size'?)",
        ),
        (
            {"model": {"config_overrides": {**TINY_MODEL, "hidden_size": 33}}},
            "hidden_size 33 is not divisible by num_attention_heads 2",
        ),
        (
            {"model": {"config_overrides": {**TINY_MODEL, "num_attention_heads": 4, "num_key_value_heads": 3}}},
            "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
        ),
        ({"model": {"config_name": "lama"}}, "model.config_name: unknown model type 'lama' (did you mean 'llama'?)"),
    ],
)
def test_setup_errors_name_the_setting(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(tiny_config(tmp_path, **sections))


def test_a_diverging_fp32_run_is_not_blamed_on_fp16(tmp_path):
    """A learning rate of 1e30 without clipping makes the fp32 loss non-finite within a few steps."""
    config = tiny_config(tmp_path, training={"learning_rate": 1e30, "max_grad_norm": None, "max_steps": 8})
    with pytest.raises(FloatingPointError) as error:
        train(config)
    message = str(error.value)
    assert "lower training.learning_rate, set training.max_grad_norm" in message
    assert "not an fp16 overflow" in message and "use bf16" not in message


def test_a_warmup_longer_than_the_run_is_stated(tmp_path, caplog):
    config = tiny_config(tmp_path, training={"max_steps": None, "epochs": 0.25, "warmup_steps": 8})
    with caplog.at_level("WARNING", logger="tigon.runtime"):
        assert train(config).steps == 2
    assert "training.warmup_steps (8) is longer than the run (2 steps): the learning rate ends at 25%" in caplog.text


def test_examples_train_for_two_steps(tmp_path, monkeypatch):
    """Every shipped example config trains (two steps, tiny run dir) from the repository root. The objectives' fused
    losses take their CPU references (TRITON_INTERPRET unset): the configs are what is tested here, the kernels are
    tested on their own, and Triton's interpreter would take most of the time."""
    from tigon.runtime.config import load_config

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        overrides = [
            "training.max_steps=2",
            "training.epochs=null",
            f"logging.run_dir={tmp_path / path.stem}",
            "eval.every_steps=0",
            "eval.max_batches=1",
            "kernels.enabled=false",
            "checkpoint.every_steps=0",
        ]
        if path.stem == "distill":  # its teacher is the demo's export, trained first as its comment says
            overrides.append(f"objective.teacher.path={tmp_path / 'demo' / 'export'}")
        result = train(load_config(path, overrides))
        assert result.steps == 2 and all(math.isfinite(x) for x in result.losses), path


def test_checkpointing_some_layers_recomputes_those_and_trains_the_same(tmp_path):
    from tigon.runtime.model import build_model

    some = tiny_config(
        tmp_path / "some", training={"max_steps": 3, "gradient_checkpointing": True, "checkpoint_layers": 1}
    )
    model = build_model(some, 64)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]
    none = train(tiny_config(tmp_path / "none", training={"max_steps": 3}))
    assert train(some).losses == none.losses  # recomputing a layer changes no value


def test_the_allocator_gets_expandable_segments_unless_configured(monkeypatch):
    """Set before CUDA starts on a machine with a GPU (the GPU test checks the segments); a user's setting, a CPU
    machine and an initialized CUDA are left alone."""
    from tigon.runtime.distributed import ALLOCATOR_VARIABLE, configure_allocator

    monkeypatch.delenv(ALLOCATOR_VARIABLE, raising=False)
    configure_allocator()
    assert ALLOCATOR_VARIABLE not in os.environ  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(ALLOCATOR_VARIABLE, "backend:native")
    configure_allocator()
    assert os.environ[ALLOCATOR_VARIABLE] == "backend:native"
    monkeypatch.delenv(ALLOCATOR_VARIABLE)
    configure_allocator()
    assert os.environ[ALLOCATOR_VARIABLE] == "expandable_segments:True"


def test_a_failing_rank_logs_its_error_before_leaving_the_process_group(monkeypatch, caplog):
    """Leaving the group waits for the other ranks, which may never come: the error is in the log first."""
    from tigon.runtime.distributed import shutdown

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with caplog.at_level("ERROR", logger="tigon.runtime"):
        shutdown(ValueError("one process: the CLI prints it"))
        assert caplog.records == []
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
        shutdown(torch.OutOfMemoryError("CUDA out of memory"))
        shutdown()  # a run that finished
    assert [record.getMessage() for record in caplog.records] == ["rank 1 of 2 failed: CUDA out of memory"]


def test_a_rank_that_fails_mid_run_ends_the_job_with_its_error(tmp_path):
    """2 ranks over gloo; rank 1's third optimizer step raises (benchmarks/rank_fault) while rank 0 goes on into
    the next step: the job ends, non-zero, with rank 1's error logged by the runtime before it left the group."""
    config = tiny_config(tmp_path, training={"micro_batch_size": 2, "max_steps": 6}, eval={"metrics": []})
    done = train_with_a_failing_rank(tmp_path, config, 2)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "rank 1 of 2 failed: injected fault on rank 1 at optimizer step 3" in output, output[-3000:]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics if '"loss"' in line] == [1, 2]  # the steps before it


def test_a_rank_that_hangs_ends_the_job_after_the_collective_timeout(tmp_path):
    """2 ranks over gloo; rank 1 stops for good in its third optimizer step (benchmarks/rank_fault, FAULT_KIND=hang)
    while rank 0 goes on into the next step's collectives: after parallelism.collective_timeout_minutes (0.2 here,
    12 s) rank 0's collective fails, the runtime logs it, and torchrun ends the job, non-zero, where the default
    timeout would have held it for 30 minutes."""
    sections = {"eval": {"metrics": []}, "parallelism": {"collective_timeout_minutes": 0.2}}
    config = tiny_config(tmp_path, training={"micro_batch_size": 2, "max_steps": 6}, **sections)
    done = train_with_a_failing_rank(tmp_path, config, 2, kind="hang")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert re.search(r"rank 0 of 2 failed: .*Timed out waiting 12000ms", output), output[-3000:]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics if '"loss"' in line] == [1, 2]
