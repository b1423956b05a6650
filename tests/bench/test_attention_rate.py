"""bench/attention_rate.py on tiny shapes: its three timings and the overlap ratios are printed, so the
diagnostic cannot rot (no time is asserted)."""

import re

import pytest

from bench import attention_rate
from kernels.cpu import build


def test_attention_rate_prints_the_three_timings_and_the_ratios(capsys):
    if build.load() is None:
        pytest.skip("no native CPU step on this machine (no C compiler)")
    attention_rate.main(["--context", "32", "--batch", "2", "--layers", "2", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "2 sequences x 32 positions, 2 layers" in out
    for name in ("pool", "resident", "read"):
        assert re.search(rf"^  {name} +[0-9.]+ ms +[0-9.]+ GB/s", out, re.M), out
    assert re.search(r"pool / \(resident \+ read\) [0-9.]+; pool / max\(resident, read\) [0-9.]+", out), out


def test_attention_rate_refuses_a_context_that_is_not_whole_blocks():
    with pytest.raises(SystemExit, match="multiple of --block-size"):
        attention_rate.main(["--context", "30"])
