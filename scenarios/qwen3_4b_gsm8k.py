"""qwen3_4b_gsm8k: Qwen3-4B (dense) learns GSM8K grade-school maths with GRPO.

``python -m vime.scenario qwen3_4b_gsm8k --model-path Qwen3-4B --data gsm8k/train.jsonl
--eval-data gsm8k/test.jsonl``. The rows are GSM8K's own (``question``,
``answer`` with the result after "####"); the reward is ``vime.rewards.gsm8k``.

Recipe: slime's ``run-qwen3-4B.sh`` for the GRPO and optimizer settings
(``recipes.slime_grpo``), and slime's GSM8K runs of Qwen3 for the shape:
32 prompts x 8 responses of up to 1024 tokens per step, all in one optimizer
step (global batch 256), the loss averaged over tokens (their
``--calculate-per-token-loss``), greedy eval on the GSM8K test set every 20
steps.
The instruction after the question is verl's GSM8K preprocessing. Departure:
thinking is off (``--no-enable-thinking``), since Qwen3's thinking rarely
ends within 1024 tokens; pass ``--enable-thinking --max-new-tokens 8192`` to
think.
"""

from __future__ import annotations

from vime.config import RunConfig
from vime.scenarios.recipes import prepare, slime_grpo

DESCRIPTION = "Qwen3-4B learns GSM8K with GRPO (--model-path, --data, --eval-data)"

__all__ = ["DESCRIPTION", "defaults", "prepare"]


def defaults() -> RunConfig:
    return slime_grpo(input_key="question", label_key="answer", reward="gsm8k", enable_thinking=False,
                      loss_aggregation="token",
                      prompt_template="{prompt} Let's think step by step and output the final answer after \"####\".",
                      rollout_batch_size=32, group_size=8, max_new_tokens=1024, updates_per_step=1,
                      eval_samples=1, eval_top_k=1, eval_max_new_tokens=1024)
