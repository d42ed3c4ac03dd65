"""Structured logs: one JSON object per line, with request ids and other context as fields.

`log.info("finished", extra={"request_id": rid, "ttft_ms": 12.3})` becomes
{"ts": ..., "level": "INFO", "logger": "router.core", "msg": "finished", "request_id": ..., ...}.
PDSERVE_LOG_FORMAT=text switches to plain lines; PDSERVE_LOG_LEVEL sets the level."""

from __future__ import annotations

import json
import logging
import os
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
               "level": record.levelname, "logger": record.name, "msg": record.getMessage(),
               "pid": record.process}
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str | None = None) -> None:
    handler = logging.StreamHandler()
    if os.environ.get("PDSERVE_LOG_FORMAT", "json") == "text":
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"))
