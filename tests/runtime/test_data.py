"""Reading, tokenizing and packing training data; the packed attention mask keeps documents apart."""

import json
import os
import re
import sys

import pytest
import torch

from tests.runtime.configs import data_config
from tigon.runtime import tasks
from tigon.runtime.config import DataConfig
from tigon.runtime.data import (
    IGNORE_INDEX,
    DataError,
    MalformedRecordError,
    PackedDataset,
    best_fit_rows,
    build_datasets,
    check_labels,
    encode_prompt,
    in_order_rows,
    instruction_prompt_ids,
    model_inputs,
    packed_attention_mask,
    read_records,
    tokenize_record,
)
from tigon.runtime.tokenizer import build_char_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "10+5="},
    {"role": "assistant", "content": "15"},
]


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def chars(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------------- formats


def test_text_format_has_loss_on_every_token(tokenizer):
    ids, labels = tokenize_record({"text": "abc"}, DataConfig(train="x.jsonl"), tokenizer)
    assert ids == [tokenizer.bos_token_id, *chars(tokenizer, "abc"), tokenizer.eos_token_id]
    assert labels == ids


def test_instruction_format_has_loss_on_response_and_eos_only(tokenizer):
    config = DataConfig(train="x.jsonl", format="instruction")
    ids, labels = tokenize_record({"instruction": "23+58=", "response": "81"}, config, tokenizer)
    prompt = [tokenizer.bos_token_id, *chars(tokenizer, "23+58=")]
    response = [*chars(tokenizer, "81"), tokenizer.eos_token_id]
    assert ids == prompt + response
    assert labels == [IGNORE_INDEX] * len(prompt) + response
    assert instruction_prompt_ids(tokenizer, "23+58=") == prompt
    assert encode_prompt({"instruction": "23+58=", "response": "81"}, config, tokenizer) == (prompt, "81")


def test_instruction_fields_are_configurable(tokenizer):
    config = DataConfig(train="x.jsonl", format="instruction", prompt_field="q", response_field="a")
    ids, labels = tokenize_record({"q": "1+1=", "a": "2"}, config, tokenizer)
    assert tokenizer.decode(ids) == "<bos>1+1=2<eos>"
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "2<eos>"


def test_chat_format_has_loss_exactly_on_assistant_turns(tokenizer):
    config = DataConfig(train="x.jsonl", format="chat")
    ids, labels = tokenize_record({"messages": CONVERSATION}, config, tokenizer)
    # the same tokens the template gives through transformers
    assert ids == tokenizer.apply_chat_template(CONVERSATION, return_dict=True)["input_ids"]
    eos = tokenizer.eos_token_id
    expected = [IGNORE_INDEX] * len(ids)
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    # each assistant turn: its content and the <eos> closing it, found independently in the rendered text
    for content in ("3", "15"):
        marker = f"<|assistant|>\n{content}<eos>"
        start = len(chars(tokenizer, text[: text.index(marker) + len("<|assistant|>\n")]))
        turn = [*chars(tokenizer, content), eos]
        expected[start : start + len(turn)] = turn
    assert labels == expected
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "3<eos>15<eos>"
    # the same mask transformers computes from the template's {% generation %} markers
    hf = tokenizer.apply_chat_template(CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    assert [label != IGNORE_INDEX for label in labels] == [bool(m) for m in hf["assistant_masks"]]
    prompt, reference = encode_prompt({"messages": CONVERSATION}, config, tokenizer)
    assert reference == "15" and ids[: len(prompt)] == prompt
    assert tokenizer.decode(prompt).endswith("10+5=<eos><|assistant|>\n")


def test_chat_template_breaking_prefix_rule_uses_generation_markers_or_fails(tokenizer):
    config = DataConfig(train="x.jsonl", format="chat")
    # the generation prompt differs from how an assistant turn is rendered, so prefixes do not line up
    body = (
        "{% for m in messages %}{{ m['role'] + ':' }}"
        "{% if m['role'] == 'assistant' %}{{ MARK_OPEN }}{{ m['content'] + eos_token }}{{ MARK_CLOSE }}"
        "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    marked = build_char_tokenizer()
    marked.chat_template = body.replace("{{ MARK_OPEN }}", "{% generation %}").replace(
        "{{ MARK_CLOSE }}", "{% endgeneration %}"
    )
    ids, labels = tokenize_record({"messages": CONVERSATION}, config, marked)
    assert marked.decode(ids).startswith("system:You add.<eos>user:")
    assert marked.decode([t for t in labels if t != IGNORE_INDEX]) == "3<eos>15<eos>"
    unmarked = build_char_tokenizer()
    unmarked.chat_template = body.replace("{{ MARK_OPEN }}", "").replace("{{ MARK_CLOSE }}", "")
    with pytest.raises(DataError, match="generation"):
        tokenize_record({"messages": CONVERSATION}, config, unmarked)


def test_chat_needs_a_chat_template(tokenizer):
    bare = build_char_tokenizer()
    bare.chat_template = None
    with pytest.raises(DataError, match="chat template"):
        tokenize_record({"messages": CONVERSATION}, DataConfig(train="x.jsonl", format="chat"), bare)


@pytest.mark.parametrize(
    ("record", "config", "message"),
    [
        ({"body": "x"}, DataConfig(train="x.jsonl"), "no field 'text' \\(data.text_field\\)"),
        ({"instruction": "1+1="}, DataConfig(train="x.jsonl", format="instruction"), "no field 'response'"),
        ({"instruction": 5, "response": "5"}, DataConfig(train="x.jsonl", format="instruction"), "is a int"),
        ({"messages": "hi"}, DataConfig(train="x.jsonl", format="chat"), "is a str, expected list"),
        ({"messages": [{"role": "user"}]}, DataConfig(train="x.jsonl", format="chat"), "message 0"),
        ({"messages": [{"role": "tool", "content": "x"}]}, DataConfig(train="x.jsonl", format="chat"), "unknown role"),
    ],
)
def test_malformed_record_names_field_and_place(tokenizer, record, config, message):
    with pytest.raises(MalformedRecordError, match=message) as error:
        tokenize_record(record, config, tokenizer, where="data.jsonl, line 7")
    assert "data.jsonl, line 7" in str(error.value)


# ---------------------------------------------------------------------------------------------------- reading


def test_read_jsonl_skips_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, "", "   ", {"text": "b"}])
    assert read_records(path) == ([{"text": "a"}, {"text": "b"}], 0)


def test_read_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"instruction": "1+1=", "response": "2"}, {"instruction": "2+2=", "response": "4"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_records(tmp_path / "d.parquet") == (rows, 0)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"text": "b"}, '{"text": "c"', {"text": "d"}])
    with pytest.raises(MalformedRecordError, match=r"bad\.jsonl, line 3: invalid JSON") as error:
        read_records(path)
    assert str(path) in str(error.value) and "skip_malformed" in str(error.value)
    (tmp_path / "list.jsonl").write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(MalformedRecordError, match=r"list\.jsonl, line 2: expected a JSON object"):
        read_records(tmp_path / "list.jsonl")
    (tmp_path / "bytes.jsonl").write_bytes(b'{"text": "a"}\n\xff\xfe\n')
    with pytest.raises(MalformedRecordError, match=r"bytes\.jsonl, line 2: not UTF-8"):
        read_records(tmp_path / "bytes.jsonl")


def test_skip_malformed_counts_skipped_lines(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, "{oops", "[1]", {"text": "d"}])
    assert read_records(path, skip_malformed=True) == ([{"text": "a"}, {"text": "d"}], 2)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.jsonl", None, "does not exist"),
        ("empty.jsonl", "\n\n", "holds no records"),
        ("bad.jsonl", "nope\n", "all 1 records are malformed"),
        ("data.xml", "<a/>\n", "unknown file type '.xml'"),
    ],
)
def test_unusable_dataset_files(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=message) as error:
        read_records(tmp_path / name, skip_malformed=True)
    assert name in str(error.value)


def test_directory_that_is_not_a_saved_dataset(tmp_path):
    with pytest.raises(DataError, match="doesn't contain any data files.*save_to_disk"):
        read_records(tmp_path)


def test_saved_dataset_directory(tmp_path):
    import datasets

    rows = [{"text": "a"}, {"text": "b"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert read_records(tmp_path / "saved") == (rows, 0)


def test_saved_dataset_directory_without_the_datasets_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    (tmp_path / "state.json").write_text("{}")
    with pytest.raises(DataError, match="pip install datasets"):
        read_records(tmp_path)


# ---------------------------------------------------------------------------------------------------- packing


def documents(lengths, start=10):
    """Documents of the given lengths with distinct token values and full labels."""
    docs, token = [], start
    for length in lengths:
        ids = list(range(token, token + length))
        docs.append((ids, list(ids)))
        token += length
    return docs


def split_documents(row_ids, row_positions):
    """A packed row cut back into its documents, by position ids restarting at 0."""
    pieces = []
    for token, position in zip(row_ids, row_positions, strict=True):
        if position == 0:
            pieces.append([])
        pieces[-1].append(token)
    return pieces


def test_packing_invariants():
    lengths = [5, 3, 9, 2, 12, 4, 4, 7, 2, 16, 20, 1]
    docs = documents(lengths)
    dataset = PackedDataset(docs, max_seq_len=16, pad_token_id=0, strategy="in_order")
    assert dataset.truncated == 1  # the 20-token document keeps its first 16 tokens
    assert dataset.dropped == 1  # the 1-token document has no label left once its first is -100
    rebuilt = []
    for item in dataset:
        assert set(item) == {"input_ids", "labels", "position_ids"}
        assert all(value.dtype == torch.long and value.shape == (16,) for value in item.values())
        ids, labels, positions = item["input_ids"].tolist(), item["labels"].tolist(), item["position_ids"].tolist()
        real = sum(token != 0 for token in ids)
        # real tokens first, then padding with label -100 and positions that go on counting from the last document's
        assert all(token == 0 for token in ids[real:])
        assert labels[real:] == [IGNORE_INDEX] * (16 - real)
        assert positions[real:] == list(range(positions[real - 1] + 1, positions[real - 1] + 1 + 16 - real))
        starts = [i for i, p in enumerate(positions[:real]) if p == 0]
        assert starts[0] == 0
        for start, end in zip(starts, [*starts[1:], real], strict=True):
            document = ids[start:end]
            assert positions[start:end] == list(range(end - start))  # positions restart for every document
            assert labels[start] == IGNORE_INDEX  # nothing is predicted across a document boundary
            assert labels[start + 1 : end] == document[1:]
            rebuilt.append(document)
    kept = [ids[:16] for ids, _ in docs if len(ids) > 1]
    assert rebuilt == kept  # every document, in order, truncated to max_seq_len
    assert dataset.num_tokens == sum(map(len, kept))
    assert dataset.num_loss_tokens == sum(len(d) - 1 for d in kept)
    assert dataset.num_tokens + dataset.num_padding_tokens == len(dataset) * 16


@pytest.mark.parametrize("packing", [True, False])
def test_split_long_documents_predict_every_token_once(packing):
    docs = documents([20, 5, 15, 1, 9])  # 20 and 15 are over 8; 15 = 1 + 2 x 7 ends exactly on a piece; 9 = 8 + 1
    dataset = PackedDataset(docs, max_seq_len=8, pad_token_id=0, packing=packing, split_long=True, strategy="in_order")
    assert (dataset.split_documents, dataset.truncated, dataset.dropped) == (3, 0, 1)  # the 1-token document
    predicted, pieces = [], []
    for item in dataset:
        ids, labels, positions = item["input_ids"].tolist(), item["labels"].tolist(), item["position_ids"].tolist()
        real = sum(token != 0 for token in ids)
        pieces += split_documents(ids[:real], positions[:real])
        predicted += [label for label in labels if label != IGNORE_INDEX]
    # each piece starts with the previous piece's last token, whose label it gives up: every token of a document
    # but its first is a label exactly once, in order
    assert predicted == [token for ids, _ in docs for token in ids[1:]]
    assert [len(piece) for piece in pieces] == [8, 8, 6, 5, 8, 8, 8, 2]
    assert pieces[1][0] == pieces[0][-1] and pieces[2][0] == pieces[1][-1]
    assert dataset.num_loss_tokens == len(predicted)


def test_runs_pack_best_fit_unless_told_in_order(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": "x" * n} for n in (9, 6, 7, 4, 2, 5)])  # 11 8 9 6 4 7 tokens
    _, _, best_fit = build_datasets(data_config(path, max_seq_len=16), tokenizer)
    _, _, in_order = build_datasets(data_config(path, max_seq_len=16, packing_strategy="in_order"), tokenizer)
    assert (best_fit.sequences, in_order.sequences) == (3, 4)  # [11 4] [9 7] [8 6]; [11] [8] [9 6] [4 7]
    assert best_fit.tokens == in_order.tokens == 45 and best_fit.padding_tokens == 3


def test_long_documents_follow_the_format_or_the_setting(tmp_path, tokenizer):
    long_text = write_jsonl(tmp_path / "text.jsonl", [{"text": "x" * 50}, {"text": "short"}])
    train, _, summary = build_datasets(data_config(long_text, max_seq_len=16), tokenizer)
    assert (summary.split_documents, summary.truncated) == (1, 0)  # text: split by default
    assert summary.loss_tokens == 51 + 6  # <bos> x..x <eos>: every token but each document's first
    assert "0 truncated, 1 split" in summary.describe()
    _, _, summary = build_datasets(data_config(long_text, max_seq_len=16, long_documents="truncate"), tokenizer)
    assert (summary.split_documents, summary.truncated, summary.loss_tokens) == (0, 1, 15 + 6)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"instruction": "1+2=", "response": "3" * 40}])
    _, _, summary = build_datasets(data_config(pairs, format="instruction", max_seq_len=16), tokenizer)
    assert (summary.split_documents, summary.truncated) == (0, 1)  # a response stays with its prompt
    config = data_config(pairs, format="instruction", max_seq_len=16, long_documents="split")
    assert build_datasets(config, tokenizer)[2].split_documents == 1
    with pytest.raises(ValueError, match="data.long_documents: truncate"):
        DataConfig(train="x.jsonl", max_seq_len=1)
    assert DataConfig(train="x.jsonl", max_seq_len=1, long_documents="truncate").max_seq_len == 1


def test_in_order_packing_layout():
    dataset = PackedDataset(documents([5, 3, 9, 1, 7]), max_seq_len=10, pad_token_id=0, strategy="in_order")
    layout = [split_documents(i["input_ids"].tolist(), i["position_ids"].tolist()) for i in dataset]
    # the 1-token document has no loss token and is dropped; padding (2, 1 and 3 tokens) continues the last document
    assert [[len(p) for p in row] for row in layout] == [[5, 5], [10], [10]]
    assert dataset[0]["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]


def test_best_fit_packing_fills_rows_the_in_order_packer_leaves_part_empty():
    docs = documents([5, 4, 3, 4, 3, 5])
    in_order = PackedDataset(docs, max_seq_len=8, pad_token_id=0, strategy="in_order")
    best_fit = PackedDataset(docs, max_seq_len=8, pad_token_id=0, strategy="best_fit")
    assert (len(in_order), in_order.num_padding_tokens) == (4, 8)  # [5] [4 3] [4 3] [5]
    assert (len(best_fit), best_fit.num_padding_tokens) == (3, 0)  # [5 3] [5 3] [4 4]
    layout = [split_documents(i["input_ids"].tolist(), i["position_ids"].tolist()) for i in best_fit]
    assert sorted(sorted(len(d) for d in row) for row in layout) == [[3, 5], [3, 5], [4, 4]]
    assert sorted(d for row in layout for d in row) == sorted(ids for ids, _ in docs)  # each document once, whole
    for item in best_fit:
        labels, ids, positions = item["labels"].tolist(), item["input_ids"].tolist(), item["position_ids"].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0]
        assert all(labels[start] == IGNORE_INDEX for start in starts)  # nothing predicted across a boundary
        assert [label for label in labels if label != IGNORE_INDEX] == [
            token for i, token in enumerate(ids) if i not in starts
        ]
    assert best_fit.num_tokens == in_order.num_tokens and best_fit.num_loss_tokens == in_order.num_loss_tokens


def test_best_fit_rows_hold_every_document_once_and_nearly_fill_mixed_lengths():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.empty(3000).uniform_(4.6, 8.3, generator=generator)).long().tolist()  # 100-4000
    rows = best_fit_rows(lengths, 4096)
    assert sorted(index for row in rows for index in row) == list(range(len(lengths)))
    assert max(sum(lengths[i] for i in row) for row in rows) <= 4096
    assert sum(lengths) / (len(rows) * 4096) > 0.99
    in_order = in_order_rows(lengths, 4096)
    assert sum(lengths) / (len(in_order) * 4096) < 0.85 and len(rows) < len(in_order)
    assert best_fit_rows([], 8) == [] and best_fit_rows([8, 8], 8) == [[0], [1]]
    with pytest.raises(ValueError, match="unknown packing strategy 'first_fit'"):
        PackedDataset(documents([3]), max_seq_len=8, pad_token_id=0, strategy="first_fit")


def test_no_packing_gives_one_document_per_sequence():
    dataset = PackedDataset(documents([5, 3, 12]), max_seq_len=8, pad_token_id=0, packing=False)
    assert len(dataset) == 3 and dataset.truncated == 1
    assert dataset[1]["input_ids"].tolist() == [15, 16, 17, 0, 0, 0, 0, 0]
    assert dataset[1]["labels"].tolist() == [IGNORE_INDEX, 16, 17] + [IGNORE_INDEX] * 5
    assert dataset[1]["position_ids"].tolist() == list(range(8))  # one document and its padding: plain causal
    assert dataset[2]["position_ids"].tolist() == list(range(8))


def test_documents_without_loss_tokens_are_dropped():
    prompt_only = ([1, 2, 3, 4], [IGNORE_INDEX] * 3 + [4])  # its one label survives only without truncation
    dataset = PackedDataset([prompt_only, ([7], [7])], max_seq_len=3, pad_token_id=0)
    assert dataset.truncated == 1 and dataset.dropped == 2 and len(dataset) == 0


def test_packing_is_deterministic():
    docs = documents([3, 8, 2, 6, 6, 1, 9])
    first, second = PackedDataset(docs, 12, 0), PackedDataset(docs, 12, 0)
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(first, name), getattr(second, name))


# ---------------------------------------------------------------------------------------------------- masks


def test_packed_attention_mask_is_block_diagonal_causal():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    allowed = packed_attention_mask(positions, torch.bool)
    assert allowed.shape == (2, 1, 6, 6)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed[0, 0], expected)
    assert torch.equal(allowed[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        additive = packed_attention_mask(positions, dtype)
        assert additive.dtype == dtype
        assert torch.equal(additive == 0, allowed)
        assert torch.all(additive[~allowed] == torch.finfo(dtype).min)


def test_packed_attention_mask_rejects_bad_input():
    with pytest.raises(ValueError, match="batch, length"):
        packed_attention_mask(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        packed_attention_mask(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="floating dtype"):
        packed_attention_mask(torch.zeros(1, 4, dtype=torch.long), torch.int32)


def test_model_inputs_per_attention_implementation():
    batch = {name: torch.zeros(2, 5, dtype=torch.long) for name in ("input_ids", "labels", "position_ids")}
    assert set(model_inputs(batch, "flash_attention_2")) == {"input_ids", "labels", "position_ids"}
    assert model_inputs(batch, "sdpa")["attention_mask"].dtype == torch.bool
    assert model_inputs(batch, "eager")["attention_mask"].dtype == torch.float32
    assert model_inputs(batch, "eager")["attention_mask"].shape == (2, 1, 5, 5)
    with pytest.raises(ValueError, match="unknown attn_implementation"):
        model_inputs(batch, "flex")
    with pytest.raises(ValueError, match="lacks"):
        model_inputs({"input_ids": batch["input_ids"]}, "sdpa")


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_single_document_rows_take_plain_causal_attention(attn_implementation):
    """No dense mask when no row is packed (so SDPA may use flash), and the same logits as with the mask."""
    model = tiny_llama(attn_implementation, 50)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(12).expand(2, 12)}
    inputs = model_inputs(batch, attn_implementation)
    assert "attention_mask" not in inputs
    packed = dict(batch, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]] * 2))
    assert "attention_mask" in model_inputs(packed, attn_implementation)
    mask = packed_attention_mask(batch["position_ids"], torch.bool if attn_implementation == "sdpa" else torch.float32)
    with torch.no_grad():
        plain = model(**inputs, use_cache=False).logits
        masked = model(**inputs, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(plain, masked, rtol=1e-5, atol=1e-5)


def tiny_llama(attn_implementation, vocab_size):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation).eval()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_attention_does_not_cross_documents(tokenizer, attn_implementation):
    model = tiny_llama(attn_implementation, len(tokenizer))
    assert model.config._attn_implementation == attn_implementation
    first = tokenize_record({"text": "The quick brown fox."}, DataConfig(train="x.jsonl"), tokenizer)
    second = tokenize_record({"text": "12+34=46\nJumps!"}, DataConfig(train="x.jsonl"), tokenizer)
    dataset = PackedDataset([first, second], max_seq_len=48, pad_token_id=tokenizer.pad_token_id)
    assert len(dataset) == 1
    batch = {name: value[None] for name, value in dataset[0].items()}
    a, b = len(first[0]), len(second[0])
    assert batch["position_ids"][0, a] == 0 and 48 - a - b > 0  # second document and padding follow the first
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([ids]), use_cache=False).logits[0] for ids, _ in (first, second)]
        masks = {
            "float mask": packed_attention_mask(batch["position_ids"], torch.float32),
            "model_inputs": model_inputs(batch, attn_implementation)["attention_mask"],
        }
        for name, mask in masks.items():
            packed = model(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask, use_cache=False
            ).logits[0]
            torch.testing.assert_close(packed[:a], alone[0], rtol=1e-5, atol=1e-5, msg=name)
            torch.testing.assert_close(packed[a : a + b], alone[1], rtol=1e-5, atol=1e-5, msg=name)
        # the control: a plain causal mask lets the second document see the first, and its logits change
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits[0]
        assert (leaky[a : a + b] - alone[1]).abs().max() > 1e-3
    # the loss over the packed sequence is the loss over the two documents
    with torch.no_grad():
        packed_loss = model(**model_inputs(batch, attn_implementation), use_cache=False).loss
        separate = [
            model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), use_cache=False).loss * (len(ids) - 1)
            for ids, labels in (first, second)
        ]
    torch.testing.assert_close(packed_loss, sum(separate) / (a - 1 + b - 1), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- building


def test_build_datasets_from_arithmetic_task(tmp_path, tokenizer):
    held_out = tasks.write_arithmetic_dataset(tmp_path / "eval.jsonl", 20, seed=1)
    tasks.write_arithmetic_dataset(tmp_path / "train.jsonl", 200, seed=0, exclude={r["instruction"] for r in held_out})
    config = data_config(
        tmp_path / "train.jsonl", eval=str(tmp_path / "eval.jsonl"), format="instruction", max_seq_len=64
    )
    train, evaluation, summary = build_datasets(config, tokenizer)
    assert summary.records == 200 and summary.skipped == summary.truncated == summary.dropped == 0
    assert summary.sequences == len(train) and summary.tokens + summary.padding_tokens == len(train) * 64
    assert summary.loss_tokens == int((train.labels != IGNORE_INDEX).sum())
    assert 0.2 < summary.loss_fraction < 0.5
    assert summary.eval is not None and summary.eval.records == 20 and len(evaluation) == summary.eval.sequences
    assert "200 records" in str(summary) and "eval" in str(summary)
    again, _, _ = build_datasets(config, tokenizer)
    assert torch.equal(train.input_ids, again.input_ids)


def test_build_datasets_missing_field_names_file_and_line(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}, {"txt": "b"}, {"text": "c"}])
    with pytest.raises(MalformedRecordError, match=r"train\.jsonl, line 2: record has no field 'text'"):
        build_datasets(data_config(path), tokenizer)


def test_build_datasets_skip_malformed_counts_all_kinds(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}, "{broken", {"txt": "b"}, {"text": 3}, {"text": "c"}])
    train, evaluation, summary = build_datasets(data_config(path, skip_malformed=True), tokenizer)
    assert (summary.records, summary.skipped, evaluation) == (4, 3, None)
    assert summary.sequences == len(train) == 1 and summary.tokens == 6  # <bos> x <eos> twice


def test_build_datasets_reports_truncation_and_chat_from_parquet(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    long = [{"role": "user", "content": "x" * 60}, {"role": "assistant", "content": "y" * 60}]
    rows = [{"messages": CONVERSATION}, {"messages": long}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    config = data_config(tmp_path / "chat.parquet", format="chat", max_seq_len=96, packing=False)
    train, _, summary = build_datasets(config, tokenizer)
    assert (summary.records, summary.truncated, summary.sequences) == (2, 1, 2)
    assert tokenizer.decode([t for t in train[0]["labels"].tolist() if t != IGNORE_INDEX]) == "3<eos>15<eos>"


def test_build_datasets_fails_when_nothing_has_loss(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"instruction": "9" * 50, "response": "1"}])
    with pytest.raises(DataError, match="max_seq_len"):
        build_datasets(data_config(path, format="instruction", max_seq_len=16), tokenizer)


# ---------------------------------------------------------------------------------------------------- demo task


def test_arithmetic_dataset_is_deterministic_and_correct(tmp_path):
    records = tasks.write_arithmetic_dataset(tmp_path / "a.jsonl", 300, seed=3, max_operand=50, operators="+-*")
    tasks.write_arithmetic_dataset(tmp_path / "b.jsonl", 300, seed=3, max_operand=50, operators="+-*")
    tasks.write_arithmetic_dataset(tmp_path / "c.jsonl", 300, seed=4, max_operand=50, operators="+-*")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()
    assert read_records(tmp_path / "a.jsonl")[0] == records
    for record in records:
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", record["instruction"]).groups()
        assert 0 <= int(a) <= 50 and 0 <= int(b) <= 50
        assert int(record["response"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert int(record["response"]) >= 0
    assert {op for r in records for op in "+-*" if op in r["instruction"]} == {"+", "-", "*"}


def test_arithmetic_dataset_excludes_held_out_problems(tmp_path):
    held_out = {
        r["instruction"] for r in tasks.write_arithmetic_dataset(tmp_path / "e.jsonl", 30, seed=1, max_operand=9)
    }
    train = tasks.write_arithmetic_dataset(tmp_path / "t.jsonl", 500, seed=0, max_operand=9, exclude=held_out)
    assert not held_out & {r["instruction"] for r in train}
    everything = {f"{a}+{b}=" for a in range(3) for b in range(3)}
    with pytest.raises(ValueError, match="exclude"):
        tasks.write_arithmetic_dataset(tmp_path / "x.jsonl", 5, seed=0, max_operand=2, exclude=everything)
    assert not (tmp_path / "x.jsonl").exists()


def test_arithmetic_dataset_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "train.jsonl"
    tasks.write_arithmetic_dataset(path, 10, seed=0)
    before = path.read_bytes()

    def failing_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        tasks.write_arithmetic_dataset(path, 1000, seed=1)
    assert path.read_bytes() == before  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]  # and no temporary file is left


def test_exact_match():
    assert tasks.exact_match(" 81\n", "81")
    assert not tasks.exact_match("810", "81")
    assert not tasks.exact_match("", "81")


def test_bad_chat_records_nulls_and_empty_strings_are_skippable_and_named(tmp_path, tokenizer):
    """Parquet nulls, empty strings, empty conversations and conversations opening with the assistant: each is a
    malformed record naming its row, and data.skip_malformed skips and counts them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    assistant_first = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "1+1="}]
    chat = [
        {"messages": CONVERSATION},
        {"messages": []},
        {"messages": assistant_first},
        {"messages": None},
    ]
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "chat.parquet")
    expected = [
        "'messages' holds no messages",
        "the conversation starts with an assistant message",
        "field 'messages' (data.messages_field) is null",
    ]
    chat_config = DataConfig(train="x", format="chat")
    for row, message in zip(chat[1:], expected, strict=True):
        with pytest.raises(MalformedRecordError, match=re.escape(f"chat.parquet, row 9: {message}")):
            tokenize_record(row, chat_config, tokenizer, where="chat.parquet, row 9")
    config = data_config(tmp_path / "chat.parquet", format="chat", skip_malformed=True, max_seq_len=96)
    _, _, summary = build_datasets(config, tokenizer)
    assert summary.records == 4 and summary.skipped == 3
    with pytest.raises(MalformedRecordError, match=r"chat.parquet, row 2: 'messages' holds no messages"):
        build_datasets(data_config(tmp_path / "chat.parquet", format="chat", max_seq_len=96), tokenizer)

    text = [{"text": "12+3=15"}, {"text": None}, {"text": ""}, {"text": "  "}]
    pq.write_table(pa.Table.from_pylist(text), tmp_path / "text.parquet")
    with pytest.raises(MalformedRecordError, match=r"text.parquet, row 2: field 'text' \(data.text_field\) is null"):
        build_datasets(data_config(tmp_path / "text.parquet", format="text"), tokenizer)
    _, _, summary = build_datasets(
        data_config(tmp_path / "text.parquet", format="text", skip_malformed=True), tokenizer
    )
    assert summary.skipped == 3
    instruction = DataConfig(train="x", format="instruction")
    with pytest.raises(MalformedRecordError, match="field 'response' \\(data.response_field\\) is an empty string"):
        tokenize_record({"instruction": "1+1=", "response": ""}, instruction, tokenizer)


def test_text_outside_the_char_tokenizers_alphabet_is_counted_and_named(tmp_path, tokenizer, caplog):
    train = write_jsonl(tmp_path / "t.jsonl", [{"text": "1+1=2"}, {"text": "café 中文\tok"}])
    with caplog.at_level("WARNING", logger="tigon.runtime"):
        _, _, summary = build_datasets(data_config(train, format="text"), tokenizer)
    assert summary.unknown_tokens == 4
    assert f"{train}: 4 tokens became the unknown token <unk>" in caplog.text
    assert f"first in {train}, line 2: characters '\\t', 'é', '中', '文'" in caplog.text
    assert "covers printable ASCII and newline only" in caplog.text


def test_a_field_of_mixed_types_keeps_its_text_as_written(tmp_path, tokenizer):
    """A JSONL field that is text in one record and a list in another: datasets would read it as its Json feature
    and decode the text "12" into the number 12; tigon reads such files itself, so "12" stays text and the error
    names the list's line."""
    path = write_jsonl(tmp_path / "train.jsonl", [{"text": "12"}, {"text": ["1", "2"]}, {"text": "3+4=7"}])
    with pytest.raises(MalformedRecordError, match=r"train\.jsonl, line 2: field 'text' \(data.text_field\) is a list"):
        build_datasets(data_config(path), tokenizer)


def test_labels_outside_the_vocabulary_are_refused_on_the_host():
    """`check_labels` reads every row, a chunk at a time: labels are token ids below the vocabulary or -100."""
    dataset = PackedDataset(documents([5, 3, 9, 1, 7]), max_seq_len=10, pad_token_id=0, strategy="in_order")
    top = int(dataset.labels.max())
    check_labels((dataset, None), top + 1, rows=1)
    with pytest.raises(DataError, match=rf"a label is {top}, which is no token of the model's {top} .*tokenizer"):
        check_labels((None, dataset), top, rows=1)
    dataset.labels[-1, -1] = -5
    with pytest.raises(DataError, match="a label is -5"):
        check_labels((dataset,), top + 1, rows=1)
