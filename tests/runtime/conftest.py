"""Fixtures shared by the runtime tests."""

import pytest


@pytest.fixture(autouse=True)
def _restore_patched_rope(restore_rope):
    """A run with kernels patches transformers' module-level RoPE function; put it back after every test,
    so a later test in the same worker does not run the kernel (through the slow interpreter) unasked."""
    yield


@pytest.fixture(scope="module")
def tokenizer():
    """tigon's character tokenizer (`model.tokenizer: char`), built once per test module."""
    from tigon.runtime.tokenizer import build_char_tokenizer

    return build_char_tokenizer()
