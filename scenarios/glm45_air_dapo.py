"""glm45_air_dapo: GLM-4.5-Air (MoE, 106B-A12B) learns DAPO-Math-17k with GSPO (a GRPO variant).

``python -m vime.scenario glm45_air_dapo --model-path GLM-4.5-Air
--data dapo_math_17k.jsonl --eval-data aime-2024.jsonl``. Rows, prompt and
reward as in ``qwen3_30b_a3b_dapo``. Responses end at the model's own EOS
ids, read from its generation_config.json (for GLM-4.5: 151329, 151336,
151338, the ids slime's script passes by hand).

Recipe: the community GLM-4.5-Air launcher for slime
(``run-glm4.5-106B-A12B.sh``, a copy of slime's ``run-glm4.5-355B-A32B.sh``
with Air's sizes): 32 prompts x 8 responses of up to 32768 tokens, four
optimizer steps per batch (global batch 64), GSPO (group advantages as in
GRPO, one clipped ratio per response: ``--ratio-level sequence``, clip
1e-4 / 2e-4), truncated importance sampling (``--off-policy-correction
tis``, cap 2), groups whose rewards are all equal dropped and replaced
(dynamic sampling), eval every 20 steps with 8 responses per prompt at
top-p 0.7. ``--ratio-level token --clip-low 0.2 --clip-high 0.28`` makes it
the Qwen3 scripts' token-level GRPO. Departures: the launcher runs 30000
steps, slime's own GLM-4.5 script 3000, as here; the reward is ``math`` (see
``qwen3_30b_a3b_dapo``).
"""

from __future__ import annotations

from vime.config import RunConfig
from vime.scenarios.recipes import DAPO_TEMPLATE, prepare, slime_grpo

DESCRIPTION = "GLM-4.5-Air (MoE) learns DAPO-Math-17k with GSPO (--model-path, --data, --eval-data)"

__all__ = ["DESCRIPTION", "defaults", "prepare"]


def defaults() -> RunConfig:
    return slime_grpo(input_key="problem", label_key="answer", reward="math", prompt_template=DAPO_TEMPLATE,
                      rollout_batch_size=32, group_size=8, max_new_tokens=32768, updates_per_step=4,
                      ratio_level="sequence", clip_low=1e-4, clip_high=2e-4, off_policy_correction="tis",
                      tis_cap=2.0, dynamic_sampling=True,
                      eval_samples=8, eval_top_p=0.7, eval_max_new_tokens=32768)
