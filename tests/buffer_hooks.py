"""A custom-rollout hook written the way a user writes one, for the buffer tests."""


def shout_and_skip_sevens(row: dict) -> dict | None:
    """Skips prompts with label 7; asks for 3 samples at temperature 0.5 for the rest."""
    if row["label"] == "7":
        return None
    return {**row, "group_size": 3, "sampling": {"temperature": 0.5}, "hooked": True}
