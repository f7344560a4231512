"""slime's command line on vime: what its flags mean here when that is more than a second name.

Most of slime's flags that vime knows are plain aliases, declared on the setting they name
(``--hf-checkpoint`` is ``--model-path``; ``--help`` lists both), since the meaning is the same.
This module holds the rest, so that what is slime-only lives in one place:

- values whose spelling under slime's name means something else here (``--eps-clip`` alone sets
  both clip bounds in slime; ``--rollout-top-k -1`` is slime's "off", vime's 0);
- Megatron's and slime's flags that are no setting of vime's (:data:`LAYOUT_FLAGS`): accepted where
  they ask for what vime does anyway (``--context-parallel-size 1``, ``--sequence-parallel``),
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
from pathlib import Path
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
    - ``--calculate-per-token-loss`` is ``--loss-aggregation token``;
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
    if getattr(args, "slime_use_tis", None):
        given.update(_tis(given))
    if getattr(args, "slime_calculate_per_token_loss", None):
        if given.get("loss_aggregation", "token") != "token":
            raise ValueError(f"--calculate-per-token-loss is vime's --loss-aggregation token, but --loss-aggregation "
                             f"{given['loss_aggregation']} is given too: pass one of them")
        given["loss_aggregation"] = "token"
    given.update(_recompute(args))
    given.update(_reward(getattr(args, "slime_rm_type", None), given))
    given.update(_eval_sets(getattr(args, "slime_eval_prompt_data", None), given))
    return given


def _tis(given: dict[str, Any]) -> dict[str, str]:
    """slime's ``--use-tis``: truncated importance sampling against the rollout's log-probs, weights in
    [--tis-clip-low, --tis-clip] (slime's defaults 0 and 2, vime's too), which is vime's --off-policy-correction tis;
    ValueError when another correction is asked for beside it."""
    if given.get("off_policy_correction", "tis") != "tis":
        raise ValueError(f"--use-tis is vime's --off-policy-correction tis, but --off-policy-correction "
                         f"{given['off_policy_correction']} is given too: pass one of them")
    return {"off_policy_correction": "tis"}


_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _recompute(args: argparse.Namespace) -> dict[str, bool]:
    """Megatron's recomputation flags as vime's ``--recompute-activations``, which is Megatron's full, uniform
    recomputation of one layer per checkpoint; any other value is refused naming what vime does."""
    spelled = {name: getattr(args, f"slime_{name}", None) for name in _RECOMPUTE}
    if all(value is None for value in spelled.values()):
        return {}
    wrong = [f"--{name.replace('_', '-')} {value}" for name, value in spelled.items()
             if value is not None and value != _RECOMPUTE[name]]
    if wrong or spelled["recompute_granularity"] is None:
        asked = ", ".join(wrong) or "--recompute-method/--recompute-num-layers without --recompute-granularity"
        raise ValueError(f"{asked}: vime recomputes whole layers, one per checkpoint (Megatron's "
                         "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1, which is "
                         "vime's --recompute-activations); pass those, or leave the --recompute-* flags out to keep "
                         "every activation")
    return {"recompute_activations": True}


# slime's --rm-type and vime's built-in reward doing the same; the others refused with what to pass
RM_TYPES = {"math": "math", "deepscaler": "deepscaler", "gsm8k": "gsm8k"}
_RM_INSTEAD = {
    "dapo": "--reward math (math-verify reads DAPO's \"Answer:\" line too; slime's dapo scores a wrong answer -1 where "
            "vime's scores 0: GRPO's group-normalised advantages are the same, eval means are not)",
    "remote_rm": "--custom-rm-path module.function, a custom_rm(args, sample) calling your reward server",
}


def _reward(rm_type: str | None, given: dict[str, Any]) -> dict[str, str]:
    """slime's ``--rm-type`` as vime's ``--reward``; ValueError for one vime has not, saying what to pass."""
    if rm_type is None:
        return {}
    if rm_type not in RM_TYPES:
        instead = _RM_INSTEAD.get(rm_type, "--reward NAME, a built-in of vime.rewards, or --custom-rm-path "
                                           "module.function (slime's custom_rm(args, sample))")
        raise ValueError(f"--rm-type {rm_type}: vime has no such reward; pass {instead}. --rm-type takes "
                         f"{', '.join(RM_TYPES)}")
    if given.get("reward", RM_TYPES[rm_type]) != RM_TYPES[rm_type]:
        raise ValueError(f"--rm-type {rm_type} is vime's --reward {RM_TYPES[rm_type]}, but --reward "
                         f"{given['reward']} is given too: pass one of them")
    return {"reward": RM_TYPES[rm_type]}


def _eval_sets(pairs: list[str] | None, given: dict[str, Any]) -> dict[str, str]:
    """slime's ``--eval-prompt-data NAME PATH`` as vime's ``--eval-data PATH``. Several sets are refused: vime
    evaluates one file, and gives per-set metrics from its rows' ``data_source``; slime's NAME only names its
    metrics (vime's are ``eval/pass@1``, ... without it)."""
    if pairs is None:
        return {}
    if len(pairs) != 2:
        raise ValueError(f"--eval-prompt-data {' '.join(pairs)}: vime takes one NAME PATH pair: it evaluates one file "
                         "(--eval-data), with pass@1 and mean@k per set when its rows carry a data_source field; "
                         "put the sets in one JSONL, each row's data_source its set's name, and pass that")
    if "eval_data" in given:
        raise ValueError(f"--eval-prompt-data {' '.join(pairs)} is vime's --eval-data {pairs[1]}, but --eval-data "
                         "is given too: pass one of them")
    return {"eval_data": pairs[1]}


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
    note: str = ""  # for a switch accepted: why what vime does is what it asks for
    text: bool = False  # the flag takes a text value (refused whatever it is)


_OFFLOAD = "offloading of the optimizer state to the CPU"
_WANDB = "logging to Weights & Biases; vime's metrics go to RUN_DIR/metrics.jsonl and RUN_DIR/tensorboard"
_OWN_GPUS = "PPO's value model on GPUs of its own; it trains on the policy's ranks"
LAYOUT_FLAGS = (
    LayoutFlag("--context-parallel-size", "context parallelism", accepted=1, number=True),
    LayoutFlag("--sequence-parallel", "", accepted=True, note="vime's tensor parallelism always shards the sequence"),
    LayoutFlag("--rollout-shuffle", "", accepted=True,
               note="vime always draws the prompts in an order shuffled anew each epoch from --seed"),
    LayoutFlag("--balance-data", "", accepted=True,
               note="slime's balancing of tokens among data-parallel ranks moves samples between ranks, not "
                    "what a step's gradient sums; vime splits a mini-batch's samples evenly among the copies"),
    LayoutFlag("--optimizer-cpu-offload", _OFFLOAD),
    LayoutFlag("--overlap-cpu-optimizer-d2h-h2d", _OFFLOAD),
    LayoutFlag("--use-precision-aware-optimizer", "Transformer Engine's precision-aware optimizer"),
    LayoutFlag("--moe-enable-deepep", "DeepEP's expert dispatch"),
    LayoutFlag("--critic-num-nodes", _OWN_GPUS, number=True),
    LayoutFlag("--critic-num-gpus-per-node", _OWN_GPUS, number=True),
)
# slime reads these only with --use-wandb (refused below unless --wandb-mode disabled): alone they ask for nothing
WANDB_SETTINGS = ("--wandb-project", "--wandb-group", "--wandb-run-id", "--wandb-key", "--wandb-host", "--wandb-team",
                  "--wandb-mode")


def add_layout_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of :data:`LAYOUT_FLAGS` on ``parser``, in a group of their own."""
    group = parser.add_argument_group("slime's and Megatron's flags that are no vime setting (any value but the "
                                      "one shown is refused, naming what vime lacks)")
    for layout in LAYOUT_FLAGS:
        if layout.accepted is True:
            meaning = f"accepted: {layout.note}"
        elif layout.accepted is None:
            meaning = f"refused (vime lacks {layout.missing})"
        else:
            meaning = f"{layout.accepted} only (vime lacks {layout.missing})"
        if layout.number or layout.text:
            group.add_argument(layout.flag, dest=_dest(layout), type=int if layout.number else str, default=None,
                               metavar="N" if layout.number else "VALUE", help=meaning)
        else:
            group.add_argument(layout.flag, dest=_dest(layout), action="store_true", default=None, help=meaning)
    group.add_argument("--use-wandb", dest="slime_use_wandb", action="store_true", default=None,
                       help=f"refused (vime lacks {_WANDB}), unless --wandb-mode disabled, which logs nothing")
    for flag in WANDB_SETTINGS:
        group.add_argument(flag, dest=_wandb_dest(flag), default=None, metavar="VALUE",
                           help="accepted with a note: slime reads it only with --use-wandb")


def _wandb_dest(flag: str) -> str:
    return "slime_" + flag.removeprefix("--").replace("-", "_")


def wandb_notes(args: argparse.Namespace) -> list[str]:
    """What the W&B flags given do on vime, to show: nothing (their values not shown: --wandb-key is a secret)."""
    given = [flag for flag in WANDB_SETTINGS if getattr(args, _wandb_dest(flag), None) is not None]
    if getattr(args, "slime_use_wandb", None):
        return ["--use-wandb --wandb-mode disabled logs nothing, in slime and in vime"]
    if not given:
        return []
    return [f"{', '.join(given)} ignored: slime reads {'it' if len(given) == 1 else 'them'} only with --use-wandb "
            f"(and vime lacks {_WANDB})"]


def colocate_notes(args: argparse.Namespace, rollout_backend: str) -> list[str]:
    """``--colocate`` is spelled alike in slime and vime but does not do the same: slime's offloads the engine while
    the trainer steps, vime's keeps vLLM awake unless told to sleep. Said on the command line, not left to the
    README, when a vLLM run asks for --colocate without choosing (``--vllm-enable-sleep-mode``)."""
    if not getattr(args, "colocate", None) or rollout_backend != "vllm":
        return []
    if "enable_sleep_mode" in (getattr(args, "vllm_args", None) or {}):
        return []
    return ["--colocate keeps each vLLM engine awake, holding its --vllm-gpu-memory-utilization share of the GPU, "
            "while the trainer steps; slime's --colocate offloads the engine meanwhile: pass "
            "--vllm-enable-sleep-mode true for that (or false to keep vime's way and silence this note)"]


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
    group.add_argument("--calculate-per-token-loss", dest="slime_calculate_per_token_loss", action="store_true",
                       default=None, help="slime's loss averaged over a batch's tokens: --loss-aggregation token "
                                          "(without it slime averages per response, then over responses: the "
                                          "slime scenario's --loss-aggregation sequence)")
    group.add_argument("--use-tis", dest="slime_use_tis", action="store_true", default=None,
                       help="slime's truncated importance sampling: --off-policy-correction tis (--tis-clip and "
                            "--tis-clip-low bound the weights, 2 and 0 by default in both)")
    for name, value in _RECOMPUTE.items():
        group.add_argument(f"--{name.replace('_', '-')}", dest=f"slime_{name}", type=type(value), default=None,
                           metavar=str(value), help=f"{value} only: with the other two, vime's "
                                                    "--recompute-activations (whole layers, one per checkpoint)")
    group.add_argument("--rm-type", dest="slime_rm_type", default=None, metavar="TYPE",
                       help=f"slime's reward: {', '.join(f'{k} is --reward {v}' for k, v in RM_TYPES.items())} "
                            "(deepscaler: the last \\boxed{} after the last </think>, or after ###Response, as "
                            "slime's, 0 without one; its answers compared by math-verify, not slime's sympy "
                            "grader); others refused with what to pass")
    group.add_argument("--eval-prompt-data", dest="slime_eval_prompt_data", nargs="+", default=None,
                       metavar="NAME PATH", help="one NAME PATH pair: --eval-data PATH (several sets: one file, "
                                                 "each row's data_source naming its set, gives metrics per set)")
    group.add_argument("--save", dest="slime_save", default=None, metavar="DIR",
                       help="slime's checkpoint folder: vime's run folder (--out DIR), which holds its checkpoints "
                            "(RUN_DIR/checkpoints, every --save-interval) beside its metrics and logs")
    group.add_argument("--load", dest="slime_load", default=None, metavar="DIR",
                       help="slime's folder to continue from: with --save DIR the same, a run already in DIR is "
                            "resumed (--resume DIR), else a new one starts there from --hf-checkpoint, as slime "
                            "starts from --ref-load")
    group.add_argument("--ref-load", dest="slime_ref_load", default=None, metavar="DIR",
                       help="slime's Megatron copy of the starting and reference weights: not read, since vime "
                            "reads both from --hf-checkpoint (a note says so)")


def run_folder(args: argparse.Namespace, out: Path | None, resume: Path | None) -> tuple[Path | None, Path | None,
                                                                                     list[str]]:
    """vime's run folder and run to resume (``--out``, ``--resume``) with slime's ``--save``/``--load``/``--ref-load``
    applied, and notes to show. slime saves its checkpoints to --save and continues from --load when a checkpoint is
    there, else starts from --ref-load; vime's run folder holds its checkpoints, a run is continued in its own
    folder, and it starts from --hf-checkpoint. ValueError for what has no vime meaning, saying what to pass."""
    save, load, ref_load = (getattr(args, f"slime_{name}", None) for name in ("save", "load", "ref_load"))
    notes = [] if ref_load is None else [
        f"--ref-load {ref_load} is not read: vime's starting and reference weights are --hf-checkpoint's (convert "
        "another reference model to a Hugging Face folder to train from it)"]
    if save is None and load is None:
        return out, resume, notes
    if out is not None or resume is not None:
        raise ValueError("--save/--load name vime's run folder, as --out or --resume do: pass one of them")
    if save is None:
        raise ValueError(f"--load {load} without --save {load}: vime continues a run in its own folder; pass --save "
                         f"and --load the same folder, or --resume RUN_DIR")
    if load is not None and Path(load).resolve() != Path(save).resolve():
        raise ValueError(f"--save {save} and --load {load} are different folders: vime continues a run in its own "
                         f"folder; pass the same folder to both (--load {save}), or leave --load out to start in "
                         f"{save}")
    folder = Path(save)
    if (folder / "config.json").is_file():
        if load is None:
            raise ValueError(f"--save {save} holds a vime run: add --load {save} to continue it, as slime's --load "
                             "does, or pass a new folder")
        return None, folder, [*notes, f"--load {load}: the run in it is resumed (--resume {load})"]
    return folder, None, notes


def refuse_missing_features(args: argparse.Namespace, given: dict[str, Any]) -> None:
    """ValueError naming, in one message, every flag given that asks for something vime lacks: the
    :data:`LAYOUT_FLAGS` with another value than vime's."""
    refused: dict[str, list[str]] = {}  # what is missing: the flags that ask for it, as given
    for layout in LAYOUT_FLAGS:
        value = getattr(args, _dest(layout), None)
        if value is not None and value != layout.accepted:
            shown = value is not True and not layout.text  # a text value may be a secret (--wandb-key)
            refused.setdefault(layout.missing, []).append(f"{layout.flag} {value}" if shown else layout.flag)
    if getattr(args, "slime_use_wandb", None) and getattr(args, "slime_wandb_mode", None) != "disabled":
        refused.setdefault(_WANDB, []).append("--use-wandb")
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
