"""Packed data written once and loaded by the trainer: the same arrays, the same losses, no tokenizing."""

from __future__ import annotations

import json

import pytest
import torch

from tests.runtime.configs import tiny_config
from tigon.runtime.data import DataError, build_datasets
from tigon.runtime.packed import MANIFEST, load_packed, pack, save_packed
from tigon.runtime.tokenizer import build_char_tokenizer, load_tokenizer
from tigon.runtime.trainer import train


def test_saved_arrays_load_back_identically(tmp_path):
    config = tiny_config(tmp_path, eval={"metrics": ["loss", "exact_match"]})
    tokenizer = load_tokenizer(config.model)
    save_packed(pack(config, tokenizer, "f" * 64), tmp_path / "packed")
    loaded = load_packed(tmp_path / "packed", tokenizer)
    train_set, eval_set, summary = build_datasets(config, tokenizer)
    for original, copy in ((train_set, loaded.train), (eval_set, loaded.eval)):
        assert len(copy) == len(original) > 0
        for name in ("input_ids", "labels", "position_ids"):
            assert torch.equal(getattr(copy, name), getattr(original, name))
            assert getattr(copy, name).dtype == torch.long
        assert (copy.num_tokens, copy.num_loss_tokens, copy.dropped) == (
            original.num_tokens,
            original.num_loss_tokens,
            original.dropped,
        )
    assert str(loaded.summary) == str(summary)
    assert loaded.manifest["fingerprint"] == "f" * 64 and loaded.manifest["tokenizer"]["size"] == len(tokenizer)
    assert len(loaded.eval_examples) == 24 and all(ids and reference for ids, reference in loaded.eval_examples)


@pytest.mark.parametrize("trainer", ["torch", "hf", "lightning"])
def test_training_on_packed_data_matches_tokenizing_and_records_the_manifest(tmp_path, trainer):
    config = tiny_config(
        tmp_path, trainer=trainer, training={"max_steps": 3}, eval={"metrics": ["loss", "exact_match"]}
    )
    save_packed(pack(config, load_tokenizer(config.model), "a" * 64), tmp_path / "packed")
    tokenized = train(config)
    packed_run = train(config, datasets=tmp_path / "packed")
    assert packed_run.losses == tokenized.losses
    assert packed_run.eval_metrics == tokenized.eval_metrics
    assert tokenized.data_manifest is None
    assert packed_run.data_manifest["fingerprint"] == "a" * 64
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data_manifest"]["fingerprint"] == "a" * 64


def test_packed_data_of_another_tokenizer_or_unfinished_is_refused(tmp_path):
    config = tiny_config(tmp_path)
    save_packed(pack(config, load_tokenizer(config.model), "b" * 64), tmp_path / "packed")
    other = build_char_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(DataError, match="not the run's tokenizer"):
        load_packed(tmp_path / "packed", other)
    (tmp_path / "packed" / MANIFEST).unlink()
    with pytest.raises(DataError, match="no manifest.json"):
        load_packed(tmp_path / "packed", load_tokenizer(config.model))
