"""The torch reference of every op: its contract, the CPU path, and what the Triton kernels are tested against.

One module per op, named as its Triton counterpart in `kernels.triton`.
"""
