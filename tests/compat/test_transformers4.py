"""The patching tests, collected again under the older transformers line that users still run, and the compiled
checkpointed layer's recompute (that line's decoder layers checkpoint `__call__`, outside the compiled forward).

scripts/test.sh installs tests/compat/transformers4.txt beside the newest transformers and runs this
folder with it first on PYTHONPATH; the main run ignores this folder (`--ignore=tests/compat`).
"""

import transformers

from tests.kernels.test_patching import *  # noqa: F403
from tests.runtime.test_compile import (  # noqa: F401
    fresh_dynamo,
    test_a_compiled_checkpointed_layer_recomputes_only_what_its_backward_reads,
)


def test_runs_against_transformers_4():
    assert transformers.__version__.startswith("4."), (
        f"tests/compat must run against transformers 4.x, found {transformers.__version__}: "
        "run it through scripts/test.sh, which puts .transformers4 first on PYTHONPATH"
    )
