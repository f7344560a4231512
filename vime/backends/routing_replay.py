"""Rollout routing replay (R3) for Hugging Face MoE models: record experts, replay them.

A mixture-of-experts layer sends each token to its top-k experts. The
rollout engine and the trainer compute in different precisions (bf16 against
fp32 masters) or kernels, so near-ties in the router pick different experts
and the two log-probs drift apart by far more than rounding. R3 (arXiv
2510.11370) records, at rollout, the experts every token was routed to in
every MoE layer, and has the trainer route each token to those same experts.
The gate weights are still computed from the trainer's own router scores at
the forced experts, so the router keeps its gradient.

Experts travel as ``[positions, moe_layers, top_k]`` int16 tensors; ``-1``
marks a position routed freely (the last token of a response, which no
forward pass of the rollout ever fed back).

Supported routers: Qwen3-MoE's (softmax, optional top-k renormalisation)
and GLM-4.5's (sigmoid, renormalised, scaled by ``routed_scaling_factor``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


def _softmax_gates(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    weights = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, experts)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _sigmoid_gates(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    weights = logits.sigmoid().gather(1, experts)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


# The gate weights a router gives its chosen experts, as the router itself computes them.
_GATES: dict[str, Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_gates,
    "Glm4MoeTopkRouter": _sigmoid_gates,
}


MODEL_TYPES = ("qwen3_moe", "glm4_moe")  # the Hugging Face model_type of each family above


def check_model_folder(path: str | Path) -> None:
    """ValueError, before a run, when the model in ``path`` is not an MoE family R3 supports."""
    model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"--use-rollout-routing-replay needs a mixture-of-experts model ({', '.join(MODEL_TYPES)}); "
                         f"{path} holds a {model_type}: pass --no-use-rollout-routing-replay")


def check_critic_folder(policy_path: str | Path, critic_path: str | Path) -> None:
    """ValueError, before a run, when PPO's value model from ``critic_path`` (``--critic-model-path``) cannot
    replay the experts the policy's rollout recorded: it replays them as the policy does, so it needs the same
    MoE layers, experts and top-k."""
    from transformers import AutoConfig

    from vime.architecture import moe_layer_pattern, routed_experts

    def layout(path: str | Path) -> tuple[Any, ...]:
        config = AutoConfig.from_pretrained(path)
        return tuple(moe_layer_pattern(config)), routed_experts(config), getattr(config, "num_experts_per_tok", None)

    policy, critic = layout(policy_path), layout(critic_path)
    if policy != critic:
        raise ValueError(f"--use-rollout-routing-replay: the value model replays the policy's experts, so "
                         f"--critic-model-path {critic_path} needs the policy's MoE layers, experts and top-k "
                         f"({policy}), not {critic}: pass a value model of the policy's architecture, or leave "
                         "--critic-model-path out")


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order; ValueError for an MoE family R3 does not know."""
    routers = [module for module in model.modules() if type(module).__name__ in _GATES]
    unknown = {type(module).__name__ for module in model.modules()
               if type(module).__name__.lower().endswith("router") and type(module).__name__ not in _GATES}
    if unknown:
        raise ValueError(f"routing replay does not know the router {sorted(unknown)}; it supports "
                         f"{sorted(_GATES)} (Qwen3-MoE and GLM-4.5)")
    return routers


@contextlib.contextmanager
def recording(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, every forward appends one ``[tokens, moe_layers, top_k]`` tensor of chosen experts
    (tokens in the order the model flattens its input: row by row)."""
    routers = moe_routers(model)
    calls: list[list[torch.Tensor]] = [[] for _ in routers]
    forwards: list[torch.Tensor] = []

    def hook(layer: int) -> Callable:
        def record(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            calls[layer].append(output[2].detach())
            if layer == len(routers) - 1:
                forwards.append(torch.stack([c.pop() for c in calls], dim=1).to(torch.int16))
        return record

    handles = [router.register_forward_hook(hook(layer)) for layer, router in enumerate(routers)]
    try:
        yield forwards
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def replaying(model: torch.nn.Module, experts: torch.Tensor | None) -> Iterator[None]:
    """Within the block, a forward over ``tokens`` positions routes them to ``experts``
    (``[tokens, moe_layers, top_k]``, -1 = free); ``experts=None`` leaves routing alone."""
    if experts is None:
        yield
        return
    routers = moe_routers(model)
    if experts.dim() != 3 or experts.shape[1] != len(routers):
        raise ValueError(f"replayed experts must be [tokens, {len(routers)} MoE layers, top_k], "
                         f"got {list(experts.shape)}")

    def hook(layer: int) -> Callable:
        def replay(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
            logits, _, chosen = output
            forced = experts[:, layer].to(device=chosen.device, dtype=chosen.dtype)
            if forced.shape != chosen.shape:
                raise ValueError(f"replayed experts cover {forced.shape[0]} tokens x top-{forced.shape[1]}, "
                                 f"the forward routes {chosen.shape[0]} x top-{chosen.shape[1]}")
            chosen = torch.where(forced < 0, chosen, forced)
            return logits, _GATES[type(module).__name__](module, logits, chosen), chosen
        return replay

    # first among the hooks, so that any other (a recording) sees the routing that was used
    handles = [router.register_forward_hook(hook(layer), prepend=True) for layer, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
