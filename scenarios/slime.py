"""slime: a slime launcher's flags, with slime's and Megatron's defaults where they are silent.

``python -m vime.scenario slime --train-backend megatron --rollout-backend vllm <train.py's flags>``: the other
scenarios bring a task's defaults (qwen3_4b_gsm8k: GSM8K's instruction, thinking off, greedy eval, the loss over
tokens; qwen3_30b_a3b_dapo: DAPO's instruction, an eval and a checkpoint every 20 steps), which a slime launcher
does not ask for and would then get without a word. This one starts from what ``train.py`` does with a flag left
out: the prompt row as it is (``--prompt-template '{prompt}'``), Qwen3's thinking as its chat template has it (on),
the loss averaged per response, then over responses (slime without ``--calculate-per-token-loss``), eval sampled
as the rollout is (slime's eval temperature, top-p and top-k default to the rollout's), no eval and no checkpoint
unless ``--eval-interval`` or ``--save-interval`` asks, and Megatron's optimizer defaults (weight decay 0.01,
Adam's beta2 0.999, a linear learning-rate decay over the run), one response per prompt (slime's
``--n-samples-per-prompt`` default; GRPO needs more), and train.py's own: the learning rate 1e-6 (slime resets
Megatron's ``--lr`` to it), GAE's lambda 1.0 (``--lambd``) and the seed 1234. Everything else is vime's default
(``vime.config.RunConfig``); ``--hf-checkpoint`` (``--model-path``) and ``--prompt-data`` (``--data``) are needed.

Which versions these follow (THUDM/slime commits; the copies read carry no dates):

- slime's own defaults, from ``slime/utils/arguments.py`` at 002fa9d: ``--n-samples-per-prompt 1``;
  ``--eval-temperature``, ``--eval-top-p`` and ``--eval-top-k`` unset, so the rollout's; ``--eval-interval`` and
  ``--save-interval`` unset; ``--calculate-per-token-loss`` off; ``--apply-chat-template-kwargs`` empty, so Qwen3's
  template thinks; ``--lr`` 1e-6, ``--lambd`` 1.0, ``--seed`` 1234. The row as it is: ``slime/utils/data.py``
  passes the prompt field to the engine untouched (through the chat template with ``--apply-chat-template``).
- Megatron's, which slime leaves as they are: ``--weight-decay 0.01`` and ``--adam-beta2 0.999`` from
  ``megatron/training/arguments.py``, ``lr_decay_style`` linear from ``megatron/training/config/training_config.py``,
  both of megatron-core 0.19.2 (the version vime installs).
- The launchers ``tests/test_slime_scripts.py`` runs on this scenario and checks against slime's recipe:
  ``scripts/run-qwen3-4B.sh`` at 05a0752 and ``scripts/run-qwen3-30B-A3B.sh`` at 128cb0e (temperature 0.8, eval
  top-p 0.7, 8192 tokens, ...). Those values come from the scripts' flags, not from these defaults.
"""

from __future__ import annotations

from vime.config import RunConfig
from vime.scenarios.recipes import prepare

DESCRIPTION = "a slime launcher's flags with slime's and Megatron's defaults where they are silent (--hf-checkpoint)"

__all__ = ["DESCRIPTION", "defaults", "prepare"]


def defaults() -> RunConfig:
    return RunConfig().replace(prompt_template="{prompt}", enable_thinking=True, loss_aggregation="sequence",
                               eval_temperature=0.0, eval_top_k=-1, eval_top_p=0.0, eval_every=0, save_every=0,
                               weight_decay=0.01, adam_beta2=0.999, lr_schedule="linear", group_size=1, lr=1e-6,
                               lam=1.0, seed=1234)
