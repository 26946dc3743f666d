"""Preference objectives: the config, TRL's data formats, the torch trainer through the fused preference ops
(one process and DDP over gloo), and per-step parity with TRL's DPOTrainer run for real."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.runtime.configs import KTO_RECORDS, PAIRS, preference_config, trl_trainer
from tests.runtime.worker_groups import logged_steps, torchrun
from tigon.runtime.config import ConfigError, parse_config
from tigon.runtime.data import MalformedRecordError
from tigon.runtime.preference_data import build_preference_datasets, tokenize_preference
from tigon.runtime.tokenizer import build_char_tokenizer
from tigon.runtime.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen")


@pytest.fixture
def reference_ops(monkeypatch):
    """The fused ops' CPU references (TRITON_INTERPRET unset), for tests that compare two runs of the runtime, as a
    worker group runs them: the kernels are held to TRL by the tests that compare with TRL, and Triton's
    interpreter would take most of these tests' time."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_objective_config_is_validated_with_the_fix(tmp_path):
    base = preference_config(tmp_path, "sft").model_dump(mode="json")
    assert base["objective"]["type"] == "sft"
    assert parse_config({**base, "objective": "dpo"}).objective.resolved_beta == 0.1
    assert parse_config({**base, "objective": {"type": "simpo"}}).objective.resolved_beta == 2.0
    # a dumped config (what the workflow passes on) loads again
    dumped = parse_config({**base, "objective": {"type": "cpo", "alpha": 0.5}}).model_dump(mode="json")
    assert parse_config(dumped).objective.resolved_alpha == 0.5
    cases = [
        ({"type": "dpo", "betta": 0.1}, "objective.betta: unknown key (did you mean 'beta'?)"),
        ({"type": "dpo", "gamma": 1.0}, "objective.gamma applies to simpo, not to objective.type 'dpo'"),
        ({"type": "dop"}, "objective.type: Input should be 'sft', 'dpo'"),
        ({"type": "dpo", "label_smoothing": 0.5}, "the sigmoid and robust losses take a flip probability below 0.5"),
        ({"type": "kto", "reference": "none"}, "objective.reference: none is not available for kto"),
        ({"type": "dpo", "loss_type": "kto_pair"}, "objective.loss_type"),
        ({"type": "cpo", "loss_type": "ipo"}, "cpo trains the sigmoid loss"),
        ({"type": "dpo", "loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}, "give one weight per entry"),
        ({"type": "dpo", "loss_type": "exo_pair"}, "exo_pair needs 0 < label_smoothing < 1"),
        ({"type": "cpo", "rpo_alpha": 1.0}, "objective.rpo_alpha applies to dpo, not to objective.type 'cpo'"),
    ]
    for objective, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config({**base, "objective": objective})
    with pytest.raises(ConfigError, match=re.escape("remove data.format")):
        train(parse_config({**base, "objective": "dpo", "data": {**base["data"], "format": "chat"}}))


def test_dpo_loss_types_weights_and_rpo_reach_the_loss(tmp_path):
    """At the first step the policy is its reference, so every log-ratio is 0 and each loss type has a known value
    (beta 0.1): sigmoid log 2, ipo (1 / (2 beta))^2 = 25, hinge 1; RPO adds rpo_alpha times the logged NLL."""
    objective = {
        "type": "dpo", "loss_type": ["sigmoid", "ipo", "hinge"], "loss_weights": [1.0, 0.5, 2.0], "rpo_alpha": 0.3,
    }  # fmt: skip
    config = preference_config(tmp_path, objective, training={"max_steps": 1})
    result = train(config)
    (first,) = logged_steps(config.logging.run_dir)
    expected = math.log(2) + 0.5 * 25 + 2.0 * 1 + 0.3 * first["nll_loss"]
    assert first["nll_loss"] > 0
    assert result.losses[0] == pytest.approx(expected, rel=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)


def test_preference_records_as_text_and_chat_with_masks_and_clear_errors(tmp_path):
    tokenizer = build_char_tokenizer()
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    prompt, (chosen, rejected) = tokenize_preference(PAIRS[0], "dpo", tokenizer)
    assert prompt == [bos, *tokenizer.encode("3+4=", add_special_tokens=False)]
    assert chosen == [*tokenizer.encode("7", add_special_tokens=False), eos]
    assert rejected == [*tokenizer.encode("8", add_special_tokens=False), eos]

    chat = {
        "prompt": [{"role": "user", "content": "hi"}],
        "chosen": [{"role": "assistant", "content": "hello"}],
        "rejected": [{"role": "assistant", "content": "go"}],
    }
    prompt, (chosen, _) = tokenize_preference(chat, "dpo", tokenizer)
    assert tokenizer.decode(prompt) == "<bos><|user|>\nhi<eos><|assistant|>\n"
    assert tokenizer.decode(chosen) == "hello<eos>"

    kto = [{"prompt": "1+1=", "completion": "2", "label": True}, {"prompt": "1+2=", "completion": "4", "label": False}]
    config = preference_config(tmp_path, "kto", kto)
    dataset, _, summary = build_preference_datasets(config, tokenizer)
    item = dataset[1]
    assert item["input_ids"].shape == (2, 32) and not bool(item["desirable"])
    completion, mismatched = (row[row != -100].tolist() for row in item["labels"])
    assert completion == [*tokenizer.encode("4", add_special_tokens=False), eos]  # the completion only
    assert mismatched == [*tokenizer.encode("2", add_special_tokens=False), eos]  # the other record's (TRL's KL)
    assert tokenizer.decode(item["input_ids"][1][item["attention_mask"][1] == 1]) == "<bos>1+2=2<eos>"
    assert summary.examples == 2 and summary.loss_tokens == 8

    bad = [PAIRS[0], {"prompt": "2+2=", "chosen": "4"}, {"prompt": "1+1=", "chosen": "2", "rejected": [1]}]
    config = preference_config(tmp_path, "dpo", bad)
    with pytest.raises(MalformedRecordError, match=r"train.jsonl, line 2: record lacks 'rejected'.*skip_malformed"):
        build_preference_datasets(config, tokenizer)
    config = preference_config(tmp_path, "dpo", bad, data={"skip_malformed": True})
    dataset, _, summary = build_preference_datasets(config, tokenizer)
    assert (len(dataset), summary.skipped) == (1, 2)
    mixed = {"prompt": "hi", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "y"}
    with pytest.raises(MalformedRecordError, match="prompt is text, chosen is messages, rejected is text"):
        tokenize_preference(mixed, "dpo", tokenizer)


def test_dpo_matches_trl_dpo_trainer_step_by_step(tmp_path):
    """tigon's DPO (fused op, frozen reference copy) and TRL's DPOTrainer, same model, data, optimizer (AdamW,
    betas 0.9/0.95, constant lr 1e-2, clipping at 1), 4 pairs x 2 micro-batches, fp32: per-step loss and metrics.

    Tolerance: 1e-5 relative on loss and log-probs, 1e-5 absolute on rewards (which start at 0). Both sides run
    float32 forwards whose sums are taken in different orders (tigon's reference op accumulates in float64);
    measured: loss 1e-7, log-probs 2e-6 absolute (1.6e-7 relative), rewards 3e-7.
    """
    from trl import DPOConfig, DPOTrainer

    ours = logged_steps(train(preference_config(tmp_path, {"type": "dpo", "beta": 0.1})).run_dir)
    theirs = trl_logged_steps(tmp_path, DPOConfig, DPOTrainer, PAIRS, beta=0.1)
    assert len(ours) == len(theirs) == 4
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), 1):
        for name in ("loss", "logps/chosen", "logps/rejected"):
            assert abs(a[name] - b[name]) <= 1e-5 * abs(b[name]), (step, name, a[name], b[name])
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
            assert abs(a[name] - b[name]) <= 1e-5, (step, name, a[name], b[name])
    assert ours[-1]["rewards/accuracies"] == 1.0 and ours[-1]["loss"] < ours[0]["loss"]


@pytest.mark.parametrize(
    "objective",
    [{"type": "kto", "reference": "precomputed"}, {"type": "dpo", "reference": "none", "label_smoothing": 0.1}],
    ids=lambda objective: f"{objective['type']}-{objective.get('reference', '')}".rstrip("-"),
)
def test_kto_and_reference_free_dpo_train_and_log_trl_metrics(tmp_path, objective):
    """The objectives the parity tests leave out (ORPO, SimPO and CPO train there) lower the loss and log TRL's
    metrics."""
    records = PAIRS
    if objective["type"] == "kto":
        records = [
            {"prompt": pair["prompt"], "completion": pair[key], "label": key == "chosen"}
            for pair in PAIRS
            for key in ("chosen", "rejected")
        ]
    result = train(preference_config(tmp_path, objective, records))
    steps = logged_steps(result.run_dir)
    assert len(steps) == 4 and steps[-1]["loss"] < steps[0]["loss"]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert name in steps[-1] and name in result.objective_metrics
    assert steps[-1]["rewards/margins"] > steps[0]["rewards/margins"]
    if objective["type"] != "kto":
        assert 0.0 <= steps[-1]["rewards/accuracies"] <= 1.0


@pytest.mark.usefixtures("reference_ops")
def test_precomputed_reference_gives_the_frozen_copys_losses(tmp_path):
    """`reference: precomputed` stores the starting model's log-probs once; the losses equal the frozen copy's."""
    two_steps = {"max_steps": 2}
    copy = train(preference_config(tmp_path, {"type": "dpo", "reference": "model"}, training=two_steps))
    stored = train(preference_config(tmp_path, {"type": "dpo", "reference": "precomputed"}, training=two_steps))
    for a, b in zip(copy.losses, stored.losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(a), (copy.losses, stored.losses)


@pytest.mark.usefixtures("reference_ops")
def test_dpo_under_ddp_two_processes_matches_one_process(tmp_path):
    """torchrun, 2 ranks x micro-batch 2 x accumulation 2 == 1 process x micro-batch 4 x accumulation 2, with a
    held-out evaluation. Tolerance 1e-5 relative per step: gloo sums the gradients in another order."""
    import yaml

    config = preference_config(
        tmp_path, {"type": "dpo"}, training={"micro_batch_size": 2}, data={"eval": str(tmp_path / "train.jsonl")}
    )
    config_file = tmp_path / "ddp.yaml"
    raw = config.model_dump(mode="json")
    raw["logging"]["run_dir"] = str(tmp_path / "ddp-run")
    config_file.write_text(yaml.safe_dump(raw))
    script = tmp_path / "worker.py"
    script.write_text(
        "import json, os, sys\n"
        "from tigon.runtime.config import load_config\n"
        "from tigon.runtime.trainer import train\n"
        "result = train(load_config(sys.argv[1]))\n"
        "with open(sys.argv[2] + f\"/rank{os.environ['RANK']}.json\", 'w') as f:\n"
        "    json.dump({'losses': result.losses, 'eval': result.eval_metrics, 'world': result.world_size}, f)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*torchrun(2), str(script), str(config_file), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["world"] == 2 and ranks[0]["losses"] == ranks[1]["losses"]
    single = train(preference_config(tmp_path, {"type": "dpo"}, data={"eval": str(tmp_path / "train.jsonl")}))
    for got, want in zip(ranks[0]["losses"], single.losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (ranks[0]["losses"], single.losses)
    for name in ("loss", *TRL_METRICS):
        assert abs(ranks[0]["eval"][name] - single.eval_metrics[name]) <= 1e-5, name


def trl_logged_steps(tmp_path: Path, config_class, trainer_class, records: list[dict], **settings) -> list[dict]:
    """`trl_trainer` trained: its step logs."""
    trainer = trl_trainer(tmp_path, config_class, trainer_class, records, **settings)
    trainer.train()
    return [record for record in trainer.state.log_history if "loss" in record]


def _trl_experimental(objective: dict, tmp_path: Path) -> list[dict]:
    """TRL's ORPOTrainer or CPOTrainer (SimPO through CPO's loss_type 'simpo') on PAIRS, as tigon trains them."""
    if objective["type"] == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return trl_logged_steps(tmp_path, ORPOConfig, ORPOTrainer, PAIRS, beta=objective["beta"])
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    extra = {"loss_type": "simpo", "simpo_gamma": objective["gamma"]} if objective["type"] == "simpo" else {}
    return trl_logged_steps(
        tmp_path, CPOConfig, CPOTrainer, PAIRS, beta=objective["beta"], cpo_alpha=objective["alpha"], **extra
    )


@pytest.mark.parametrize(
    "objective",
    [
        {"type": "orpo", "beta": 0.1},
        {"type": "cpo", "beta": 0.1, "alpha": 1.0},
        {"type": "simpo", "beta": 2.0, "gamma": 0.5, "alpha": 0.0},
    ],
    ids=lambda objective: objective["type"],
)
def test_orpo_cpo_simpo_match_trl_step_by_step(tmp_path, objective):
    """As the DPO parity test (same tolerance), against TRL's ORPOTrainer and CPOTrainer (SimPO is CPO's loss_type
    'simpo'). ORPO: TRL's ORPOTrainer takes its NLL term over the prompt and the chosen completion, tigon's op over
    the completion only (where the loss masks are), so the loss and the training path differ; the odds-ratio terms
    agree on the first step, before the two diverge."""
    ours = logged_steps(train(preference_config(tmp_path, objective)).run_dir)
    theirs = _trl_experimental(objective, tmp_path)
    assert len(ours) == len(theirs) == 4
    names = ["logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected", "rewards/margins"]
    if objective["type"] == "orpo":
        ours, theirs, names = ours[:1], theirs[:1], [*names, "log_odds_ratio", "log_odds_chosen"]
    else:  # TRL logs an NLL of 0 where cpo_alpha is 0, tigon the chosen completions' NLL the loss leaves out
        names += ["loss"] + (["nll_loss"] if objective["alpha"] > 0 else [])
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), 1):
        for name in names:
            assert abs(a[name] - b[name]) <= 1e-5 * max(1.0, abs(b[name])), (step, name, a[name], b[name])
        assert a["rewards/accuracies"] == b["rewards/accuracies"], step


@pytest.mark.usefixtures("reference_ops")
def test_prepared_preference_data_trains_as_tokenized_here(tmp_path):
    """What the workflow's prepare_data writes (`packed.pack` + `save_packed`) trains a KTO run to the losses of
    tokenizing in the run; data prepared for another objective is refused."""
    from tigon.runtime.packed import pack, save_packed
    from tigon.runtime.tokenizer import load_tokenizer

    records = [{"prompt": p["prompt"], "completion": p["chosen"], "label": i % 3 != 0} for i, p in enumerate(PAIRS)]
    config = preference_config(tmp_path, {"type": "kto", "reference": "precomputed"}, records)
    save_packed(pack(config, load_tokenizer(config.model), "fingerprint"), tmp_path / "packed")
    prepared = train(config, datasets=tmp_path / "packed")
    assert prepared.data_manifest["objective"] == "kto"
    assert prepared.losses == train(config).losses
    with pytest.raises(ConfigError, match="prepared for objective.type 'kto', not 'dpo'"):
        train(preference_config(tmp_path, "dpo"), datasets=tmp_path / "packed")


def test_kto_matches_trl_kto_trainer_step_by_step(tmp_path):
    """As the DPO parity test (same tolerances), against TRL's KTOTrainer with its KL estimate: 4 desirable and 4
    undesirable completions, one micro-batch of 8 per step (TRL's KL term is a mean over a micro-batch, so both
    sides must batch the same records together; the whole data set is one micro-batch here)."""
    from trl import KTOConfig, KTOTrainer

    records = [
        {"prompt": pair["prompt"], "completion": pair["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
        for i, pair in enumerate(PAIRS)
    ]
    batch = {"micro_batch_size": 8, "gradient_accumulation_steps": 1}
    ours = logged_steps(train(preference_config(tmp_path, {"type": "kto"}, records, training=batch)).run_dir)
    theirs = trl_logged_steps(
        tmp_path, KTOConfig, KTOTrainer, records, per_device_train_batch_size=8, gradient_accumulation_steps=1, beta=0.1
    )
    assert len(ours) == len(theirs) == 4
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), 1):
        for name in ("loss", "logps/chosen", "logps/rejected"):
            assert abs(a[name] - b[name]) <= 1e-5 * abs(b[name]), (step, name, a[name], b[name])
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl"):
            assert abs(a[name] - b[name]) <= 1e-5, (step, name, a[name], b[name])
    assert any(record["kl"] > 0 for record in ours)  # the KL term took part


def test_lora_with_gradient_checkpointing_and_bf16(tmp_path):
    """LoRA adapters (the reference precomputed, as a frozen copy is refused with LoRA), gradient checkpointing and
    bf16 autocast: the decoder hook still hands the fused op its hidden states, and the loss falls."""
    sections = {"lora": {"enabled": True, "r": 4}, "training": {"gradient_checkpointing": True, "precision": "bf16"}}
    with pytest.raises(ConfigError, match="set objective.reference: precomputed"):
        train(preference_config(tmp_path, {"type": "dpo"}, **sections))
    result = train(preference_config(tmp_path, {"type": "dpo", "reference": "precomputed"}, **sections))
    assert result.losses[-1] < result.losses[0] and result.objective_metrics["rewards/margins"] > 0


@pytest.mark.usefixtures("reference_ops")
def test_a_resumed_run_keeps_the_starting_model_as_its_reference(tmp_path):
    """Stopped at its step-2 checkpoint and resumed, a DPO run repeats the uninterrupted run's losses: its frozen
    reference is the starting model (built before the checkpoint is loaded), not the checkpoint's weights."""
    whole = train(preference_config(tmp_path, {"type": "dpo"})).losses
    sections = {"checkpoint": {"every_steps": 2, "resume": True}, "logging": {"run_dir": str(tmp_path / "resumed")}}
    train(preference_config(tmp_path, {"type": "dpo"}, training={"max_steps": 2}, **sections))
    resumed = train(preference_config(tmp_path, {"type": "dpo"}, **sections))
    assert resumed.resumed_from_step == 2 and resumed.losses == whole, (resumed.losses, whole)


SHARDED_OBJECTIVES = {  # name: (objective, records)
    "dpo": ({"type": "dpo"}, PAIRS),
    "dpo-precomputed": ({"type": "dpo", "reference": "precomputed"}, PAIRS),
    "kto": ({"type": "kto"}, KTO_RECORDS),
    "orpo": ({"type": "orpo"}, PAIRS),
    "simpo": ({"type": "simpo"}, PAIRS),
    "cpo": ({"type": "cpo"}, PAIRS),
}


def test_preference_objectives_under_fsdp_and_zero2_match_ddp(tmp_path):
    """torchrun, 2 ranks x micro-batch 2 x accumulation 2, 2 steps with a held-out evaluation: every objective
    under FSDP2 (the policy and the frozen reference copy sharded; precomputed log-probs scored by rank 0 before
    sharding) and under DeepSpeed ZeRO-2, against DDP. Per-step losses, the last step's metrics and the evaluation
    agree within 1e-5 relative (fp32; FSDP2 and ZeRO-2 reduce-scatter the gradients where DDP all-reduces them:
    another order), and 1e-7 absolute near zero (the first step's rewards: policy and reference are the same)."""
    from tests.runtime.worker_groups import launch

    runs = {}
    for name, (objective, records) in SHARDED_OBJECTIVES.items():
        (tmp_path / name).mkdir()
        for strategy in ("ddp", "fsdp", "deepspeed"):
            runs[f"{name}-{strategy}"] = preference_config(
                tmp_path / name,
                objective,
                records,
                training={"micro_batch_size": 2, "max_steps": 2},
                data={"eval": str(tmp_path / name / "train.jsonl")},
                parallelism={"strategy": strategy},
                logging={"run_dir": str(tmp_path / name / strategy)},
            )
    records = launch(tmp_path, runs, timeout=600)
    for name, strategy in itertools.product(SHARDED_OBJECTIVES, ("fsdp", "deepspeed")):
        ddp, sharded = records[f"{name}-ddp"], records[f"{name}-{strategy}"]
        last_ddp, last = (logged_steps(tmp_path / name / run)[-1] for run in ("ddp", strategy))
        pairs = [*zip(sharded["losses"], ddp["losses"], strict=True)]
        pairs += [(last[key], last_ddp[key]) for key in last_ddp if "/" in key]
        pairs += [(sharded["eval"][key], ddp["eval"][key]) for key in ddp["eval"]]
        assert len(pairs) > 8, name
        for got, want in pairs:
            assert abs(got - want) <= 1e-5 * abs(want) + 1e-7, (name, strategy, ddp, sharded)


def test_the_config_offers_every_dpo_loss_type_the_op_computes():
    from typing import get_args

    from tigon.kernels.ops.dpo import DPO_LOSS_TYPES
    from tigon.runtime.config import DpoLossType

    assert sorted(get_args(DpoLossType)) == sorted(DPO_LOSS_TYPES)
