"""Fused ops. Each module holds a pure-PyTorch reference, its Triton kernels and the autograd wiring.

These files are shipped as remote code, flattened beside `modeling_fat5.py`: they import only torch,
triton (inside `try:`), transformers and each other, always relatively.
"""
