"""slime's command line on vime: what its flags mean here when that is more than a second name.

Most of slime's flags that vime knows are plain aliases, declared on the setting they name
(``--hf-checkpoint`` is ``--model-path``; ``--help`` lists both), since the meaning is the same.
This module holds the rest, so that what is slime-only lives in one place:

- values whose spelling under slime's name means something else here (``--eps-clip`` alone sets
  both clip bounds in slime; ``--rollout-top-k -1`` is slime's "off", vime's 0);
- Megatron's and slime's flags that are no setting of vime's (:data:`LAYOUT_FLAGS`): accepted where
  they ask for what vime does anyway (``--pipeline-model-parallel-size 1``, ``--sequence-parallel``),
  and otherwise refused together, in one message naming what vime lacks for each, so that a
  launcher learns everything it must drop at once;
- the SGLang server flags slime passes as ``--sglang-NAME`` (:data:`SGLANG_FLAGS`): vime's engines are
  vLLM's, so the common ones become the vLLM engine argument or the vime setting that does the same,
  with a note where the two differ, and the others are refused together, each with what to pass instead.

It leaves out the flags vime does not know at all (argparse refuses them; see the README's "Coming
from slime"). It imports no torch: the command line is read before any engine loads.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

from vime.settings import flag_values, spelling_of


def translate(args: argparse.Namespace, given: dict[str, Any], current: Callable[[str], Any]) -> dict[str, Any]:
    """The settings ``given`` on the command line, with what slime's spellings imply applied (``current(name)``: a
    setting's value, given or the scenario's):

    - ``--eps-clip`` without ``--eps-clip-high`` (or ``--clip-high``) is a symmetric clip, as slime's
      eps_clip_high defaults to eps_clip;
    - ``--rollout-top-k`` below 0 switches top-k off, which vime spells 0;
    - ``--global-batch-size N``, slime's samples per optimizer step, is checked against a step's samples
      (``--rollout-batch-size`` x ``--group-size``) over ``--updates-per-step``, or gives ``--updates-per-step``
      when that is not given, as slime derives its steps per rollout;
    - with slime's KL spelling on the command line (``--use-kl-loss`` or ``--kl-loss-type``), the KL loss is on only
      with ``--use-kl-loss`` (slime ignores ``--kl-loss-coef`` without it), and its estimator defaults to slime's k1;
    - ``--optimizer adam`` is vime's AdamW (Megatron's adam decays weights decoupled, as AdamW does); others are
      refused.

    ValueError naming the numbers when they do not agree."""
    given = dict(given)
    if spelling_of(args, "clip_low") == "--eps-clip" and "clip_high" not in given:
        given["clip_high"] = given["clip_low"]
    if spelling_of(args, "top_k") == "--rollout-top-k" and given["top_k"] < 0:
        given["top_k"] = 0
    optimizer = getattr(args, "slime_optimizer", None)
    if optimizer not in (None, "adam"):
        raise ValueError(f"--optimizer {optimizer}: vime trains with AdamW only, which is Megatron's adam (weight "
                         "decay decoupled from the gradient); pass --optimizer adam or leave it out")
    use_kl_loss = bool(getattr(args, "slime_use_kl_loss", None))
    if use_kl_loss or spelling_of(args, "kl_estimator") == "--kl-loss-type":
        if not use_kl_loss:
            given["kl_loss_coef"] = 0.0
        given.setdefault("kl_estimator", "k1")
    batch = getattr(args, "slime_global_batch_size", None)
    if batch is not None:
        given.update(_updates_per_step(batch, given, current))
    return given


def _updates_per_step(batch: int, given: dict[str, Any], current: Callable[[str], Any]) -> dict[str, int]:
    """``--global-batch-size batch`` as vime's ``updates_per_step``; ValueError naming the numbers."""
    prompts, group = current("rollout_batch_size"), current("group_size")
    samples = prompts * group
    spelled = f"--rollout-batch-size {prompts} x --n-samples-per-prompt {group} = {samples} samples"
    if batch < 1 or samples % batch:
        raise ValueError(f"--global-batch-size {batch}: a step trains {spelled}, which does not split into optimizer "
                         f"steps of {batch}; pass a divisor of {samples} ({samples}: one optimizer step per rollout)")
    if "updates_per_step" in given and given["updates_per_step"] * batch != samples:
        updates = given["updates_per_step"]
        raise ValueError(f"--global-batch-size {batch} x --num-steps-per-rollout {updates} = {batch * updates} "
                         f"samples, but a step trains {spelled}: pass --global-batch-size {samples // updates} "
                         "or leave one of the two out")
    return {"updates_per_step": samples // batch}


@dataclasses.dataclass(frozen=True)
class LayoutFlag:
    """A flag of Megatron's or slime's that is no setting of vime's: accepted with the one value that asks for what
    vime does anyway, refused with any other."""

    flag: str
    missing: str  # what vime lacks to honour another value
    accepted: int | bool | None = None  # the value vime runs as it is; None: none is (a switch is refused when given)
    number: bool = False  # the flag takes a number (else it is a switch)


_TOKEN_BUDGET = "micro-batches packed to a token budget; vime's hold --micro-batch-size samples"
_OFFLOAD = "offloading of the optimizer state to the CPU"
_OWN_GPUS = "PPO's value model on GPUs of its own; it trains on the policy's ranks"
LAYOUT_FLAGS = (
    LayoutFlag("--pipeline-model-parallel-size", "pipeline parallelism", accepted=1, number=True),
    LayoutFlag("--context-parallel-size", "context parallelism", accepted=1, number=True),
    LayoutFlag("--sequence-parallel", "", accepted=True),  # vime's tensor parallelism always shards the sequence
    LayoutFlag("--use-dynamic-batch-size", _TOKEN_BUDGET),
    LayoutFlag("--max-tokens-per-gpu", _TOKEN_BUDGET, number=True),
    LayoutFlag("--optimizer-cpu-offload", _OFFLOAD),
    LayoutFlag("--overlap-cpu-optimizer-d2h-h2d", _OFFLOAD),
    LayoutFlag("--use-precision-aware-optimizer", "Transformer Engine's precision-aware optimizer"),
    LayoutFlag("--moe-enable-deepep", "DeepEP's expert dispatch"),
    LayoutFlag("--critic-num-nodes", _OWN_GPUS, number=True),
    LayoutFlag("--critic-num-gpus-per-node", _OWN_GPUS, number=True),
)


def add_layout_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of :data:`LAYOUT_FLAGS` on ``parser``, in a group of their own."""
    group = parser.add_argument_group("slime's and Megatron's flags that are no vime setting (any value but the "
                                      "one shown is refused, naming what vime lacks)")
    for layout in LAYOUT_FLAGS:
        if layout.accepted is True:
            meaning = "accepted: vime's tensor parallelism always shards the sequence"
        elif layout.accepted is None:
            meaning = f"refused (vime lacks {layout.missing})"
        else:
            meaning = f"{layout.accepted} only (vime lacks {layout.missing})"
        if layout.number:
            group.add_argument(layout.flag, dest=_dest(layout), type=int, default=None, metavar="N", help=meaning)
        else:
            group.add_argument(layout.flag, dest=_dest(layout), action="store_true", default=None, help=meaning)


def add_translated_flags(parser: argparse.ArgumentParser) -> None:
    """slime's flags that are no setting of vime's but translate into some (:func:`translate`)."""
    group = parser.add_argument_group("slime's flags translated into vime's settings")
    group.add_argument("--global-batch-size", dest="slime_global_batch_size", type=int, default=None, metavar="N",
                       help="slime's samples per optimizer step: a step's --rollout-batch-size x --group-size samples "
                            "are trained in mini-batches of N (--updates-per-step derived, or checked when given)")
    group.add_argument("--use-kl-loss", dest="slime_use_kl_loss", action="store_true", default=None,
                       help="slime's switch of the KL loss: with it or --kl-loss-type given, --kl-loss-coef applies "
                            "only when it is there too, as in slime, and --kl-loss-type defaults to k1")
    group.add_argument("--optimizer", dest="slime_optimizer", default=None, metavar="adam",
                       help="adam only: vime's AdamW is Megatron's adam, whose weight decay is decoupled too, so "
                            "--weight-decay, --adam-beta1 and --adam-beta2 mean the same")


def refuse_missing_features(args: argparse.Namespace, given: dict[str, Any]) -> None:
    """ValueError naming, in one message, every flag given that asks for something vime lacks: the
    :data:`LAYOUT_FLAGS` with another value than vime's, and a trainer on several hosts (``--actor-num-nodes``)."""
    refused: dict[str, list[str]] = {}  # what is missing: the flags that ask for it, as given
    if given.get("actor_num_nodes", 1) > 1:
        refused["a trainer on several hosts; rollout workers on other hosts join with RUN_DIR/join"] = [
            f"--actor-num-nodes {given['actor_num_nodes']}"]
    for layout in LAYOUT_FLAGS:
        value = getattr(args, _dest(layout), None)
        if value is not None and value != layout.accepted:
            refused.setdefault(layout.missing, []).append(layout.flag if value is True else f"{layout.flag} {value}")
    if refused:
        listed = "; ".join(f"{', '.join(flags)} ({missing})" for missing, flags in refused.items())
        raise ValueError(f"vime does not have what these flags ask for yet: {listed}. Leave them out (the run then "
                         "differs from slime's in what they change)")


def _dest(layout: LayoutFlag) -> str:
    return "slime_" + layout.flag.removeprefix("--").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class SglangFlag:
    """An SGLang server flag as slime passes it, ``--sglang-NAME``, and vime's flag that does the same."""

    instead: str | None  # vime's flag (``--vllm-*`` or a setting's) taking the same values; None: dropped
    note: str = ""  # where the two differ, or what vime does instead when dropped
    only: str | None = None  # the one value accepted (then dropped: it asks for what vime does); others refused


_NO_DP_ATTENTION = ("attention data parallelism inside an engine: a vime engine is one vLLM engine, tensor parallel "
                    "over --rollout-num-gpus-per-engine GPUs; drop it, or run more engines of fewer GPUs each")
_ROUTER = "slime's SGLang router: vime's router is an actor of its own, with nothing to address; drop it"
SGLANG_FLAGS = {
    "mem-fraction-static": SglangFlag(
        "--vllm-gpu-memory-utilization", "the two fractions differ slightly: SGLang's covers the weights and the KV "
        "cache, vLLM's the whole engine (activations and CUDA graphs too), so the same value leaves vLLM a little "
        "less KV cache"),
    "cuda-graph-bs": SglangFlag("--vllm-cudagraph-capture-sizes",
                                "vLLM captures no batch size above --rollout-max-batch-size (its max_num_seqs)"),
    "cuda-graph-max-bs": SglangFlag("--vllm-max-cudagraph-capture-size"),
    "max-running-requests": SglangFlag("--rollout-max-batch-size", "the sequences one engine decodes together "
                                                                   "(vLLM's max_num_seqs)"),
    "context-length": SglangFlag("--vllm-max-model-len"),
    "disable-cuda-graph": SglangFlag("--vllm-enforce-eager"),
    "server-concurrency": SglangFlag(
        None, "slime's client-side cap on the requests in flight to each engine; vime's workers send no requests: "
        "each decodes at most --rollout-max-batch-size sequences at once and takes --rollout-capacity groups at a "
        "time, so set those instead"),
    "enable-dp-attention": SglangFlag(None, _NO_DP_ATTENTION, only="no"),
    "dp-size": SglangFlag(None, _NO_DP_ATTENTION, only="1"),
    "ep-size": SglangFlag(None, "an expert-parallel size inside an engine: vLLM takes none; "
                                "--vllm-enable-expert-parallel true shards the experts over all the engine's GPUs",
                          only="1"),
}
_SGLANG_INSTEAD = {  # the flags refused with a pointer: vime's way to ask for the same
    "chunked-prefill-size": "--vllm-max-num-batched-tokens N (for -1: --vllm-enable-chunked-prefill false)",
    "tp-size": "--rollout-num-gpus-per-engine",
    "tensor-parallel-size": "--rollout-num-gpus-per-engine",
    "random-seed": "--seed",
    "enable-memory-saver": "--colocate with --vllm-enable-sleep-mode true",
}


def sglang_flags(tokens: list[str]) -> tuple[list[str], list[str]]:
    """The command line with slime's ``--sglang-*`` flags replaced by vime's that do the same
    (:data:`SGLANG_FLAGS`), and a note for each one replaced or dropped. A ValueError names, in one message,
    every ``--sglang-*`` flag with no replacement and what to pass instead (a ``--vllm-*`` engine argument), and
    one whose replacement is given as well (two values for one setting).
    Values are the tokens up to the next flag, as slime's parser reads ``--sglang-cuda-graph-bs 1 2 4``."""
    rest, notes, refused, replaced = [], [], [], {}
    index = 0
    while index < len(tokens):
        if not tokens[index].startswith("--sglang-"):
            rest.append(tokens[index])
            index += 1
            continue
        flag, values, index = flag_values(tokens, index)
        name = flag.removeprefix("--sglang-")
        spelled = " ".join([flag, *values])
        known = SGLANG_FLAGS.get(name)
        if known is None:
            instead = _SGLANG_INSTEAD.get(name, "the vLLM engine argument that does the same, as --vllm-NAME")
            refused.append(f"{spelled} ({_ROUTER})" if name.startswith("router-") else f"{spelled} (pass {instead})")
        elif known.only is not None:
            if " ".join(values or ["yes"]) != known.only:
                refused.append(f"{spelled} ({known.note})")
        elif known.instead is None:
            notes.append(f"{spelled} is dropped: {known.note}")
        else:
            rest += [known.instead, *values]
            replaced[known.instead] = spelled
            notes.append(f"{spelled} runs as {' '.join([known.instead, *values])}" +
                         (f"; {known.note}" if known.note else ""))
    refused += [f"{spelled} (given as {instead} too: pass one of them)" for instead, spelled in replaced.items()
                if sum(token.partition("=")[0] == instead for token in rest) > 1]
    if refused:
        raise ValueError(f"these SGLang flags are refused: {'; '.join(refused)}. vime's rollout "
                         "engines are vLLM's: vLLM's engine arguments are passed as --vllm-NAME VALUE")
    return rest, notes
