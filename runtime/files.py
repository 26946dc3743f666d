"""Files written whole or not at all: each is written under a temporary name beside it and renamed into place.

A reader never sees half a file, and a writer that fails or is killed leaves the previous file as it was
(a killed writer's hidden `.<name>.<random>.tmp` stays behind; `tigon.runtime.checkpoint` sweeps those in
its own directories). The runtime, the workflows and the benchmarks write their files through here.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A fresh temporary path beside `path` for any writer to create; renamed onto `path` when the block ends,
    removed when it raises. The folder is made if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write a whole file, flushed to disk before it is renamed into place."""
    with atomic_path(path) as temporary, temporary.open("xb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def atomic_write_text(path: str | Path, text: str) -> None:
    """`atomic_write_bytes` of `text` in UTF-8."""
    atomic_write_bytes(path, text.encode())
