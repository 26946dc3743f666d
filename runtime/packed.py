"""Packed datasets on disk: tokenized and packed once (the workflow's prepare_data), loaded by every worker.

    packed = pack(config, tokenizer, fingerprint)          # tokenize and pack (build_datasets)
    save_packed(packed, "packed/")                         # train.safetensors, eval.safetensors, manifest.json
    packed = load_packed("packed/", tokenizer)             # no tokenization: the arrays as written
    result = train(config, datasets="packed/")            # tigon.runtime.trainer: loads it, never tokenizes

The manifest records the format version, the data's content fingerprint (the cache key), a build id,
the tokenizer's identity (name, vocabulary size, SHA-256 of its vocabulary, special tokens and chat
template), the data options and the data summary. `load_packed` refuses a directory whose tokenizer
is not the run's. The manifest is written last, under a temporary name then renamed, so a
directory without one is unfinished.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tigon.runtime.data import DataError, DataSummary, PackedDataset, build_datasets, generation_examples
from tigon.runtime.files import atomic_path, atomic_write_text
from tigon.runtime.preference_data import PreferenceDataset, PreferenceSummary, build_preference_datasets

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tigon.runtime.config import RunConfig

logger = logging.getLogger("tigon.runtime")

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ARRAYS = ("input_ids", "labels", "position_ids")
PREFERENCE_ARRAYS = ("input_ids", "labels", "attention_mask")
COUNTERS = (
    "truncated",
    "split_documents",
    "dropped",
    "documents",
    "num_tokens",
    "num_loss_tokens",
    "num_padding_tokens",
)


@dataclass
class PackedData:
    """Train and eval sequences, the data summary, and the eval prompts for generation metrics."""

    train: PackedDataset
    eval: PackedDataset | None
    summary: DataSummary
    eval_examples: list[tuple[list[int], str]] | None  # (prompt ids, reference) when data.eval has prompts
    manifest: dict[str, Any]


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Name, size and a SHA-256 over everything that decides token ids: vocabulary, special tokens, chat template."""
    described = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")},
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    return {"name": str(tokenizer.name_or_path or ""), "size": len(tokenizer), "sha256": digest}


def pack(config: RunConfig, tokenizer: PreTrainedTokenizerBase, fingerprint: str) -> PackedData:
    """Tokenize and pack the configured data; `fingerprint` is the data's content hash (the cache key)."""
    if config.objective.preference:  # stored as padded rows; data.packing packs each micro-batch in training
        train, evaluation, summary = build_preference_datasets(config, tokenizer)
    else:
        train, evaluation, summary = build_datasets(config, tokenizer)
    examples = None
    if evaluation is not None and config.data.format in ("instruction", "chat") and not config.objective.preference:
        examples = generation_examples(config, tokenizer)
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "build_id": uuid.uuid4().hex,  # tells one packing from another of the same data (e.g. a cache hit)
        "tokenizer": tokenizer_identity(tokenizer),
        "data": config.data.model_dump(mode="json", exclude={"train", "eval"}),
        "objective": config.objective.type,
        "sequences": {"train": len(train), "eval": len(evaluation) if evaluation is not None else 0},
        "summary": str(summary),
    }
    return PackedData(train, evaluation, summary, examples, manifest)


def _save_split(dataset: PackedDataset | PreferenceDataset, path: Path) -> None:
    from safetensors.torch import save_file

    if isinstance(dataset, PreferenceDataset):
        arrays = {name: getattr(dataset, name).to(torch.int32).contiguous() for name in PREFERENCE_ARRAYS}
        if dataset.desirable is not None:
            arrays["desirable"] = dataset.desirable.to(torch.int32).contiguous()
        metadata = {"kind": "preference", "truncated": str(dataset.truncated), "dropped": str(dataset.dropped)}
        with atomic_path(path) as temporary:
            save_file(arrays, str(temporary), metadata=metadata)
        return
    arrays = {name: getattr(dataset, name).to(torch.int32).contiguous() for name in ARRAYS}
    metadata = {name: str(getattr(dataset, name)) for name in COUNTERS}
    metadata["max_seq_len"], metadata["packing"] = str(dataset.max_seq_len), str(dataset.packing)
    with atomic_path(path) as temporary:
        save_file(arrays, str(temporary), metadata=metadata)


def _load_split(path: Path) -> PackedDataset | PreferenceDataset:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
        if metadata.get("kind") == "preference":
            arrays = {name: file.get_tensor(name).long() for name in PREFERENCE_ARRAYS}
            desirable = file.get_tensor("desirable").bool() if "desirable" in file.keys() else None
            return PreferenceDataset.from_arrays(
                **arrays, desirable=desirable, truncated=int(metadata["truncated"]), dropped=int(metadata["dropped"])
            )
        arrays = {name: file.get_tensor(name).long() for name in ARRAYS}
    counters = {name: int(metadata[name]) for name in COUNTERS if name in metadata}  # older packings lack some
    return PackedDataset.from_arrays(
        **arrays, max_seq_len=int(metadata["max_seq_len"]), packing=metadata["packing"] == "True", **counters
    )


def save_packed(packed: PackedData, out_dir: str | Path) -> Path:
    """Write the arrays, the eval prompts and the data summary, then the manifest (last, atomically)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_split(packed.train, out_dir / "train.safetensors")
    if packed.eval is not None:
        _save_split(packed.eval, out_dir / "eval.safetensors")
    if packed.eval_examples is not None:
        atomic_write_text(out_dir / "eval_examples.json", json.dumps(packed.eval_examples))
    atomic_write_text(out_dir / "summary.json", json.dumps(_summary_dict(packed.summary)))
    atomic_write_text(out_dir / MANIFEST, json.dumps(packed.manifest, indent=1))
    return out_dir


def _summary_dict(summary: DataSummary | PreferenceSummary) -> dict[str, Any]:
    if isinstance(summary, PreferenceSummary):
        result = {name: value for name, value in vars(summary).items() if name != "eval"}
        result["kind"] = "preference"
        result["eval"] = _summary_dict(summary.eval) if summary.eval is not None else None
        return result
    fields = ("path", "records", "skipped", "truncated", "dropped", "sequences", "tokens", "loss_tokens")
    result: dict[str, Any] = {name: getattr(summary, name) for name in (*fields, "padding_tokens", "split_documents")}
    result["eval"] = _summary_dict(summary.eval) if summary.eval is not None else None
    return result


def _summary_from_dict(raw: dict[str, Any]) -> DataSummary | PreferenceSummary:
    evaluation = raw.pop("eval")
    summary = PreferenceSummary(**raw) if raw.pop("kind", None) == "preference" else DataSummary(**raw)
    summary.eval = _summary_from_dict(evaluation) if evaluation is not None else None
    return summary


def load_packed(directory: str | Path, tokenizer: PreTrainedTokenizerBase) -> PackedData:
    """The packed data in `directory`, checked against the run's tokenizer; nothing is tokenized."""
    directory = Path(directory)
    manifest_file = directory / MANIFEST
    if not manifest_file.is_file():
        raise DataError(
            f"packed data {directory} has no {MANIFEST} (missing, or its writer stopped early); run the "
            "prepare_data step again (clear a stale local Flyte cache with `pyflyte local-cache clear`)"
        )
    manifest = json.loads(manifest_file.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"packed data {directory} has format version {manifest.get('format_version')}, this tigon reads "
            f"{FORMAT_VERSION}; prepare the data again with this version"
        )
    expected, found = manifest["tokenizer"], tokenizer_identity(tokenizer)
    if expected["sha256"] != found["sha256"]:
        raise DataError(
            f"packed data {directory} was tokenized with {expected['name']!r} ({expected['size']} tokens), not the "
            f"run's tokenizer {found['name']!r} ({found['size']} tokens); prepare the data again with model.tokenizer "
            "set as in this run"
        )
    train = _load_split(directory / "train.safetensors")
    eval_file = directory / "eval.safetensors"
    evaluation = _load_split(eval_file) if eval_file.is_file() else None
    examples_file = directory / "eval_examples.json"
    examples = None
    if examples_file.is_file():
        examples = [(list(ids), reference) for ids, reference in json.loads(examples_file.read_text())]
    summary = _summary_from_dict(json.loads((directory / "summary.json").read_text()))
    logger.info(
        "data: loaded %d packed sequences from %s (fingerprint %s)", len(train), directory, manifest["fingerprint"]
    )
    return PackedData(train, evaluation, summary, examples, manifest)
