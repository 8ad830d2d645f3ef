"""Fused ops. Each module holds a pure-PyTorch reference, its Triton kernels and the autograd wiring.

These files are shipped as remote code, flattened beside `modeling_fat5.py`: they import only torch,
triton and flash-attn-4 (inside `try:`, where transformers' check_imports does not look), transformers and each
other, always relatively. `routes.py` says which attention kernel serves which problem.
"""
