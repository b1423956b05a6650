"""Start-up timings kept between starts: measured once per key, measured again for any other key, and
never trusted from a file that does not hold its key; an engine's second start with the same model and
configuration times nothing and gets the first start's results."""

from __future__ import annotations

import logging
import os

import pytest

from engine.tuning_cache import TuningCache, machine_key


def counting(value):
    calls = []

    def measure():
        calls.append(1)
        return value

    return measure, calls


def test_a_result_is_measured_once_per_key(tmp_path):
    cache = TuningCache(tmp_path)
    measure, calls = counting({"x": 1.5})
    ident = (lambda v: v, lambda v: v)
    assert cache.remember("k", {"a": 1}, measure, *ident) == ({"x": 1.5}, False)
    assert cache.remember("k", {"a": 1}, measure, *ident) == ({"x": 1.5}, True)
    assert TuningCache(tmp_path).remember("k", {"a": 1}, measure, *ident) == ({"x": 1.5}, True)  # another process
    assert len(calls) == 1
    assert cache.remember("k", {"a": 2}, measure, *ident)[1] is False  # another key
    assert cache.remember("other", {"a": 1}, measure, *ident)[1] is False  # another kind
    assert len(calls) == 3


def test_a_broken_or_foreign_file_is_measured_again_and_replaced(tmp_path, caplog):
    cache = TuningCache(tmp_path)
    measure, calls = counting(7)
    cache.remember("k", {"a": 1}, measure, int, int)
    (path,) = tmp_path.glob("k-*.json")
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="engine.tuning_cache"):
        assert cache.remember("k", {"a": 1}, measure, int, int) == (7, False)
    assert "unreadable" in caplog.text
    path.write_text('{"key": {"version": 1, "kind": "k", "a": 99}, "value": 8}')  # a hash collision's shape
    assert cache.remember("k", {"a": 1}, measure, int, int) == (7, False)
    assert cache.remember("k", {"a": 1}, measure, int, int) == (7, True)
    assert len(calls) == 3
    assert not list(tmp_path.glob(".tmp-*"))  # written by rename, nothing left beside


def test_off_no_key_or_an_unwritable_folder_measure_every_time(tmp_path, monkeypatch):
    measure, calls = counting(3)
    monkeypatch.setenv("SLUICE_TUNING_CACHE", "off")
    off = TuningCache.from_env()
    assert off.folder is None
    assert off.remember("k", {"a": 1}, measure, int, int) == (3, False)
    assert TuningCache(tmp_path).remember("k", None, measure, int, int) == (3, False)  # e.g. random weights
    assert not list(tmp_path.iterdir())
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert TuningCache(blocked / "sub").remember("k", {"a": 1}, measure, int, int) == (3, False)
    assert len(calls) == 3
    monkeypatch.delenv("SLUICE_TUNING_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert TuningCache.from_env().folder == tmp_path / "sluice" / "tuning"


def test_the_machine_key_names_the_cpu_and_torch():
    key = machine_key("cpu")
    assert key["cpu"] and len(key["flags"]) == 16 and key["torch"] and key["cores"] == os.cpu_count()


@pytest.mark.model
def test_a_second_engine_start_times_nothing_and_keeps_the_first_starts_results(tmp_path, monkeypatch):
    from engine import EngineConfig, LLMEngine
    from engine.step_cost import StepCost

    monkeypatch.setenv("SLUICE_TUNING_CACHE", str(tmp_path))
    measured = []
    real = StepCost.measure.__func__

    def spy(cls, *a, **kw):
        measured.append(1)
        return real(cls, *a, **kw)

    monkeypatch.setattr(StepCost, "measure", classmethod(spy))
    cfg = EngineConfig(kv_cache_tokens=2048, max_running_requests=4)
    first = LLMEngine(cfg)
    assert len(measured) == 1 and list(tmp_path.glob("step-cost-*.json"))
    second = LLMEngine(cfg)
    assert len(measured) == 1
    assert second.step_cost == first.step_cost and second.step_cost != StepCost()
    kernels = second.runner.kernels
    assert (kernels.wide_min_rows, kernels.amx_min_rows) == (first.runner.kernels.wide_min_rows,
                                                             first.runner.kernels.amx_min_rows)
    # What the timed steps depend on (the block size, the native build, ...) is part of the key.
    key = second.runner._tuning_key(chunk=64)
    assert key is not None and key["block_size"] == 16 and key["native"] == (
        second.runner.model.native.library if second.runner.model.native else None)
