"""A Hugging Face Hub cache built on the spot, for tests that load models and datasets by Hub id offline.

    cache = HubCache(tmp_path / "hub")
    revision = cache.add_model("tigon-test/tiny-llama", tags=["v1"])   # models--tigon-test--tiny-llama/...
    offline(monkeypatch, cache.root)                                    # HF_HUB_OFFLINE=1, HF_HUB_CACHE=root

The layout is huggingface_hub's own: `models--org--name/snapshots/<commit>/<files>` and
`refs/<branch or tag>` holding the commit, so `snapshot_download("org/name")` and
`from_pretrained("org/name")` resolve it from the cache with no network.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.runtime.configs import save_tiny_llama


class HubCache:
    """A huggingface_hub cache directory that repositories are added to."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def add(self, kind: str, repo_id: str, source: Path, tags: tuple[str, ...] = ("main",)) -> str:
        """Copy `source`'s files in as a snapshot of `repo_id` (kind: model or dataset); returns its commit."""
        commit = hashlib.sha1(f"{repo_id}:{sorted(tags)}:{source}".encode()).hexdigest()
        repo = self.root / f"{kind}s--{repo_id.replace('/', '--')}"
        shutil.copytree(source, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        for tag in tags:
            (repo / "refs" / tag).write_text(commit)
        return commit

    def add_model(self, repo_id: str, tmp: Path, tags: tuple[str, ...] = ("main",), **overrides) -> str:
        source = save_tiny_llama(tmp / f"src-{repo_id.replace('/', '-')}-{'-'.join(tags)}", **overrides)
        return self.add("model", repo_id, source, tags)


def offline(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """HF_HUB_OFFLINE=1 with `cache` as the Hugging Face cache, for huggingface_hub, transformers and datasets."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # huggingface_hub reads these variables once, at import: set its module-level copies too
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


REPO = "tigon-test/tiny-llama"
