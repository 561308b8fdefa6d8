"""A service's own process settles its heap once serving (specdec/serving/server.py settle_heap): what
start-up left is frozen, so a full collection no longer walks the loaded model's objects. A server
started inside another process (the tests' own) leaves that process's heap alone."""

from __future__ import annotations

import gc
import json

from specdec.serving import server
from specdec_tools import stacks
from tests import tiny
from tests.stack import Stack


def test_settle_heap_freezes_what_is_alive_and_collections_leave_it():
    try:
        kept = [[i] for i in range(20000)]  # tracked and alive, as what a loaded model leaves
        frozen = server.settle_heap()
        # Other tests' server threads may still free a few frozen objects meanwhile: the count can
        # only drop by those, never below what this test keeps alive.
        assert frozen >= len(kept) and len(kept) <= gc.get_freeze_count() <= frozen
        gc.collect()
        assert gc.get_freeze_count() >= len(kept)  # collections skip the permanent generation
    finally:
        gc.unfreeze()  # this is the test process: give its objects back to the collector


def test_a_serve_process_settles_its_heap_and_an_in_process_server_does_not(tmp_path):
    model = tiny.save(tiny.tiny_pair()[0], tmp_path / "target")
    in_process = Stack()
    try:
        in_process.target(model)
        assert gc.get_freeze_count() == 0
    finally:
        in_process.stop()
    own = stacks.Stack(model, tmp_path / "logs")
    try:
        own.start_target()
        own.wait()
    finally:
        own.stop()
    events = [json.loads(line) for path in (tmp_path / "logs").rglob("*") if path.is_file()
              for line in path.read_text().splitlines() if line.startswith("{")]
    settled = [e for e in events if e.get("event") == "heap settled"]
    assert len(settled) == 1 and settled[0]["frozen_objects"] > 10000
