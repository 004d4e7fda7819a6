"""Structured JSON logs: one object per line, never the token or the state text."""

from __future__ import annotations

import json
import logging
import sys
import time

_BLANK = logging.LogRecord(name="", level=0, pathname="", lineno=0, msg="", args=(), exc_info=None)
RESERVED = set(vars(_BLANK)) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: time, level, logger, message and any `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update({k: v for k, v in vars(record).items() if k not in RESERVED})
        if record.exc_info and record.exc_info[0] is not None:
            line["exception"] = record.exc_info[0].__name__
        return json.dumps(line, default=str)


def configure_logging(level: str = "INFO") -> None:
    """Send every logger (ours, uvicorn's, transformers') through the JSON formatter on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
