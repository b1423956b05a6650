"""The Triton kernels, one module per op, each importing Triton at the top.

Nothing imports this package on a machine without Triton: `kernels.dispatch` imports an op's module
the first time it picks Triton for that op. Triton decides at that import whether the kernels are
compiled or interpreted (`TRITON_INTERPRET=1`, which the tests set on a CPU). Each op's contract and
torch reference are in `kernels.reference`, under the same module name.
"""
