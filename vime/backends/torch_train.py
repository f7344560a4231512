"""The reference trainer: the policy (and value model) in plain PyTorch.

One ``train_step`` does what a step of slime's Megatron trainer does, at
laptop scale: recompute the batch's log-probs with the current weights (the
"old" policy of the PPO ratio, and the trainer side of
``train_rollout_logprob_abs_diff``; a token sampled by older weights takes
its ratio against its rollout log-prob instead: ``policy_loss.ratio_anchor``),
compute advantages, then
``updates_per_step`` optimizer steps over mini-batches, each accumulated
over micro-batches of ``micro_batch_size`` samples, with gradient clipping and
AdamW. Such a micro-batch is as wide as its longest sample, so each
mini-batch is cut into micro-batches of samples of similar length (longest
first); gradients only accumulate over them, each loss normalised by its
whole mini-batch, so the grouping does not change the step. With
``use_dynamic_batch_size`` a micro-batch holds at most ``max_tokens_per_gpu``
tokens, its samples packed end to end into one row without padding
(``vime.backends.packing``): the same log-probs and step, no compute spent
on padding. With one
optimizer step per batch, neither a KL reference nor a value model, and no
dropout, nothing needs the old log-probs before the training forward passes,
which run on those very weights: their log-probs serve as the old ones (the
ratio is exactly 1), and the separate no-grad pass is skipped.
``dtype="bf16"`` runs forward and backward on bf16 weights and steps fp32
masters (``vime.backends.master_weights``).

``algo`` is the advantage estimator (``vime.algorithms.estimators``). PPO's
value model is a second copy of the backbone (from ``critic_model_path``, else
the policy's checkpoint) with a scalar head, trained in the same step at
``critic_lr`` (its own parameter group, clipped on its own), replaying the
rollout's experts as the policy does under R3; a frozen
copy of the initial policy serves as the KL reference when either KL
coefficient is > 0 (``kl_loss_coef``: a loss term; ``kl_coef``: a penalty in
the reward, measured once per step with the scoring pass's log-probs).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vime.algorithms import estimators, grpo, ppo
from vime.algorithms.config import check_estimator
from vime.algorithms.kl import kl_divergence
from vime.algorithms.policy_loss import PolicyLossConfig, aggregate, batch_normalizer, policy_loss, ratio_anchor
from vime.backends import routing_replay
from vime.backends.base import TensorBatch, TrainEngine
from vime.backends.hf import load_causal_lm, token_stats, warn_if_bf16_is_emulated
from vime.backends.master_weights import MasterWeights, to_bf16
from vime.backends.packing import MicroBatch, ModelInputs, SampleSizes, on_device, packed_inputs, padded_inputs
from vime.config import OptimConfig


class _ValueModel(torch.nn.Module):
    """A causal LM's backbone with a scalar head (in place of its output layer): V(prefix) for every position."""

    def __init__(self, causal_lm: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = causal_lm.model
        self.head = torch.nn.Linear(causal_lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                use_cache: bool = False) -> torch.Tensor:
        """Called as the policy is (``attention_mask`` None: a packed row, its samples told apart by their
        positions)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache).last_hidden_state
        return self.head(hidden).squeeze(-1).to(torch.float32)


class TorchTrainEngine(TrainEngine):
    def __init__(self, model_path: str, *, algo: str, optim: OptimConfig, loss: PolicyLossConfig,
                 grpo_config: grpo.GRPOConfig, ppo_config: ppo.PPOConfig, temperature: float, dtype: str = "fp32",
                 total_steps: int = 1, seed: int = 0, device: str = "cpu", critic_model_path: str = "") -> None:
        check_estimator(algo, loss)
        torch.manual_seed(seed)
        self.seed = seed
        self.algo, self.optim, self.loss = algo, optim, estimators.loss_settings(algo, loss)
        self.grpo, self.ppo = grpo_config, ppo_config
        self.temperature = temperature
        self.device = device
        warn_if_bf16_is_emulated(dtype, device)
        self.weight_version = 0
        self.replica = (0, 1)  # (which, of how many) data-parallel copies of this trainer: each trains its share
        self.layout: dict[str, Any] = {"train_backend": "torch"}  # what wrote a checkpoint: the backend, its ranks
        self.policy = self._load_policy(model_path).to(device)
        self.reference = (self._load_policy(model_path).to(device).requires_grad_(False)
                          if loss.needs_reference else None)
        if self.reference is not None and dtype == "bf16":
            to_bf16(self.reference)  # as the policy's weights are: the KL starts at exactly 0
        self.critic = self._load_critic(critic_model_path or model_path).to(device) if algo == "ppo" else None
        trained = self._trained_models()
        self.masters = self._master_weights(trained) if dtype == "bf16" else None
        params = self.masters.groups if self.masters else [
            [param for param in module.parameters() if param.requires_grad] for module in trained]
        self.optimizer = self._optimizer(
            [{"params": group, "lr": lr} for group, lr in zip(params, (optim.lr, optim.critic_lr))])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: optim.lr_factor(step, total_steps))

    def _master_weights(self, trained: list[torch.nn.Module]) -> MasterWeights:
        """fp32 masters of ``trained``'s parameters, which this turns into bf16 (``dtype="bf16"``): what another
        backend overrides to keep only a part of each master."""
        return MasterWeights(trained)

    def _optimizer(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """AdamW over ``groups`` (one per trained model: the tensors it steps, the masters in bf16, and its learning
        rate), with the run's settings (:meth:`_adamw_settings`): what another backend overrides to keep its
        state otherwise."""
        return torch.optim.AdamW(groups, **self._adamw_settings())

    def _adamw_settings(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s keywords for the run's weight decay and betas (fused kernels on CUDA)."""
        return {"weight_decay": self.optim.weight_decay, "betas": (self.optim.adam_beta1, self.optim.adam_beta2),
                "fused": torch.device(self.device).type == "cuda"}

    def _load_policy(self, model_path: str) -> torch.nn.Module:
        """The policy, loaded in fp32, answering ``model(input_ids=, attention_mask=, position_ids=,
        use_cache=False).logits`` for right-padded rows, or with ``attention_mask=None`` for one packed row whose
        position ids restart at each sample (``vime.backends.packing``): what another backend overrides to reuse
        this step, with :meth:`_load_critic` (called again for the frozen KL reference)."""
        return load_causal_lm(model_path, "fp32")

    def _load_critic(self, model_path: str) -> torch.nn.Module:
        """PPO's value model from the Hugging Face folder ``model_path``: its backbone, a zero-initialised scalar
        head, in fp32, answering ``critic(input_ids=, attention_mask=, position_ids=, use_cache=)`` (as the policy)
        with the values of every position ``[rows, width]`` in fp32 (another backend overrides this with its own
        model)."""
        return _ValueModel(load_causal_lm(model_path, "fp32")).eval()

    def named_weights(self, device: str | None = None) -> dict[str, torch.Tensor]:
        return {name: param.detach().to(device) for name, param in self.policy.named_parameters()}

    def save_hf(self, folder: Path) -> None:
        self.policy.save_pretrained(folder)

    def save(self, folder: Path) -> None:
        self.save_hf(folder / "model")
        torch.save(self._trainer_state(), self._state_file(folder))

    def _trainer_state(self) -> dict[str, Any]:
        """What :meth:`save` writes beside the Hugging Face folder (optimizer, schedule, value model, masters, RNG,
        version) and the layout it was written in."""
        return {"weight_version": self.weight_version, "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state(),
                "critic": None if self.critic is None else self.critic.state_dict(),
                "masters": None if self.masters is None else self.masters.state_dict(), "layout": self.layout}

    def load(self, folder: Path) -> None:
        state = self._saved_state(folder)
        if self.masters is not None and state.get("masters") is None:
            raise ValueError(f"{folder} holds no fp32 master weights (an fp32 run, or vime before they were saved): "
                             "resume it with --dtype fp32, or start a new run from its model folder")
        with torch.no_grad():
            self._load_policy_weights(folder / "model")
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        if self.masters is not None:  # the bf16 weights above are the masters rounded; these are exact
            self.masters.load_state_dict(state["masters"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        self.weight_version = state["weight_version"]

    def _dropout(self) -> float:
        """The policy's dropout: with any, a training forward is not the scoring one (eval mode, no dropout)."""
        config = self.policy.config
        return getattr(config, "attention_dropout", 0.0) + getattr(config, "hidden_dropout", 0.0)

    def _trained_models(self) -> list[torch.nn.Module]:
        """The models the optimizer steps, in the order of its parameter groups: the policy, and for ppo the
        value model."""
        return [self.policy] + ([self.critic] if self.critic is not None else [])

    def _train_mode(self, training: bool) -> None:
        """The trained models in training mode for the step's training passes (dropout; a replay that a
        recomputing model keeps for the backward pass), in eval mode for the scoring pass."""
        for model in self._trained_models():
            model.train(training)

    def _clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Scale the gradients of ``params`` to a norm of at most ``max_norm``; their norm before."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _sum_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the data-parallel copies of this trainer (one here: itself)."""
        return tensor

    def _saved_state(self, folder: Path) -> dict[str, Any]:
        """What :meth:`_trainer_state` gave when ``folder`` was saved, for this trainer: its own file, written in
        its layout; a checkpoint of another layout is refused (a trainer of this backend cannot reshard it)."""
        path = self._state_file(folder)
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete (resume from an earlier one), "
                                    "or --train-backend megatron wrote it (its files are named by rank: resume it "
                                    "with --train-backend megatron)")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("layout", self.layout) != self.layout:  # the same file name, another backend's state
            raise refused_layout(folder, state["layout"], self.layout)
        return state

    def _state_file(self, folder: Path) -> Path:
        """Where :meth:`save` puts what the Hugging Face folder does not hold (optimizer, schedule, masters)."""
        return folder / "trainer.pt"

    def _load_policy_weights(self, folder: Path) -> None:
        """The policy's weights from the Hugging Face folder :meth:`save_hf` wrote, copied in place (the
        optimizer and the master weights hold these tensors)."""
        saved = load_causal_lm(str(folder), "fp32")
        for name, param in self.policy.named_parameters():
            param.copy_(saved.get_parameter(name))

    def _replaying(self, model: torch.nn.Module, experts: torch.Tensor | None) -> contextlib.AbstractContextManager:
        """Route the forward's tokens to the rollout's experts (``[rows, width, moe_layers, top_k]``, R3)."""
        return routing_replay.replaying(model, None if experts is None else experts.flatten(0, 1))

    def _inputs(self, batch: TensorBatch, micro: MicroBatch) -> ModelInputs:
        """The forward's inputs for ``micro``: packed into one row with ``--use-dynamic-batch-size`` (its token
        budget is of real tokens, which a packed row holds and nothing else), else right-padded rows."""
        return (packed_inputs if self.optim.use_dynamic_batch_size else padded_inputs)(batch, micro)

    def _call(self, model: torch.nn.Module, inputs: ModelInputs) -> Any:
        """``model`` (the policy, the KL reference or the value model) on ``inputs``, called as a transformers
        model is: what another backend overrides to hand its model what else it takes."""
        return model(**inputs.model_kwargs())

    def _response_logprobs(self, model: torch.nn.Module, batch: TensorBatch,
                           micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the response tokens of ``micro``'s rows: ``[rows, max_response]`` each."""
        inputs = self._inputs(batch, micro)
        with self._replaying(model, inputs.experts):
            logits = self._call(model, inputs).logits
        return self._response_stats(logits, inputs)

    def _response_stats(self, logits: torch.Tensor, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_response_logprobs` from the policy's ``logits [rows, width, vocab]`` of ``inputs`` (one row when
        packed)."""
        # each position from the first that predicts a response token, with its next token; then the responses'
        logprobs, entropy = self._token_stats(logits[:, inputs.first:], inputs.next_tokens(),
                                              entropy_grad=bool(self.loss.entropy_coef))
        return inputs.responses(logprobs), inputs.responses(entropy)

    def _forward_passes(self, model: torch.nn.Module, batch: TensorBatch,
                        chunks: list[MicroBatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`_response_logprobs` of ``model`` for each micro-batch of ``chunks``, without gradients: what
        another backend overrides to run the passes its own way (pipeline stages)."""
        return [self._response_logprobs(model, batch, micro) for micro in chunks]

    def _mini_batch_passes(self, batch: TensorBatch, chunks: list[MicroBatch],
                           loss_of: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
                           value_loss_of: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = None
                           ) -> list[dict[str, torch.Tensor]]:
        """Forward and backward of the policy (and, with ``value_loss_of``, the value model) on each micro-batch
        of ``chunks``, the gradients accumulating; ``loss_of(micro, logprobs, entropy)`` gives a micro-batch's
        policy loss and statistics (:meth:`_micro_loss`), ``value_loss_of(micro, values)`` its value loss and
        statistics (:meth:`_micro_value_loss`); each micro-batch's statistics, both together, are returned in
        ``chunks``' order. Another backend overrides this to schedule the passes its own way (pipeline stages),
        and may return the statistics on only some of its ranks."""
        figures = []
        for micro in chunks:
            loss, stats = loss_of(micro, *self._response_logprobs(self.policy, batch, micro))
            if value_loss_of is not None:
                value_loss, value_stats = value_loss_of(micro, self._values(batch, micro))
                loss = loss + value_loss
                stats.update(value_stats)
            loss.backward()
            figures.append(stats)
        return figures

    def _token_stats(self, logits: torch.Tensor, targets: torch.Tensor,
                     entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of ``targets`` and entropies from the policy's ``logits`` (:func:`token_stats`)."""
        return token_stats(logits, targets, self.temperature, entropy_grad=entropy_grad)

    def _values(self, batch: TensorBatch, micro: MicroBatch) -> torch.Tensor:
        """The value model's values at the positions that predict the response tokens of ``micro``'s rows. Under R3 it
        routes each token to the rollout's experts, as the policy does: it starts as the policy's copy, and a
        value that moves between the step's scoring pass and its training passes because a near-tie in a
        router flipped would be clipped as if the weights had moved it."""
        assert self.critic is not None
        inputs = self._inputs(batch, micro)
        with self._replaying(self.critic, inputs.experts):
            values = self._call(self.critic, inputs)
        return self._response_values(values, inputs)

    @staticmethod
    def _response_values(values: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        """:meth:`_values` from the value model's ``values [rows, width]`` of ``inputs`` (one row when packed)."""
        return inputs.responses(values[:, inputs.first:])

    def _value_passes(self, batch: TensorBatch, chunks: list[MicroBatch]) -> list[torch.Tensor]:
        """:meth:`_values` for each micro-batch of ``chunks``, without gradients: what another backend overrides to
        run the passes its own way (pipeline stages)."""
        return [self._values(batch, micro) for micro in chunks]

    @torch.no_grad()
    def score(self, batch: TensorBatch, sizes: SampleSizes | None = None) -> dict[str, torch.Tensor]:
        """Everything computed once per step with the weights the batch will be trained from: the response
        tokens' log-probs (``old_logprobs``, the trainer side of ``train_rollout_logprob_abs_diff``) and
        entropies, and the reference log-probs and values where the algorithm has them. ``sizes``: the batch's,
        read already (by the step); else read here, once."""
        sizes = SampleSizes.of(batch) if sizes is None else sizes
        if len(sizes.lengths) != batch.input_ids.shape[0]:
            raise ValueError(f"sizes of {len(sizes.lengths)} samples for a batch of {batch.input_ids.shape[0]}: "
                             "pass SampleSizes.of(batch) of this very batch, or none")
        batch = batch.to(self.device)
        chunks = self._micro_batches(torch.arange(batch.input_ids.shape[0]), sizes)
        keys = ["old_logprobs", "entropy"] + ["ref_logprobs"] * (self.reference is not None) + \
            ["values"] * (self.critic is not None)
        scores = {key: torch.zeros_like(batch.rollout_logprobs) for key in keys}
        policy = self._forward_passes(self.policy, batch, chunks)
        reference = self._forward_passes(self.reference, batch, chunks) if self.reference is not None else None
        values = self._value_passes(batch, chunks) if self.critic is not None else None
        for index, micro in enumerate(chunks):
            figures = dict(zip(("old_logprobs", "entropy"), policy[index]))
            if reference is not None:
                figures["ref_logprobs"] = reference[index][0]
            if values is not None:
                figures["values"] = values[index]
            if micro.counted:
                for key, value in figures.items():
                    scores[key][micro.rows] = value
        return {key: self._sum_over_replicas(value) for key, value in scores.items()}


    def train_step(self, batch: TensorBatch, sizes: SampleSizes | None = None) -> dict[str, Any]:
        """One step on ``batch`` (see the base class). ``sizes``: the batch's, taken on the host by a caller that
        moves the batch first; else read here, the step's one read of the batch for every micro-batch (a wait
        for the device only if the batch is there already)."""
        sizes = SampleSizes.of(batch) if sizes is None else sizes
        batch = batch.to(self.device)
        scored_in_training = (self.optim.updates_per_step == 1 and self.reference is None and self.critic is None
                              and not self._dropout())
        if scored_in_training:  # filled in by the micro-steps, all of which run before the one optimizer step
            empty = torch.zeros_like(batch.rollout_logprobs)
            scores = {"old_logprobs": empty, "entropy": empty.clone()}
        else:
            scores = self.score(batch, sizes)
        self._train_mode(True)
        mask = batch.response_mask
        version = self.weight_version
        metrics: dict[str, Any] = {}
        kl = None
        if "ref_logprobs" in scores:
            kl = kl_divergence(scores["old_logprobs"], scores["ref_logprobs"], self.loss.kl_estimator) * mask
            metrics["kl"] = float(aggregate(kl, mask, "token"))
        advantages, returns = estimators.advantages(
            self.algo, batch.rewards, batch.group_ids, mask, grpo_config=self.grpo, ppo_config=self.ppo,
            values=scores.get("values"), kl_penalty=self.loss.kl_coef * kl if self.loss.kl_coef else None)
        totals: dict[str, list[tuple[torch.Tensor, float]]] = {}
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.weight_version)
        order = torch.randperm(batch.input_ids.shape[0], generator=generator)
        minis = [mini for mini in order.tensor_split(self.optim.updates_per_step) if mini.numel()]
        for mini in minis:
            self.optimizer.zero_grad(set_to_none=True)
            value_normalizer = float(sizes.response_tokens[mini].sum())
            normalizer = batch_normalizer(self.loss.loss_aggregation, float(mini.numel()), max(value_normalizer, 1.0),
                                          self.loss.loss_scale_tokens or mask.shape[-1])
            chunks = self._micro_batches(mini, sizes)
            loss_of = functools.partial(self._micro_loss, batch, scores=scores, advantages=advantages,
                                        normalizer=normalizer, scored_here=scored_in_training)
            value_loss_of = None if self.critic is None else functools.partial(
                self._micro_value_loss, batch, scores=scores, returns=returns, value_normalizer=value_normalizer)
            for micro, stats in zip(chunks, self._mini_batch_passes(batch, chunks, loss_of, value_loss_of)):
                tokens = float(micro.sizes.response_tokens.sum()) if micro.counted else 0.0
                for key, value in stats.items():
                    totals.setdefault(key, []).append((value, tokens))
            norms = [self._clip_gradients(group["params"], self.optim.grad_clip or math.inf)
                     for group in self.optimizer.param_groups]
            totals.setdefault("grad_norm", []).append((norms[0], 1.0))
            if len(norms) > 1:  # the value model's, clipped on its own as slime clips its critic's
                totals.setdefault("value_grad_norm", []).append((norms[1], 1.0))
            self.optimizer.step()
            if self.masters is not None:
                self.masters.publish()
        self.optimizer.zero_grad(set_to_none=True)  # so that a colocated engine can use that memory between steps
        if scored_in_training:  # each copy of the trainer filled in its own rows
            scores = {key: self._sum_over_replicas(value) for key, value in scores.items()}
        # Only tokens sampled by the weights trained now show the engines' numerical mismatch; older ones also
        # carry the policy's movement since. Either figure is NaN (null in metrics.jsonl) without such tokens.
        gaps = (scores["old_logprobs"] - batch.rollout_logprobs).abs()
        sampled = (mask > 0) & (batch.versions >= 0)
        for key, tokens in (("train_rollout_logprob_abs_diff", sampled & (batch.versions == version)),
                            ("train_rollout_logprob_abs_diff_stale", sampled & (batch.versions < version))):
            metrics[key] = float((gaps * tokens).sum() / tokens.sum()) if tokens.any() else math.nan
        metrics["entropy"] = float(aggregate(scores["entropy"], mask, "token"))
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self._train_mode(False)
        self.weight_version += 1
        sums = _read(totals)
        summed = self._sum_over_replicas(torch.tensor(list(sums.values()), dtype=torch.float64).reshape(-1, 3))
        for key, figures in zip(sums, summed.tolist()):
            metrics.setdefault(key, _combine(key, figures, len(minis)))  # kl was measured before the update: kept
        return metrics

    def _micro_batches(self, rows: torch.Tensor, sizes: SampleSizes) -> list[MicroBatch]:
        """This copy's micro-batches of ``rows`` (on the host; :func:`replica_micro_batches`): ``--micro-batch-size``
        samples each, or with ``--use-dynamic-batch-size`` at most ``--max-tokens-per-gpu`` tokens each (packed),
        cut by the batch's ``sizes`` and sent to the device together, before any of them runs."""
        chunks = replica_micro_batches(rows, sizes.lengths, self.optim.micro_batch_size, *self.replica,
                                       max_tokens=self.optim.max_tokens_per_gpu)
        return on_device(chunks, sizes, self.device)

    def _micro_loss(self, batch: TensorBatch, micro: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor, *,
                    scores: dict[str, torch.Tensor], advantages: torch.Tensor, normalizer: float,
                    scored_here: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy's loss of one micro-batch from its ``logprobs`` and ``entropy`` of its response tokens, to be
        backpropagated, and its statistics. ``scored_here``: this forward's log-probs and entropies are the step's
        scores (written into ``scores``). A pass that does not count (see :func:`replica_micro_batches`) adds
        nothing to either."""
        rows = micro.rows
        mask = batch.response_mask[rows]
        old_logprobs = logprobs.detach() if scored_here else scores["old_logprobs"][rows]
        if scored_here and micro.counted:
            scores["old_logprobs"][rows] = old_logprobs
            scores["entropy"][rows] = entropy.detach()
        stale = (batch.versions[rows] >= 0) & (batch.versions[rows] < self.weight_version)
        old_logprobs = ratio_anchor(self.loss, old_logprobs, batch.rollout_logprobs[rows], stale)
        loss, stats = policy_loss(self.loss, logprobs, old_logprobs, advantages[rows], mask,
                                  entropy=entropy, ref_logprobs=scores["ref_logprobs"][rows]
                                  if "ref_logprobs" in scores else None,
                                  behaviour_logprobs=batch.rollout_logprobs[rows], normalizer=normalizer)
        stats["loss"] = loss.detach()
        return _counted_only(micro, loss, stats)

    def _micro_value_loss(self, batch: TensorBatch, micro: MicroBatch, values: torch.Tensor, *,
                          scores: dict[str, torch.Tensor], returns: torch.Tensor | None,
                          value_normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The value model's loss of one micro-batch (ppo) from its ``values`` of the response tokens, weighted by
        ``value_coef``, and its statistics: a loss of its own, since the two models share no parameters (the
        policy's loss adds nothing to the value model's gradients, nor this to the policy's), so a backend may
        backpropagate the two apart. A pass that does not count adds nothing."""
        assert returns is not None
        rows = micro.rows
        value_loss, stats = ppo.value_loss(values, scores["values"][rows], returns[rows], batch.response_mask[rows],
                                           self.ppo.value_clip, normalizer=value_normalizer)
        stats["value_loss"] = value_loss.detach()
        return _counted_only(micro, self.ppo.value_coef * value_loss, stats)


def _counted_only(micro: MicroBatch, loss: torch.Tensor,
                  stats: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss`` and ``stats`` of ``micro``, zeros where it is a pass for the other copies' exchanges only (see
    :func:`replica_micro_batches`): kept in the graph, so that the backward pass still joins them."""
    if micro.counted:
        return loss, stats
    return loss * 0, {key: value * 0 for key, value in stats.items()}


def refused_layout(folder: Path, written: dict[str, Any], mine: dict[str, Any]) -> ValueError:
    """The refusal of a trainer state that a trainer of layout ``mine`` cannot read: another backend's."""
    return ValueError(f"{folder} was written by a trainer of layout {written}, and this one's is {mine}: resume "
                      "with the flags of that layout (only a Megatron trainer's state reshards, to another "
                      "Megatron layout)")


def _read(totals: dict[str, list[tuple[torch.Tensor, float]]]) -> dict[str, list[float]]:
    """Each statistic's ``[sum of value x tokens, sum of tokens, sum of values]`` over the step's micro-batches
    (value, response tokens), copied to the host in one transfer at the end of the step: read one by one, each
    micro-step would make the host wait for the device before it could queue the next one's work."""
    flat = [value.float() for pairs in totals.values() for value, _ in pairs]  # detached scalars, of mixed dtypes
    if not flat:
        return {}
    values = iter(torch.stack([value.to(flat[0].device) for value in flat]).tolist())
    sums = {}
    for key, pairs in totals.items():
        read = [(next(values), tokens) for _, tokens in pairs]
        sums[key] = [sum(value * tokens for value, tokens in read), sum(tokens for _, tokens in read),
                     sum(value for value, _ in read)]
    return sums


def _combine(key: str, sums: list[float], minis: int) -> float:
    """One figure for the step from :func:`_read`'s sums (over every copy of the trainer): the losses were
    normalised by their mini-batch, so they add up (one figure per mini-batch, averaged); the rest are
    per-token means, weighted by their micro-batch's tokens (micro-batches of short samples hold fewer)."""
    weighted, tokens, plain = sums
    if key in ("loss", "value_loss"):
        return plain / minis
    return weighted / max(tokens, 1.0)


def micro_batches(rows: torch.Tensor, lengths: torch.Tensor, size: int,
                  max_tokens: int = 0) -> tuple[torch.Tensor, ...]:
    """``rows`` cut into micro-batches of ``size``, longest samples first (``lengths``: of every sample of the
    batch): a micro-batch of ``size`` is padded to its longest sample, so grouping samples of similar length
    wastes the least compute on padding, and the largest one comes first (running out of memory shows at
    once). With ``max_tokens`` (slime's --max-tokens-per-gpu), as many samples as :func:`token_budget_sizes`
    fits instead."""
    return tuple(chunk for chunk, _ in replica_micro_batches(rows, lengths, size, 0, 1, max_tokens))


def replica_micro_batches(rows: torch.Tensor, lengths: torch.Tensor, size: int, replica: int,
                          replicas: int, max_tokens: int = 0) -> list[tuple[torch.Tensor, bool]]:
    """The micro-batches (see :func:`micro_batches`) of the share of ``rows`` that copy ``replica`` of
    ``replicas`` data-parallel trainers takes, each with whether it counts: by length, every ``replicas``-th
    sample from the ``replica``-th, so that the shares cost alike. Every copy runs as many micro-batches as
    the one with the most (each copy holds the whole batch, so each works out every copy's cut), the others
    adding passes over the shortest sample that count for nothing: when experts are divided among the copies,
    each forward and backward pass needs all of them."""
    ordered = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    cuts = [_cut(ordered[copy::replicas], lengths, size, max_tokens) for copy in range(replicas)]
    mine, passes = cuts[replica], max(len(cut) for cut in cuts)
    return [(chunk, True) for chunk in mine] + [(ordered[-1:], False)] * (passes - len(mine))


def _cut(share: torch.Tensor, lengths: torch.Tensor, size: int, max_tokens: int) -> tuple[torch.Tensor, ...]:
    """``share`` (longest first) cut into micro-batches: of ``size`` samples, or by the token budget
    ``max_tokens`` when it is > 0. The loss is normalised by the whole mini-batch, whatever the cut."""
    if not share.numel():  # an empty tensor splits into one empty part
        return ()
    return share.split(token_budget_sizes(lengths[share].tolist(), max_tokens) if max_tokens else size)


def token_budget_sizes(longest_first: list[int], max_tokens: int) -> list[int]:
    """How many samples each micro-batch takes of samples of these lengths (prompt + response tokens, longest
    first), in order, so that their tokens add up to at most ``max_tokens``: the micro-batch's samples are
    packed into one row without padding (``vime.backends.packing``), so its real tokens are what its
    activations hold, the count slime's budget takes too. A sample longer than the budget runs alone rather
    than being refused, as slime's first-fit gives it a micro-batch of its own: the budget bounds memory, and
    one long response should not stop a run."""
    sizes, tokens = [], max_tokens
    for length in longest_first:
        if sizes and tokens + length <= max_tokens:
            sizes[-1] += 1
            tokens += length
        else:
            sizes.append(1)
            tokens = length
    return sizes

