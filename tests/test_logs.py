"""One log stream: in JSON mode every line a service writes is one JSON object, whoever logged it
(structlog, uvicorn, transformers, warnings.warn), with the same `timestamp` and `level` keys."""

from __future__ import annotations

import json
import logging
import re
import sys
import warnings

import huggingface_hub.utils
import pytest
import structlog

from specdec.serving import logs


@pytest.fixture
def restored():
    """configure() changes process-wide logging: put back what the rest of the suite runs with."""
    from transformers.utils import logging as hf_logging

    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    uvicorn = {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).propagate) for name in logs.UVICORN_LOGGERS}
    hf_logging.get_logger()
    hf_root = logging.getLogger("transformers")
    hf_handlers, hf_propagate = list(hf_root.handlers), hf_root.propagate
    bars = hf_logging.is_progress_bar_enabled(), huggingface_hub.utils.are_progress_bars_disabled()
    yield
    sys.excepthook = sys.__excepthook__
    if bars[0]:
        hf_logging.enable_progress_bar()
    if not bars[1]:
        huggingface_hub.utils.enable_progress_bars()
    structlog.configure(**config)
    root.handlers[:], root.level = handlers, level
    for name, (own, propagate) in uvicorn.items():
        logging.getLogger(name).handlers[:], logging.getLogger(name).propagate = own, propagate
    hf_root.handlers[:], hf_root.propagate = hf_handlers, hf_propagate
    logging.captureWarnings(False)


def emit_from_everyone() -> None:
    from transformers.utils import logging as hf_logging

    structlog.get_logger("specdec.test").info("structlog line", request_id="r1")
    logging.getLogger("uvicorn.error").warning("uvicorn line %s", "with args")
    logging.getLogger("uvicorn.access").warning("an access line")
    hf_logging.get_logger("transformers.modeling_utils").warning("transformers line")
    logging.getLogger("some.library").error("plain stdlib line")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("some.library").exception("with a traceback")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a warnings.warn line", UserWarning, stacklevel=1)


def test_json_mode_writes_one_json_object_per_line_for_every_logger(capfd, restored):
    from transformers.utils import logging as hf_logging

    logs.configure("json", "info")
    emit_from_everyone()
    for _ in hf_logging.tqdm(range(3), desc="a progress bar"):  # transformers' bars (loading weights): off
        pass
    try:
        raise RuntimeError("the process ends")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())  # what Python calls for an exception nothing caught
    out, err = capfd.readouterr()
    assert out == ""
    lines = err.splitlines()
    records = [json.loads(line) for line in lines]  # raises on any plain-text line
    events = [r["event"] for r in records]
    assert events[:5] == ["structlog line", "uvicorn line with args", "an access line", "transformers line", "plain stdlib line"]
    assert events[5] == "with a traceback" and "ValueError: boom" in records[5]["exception"]
    assert "a warnings.warn line" in events[6]
    assert records[7]["event"] == "uncaught exception" and records[7]["level"] == "critical"
    assert "RuntimeError: the process ends" in records[7]["exception"]
    assert len(records) == 8
    for record in records:
        assert set(record) >= {"event", "level", "timestamp"}
        assert record["timestamp"].endswith("Z")
    assert [r["level"] for r in records[:5]] == ["info", "warning", "warning", "warning", "error"]
    assert records[0]["request_id"] == "r1" and records[1]["logger"] == "uvicorn.error"
    assert records[3]["logger"] == "transformers.modeling_utils"


def test_console_mode_renders_foreign_lines_like_structlog_ones(capfd, restored):
    logs.configure("console", "info")
    emit_from_everyone()
    lines = re.sub(r"\x1b\[[0-9;]*m", "", capfd.readouterr().err).splitlines()  # without the colours
    own = next(line for line in lines if "structlog line" in line)
    uvicorn = next(line for line in lines if "uvicorn line with args" in line)
    # structlog's console layout: "<timestamp> [<level>] <event> key=value"
    assert own[:4].isdigit() and "[info     ]" in own and "request_id=r1" in own
    assert uvicorn[:4].isdigit() and "[warning  ]" in uvicorn and "[uvicorn.error]" in uvicorn
    assert not any(line.startswith("[transformers]") for line in lines)  # transformers' own handler is off


def test_configure_twice_does_not_double_lines(capfd, restored):
    logs.configure("json", "info")
    logs.configure("json", "warning")
    logging.getLogger("uvicorn.error").warning("once")
    structlog.get_logger().info("filtered out at warning")
    assert [json.loads(line)["event"] for line in capfd.readouterr().err.splitlines()] == ["once"]
