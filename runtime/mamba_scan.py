"""A run that transformers' PyTorch Mamba-2 scan cannot fit, refused before it starts.

Without the `mamba-ssm` and `causal-conv1d` kernels, transformers runs a Mamba-2 mixer's chunked scan in PyTorch.
Before transformers 5.18 that code contracts the chunks' B and C by broadcasting, building a float32 tensor of
(chunks x chunk x chunk x heads x state) per sequence in every layer: 128 GiB for one 4096-token sequence at
Falcon-H1-7B's widths. 5.18 computes the same sums with `einsum`. A run that would build a tensor larger than its GPU
stops here with the fix instead of running out of memory in its first step.
"""

from __future__ import annotations

import importlib.util

from tigon.runtime.config import ConfigError, RunConfig

FIXED_IN = (5, 18)
FLOAT32_BYTES = 4

# model_type -> the config's (heads, state size, chunk size) fields of its Mamba-2 mixer
MAMBA2_FIELDS: dict[str, tuple[str, str, str]] = {
    "bamba": ("mamba_n_heads", "mamba_d_state", "mamba_chunk_size"),
    "falcon_h1": ("mamba_n_heads", "mamba_d_state", "mamba_chunk_size"),
    "granitemoehybrid": ("mamba_n_heads", "mamba_d_state", "mamba_chunk_size"),
    "mamba2": ("num_heads", "state_size", "chunk_size"),
    "nemotron_h": ("mamba_num_heads", "ssm_state_size", "chunk_size"),
    "zamba2": ("n_mamba_heads", "mamba_d_state", "chunk_size"),
}


def broadcast_scan_bytes(model_config, tokens: int, sequences: int, transformers_version: str) -> int:
    """Bytes of the broadcast product one layer's PyTorch scan builds for `sequences` rows of `tokens`; 0 where the
    model has no Mamba-2 mixer or the installed transformers computes it without that product."""
    from packaging.version import Version  # transformers' own dependency

    fields = MAMBA2_FIELDS.get(getattr(model_config, "model_type", None))
    if fields is None or Version(transformers_version).release >= FIXED_IN:
        return 0
    heads, state, chunk = (getattr(model_config, name) for name in fields)
    chunks = -(-tokens // chunk)
    return sequences * chunks * chunk * chunk * heads * state * FLOAT32_BYTES


def fast_path_installed() -> bool:
    """Whether transformers can run the mixer on the `mamba-ssm` and `causal-conv1d` kernels instead."""
    return all(importlib.util.find_spec(name) is not None for name in ("mamba_ssm", "causal_conv1d"))


def check_mamba_scan(
    model_config, config: RunConfig, gpu_bytes: int | None, transformers_version: str, fast_path: bool
) -> None:
    """Raise ConfigError when the run's micro-batch would build a scan product larger than `gpu_bytes` (the GPU's
    memory; None: no GPU, nothing to check); `fast_path`: `fast_path_installed()`."""
    if gpu_bytes is None or fast_path:
        return
    tokens, sequences = config.data.max_seq_len, config.training.micro_batch_size
    needed = broadcast_scan_bytes(model_config, tokens, sequences, transformers_version)
    if needed > gpu_bytes:
        raise ConfigError(
            f"{model_config.model_type}: transformers {transformers_version} runs this model's Mamba-2 scan in "
            f"PyTorch (no mamba-ssm/causal-conv1d installed) and builds a {needed / 2**30:,.0f} GiB tensor per layer "
            f"for a micro-batch of {sequences} x {tokens} tokens, more than this GPU's {gpu_bytes / 2**30:.0f} GiB; "
            "upgrade transformers to 5.18 or later (pip install -U 'transformers>=5.18'), or install mamba-ssm and "
            "causal-conv1d"
        )
