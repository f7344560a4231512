"""``MegatronTrainEngine``: the reference trainer's step (``vime.backends.torch_train``) on the GPTModel.

The engine supplies the model (and PPO's value model, a GPTModel with a value head) and its weights' ways in
and out, and completes the gradients over the ranks before clipping; the step itself is inherited. Building
the model, its forward, the weights' conversion and the vocabulary-parallel log-probs are in the other files
of this package.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func

from vime.algorithms import grpo, ppo
from vime.algorithms.policy_loss import PolicyLossConfig
from vime.backends import cpu_compat
from vime.backends.base import TensorBatch
from vime.backends.master_weights import MasterWeights
from vime.backends.megatron.distributed_optimizer import Part, ShardedAdamW, ShardedMasterWeights
from vime.backends.megatron.logprobs import vocab_parallel_token_stats
from vime.backends.megatron.model import ForwardOutput, build_model, forward
from vime.backends.megatron.parallel import _sum_over
from vime.backends.megatron.resharding import (
    Shapes,
    check_models,
    model_shapes,
    resharded_state,
    saved_critic_names,
    saved_shapes,
    shard_records,
    trained_names,
)
from vime.backends.megatron.routing import _check_replayable, _route_free_tokens, end_replay
from vime.backends.megatron.weights import (
    hf_tensors,
    hf_weights,
    load_hf_weights,
    read_hf_folder,
    unsharded_weights,
    write_hf_folder,
)
from vime.backends.packing import MicroBatch, ModelInputs, SampleSizes
from vime.backends.plain_collectives import broadcast_plain, gather_plain
from vime.backends.routing_replay import MODEL_TYPES as MOE_MODEL_TYPES
from vime.backends.torch_train import TorchTrainEngine, refused_layout
from vime.config import OptimConfig


class _AsCausalLM(torch.nn.Module):
    """A GPTModel called the way the reference trainer calls a transformers causal LM.

    The reference trainer's step (score, advantages, mini- and micro-batches,
    loss, clipping, AdamW, schedule) is written against
    ``model(input_ids=, attention_mask=, position_ids=).logits``; answering
    that call lets :class:`MegatronTrainEngine` run the very same step. The
    trainer's batches are right-padded and trimmed, so the mask and positions
    it passes are those the causal GPTModel assumes anyway; or packed into one
    row (``attention_mask`` None), whose positions restart at each sample (for
    the rotary embedding) and whose ``sample_lengths``, on the host, bound each
    sample's attention (``model.forward``). Under tensor
    parallelism its logits are this rank's share of the vocabulary, which the
    engine's ``_token_stats`` takes as they are; anything else must gather them.
    """

    def __init__(self, model: GPTModel, config: Any) -> None:
        super().__init__()
        self.model = model
        self.config = config  # the Hugging Face config, as a transformers model carries it
        self.replay_experts: torch.Tensor | None = None  # set by MegatronTrainEngine._replaying

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                use_cache: bool = False, sample_lengths: torch.Tensor | None = None) -> ForwardOutput:
        """This rank's share of the vocabulary's logits: :meth:`MegatronTrainEngine._token_stats` sums over
        the ranks. ``use_cache`` is taken as a transformers model takes it; a GPTModel keeps no cache here.
        ``sample_lengths``: a packed row's, on the host (``model.forward``)."""
        return forward(self.model, input_ids, position_ids=_packed_positions(attention_mask, position_ids),
                       sample_lengths=sample_lengths, replay_experts=self.replay_experts, whole_vocabulary=False)


class _AsValueModel(_AsCausalLM):
    """A GPTModel with a :class:`~vime.backends.megatron.modules.ValueHead` called the way the reference
    trainer calls its value model: ``critic(input_ids=, attention_mask=, position_ids=, use_cache=)`` -> the
    values of every position, ``[rows, width]`` in fp32, whole on every tensor-parallel rank."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,  # type: ignore[override]
                position_ids: torch.Tensor, use_cache: bool = False,
                sample_lengths: torch.Tensor | None = None) -> torch.Tensor:
        return forward(self.model, input_ids, position_ids=_packed_positions(attention_mask, position_ids),
                       sample_lengths=sample_lengths, replay_experts=self.replay_experts).logits.squeeze(-1).float()


def _packed_positions(attention_mask: torch.Tensor | None, position_ids: torch.Tensor) -> torch.Tensor | None:
    """The positions ``model.forward`` needs: a packed row's (no mask), which mark its samples; none for right-padded
    rows, whose positions are ``0..width-1`` as the GPTModel takes them anyway."""
    return position_ids if attention_mask is None else None


_LAYOUT_FLAGS = (("pipeline_parallel", "--pipeline-model-parallel-size"),
                 ("tensor_parallel", "--tensor-model-parallel-size"), ("data_parallel", "--data-parallel-size"),
                 ("expert_parallel", "--expert-model-parallel-size"))


class MegatronTrainEngine(TorchTrainEngine):
    """The trainer on a megatron-core GPTModel, with the reference trainer's training step.

    Everything algorithmic -- log-prob recomputation, advantages, the policy
    loss of ``vime.algorithms``, mini- and micro-batches, clipping, AdamW and
    the schedule -- is inherited from :class:`TorchTrainEngine`, so the two
    backends cannot drift apart; this class supplies the model (built from
    the Hugging Face config, weights converted on load) and the conversions
    back to Hugging Face names for weight sync, ``save_hf`` and checkpoints.
    ``dtype="bf16"`` trains bf16 weights with fp32 masters, as the reference
    trainer does.

    With several ranks (``tensor_parallel`` x ``data_parallel``, of a
    ``torchrun`` launch or led by ``vime.backends.tensor_parallel`` in the
    pipeline) every rank builds this engine and makes the same calls with
    the same batches: each holds its shard of the weights (with
    ``expert_parallel``, whole experts of its own), masters and optimizer
    state; each data-parallel copy runs its share of the samples
    (:func:`~vime.backends.torch_train.replica_micro_batches`) and the
    gradients are summed over the copies; the gradient norm is taken over
    the whole model, and ``named_weights`` gathers whole tensors on every
    rank. Rank 0 writes the Hugging Face folder; each rank writes its own
    trainer state, which a trainer of another layout reshards on load
    (``resharding``). With ``distributed_optimizer`` each data-parallel copy
    keeps Adam's state, and in bf16 the fp32 masters, for its part of every
    tensor only (``distributed_optimizer``); such a state resumes in its own
    layout. With ``pipeline_parallel`` stages each rank holds its stage's
    layers; megatron-core's schedule runs the step's micro-batches through
    them (:meth:`_pipelined`), the last stage computing the log-probs, the loss
    and the metrics, which every rank then gets; each stage's ranks write
    their own trainer state, which any other layout reshards too.

    PPO's value model is the policy's GPTModel (or ``critic_model_path``'s) with a
    :class:`~vime.backends.megatron.modules.ValueHead` in place of the output layer, on the policy's ranks
    and in their layout (in pipeline stages: split as the policy is, the head on the last stage, its passes
    scheduled apart from the policy's), replaying the rollout's experts under R3 as the policy does; its optimizer state
    and masters are the policy's kind, and each rank's shard of it is in that rank's trainer state (resharded
    with the policy's).
    """

    def __init__(self, model_path: str, *, algo: str, optim: OptimConfig, loss: PolicyLossConfig,
                 grpo_config: grpo.GRPOConfig, ppo_config: ppo.PPOConfig, temperature: float, dtype: str = "fp32",
                 total_steps: int = 1, seed: int = 0, tensor_parallel: int = 1, expert_parallel: int = 1,
                 data_parallel: int = 1, recompute: bool = False, critic_model_path: str = "",
                 distributed_optimizer: bool = False, pipeline_parallel: int = 1) -> None:
        self.hf_config, self._checkpoint = read_hf_folder(model_path)
        self.tensor_parallel, self.expert_parallel, self.recompute = tensor_parallel, expert_parallel, recompute
        self.data_parallel, self.pipeline_parallel = data_parallel, pipeline_parallel
        self.sharded_optimizer = distributed_optimizer and data_parallel > 1  # one copy: nothing to divide
        super().__init__(model_path, algo=algo, optim=optim, loss=loss, grpo_config=grpo_config,
                         ppo_config=ppo_config, temperature=temperature, dtype=dtype, total_steps=total_steps,
                         seed=seed, device="cuda" if torch.cuda.is_available() else "cpu",
                         critic_model_path=critic_model_path)
        del self._checkpoint
        if dist.get_rank() == 0 and importlib.util.find_spec("transformer_engine") is None:
            structlog.get_logger().info("megatron-core without Transformer Engine or Apex, as vime runs it: its own "
                                        "layers (SDPA attention, torch's norms, grouped experts) and torch's AdamW")
        # the optimizer's tensors (the masters in bf16, the parameters themselves in fp32) that hold a shard, and
        # the whole ones whose gradient each rank sees only part of (marked ``sequence_parallel``): norms, routers
        # and the value head act on the rank's share of the tokens, q/k norms on its own heads
        pairs = self._optimized_pairs(self.optimizer.param_groups)
        self._split = {id(tensor) for tensor, param in pairs if getattr(param, "tensor_model_parallel", False)}
        self._partial = {id(tensor) for tensor, param in pairs if getattr(param, "sequence_parallel", False)}
        self._experts = {id(tensor) for tensor, param in pairs if hasattr(param, "expert_split")}
        # a tied embedding in pipeline stages: the first stage's and the last stage's copy (megatron-core marks both
        # ``shared_embedding``, the copy also ``shared``), whose gradients are summed over the embedding group
        self._tied = {id(tensor) for tensor, param in pairs if getattr(param, "shared_embedding", False)}
        self._tied_copy = {id(tensor) for tensor, param in pairs if getattr(param, "shared", False)}
        self.replica = (parallel_state.get_data_parallel_rank(), data_parallel)
        self.layout = {"train_backend": "megatron", "tensor_parallel": tensor_parallel,
                       "data_parallel": data_parallel, "expert_parallel": expert_parallel}
        if self.sharded_optimizer:  # only then: a plain state of this layout reads as before
            self.layout["distributed_optimizer"] = True
        if pipeline_parallel > 1:  # likewise
            self.layout["pipeline_parallel"] = pipeline_parallel

    def _optimized_pairs(self, groups: list[dict[str, Any]]) -> list[tuple[torch.Tensor, torch.nn.Parameter]]:
        """Each tensor of the optimizer's ``groups`` with the model parameter it is (fp32) or the master of
        (bf16), which carries how the parameter is split."""
        return [(tensor, param) for group, model in zip(groups, self._trained_models(), strict=True)
                for tensor, param in zip(group["params"], [p for p in model.parameters() if p.requires_grad],
                                         strict=True)]

    def _master_weights(self, trained: list[torch.nn.Module]) -> MasterWeights:
        """With ``distributed_optimizer`` and several data-parallel copies, each copy keeps the masters of its part
        of every tensor (:class:`ShardedMasterWeights`), divided as the optimizer's state is."""
        if not self.sharded_optimizer:
            return super()._master_weights(trained)
        return ShardedMasterWeights(trained, self._copies)

    def _optimizer(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """With ``distributed_optimizer`` and several data-parallel copies, AdamW whose state each copy keeps
        for its part of every tensor (:class:`ShardedAdamW`): in bf16 the parts its masters keep, in fp32 the
        parameters' own parts."""
        if not self.sharded_optimizer:
            return super()._optimizer(groups)
        masters = self.masters
        part_of = masters.part_of if isinstance(masters, ShardedMasterWeights) else (
            lambda tensor: Part(tensor, self._copies(tensor)))
        return ShardedAdamW(groups, part_of, **self._adamw_settings())

    @staticmethod
    def _copies(param: torch.Tensor) -> dist.ProcessGroup:
        """The ranks among which the distributed optimizer divides ``param``, those that hold copies of it: the
        data-parallel group for the dense tensors, the expert-data-parallel group for the experts."""
        if hasattr(param, "expert_split"):
            return parallel_state.get_expert_data_parallel_group()
        return parallel_state.get_data_parallel_group()

    def _load_policy(self, model_path: str) -> _AsCausalLM:
        return self._policy(self._checkpoint)

    def _load_critic(self, model_path: str) -> _AsValueModel:
        """``model_path``'s architecture and backbone (the policy's, unless ``critic_model_path`` names another
        folder) with a zero-initialised value head; each rank reads its shard, as for the policy."""
        hf_config, checkpoint = read_hf_folder(model_path)
        return _AsValueModel(self._build(hf_config, checkpoint, value_head=True), hf_config).eval()

    @contextlib.contextmanager
    def _replaying(self, model: torch.nn.Module, experts: torch.Tensor | None) -> Iterator[None]:
        """R3 through megatron-core's RouterReplay, which needs an expert for every position: the free ones
        (-1: a response's last token, padding) get any valid ids, since no kept log-prob depends on them. That
        the others are all there is checked once per step, for the whole batch (:meth:`train_step`)."""
        if experts is None:
            yield
            return
        model.replay_experts = _route_free_tokens(experts).to(self.device)
        try:
            yield
        finally:
            model.replay_experts = None

    def _call(self, model: torch.nn.Module, inputs: ModelInputs) -> Any:
        """As the reference trainer calls ``model``, with a packed row's sample lengths from the host, which the
        GPTModel's forward requires with its positions (the attention's bounds, known without reading the
        device)."""
        return model(**inputs.model_kwargs(), sample_lengths=inputs.sample_lengths)

    def _policy(self, checkpoint: Mapping[str, torch.Tensor]) -> _AsCausalLM:
        return _AsCausalLM(self._build(self.hf_config, checkpoint), self.hf_config).eval()

    def _build(self, hf_config: Any, checkpoint: Mapping[str, torch.Tensor], value_head: bool = False) -> GPTModel:
        """A GPTModel of ``hf_config`` in this trainer's layout, its weights from ``checkpoint``."""
        model = build_model(hf_config, routing_replay=hf_config.model_type in MOE_MODEL_TYPES,
                            tensor_parallel=self.tensor_parallel, expert_parallel=self.expert_parallel,
                            data_parallel=self.data_parallel, recompute=self.recompute, value_head=value_head,
                            pipeline_parallel=self.pipeline_parallel)
        load_hf_weights(model, checkpoint, hf_config)
        return model

    def _token_stats(self, logits: torch.Tensor, targets: torch.Tensor,
                     entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tensor_parallel == 1:
            return super()._token_stats(logits, targets, entropy_grad)
        return vocab_parallel_token_stats(logits, targets, self.temperature, entropy_grad)

    def train_step(self, batch: TensorBatch) -> dict[str, Any]:
        """The reference trainer's step; the experts the last micro-batch replayed (in the policy and the value
        model), kept for its backward pass when the layers recompute, are dropped after it. Experts that cannot
        be replayed are refused first, by every rank (each holds the whole batch): one refusing in a micro-batch
        that the other data-parallel copies do not run would leave them waiting in their next collective.
        Under pipeline parallelism the metrics are the last stage's (where the loss is), on every rank."""
        sizes = SampleSizes.of(batch)  # from the host batch: read after the move, it would wait for the device
        batch = batch.to(self.device)  # the experts are checked there: on the host, seconds for a large batch
        if batch.routed_experts is not None:
            _check_replayable(batch.routed_experts)
        try:
            metrics = super().train_step(batch, sizes)
        finally:
            if self.recompute:
                for model in self._trained_models():
                    end_replay(model.model)
        if self.pipeline_parallel == 1:
            return metrics
        return broadcast_plain(metrics, src=_last_stage(), group=parallel_state.get_pipeline_model_parallel_group())

    def score(self, batch: TensorBatch, sizes: SampleSizes | None = None) -> dict[str, torch.Tensor]:
        """The reference trainer's scores; under pipeline parallelism computed on the last stage and broadcast
        from there, so that every rank holds them (the step's advantages and metrics read them)."""
        scores = super().score(batch, sizes)
        if self.pipeline_parallel > 1:
            for value in scores.values():
                dist.broadcast(value, src=_last_stage(), group=parallel_state.get_pipeline_model_parallel_group())
        return scores

    def _forward_passes(self, model: torch.nn.Module, batch: TensorBatch,
                        chunks: list[MicroBatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Under pipeline parallelism, megatron-core's schedule runs the forward passes through the stages;
        the log-probs and entropies are the last stage's, and zeros on the others (:meth:`score` broadcasts the
        last stage's)."""
        if self.pipeline_parallel == 1:
            return super()._forward_passes(model, batch, chunks)
        logprobs, entropy = self._scored_in_stages(model, batch, chunks)
        return list(zip(logprobs, entropy, strict=True))

    def _value_passes(self, batch: TensorBatch, chunks: list[MicroBatch]) -> list[torch.Tensor]:
        """Under pipeline parallelism the value model's forward passes run through its stages as the policy's do
        (:meth:`_forward_passes`): the values are the last stage's, zeros on the others."""
        if self.pipeline_parallel == 1:
            return super()._value_passes(batch, chunks)
        assert self.critic is not None
        values, = self._scored_in_stages(self.critic, batch, chunks)
        return values

    def _scored_in_stages(self, model: _AsCausalLM, batch: TensorBatch,
                          chunks: list[MicroBatch]) -> list[list[torch.Tensor]]:
        """``model``'s response outputs (:meth:`_stage_outputs`) of each micro-batch, one list per output, from
        forward passes through the stages: the last stage's, and zeros of their shape on the others."""
        def outputs_only(micro: MicroBatch, *outputs: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
            return outputs[0].sum() * 0, dict(enumerate(outputs))

        figures = self._pipelined(model, batch, chunks, outputs_only, forward_only=True)
        count = 1 if isinstance(model, _AsValueModel) else 2
        if not parallel_state.is_pipeline_last_stage():
            return [[torch.zeros(len(micro.rows), batch.response_ids.shape[1], device=self.device) for micro in chunks]
                    for _ in range(count)]
        return [[outputs[index] for outputs in figures] for index in range(count)]

    def _mini_batch_passes(self, batch: TensorBatch, chunks: list[MicroBatch],
                           loss_of: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
                           value_loss_of: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = None
                           ) -> list[dict[str, torch.Tensor]]:
        """Under pipeline parallelism, megatron-core's 1F1B schedule runs the forward and backward passes of
        the micro-batches through the stages, the policy's, then (ppo) the value model's on its own: the two
        losses share no parameters, so each model's backward pass needs only its own loss. The statistics are
        the last stage's (none on the others: :meth:`train_step` broadcasts the last stage's metrics)."""
        if self.pipeline_parallel == 1:
            return super()._mini_batch_passes(batch, chunks, loss_of, value_loss_of)
        figures = self._pipelined(self.policy, batch, chunks, loss_of, forward_only=False)
        if value_loss_of is not None:
            assert self.critic is not None
            for stats, value_stats in zip(figures, self._pipelined(self.critic, batch, chunks, value_loss_of,
                                                                   forward_only=False), strict=True):
                stats.update(value_stats)
        return figures

    def _pipelined(self, model: _AsCausalLM, batch: TensorBatch, chunks: list[MicroBatch],
                   loss_of: Callable[..., tuple[torch.Tensor, dict[Any, torch.Tensor]]],
                   forward_only: bool) -> list[dict[Any, torch.Tensor]]:
        """The micro-batches ``chunks`` (right-padded rows, or one packed row each: :meth:`_inputs`) through the
        pipeline stages of ``model`` (the policy, the KL reference or the value model) by megatron-core's own
        schedule (``get_forward_backward_func``: 1F1B, or forward passes only), each stage exchanging activations
        and their gradients with its neighbours. The last stage turns its output into the response tokens'
        log-probs and entropies, or values (:meth:`_stage_outputs`), and ``loss_of`` into the micro-batch's loss
        (normalised by its mini-batch, as in the reference trainer: the token count of 1 handed to the schedule,
        under ``calculate_per_token_loss``, keeps it from dividing the loss again) and statistics, which it
        returns in ``chunks``' order; the other stages return none."""
        one = torch.ones((), dtype=torch.int, device=self.device)
        # that token count of 1 holds only while no finalize_model_grads_func divides the gradients by the summed
        # count (megatron's DDP would set one): our loss is normalised already
        assert model.model.config.finalize_model_grads_func is None, "the loss would be divided twice"
        # the stages receive activations into buffers of this dtype: the weights', bf16 once the masters rounded
        # them (the model was built in fp32)
        model.model.config.pipeline_dtype = next(model.model.parameters()).dtype

        def step(data: Iterator[MicroBatch], stage: GPTModel) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple]]:
            micro = next(data)
            inputs = self._inputs(batch, micro)
            experts = None if inputs.experts is None else _route_free_tokens(inputs.experts)
            output = forward(stage, inputs.input_ids,
                             position_ids=_packed_positions(inputs.attention_mask, inputs.position_ids),
                             sample_lengths=inputs.sample_lengths, replay_experts=experts,
                             whole_vocabulary=False).logits

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[Any, torch.Tensor]]:
                loss, stats = loss_of(micro, *self._stage_outputs(model, output, inputs))
                return loss, one, stats

            return output, loss_func

        with cpu_compat.cuda_tensors_on_cpu():
            return get_forward_backward_func()(forward_step_func=step, data_iterator=iter(chunks), model=[model.model],
                                               num_microbatches=len(chunks), seq_length=0, micro_batch_size=0,
                                               forward_only=forward_only)

    def _stage_outputs(self, model: _AsCausalLM, output: torch.Tensor, inputs: ModelInputs) -> tuple[torch.Tensor, ...]:
        """What the last stage's ``output`` of ``inputs`` gives the loss: the policy's (or the KL reference's)
        log-probs and entropies of the response tokens, from its logits (this rank's share of the vocabulary); the
        value model's values of them, in fp32 (as :class:`_AsValueModel` gives them)."""
        if isinstance(model, _AsValueModel):
            return (self._response_values(output.squeeze(-1).float(), inputs),)
        return self._response_stats(output, inputs)

    def _clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Complete the gradients, then take the norm over the whole model and clip to it.

        Each data-parallel copy's gradients are of its share of the batch's samples (the loss normalised
        by the whole batch), so they are summed over the copies: an expert's over the copies that hold it.
        Under tensor parallelism the norms' and routers' gradients are of the rank's share of the positions
        and are summed over its copy's ranks. The norm then counts each shard once (squares summed over the
        ranks that divide the tensor) and each whole tensor once, since every rank now holds the same
        gradient of it; under pipeline parallelism each stage's squares are summed with the others'. A tied
        embedding's two copies, on the first stage and the last, each get the sum of both gradients (as
        megatron-core's ``_allreduce_word_embedding_grads`` does), so that the same update keeps them equal; the
        norm counts it once, on the first stage."""
        grads = {id(param): param.grad for param in params if param.grad is not None}
        experts = [grad for key, grad in grads.items() if key in self._experts]
        _sum_over([grad for key, grad in grads.items() if key not in self._experts],
                  parallel_state.get_data_parallel_group())
        _sum_over(experts, parallel_state.get_expert_data_parallel_group())
        if dist.get_world_size() == 1:
            return super()._clip_gradients(params, max_norm)
        _sum_over([grad for key, grad in grads.items() if key in self._partial],
                  parallel_state.get_tensor_model_parallel_group())
        tied = [grad for key, grad in grads.items() if key in self._tied]
        if tied:
            _sum_over(tied, parallel_state.get_embedding_group())
        grads = {key: grad for key, grad in grads.items() if key not in self._tied_copy}  # counted once in the norm
        squares = torch.zeros((), device=self.device)
        for shards, group in (([grad for key, grad in grads.items() if key in self._split and key not in self._experts],
                               parallel_state.get_tensor_model_parallel_group()),
                              (experts, parallel_state.get_expert_tensor_and_model_parallel_group())):
            part = (torch.nn.utils.get_total_norm(shards) ** 2).to(self.device)  # a CPU zero when there are none
            dist.all_reduce(part, group=group)
            squares += part
        whole = [grad for key, grad in grads.items() if key not in self._split]
        squares += torch.nn.utils.get_total_norm(whole).to(self.device) ** 2
        if self.pipeline_parallel > 1:  # each stage's tensors are its own
            dist.all_reduce(squares, group=parallel_state.get_pipeline_model_parallel_group())
        total = squares.sqrt()
        torch.nn.utils.clip_grads_with_norm_([param for param in params if param.grad is not None], max_norm, total)
        return total

    def _sum_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.data_parallel == 1:
            return tensor
        summed = tensor.to(self.device)
        dist.all_reduce(summed, group=parallel_state.get_data_parallel_group())
        return summed.to(tensor.device)

    def named_weights(self, device: str | None = None) -> dict[str, torch.Tensor]:
        """Hugging Face checkpoint names, as vLLM loads them (the fused q/k/v and gate/up are split into copies);
        whole tensors, so under tensor parallelism every rank must call this or :meth:`join_weight_gather`."""
        return hf_weights(self.policy.model, self.hf_config, device)

    def rollout_weights(self, dtype: torch.dtype, device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in hf_tensors(self.policy.model, self.hf_config):  # converted where it was gathered
            yield name, tensor.to(dtype).to(device)

    def join_weight_gather(self) -> None:
        """A follower rank's part of the leader's :meth:`named_weights`: the same gathers, nothing kept."""
        for _ in unsharded_weights(self.policy.model):
            pass

    def save_hf(self, folder: Path) -> None:
        """Rank 0 writes the folder from host copies, one tensor gathered at a time; the others join."""
        if dist.get_rank() == 0:
            write_hf_folder(folder, self.hf_config, self.named_weights("cpu"))
        else:
            self.join_weight_gather()
        dist.barrier()

    def save(self, folder: Path) -> None:
        """Returns once every rank has written its part: the checkpoint is complete when the caller seals it."""
        super().save(folder)
        dist.barrier()

    def _trainer_state(self) -> dict[str, Any]:
        """The reference trainer's state of this rank, and where its shards lie in the whole tensors (for a
        trainer of another layout to reshard it: ``resharding``); the value model's weights by the whole model's
        names (:func:`saved_critic_names`)."""
        models = self._gpt_models()
        state = {**super()._trainer_state(), "shards": [shard_records(model) for model in models],
                 "parameters": [trained_names(model) for model in models]}
        if self.critic is not None:
            saved = saved_critic_names(self.critic.model)
            state["critic"] = {saved[key]: value for key, value in state["critic"].items()}
        return state

    def _saved_state(self, folder: Path) -> dict[str, Any]:
        """This rank's own file when the checkpoint was written in this layout (read as it is, as fast as
        before); else this rank's part of every rank's file (:func:`resharded_state`). Either must be of this
        trainer's models."""
        own = self._state_file(folder)
        if own.exists():
            state = torch.load(own, map_location="cpu", mmap=True, weights_only=True)
            if state.get("layout", self.layout) == self.layout:
                if "shards" in state:  # one saved before the records were kept passes, as it did
                    check_models(saved_shapes([state]), model_shapes(self._gpt_models()), folder)
                if self.critic is not None and state.get("critic") is not None:  # by this stage's own names
                    own = {saved: key for key, saved in saved_critic_names(self.critic.model).items()}
                    state = {**state, "critic": {own[name]: value for name, value in state["critic"].items()}}
                return state
        # on the CPU: a GPU's tensors would otherwise be copied back to the GPU each was saved from (or fail on a
        # host with fewer GPUs); the optimizer and the masters move this rank's part to its parameters' device
        states = [torch.load(file, map_location="cpu", mmap=True, weights_only=True)
                  for file in sorted(folder.glob("trainer*.pt"))]
        if not states:
            raise FileNotFoundError(f"{folder} holds no trainer state (trainer*.pt): the checkpoint is incomplete; "
                                    "resume from an earlier one")
        other = next((layout for layout in (state.get("layout", {}) for state in states)
                      if layout.get("train_backend") != "megatron"), None)
        if other is not None:  # the reference trainer's: its parameters and optimizer state are of another model
            raise refused_layout(folder, other, self.layout)
        layouts = [state.get("layout", {}) for state in states]
        sharded = next((layout for layout in layouts if layout.get("distributed_optimizer")), None)
        if sharded is not None or self.sharded_optimizer:
            raise self._unreshardable(folder, sharded or layouts[0], "a checkpoint resumes in another layout only "
                                      "without --use-distributed-optimizer on either side (its Adam state is divided "
                                      "among the data-parallel ranks, which resharding does not yet join)")
        return resharded_state(states, self._trained_models(), folder, self._whole_shapes())

    def _gpt_models(self) -> list[GPTModel]:
        return [model.model for model in self._trained_models()]

    def _whole_shapes(self) -> list[Shapes]:
        """The shapes of the models this trainer trains (:func:`model_shapes`), joined over its pipeline stages:
        what a checkpoint of another layout must hold, whatever stages saved it."""
        mine = model_shapes(self._gpt_models())
        if self.pipeline_parallel == 1:
            return mine
        stages = gather_plain(mine, group=parallel_state.get_pipeline_model_parallel_group())
        return [{name: tuple(shape) for stage in stages for name, shape in stage[role].items()}
                for role in range(len(mine))]

    def _unreshardable(self, folder: Path, saved: dict[str, Any], why: str) -> ValueError:
        """The refusal of a checkpoint that resharding cannot read in this layout: the saving run's layout
        flags, every one of them, so that passing them resumes it."""
        flags = " ".join(f"{flag} {saved.get(key, 1)}" for key, flag in _LAYOUT_FLAGS)
        optimizer = " --use-distributed-optimizer" if saved.get("distributed_optimizer") else ""
        return ValueError(f"{folder} was saved in layout {saved} and this trainer's is {self.layout}: {why}; resume "
                          f"with the saving run's {flags}{optimizer}, or start a new run from its model folder (a "
                          "Hugging Face folder, any layout reads it)")

    def _state_file(self, folder: Path) -> Path:
        if dist.get_world_size() == 1:
            return super()._state_file(folder)
        copy = f"-dp{parallel_state.get_data_parallel_rank()}" if self.data_parallel > 1 else ""
        experts = "-ep" if self.expert_parallel > 1 else ""  # its optimizer state holds other tensors
        stage = f"-pp{parallel_state.get_pipeline_model_parallel_rank()}" if self.pipeline_parallel > 1 else ""
        return folder / f"trainer-tp{parallel_state.get_tensor_model_parallel_rank()}{copy}{experts}{stage}.pt"

    def _load_policy_weights(self, folder: Path) -> None:
        load_hf_weights(self.policy.model, read_hf_folder(folder)[1], self.hf_config)


def _last_stage() -> int:
    """The global rank of the last pipeline stage in this rank's pipeline group (where the loss is computed)."""
    group = parallel_state.get_pipeline_model_parallel_group()
    return dist.get_global_rank(group, dist.get_world_size(group) - 1)
