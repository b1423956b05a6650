"""The `auto` dtype: bf16 only where the CPU has bf16 units and a timed matmul confirms they run; on
CUDA always; an explicit dtype as configured."""

from __future__ import annotations

import torch

from engine.embedding import precision


def test_auto_needs_the_units_and_the_measurement(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "cpu_has_bf16_units", lambda: True)
    monkeypatch.setattr(precision, "bf16_measured_faster", lambda hidden=384: True)
    assert precision.resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(precision, "bf16_measured_faster", lambda hidden=384: False)  # units capped or hidden
    assert precision.resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(precision, "cpu_has_bf16_units", lambda: False)
    monkeypatch.setattr(precision, "bf16_measured_faster", lambda hidden=384: 1 / 0)  # not even timed
    assert precision.resolve_dtype("auto", cpu) == torch.float32


def test_cuda_and_explicit_dtypes():
    assert precision.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert precision.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert precision.resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_the_measurement_runs():
    assert isinstance(precision.bf16_measured_faster(hidden=64, rows=32), bool)
