"""Structured logging: readable on a terminal, one JSON object per line elsewhere."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info") -> None:
    """Configure structlog once per process; actors bind role and name on top."""
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if sys.stderr.isatty():
        tail = [structlog.dev.ConsoleRenderer()]  # renders tracebacks itself
    else:
        tail = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=[*shared, *tail],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
