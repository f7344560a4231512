"""qwen3_30b_a3b_dapo: Qwen3-30B-A3B (MoE) learns DAPO-Math-17k with GRPO.

``python -m vime.scenario qwen3_30b_a3b_dapo --model-path Qwen3-30B-A3B
--data dapo_math_17k.jsonl --eval-data aime-2024.jsonl``. The rows are
``{"problem", "answer"}`` (``--input-key``/``--label-key`` map others; a
verl-style Parquet file works with ``--input-key prompt --label-key
reward_model.ground_truth``); the problem goes into DAPO's "Answer:"
instruction (``recipes.DAPO_TEMPLATE``) and the answer is checked by
math-verify (``vime.rewards.math``).

Recipe: slime's ``run-qwen3-30B-A3B.sh``: 32 prompts x 8 responses of up to
8192 tokens, one optimizer step per batch (global batch 256), temperature
0.8, thinking on, eval every 20 steps with 16 responses per prompt of up to
16384 tokens at top-p 0.7. Departures: the reward is math-verify on the
last ``\\boxed{}`` or "Answer:" line, where slime's ``deepscaler`` reward
also requires a closed ``</think>``; rollout routing replay (R3) is on
(``--use-rollout-routing-replay``; the script leaves it off): the rollout's
experts are replayed by the trainer, which keeps an MoE's train/rollout
log-prob gap small. ``--no-use-rollout-routing-replay`` turns it off.

On one host of 8 GPUs, colocated, in slime's layout (its script trains with
tensor parallelism 4 and expert parallelism 8 over two data-parallel
copies): ``--train-backend megatron --rollout-backend vllm --dtype bf16
--actor-num-gpus-per-node 8 --tensor-model-parallel-size 4
--data-parallel-size 2 --expert-model-parallel-size 8 --colocate
--rollout-num-gpus-per-engine 8 --vllm-enable-sleep-mode true`` (each copy's
4 ranks split attention and the vocabulary 4 ways and train half of each
batch's samples; the 8 ranks hold 16 whole experts each; one vLLM engine of
tensor-parallel size 8 shares their GPUs and sleeps while they train; after
each step every rank gathers the new weights a bucket at a time,
``--weight-bucket-mb``, and the engine's worker on the same GPU copies from
it over CUDA IPC). ``--tensor-model-parallel-size 8 --data-parallel-size 1``
is the other layout of 8 ranks (one copy; the same experts per rank). Each
rank keeps about 4 B parameters in bf16 with fp32 masters, fp32 gradients
and Adam state (about 72 GB); where the activations of long responses do not
fit beside them, ``--recompute-activations`` keeps one layer's at a time
(slime's script recomputes every layer) or ``--micro-batch-size`` cuts them.
Neither layout has run on 8 GPUs yet (``bench/RESULTS.md`` has the reduced
model on one).
"""

from __future__ import annotations

from vime.config import RunConfig
from vime.scenarios.recipes import DAPO_TEMPLATE, prepare, slime_grpo

DESCRIPTION = "Qwen3-30B-A3B (MoE) learns DAPO-Math-17k with GRPO (--model-path, --data, --eval-data)"

__all__ = ["DESCRIPTION", "defaults", "prepare"]


def defaults() -> RunConfig:
    return slime_grpo(input_key="problem", label_key="answer", reward="math", prompt_template=DAPO_TEMPLATE,
                      rollout_batch_size=32, group_size=8, max_new_tokens=8192, updates_per_step=1,
                      eval_samples=16, eval_top_p=0.7, eval_max_new_tokens=16384, use_rollout_routing_replay=True)
