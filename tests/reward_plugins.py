"""Reward functions written the way a user writes them, for the plug-in tests.

Spawned actors import this module by name (the tests put this folder on
PYTHONPATH), exactly as they would import a user's ``--custom-reward``.
"""


async def label_length(response: str, label: str, **metadata) -> float:
    """Async, and uses the label and metadata: len(label) / 10, plus any ``bonus``."""
    return len(label) / 10 + float(metadata.get("bonus", 0.0))


def no_metadata(response: str, label: str) -> float:
    """Breaks the contract: it cannot take metadata keywords."""
    return 0.0


def says_yes(response: str, label: str, **metadata) -> str:
    """Breaks the contract: returns a string."""
    return "yes"
