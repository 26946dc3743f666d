"""Files written whole or not at all (tigon.runtime.files)."""

from __future__ import annotations

import json

import pytest

from tigon.runtime.files import atomic_path, atomic_write_bytes, atomic_write_text


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "report.json"
    atomic_write_text(path, "old")

    with pytest.raises(TypeError):
        atomic_write_bytes(path, object())  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_atomic_path_renames_what_a_writer_made_and_makes_the_folder(tmp_path):
    path = tmp_path / "new" / "trace.json"
    with atomic_path(path) as temporary:
        assert temporary.parent == path.parent and temporary.name.startswith(".trace.json.")
        assert temporary.suffix == ".tmp" and not temporary.exists()
        temporary.write_text(json.dumps({"events": 3}))
        assert not path.exists()  # nothing at the real name until the block ends
    assert json.loads(path.read_text()) == {"events": 3}
    assert [p.name for p in path.parent.iterdir()] == ["trace.json"]


def test_atomic_path_removes_a_failed_writers_partial_file(tmp_path):
    path = tmp_path / "arrays.safetensors"
    path.write_bytes(b"previous")
    with pytest.raises(RuntimeError, match="writer died"), atomic_path(path) as temporary:
        temporary.write_bytes(b"half")
        raise RuntimeError("writer died")
    assert path.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["arrays.safetensors"]
