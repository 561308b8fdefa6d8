"""specdec.serving.server.run_service: `specdec serve` runs a service on uvloop unless told otherwise.
(The subprocess tests, tests/test_shutdown.py among them, run real services on it.)"""

from __future__ import annotations

import asyncio
import sys

import pytest

from specdec.serving.config import from_argv
from specdec.serving.server import run_service
from target_service.config import TargetConfig


async def loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_by_default_and_asyncio_when_asked():
    pytest.importorskip("uvloop")  # a dependency everywhere but Windows
    assert TargetConfig().event_loop == "uvloop"
    assert run_service(loop_module()).startswith("uvloop")
    assert run_service(loop_module(), "asyncio").startswith("asyncio")


def test_asyncio_where_uvloop_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now raises ImportError
    assert run_service(loop_module(), "uvloop").startswith("asyncio")


def test_event_loop_flag_and_environment():
    assert from_argv(TargetConfig, [], "SPECDEC_TARGET_", "t", env={"SPECDEC_TARGET_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
    with pytest.raises(SystemExit):
        from_argv(TargetConfig, ["--event-loop", "trio"], "SPECDEC_TARGET_", "t", env={})
