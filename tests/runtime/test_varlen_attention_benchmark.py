"""benchmarks/varlen_attention.py cannot rot: its documents, its FLOP count and its table (the timing needs a GPU)."""

from __future__ import annotations

import json

import pytest

from benchmarks.varlen_attention import TOKENS, flops, lengths, markdown


@pytest.mark.parametrize(("shortest", "longest"), [(100, 4000), (100, 1000), (4096, 4096)])
def test_documents_fill_the_micro_batch_within_their_range(shortest, longest):
    documents = lengths(shortest, longest)
    assert documents == lengths(shortest, longest) and sum(documents) == TOKENS
    assert all(length <= longest for length in documents)
    assert all(length >= shortest for length in documents[:-1])  # the last one takes what is left


def test_flops_count_each_documents_causal_half():
    assert flops([4], heads=2, head_dim=8) == 7 * 2 * 2 * 16 * 8 / 2
    assert flops([4, 4], heads=2, head_dim=8) == 2 * flops([4], heads=2, head_dim=8) < flops([8], heads=2, head_dim=8)


def test_the_table_gives_cudnns_speed_up_on_its_row():
    errors = {"out": 1e-3, "dq": 3e-3, "dk": 2e-3, "dv": 2e-3}
    rows = [
        {"model": "m", "documents": "d", "count": 3, "kernel": "flash", "ms": 2.0, "tflops": 100.0, "errors": errors},
        {"model": "m", "documents": "d", "count": 3, "kernel": "cudnn", "ms": 1.6, "tflops": 125.0, "errors": errors,
         "speedup": 1.25},
    ]  # fmt: skip
    table = markdown(rows).splitlines()
    assert table[2] == "| m | d (3) | flash | 2.000 | 100 | 3.0e-03 |  |"
    assert table[3] == "| m | d (3) | cudnn | 1.600 | 125 | 3.0e-03 | 1.25x |"


def test_the_report_is_the_json_and_its_table_beside_it(tmp_path, capsys):
    from benchmarks.harness import write_report

    write_report(str(tmp_path / "varlen.json"), {"rows": [1]}, "| a |")
    assert json.loads((tmp_path / "varlen.json").read_text()) == {"rows": [1]}
    assert (tmp_path / "varlen.md").read_text() == "| a |\n" and "| a |" in capsys.readouterr().out
