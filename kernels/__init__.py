"""tigon.kernels: exact, fused Triton kernels for LLM training."""
