"""vime: RL post-training for LLMs on lightweight nng actors.

The public runtime surface is re-exported here; implementations live in the
modules named for what they are (runtime, cluster, messages, transports).
The names load on first use: importing a submodule alone (``vime.config``
to read a command line) does not import the runtime.
"""

import importlib
from typing import Any

_HOMES = {
    "ActorEvent": "vime.cluster",
    "ActorInfo": "vime.cluster",
    "Cluster": "vime.cluster",
    "Actor": "vime.runtime",
    "ActorSettings": "vime.runtime",
    "PeerGone": "vime.runtime",
    "RemoteError": "vime.runtime",
    "handles": "vime.runtime",
    "Envelope": "vime.transports.codec",
    "message": "vime.transports.records",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """Import a public name from its home on first use (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'vime' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
