"""What the real-model scenarios share: slime's GRPO recipe and its DAPO-Math prompt.

The values follow THUDM/slime's launch scripts (``scripts/run-qwen3-4B.sh``,
``scripts/run-qwen3-30B-A3B.sh``, and the GLM-4.5 script that the community
GLM-4.5-Air launcher copies); each scenario module names what it takes from
which, and where it departs. Not a scenario itself: ``python -m vime.scenario
--list`` shows the scenarios.
"""

from __future__ import annotations

from pathlib import Path

from vime.config import RunConfig

# slime's copy of DAPO-Math-17k carries this instruction in its prompts; the
# rows in ../shared/data (and DAPO's own) hold the bare problem, so it is a template here.
DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the "
                 "form Answer: \\boxed{$Answer} where $Answer is the answer to the problem.\n\n{prompt}\n\n"
                 "Remember to put your answer on its own line after \"Answer:\".")


def slime_grpo(**overrides: object) -> RunConfig:
    """GRPO as slime's Qwen3 scripts run it: lr 1e-6 constant, AdamW (0.9, 0.98) with weight decay 0.1,
    clip 0.2 / 0.28 (clip-higher), no KL or entropy term, the loss averaged per response then over
    responses (slime's default without --calculate-per-token-loss), rollout temperature 0.8, the chat template,
    bf16 rollout over fp32 master weights, an eval and a checkpoint every 20 steps, 3000 steps."""
    return RunConfig().replace(**{
        "algo": "grpo", "lr": 1e-6, "lr_schedule": "constant", "weight_decay": 0.1, "adam_beta1": 0.9,
        "adam_beta2": 0.98, "grad_clip": 1.0, "clip_low": 0.2, "clip_high": 0.28, "kl_loss_coef": 0.0,
        "entropy_coef": 0.0, "loss_aggregation": "sequence", "temperature": 0.8, "top_p": 1.0,
        "chat_template": True, "dtype": "bf16", "eval_every": 20, "save_every": 20, "steps": 3000,
        "micro_batch_size": 4, **overrides})


def prepare(run_dir: Path, config: RunConfig) -> RunConfig:
    """A real-model scenario trains the model it is given; there is no default to fall back on."""
    if not config.model.model_path:
        raise ValueError("pass --model-path: a local Hugging Face folder of the model (config.json, "
                         "*.safetensors, tokenizer files), or a tiny stand-in made with "
                         "python -m vime.devtools.make_tiny_model --arch ARCH --tokenizer TOKENIZER --out DIR")
    return config
