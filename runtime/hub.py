"""Where a model or tokenizer comes from: a local directory, a Hugging Face Hub id, or an object-store URL.

    directory = fetch_model(config.model, env)      # every rank; local rank 0 of each node downloads
    directory = model_directory(config.model)       # one process: download if needed, return the local copy

`model.path` (and `model.tokenizer`) may be
- a local `save_pretrained` directory, used as it is;
- a Hub id (`Qwen/Qwen2.5-0.5B`), fetched with `huggingface_hub.snapshot_download` at `model.revision`
  into `model.cache_dir` (default: the Hugging Face cache, `HF_HUB_CACHE` / `HF_HOME`), with the token from
  the environment (`HF_TOKEN`); `HF_HUB_OFFLINE=1` resolves it from the cache alone;
- an fsspec URL (`s3://bucket/models/llama`, `gs://...`), whose files are copied once into
  `<cache_dir>/tigon-objects/<hash of the URL>/`.

Hub errors (missing repository, gated repository without a token, unknown revision, not cached while
offline) become ConfigErrors that name the key and the fix, raised before any model is built.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from tigon.runtime.config import ConfigError
from tigon.runtime.distributed import barrier

if TYPE_CHECKING:
    from tigon.runtime.config import ModelConfig
    from tigon.runtime.distributed import DistEnv

logger = logging.getLogger("tigon.runtime")

URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
# Files a causal LM and its tokenizer never need: other frameworks' weights, the original (non-HF) checkpoints.
IGNORED_FILES = ["*.onnx", "onnx/*", "*.gguf", "*.h5", "*.msgpack", "*.ot", "*.tflite", "original/*", "*.pth"]
# What a tokenizer needs from a model repository: no weights (the workflow's data task loads only the tokenizer).
TOKENIZER_FILES = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "tokenizer*"]
OBJECT_DIR = "tigon-objects"
_RESOLVED: dict[tuple[str, str | None, str, bool], Path] = {}  # (source, revision, cache, tokenizer only) -> directory


def is_url(source: str) -> bool:
    """Whether `source` is a URL (`s3://...`, `gs://...`, `file://...`) rather than a path or a Hub id."""
    return bool(URL.match(source))


def is_hub_id(source: str) -> bool:
    """Whether `source` names a Hub repository: `org/name` (or `name`) that is not an existing local path."""
    return not is_url(source) and not Path(source).expanduser().exists() and bool(HUB_ID.match(source))


def cache_dir(model_config: ModelConfig) -> Path:
    """Where Hub snapshots and object-store copies go: `model.cache_dir`, else the Hugging Face cache."""
    if model_config.cache_dir is not None:
        return Path(model_config.cache_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_error(error: Exception, key: str, source: str, revision: str | None) -> ConfigError | None:
    """The ConfigError for a huggingface_hub error about `source` (given as `key`), or None if it is another kind."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    local = f"; no local directory {source} exists either" if "/" in source else ""
    if isinstance(error, GatedRepoError):  # a subclass of RepositoryNotFoundError: check it first
        where = "HF_TOKEN is not set" if not os.environ.get("HF_TOKEN") else "the token in HF_TOKEN has no access"
        return ConfigError(
            f"{key}: {source!r} is a gated model and {where}; accept its license on huggingface.co/{source} and set "
            "HF_TOKEN to a token of that account (on a cluster: the hf-token secret in the job template)"
        )
    if isinstance(error, RepositoryNotFoundError):
        return ConfigError(
            f"{key}: no model {source!r} on the Hugging Face Hub (or it is private and HF_TOKEN cannot see it); "
            "check the id (org/name), set HF_TOKEN for a private model, or point it at a local directory" + local
        )
    if isinstance(error, RevisionNotFoundError):
        return ConfigError(
            f"{key}: {source!r} has no revision {revision!r}; set model.revision to an existing branch, tag or "
            "commit (or remove it for main)"
        )
    if isinstance(error, LocalEntryNotFoundError):
        return ConfigError(
            f"{key}: {source!r}{at} is not in the cache and the Hub cannot be reached (offline: HF_HUB_OFFLINE=1, "
            "or no network); download it once where the Hub is reachable (same model.cache_dir), unset "
            "HF_HUB_OFFLINE, or point it at a local directory" + local
        )
    return None


def snapshot(
    source: str, model_config: ModelConfig, key: str, local_only: bool = False, tokenizer_only: bool = False
) -> Path:
    """The local directory of Hub repository `source` at `model.revision`, downloaded into the cache if needed
    (with `tokenizer_only`, only the tokenizer's files)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    code = ["*.py"] if model_config.trust_remote_code else []
    ignored = IGNORED_FILES if model_config.trust_remote_code else [*IGNORED_FILES, "*.py"]
    try:
        return Path(
            snapshot_download(
                source,
                revision=model_config.revision,
                cache_dir=cache_dir(model_config),
                allow_patterns=[*TOKENIZER_FILES, *code] if tokenizer_only else None,
                ignore_patterns=ignored,
                local_files_only=local_only,
            )
        )
    except (HfHubHTTPError, OSError, ValueError) as error:
        mapped = hub_error(error, key, source, model_config.revision)
        if mapped is None:
            raise ConfigError(f"{key}: cannot fetch {source!r} from the Hugging Face Hub: {error}") from error
        raise mapped from None


def object_copy(url: str, model_config: ModelConfig, key: str, local_only: bool = False) -> Path:
    """A local copy of the model directory at fsspec `url` (made once; a finished copy holds `.complete`)."""
    import fsspec

    target = cache_dir(model_config) / OBJECT_DIR / hashlib.sha256(url.encode()).hexdigest()[:16]
    if (target / ".complete").is_file():
        return target
    if local_only:
        raise ConfigError(f"{key}: {url} has no finished local copy in {target}; local rank 0 failed to copy it")
    try:
        fs, root = fsspec.core.url_to_fs(url)
        if not fs.isfile(f"{root.rstrip('/')}/config.json"):
            raise ConfigError(f"{key}: {url} has no config.json; point it at a save_pretrained directory")
        partial = target.with_name(f"{target.name}.partial-{uuid.uuid4().hex[:8]}")  # nodes may share the cache
        fs.get(f"{root.rstrip('/')}/", str(partial), recursive=True)
    except (OSError, ImportError, ValueError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"{key}: cannot copy {url}: {error}; check the URL and the store's credentials") from error
    (partial / ".complete").touch()
    try:
        partial.rename(target)
        logger.info("copied %s to %s", url, target)
    except OSError:  # another node's copy got there first
        shutil.rmtree(partial, ignore_errors=True)
    return target


def local_directory(
    source: str, model_config: ModelConfig, key: str, local_only: bool = False, tokenizer_only: bool = False
) -> Path:
    """The local directory `source` (a path, a Hub id or a URL) resolves to, fetching it if needed (a Hub id with
    `tokenizer_only`: its tokenizer files alone). A source this process resolved already is not looked up again
    (no second request to the Hub for the same revision)."""
    remembered = (
        source,
        model_config.revision,
        str(cache_dir(model_config)) if not _local(source) else "",
        tokenizer_only,
    )
    if remembered in _RESOLVED and _RESOLVED[remembered].is_dir():
        return _RESOLVED[remembered]
    if is_url(source) and not source.startswith("file://"):
        directory = object_copy(source, model_config, key, local_only)
    elif is_hub_id(source):
        directory = snapshot(source, model_config, key, local_only, tokenizer_only)
    else:
        return _local_path(source.removeprefix("file://"), key)
    _RESOLVED[remembered] = directory
    return directory


def _local_path(source: str, key: str) -> Path:
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"{key}: {path} does not exist; give a local save_pretrained directory, a Hugging Face Hub id "
            "(org/name), or an object-store URL (s3://, gs://)"
        )
    return path


def model_directory(model_config: ModelConfig, local_only: bool = False) -> Path:
    """`model.path` as a local directory with a config.json (downloaded or copied if needed)."""
    directory = local_directory(model_config.path, model_config, "model.path", local_only)
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"model.path: {model_config.path} ({directory}) has no config.json; point it at a save_pretrained "
            "directory or a model repository, or build from a config with model.config_name"
        )
    return directory


def config_json(model_config: ModelConfig) -> dict:
    """`model.path`'s config.json alone, without the weights (for the planner): one small download at most."""
    source = model_config.path
    if is_hub_id(source):
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

        try:
            file = hf_hub_download(
                source, "config.json", revision=model_config.revision, cache_dir=cache_dir(model_config)
            )
        except (HfHubHTTPError, EntryNotFoundError, OSError, ValueError) as error:
            mapped = hub_error(error, "model.path", source, model_config.revision)
            if mapped is None and isinstance(error, EntryNotFoundError):
                mapped = ConfigError(f"model.path: {source!r} has no config.json; is it a transformers model?")
            raise mapped or ConfigError(f"model.path: cannot fetch {source!r}'s config.json: {error}") from None
        return json.loads(Path(file).read_text())
    if is_url(source) and not source.startswith("file://"):
        import fsspec

        try:
            with fsspec.open(f"{source.rstrip('/')}/config.json", "r") as file:
                return json.load(file)
        except (OSError, ValueError) as error:
            raise ConfigError(f"model.path: cannot read {source}/config.json: {error}") from None
    return json.loads((model_directory(model_config) / "config.json").read_text())


def fetch_model(model_config: ModelConfig, env: DistEnv) -> None:
    """Fetch the model (and a separate tokenizer) once per node: local rank 0 downloads, every rank waits at a
    barrier, then the others find the files in the cache. Call on every rank, before building the model."""
    sources = [(model_config.path, "model.path"), (model_config.tokenizer, "model.tokenizer")]
    remote = [(source, key) for source, key in sources if source and source != "char" and not _local(source)]
    if not remote:
        return
    failure = None
    if env.local_rank == 0:
        try:
            for source, key in remote:
                local_directory(source, model_config, key, tokenizer_only=key == "model.tokenizer")
        except ConfigError as error:
            failure = error
    barrier(env)  # every rank reaches it, so a failed download cannot leave the others waiting
    if failure is not None:
        raise failure
    if env.local_rank != 0:
        for source, key in remote:
            local_directory(source, model_config, key, local_only=True, tokenizer_only=key == "model.tokenizer")


def _local(source: str) -> bool:
    return source.startswith("file://") or (not is_url(source) and not is_hub_id(source))
