"""Scores of a weight version on held-out prompts: the ``eval/*`` metrics.

Each eval prompt gets ``k`` responses (``--eval-samples``). A response is
right when its reward is at least 1 -- the built-in checkers give 1 for a
right answer and 0 otherwise -- and the metrics are:

* ``eval/pass@1``: the chance that one response is right (the mean over
  prompts of right/k, the unbiased estimate from k samples);
* ``eval/mean@k``: the mean reward over all k responses of every prompt
  (equal to pass@1 for 0/1 rewards; it also counts partial credit);
* ``eval/pass@k`` (k > 1): the share of prompts with a right response
  among their k;
* ``eval/response_len``, ``eval/truncated`` (share cut at the length limit),
  ``eval/prompts``, ``eval/weight_version``, and ``eval/newer_tokens``: the
  share of tokens sampled by weights newer than the version evaluated (in an
  asynchronous run the rollout workers may move on while an eval group is
  being generated; 0 means the figures are exactly those of that version).

When the rows carry a ``data_source`` with more than one value (MATH-500
and AIME in one file, say), pass@1 and mean@k are also given per source, as
``eval/SOURCE/pass@1``.
"""

from __future__ import annotations

import statistics
from typing import Any

from vime.config import RunConfig
from vime.data import load_rows
from vime.messages.pipeline import Sample


def eval_metrics(groups: list[list[Sample]], version: int) -> dict[str, float]:
    """The ``eval/*`` metrics of version ``version`` from every eval prompt's scored samples."""
    metrics = {"eval/weight_version": float(version), "eval/prompts": float(len(groups)),
               **_scores(groups, "eval")}
    samples = [sample for group in groups for sample in group]
    tokens = [v for sample in samples for v in sample.versions]
    metrics["eval/response_len"] = statistics.fmean(len(s.response_ids) for s in samples)
    metrics["eval/truncated"] = statistics.fmean(s.finish_reason == "length" for s in samples)
    metrics["eval/newer_tokens"] = sum(v > version for v in tokens) / max(1, len(tokens))
    sources = sorted({str(group[0].metadata.get("data_source")) for group in groups
                      if "data_source" in group[0].metadata})
    if len(sources) > 1:
        for source in sources:
            chosen = [group for group in groups if str(group[0].metadata.get("data_source")) == source]
            metrics.update(_scores(chosen, f"eval/{source}", with_pass_k=False))
    return metrics


def _scores(groups: list[list[Sample]], prefix: str, with_pass_k: bool = True) -> dict[str, Any]:
    k = len(groups[0])
    right = [[_right(sample.reward) for sample in group] for group in groups]
    scores = {f"{prefix}/pass@1": statistics.fmean(sum(r) / len(r) for r in right),
              f"{prefix}/mean@{k}": statistics.fmean(float(s.reward) for group in groups for s in group)}
    if with_pass_k and k > 1:
        scores[f"{prefix}/pass@{k}"] = statistics.fmean(float(any(r)) for r in right)
    return scores


def _right(reward: float | None) -> bool:
    return reward is not None and reward >= 1.0


def eval_rows(run: RunConfig) -> list[dict[str, Any]]:
    """The held-out prompts of ``--eval-data`` (the first ``--eval-max-prompts``), keys mapped as for training."""
    settings, data = run.eval, run.data
    if not settings.eval_data:
        return []
    rows = load_rows(settings.eval_data, input_key=settings.eval_input_key or data.input_key,
                     label_key=settings.eval_label_key or data.label_key, flag="--eval-data")
    return rows[:settings.eval_max_prompts or None]
