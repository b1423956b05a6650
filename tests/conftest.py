"""Suite-wide environment, set before anything imports torch or triton.

OMP_WAIT_POLICY=PASSIVE: on a small shared CPU box torch's OpenMP threads otherwise busy-wait between
ops and make small ops up to 100x slower. TRITON_INTERPRET=1 without a GPU: Triton kernels then run on
the CPU (Triton reads it at import, and transformers imports Triton while the suite is collected).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.fixtures.servers import real_gateway, redis_server  # noqa: F401  (session fixtures for every folder)

# What runs a real model, in this process or in servers it starts: under pytest-xdist (`make test` runs
# `-n 2 --dist loadgroup`) each of two groups stays on one worker, in order, so a session fixture's model
# loads once: "servers" (real gateways, workers and their processes) and "engine" (the in-process
# engines of tests/engine). The two run beside each other and the rest (fake engines, unit tests, the
# Triton interpreter) fills in around them; what measures token rates or stalls is marked `serial` and
# runs afterwards, alone.
SERVER_FIXTURES = {"real_gateway"}
ENGINE_FIXTURES = {"engine", "tokenizer", "configured", "embedding_engine", "minilm_reference"}


def _group(item) -> str | None:
    path = item.nodeid.replace("\\", "/")
    fixtures = set(getattr(item, "fixturenames", ()))
    if SERVER_FIXTURES & fixtures or path.startswith("tests/e2e/"):
        return "servers"
    if ENGINE_FIXTURES & fixtures or path.startswith("tests/engine/"):
        return "engine"
    if item.get_closest_marker("model") or item.get_closest_marker("slow"):
        return "servers"
    return None


def pytest_collection_modifyitems(config, items):
    # schemathesis gives every operation's item the test's own node id ("...::test_openai_spec"); xdist
    # schedules by node id, and --dist loadgroup ran one operation of the 18. Each gets its name's id.
    seen: dict[str, int] = {}
    for item in items:
        seen[item.nodeid] = seen.get(item.nodeid, 0) + 1
    for item in items:
        if seen[item.nodeid] > 1 and item.name not in item.nodeid:
            if hasattr(item, "_id"):  # pytest 9: the node id is a structured NodeId
                item._id = item.parent.id.child(item.name)
            else:
                item._nodeid = f"{item.nodeid.rsplit('::', 1)[0]}::{item.name}"
    loadgroup = bool(getattr(config.option, "loadgroup", False))  # set on xdist workers under --dist loadgroup
    for item in items:
        group = _group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
            if loadgroup:
                _suffix_group(item, group)


def _suffix_group(item, group: str) -> None:
    """What xdist's own hook does for an xdist_group mark, for pytest 9: --dist loadgroup schedules by the
    node id's "@group" suffix, and xdist sets `item._nodeid`, which pytest 9 no longer reads (the id is a
    structured NodeId), so every group was split over both workers and its fixtures set up on each."""
    if item.nodeid.endswith("@" + group):
        return
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{group}")
    else:
        item._nodeid = f"{item.nodeid}@{group}"
