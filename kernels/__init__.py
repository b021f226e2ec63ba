"""Triton kernels of vllm-adaptive-spec.

One module per kernel; each holds the Triton kernel, its torch reference and a
dispatch that runs the kernel on a GPU and the reference elsewhere.
"""
