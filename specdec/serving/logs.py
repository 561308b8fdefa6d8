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


# uvicorn's loggers, which carry handlers of their own once any log_config was applied (start_http
# passes none; these cover a uvicorn configured elsewhere in the process). Their lines must come out
# through the one handler below instead.
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class _Handler(logging.StreamHandler):
    """The one handler every line leaves through (its own class, so a second `configure` finds it)."""


def configure(fmt: str = "auto", level: str = "info") -> None:
    """fmt: "json", "console", or "auto" (console on a terminal, JSON otherwise).

    structlog's lines and the standard library's (uvicorn, transformers, warnings, any other
    library) leave through one handler on the root logger, rendered by structlog's
    ProcessorFormatter: in JSON mode every line of stderr is one JSON object with the same
    `timestamp` and `level` keys, whoever logged it.
    """
    if fmt not in ("auto", "json", "console"):
        raise ValueError(f"log format must be auto, json or console, not {fmt!r}")
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    # ConsoleRenderer prints exceptions itself; JSON needs them rendered into a string first.
    render = [structlog.dev.ConsoleRenderer()] if use_console else [structlog.processors.format_exc_info,
                                                                   structlog.processors.JSONRenderer()]
    stamp = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *stamp,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    handler = _Handler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        # Lines from the standard library get what structlog's own lines got before reaching here.
        foreign_pre_chain=[structlog.contextvars.merge_contextvars, structlog.stdlib.add_logger_name, *stamp],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:  # replaced, not doubled, on a second call
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        for own in list(logger.handlers):
            logger.removeHandler(own)
        logger.propagate = True
    _route_transformers(progress_bars=use_console)
    logging.captureWarnings(True)  # warnings.warn's lines too (torch's, transformers')
    sys.excepthook = _log_uncaught  # and the traceback of an exception that ends the process


def _log_uncaught(kind, value, traceback) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, traceback)
        return
    logging.getLogger("specdec").critical("uncaught exception", exc_info=(kind, value, traceback))


def _route_transformers(progress_bars: bool) -> None:
    """transformers writes plain text through a handler of its own, with propagation off; it and
    huggingface_hub also draw tqdm bars (loading weights, converting a GGUF), which a JSON stream
    cannot hold."""
    import huggingface_hub.utils
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger()  # adds that handler now if not yet, so it is there to take off
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    if not progress_bars:
        hf_logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()


def bind_request(request_id: str, **extra: object) -> None:
    """Tags every following log line of this task (asyncio context) with the request id."""
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id, **extra)
