"""The token embedding (and an untied output layer) read from the model file itself, for the native step.

Dequantised to fp32, a vocabulary-sized matrix is the largest thing a small model holds: 108 MiB for
SmolLM2's 49k x 576 embedding, 1 GiB for a Llama-3.2-1B shape's 128k x 2048, against the 30 and 215 MB its
GGUF stores it in. The native step only ever needs a few rows of it at a time (the tokens a step embeds,
each output row's candidates that the output layer recomputes at full precision; its int8 copy is what a
step reads whole) and, for logprobs, the whole product at full precision. So the model does not copy it
at all: the rows are decoded from the memory-mapped file's own blocks when they are needed
(kernels/cpu/gguf_rows.c), exactly: the values are the dequantised weights, bit for bit, as an fp32 copy
would hold them. Its pages are the file's, resident once read (as a whole mapped file is in llama.cpp),
never a second copy; `release` drops them after a pass over every row.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import kernels.cpu as cpu_kernels

CHUNK_ROWS = 4096  # rows decoded at once for a full product: 9 MiB of fp32 at 576 columns
NATIVE_MAX_ROWS = 8  # up to this many input rows, the native product (each weight row decoded once)
# The GGML types kernels/cpu/gguf_rows.c decodes (type numbers): F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
# Q5_K, Q6_K, BF16. (Whole blocks per row: the GGUF reader checks that.)
ROW_TYPES = frozenset({1, 2, 3, 6, 7, 8, 12, 13, 14, 30})


class TokenRows:
    """A [V, K] matrix in the file's blocks. Indexing it as a tensor (`rows[ids]`, `rows[a:b]`) gives fp32
    rows; `product(h)` is h @ W^T at full precision. `threads`: for decoding many rows at once (a prefill's
    embeddings); the model sets it to the native step's."""

    def __init__(self, rows: cpu_kernels.GGUFRows, type_name: str,
                 release: Callable[[np.ndarray], None] | None = None):
        self.rows = rows
        self.shape = rows.shape
        self.type_name = type_name
        self.threads = 1
        self._release = release
        assert self.shape[1] % 32 == 0

    def nbytes(self) -> int:
        """The file bytes it maps (resident only while read): what it costs instead of a copy."""
        return int(self.rows.data.nbytes)

    def release(self, a: int = 0, b: int | None = None) -> None:
        """Drops the mapped pages of rows [a, b) from the resident set (after a pass over them, such as
        building the output layer's int8 copy): they come back, from the page cache, as rows are read again.
        `release`: the file's (GGUFFile.release), given a view of the rows."""
        if self._release is not None:
            self._release(self.rows.data[a:b])

    def __getitem__(self, index: torch.Tensor | slice) -> torch.Tensor:
        """fp32 rows: `index` a tensor of row ids (any shape: the result adds a last dimension K) or a slice."""
        if isinstance(index, slice):
            return cpu_kernels.gguf_rows(self.rows, torch.arange(self.shape[0])[index], self.threads)
        flat = index.reshape(-1)
        return cpu_kernels.gguf_rows(self.rows, flat, self.threads).view(*index.shape, self.shape[1])

    def product(self, h: torch.Tensor, chunk_rows: int = CHUNK_ROWS, threads: int = 0) -> torch.Tensor:
        """h [B, K] @ W^T at full precision -> [B, V] fp32. A few rows of h (a decode step's logprobs), with
        `threads`: each row of W decoded once and multiplied natively. Otherwise `chunk_rows` rows of W
        decoded at a time, then a GEMM. No full-size fp32 copy, ever."""
        h = h.float()
        if threads and h.shape[0] <= NATIVE_MAX_ROWS:
            return cpu_kernels.gguf_rows_product(h, self.rows, threads)
        v, _ = self.shape
        out = torch.empty(h.shape[0], v)
        for a in range(0, v, chunk_rows):
            b = min(a + chunk_rows, v)
            out[:, a:b] = h @ self[a:b].T
        return out
