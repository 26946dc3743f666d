"""Distillation (`objective.type: distill`): the config and its errors, the vocabulary check, per-step equality with
a plain PyTorch loop on materialized logits, and DDP over gloo (2 ranks) against one process."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.runtime.configs import DISTILL_STEPS, distill_config, save_llama
from tests.runtime.worker_groups import launch, logged_steps, process_env
from tigon.runtime.config import ConfigError, parse_config
from tigon.runtime.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]


def test_distill_config_is_validated_with_the_fix(tmp_path):
    base = distill_config(tmp_path).model_dump(mode="json")
    objective = base["objective"]
    assert parse_config(base).objective.resolved_alpha == 0.3
    defaults = parse_config({**base, "objective": {"type": "distill", "teacher": objective["teacher"]}}).objective
    assert (defaults.resolved_alpha, defaults.resolved_beta, defaults.temperature) == (0.5, 0.5, 1.0)
    cases = [
        ({"type": "distill"}, "objective.type distill needs objective.teacher.path"),
        ({**objective, "alpha": 1.5}, "objective.alpha 1.5 weighs distill's cross entropy and 1 - alpha"),
        ({**objective, "beta": 1.5}, "objective.beta 1.5 mixes distill's two KL directions"),
        ({**objective, "gamma": 1.0}, "objective.gamma applies to simpo, not to objective.type 'distill'"),
        ({"type": "dpo", "temperature": 2.0}, "objective.temperature applies to distill, not to objective.type 'dpo'"),
        ({"type": "dpo", "beta": 0.0}, "objective.beta must be greater than 0 for dpo"),
        ({**objective, "teacher": {"path": "t", "revison": "main"}}, "objective.teacher.revison: unknown key"),
    ]
    for value, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config({**base, "objective": value})


def test_a_teacher_with_another_vocabulary_is_refused_before_training(tmp_path):
    bigger = save_llama(tmp_path / "bigger", seed=1, hidden=32, vocab_extra=3)
    config = distill_config(tmp_path, {"teacher": {"path": str(bigger)}})
    with pytest.raises(ConfigError, match=r"has a vocabulary of 103 tokens and the student's head 100: .* must share"):
        train(config)
    swapped = tmp_path / "swapped"  # the same size, two tokens' ids exchanged
    save_llama(swapped, seed=1, hidden=32)
    tokenizer_file = swapped / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    tokenizer_file.write_text(json.dumps(tokenizer))
    config = distill_config(tmp_path, {"teacher": {"path": str(swapped)}})
    with pytest.raises(ConfigError, match=r"has another tokenizer than the student \(token/id pairs in one only: "):
        train(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step


def reference_losses(config, steps: int) -> list[tuple[float, float, float]]:
    """(loss, cross entropy, JSD) per step of a plain PyTorch loop: both models' logits materialized, the JSD of
    `tigon.kernels.reference`, AdamW as the trainer builds it, on the trainer's micro-batches."""
    from transformers import AutoModelForCausalLM

    from tigon.kernels import reference
    from tigon.runtime.batches import GlobalBatchSampler, collate
    from tigon.runtime.data import build_datasets, model_inputs
    from tigon.runtime.optim import build_optimizer, build_scheduler
    from tigon.runtime.run import seed_everything
    from tigon.runtime.tokenizer import load_tokenizer

    objective, training = config.objective, config.training
    seed_everything(training.seed)
    tokenizer = load_tokenizer(config.model)
    dataset = build_datasets(config, tokenizer)[0]
    student = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(objective.teacher.path, dtype=torch.float32).eval()
    optimizer = build_optimizer(student, training)
    scheduler = build_scheduler(optimizer, training, steps)
    sampler = GlobalBatchSampler(len(dataset), training.micro_batch_size, training.gradient_accumulation_steps, 1, 0, 0)
    per_epoch = sampler.batches_per_epoch
    alpha = objective.resolved_alpha
    results = []
    for step in range(steps):
        batches = [collate([dataset[i] for i in chunk]) for chunk in sampler.micro_batches(*divmod(step, per_epoch))]
        n_label = sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in batches)
        totals = torch.zeros(2, dtype=torch.float64)
        for batch in batches:
            inputs = model_inputs(batch, config.model.attn_implementation)
            labels = inputs.pop("labels")
            target = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
            logits = student(**inputs, use_cache=False).logits.reshape(-1, len(tokenizer))
            with torch.no_grad():
                teacher_logits = teacher(**inputs, use_cache=False).logits.reshape(-1, len(tokenizer))
            ce = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
            jsd = reference.jsd(
                logits, teacher_logits, target, beta=objective.resolved_beta, temperature=objective.temperature,
                reduction="sum", from_logits=True,
            )  # fmt: skip
            ((alpha * ce + (1 - alpha) * jsd) / n_label).backward()
            totals += torch.stack([ce.detach(), jsd.detach()]).double()
        torch.nn.utils.clip_grad_norm_(student.parameters(), training.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        ce_loss, distill_loss = (float(total) / n_label for total in totals)
        results.append((alpha * ce_loss + (1 - alpha) * distill_loss, ce_loss, distill_loss))
    return results


def test_distill_matches_a_plain_pytorch_loop_step_by_step(tmp_path):
    """Per step, loss, ce_loss and distill_loss equal the loop on materialized logits to 1e-5 relative (fp32; the
    fused ops sum in chunks, in another order). The teacher is wider than the student (48 vs 32)."""
    config = distill_config(tmp_path)
    result = train(config)
    steps = logged_steps(result.run_dir)
    want = reference_losses(config, DISTILL_STEPS)
    got = [(step["loss"], step["ce_loss"], step["distill_loss"]) for step in steps]
    assert len(got) == DISTILL_STEPS and got[0][2] > 0.01
    for step_got, step_want in zip(got, want, strict=True):
        for a, b in zip(step_got, step_want, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (got, want)
    assert result.losses == [step[0] for step in got]
    assert result.objective_metrics == {"ce_loss": got[-1][1], "distill_loss": got[-1][2]}


def test_the_heads_project_only_the_completions(tmp_path):
    """kernels.skip_unlabelled: both heads get the positions with a target (the tests above train through it and
    meet the plain loop); without it every position, the same targets among them."""
    from tigon.runtime.batches import collate
    from tigon.runtime.data import build_datasets
    from tigon.runtime.distill import distill_inputs
    from tigon.runtime.tokenizer import load_tokenizer

    config = distill_config(tmp_path)
    dataset = build_datasets(config, load_tokenizer(config.model))[0]
    batch = collate([dataset[i] for i in range(4)])
    cpu = torch.device("cpu")
    inputs, target, positions = distill_inputs(batch, config, cpu, skip_prompts=True)
    _, every, none = distill_inputs(batch, config, cpu)
    assert none is None and positions is not None and len(target) == len(positions) < len(every) / 2
    assert torch.equal(target, every[positions]) and int((target != -100).sum()) == int((every != -100).sum())


def test_the_last_layer_computes_only_the_completions(tmp_path):
    """With the prompts skipped, the student's last layer runs its MLP on only the positions its head projects, and
    the states there and their gradients are the whole layer's (the teacher's forward takes the same rows)."""
    from tigon.kernels.patching import apply
    from tigon.kernels.patching.causal_lm import decoder_of
    from tigon.runtime.batches import collate
    from tigon.runtime.data import build_datasets
    from tigon.runtime.distill import at_positions, distill_inputs
    from tigon.runtime.model import build_model
    from tigon.runtime.objectives import final_hidden
    from tigon.runtime.tokenizer import load_tokenizer

    config = distill_config(tmp_path)
    tokenizer = load_tokenizer(config.model)
    batch = collate([build_datasets(config, tokenizer)[0][i] for i in range(4)])
    inputs, _, positions = distill_inputs(batch, config, torch.device("cpu"), skip_prompts=True)
    model = build_model(config, len(tokenizer)).train()
    apply(model, rms_norm=False, rope=False, swiglu=False)  # the last-layer swap, without the interpreted kernels
    rows_seen = []
    decoder_of(model).layers[-1].mlp.register_forward_pre_hook(lambda _, args: rows_seen.append(args[0].shape[:-1]))
    weights = torch.randn(len(positions), model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    outputs, gradients = [], []
    for rows in (None, positions):
        model.zero_grad()
        hidden = at_positions(final_hidden(model, dict(inputs), rows=rows), positions)
        (hidden * weights).sum().backward()
        outputs.append(hidden.detach())
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert [tuple(shape) for shape in rows_seen] == [tuple(inputs["input_ids"].shape), (1, len(positions))]
    assert torch.allclose(outputs[1], outputs[0], atol=1e-6, rtol=1e-5)
    assert float((gradients[1] - gradients[0]).norm() / gradients[0].norm()) < 1e-5


@pytest.mark.parametrize("beta", [0.0, 1.0], ids=["forward-kl", "reverse-kl"])
def test_distill_kl_directions_and_evaluation(tmp_path, beta):
    """beta 0 and 1 are the forward and reverse KL; a held-out evaluation reports the two terms and their mix."""
    config = distill_config(
        tmp_path, {"beta": beta}, training={"max_steps": 1}, data={"eval": str(tmp_path / "train.jsonl")}
    )
    result = train(config)
    want = reference_losses(config, 1)[0]
    assert abs(result.losses[0] - want[0]) <= 1e-5 * want[0]
    metrics = result.eval_metrics
    assert math.isclose(metrics["loss"], 0.3 * metrics["ce_loss"] + 0.7 * metrics["distill_loss"], rel_tol=1e-12)
    assert metrics["distill_loss"] > 0


def test_distill_two_ranks_under_ddp_fsdp_and_zero2_match_one_process(tmp_path, monkeypatch):
    """torchrun, 2 ranks x micro-batch 1 x accumulation 2, under DDP, FSDP2 (student and teacher sharded; and with
    objective.teacher.precompute, the ranks scoring the data in rounds) and DeepSpeed ZeRO-2, == 1 process x
    micro-batch 2 x accumulation 2, with a held-out evaluation. Tolerance 1e-5
    relative per step (fp32): gloo sums the gradients, FSDP2 and ZeRO-2 reduce-scatter them, in another order than
    one process adds them. The one process runs the fused loss's CPU reference, as the worker group does
    (TRITON_INTERPRET unset): the kernel itself is held to a plain PyTorch loop by the test above."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    held_out = {"eval": str(tmp_path / "train.jsonl")}
    runs = {
        strategy: distill_config(
            tmp_path,
            training={"micro_batch_size": 1},
            data=held_out,
            parallelism={"strategy": strategy},
            logging={"run_dir": str(tmp_path / strategy)},
        )
        for strategy in ("ddp", "fsdp", "deepspeed")
    }
    runs["fsdp-precomputed"] = distill_config(  # the teacher sharded for its pass, then only its head kept
        tmp_path,
        precompute=True,
        training={"micro_batch_size": 1},
        data=held_out,
        parallelism={"strategy": "fsdp"},
        logging={"run_dir": str(tmp_path / "fsdp-precomputed")},
    )
    records = launch(tmp_path, runs)
    single = train(distill_config(tmp_path, data=held_out))
    want = [(step["ce_loss"], step["distill_loss"]) for step in logged_steps(single.run_dir)]
    for strategy, record in records.items():
        got = [(step["ce_loss"], step["distill_loss"]) for step in logged_steps(tmp_path / strategy)]
        for a, b in zip([*record["losses"], *sum(got, ())], [*single.losses, *sum(want, ())], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (strategy, record["losses"], single.losses, got, want)
        for name in ("loss", "ce_loss", "distill_loss"):
            assert abs(record["eval"][name] - single.eval_metrics[name]) <= 1e-5 * single.eval_metrics[name], name


def test_distill_recipe_as_written(tmp_path):
    """docs/runtime.md's two commands and the precomputed teacher's, run by the `tigon` command from a directory
    holding the examples, at fewer steps: the demo's model is exported and becomes the teacher, and the student's
    distillation term falls, with the teacher beside it and precomputed."""
    section = (ROOT / "docs" / "runtime.md").read_text().split("\n## Distillation\n")[1]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[:2]
    commands = [line.split("#")[0].split() for block in blocks for line in block.strip().splitlines()]
    precomputed = ["--set", "objective.teacher.precompute=true", "--set", "logging.run_dir=runs/distill-precomputed"]
    assert commands == [
        ["tigon", "train", "examples/demo.yaml"],
        ["tigon", "train", "examples/distill.yaml"],
        ["tigon", "train", "examples/distill.yaml", *precomputed],
    ]
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    shorter = ["training.max_steps=20", "checkpoint.every_steps=0", "eval.every_steps=0", "eval.max_batches=1"]
    shorter += ["eval.metrics=[loss]", "logging.progress_bar=false", "logging.tensorboard=false"]
    env = process_env(OMP_NUM_THREADS="1")
    tigon = Path(sys.executable).parent / "tigon"
    for command in commands:
        overrides = [part for value in shorter for part in ("--set", value)]
        done = subprocess.run(
            [str(tigon), *command[1:], *overrides], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert (tmp_path / "runs" / "demo" / "export" / "tokenizer.json").is_file()
    for run in ("distill", "distill-precomputed"):
        steps = logged_steps(tmp_path / "runs" / run)
        assert steps[-1]["step"] == 20 and steps[-1]["distill_loss"] < 0.5 * steps[0]["distill_loss"], (run, steps)


def test_data_packed_for_sft_trains_distill_as_tokenized_here(tmp_path):
    """The workflow's prepared data (its cache key leaves next-token objectives alike): sft's packed sequences train
    distill to the same losses as the data tokenized in the run."""
    from tigon.runtime.packed import pack, save_packed
    from tigon.runtime.tokenizer import load_tokenizer

    config = distill_config(tmp_path, training={"max_steps": 1})
    sft = config.model_copy(update={"objective": config.objective.model_copy(update={"type": "sft"})})
    save_packed(pack(sft, load_tokenizer(config.model), "fingerprint"), tmp_path / "packed")
    assert train(config, datasets=tmp_path / "packed").losses == train(config).losses


PRECOMPUTED_TOLERANCE = 1e-6  # fp32, one process: the teacher's forward on micro-batches of the same size, the
# same fused ops on the same rows; measured: equal bit for bit


def test_a_precomputed_teacher_trains_to_the_losses_of_the_teacher_beside(tmp_path):
    """objective.teacher.precompute: per step, loss, ce_loss and distill_loss, and the held-out evaluation, equal
    the run with the teacher beside the student to PRECOMPUTED_TOLERANCE, relative."""
    held_out = {"eval": str(tmp_path / "train.jsonl")}
    beside = train(distill_config(tmp_path, data=held_out, logging={"run_dir": str(tmp_path / "beside")}))
    precomputed = train(distill_config(tmp_path, precompute=True, data=held_out))
    want = [(step["loss"], step["ce_loss"], step["distill_loss"]) for step in logged_steps(beside.run_dir)]
    got = [(step["loss"], step["ce_loss"], step["distill_loss"]) for step in logged_steps(precomputed.run_dir)]
    assert len(got) == DISTILL_STEPS and got[0][2] > 0.01
    for a, b in zip(
        [*sum(got, ()), *precomputed.eval_metrics.values()],
        [*sum(want, ()), *beside.eval_metrics.values()],
        strict=True,
    ):
        assert abs(a - b) <= PRECOMPUTED_TOLERANCE * abs(b), (got, want, precomputed.eval_metrics, beside.eval_metrics)


def test_a_precomputed_teacher_keeps_its_hidden_states_and_head_and_frees_its_layers(tmp_path, monkeypatch):
    """After prepare_objective the teacher model is gone: the student's state holds the teacher's head weight, and
    each dataset item the teacher's final hidden states at its completion tokens, as the teacher computes them."""
    import gc
    import weakref

    from transformers import AutoModelForCausalLM

    from tigon.runtime import distill
    from tigon.runtime.data import model_inputs
    from tigon.runtime.objectives import state_of
    from tigon.runtime.post_training import prepare_objective
    from tigon.runtime.run import prepare

    loaded = []
    load = distill.load_teacher

    def watched(*args, **kwargs):
        teacher = load(*args, **kwargs)
        loaded.append(weakref.ref(teacher))
        return teacher

    monkeypatch.setattr(distill, "load_teacher", watched)
    config = distill_config(tmp_path, precompute=True)
    prepared = prepare(config)
    prepare_objective(config, prepared)
    gc.collect()
    assert len(loaded) == 1 and loaded[0]() is None  # loaded once, then freed
    state = state_of(prepared.model)
    teacher = AutoModelForCausalLM.from_pretrained(config.objective.teacher.path, dtype=torch.float32).eval()
    assert state.reference is None and torch.equal(state.teacher_weight, teacher.lm_head.weight)
    dataset = prepared.train_dataset
    for index in range(len(dataset)):
        item = dataset[index]
        batch = {name: value[None] for name, value in item.items() if name != "teacher_hidden"}
        inputs = model_inputs(batch, "sdpa")
        inputs.pop("labels")
        with torch.no_grad():
            hidden = teacher.model(**inputs).last_hidden_state[0]
        completion = item["labels"][1:] != -100
        assert completion.sum() > 0 and item["teacher_hidden"].shape == (int(completion.sum()), 48)
        torch.testing.assert_close(item["teacher_hidden"], hidden[:-1][completion], rtol=1e-5, atol=1e-6)
