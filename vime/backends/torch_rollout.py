"""The reference rollout engine: batched sampling with a KV cache in plain PyTorch.

Runs any Hugging Face causal LM on CPU (or one GPU). Sequences are generated
in static batches: a batch is prefilled together (left-padded) and decoded
one token per ``step`` until all of its sequences finish; sequences added
meanwhile start with the next batch. Weights loaded between steps apply to
the very next token; the KV cache of tokens already generated is kept (the
vLLM in-flight update does the same), and each token records its version.

With ``record_experts`` (routing replay, MoE models), each finished
sequence carries the experts its prompt and response tokens were routed to
(``vime.backends.routing_replay``).

Deliberately missing: continuous batching and paged attention -- that is
what the vLLM engine is for.
"""

from __future__ import annotations

import collections
import contextlib
import inspect

import torch

from vime.backends import routing_replay
from vime.backends.base import RolloutEngine, Sequence
from vime.backends.hf import in_memory_names, load_causal_lm, position_ids, scaled_logprobs, warn_if_bf16_is_emulated
from vime.transports.gpu import gpu_uuid


class TorchRolloutEngine(RolloutEngine):
    def __init__(self, model_path: str, *, dtype: str = "fp32", max_batch_size: int = 1024, seed: int = 0,
                 device: str = "cpu", record_experts: bool = False) -> None:
        warn_if_bf16_is_emulated(dtype, device)
        self.model = load_causal_lm(model_path, dtype).to(device)
        self.record_experts = record_experts
        if record_experts and not routing_replay.moe_routers(self.model):
            raise ValueError("routing replay needs a mixture-of-experts model; this one has no MoE routers")
        # transformers 5.24 renamed past_key_values to cache; older releases know only the old name.
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.device = device
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self.generator = torch.Generator().manual_seed(seed)  # seeds the sequences that bring no seed
        self._draws: dict[int, torch.Generator] = {}  # each unfinished sequence's own stream, by request id
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._cache = None
        self._mask: torch.Tensor | None = None
        self._last_tokens: torch.Tensor | None = None
        self._routed: list[list[torch.Tensor]] = []  # with record_experts: each running row's experts, per forward

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._running)

    def add(self, sequences: list[Sequence]) -> None:
        for sequence in sequences:
            seed = sequence.seed if sequence.seed is not None else int(
                torch.randint(2**62, (1,), generator=self.generator))
            self._draws[sequence.request_id] = torch.Generator().manual_seed(seed)
        self._waiting.extend(sequences)

    def abort(self, request_ids: list[int]) -> None:
        """Queued sequences leave the queue; running ones stop growing and keep their row until the
        batch ends (static batching)."""
        stop = set(request_ids)
        self._waiting = collections.deque(s for s in self._waiting if s.request_id not in stop)
        for request_id in stop:
            self._draws.pop(request_id, None)
        for sequence in self._running:
            if sequence.request_id in stop and sequence.finish_reason is None:
                sequence.finish_reason = "abort"
        self._end_batch_if_done()

    def _end_batch_if_done(self) -> None:
        if all(s.finish_reason is not None for s in self._running):
            self._running, self._cache, self._mask, self._last_tokens, self._routed = [], None, None, None, []

    @torch.no_grad()
    def gpus(self) -> list[str]:
        device = torch.device(self.device)
        return [gpu_uuid(device.index)] if device.type == "cuda" else []

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Every parameter, by the model's own names or a checkpoint's (experts one by one); buffers
        such as GLM-4.5's expert score bias may come too."""
        tensors = in_memory_names(tensors)
        params = dict(self.model.named_parameters())
        targets = {**dict(self.model.named_buffers()), **params}
        missing = set(params) - set(tensors)
        unknown = set(tensors) - set(targets)
        if missing or unknown:
            raise ValueError(f"weights for version {version} do not fit the model: "
                             f"missing {sorted(missing)[:5]}, unknown {sorted(unknown)[:5]}")
        for name, tensor in tensors.items():
            targets[name].copy_(tensor)
        self.weight_version = version

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        if not self._running and not self._waiting:
            return []
        recorder = routing_replay.recording(self.model) if self.record_experts else contextlib.nullcontext([])
        with recorder as routed:
            logits = self._decode() if self._running else self._prefill()
        if routed:
            self._keep_experts(routed[0])
        return self._sample(logits)

    def _keep_experts(self, experts: torch.Tensor) -> None:
        """Keep this forward's experts (``[rows x width, layers, top_k]``) for each unfinished sequence;
        they are joined once, when the sequence finishes."""
        experts = experts.view(len(self._running), -1, *experts.shape[1:]).cpu()
        if not self._routed:  # the prefill: each prompt's own positions (rows are left-padded)
            self._routed = [[experts[row, -len(s.prompt_ids):]] for row, s in enumerate(self._running)]
            return
        for row, sequence in enumerate(self._running):
            if sequence.finish_reason is None:
                self._routed[row].append(experts[row])

    def _prefill(self) -> torch.Tensor:
        count = min(len(self._waiting), self.max_batch_size)
        self._running = [self._waiting.popleft() for _ in range(count)]
        width = max(len(s.prompt_ids) for s in self._running)
        pad = self.model.config.pad_token_id or 0
        ids = torch.full((count, width), pad, dtype=torch.long)
        self._mask = torch.zeros((count, width), dtype=torch.long)
        for row, sequence in enumerate(self._running):
            ids[row, width - len(sequence.prompt_ids):] = torch.tensor(sequence.prompt_ids)
            self._mask[row, width - len(sequence.prompt_ids):] = 1
        from transformers import DynamicCache

        self._cache = DynamicCache()
        ids, self._mask = ids.to(self.device), self._mask.to(self.device)
        out = self.model(input_ids=ids, attention_mask=self._mask, position_ids=position_ids(self._mask),
                         use_cache=True, logits_to_keep=1, **{self._cache_arg: self._cache})
        return out.logits[:, -1]

    def _decode(self) -> torch.Tensor:
        assert self._mask is not None and self._last_tokens is not None
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        positions = position_ids(self._mask)[:, -1:]
        out = self.model(input_ids=self._last_tokens.unsqueeze(1), attention_mask=self._mask, position_ids=positions,
                         use_cache=True, **{self._cache_arg: self._cache})
        return out.logits[:, -1]

    def _sample(self, logits: torch.Tensor) -> list[Sequence]:
        """Sample one token per running sequence; return the sequences that just finished."""
        temperature = torch.tensor([s.params.temperature for s in self._running], device=logits.device)
        logprobs = scaled_logprobs(logits, temperature)
        filtered = _top_k_top_p(logprobs, [s.params.top_k for s in self._running],
                                [s.params.top_p for s in self._running])
        tokens = _sample_tokens(filtered, self._uniforms())
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        self._last_tokens = tokens
        finished = []
        for row, (sequence, token, logprob) in enumerate(zip(self._running, tokens.tolist(), chosen.tolist())):
            if sequence.finish_reason is not None:
                continue
            sequence.response_ids.append(token)
            sequence.logprobs.append(logprob)
            sequence.versions.append(self.weight_version)
            if token in sequence.params.stop_token_ids:
                sequence.finish_reason = "stop"
            elif len(sequence.response_ids) >= sequence.params.max_new_tokens:
                sequence.finish_reason = "length"
            if sequence.finish_reason is not None:
                if self._routed:
                    sequence.routed_experts = torch.cat(self._routed[row])
                self._draws.pop(sequence.request_id, None)
                finished.append(sequence)
        self._end_batch_if_done()
        return finished

    def _uniforms(self) -> torch.Tensor:
        """One uniform draw per running row ([rows, 1], float64), each from its sequence's own stream; a row
        whose sequence has finished (its batch goes on) draws nothing."""
        draws = [torch.rand(1, generator=self._draws[s.request_id], dtype=torch.float64)
                 if s.request_id in self._draws else torch.zeros(1, dtype=torch.float64) for s in self._running]
        return torch.stack(draws).to(self.device)


def _sample_tokens(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(logprobs), by inverting the row's CDF (float64) at the row's uniform
    draw (``uniforms``, [rows, 1] in [0, 1)): exact like torch.multinomial, which on CPU is about 20 times
    slower over a 150k vocabulary."""
    cdf = torch.cumsum((logprobs - logprobs.max(dim=-1, keepdim=True).values).double().exp(), dim=-1)
    draw = uniforms * cdf[:, -1:]
    return torch.searchsorted(cdf, draw, right=True).squeeze(1).clamp_(max=cdf.shape[-1] - 1)


def _top_k_top_p(logprobs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k and nucleus (top-p); rows with neither pass unchanged.

    When every row has a top-k, only the best max(k) tokens are ranked (torch.topk) rather than
    sorting the whole vocabulary: the nucleus lies inside them, and the sort dominates on CPU."""
    if all(k == 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logprobs
    vocab = logprobs.shape[-1]
    ranked = min(vocab, max(top_k)) if all(k > 0 for k in top_k) else vocab
    sorted_lp, order = torch.topk(logprobs, ranked, dim=-1) if ranked < vocab else torch.sort(
        logprobs, dim=-1, descending=True)
    ranks = torch.arange(ranked, device=logprobs.device).expand_as(sorted_lp)
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logprobs.device).unsqueeze(1)
    drop = ranks >= k
    p = torch.tensor(top_p, device=logprobs.device, dtype=torch.float32).unsqueeze(1)
    cumulative = torch.cumsum(sorted_lp.exp(), dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    # Keep the smallest prefix whose mass reaches p (always at least one token); p = 1 keeps all,
    # whatever fp32 rounding does to the running sum.
    drop |= (mass_before >= p) & (p < 1.0)
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    return torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)
