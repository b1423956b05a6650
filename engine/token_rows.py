"""The token embedding (and an untied output layer) kept in the file's own codes, for the native step.

Dequantised to fp32, a vocabulary-sized matrix is the largest thing a small model holds: 108 MiB for
SmolLM2's 49k x 576 embedding, 1 GiB for a Llama-3.2-1B shape's 128k x 2048, against the 30 and 215 MB its
GGUF stores it in. The native step only ever needs a few rows of it at a time (the tokens a step embeds,
each output row's candidates that `LlamaModel.logits` recomputes at full precision) and, for logprobs, the
whole product at full precision. So the model keeps it as the file's codes and group scales
(`gguf_blocks.GroupBlocks`: code * scale + min, every GGUF quantised type the native step reads fits it),
or as fp16 for an F16 file, and expands rows on demand, exactly: the values are the dequantised weights,
bit for bit, as the fp32 copy held them.
"""

from __future__ import annotations

import torch

import kernels.cpu as cpu_kernels

from .gguf_blocks import GroupBlocks, HalfWeights

CHUNK_ROWS = 4096  # rows expanded at once for a full product: 9 MiB of fp32 at 576 columns
NATIVE_MAX_ROWS = 8  # up to this many input rows, the native product (each weight row expanded once)


class TokenRows:
    """A [V, K] matrix of exact weights in a compact form. Indexing it as a tensor (`rows[ids]`,
    `rows[a:b]`) gives fp32 rows; `product(h)` is h @ W^T at full precision, in chunks."""

    def __init__(self, blocks: GroupBlocks | HalfWeights):
        self.blocks = blocks
        self.half = blocks.weight if isinstance(blocks, HalfWeights) else None
        # (codes, scale per 16, min per 32), contiguous, as the native output layer reads them; None for fp16
        self.groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if isinstance(blocks, GroupBlocks):
            self.codes, self.scale, self.mn = (t.contiguous() for t in (blocks.codes, blocks.scale.float(),
                                                                         blocks.mn.float()))
            self.groups = (self.codes, self.scale, self.mn)
            self.shape = tuple(blocks.codes.shape)
        else:
            self.shape = tuple(blocks.weight.shape)
        assert self.shape[1] % 32 == 0

    @property
    def type_name(self) -> str:
        return self.blocks.type_name

    def nbytes(self) -> int:
        if self.half is not None:
            return self.half.numel() * 2
        return self.codes.numel() + (self.scale.numel() + self.mn.numel()) * 4

    def __getitem__(self, index: torch.Tensor | slice) -> torch.Tensor:
        """fp32 rows: `index` a tensor of row ids (any shape: the result adds a last dimension K) or a slice."""
        if isinstance(index, slice):
            return self._expand(index)
        flat = index.reshape(-1).long()
        return self._expand(flat).view(*index.shape, self.shape[1])

    def _expand(self, index: torch.Tensor | slice, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.half is not None:
            h = self.half[index]
            return h.float() if out is None else out.copy_(h)
        codes = self.codes[index]
        n, k = codes.shape
        w = torch.empty(n, k) if out is None else out
        w.copy_(codes)
        w.view(n, k // 16, 16).mul_(self.scale[index][..., None])
        w.view(n, k // 32, 32).add_(self.mn[index][..., None])
        return w

    def product(self, h: torch.Tensor, chunk_rows: int = CHUNK_ROWS, threads: int = 0) -> torch.Tensor:
        """h [B, K] @ W^T at full precision -> [B, V] fp32. A few rows of h (a decode step's logprobs), with
        `threads` for the native kernels: each row of W expanded once and multiplied natively. Otherwise
        `chunk_rows` rows of W at a time into one reused buffer, then a GEMM. No full-size fp32 copy, ever."""
        h = h.float()
        if threads and self.groups is not None and h.shape[0] <= NATIVE_MAX_ROWS:
            return cpu_kernels.group_rows_product(h, *self.groups, threads)
        v, k = self.shape
        out = torch.empty(h.shape[0], v)
        buf = torch.empty(min(chunk_rows, v), k)
        for a in range(0, v, chunk_rows):
            b = min(a + chunk_rows, v)
            w = self._expand(slice(a, b), buf[:b - a])
            out[:, a:b] = h @ w.T
        return out
