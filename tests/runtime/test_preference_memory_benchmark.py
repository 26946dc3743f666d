"""benchmarks/preference_memory.py cannot rot: its records fill every sequence, and a tiny case runs end to end."""

from __future__ import annotations

from benchmarks.preference_memory import case_config, records, run_case
from tigon.runtime.preference_data import build_preference_datasets
from tigon.runtime.tokenizer import load_tokenizer


def test_every_tokenized_sequence_fills_max_seq_len(tmp_path):
    """The planner counts every sequence at data.max_seq_len; the benchmark's data is that bound, pairs and KTO's
    completions with their mismatched sequences alike."""
    for case, width in [("dpo-model-packed", 2), ("kto-model-padded-eager", 2)]:
        spec = {"case": case, "seq": 48, "micro_batch": 2, "accumulation": 2, "steps": 2, "tiny": True}
        config = case_config(spec, tmp_path)
        train_set, _, summary = build_preference_datasets(config, load_tokenizer(config.model))
        assert len(train_set) == 8 and summary.truncated == 8 and summary.dropped == 0
        assert train_set.attention_mask.shape == (8, width, 48) and bool(train_set.attention_mask.all())
    assert records("dpo", 3, 48, seed=0) == records("dpo", 3, 48, seed=0)


def test_a_tiny_case_trains_and_is_estimated(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the reference path: the interpreter is slow
    result = run_case("dpo-precomputed-packed-ckpt", seq=32, micro_batch=2, tiny=True)
    assert "error" not in result and not result["oom"], result
    assert len(result["losses"]) == 2 and result["peak_bytes"] is None  # no GPU here: the estimate only
    assert result["estimate_bytes"] == sum(result["estimate_parts"].values()) > 0
