"""Pooling over packed inputs (no model): mean over each input's own tokens, its first or its last
token, and normalisation, against a per-input loop."""

from __future__ import annotations

import pytest
import torch

from engine.embedding.pooling import pool


@pytest.fixture
def packed():
    torch.manual_seed(0)
    lengths = [3, 1, 5]
    hidden = torch.randn(sum(lengths), 4)
    cu = torch.tensor([0, 3, 4, 9])
    return hidden, cu, [hidden[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]


def test_mean_averages_each_inputs_own_tokens(packed):
    hidden, cu, parts = packed
    torch.testing.assert_close(pool(hidden, cu, "mean", normalize=False), torch.stack([p.mean(0) for p in parts]))


def test_cls_and_lasttoken(packed):
    hidden, cu, parts = packed
    torch.testing.assert_close(pool(hidden, cu, "cls", normalize=False), torch.stack([p[0] for p in parts]))
    torch.testing.assert_close(pool(hidden, cu, "lasttoken", normalize=False), torch.stack([p[-1] for p in parts]))


def test_normalize_gives_unit_vectors_in_the_same_direction(packed):
    hidden, cu, _ = packed
    raw, unit = pool(hidden, cu, "mean", normalize=False), pool(hidden, cu, "mean", normalize=True)
    torch.testing.assert_close(unit.norm(dim=1), torch.ones(3))
    torch.testing.assert_close(unit * raw.norm(dim=1, keepdim=True), raw)
