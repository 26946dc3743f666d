"""tigon.kernels: exact, fused Triton kernels for LLM training.

`apply`, `apply_to` and `AutoModelForCausalLM` (from `tigon.kernels.patching`) are loaded on first
use, so `import tigon.kernels` imports neither triton nor transformers.
"""

__all__ = ["AutoModelForCausalLM", "apply", "apply_to"]


def __getattr__(name: str):
    if name in __all__:
        from tigon.kernels import patching

        return getattr(patching, name)
    raise AttributeError(f"module 'tigon.kernels' has no attribute {name!r}")
