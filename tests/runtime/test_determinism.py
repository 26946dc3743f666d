"""`training.deterministic`: the run chooses PyTorch's deterministic kernels, strictly (with warnings only, flash
attention's backward stays non-deterministic), and leaves cuDNN attention out; without it nothing global changes.
Each run is a subprocess of its own, since the setting is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.runtime.configs import tiny_config

TRAIN_AND_REPORT = """
import json, sys, torch
from tigon.runtime.config import load_config
from tigon.runtime.trainer import train
result = train(load_config(sys.argv[1]))
print(json.dumps({
    "deterministic": torch.are_deterministic_algorithms_enabled(),
    "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    "cudnn_deterministic": torch.backends.cudnn.deterministic,
    "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled(),
    "final_loss": result.final_loss,
}))
"""


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_training_sets_the_kernels_choice_for_the_process(tmp_path, deterministic):
    config = tiny_config(tmp_path, training={"max_steps": 2, "deterministic": deterministic})
    path = tmp_path / "config.yaml"
    path.write_text(config.model_dump_json())
    done = subprocess.run(
        [sys.executable, "-c", TRAIN_AND_REPORT, str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["deterministic"] is deterministic and report["cudnn_deterministic"] is deterministic
    assert report["warn_only"] is False
    assert report["cudnn_attention"] is not deterministic
    assert report["final_loss"] > 0
