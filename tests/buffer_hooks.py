"""A custom-rollout hook written the way a user writes one, for the buffer tests."""


def shout_and_skip_sevens(row: dict) -> dict | None:
    """Skips prompts with label 7; asks for 3 samples, top-k 3, for the rest."""
    if row["label"] == "7":
        return None
    return {**row, "group_size": 3, "sampling": {"top_k": 3}, "hooked": True}


def breaks_sampling(row: dict) -> dict:
    """Returns settings no rollout worker could use (top_p 0) for label 5, fine ones otherwise."""
    return {**row, "sampling": {"top_p": 0.0}} if row["label"] == "5" else row
