"""The PyTorch Mamba-2 scan of transformers before 5.18: its broadcast product counted, and a run it cannot fit
refused with the fix (tigon.runtime.mamba_scan)."""

from __future__ import annotations

import pytest
from transformers import FalconH1Config, LlamaConfig, Mamba2Config

from tests.runtime.configs import tiny_config
from tigon.runtime.config import ConfigError
from tigon.runtime.mamba_scan import broadcast_scan_bytes, check_mamba_scan, fast_path_installed

GIB = 2**30


def test_the_broadcast_product_is_chunks_by_chunk_squared_by_heads_by_state_in_float32():
    falcon = FalconH1Config()  # 128 heads, state 256, chunks of 256
    assert broadcast_scan_bytes(falcon, 4096, 1, "5.17.0") == 16 * 256 * 256 * 128 * 256 * 4 == 128 * GIB
    assert broadcast_scan_bytes(falcon, 4097, 2, "4.57.1") == 2 * 17 * 256 * 256 * 128 * 256 * 4  # padded to chunks
    mamba = Mamba2Config(hidden_size=256, num_heads=8, head_dim=64, state_size=16, chunk_size=64)
    assert broadcast_scan_bytes(mamba, 128, 1, "5.0.0") == 2 * 64 * 64 * 8 * 16 * 4


@pytest.mark.parametrize("version", ["5.18.0", "5.18.0rc1", "5.24.0", "6.0.0.dev0"])
def test_transformers_5_18_and_later_build_no_such_product(version):
    assert broadcast_scan_bytes(FalconH1Config(), 4096, 4, version) == 0


def test_a_model_without_a_mamba2_mixer_builds_none():
    assert broadcast_scan_bytes(LlamaConfig(), 4096, 4, "5.17.0") == 0


def test_a_run_the_product_does_not_fit_stops_with_the_fix(tmp_path):
    config = tiny_config(tmp_path, data={"max_seq_len": 4096}, training={"micro_batch_size": 1})
    falcon = FalconH1Config()
    with pytest.raises(ConfigError, match=r"builds a 128 GiB tensor per layer.*than this GPU's 80 GiB.*>=5\.18"):
        check_mamba_scan(falcon, config, 80 * GIB, "5.17.0", fast_path=False)
    check_mamba_scan(falcon, config, 141 * GIB, "5.17.0", fast_path=False)  # fits: the run goes on
    check_mamba_scan(falcon, config, 80 * GIB, "5.18.0", fast_path=False)
    check_mamba_scan(falcon, config, 80 * GIB, "5.17.0", fast_path=True)  # transformers runs mamba-ssm's kernels
    check_mamba_scan(falcon, config, None, "5.17.0", fast_path=False)  # no GPU: nothing to check


def test_the_fast_path_is_mamba_ssm_with_causal_conv1d():
    import importlib.util

    expected = all(importlib.util.find_spec(name) is not None for name in ("mamba_ssm", "causal_conv1d"))
    assert fast_path_installed() is expected
