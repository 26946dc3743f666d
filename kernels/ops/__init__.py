"""Triton kernels and the autograd functions that launch them, one op per module."""
