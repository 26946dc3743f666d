"""Publishing a run to the Hugging Face Hub: the exported model (and a LoRA run's adapter) with a model card.

    check_push(config)                                   # before training: a token is there
    folder = stage(config, result, fingerprint)          # run_dir/hub/: the export, adapter/ and README.md
    url = push(config, folder)                           # create the repository, upload the folder

`checkpoint.push_to_hub: {repo_id: me/tiny-sft, private: true, revision: main}`. A full fine-tune pushes its
export; a LoRA run pushes the merged model with the adapter alone under `adapter/` (`checkpoint.merge_lora`),
or only the adapter when the export is unmerged. The model card (README.md) records the base model, the
config, the data fingerprint and the final metrics. The token comes from `HF_TOKEN` (or `huggingface-cli login`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tigon.runtime.config import ConfigError
from tigon.runtime.data import is_hub_dataset
from tigon.runtime.hub import is_hub_id

if TYPE_CHECKING:
    from tigon.runtime.config import RunConfig

logger = logging.getLogger("tigon.runtime")

STAGING = "hub"
ADAPTER = "adapter"


def check_push(config: RunConfig) -> None:
    """Fail before training when a push is configured but it cannot succeed: no export, or no token."""
    if config.checkpoint.push_to_hub is None:
        return
    if not config.checkpoint.export:
        raise ConfigError("checkpoint.push_to_hub pushes the export: set checkpoint.export: true")
    from huggingface_hub import get_token

    if get_token() is None:
        raise ConfigError(
            "checkpoint.push_to_hub: no Hugging Face token; set HF_TOKEN to a token with write access (on a cluster: "
            "the hf-token secret in the job template), or remove checkpoint.push_to_hub"
        )


def data_fingerprint(train_dataset, manifest: dict | None) -> str:
    """The packed data's fingerprint: its manifest's (the data files' content hash), else the SHA-256 of the packed
    training arrays (input ids and labels)."""
    if manifest and manifest.get("fingerprint"):
        return str(manifest["fingerprint"])
    digest = hashlib.sha256()
    for array in (train_dataset.input_ids, train_dataset.labels):
        digest.update(array.contiguous().numpy().tobytes())
    return digest.hexdigest()


def model_card(config: RunConfig, metrics: dict[str, Any], fingerprint: str) -> str:
    """README.md for the Hub: metadata (base model, library, datasets, tags), the config, the data and the results."""
    base = config.model.path if config.model.path and is_hub_id(config.model.path) else None
    datasets = [name for name in (config.data.train, config.data.eval) if name and is_hub_dataset(name)]
    metadata: dict[str, Any] = {"library_name": "peft" if config.lora.enabled else "transformers"}
    if base:
        metadata["base_model"] = base
    if datasets:
        metadata["datasets"] = sorted(set(datasets))
    metadata["tags"] = ["tigon", "causal-lm", "lora" if config.lora.enabled else "full-fine-tune"]
    settings = json.loads(config.model_dump_json())
    settings["logging"].pop("run_dir", None)
    rows = "\n".join(f"| {name} | {_number(value)} |" for name, value in metrics.items() if value is not None)
    what = f"a LoRA adapter (r={config.lora.r}) on" if config.lora.enabled else "a full fine-tune of"
    source = (
        f"[{base}](https://huggingface.co/{base})" if base else f"`{config.model.path or config.model.config_name}`"
    )
    return (
        f"---\n{yaml.safe_dump(metadata, sort_keys=False)}---\n\n"
        f"# {config.checkpoint.push_to_hub.repo_id if config.checkpoint.push_to_hub else config.name}\n\n"
        f"{what} {source}, trained with tigon ({config.trainer} trainer, {config.training.precision}).\n\n"
        f"## Data\n\n`{config.data.train}` ({config.data.format} format, split `{config.data.split}`), "
        f"packed into {config.data.max_seq_len}-token sequences.\n\n"
        f"Data fingerprint (SHA-256): `{fingerprint}`\n\n"
        f"## Results\n\n| metric | value |\n|---|---|\n{rows}\n\n"
        f"## Training configuration\n\n```yaml\n{yaml.safe_dump(settings, sort_keys=False)}```\n"
    )


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def stage(config: RunConfig, export_dir: Path, metrics: dict[str, Any], fingerprint: str) -> Path:
    """The folder to upload, in run_dir/hub: the export, a LoRA run's separate adapter under adapter/, README.md."""
    folder = Path(config.logging.run_dir) / STAGING
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(export_dir, folder)
    adapter = adapter_dir(export_dir)
    if adapter.is_dir():
        shutil.copytree(adapter, folder / ADAPTER)
    (folder / "README.md").write_text(model_card(config, metrics, fingerprint))
    return folder


def adapter_dir(export_dir: Path) -> Path:
    """Where `export_model` saves a LoRA run's adapter alone beside the merged export."""
    return export_dir.with_name(f"{export_dir.name}-{ADAPTER}")


def push(config: RunConfig, folder: Path) -> str:
    """Create the repository (private unless set otherwise) and the branch, upload `folder`; the commit's URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    target = config.checkpoint.push_to_hub
    api = HfApi()
    try:
        api.create_repo(target.repo_id, private=target.private, exist_ok=True)
        if target.revision not in (None, "main"):
            api.create_branch(target.repo_id, branch=target.revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=target.repo_id,
            folder_path=str(folder),
            revision=target.revision,
            commit_message=f"tigon: {config.name}",
        )
    except OfflineModeIsEnabled:
        raise ConfigError(
            f"checkpoint.push_to_hub: HF_HUB_OFFLINE is set, so {target.repo_id} cannot be pushed; the staged "
            f"folder is {folder}: upload it later with `hf upload {target.repo_id} {folder}`"
        ) from None
    except HfHubHTTPError as error:
        raise ConfigError(
            f"checkpoint.push_to_hub: pushing {target.repo_id} failed: {error}; check that HF_TOKEN has write access "
            f"to it; the staged folder is {folder}"
        ) from None
    logger.info("pushed %s to %s", folder, commit.commit_url)
    return commit.commit_url


def publish(config: RunConfig, export_dir: str, metrics: dict[str, Any], fingerprint: str) -> str:
    """Stage the export with its model card and push it (rank 0, after the export); the commit's URL."""
    return push(config, stage(config, Path(export_dir), metrics, fingerprint))
