import pytest


@pytest.fixture(autouse=True)
def _restore_patched_rope(restore_rope):
    """A run with kernels patches transformers' module-level RoPE function; put it back after every test,
    so a later test in the same worker does not run the kernel (through the slow interpreter) unasked."""
    yield
