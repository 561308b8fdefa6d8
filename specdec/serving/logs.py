"""structlog set-up shared by every process: JSON lines in services, readable text on a terminal.

Every log line of a request carries its `request_id`, bound with structlog's contextvars when the
request arrives (from the `x-request-id` gRPC metadata between services), so one grep follows a
request across the coordinator, the draft and the target.
"""

from __future__ import annotations

import logging
import sys

import structlog

REQUEST_ID_METADATA = "x-request-id"


def configure(fmt: str = "auto", level: str = "info") -> None:
    """fmt: "json", "console", or "auto" (console on a terminal, JSON otherwise)."""
    if fmt not in ("auto", "json", "console"):
        raise ValueError(f"log format must be auto, json or console, not {fmt!r}")
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer = structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def bind_request(request_id: str, **extra: object) -> None:
    """Tags every following log line of this task (asyncio context) with the request id."""
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id, **extra)
