"""The runtime's own message kinds, for every actor: registration, liveness, errors, status.

Who sends what to whom is in each docstring; the other subsystems' kinds are in the modules beside this one
(``vime.messages``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from vime.transports.records import message

_DIALABLE = re.compile(r"ipc://[^\x00]+|(tls\+)?tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}")


@message
class Register:
    """actor -> driver, once at start (ask): here I am, reach me at ``address``."""

    name: str
    role: str
    address: str
    pid: int
    host: str

    def __post_init__(self) -> None:
        """The driver dials ``address`` to tell everyone the directory: one it cannot dial must not get in."""
        if not self.name:
            raise ValueError("Register.name is empty")
        if not _DIALABLE.fullmatch(self.address):
            raise ValueError(f"Register.address {self.address[:100]!r} is not ipc://PATH or tcp://HOST:PORT "
                             "(tls+tcp://HOST:PORT)")


@message
class Registered:
    """driver -> actor, the answer to Register: the run and the current directory."""

    run_id: str
    directory: dict[str, str]
    heartbeat_s: float
    config: dict[str, Any] | None = None  # the job's settings, for an actor that joined without --config


@message
class Directory:
    """driver -> every actor, whenever one joins or leaves: name -> inbox address."""

    addresses: dict[str, str]


@message
class Heartbeat:
    """actor -> driver, every ``heartbeat_s``: still alive, and how it is doing."""

    name: str
    status: dict[str, Any]


@message
class Shutdown:
    """driver -> actor: finish the message in hand, flush what is queued, exit."""

    reason: str


@message
class StatusQuery:
    """anyone -> actor (ask): counters of traffic and errors, answered with Status."""


@message
class Status:
    """actor -> asker: traffic and error counters, inbox depth, pending asks, and the seconds each part of its
    start-up after registering took, timed where the work happened (``startup``: an engine's build, say;
    ``vime.startup`` gathers them for the run's start-up breakdown)."""

    name: str
    role: str
    counters: dict[str, int]
    errors: dict[str, int]
    inbox_depth: int
    pending_asks: int
    startup: dict[str, float] = dataclasses.field(default_factory=dict)


@message
class ErrorReply:
    """actor -> asker, instead of the normal answer: what went wrong and why."""

    reason: str
    error: str
    kind: str | None = None


@message
class SegmentsFree:
    """actor -> actor that sent it shared-memory tensors: no view of these segments is left."""

    names: list[str]
