"""Where the project's shared data sits (the Qwen3 tokenizer, GSM8K, DAPO-Math-17k, MATH-500/AIME): tests and
benches use it when it is there and skip, saying so, when it is not. It is never copied into the repository.

``$VIME_SHARED_DATA`` names it; otherwise the first ``shared/data`` folder beside the checkout or above it,
so that a checkout anywhere under the folder that holds ``shared/`` finds it (a clone elsewhere does not).
"""

from __future__ import annotations

import os
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[2]


def shared_data() -> Path:
    """The shared data folder; a path that does not exist when there is none (callers check what they need)."""
    named = os.environ.get("VIME_SHARED_DATA")
    if named:
        return Path(named)
    for folder in _CHECKOUT.parents:
        if (folder / "shared" / "data").is_dir():
            return folder / "shared" / "data"
    return _CHECKOUT.parent / "shared" / "data"
