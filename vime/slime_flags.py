"""slime's command line on vime: what its flags mean here when that is more than a second name.

Most of slime's flags that vime knows are plain aliases, declared on the setting they name
(``--hf-checkpoint`` is ``--model-path``; ``--help`` lists both), since the meaning is the same.
This module holds the rest, so that what is slime-only lives in one place:

- values whose spelling under slime's name means something else here (``--eps-clip`` alone sets
  both clip bounds in slime; ``--rollout-top-k -1`` is slime's "off", vime's 0).

It leaves out the flags vime does not accept yet (see the README's "Coming from slime"). It imports no
torch: the command line is read before any engine loads.
"""

from __future__ import annotations

import argparse
from typing import Any

from vime.settings import spelling_of


def translate(args: argparse.Namespace, given: dict[str, Any]) -> dict[str, Any]:
    """The settings ``given`` on the command line, with what slime's spellings imply applied: ``--eps-clip`` without
    ``--eps-clip-high`` (or ``--clip-high``) is a symmetric clip, as slime's eps_clip_high defaults to eps_clip; and
    ``--rollout-top-k`` below 0 switches top-k off, which vime spells 0."""
    given = dict(given)
    if spelling_of(args, "clip_low") == "--eps-clip" and "clip_high" not in given:
        given["clip_high"] = given["clip_low"]
    if spelling_of(args, "top_k") == "--rollout-top-k" and given["top_k"] < 0:
        given["top_k"] = 0
    return given
