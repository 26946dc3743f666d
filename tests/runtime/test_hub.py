"""Models and tokenizers by Hub id (offline, from a cache built here), by object-store URL, and Hub errors."""

from __future__ import annotations

import fsspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.runtime.configs import save_tiny_llama, tiny_config
from tests.runtime.hub_cache import REPO
from tigon.runtime.config import ConfigError, ModelConfig
from tigon.runtime.distributed import DistEnv
from tigon.runtime.hub import config_json, fetch_model, hub_error, model_directory
from tigon.runtime.model import build_model
from tigon.runtime.tokenizer import load_tokenizer

from .hub_cache import HubCache, offline


@pytest.fixture
def hub(tmp_path, monkeypatch) -> HubCache:
    cache = HubCache(tmp_path / "hub")
    offline(monkeypatch, cache.root)
    return cache


def hub_run(tmp_path, **model):
    model = {"path": REPO, "config_name": None, "config_overrides": {}, "tokenizer": None, **model}
    return tiny_config(tmp_path, model=model)


def test_model_and_tokenizer_by_hub_id_from_the_cache(tmp_path, hub):
    hub.add_model(REPO, tmp_path)
    config = hub_run(tmp_path)
    tokenizer = load_tokenizer(config.model)
    assert len(tokenizer) == 100 and tokenizer.chat_template
    model = build_model(config, len(tokenizer), tokenizer)
    reference = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "again"))
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(got, want), name
    meta = build_model(config, len(tokenizer), tokenizer, meta=True)  # an FSDP2 rank > 0: shapes only
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert config_json(config.model)["num_hidden_layers"] == 2


def test_revision_pins_a_tag_or_a_commit(tmp_path, hub):
    hub.add_model(REPO, tmp_path)
    commit = hub.add_model(REPO, tmp_path, tags=("v1",), num_hidden_layers=3)
    for revision in ("v1", commit):
        config = hub_run(tmp_path, revision=revision)
        assert model_directory(config.model).name == commit
        assert build_model(config, 100).config.num_hidden_layers == 3
    assert build_model(hub_run(tmp_path), 100).config.num_hidden_layers == 2


def test_cache_dir_setting_and_missing_model_or_revision_offline(tmp_path, hub):
    elsewhere = HubCache(tmp_path / "elsewhere")
    elsewhere.add_model(REPO, tmp_path)
    config = hub_run(tmp_path, cache_dir=str(elsewhere.root))
    assert model_directory(config.model).is_relative_to(elsewhere.root)
    with pytest.raises(ConfigError, match=r"model.path: 'tigon-test/tiny-llama' is not in the cache .*HF_HUB_OFFLINE"):
        model_directory(hub_run(tmp_path).model)  # the default cache has no copy
    with pytest.raises(ConfigError, match="revision 'v9' is not in the cache"):
        model_directory(hub_run(tmp_path, cache_dir=str(elsewhere.root), revision="v9").model)
    with pytest.raises(ConfigError, match="model.tokenizer: 'tigon-test/absent'"):
        load_tokenizer(ModelConfig(config_name="llama", tokenizer="tigon-test/absent"))


@pytest.mark.parametrize(
    ("status", "code", "message"),
    [
        (401, "GatedRepo", "gated model and HF_TOKEN is not set; accept its license"),
        (404, "RepoNotFound", "no model 'org/x' on the Hugging Face Hub"),
        (404, "RevisionNotFound", "has no revision 'v2'; set model.revision"),
    ],
)
def test_hub_errors_name_the_key_and_the_fix(monkeypatch, status, code, message):
    """The Hub's responses (status and X-Error-Code), classified by huggingface_hub's own hf_raise_for_status."""
    import httpx2
    from huggingface_hub.utils import hf_raise_for_status

    monkeypatch.delenv("HF_TOKEN", raising=False)
    request = httpx2.Request("GET", "https://huggingface.co/api/models/org/x/revision/v2")
    response = httpx2.Response(status, headers={"X-Error-Code": code}, request=request)
    with pytest.raises(Exception) as raised:
        hf_raise_for_status(response)
    mapped = hub_error(raised.value, "model.path", "org/x", "v2")
    assert isinstance(mapped, ConfigError) and message in str(mapped), str(mapped)
    assert hub_error(KeyError("x"), "model.path", "org/x", None) is None


def test_object_store_url_is_copied_once_per_node(tmp_path, monkeypatch):
    """fsspec's in-memory filesystem stands where s3:// or gs:// would; the copy lands in model.cache_dir."""
    source = save_tiny_llama(tmp_path / "src")
    store = fsspec.filesystem("memory")
    store.put(f"{source}/", "/bucket/models/tiny/", recursive=True)
    config = hub_run(tmp_path, path="memory://bucket/models/tiny", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="local rank 0 failed to copy it"):
        fetch_model(config.model, DistEnv(rank=1, world_size=1, local_rank=1))  # nothing copied yet
    fetch_model(config.model, DistEnv())
    directory = model_directory(config.model, local_only=True)
    assert (directory / "config.json").is_file() and directory.is_relative_to(tmp_path / "cache")
    store.rm("/bucket/models/tiny", recursive=True)  # later ranks and runs read the copy, not the store
    assert build_model(config, len(load_tokenizer(config.model))).config.num_hidden_layers == 2
    with pytest.raises(ConfigError, match="has no config.json"):
        model_directory(hub_run(tmp_path, path="memory://bucket/empty", cache_dir=str(tmp_path / "cache")).model)


def test_fsdp2_ranks_fetch_once_per_node_then_load_from_the_cache(tmp_path, hub):
    """2 FSDP2 ranks over gloo: the model from an object-store URL (fsspec's `local://` where s3:// would be), the
    tokenizer by Hub id. Local rank 0 fetches both; rank 1 waits at the barrier and may only read the local copies
    (it raises if they are absent), then builds on the meta device and receives rank 0's weights."""
    from tests.runtime.configs import resumable_config
    from tests.runtime.worker_groups import launch

    hub.add_model(REPO, tmp_path)
    source = save_tiny_llama(tmp_path / "store" / "tiny")
    model = {"path": f"local://{source}", "tokenizer": REPO, "config_name": None, "config_overrides": {}}
    config = resumable_config(tmp_path, "fsdp", 2, False, model=model, parallelism={"strategy": "fsdp"})
    runs = launch(tmp_path, {"fsdp": config})
    assert len(runs["fsdp"]["losses"]) == 2
    (copy,) = (hub.root / "tigon-objects").iterdir()
    assert (copy / ".complete").is_file() and (copy / "model.safetensors").is_file()
