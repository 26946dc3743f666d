"""Preference data: TRL's formats, tokenized with loss masks on the completions only.

    train, eval_, summary = build_preference_datasets(config, tokenizer)

Records (JSONL, Parquet or a saved dataset, read as `tigon.runtime.data` reads SFT data):
- paired (`dpo`, `orpo`, `simpo`, `cpo`): `prompt`, `chosen`, `rejected`;
- unpaired (`kto`): `prompt`, `completion`, `label` (true: desirable).
Each field is text, or (conversational) a list of `{"role", "content"}` messages rendered by the tokenizer's
chat template: the prompt with the generation prompt, the prompt followed by a completion as one conversation.

Tokenized as TRL's trainers do: text completions end with the eos token; the prompt's ids and the
prompt-plus-completion's ids are tokenized separately, and the completion starts where the two diverge (a
chat template that renders the prompt alone differently, or tokens merging across the boundary, move it
left). Each sequence is cut to `data.max_seq_len` from the end (TRL's `keep_start`); a record whose prompt
fills `data.max_seq_len` has no completion token left and is dropped (and counted).

Items hold one row per sequence, `(2, max_seq_len)`: `input_ids`, `labels` (-100 on the prompt and the padding;
aligned with input_ids, the model shifts) and `attention_mask`. A pair's rows are chosen then rejected. A KTO
item's rows are its completion, then its prompt with a mismatched completion, from which the trainer estimates
KTO's reference point (the KL term) as TRL does: within each run of `training.micro_batch_size` records in file
order, record i takes record i-1's completion (the first takes the last). KTO items also hold `desirable` `(1,)`.
The trainer cuts a micro-batch to its longest row, or with `data.packing: true` lays its sequences end to end in one
row (`tigon.runtime.preference_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from tigon.runtime.data import (
    IGNORE_INDEX,
    SKIP_HINT,
    DataError,
    MalformedRecordError,
    _read_located,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tigon.runtime.config import RunConfig

PAIRED_FIELDS = ("prompt", "chosen", "rejected")
UNPAIRED_FIELDS = ("prompt", "completion", "label")


def record_fields(objective: str) -> tuple[str, ...]:
    """The fields a record of this objective's data holds."""
    return UNPAIRED_FIELDS if objective == "kto" else PAIRED_FIELDS


def _check_record(record: dict, fields: tuple[str, ...], where: str) -> bool:
    """Whether the record is conversational; a MalformedRecordError naming the field and the fix otherwise."""
    missing = [name for name in fields if name not in record or record[name] is None]
    if missing:
        shape = (
            '{"prompt": ..., "completion": ..., "label": true}'
            if "label" in fields
            else '{"prompt": ..., "chosen": ..., "rejected": ...}'
        )
        raise MalformedRecordError(
            f"{where}: record lacks {', '.join(repr(name) for name in missing)} (its fields are {sorted(record)}); "
            f"each record must look like {shape}, fields as text or as lists of chat messages; {SKIP_HINT}"
        )
    if "label" in fields and not isinstance(record["label"], bool):
        raise MalformedRecordError(
            f"{where}: 'label' is {record['label']!r}; it must be true (a desirable completion) or false; {SKIP_HINT}"
        )
    texts = [name for name in fields if name != "label"]
    kinds = {name: _kind(record[name], name, where) for name in texts}
    if len(set(kinds.values())) > 1:
        described = ", ".join(f"{name} is {kind}" for name, kind in kinds.items())
        raise MalformedRecordError(
            f"{where}: {described}; give every field as text, or every field as a list of chat messages; {SKIP_HINT}"
        )
    return kinds[texts[0]] == "messages"


def _kind(value: Any, name: str, where: str) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return "messages"
    raise MalformedRecordError(
        f"{where}: {name!r} is {value!r}; it must be text or a list of {{'role': ..., 'content': ...}} messages; "
        f"{SKIP_HINT}"
    )


def _chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool, where: str) -> list:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"conversational preference records need a tokenizer with a chat template, and "
            f"{tokenizer.name_or_path!r} has none; use one whose tokenizer_config.json has one, give the fields as "
            "text, or use model.tokenizer: char"
        )
    from jinja2 import TemplateError

    try:
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
        )
    except TemplateError as error:
        raise MalformedRecordError(f"{where}: the chat template rejects these messages: {error}; {SKIP_HINT}") from None
    return list(encoded["input_ids"])


def _text_ids(tokenizer: PreTrainedTokenizerBase, text: str, eos: bool, encoded: dict[str, list[int]]) -> list[int]:
    ids = list(encoded[text]) if text in encoded else list(tokenizer(text)["input_ids"])
    if eos and tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    return ids


def _common_prefix(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        length += 1
    return length


def record_texts(record: dict, objective: str) -> list[str]:
    """The texts a text record is tokenized as (prompt, prompt + each completion), to encode many in one call."""
    fields = [name for name in record_fields(objective) if name != "label"]
    values = [record.get(name) for name in fields]
    if not all(isinstance(value, str) for value in values):
        return []
    return [values[0]] + [values[0] + value for value in values[1:]]


def tokenize_preference(
    record: dict,
    objective: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    where: str = "record",
    encoded: dict[str, list[int]] | None = None,
) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, [completion ids per sequence]) of one record: chosen then rejected, or KTO's one completion.

    `encoded` maps texts to their ids, tokenized beforehand in one batch (`record_texts`)."""
    encoded = encoded or {}
    fields = record_fields(objective)
    conversational = _check_record(record, fields, where)
    completions = [name for name in fields[1:] if name != "label"]
    if conversational:
        prompt_ids = _chat_ids(tokenizer, record["prompt"], True, where)
        full = [_chat_ids(tokenizer, record["prompt"] + record[name], False, where) for name in completions]
    else:
        prompt_ids = _text_ids(tokenizer, record["prompt"], False, encoded)
        full = [_text_ids(tokenizer, record["prompt"] + record[name], True, encoded) for name in completions]
    start = min(_common_prefix(prompt_ids, ids) for ids in full)
    if any(len(ids) <= start for ids in full):
        empty = [name for name, ids in zip(completions, full, strict=True) if len(ids) <= start]
        raise MalformedRecordError(
            f"{where}: {', '.join(repr(name) for name in empty)} adds no token after the prompt; give every "
            f"completion some text; {SKIP_HINT}"
        )
    return prompt_ids[:start], [ids[start:] for ids in full]


def with_mismatched_completions(
    records: list[tuple[list[int], list[list[int]]]], max_seq_len: int, group: int
) -> list[tuple[list[int], list[list[int]]]]:
    """KTO records with a second completion, another record's (TRL's KL pairs): among the records that fit (a prompt
    shorter than max_seq_len), in runs of `group` in file order, each takes the previous one's, the first the last's."""
    kept = [index for index, (prompt, _) in enumerate(records) if len(prompt) < max_seq_len]
    result = [(prompt, completions * 2) for prompt, completions in records]  # records that do not fit are dropped
    for start in range(0, len(kept), group):
        run = kept[start : start + group]
        for position, index in enumerate(run):
            other = records[run[position - 1]][1][0]
            result[index] = (records[index][0], [records[index][1][0], other])
    return result


class PreferenceDataset(Dataset):
    """Tokenized preference records as fixed-size rows (see the module docstring); `ref_logps` `(N, rows)` float64
    holds the reference model's summed completion log-probs once `objectives.precompute_reference` filled it."""

    def __init__(
        self,
        records: list[tuple[list[int], list[list[int]]]],
        desirable: list[bool] | None,
        max_seq_len: int,
        pad_token_id: int,
    ):
        self.truncated = self.dropped = 0
        rows_of: list[tuple[list[list[int]], list[int]]] = []
        flags: list[bool] = []
        for index, (prompt, completions) in enumerate(records):
            if len(prompt) >= max_seq_len:
                self.dropped += 1
                continue
            self.truncated += any(len(prompt) + len(c) > max_seq_len for c in completions)
            rows_of.append(([(prompt + c)[:max_seq_len] for c in completions], [len(prompt)] * len(completions)))
            if desirable is not None:
                flags.append(desirable[index])
        n, rows = len(rows_of), max((len(completions) for _, completions in records), default=1)
        self.input_ids = torch.full((n, rows, max_seq_len), pad_token_id, dtype=torch.long)
        self.labels = torch.full((n, rows, max_seq_len), IGNORE_INDEX, dtype=torch.long)
        self.attention_mask = torch.zeros((n, rows, max_seq_len), dtype=torch.long)
        for item, (sequences, prompt_lengths) in enumerate(rows_of):
            for row, (ids, start) in enumerate(zip(sequences, prompt_lengths, strict=True)):
                tensor = torch.tensor(ids, dtype=torch.long)
                self.input_ids[item, row, : len(ids)] = tensor
                self.labels[item, row, start : len(ids)] = tensor[start:]
                self.attention_mask[item, row, : len(ids)] = 1
        self.desirable = torch.tensor(flags, dtype=torch.bool).unsqueeze(1) if desirable is not None else None
        self.ref_logps: torch.Tensor | None = None

    @classmethod
    def from_arrays(
        cls,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor,
        desirable: torch.Tensor | None,
        truncated: int,
        dropped: int,
    ) -> PreferenceDataset:
        """A dataset from arrays written earlier (`tigon.runtime.packed`), without tokenizing."""
        dataset = cls.__new__(cls)
        dataset.input_ids, dataset.labels, dataset.attention_mask = input_ids, labels, attention_mask
        dataset.desirable, dataset.truncated, dataset.dropped, dataset.ref_logps = desirable, truncated, dropped, None
        return dataset

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = {
            "input_ids": self.input_ids[index],
            "labels": self.labels[index],
            "attention_mask": self.attention_mask[index],
        }
        if self.desirable is not None:
            item["desirable"] = self.desirable[index]
        if self.ref_logps is not None:
            item["ref_logps"] = self.ref_logps[index]
        return item

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def num_loss_tokens(self) -> int:
        return int((self.labels[..., 1:] != IGNORE_INDEX).sum())


@dataclass
class PreferenceSummary:
    """What building a preference dataset did: records read, skipped, truncated and dropped, tokens."""

    path: str
    objective: str
    records: int
    skipped: int
    truncated: int  # records with a sequence cut to data.max_seq_len
    dropped: int  # records whose prompt fills data.max_seq_len
    examples: int  # pairs (KTO: completions) kept
    tokens: int
    loss_tokens: int
    eval: PreferenceSummary | None = None

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        unit = "completions" if self.objective == "kto" else "pairs"
        lines = [
            f"{self.path}: {self.records} records ({self.skipped} malformed skipped), {self.truncated} truncated, "
            f"{self.dropped} with a prompt filling data.max_seq_len dropped -> {self.examples} {unit}, "
            f"{self.tokens} tokens ({self.loss_tokens} in completions)"
        ]
        if self.eval is not None:
            lines.append("eval " + self.eval.describe())
        return "\n".join(lines)


def _build(path: str, config: RunConfig, tokenizer: PreTrainedTokenizerBase, pad_token_id: int):
    objective, data = config.objective.type, config.data
    records, locations, skipped = _read_located(path, data.skip_malformed)
    texts = sorted({text for record in records for text in record_texts(record, objective)})
    encoded = dict(zip(texts, tokenizer(texts)["input_ids"], strict=True)) if texts else {}
    tokenized, desirable = [], []
    for record, where in zip(records, locations, strict=True):
        try:
            tokenized.append(tokenize_preference(record, objective, tokenizer, where=where, encoded=encoded))
        except MalformedRecordError:
            if not data.skip_malformed:
                raise
            skipped += 1
            continue
        desirable.append(record.get("label") is True)
    if not tokenized:
        raise DataError(f"dataset {path}: all {skipped} records are malformed (skipped); nothing left to train on")
    if objective == "kto":
        tokenized = with_mismatched_completions(tokenized, data.max_seq_len, config.training.micro_batch_size)
    dataset = PreferenceDataset(tokenized, desirable if objective == "kto" else None, data.max_seq_len, pad_token_id)
    if not len(dataset):
        raise DataError(
            f"dataset {path}: every one of its {len(tokenized)} prompts fills data.max_seq_len={data.max_seq_len} "
            "tokens, leaving no completion token; raise data.max_seq_len"
        )
    summary = PreferenceSummary(
        path=str(path),
        objective=objective,
        records=len(records),
        skipped=skipped,
        truncated=dataset.truncated,
        dropped=dataset.dropped,
        examples=len(dataset),
        tokens=dataset.num_tokens,
        loss_tokens=dataset.num_loss_tokens,
    )
    return dataset, summary


def build_preference_datasets(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[PreferenceDataset, PreferenceDataset | None, PreferenceSummary]:
    """The train and (if data.eval is set) eval datasets of a preference objective, and a summary."""
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is None:
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} has neither a pad nor an eos token; load it with load_tokenizer"
        )
    train, summary = _build(config.data.train, config, tokenizer, pad_token_id)
    evaluation = None
    if config.data.eval is not None:
        evaluation, summary.eval = _build(config.data.eval, config, tokenizer, pad_token_id)
    return train, evaluation, summary
