"""Datasets through `datasets.load_dataset`: a dataset repository laid out as on the Hub (subsets, splits,
data_files), CSV files and globs, with the same formats and loss masks as the file readers."""

from __future__ import annotations

import json

import pytest

from tests.runtime.configs import data_config
from tigon.runtime.data import IGNORE_INDEX, DataError, build_datasets, read_records, tokenize_record

README = """---
configs:
- config_name: add
  data_files:
  - split: train
    path: add/train-*.jsonl
  - split: test
    path: add/test.jsonl
- config_name: chat
  data_files:
  - split: train
    path: chat/train.jsonl
---
# sums
"""


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


@pytest.fixture
def repository(tmp_path):
    """A dataset repository as it sits on the Hub: a README whose YAML declares subsets and their splits."""
    root = tmp_path / "sums"
    write_jsonl(root / "add" / "train-00000.jsonl", [{"instruction": "1+1=", "response": "2"}])
    write_jsonl(root / "add" / "train-00001.jsonl", [{"instruction": "2+3=", "response": "5"}])
    write_jsonl(root / "add" / "test.jsonl", [{"instruction": "4+4=", "response": "8"}])
    chat = [{"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]}]
    write_jsonl(root / "chat" / "train.jsonl", chat)
    (root / "README.md").write_text(README)
    return root


def run_config(tmp_path, train, **data):
    """`data_config` with a short max_seq_len and the datasets cache under `tmp_path`."""
    return data_config(train, **{"max_seq_len": 32, "cache_dir": str(tmp_path / "datasets-cache"), **data})


def test_subset_split_and_eval_split_of_a_dataset_repository(tmp_path, repository, tokenizer):
    config = run_config(tmp_path, repository, subset="add", format="instruction", eval_split="test")
    train, evaluation, summary = build_datasets(config, tokenizer)
    assert summary.records == 2 and summary.eval.records == 1
    assert len(train) == 1 and len(evaluation) == 1  # both train documents packed into one sequence
    expected = tokenize_record({"instruction": "4+4=", "response": "8"}, config.data, tokenizer)
    assert evaluation[0]["input_ids"][: len(expected[0])].tolist() == expected[0]
    records, _ = read_records(repository, data_config=config.data.model_copy(update={"subset": "chat"}))
    assert records[0]["messages"][1] == {"role": "assistant", "content": "3"}
    chat = run_config(tmp_path, repository, subset="chat", format="chat")
    labels = build_datasets(chat, tokenizer)[0][0]["labels"].tolist()
    trained = [token for token in labels if token != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "3<eos>"  # the assistant turn alone carries loss


def test_data_files_globs_and_csv(tmp_path, repository):
    config = run_config(tmp_path, repository, data_files="add/train-*.jsonl")
    assert [r["response"] for r in read_records(repository, data_config=config.data)[0]] == ["2", "5"]
    glob = str(repository / "add" / "train-*.jsonl")
    assert len(read_records(glob, data_config=run_config(tmp_path, glob).data)[0]) == 2
    mixed = [
        {"messages": [{"role": "user", "content": "hi", "name": "ann"}]},
        {"messages": [{"role": "user", "content": "yo"}]},
    ]
    write_jsonl(tmp_path / "mixed.jsonl", mixed)
    assert read_records(tmp_path / "mixed.jsonl")[0] == mixed  # no name=None where Arrow unified the schemas
    (tmp_path / "sums.csv").write_text("instruction,response\n1+1=,2\n")
    assert read_records(tmp_path / "sums.csv")[0] == [{"instruction": "1+1=", "response": 2}]


def test_wrong_split_subset_or_name_fail_clearly(tmp_path, repository, monkeypatch):
    with pytest.raises(DataError, match="set data.split"):
        read_records(repository, data_config=run_config(tmp_path, repository, subset="add", split="dev").data)
    with pytest.raises(DataError, match="data.subset"):
        read_records(repository, data_config=run_config(tmp_path, repository, subset="mul").data)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="tigon-test/absent: .*HF_HUB_OFFLINE"):
        read_records("tigon-test/absent", data_config=run_config(tmp_path, "tigon-test/absent").data)
