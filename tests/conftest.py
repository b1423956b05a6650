"""Suite-wide environment, set before anything imports torch or triton.

OMP_WAIT_POLICY=PASSIVE: on a small shared CPU box torch's OpenMP threads otherwise busy-wait between
ops and make small ops up to 100x slower. TRITON_INTERPRET=1 without a GPU: Triton kernels then run on
the CPU (Triton reads it at import, and transformers imports Triton while the suite is collected).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Start-up timings (engine/tuning_cache.py) are kept for this run only, in one folder that the xdist workers
# and every server they start share (they inherit the variable): the first engine of a configuration
# measures, the rest start without (~1.5 s of each native start, ~6 s of a torch-path one), and no run
# reads what another run, or the user's own service, measured.
if "SLUICE_TUNING_CACHE" not in os.environ:
    os.environ["SLUICE_TUNING_CACHE"] = _tuning = tempfile.mkdtemp(prefix="sluice-tuning-")
    atexit.register(shutil.rmtree, _tuning, ignore_errors=True)

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections import Counter

import pytest

from tests.fixtures.servers import real_gateway, redis_server  # noqa: F401  (session fixtures for every folder)

# What runs a real model, in this process or in servers it starts: under pytest-xdist (`make test` runs
# `-n 2 --dist loadgroup`) each group stays on one worker, in order, so a session fixture's model loads
# once: "servers" (the tests of the shared real gateway), "engine" (the in-process engines of
# tests/engine), and one group per module that starts servers of its own (a cluster, a pool, a gateway
# on a full disk), so those modules spread over both workers instead of lining up behind the shared
# gateway's tests. The rest (fake engines, unit tests, the Triton interpreter) fills in around them;
# what measures token rates or stalls is marked `serial` and runs afterwards, alone.
SERVER_FIXTURES = {"real_gateway"}
ENGINE_FIXTURES = {"engine", "torch_engine", "tokenizer", "configured", "torch_configured", "embedding_engine",
                   "minilm_reference"}
# Heavy modules with engines of their own (module fixtures, none of the session ones): a group each, so
# xdist can put them on whichever worker has room instead of lengthening the "engine" group (2 minutes
# of deterministic-mode runs, transformers' reference model).
OWN_GROUP = {"tests/engine/test_deterministic.py", "tests/engine/test_reference.py"}


def _group(item) -> str | None:
    path = item.nodeid.replace("\\", "/")
    file = path.split("::", 1)[0]
    fixtures = set(getattr(item, "fixturenames", ()))
    if SERVER_FIXTURES & fixtures:
        return "servers"
    if file in OWN_GROUP:
        return "engine:" + file.rsplit("/", 1)[-1].removesuffix(".py")
    if ENGINE_FIXTURES & fixtures or path.startswith("tests/engine/"):
        return "engine"
    if path.startswith("tests/e2e/") or item.get_closest_marker("model") or item.get_closest_marker("slow"):
        # Servers of the module's own (module fixtures: a cluster, a pool): the module stays on one worker
        # and the modules spread over the workers.
        return "module:" + file.rsplit("/", 1)[-1].removesuffix(".py")
    return None


def pytest_collection_modifyitems(config, items):
    # schemathesis gives every operation's item the test's own node id ("...::test_openai_spec"); xdist
    # schedules by node id, and --dist loadgroup ran one operation of the 18. Each gets its name's id.
    seen = Counter(item.nodeid for item in items)
    for item in items:
        if seen[item.nodeid] > 1 and item.name not in item.nodeid:
            _set_nodeid(item, f"{item.nodeid.rsplit('::', 1)[0]}::{item.name}")
    # What xdist's own hook does for an xdist_group mark: --dist loadgroup schedules by the node id's
    # "@group" suffix, and xdist sets `item._nodeid`, which pytest 9 no longer reads, so every group was
    # split over both workers and its fixtures set up on each.
    loadgroup = bool(getattr(config.option, "loadgroup", False))  # set on xdist workers under --dist loadgroup
    for item in items:
        group = _group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
            if loadgroup and not item.nodeid.endswith("@" + group):
                _set_nodeid(item, f"{item.nodeid}@{group}")


def _set_nodeid(item, nodeid: str) -> None:
    """pytest 9 keeps a structured NodeId (its string form is the one given); older pytest, a string."""
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid
