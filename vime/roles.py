"""Role names and the actor classes behind them.

A role given on our own command line may also be ``package.module:Class``
(a user's actor); roles read from anywhere else -- a message log, say -- are
looked up in :data:`ROLES` only, so nothing received decides what is imported.
"""

from __future__ import annotations

from vime.plugins import import_function
from vime.runtime import Actor

ROLES: dict[str, str] = {
    "buffer": "vime.actors.buffer:Buffer",
    "node": "vime.node:NodeAgent",
    "router": "vime.actors.router:Router",
    "rollout": "vime.actors.rollout:RolloutWorker",
    "reward": "vime.actors.reward:Reward",
    "trainer": "vime.actors.trainer:Trainer",
}


def resolve_role(spec: str, *, allow_import: bool) -> type[Actor]:
    """The Actor subclass for a role name (or ``module:Class`` when allowed)."""
    target = ROLES.get(spec)
    if target is None:
        if not (allow_import and ":" in spec):
            raise LookupError(f"unknown role {spec!r}; built-in roles: {', '.join(sorted(ROLES))}"
                              + ("; or give package.module:Class" if allow_import else ""))
        target = spec
    try:
        cls = import_function(target, "role")
    except ValueError as err:
        raise LookupError(str(err)) from None
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise LookupError(f"{target} is not a vime Actor subclass")
    return cls
