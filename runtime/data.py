"""Training data: read records, tokenize them with loss masks, pack them into fixed-length sequences.

    tokenizer = load_tokenizer(config.model)
    train, eval_, summary = build_datasets(config, tokenizer)
    for batch in DataLoader(train, batch_size=8, shuffle=True):
        batch = {key: value.to(device) for key, value in batch.items()}
        loss = model(**model_inputs(batch, config.model.attn_implementation), use_cache=False).loss

Conventions:
- Labels are aligned with input_ids, not shifted (Hugging Face's convention: the model shifts them);
  -100 marks a token that carries no loss. The first token of every document has label -100, so no
  token is ever predicted from the previous document; padding has label -100.
- Sequences are `data.max_seq_len` long. With packing, documents follow each other greedily in file
  order; a document that does not fit in what is left of a sequence starts the next one. A document
  longer than a sequence is split into pieces (format text, by default) or truncated
  (`data.long_documents`). Position ids restart at 0 for every document, so documents are told apart
  by their position ids alone: "varlen" attention takes the boundaries `model_inputs` derives from
  them, flash-attention 2 and flex attention need nothing else, sdpa and eager take the block-diagonal
  causal mask `packed_attention_mask` builds.
- Formats: `text` (loss on every token), `instruction` (prompt then response + eos; loss on the
  response and eos), `chat` (messages rendered by the tokenizer's chat template; loss on the
  assistant turns, including the end-of-turn tokens the template puts inside them).

Chat loss masks come from rendering prefixes: for the i-th message, an assistant turn, the template
renders messages[:i] with the generation prompt, then messages[:i + 1]; the text between the two is
that turn. This works for any template that renders a conversation's prefixes as prefixes of its
rendering (nearly all do) and needs no `{% generation %}` markers, which most released templates lack.
Each span is tokenized on its own, so the assistant tokens are exactly the tokens the model would
generate after the rendered prompt. A template that breaks the prefix rule but has generation
markers falls back to `apply_chat_template(..., return_assistant_tokens_mask=True)`.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from tigon.kernels.reference import out_of_range
from tigon.runtime.attention import IMPLEMENTATIONS, document_boundaries, resolve
from tigon.runtime.host_copies import to_device

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .config import DataConfig, RunConfig

logger = logging.getLogger("tigon.runtime")

IGNORE_INDEX = -100
SKIP_FROM = 1 / 16  # the share of positions without a label from which the fused loss's head skips them: below it
# the head work saved is within a step's noise, while the skipping costs a copy of the hidden states
LOSS_POSITION_MULTIPLE = 16  # as the fused loss's chunks: its kernels then see the same alignments every micro-batch
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
OTHER_BUILDERS = {".csv": "csv", ".arrow": "arrow", ".txt": "text"}  # datasets' packaged builders by suffix
OTHER_SUFFIXES = tuple(OTHER_BUILDERS)
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json", "dataset_info.json")
HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
SKIP_HINT = "fix the record, or set data.skip_malformed: true to skip malformed records and count them"


class DataError(ValueError):
    """A dataset that cannot be used as configured; the message names the file and what to change."""


class MalformedRecordError(DataError):
    """One record that cannot be read or tokenized; `data.skip_malformed` skips these and counts them."""


# ----------------------------------------------------------------------------------------------------------------------
# Reading


def read_records(
    path: str | Path, skip_malformed: bool = False, data_config: DataConfig | None = None, split: str | None = None
) -> tuple[list[dict], int]:
    """All records of a dataset: a Hub name, a local file, a glob, a dataset directory, or a saved dataset.

    `data_config` supplies the `datasets.load_dataset` options (subset, data_files, revision, cache_dir) and
    `split` the split (default: data.split, else "train"). Returns (records, skipped): with `skip_malformed`,
    JSONL lines that are not a JSON object are skipped and counted; without it, the first one raises
    MalformedRecordError naming the file and its 1-based line. A missing dataset or one with no records
    raises DataError.
    """
    records, _, skipped = _read_located(path, skip_malformed, data_config, split)
    return records, skipped


def _read_located(
    path: str | Path, skip_malformed: bool, data_config: DataConfig | None = None, split: str | None = None
) -> tuple[list[dict], list[str], int]:
    """(records, where each record came from as 'file, line N' / 'source, row N', skipped count).

    Everything goes through `datasets.load_dataset` except what it cannot serve: a JSONL file with
    `skip_malformed` or with a line it cannot parse (read line by line, so the error names the line),
    and any file when the datasets package is missing.
    """
    source = str(path)
    split = split or (data_config.split if data_config is not None else "train")
    local = Path(source).expanduser()
    skipped = 0
    if local.is_dir() and any((local / name).is_file() for name in SAVED_DATASET_FILES):
        records = _read_saved_dataset(local, split)
    elif local.is_file() and local.name.lower().endswith(JSONL_SUFFIXES) and skip_malformed:
        records, locations, skipped = _read_jsonl(local, skip_malformed)
        return _nonempty(local, records, skipped), locations, skipped
    elif local.is_file() and not local.name.lower().endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES + OTHER_SUFFIXES):
        raise DataError(
            f"dataset {local}: unknown file type {local.suffix or '(no suffix)'!r}; use JSONL "
            f"({', '.join(JSONL_SUFFIXES)}), Parquet ({', '.join(PARQUET_SUFFIXES)}), "
            f"{', '.join(OTHER_SUFFIXES)}, a directory saved by datasets.save_to_disk, or a Hub dataset name"
        )
    elif local.exists() or _is_pattern(source) or _looks_like_hub_name(source):
        try:
            records = _load_dataset(source, split, data_config)
        except _DatasetsCannotServe as reason:
            if not (local.is_file() and local.name.lower().endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)):
                raise DataError(str(reason)) from None
            if local.name.lower().endswith(PARQUET_SUFFIXES):
                records = _read_parquet(local)
            else:
                records, locations, skipped = _read_jsonl(local, skip_malformed)
                return _nonempty(local, records, skipped), locations, skipped
    else:
        raise DataError(
            f"dataset {local} does not exist (data.train / data.eval take a Hub dataset name, a JSONL, Parquet, "
            "CSV or Arrow file, a glob of them, a dataset directory, or a directory saved by datasets.save_to_disk)"
        )
    records = _nonempty(source, records, skipped)
    if local.is_file() and local.name.lower().endswith(JSONL_SUFFIXES):
        lines = _record_lines(local)
        if len(lines) == len(records):  # one record per non-blank line: name the line
            return records, [f"{local}, line {number}" for number in lines], skipped
    return records, [f"{source}, row {index}" for index in range(1, len(records) + 1)], skipped


def _record_lines(path: Path) -> list[int]:
    """1-based numbers of a JSONL file's non-blank lines."""
    with path.open("rb") as file:
        return [number for number, line in enumerate(file, start=1) if line.strip()]


def _nonempty(source: str | Path, records: list[dict], skipped: int) -> list[dict]:
    if not records:
        if skipped:
            raise DataError(
                f"dataset {source}: all {skipped} records are malformed (skipped); nothing left to train on"
            )
        raise DataError(f"dataset {source} holds no records")
    return records


class _DatasetsCannotServe(Exception):
    """`datasets.load_dataset` is missing or failed on a file tigon can also read itself."""


def _is_pattern(source: str) -> bool:
    return any(char in source for char in "*?[")


def _looks_like_hub_name(source: str) -> bool:
    """`org/name` (or `name`) that is not a path to a data file."""
    return bool(HUB_NAME.match(source)) and _builder(source) is None


def is_hub_dataset(source: str) -> bool:
    """Whether data.train / data.eval names a Hub dataset (`org/name`): no such local path, no file suffix."""
    return _looks_like_hub_name(source) and not Path(source).expanduser().exists()


def _builder(path: str) -> str | None:
    """The `datasets` packaged builder for a file (or glob) by its suffix; None leaves the choice to datasets."""
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "json"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return next((builder for suffix, builder in OTHER_BUILDERS.items() if name.endswith(suffix)), None)


def _load_dataset(source: str, split: str, data_config: DataConfig | None) -> list[dict]:
    """One split of `source` through `datasets.load_dataset`, as a list of records (Arrow's added None dropped)."""
    try:
        import datasets
    except ImportError:
        raise _DatasetsCannotServe(
            f"dataset {source}: reading it needs the datasets package: pip install datasets"
        ) from None
    options: dict[str, Any] = {"split": split}
    if data_config is not None:
        options.update(name=data_config.subset, revision=data_config.revision, cache_dir=data_config.cache_dir)
    files = data_config.data_files if data_config is not None else None
    local = Path(source).expanduser()
    builder = _builder(source) if (local.is_file() or _is_pattern(source)) else None
    if builder is not None:
        path, files = builder, str(local) if local.is_file() else source
    else:
        path = str(local) if local.is_dir() else source
    if files is not None:
        options["data_files"] = files
    try:
        dataset = datasets.load_dataset(path, **{k: v for k, v in options.items() if v is not None})
    except ValueError as error:
        if "split" in str(error).lower():
            raise DataError(
                f"dataset {source}: {error}; set data.split (data.eval_split for data.eval) to one of its splits"
            ) from None
        if builder is not None:
            raise _DatasetsCannotServe(f"dataset {source}: {error}") from None
        raise DataError(f"dataset {source}: {error}; check data.subset and data.data_files") from None
    except (datasets.exceptions.DatasetNotFoundError, FileNotFoundError) as error:
        if local.exists():
            raise DataError(
                f"dataset {source}: {error}; point it at data files (JSONL, Parquet, CSV, Arrow, text), set "
                "data.data_files, or use a directory saved by datasets.save_to_disk"
            ) from None
        raise DataError(
            f"dataset {source}: not found ({error}); check the name (org/name) or path, set HF_TOKEN for a private "
            "or gated dataset, and unset HF_HUB_OFFLINE unless it is in the cache"
        ) from None
    except ConnectionError as error:
        raise DataError(
            f"dataset {source}: {error}; it is not in datasets' cache and the Hub cannot be reached (HF_HUB_OFFLINE=1, "
            "or no network): load it once where the Hub is reachable, or point data.train at local files"
        ) from None
    except (datasets.exceptions.DatasetGenerationError, OSError) as error:
        if builder is not None:
            raise _DatasetsCannotServe(f"dataset {source}: {error}") from None
        raise DataError(f"dataset {source}: cannot be read ({error.__cause__ or error})") from None
    if builder == "json" and "Json(" in repr(dataset.features):
        # A field of mixed types (text in one record, a list in another) becomes datasets' Json feature, which decodes
        # text that parses as JSON ("9" becomes 9): tigon's own reader keeps every value as written.
        raise _DatasetsCannotServe(f"dataset {source}: fields of mixed types")
    if builder == "json":  # JSON records differ in their keys: Arrow's None there is a key the record lacks
        return [_without_none(row) for row in dataset.to_list()]
    return [{key: _without_none(value) for key, value in row.items()} for row in dataset.to_list()]


def _without_none(value: Any) -> Any:
    """A value without the None entries Arrow adds where records differ (a message with no `name` gets name=None
    when another has one), so records read as they were written; chat templates test `is defined`. Columnar
    files keep a record's own null fields (a null column value is a malformed record)."""
    if isinstance(value, dict):
        return {key: _without_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_none(item) for item in value]
    return value


def _read_jsonl(path: Path, skip_malformed: bool) -> tuple[list[dict], list[str], int]:
    records, locations, skipped = [], [], 0
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            where = f"{path}, line {number}"
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise MalformedRecordError(f"{where}: not UTF-8 text ({error}); {SKIP_HINT}") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise MalformedRecordError(f"{where}: invalid JSON ({error}); {SKIP_HINT}") from None
                if not isinstance(record, dict):
                    raise MalformedRecordError(
                        f"{where}: expected a JSON object, got {type(record).__name__}; {SKIP_HINT}"
                    )
            except MalformedRecordError:
                if not skip_malformed:
                    raise
                skipped += 1
                continue
            records.append(record)
            locations.append(where)
    return records, locations, skipped


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"dataset {path}: not a readable Parquet file ({error})") from None


def _read_saved_dataset(path: Path, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"dataset {path} was saved by datasets.save_to_disk; reading it needs the datasets package: "
            "pip install datasets (or convert it to JSONL or Parquet)"
        ) from None
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        if split in dataset:
            dataset = dataset[split]
        elif len(dataset) == 1:
            dataset = next(iter(dataset.values()))
        else:
            raise DataError(
                f"dataset {path} holds the splits {sorted(dataset)}, not {split!r}; set data.split (data.eval_split "
                "for data.eval) to one of them"
            )
    return [dict(row) for row in dataset.to_list()]


# ----------------------------------------------------------------------------------------------------------------------
# Tokenizing


def _field(record: dict, name: str, setting: str, where: str, kind: type | tuple[type, ...] = str) -> Any:
    """The record's `name` field (data.`setting`), of type `kind`; MalformedRecordError when it is absent, null
    (a Parquet null or JSON null), of another type, or an empty or blank string."""
    if name not in record:
        raise MalformedRecordError(
            f"{where}: record has no field {name!r} (data.{setting}); its fields are {sorted(record)}; "
            f"set data.{setting} to the right field name, or {SKIP_HINT}"
        )
    value = record[name]
    if value is None:
        raise MalformedRecordError(f"{where}: field {name!r} (data.{setting}) is null; {SKIP_HINT}")
    if not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise MalformedRecordError(
            f"{where}: field {name!r} (data.{setting}) is a {type(value).__name__}, expected {expected}; {SKIP_HINT}"
        )
    if isinstance(value, str) and not value.strip():
        raise MalformedRecordError(f"{where}: field {name!r} (data.{setting}) is an empty string; {SKIP_HINT}")
    return value


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool) -> list[int]:
    if not text and not add_special_tokens:
        return []
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _eos_id(tokenizer: PreTrainedTokenizerBase, data_format: str) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} has no eos token, which data.format {data_format!r} needs to "
            "end every response; use a tokenizer with one (or model.tokenizer: char)"
        )
    return tokenizer.eos_token_id


def instruction_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """An instruction prompt's ids as training sees them: the tokenizer's own leading special tokens (e.g.
    Llama's <bos>, the char tokenizer's <bos>) and the prompt, never ending in eos. Generate from these."""
    ids = _encode(tokenizer, prompt, add_special_tokens=True)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return ids


def tokenize_record(
    record: dict, data_config: DataConfig, tokenizer: PreTrainedTokenizerBase, *, where: str = "record"
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one record; labels are input_ids with -100 where no loss is taken.

    `where` ('file, line N') prefixes error messages; a record missing the configured field, or with a
    field of the wrong type, raises MalformedRecordError.
    """
    fmt = data_config.format
    if fmt == "text":
        text = _field(record, data_config.text_field, "text_field", where)
        ids = _encode(tokenizer, text, add_special_tokens=True)
        eos = tokenizer.eos_token_id
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids, list(ids)
    if fmt == "instruction":
        prompt = _field(record, data_config.prompt_field, "prompt_field", where)
        response = _field(record, data_config.response_field, "response_field", where)
        prompt_ids = instruction_prompt_ids(tokenizer, prompt)
        response_ids = _encode(tokenizer, response, add_special_tokens=False) + [_eos_id(tokenizer, fmt)]
        return prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids
    if fmt == "chat":
        messages = _messages(record, data_config, where)
        return _tokenize_chat(messages, tokenizer, where)
    raise DataError(f"unknown data.format {fmt!r}; use text, instruction or chat")


def encode_prompt(
    record: dict, data_config: DataConfig, tokenizer: PreTrainedTokenizerBase, *, where: str = "record"
) -> tuple[list[int], str]:
    """(prompt_ids, reference) for generation-based evaluation, tokenized exactly as in training.

    instruction: the prompt's ids and the response. chat: the conversation before its last assistant
    turn, rendered with the generation prompt, and that turn's content.
    """
    if data_config.format == "instruction":
        prompt = _field(record, data_config.prompt_field, "prompt_field", where)
        response = _field(record, data_config.response_field, "response_field", where)
        return instruction_prompt_ids(tokenizer, prompt), response
    if data_config.format == "chat":
        messages = _messages(record, data_config, where)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise MalformedRecordError(f"{where}: the conversation has no assistant message to compare against")
        prompt = _render(tokenizer, messages[:last], True, where)
        return _encode(tokenizer, prompt, add_special_tokens=False), messages[last]["content"]
    raise DataError("generation-based evaluation needs data.format instruction or chat (text has no prompt)")


def _messages(record: dict, data_config: DataConfig, where: str) -> list[dict]:
    """The record's conversation, checked: a non-empty list of {role, content} strings, not opening with the
    assistant (its first turn would have no prompt to answer)."""
    messages = _field(record, data_config.messages_field, "messages_field", where, list)
    if not messages:
        raise MalformedRecordError(f"{where}: {data_config.messages_field!r} holds no messages; {SKIP_HINT}")
    for index, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise MalformedRecordError(
                f"{where}: message {index} of {data_config.messages_field!r} must be an object with string 'role' "
                f"and 'content', got {message!r}; {SKIP_HINT}"
            )
    if messages[0]["role"] == "assistant":
        raise MalformedRecordError(
            f"{where}: the conversation starts with an assistant message; it needs a user (or system) message "
            f"first; {SKIP_HINT}"
        )
    return messages


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool, where: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"data.format 'chat' needs a tokenizer with a chat template, and {tokenizer.name_or_path!r} has none; "
            "use a tokenizer directory whose tokenizer_config.json (or chat_template.jinja) has one, or "
            "model.tokenizer: char"
        )
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except (TemplateError, ValueError) as error:
        raise MalformedRecordError(
            f"{where}: the chat template rejects this conversation: {error}; {SKIP_HINT}"
        ) from None


_GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


def _chat_segments(messages: list[dict], tokenizer: PreTrainedTokenizerBase, where: str) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is_assistant_turn) pieces, by rendering its prefixes."""
    full = _render(tokenizer, messages, False, where)
    segments, cursor = [], 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], True, where)
        through = _render(tokenizer, messages[: index + 1], False, where)
        if not (len(before) >= cursor and through.startswith(before) and full.startswith(through)):
            raise _PrefixRuleBroken(
                f"{where}: the chat template of {tokenizer.name_or_path!r} does not render the first {index} messages "
                f"(with the generation prompt) as a prefix of the first {index + 1}, so assistant turns cannot be "
                "located by rendering prefixes; add {% generation %} markers around the assistant content in the "
                "template, or use a template that renders prefixes consistently"
            )
        segments.append((full[cursor : len(before)], False))
        segments.append((full[len(before) : len(through)], True))
        cursor = len(through)
    segments.append((full[cursor:], False))
    return [(text, trainable) for text, trainable in segments if text]


class _PrefixRuleBroken(DataError):
    pass


def _tokenize_chat(messages: list[dict], tokenizer: PreTrainedTokenizerBase, where: str) -> tuple[list[int], list[int]]:
    try:
        segments = _chat_segments(messages, tokenizer, where)
    except _PrefixRuleBroken:
        if not _GENERATION_MARKER.search(tokenizer.chat_template or ""):
            raise
        return _tokenize_chat_by_generation_markers(messages, tokenizer)
    ids: list[int] = []
    labels: list[int] = []
    for text, trainable in segments:
        piece = _encode(tokenizer, text, add_special_tokens=False)
        ids += piece
        labels += piece if trainable else [IGNORE_INDEX] * len(piece)
    return ids, labels


def _tokenize_chat_by_generation_markers(
    messages: list[dict], tokenizer: PreTrainedTokenizerBase
) -> tuple[list[int], list[int]]:
    """The fallback: Hugging Face's assistant mask from the template's {% generation %} markers."""
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = list(encoded["input_ids"])
    labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, encoded["assistant_masks"], strict=True)]
    return ids, labels


# ----------------------------------------------------------------------------------------------------------------------
# Packing


class PackedDataset(Dataset):
    """Fixed-length sequences of documents; items are dicts of LongTensors input_ids, labels, position_ids.

    `documents` are (input_ids, labels) pairs. A document longer than `max_seq_len` keeps its first
    `max_seq_len` tokens (counted in `truncated`), or with `split_long` becomes pieces of `max_seq_len` tokens
    (counted in `split_documents`), each starting with the previous piece's last token: every piece's first
    label is -100, so that overlap keeps each token predicted once. A document or piece with no label left
    (after its first label is set to -100) is dropped (counted in `dropped`). With `packing`, documents share
    sequences: `strategy` "best_fit" (the default) places the longest first, each into the fullest sequence it
    still fits (best-fit decreasing: little padding, so little compute spent on it), "in_order" fills one sequence
    at a time in the documents' order; without `packing` each gets its own sequence. Tails are padded with
    `pad_token_id`, label -100, and position ids that go on counting from the last document's: under causal
    attention no real token attends to the padding after it, and a row of one document stays one document, which
    trains with plain causal attention (no dense mask, see `model_inputs`).

    `teacher_hidden`: distillation's precomputed teacher (`distill.precompute_teacher`), the teacher's final hidden
    states at every item's completion tokens end to end and each item's first row (N + 1 offsets); an item then
    carries its own rows, which `batches.collate` joins.
    """

    teacher_hidden: tuple[torch.Tensor, torch.Tensor] | None = None
    _row_tokens: list[int] | None = None  # `row_tokens`, once read

    def __init__(
        self,
        documents: Sequence[tuple[Sequence[int], Sequence[int]]],
        max_seq_len: int,
        pad_token_id: int,
        packing: bool = True,
        split_long: bool = False,
        strategy: str = "best_fit",
    ):
        if strategy not in PACKING_STRATEGIES:
            raise ValueError(f"unknown packing strategy {strategy!r}; use one of {', '.join(PACKING_STRATEGIES)}")
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        if split_long and max_seq_len < 2:
            raise ValueError("split_long needs max_seq_len of at least 2: a 1-token piece has no token to predict")
        if pad_token_id is None:
            raise ValueError(
                "pad_token_id is None: give the tokenizer a pad token (tigon.runtime.tokenizer.load_tokenizer does)"
            )
        self.max_seq_len, self.packing = max_seq_len, packing
        self.truncated = self.split_documents = self.dropped = self.documents = 0
        self.num_tokens = self.num_loss_tokens = self.num_padding_tokens = 0
        placed: list[tuple[Sequence[int], list[int]]] = []  # documents that train, labels shifted

        def pieces(numbered):
            """The documents to place: each one whole, split into pieces, or truncated (and counted as such)."""
            for number, (doc_ids, doc_labels) in numbered:
                if len(doc_ids) != len(doc_labels):
                    raise ValueError(f"document {number}: {len(doc_ids)} input ids but {len(doc_labels)} labels")
                if len(doc_ids) <= max_seq_len:
                    yield doc_ids, doc_labels
                elif split_long:
                    self.split_documents += 1
                    for start in range(0, len(doc_ids) - 1, max_seq_len - 1):
                        yield doc_ids[start : start + max_seq_len], doc_labels[start : start + max_seq_len]
                else:
                    self.truncated += 1
                    yield doc_ids[:max_seq_len], doc_labels[:max_seq_len]

        for doc_ids, doc_labels in pieces(enumerate(documents)):
            if not doc_ids:
                self.dropped += 1
                continue
            doc_labels = [IGNORE_INDEX, *doc_labels[1:]]
            loss_tokens = sum(label != IGNORE_INDEX for label in doc_labels)
            if not loss_tokens:
                self.dropped += 1
                continue
            placed.append((doc_ids, doc_labels))
            self.documents += 1
            self.num_tokens += len(doc_ids)
            self.num_loss_tokens += loss_tokens

        lengths = [len(doc_ids) for doc_ids, _ in placed]
        if not packing:
            rows = [[index] for index in range(len(placed))]
        elif strategy == "best_fit":
            rows = best_fit_rows(lengths, max_seq_len)
        else:
            rows = in_order_rows(lengths, max_seq_len)
        rows_ids, rows_labels, rows_positions = [], [], []
        for row in rows:
            ids = [token for index in row for token in placed[index][0]]
            pad = max_seq_len - len(ids)
            self.num_padding_tokens += pad
            rows_ids.append(ids + [pad_token_id] * pad)
            rows_labels.append([label for index in row for label in placed[index][1]] + [IGNORE_INDEX] * pad)
            positions = [position for index in row for position in range(lengths[index])]
            start = positions[-1] + 1
            rows_positions.append(positions + list(range(start, start + pad)))
        shape = (len(rows_ids), max_seq_len)
        self.input_ids = torch.tensor(rows_ids, dtype=torch.long).reshape(shape)
        self.labels = torch.tensor(rows_labels, dtype=torch.long).reshape(shape)
        self.position_ids = torch.tensor(rows_positions, dtype=torch.long).reshape(shape)

    @classmethod
    def from_arrays(
        cls,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        max_seq_len: int,
        packing: bool,
        **counters: int,
    ) -> PackedDataset:
        """A dataset from already packed (N, max_seq_len) arrays and its counters (`tigon.runtime.packed`)."""
        shape = (input_ids.shape[0], max_seq_len)
        if any(tuple(array.shape) != shape for array in (input_ids, labels, position_ids)):
            raise DataError(
                f"packed arrays must all be {shape}; got input_ids {tuple(input_ids.shape)}, labels "
                f"{tuple(labels.shape)}, position_ids {tuple(position_ids.shape)}: prepare the data again"
            )
        dataset = cls.__new__(cls)
        dataset.max_seq_len, dataset.packing = max_seq_len, packing
        dataset.truncated = dataset.split_documents = dataset.dropped = dataset.documents = 0
        dataset.num_tokens = dataset.num_loss_tokens = dataset.num_padding_tokens = 0
        for name, value in counters.items():
            if not hasattr(dataset, name):
                raise TypeError(f"unknown PackedDataset counter {name!r}")
            setattr(dataset, name, value)
        dataset.input_ids, dataset.labels, dataset.position_ids = input_ids, labels, position_ids
        return dataset

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def row_tokens(self, chunk: int = 4096) -> list[int]:
        """Per row, the tokens up to its last labelled one: what varlen attention computes of it (its padding is
        dropped). Read `chunk` rows at a time."""
        if self._row_tokens is None:
            self._row_tokens = [
                length
                for start in range(0, len(self), chunk)
                for length in labelled_lengths(self.labels[start : start + chunk]).tolist()
            ]
        return self._row_tokens

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = {name: getattr(self, name)[index] for name in ("input_ids", "labels", "position_ids")}
        if self.teacher_hidden is not None:
            hidden, offsets = self.teacher_hidden
            item["teacher_hidden"] = hidden[offsets[index] : offsets[index + 1]]
        return item


PACKING_STRATEGIES = ("best_fit", "in_order")


def in_order_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Documents (by index) into rows of `capacity` tokens in their order, a new row when the next does not fit."""
    rows: list[list[int]] = []
    room = 0
    for index, length in enumerate(lengths):
        if not rows or length > room:
            rows.append([])
            room = capacity
        rows[-1].append(index)
        room -= length
    return rows


def best_fit_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Documents (by index) into rows of `capacity` tokens, best-fit decreasing: longest first (equal lengths in
    their order), each into a row with the least room that still holds it, else a new row."""
    rows: list[list[int]] = []
    rooms: list[int] = []  # the distinct room left in some row, ascending
    rows_with_room: dict[int, list[int]] = {}
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        at = bisect.bisect_left(rooms, length)
        if at == len(rooms):
            row, room = len(rows), capacity
            rows.append([])
        else:
            room = rooms[at]
            row = rows_with_room[room].pop()
            if not rows_with_room[room]:
                del rows_with_room[room], rooms[at]
        rows[row].append(index)
        left = room - length
        if not left:
            continue
        if left not in rows_with_room:
            rows_with_room[left] = []
            bisect.insort(rooms, left)
        rows_with_room[left].append(row)
    return rows


MODEL_INPUTS = ("input_ids", "labels", "position_ids")


def packed_attention_mask(position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (B, 1, L, L) block-diagonal causal mask of packed sequences, for a custom 4D attention_mask.

    A new document starts wherever position_ids is 0; token i may attend to token j when j <= i and both
    are in the same document. For a floating `dtype` the mask is additive (0 where allowed, the dtype's
    minimum where masked): what eager attention needs (it adds the mask to the scores) and what sdpa
    accepts when the dtype matches the query's. `dtype=torch.bool` gives True where allowed: what sdpa
    accepts at any query dtype, and what eager must NOT be given (it would add 1 and 0 to the scores).
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2:
        got = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise ValueError(f"position_ids must be a (batch, length) tensor, got {got}")
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise ValueError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    if not (dtype == torch.bool or dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating dtype (additive mask) or torch.bool, got {dtype}")
    length = position_ids.shape[1]
    document = (position_ids == 0).cumsum(dim=-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = ((document[:, :, None] == document[:, None, :]) & causal)[:, None]
    if dtype == torch.bool:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def single_documents(position_ids: torch.Tensor) -> bool:
    """Whether each row holds one document: its position ids count 0, 1, 2, ... to the end."""
    expected = torch.arange(position_ids.shape[-1], device=position_ids.device)
    return bool((position_ids == expected).all())


def model_inputs(
    batch: dict,
    attn_implementation: str,
    device: torch.device | str | None = None,
    token_multiple: int = 1,
    loss_positions: bool = False,
    whole_rows: bool = False,
) -> dict[str, Any]:
    """Keyword arguments for a Hugging Face causal LM's forward on a batch of PackedDataset items.

    Gives input_ids, labels and position_ids, on `device` when given, plus what tells the attention where the
    documents of a packed row are (`attn_implementation` as in model.attn_implementation; "auto" resolves as
    `tigon.runtime.attention.resolve` says):
    - "varlen": the rows without their padding, as one row (`unpadded`), and the documents' boundaries
      (`tigon.runtime.attention.document_boundaries`), no mask;
    - "sdpa": the boolean block-diagonal causal mask (any weight dtype or autocast);
    - "eager": the additive float32 mask (eager adds it to the scores; promotion handles bf16/fp16);
    - "flash_attention_2", "flex_attention": nothing; transformers finds the documents from position_ids.
    Boundaries are read from the batch as given (a CPU batch needs no GPU synchronization); a mask is (B, 1, L,
    L), made on `device` (else on position_ids' device). Call the model with use_cache=False too: transformers
    5 skips its own packed-sequence detection when a cache is made. When every row is a single document
    (position ids 0, 1, 2, ... throughout; for "varlen" also labelled to its end) the rows go as they are, with
    nothing added: attention is plain causal and SDPA may take its flash kernel, where a dense mask forces the
    slower memory-efficient kernel and an (L, L) bias per layer. `token_multiple` (`token_multiple`): "varlen"
    keeps as many of the dropped padding tokens as make the row's length a multiple of it. `loss_positions`, for a
    model with tigon's fused loss (`tigon.kernels.patching.causal_lm.has_fused_loss`), adds the positions whose next
    token carries a loss (`positions_with_loss`, found on the batch as given), so the head skips prompts and padding
    without a GPU synchronization. `whole_rows` (`training.static_shapes`): "varlen" keeps every row whole, padding and
    all, so micro-batches of as many rows have the same token count.
    """
    missing = [key for key in MODEL_INPUTS if key not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}; expected a collated batch of PackedDataset items")
    attention = resolve(attn_implementation)
    if attention not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attn_implementation {attn_implementation!r}; use auto, {', '.join(IMPLEMENTATIONS)}")
    positions = batch["position_ids"]
    if attention == "varlen" and whole_rows:
        lengths = torch.full((positions.shape[0],), positions.shape[1])
        return unpadded(batch, grown_to_multiple(lengths, positions.shape[1], token_multiple), device, loss_positions)
    if attention == "varlen":
        lengths = labelled_lengths(batch["labels"])
        if not single_documents(positions) or bool((lengths < positions.shape[1]).any()):
            lengths = grown_to_multiple(lengths, positions.shape[1], token_multiple)
            return unpadded(batch, lengths, device, loss_positions)
    inputs = {key: batch[key] if device is None else to_device(batch[key], device) for key in MODEL_INPUTS}
    if loss_positions:
        inputs |= _loss_positions(batch["labels"], device)
    if attention in ("varlen", "flash_attention_2", "flex_attention") or single_documents(positions):
        return inputs
    dtype = torch.bool if attention == "sdpa" else torch.float32
    inputs["attention_mask"] = packed_attention_mask(inputs["position_ids"], dtype)
    return inputs


def positions_with_loss(labels: torch.Tensor) -> torch.Tensor | None:
    """Indices into the flattened `(B, L)` labels of the positions whose next label is a token (the causal shift: a
    row's last position predicts nothing), with as many positions without one as make their count a multiple of
    LOSS_POSITION_MULTIPLE; None where `projected_count` finds nothing worth skipping."""
    with_loss = torch.zeros_like(labels, dtype=torch.bool)
    with_loss[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    with_loss = with_loss.flatten()
    count = int(with_loss.sum())
    kept = projected_count(count, with_loss.numel())
    if kept is None:
        return None
    with_loss[(~with_loss).nonzero().squeeze(1)[: kept - count]] = True
    return with_loss.nonzero().squeeze(1)


def projected_count(count: int, total: int) -> int | None:
    """How many of `total` positions a loss head projects when `count` of them carry a loss: `count` rounded up to
    LOSS_POSITION_MULTIPLE; None where that leaves out under SKIP_FROM of them (too little head work to skip) or
    `count` is 0 (the loss is empty either way). The rule of the SFT and the preference losses alike."""
    kept = -(-count // LOSS_POSITION_MULTIPLE) * LOSS_POSITION_MULTIPLE
    return kept if count and kept <= (1 - SKIP_FROM) * total else None


def _loss_positions(labels: torch.Tensor, device: torch.device | str | None) -> dict[str, torch.Tensor]:
    """`loss_positions` of `labels` on `device` (none where `positions_with_loss` finds nothing to skip)."""
    positions = positions_with_loss(labels)
    if positions is None:
        return {}
    return {"loss_positions": positions if device is None else to_device(positions, device)}


def labelled_lengths(labels: torch.Tensor) -> torch.Tensor:
    """Per row, the tokens up to its last labelled one (at least one token in the batch)."""
    column = torch.arange(1, labels.shape[1] + 1, device=labels.device)
    lengths = torch.where(labels != IGNORE_INDEX, column, 0).amax(dim=1)
    if not bool(lengths.any()):  # nothing labelled: one token keeps the forward defined, with no loss
        lengths[0] = 1
    return lengths


def check_labels(datasets, vocab_size: int, rows: int = 4096) -> None:
    """Fail, naming the fix, if a label of the datasets (None skipped) is neither IGNORE_INDEX nor a token id below
    `vocab_size` (the model's head). Checked once on the host, in chunks of `rows` rows, so the fused loss need not
    check on the GPU."""
    for dataset in datasets:
        if dataset is None:
            continue
        labels = dataset.labels.reshape(-1, dataset.labels.shape[-1])
        for start in range(0, labels.shape[0], rows):
            chunk = labels[start : start + rows]
            bad = out_of_range(chunk, vocab_size, IGNORE_INDEX)
            if bool(bad.any()):
                label = int(chunk[bad][0])
                raise DataError(
                    f"a label is {label}, which is no token of the model's {vocab_size} (labels are token ids, "
                    f"or {IGNORE_INDEX} for no loss): the data was tokenized with another tokenizer; prepare it again "
                    "with this run's model.tokenizer"
                )


def token_multiple(precision: str) -> int:
    """What the tokens a micro-batch feeds the model must be a multiple of: 16 under `precision: fp8` (an FP8
    matmul's inner dimension is a multiple of 16, and the weight gradient's inner dimension is the tokens), else 1."""
    return 16 if precision == "fp8" else 1


def grown_to_multiple(lengths: torch.Tensor, row_length: int, multiple: int) -> torch.Tensor:
    """Rows' kept lengths grown, first rows first, into the padding after them until their sum is a multiple of
    `multiple`. The tokens added follow every labelled token of their row, so no labelled token sees them."""
    missing = -int(lengths.sum()) % multiple
    if not missing:
        return lengths
    room = row_length - lengths
    if missing > int(room.sum()):
        raise ValueError(
            f"a micro-batch of {int(lengths.sum())} tokens cannot grow to a multiple of {multiple} within its rows "
            f"of {row_length}: make data.max_seq_len a multiple of {multiple}"
        )
    added = torch.minimum(room, (missing - (room.cumsum(0) - room)).clamp(min=0))
    return lengths + added


def unpadded(
    batch: dict, lengths: torch.Tensor, device: torch.device | str | None = None, loss_positions: bool = False
) -> dict[str, Any]:
    """ "varlen" inputs: each row's first `lengths` tokens, rows concatenated into one (1, N) row, and the
    documents' boundaries.

    What is dropped after a row's last labelled token (padding, or a document's unlabelled tail) is seen by no
    labelled token under causal attention and carries no loss, so the loss and every gradient are those of the
    padded batch; the padding costs no compute. Each row's first label becomes -100: the causal shift never
    predicted it, and now it follows the previous row.
    """
    labels = batch["labels"].clone()
    labels[:, 0] = IGNORE_INDEX
    keep = torch.arange(labels.shape[1], device=labels.device) < lengths[:, None]
    flat = {"input_ids": batch["input_ids"][keep], "labels": labels[keep], "position_ids": batch["position_ids"][keep]}
    inputs = {key: (value if device is None else to_device(value, device))[None] for key, value in flat.items()}
    target = inputs["position_ids"].device
    if loss_positions:
        inputs |= _loss_positions(flat["labels"][None], device)
    return inputs | document_boundaries(batch["position_ids"], lengths, target)


# ----------------------------------------------------------------------------------------------------------------------
# Building


@dataclass
class DataSummary:
    """What building a dataset did: records read and skipped, documents truncated or dropped, tokens."""

    path: str
    records: int  # records read (not counting skipped ones)
    skipped: int  # malformed records skipped (unreadable lines, missing or mistyped fields)
    truncated: int  # documents cut to data.max_seq_len
    dropped: int  # documents with no loss token left (e.g. a prompt longer than max_seq_len)
    sequences: int
    tokens: int  # real tokens in the sequences (padding excluded)
    loss_tokens: int  # tokens with a label
    padding_tokens: int
    unknown_tokens: int = 0  # tokens the tokenizer could only map to its unknown token
    split_documents: int = 0  # documents split into pieces of data.max_seq_len (data.long_documents)
    loss_fraction: float = field(init=False)  # loss_tokens / tokens
    eval: DataSummary | None = None

    def __post_init__(self) -> None:
        self.loss_fraction = self.loss_tokens / self.tokens if self.tokens else 0.0

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        lines = [
            f"{self.path}: {self.records} records ({self.skipped} malformed skipped), {self.truncated} truncated, "
            f"{self.split_documents} split, "
            f"{self.dropped} without loss tokens dropped -> {self.sequences} sequences, {self.tokens} tokens "
            f"({self.loss_fraction:.1%} with loss, {self.padding_tokens} padding)"
        ]
        if self.eval is not None:
            lines.append("eval " + self.eval.describe())
        return "\n".join(lines)


def eval_source(data_config: DataConfig) -> tuple[str, str] | None:
    """(source, split) of the held-out examples: data.eval at data.eval_split (default 'train'), or data.train
    at data.eval_split when only that is set; None without either."""
    if data_config.eval is not None:
        return data_config.eval, data_config.eval_split or "train"
    if data_config.eval_split is not None:
        return data_config.train, data_config.eval_split
    return None


def _build(
    path: str, data_config: DataConfig, tokenizer: PreTrainedTokenizerBase, pad_token_id: int, split: str
) -> tuple[PackedDataset, DataSummary]:
    records, locations, skipped = _read_located(path, data_config.skip_malformed, data_config, split)
    documents = []
    for record, where in zip(records, locations, strict=True):
        try:
            documents.append(tokenize_record(record, data_config, tokenizer, where=where))
        except MalformedRecordError:
            if not data_config.skip_malformed:
                raise
            skipped += 1
    if not documents:
        raise DataError(f"dataset {path}: all {skipped} records are malformed (skipped); nothing left to train on")
    unknown = _warn_unknown_tokens(path, records, locations, documents, tokenizer)
    dataset = PackedDataset(
        documents,
        data_config.max_seq_len,
        pad_token_id,
        data_config.packing,
        data_config.splits_long_documents,
        data_config.packing_strategy,
    )
    if not len(dataset):
        raise DataError(
            f"dataset {path}: none of its {len(documents)} documents has a token with loss within the first "
            f"data.max_seq_len={data_config.max_seq_len} tokens; raise data.max_seq_len or check data.format"
        )
    summary = DataSummary(
        path=str(path),
        records=len(records),
        skipped=skipped,
        truncated=dataset.truncated,
        split_documents=dataset.split_documents,
        dropped=dataset.dropped,
        sequences=len(dataset),
        tokens=dataset.num_tokens,
        loss_tokens=dataset.num_loss_tokens,
        padding_tokens=dataset.num_padding_tokens,
        unknown_tokens=unknown,
    )
    return dataset, summary


def _strings(value: Any) -> list[str]:
    """Every string inside a record (its fields, and the contents of nested messages)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for item in value.values() for text in _strings(item)]
    if isinstance(value, list):
        return [text for item in value for text in _strings(item)]
    return []


def _warn_unknown_tokens(
    path: str, records: list[dict], locations: list[str], documents: list, tokenizer: PreTrainedTokenizerBase
) -> int:
    """Count the tokens that became the tokenizer's unknown token and say where, with the characters it lacks;
    returns the count. (Skipped records are not in `documents`, so the first record is found by its text.)"""
    unk = tokenizer.unk_token_id
    if unk is None:
        return 0
    count = sum(ids.count(unk) for ids, _ in documents)
    if not count:
        return 0
    vocab = tokenizer.get_vocab()
    where, missing = "a record", []
    for record, location in zip(records, locations, strict=True):
        missing = sorted({c for text in _strings(record) for c in text if c not in vocab})
        if missing:
            where = location
            break
    logger.warning(
        "%s: %d tokens became the unknown token %s, which the model cannot learn from (first in %s: characters %s); "
        "tigon's character tokenizer (model.tokenizer: char) covers printable ASCII and newline only: use a "
        "tokenizer directory for other text, or clean the data",
        path,
        count,
        tokenizer.unk_token,
        where,
        ", ".join(repr(c) for c in missing[:8]) or "unknown",
    )
    return count


def build_datasets(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[PackedDataset, PackedDataset | None, DataSummary]:
    """The train and (if data.eval or data.eval_split is set) eval datasets, and a summary (eval's in summary.eval)."""
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is None:
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} has neither a pad nor an eos token; load it with load_tokenizer"
        )
    train, summary = _build(config.data.train, config.data, tokenizer, pad_token_id, config.data.split)
    evaluation, held_out = None, eval_source(config.data)
    if held_out is not None:
        evaluation, summary.eval = _build(held_out[0], config.data, tokenizer, pad_token_id, held_out[1])
    return train, evaluation, summary


def generation_examples(config: RunConfig, tokenizer) -> list[tuple[list[int], str]]:
    """(prompt ids, reference answer) of every eval record, tokenized exactly as in training."""
    source, split = eval_source(config.data)
    records, _ = read_records(source, config.data.skip_malformed, config.data, split)
    examples = []
    for number, record in enumerate(records, start=1):
        try:
            examples.append(encode_prompt(record, config.data, tokenizer, where=f"{source}, record {number}"))
        except MalformedRecordError:
            if not config.data.skip_malformed:
                raise
    return examples
