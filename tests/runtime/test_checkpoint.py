"""Checkpoints: atomic, pruned to the last K, and a resumed run continues exactly; the export loads."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.runtime.test_trainer import tiny_config
from tigon.runtime import checkpoint as ckpt
from tigon.runtime.trainer import train

OVERRIDES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


def _logging(run_dir: Path) -> dict:
    return {"run_dir": str(run_dir), "tensorboard": False, "progress_bar": False, "every_steps": 1}


def test_resumed_run_repeats_the_uninterrupted_losses_exactly(tmp_path):
    """Stop at step 3 (checkpoint), resume to step 8: bit-identical per-step losses.

    Dropout is on (so the restored RNG states matter) and an epoch is 3 steps long (so the data position
    crosses epoch boundaries). The schedule is constant after warmup so that the shortened first run
    follows the same learning rates as the full one.
    """

    def config(run_dir: Path, max_steps: int):
        return tiny_config(
            tmp_path,
            n_train=60,
            model={"config_overrides": {**OVERRIDES, "attention_dropout": 0.2}},
            training={"max_steps": max_steps, "warmup_steps": 2, "lr_schedule": "constant", "weight_decay": 0.1},
            checkpoint={"every_steps": 3, "keep_last": 2, "resume": True},
            eval={"metrics": []},
            logging=_logging(run_dir),
        )

    full = train(config(tmp_path / "full", 8))
    assert full.resumed_from_step is None

    first = train(config(tmp_path / "resumed", 3))  # the "killed" run: stops after its checkpoint at step 3
    assert first.losses == full.losses[:3]
    assert ckpt.latest_checkpoint(tmp_path / "resumed").name == "step-3"

    resumed = train(config(tmp_path / "resumed", 8))
    assert resumed.resumed_from_step == 3
    assert resumed.losses == full.losses, (resumed.losses, full.losses)
    assert [name for _, name in _names(tmp_path / "resumed")] == ["step-6", "step-8"]

    state = json.loads((tmp_path / "resumed" / "checkpoints" / "step-8" / "state.json").read_text())
    assert state["step"] == 8 and state["losses"] == full.losses and state["epoch"] >= 2
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)), "metrics.jsonl must hold each step once across the two runs"


def _names(run_dir: Path) -> list[tuple[int, str]]:
    return [(step, path.name) for step, path in ckpt.list_checkpoints(run_dir)]


def test_half_written_checkpoint_is_ignored_and_resume_is_off_when_asked(tmp_path):
    config = tiny_config(tmp_path, training={"max_steps": 2}, checkpoint={"every_steps": 1, "keep_last": 1})
    train(config)
    run_dir = Path(config.logging.run_dir)
    assert _names(run_dir) == [(2, "step-2")]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]

    # a run killed while writing step 5 leaves a temporary directory, and one without state.json
    (run_dir / "checkpoints" / ".tmp-step-5").mkdir()
    (run_dir / "checkpoints" / "step-7").mkdir()
    assert ckpt.latest_checkpoint(run_dir).name == "step-2"

    again = train(config)  # checkpoint.resume is false in tiny_config: starts over, dropping the old checkpoints
    assert again.resumed_from_step is None and again.steps == 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2"]


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    from tigon.runtime.config import ConfigError

    first = tiny_config(tmp_path, training={"max_steps": 1}, checkpoint={"every_steps": 1, "resume": True})
    train(first)
    wider = {**OVERRIDES, "hidden_size": 64}
    second = tiny_config(tmp_path, model={"config_overrides": wider}, checkpoint={"every_steps": 1, "resume": True})
    with pytest.raises(ConfigError, match="different model settings; use another logging.run_dir"):
        train(second)


def test_resume_accepts_a_checkpoint_from_before_new_settings_and_another_cache(tmp_path):
    """A checkpoint's config.json without later fields (they take their defaults) or with another download cache."""
    import json

    from tigon.runtime.trainer import check_resumable

    config = tiny_config(tmp_path)
    saved = json.loads(config.model_dump_json())
    for key in ("revision", "trust_remote_code"):
        del saved["model"][key]
    del saved["data"]["subset"]
    saved["model"]["cache_dir"] = "/another/cache"
    (tmp_path / "config.json").write_text(json.dumps(saved))
    check_resumable(tmp_path, config)


def test_checkpoint_round_trip_restores_everything(tmp_path):
    from tigon.runtime.distributed import DistEnv

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = ckpt.TrainState(step=1, epoch=0, batches_in_epoch=1, losses=[1.5])
    env = DistEnv()
    random.seed(7)
    torch.manual_seed(7)
    ckpt.save_checkpoint(tmp_path, state, model, optimizer, scheduler, env, keep_last=2)
    expected = (random.random(), torch.rand(3))

    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    other_scheduler = torch.optim.lr_scheduler.LambdaLR(other_optimizer, lambda step: 1 / (step + 1))
    loaded = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), other, other_optimizer, other_scheduler, env)
    assert loaded == state
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))
    assert other_scheduler.last_epoch == 1 and other_optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert torch.equal(
        other_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )
    assert (random.random(), torch.rand(3)) == (expected[0], pytest.approx(expected[1]))


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "report.json"
    ckpt.atomic_write_text(path, "old")

    with pytest.raises(TypeError):
        ckpt.atomic_write_bytes(path, object())  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def _capture_before_export(monkeypatch, ids: torch.Tensor) -> dict:
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


def test_export_loads_with_from_pretrained(tmp_path, restore_rope, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor([[1, 20, 21, 14, 22, 30]])
    captured = _capture_before_export(monkeypatch, ids)
    config = tiny_config(
        tmp_path,
        training={"max_steps": 2},
        kernels={"enabled": True, "rope": False},  # patched norms and MLPs must save under Hugging Face's names
        checkpoint={"export": True},
        eval={"metrics": []},
    )
    result = train(config)
    export = Path(result.export_dir)
    assert export == Path(config.logging.run_dir) / "export"
    loaded = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert loaded.config.hidden_size == 32 and loaded.config.vocab_size == len(tokenizer)
    assert tokenizer.decode(tokenizer("12+3=", add_special_tokens=False)["input_ids"]) == "12+3="
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert torch.allclose(got, captured["logits"], atol=1e-5), "the export holds the trained weights"
    assert not [p for p in export.parent.iterdir() if p.name.startswith(".")]


def test_lora_export_is_merged_into_plain_weights(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 20, 21, 14, 22, 30]])
    captured = _capture_before_export(monkeypatch, ids)
    config = tiny_config(
        tmp_path, training={"max_steps": 3}, lora={"enabled": True, "r": 4}, checkpoint={"export": True}
    )
    result = train(config)
    loaded = AutoModelForCausalLM.from_pretrained(result.export_dir)
    assert not any("lora" in name for name, _ in loaded.named_parameters())
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert torch.allclose(got, captured["logits"], atol=1e-5)
