"""qwen3_4b_gsm8k_tools: qwen3_4b_gsm8k with a calculator the model may call between thoughts.

``python -m vime.scenario qwen3_4b_gsm8k_tools --model-path Qwen3-4B --data gsm8k/train.jsonl
--eval-data gsm8k/test.jsonl``. Everything of ``qwen3_4b_gsm8k`` (GRPO recipe, GSM8K rows, the
``gsm8k`` reward on the final "####" answer), plus the built-in calculator
(``vime.agent.calculator:calculator``) presented through Qwen3's chat template. A response may
call it up to 4 times; each call runs in the sandbox and its result joins the response as a tool
message (trained on by no one: loss mask 0), and a response with its tool messages ends at 2048
tokens. Eval runs with the tool too.
"""

from __future__ import annotations

from vime.config import RunConfig
from vime.scenarios import qwen3_4b_gsm8k
from vime.scenarios.recipes import prepare

DESCRIPTION = "qwen3_4b_gsm8k with the sandboxed calculator tool (multi-turn, --model-path, --data)"

__all__ = ["DESCRIPTION", "defaults", "prepare"]


def defaults() -> RunConfig:
    return qwen3_4b_gsm8k.defaults().replace(
        tool=("vime.agent.calculator:calculator",), max_turns=4, max_response_tokens=2048,
        prompt_template="{prompt} Use the calculator for arithmetic. Let's think step by step and output the final "
                        "answer after \"####\".")
