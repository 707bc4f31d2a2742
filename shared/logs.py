"""Logging set-up shared by every service: one line per record, service and instance named."""

from __future__ import annotations

import logging
import sys


def setup_logging(service: str, instance: str, level: str = "info") -> None:
    fmt = f"%(asctime)s %(levelname)s {service}[{instance}] %(name)s: %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiohttp.access", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
