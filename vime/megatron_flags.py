"""Megatron's model flags (slime's ``MODEL_ARGS``, ``source scripts/models/qwen3-4B.sh``) on vime's command line.

In slime these flags build the model; vime's Megatron trainer builds it from the checkpoint's config.json
(``vime.backends.megatron.conversion``), so here they describe what the user believes the checkpoint to be.
Each is checked against the config.json field that says the same (:data:`MEGATRON_FLAGS`, one row per flag):
accepted when they agree, and otherwise refused together in one message naming each flag, its value, the field
and the field's value -- the launcher's ``MODEL_ARGS`` are of another model than ``--hf-checkpoint``.

The flags of Megatron's that change how fast the same model trains, not what it computes (``--moe-grouped-gemm``,
``--attention-backend``, the token dispatcher), are rows too, accepted with the reason; where vime does otherwise
than a value asks (an auxiliary load-balancing loss, DeepEP's dispatcher) it is refused by name. Without any
one of the flags Megatron requires (``--num-layers``, ``--hidden-size``, ``--num-attention-heads``) the flags given
are checked alone; with one, an architecture switch left out is checked as off, as Megatron builds the model
without it.

The check runs in the run's preflight (``vime.pipeline.preflight``), which reads config.json once, for it and the
Megatron backend; the rows of vime's own values are checked there too, so that one message says everything.
This module imports no torch: the flags are declared before any engine loads.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
from typing import Any, Callable, Mapping

from vime.architecture import expert_tensor_parallel, head_dim, moe_layer_pattern, routed_experts

ABSENT = object()  # what a MoE flag is checked against on a dense model: no value given equals it


@dataclasses.dataclass(frozen=True)
class MegatronFlag:
    """A Megatron model flag and what vime runs for it: ``expected(hf_config, run_config)`` is the value that agrees
    with the checkpoint (``field`` names the config.json field it comes from; "" for vime's own value, and ``why``
    says why it is vime's), a frozenset of values that all do, or None when any value does."""

    flag: str
    kind: type  # int, float, str, or bool for a switch
    expected: Callable[[Any, Any], Any]
    field: str = ""
    note: str = ""  # how the field's value gives the flag's, where that is more than equality
    why: str = ""
    at_least: bool = False  # the flag may exceed the field (Megatron pads it)

    @property
    def dest(self) -> str:
        return "megatron_" + self.flag.removeprefix("--").replace("-", "_")

    def agrees(self, value: Any, expected: Any) -> bool:
        """Whether ``value``, as given, is what vime runs (``expected``, from :attr:`expected`)."""
        if expected is None:
            return True
        if expected is ABSENT:  # a MoE switch on a dense model: left out (False) agrees
            return value is False
        if isinstance(expected, frozenset):
            return value in expected
        if self.at_least:
            return value >= expected
        if self.kind is float and isinstance(expected, (int, float)):
            return math.isclose(value, expected, rel_tol=1e-9)
        return value == expected


def _rope(hf: Any) -> dict[str, Any]:
    """The checkpoint's RoPE settings (transformers 5 keeps rope_theta and partial_rotary_factor there)."""
    return dict(getattr(hf, "rope_parameters", None) or {})


def _moe(read: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    """``read(hf_config)`` for a mixture of experts; :data:`ABSENT` for a dense model."""
    return lambda hf, run: read(hf) if any(moe_layer_pattern(hf)) else ABSENT


def _qk_norm(hf: Any) -> bool:
    """Whether the checkpoint normalizes queries and keys per head: Qwen3's always do (its config has no field
    for it), GLM-4.5's when use_qk_norm says so; a model without the field (Qwen2, Llama) has none."""
    return hf.model_type in ("qwen3", "qwen3_moe") or bool(getattr(hf, "use_qk_norm", False))


class _LongerThanModel(Exception):
    """A ``--moe-layer-freq`` pattern of more entries than the checkpoint's layers, found before it is built."""


def _layer_pattern(text: str, layers: int) -> list[int] | None:
    """``--moe-layer-freq`` as Megatron reads it, as one 0/1 per layer: an int N >= 1 (layers 0, N, 2N, ... are
    MoE) or a list expression such as ``[0]*3+[1]*89``; slime's qwen3-30B-A3B.sh passes ``'([1]*48)'``, quotes
    included, which Megatron evaluates through them. Only list literals of 0 and 1, + and * are evaluated here
    (never arbitrary code). None for a pattern longer than the model: an operand of * beyond ``layers`` (the
    checkpoint's num_hidden_layers) makes one, and is not built (``[1]*10**11`` would take the preflight's memory).
    Anything else is the ValueError that the preflight turns into exit 2."""
    spelled = text
    text = text.strip().strip("'\"")
    refused = ValueError(f"--moe-layer-freq {spelled}: not an int >= 1 (every N-th layer an MoE) nor a pattern of "
                         f"[0]/[1] lists, + and * such as '([1]*{layers})'")
    if "[" not in text:
        try:
            every = int(text)
        except ValueError:
            raise refused from None
        if every < 1:
            raise refused
        return [int(layer % every == 0) for layer in range(layers)]

    def length(operand: Any) -> int:
        return len(operand) if isinstance(operand, list) else abs(operand)

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List) and all(isinstance(item, ast.Constant) and item.value in (0, 1)
                                              and type(item.value) is int for item in node.elts):
            return [item.value for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = value(node.left), value(node.right)
            if type(left) is not type(right):
                raise refused
            return left + right
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            left, right = value(node.left), value(node.right)
            if isinstance(left, list) == isinstance(right, list) and isinstance(left, list):
                raise refused
            if [] in (left, right):
                return []
            if length(left) > layers or length(right) > layers:
                raise _LongerThanModel
            return left * right
        raise refused

    try:
        pattern = value(ast.parse(text, mode="eval").body)
    except _LongerThanModel:
        return None
    except (SyntaxError, RecursionError, MemoryError, ValueError):  # deep nesting fails in the parser or here
        raise refused from None
    if not isinstance(pattern, list):
        raise refused
    return pattern


def _expert_tensor_parallel(hf: Any, run: Any) -> Any:
    """How many ranks share each expert in vime's layout (:func:`vime.architecture.expert_tensor_parallel`); any
    value for a dense model."""
    if not any(moe_layer_pattern(hf)):
        return None
    return expert_tensor_parallel(run.job.tensor_model_parallel_size, run.job.expert_model_parallel_size)


_SAME_MATH = "accepted: it changes how fast, not what, Megatron computes; "
_NO_BALANCING = "vime adds no load-balancing loss (the loss is the RL loss alone)"
MEGATRON_FLAGS = (
    MegatronFlag("--num-layers", int, lambda hf, run: hf.num_hidden_layers, "num_hidden_layers"),
    MegatronFlag("--hidden-size", int, lambda hf, run: hf.hidden_size, "hidden_size"),
    MegatronFlag("--ffn-hidden-size", int, lambda hf, run: hf.intermediate_size, "intermediate_size"),
    MegatronFlag("--num-attention-heads", int, lambda hf, run: hf.num_attention_heads, "num_attention_heads"),
    MegatronFlag("--group-query-attention", bool,
                 lambda hf, run: hf.num_key_value_heads < hf.num_attention_heads,
                 "num_key_value_heads", note="grouped when below num_attention_heads"),
    MegatronFlag("--num-query-groups", int, lambda hf, run: hf.num_key_value_heads, "num_key_value_heads"),
    MegatronFlag("--kv-channels", int, lambda hf, run: head_dim(hf), "head_dim"),
    MegatronFlag("--normalization", str,
                 lambda hf, run: "RMSNorm" if getattr(hf, "rms_norm_eps", None) else "LayerNorm", "rms_norm_eps",
                 note="an RMSNorm model has it"),
    MegatronFlag("--norm-epsilon", float, lambda hf, run: hf.rms_norm_eps, "rms_norm_eps"),
    MegatronFlag("--swiglu", bool, lambda hf, run: hf.hidden_act == "silu", "hidden_act", note="SwiGLU is silu"),
    MegatronFlag("--disable-bias-linear", bool, lambda hf, run: not getattr(hf, "mlp_bias", False),
                 "mlp_bias", note="vime's families have no MLP or output-projection bias"),
    MegatronFlag("--add-qkv-bias", bool, lambda hf, run: bool(hf.attention_bias), "attention_bias"),
    MegatronFlag("--qk-layernorm", bool, lambda hf, run: _qk_norm(hf), "use_qk_norm",
                 note="Qwen3 always has it, without the field; Qwen2 and Llama never"),
    MegatronFlag("--use-rotary-position-embeddings", bool, lambda hf, run: "rope_theta" in _rope(hf), "rope_theta"),
    MegatronFlag("--position-embedding-type", str,
                 lambda hf, run: "rope" if "rope_theta" in _rope(hf) else "learned_absolute", "rope_theta"),
    MegatronFlag("--rotary-base", float, lambda hf, run: _rope(hf).get("rope_theta"), "rope_theta"),
    MegatronFlag("--rotary-percent", float, lambda hf, run: _rope(hf).get("partial_rotary_factor", 1.0),
                 "partial_rotary_factor"),
    # Megatron pads the embedding to a multiple of --make-vocab-size-divisible-by x TP rows whatever --vocab-size
    # says, and slime passes the checkpoint's (already padded) size: a larger value only adds rows no token id
    # reaches. vime keeps the checkpoint's rows; a smaller value would leave tokens without one: the wrong model.
    MegatronFlag("--vocab-size", int, lambda hf, run: hf.vocab_size, "vocab_size", at_least=True),
    MegatronFlag("--untie-embeddings-and-output-weights", bool, lambda hf, run: not hf.tie_word_embeddings,
                 "tie_word_embeddings"),
    MegatronFlag("--attention-dropout", float, lambda hf, run: getattr(hf, "attention_dropout", 0.0),
                 "attention_dropout"),
    MegatronFlag("--num-experts", int, _moe(routed_experts), "num_experts", note="GLM-4.5: n_routed_experts"),
    MegatronFlag("--moe-ffn-hidden-size", int, _moe(lambda hf: hf.moe_intermediate_size), "moe_intermediate_size"),
    MegatronFlag("--moe-router-topk", int, _moe(lambda hf: hf.num_experts_per_tok), "num_experts_per_tok"),
    MegatronFlag("--moe-shared-expert-intermediate-size", int,
                 _moe(lambda hf: hf.moe_intermediate_size * getattr(hf, "n_shared_experts", 0) or ABSENT),
                 "n_shared_experts", note="times moe_intermediate_size"),
    MegatronFlag("--moe-layer-freq", str, lambda hf, run: moe_layer_pattern(hf),
                 "number of MoE layers",
                 note="from decoder_sparse_step and mlp_only_layers; GLM-4.5: first_k_dense_replace"),
    MegatronFlag("--moe-router-score-function", str,
                 _moe(lambda hf: "sigmoid" if hf.model_type == "glm4_moe" else "softmax"),
                 "model_type", note="Qwen3-MoE routes by softmax, GLM-4.5 by sigmoid"),
    # under a sigmoid score Megatron ignores --moe-router-pre-softmax; under softmax it is Qwen3-MoE's
    # softmax over all experts before the top-k, which norm_topk_prob false asks for
    MegatronFlag("--moe-router-pre-softmax", bool,
                 _moe(lambda hf: None if hf.model_type == "glm4_moe" else not hf.norm_topk_prob),
                 "norm_topk_prob", note="pre-softmax is Qwen3-MoE without norm_topk_prob"),
    MegatronFlag("--moe-router-enable-expert-bias", bool, _moe(lambda hf: hf.model_type == "glm4_moe"),
                 "model_type", note="GLM-4.5's e_score_correction_bias"),
    MegatronFlag("--moe-router-topk-scaling-factor", float,
                 _moe(lambda hf: getattr(hf, "routed_scaling_factor", 1.0)), "routed_scaling_factor"),
    MegatronFlag("--expert-tensor-parallel-size", int, _expert_tensor_parallel,
                 why="the ranks sharing each expert in vime's layout: --tensor-model-parallel-size with "
                     "--expert-model-parallel-size 1, else 1 (any value for a dense model)"),
    MegatronFlag("--moe-aux-loss-coeff", float, lambda hf, run: 0.0, why=_NO_BALANCING),
    MegatronFlag("--moe-router-bias-update-rate", float, lambda hf, run: 0.0,
                 why="vime never updates the expert bias during training (the HF models' is fixed)"),
    MegatronFlag("--moe-router-load-balancing-type", str,
                 lambda hf, run: frozenset({"aux_loss", "seq_aux_loss", "global_aux_loss", "none"}),
                 why="sinkhorn routes otherwise; with --moe-aux-loss-coeff 0 (vime's) the others add no loss"),
    MegatronFlag("--moe-router-dtype", str, lambda hf, run: "fp32", why="vime's router runs in fp32, as the HF "
                                                                        "models' do"),
    MegatronFlag("--moe-token-drop-policy", str, lambda hf, run: None,
                 why="accepted: tokens are dropped only with --moe-expert-capacity-factor, which vime never sets"),
    MegatronFlag("--moe-token-dispatcher-type", str, lambda hf, run: frozenset({"alltoall", "allgather"}),
                 why="both move the same tokens to the same experts, vime's all-to-all; flex is DeepEP's, which "
                     "vime lacks"),
    MegatronFlag("--moe-grouped-gemm", bool, lambda hf, run: None,
                 why=_SAME_MATH + "vime's experts always run as grouped matmuls"),
    MegatronFlag("--moe-permute-fusion", bool, lambda hf, run: None,
                 why=_SAME_MATH + "vime permutes the tokens without the fused kernel"),
    MegatronFlag("--attention-backend", str, lambda hf, run: frozenset({"flash", "fused", "unfused", "local", "auto"}),
                 why="each computes the same attention; vime's is torch's scaled_dot_product_attention (flash kernels "
                     "on GPU)"),
    MegatronFlag("--attention-softmax-in-fp32", bool, lambda hf, run: None,
                 why="accepted: the fused attention kernels vime uses accumulate the softmax in fp32"),
    MegatronFlag("--accumulate-allreduce-grads-in-fp32", bool, lambda hf, run: None,
                 why="accepted: vime's gradients are fp32 (its masters'), summed over copies in fp32"),
    MegatronFlag("--hidden-dropout", float, lambda hf, run: 0.0, why="vime trains without dropout"),
)


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of :data:`MEGATRON_FLAGS` on ``parser``, in a group of their own; each defaults to None (not
    given, not checked)."""
    group = parser.add_argument_group("Megatron's model flags (slime's MODEL_ARGS): vime builds the model from "
                                      "config.json and checks each flag given against it")
    for row in MEGATRON_FLAGS:
        meaning = f"checked against config.json's {row.field}" + (f" ({row.note})" if row.note else "") \
            if row.field else row.why
        if row.at_least:
            meaning += " (a larger value is accepted: Megatron pads the vocabulary anyway)"
        if row.kind is bool:
            group.add_argument(row.flag, dest=row.dest, action="store_true", default=None, help=meaning)
        else:
            group.add_argument(row.flag, dest=row.dest, type=row.kind, default=None, metavar="VALUE", help=meaning)


# Megatron's --position-embedding-type rope gives RoPE without this (older) switch, so its absence says nothing
_NOT_IMPLIED_OFF = {"--use-rotary-position-embeddings"}
# what Megatron cannot build a model without: a command line holding one describes the whole model
_REQUIRED = {"--num-layers", "--hidden-size", "--num-attention-heads"}


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of :data:`MEGATRON_FLAGS` on the command line, by flag, as given. Once a flag that Megatron
    cannot build a model without is given (``--num-layers``, ``--hidden-size``, ``--num-attention-heads``: the
    command line describes the whole model), the architecture switches left out are given as False, as Megatron
    builds the model without them: a launcher's MODEL_ARGS lacking
    ``--untie-embeddings-and-output-weights`` describe a tied model, which an untied checkpoint is not."""
    flags = {row.flag: getattr(args, row.dest) for row in MEGATRON_FLAGS if getattr(args, row.dest, None) is not None}
    if _REQUIRED & set(flags):
        for row in MEGATRON_FLAGS:
            if row.kind is bool and row.field and row.flag not in _NOT_IMPLIED_OFF:
                flags.setdefault(row.flag, False)
    return flags


def check(flags: Mapping[str, Any], hf_config: Any, run: Any, source: str) -> None:
    """ValueError naming, in one message, every flag of ``flags`` (from :func:`given`) that disagrees with the
    checkpoint's config (``hf_config``, read from ``source``) or with what vime runs; ``run`` is the run's
    RunConfig. With no model folder yet (``hf_config`` None: a scenario that builds its model) nothing is checked
    here; the run's own preflight checks the flags once the folder is there."""
    if hf_config is None:
        return
    rows = {row.flag: row for row in MEGATRON_FLAGS}
    wrong, fixed = [], []
    for flag, value in flags.items():
        row = rows[flag]
        expected = row.expected(hf_config, run)
        spelled = (flag if value else f"no {flag}") if row.kind is bool else f"{flag} {value}"
        if row.flag == "--moe-layer-freq":
            value = _layer_pattern(value, hf_config.num_hidden_layers)
        if row.agrees(value, expected):
            continue
        if row.field:
            actual = _describe(expected) if row.flag == "--moe-layer-freq" else _field(hf_config, row.field)
            wrong.append(f"{spelled}: config.json's {row.field} is {actual}" + (f" ({row.note})" if row.note else ""))
        else:
            fixed.append(f"{spelled} ({row.why}; vime runs {_describe(expected)})")
    said = []
    if wrong:
        said.append(f"these Megatron model flags disagree with {source}: {'; '.join(wrong)}. They describe another "
                    "model than the checkpoint: pass the --hf-checkpoint they are for, or that checkpoint's "
                    "MODEL_ARGS (vime builds the model from config.json, so leaving them out is safe too)")
    if fixed:
        said.append(f"these Megatron flags ask for what vime does not do: {'; '.join(fixed)}; leave them out or "
                    "pass vime's value")
    if said:
        raise ValueError(". ".join(said))


def _field(hf_config: Any, name: str) -> Any:
    """A config.json field as the checkpoint's config holds it (RoPE's inside rope_parameters); "absent"."""
    if hasattr(hf_config, name):
        return getattr(hf_config, name)
    return _rope(hf_config).get(name, "absent")


def _describe(expected: Any) -> str:
    """What vime runs, as a message shows it: an accepted set listed, a layer pattern summed up."""
    if isinstance(expected, frozenset):
        return "one of " + ", ".join(sorted(expected))
    if isinstance(expected, list):
        moe = [index for index, layer in enumerate(expected) if layer]
        return f"{len(moe)} of {len(expected)}" + (f", from layer {moe[0]}" if moe else "")
    return str(expected)
