"""checkpoint.push_to_hub: the model card and the folder staged for upload (real), and the upload call as far as
an offline machine takes it: huggingface_hub refuses it with HF_HUB_OFFLINE set, and tigon says where the staged
folder is. The upload to a reachable Hub is not exercised here."""

from __future__ import annotations

import pytest
import yaml

from tests.runtime.configs import tiny_config
from tests.runtime.hub_cache import REPO
from tigon.runtime.config import ConfigError
from tigon.runtime.trainer import train

from .hub_cache import HubCache, offline


def test_lora_run_stages_merged_model_adapter_and_card_then_push_is_refused_offline(tmp_path, monkeypatch):
    cache = HubCache(tmp_path / "hub")
    offline(monkeypatch, cache.root)
    cache.add_model(REPO, tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_offline_test_token")
    model = {"path": REPO, "config_name": None, "config_overrides": {}, "tokenizer": None}
    push = {"export": True, "resume": False, "push_to_hub": {"repo_id": "me/tiny-sft"}}
    config = tiny_config(
        tmp_path, model=model, training={"max_steps": 2}, lora={"enabled": True, "r": 4}, checkpoint=push
    )
    with pytest.raises(ConfigError, match=r"HF_HUB_OFFLINE is set, so me/tiny-sft cannot be pushed; the staged"):
        train(config)
    staged = tmp_path / "run" / "hub"
    assert (staged / "model.safetensors").is_file() and (staged / "tokenizer.json").is_file()  # merged model
    assert (staged / "adapter" / "adapter_config.json").is_file()
    assert (staged / "adapter" / "adapter_model.safetensors").is_file()  # the adapter alone
    card = (staged / "README.md").read_text()
    metadata = yaml.safe_load(card.split("---")[1])
    assert metadata["base_model"] == REPO and metadata["library_name"] == "peft" and "tigon" in metadata["tags"]
    assert "Data fingerprint (SHA-256): `" in card and "| final_loss |" in card
    assert "max_steps: 2" in card and "repo_id: me/tiny-sft" in card


def test_push_without_a_token_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    config = tiny_config(tmp_path, checkpoint={"export": True, "push_to_hub": {"repo_id": "me/tiny-sft"}})
    with pytest.raises(ConfigError, match="checkpoint.push_to_hub: no Hugging Face token; set HF_TOKEN"):
        train(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
