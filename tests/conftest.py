"""Test set-up: run the Triton kernels through the interpreter when no GPU is present.

TRITON_INTERPRET must be set before triton is imported, so this happens at conftest import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if "gpu" in item.keywords:
            raise pytest.UsageError(
                f"{item.nodeid} is a GPU test but no CUDA device is present; deselect with -m 'not gpu'"
            )


@pytest.fixture(autouse=True)
def poison_uninitialized_memory():
    """Fill every torch.empty with NaN so an element a kernel forgets to write fails the test."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.fixture
def one_thread():
    """For tests of tiny models: one torch thread is faster than two that other processes' threads contend with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session", autouse=True)
def transformers_ropes():
    """Every table family's `apply_rotary_pos_emb` as transformers ships it, read before any test runs: tigon's RoPE
    patch is module-wide, and a test that builds a patched model leaves it in place for the tests after it."""
    from tests.kernels.families import rope_functions

    return rope_functions()


@pytest.fixture
def restore_rope(transformers_ropes):
    """The test starts with transformers' own RoPE functions (whatever tests ran before it in this process), and
    what the modules held is put back after it."""
    from tests.kernels.families import rope_functions

    saved = rope_functions()
    for module, function in transformers_ropes.items():
        module.apply_rotary_pos_emb = function
    yield
    for module, function in saved.items():
        module.apply_rotary_pos_emb = function


@pytest.fixture
def restore_modeling(restore_rope):
    """apply_to swaps module-level classes; put the originals back after the test."""
    from tests.kernels.helpers import installed_modeling
    from tigon.kernels.patching import FAMILIES

    saved = {}
    for family in FAMILIES.values():
        family = family.installed()
        module = installed_modeling(family.modeling)
        if module is None:
            continue
        names = (*family.rms_norm, *family.offset_layer_norm, *family.mlp, *family.packed_mlp, *family.experts)
        names += family.expert_mlp + ((family.loss_rows_layer,) if family.loss_rows_layer else ())
        saved[module] = {name: getattr(module, name) for name in names}
        if family.causal_lm is not None:  # a vision encoder's row has none
            causal_lm = getattr(module, family.causal_lm)
            saved[causal_lm] = {"forward": causal_lm.forward}
    yield
    for owner, names in saved.items():
        for name, value in names.items():
            setattr(owner, name, value)
