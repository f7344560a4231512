"""An OpenAI-compatible endpoint through which an external agent drives a rollout worker's episodes.

With ``--openai-endpoint HOST:PORT`` a rollout worker does not generate its groups itself: each
response of a group becomes an episode that an agent claims and drives with any OpenAI client::

    task = POST /episodes                      -> {"id", "messages", "label", "metadata", "base_url"}
    client = OpenAI(base_url=task["base_url"], api_key="none")
    client.chat.completions.create(model=..., messages=[...], tools=[...], stream=False | True)
    ...                                        (tool results or user messages, then another completion)
    POST /episodes/ID/end  {"reward": 1.0}     (or no reward: the run's reward function scores it)

Token in, token out: the first completion renders the agent's messages with the chat template --
that is the sample's prompt. Every later request must repeat the conversation so far; only the
messages added since the last reply are rendered (as the template writes a turn after an
assistant's) and inserted under loss mask 0, while each reply's tokens are the engine's own, with
their log-probs and weight versions. A request that rewrites earlier messages cannot be kept
token-exact and is refused. Sampling is the run's (the trainer recomputes log-probs at its
temperature): a request asking another temperature or top-p is refused; ``max_tokens`` only
shortens a reply. A reply's ``<tool_call>`` blocks come back as OpenAI ``tool_calls``; the choice
also carries ``token_ids``, the reply's tokens.

:func:`serve_agents` starts the HTTP server (``vime.transports.http``) for a worker and writes its URL to
RUN_DIR/endpoints/NAME; the worker offers each response of a group it admits (:meth:`AgentEndpoint.offer`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from vime.agent.episode import Episode, parse_tool_calls, turn_ids, turn_text
from vime.backends.base import SamplingParams, Sequence
from vime.tasks import Changed
from vime.transports import http
from vime.transports.http import HTTPError, Request, Response

if TYPE_CHECKING:
    from vime.config import AgentConfig

_CALL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)
_EPISODE = re.compile(r"^/episodes/([0-9a-f]{32})(/v1/chat/completions|/end)$")


class TurnHost(Protocol):
    """What the endpoint needs from the rollout worker that serves it."""

    tokenizer: Any
    stepped: Changed  # notified after every engine step
    counters: Any  # collections.Counter of the worker's status

    def start_turn(self, prompt_ids: list[int], params: SamplingParams,
                   stream: bool) -> tuple[Sequence, trio.Event]: ...

    def start_soon(self, fn: Any, *args: Any) -> None: ...

    async def end_response(self, group: Any, index: int, episode: Episode, finish_reason: str,
                           reward: float | None) -> None: ...


@dataclasses.dataclass
class _Open:
    """An episode offered to agents: one response of a group."""

    id: str
    group: Any
    index: int
    messages: list[dict[str, Any]]
    label: str
    metadata: dict[str, Any]
    sampling: SamplingParams
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # what the next request must repeat
    episode: Episode | None = None
    last: Sequence | None = None  # the latest reply's turn
    busy: bool = False
    claimed: bool = False
    active: float = 0.0  # trio.current_time() of the agent's latest request or reply


async def serve_agents(host: TurnHost, nursery: trio.Nursery, agent: AgentConfig, thinking: bool, run_dir: Path,
                       name: str) -> AgentEndpoint:
    """Serve the endpoint of ``host`` (a rollout worker named ``name``) at ``--openai-endpoint`` HOST:PORT (port 0:
    any free one) in ``nursery``; its URL goes to RUN_DIR/endpoints/NAME. Claimed episodes whose agent stays silent
    for ``--episode-timeout-s`` are offered again. ValueError, before anything is served, for a tokenizer whose
    chat template cannot render conversations turn by turn (every completion would fail)."""
    check_chat_template(host.tokenizer, thinking)
    served: list[AgentEndpoint] = []  # the endpoint needs the URL, known once the server has bound its port

    async def handle(request: Request) -> Response:
        return await served[0].handle(request)

    bind, _, port = agent.openai_endpoint.rpartition(":")
    bound = await nursery.start(functools.partial(http.serve, handle, bind, int(port), counters=host.counters))
    endpoint = AgentEndpoint(host, f"http://{bind}:{bound}", thinking=thinking,
                             max_response_tokens=agent.max_response_tokens)
    served.append(endpoint)
    host.start_soon(endpoint.expire_idle, agent.episode_timeout_s)
    folder = run_dir / "endpoints"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(endpoint.url + "\n")
    return endpoint


def check_chat_template(tokenizer: Any, thinking: bool) -> None:
    """ValueError unless ``tokenizer`` renders a conversation with its chat template and closes an assistant's
    turn with its EOS token (how a later turn's messages are inserted token by token)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--openai-endpoint: the tokenizer in --model-path has no chat template, with which agents' "
                         "messages are rendered; use a model folder whose tokenizer has one")
    try:
        turn_ids(tokenizer, [{"role": "user", "content": "probe"}], ended_with_eos=True, thinking=thinking)
    except ValueError as err:
        raise ValueError(f"--openai-endpoint: {err}") from None


class AgentEndpoint:
    def __init__(self, host: TurnHost, url: str, *, thinking: bool, max_response_tokens: int) -> None:
        self.host, self.url = host, url
        self.thinking, self.max_response_tokens = thinking, max_response_tokens
        self.waiting: deque[_Open] = deque()
        self.episodes: dict[str, _Open] = {}

    def offer(self, group: Any, index: int, messages: list[dict[str, Any]], label: str, metadata: dict[str, Any],
              sampling: SamplingParams) -> None:
        """Make one response of ``group`` an episode for the next agent that asks."""
        episode = _Open(uuid.uuid4().hex, group, index, messages, label, metadata, sampling)
        self.episodes[episode.id] = episode
        self.waiting.append(episode)

    async def expire_idle(self, timeout_s: float) -> None:
        """Offer again, from scratch and under a new id, every claimed episode whose agent has been silent
        for ``timeout_s``: an agent that died must not hold its group forever."""
        while True:
            await trio.sleep(min(1.0, timeout_s / 4))
            now = trio.current_time()
            silent = [e for e in self.episodes.values() if e.claimed and not e.busy and now - e.active > timeout_s]
            for episode in silent:
                del self.episodes[episode.id]
                self.offer(episode.group, episode.index, episode.messages, episode.label, episode.metadata,
                           episode.sampling)
                self.host.counters["episodes_offered_again"] += 1

    def withdraw(self) -> None:
        """Forget every episode (the worker handed its groups back): agents hear 404 from now on."""
        self.waiting.clear()
        self.episodes.clear()

    async def handle(self, request: Request) -> Response:
        if request.method == "POST" and request.path == "/episodes":
            return Response(self._claim())
        match = _EPISODE.match(request.path)
        if request.method != "POST" or match is None:
            raise HTTPError(404, f"no route {request.method} {request.path}; POST /episodes claims an episode, then "
                                 "POST /episodes/ID/v1/chat/completions and POST /episodes/ID/end")
        episode = self.episodes.get(match[1])
        if episode is None:
            raise HTTPError(404, f"no open episode {match[1]}: ended, offered again after --episode-timeout-s of "
                                 "silence, or handed back when its worker left")
        if match[2] == "/end":
            return Response(await self._end(episode, request.body))
        return await self._complete(episode, request.body)

    def _claim(self) -> dict[str, Any]:
        if not self.waiting:
            return {"id": None}
        episode = self.waiting.popleft()
        episode.claimed, episode.active = True, trio.current_time()
        return {"id": episode.id, "messages": episode.messages, "label": episode.label, "metadata": episode.metadata,
                "base_url": f"{self.url}/episodes/{episode.id}/v1"}

    async def _end(self, episode: _Open, body: dict[str, Any]) -> dict[str, Any]:
        reward = body.get("reward")
        if reward is not None and not (type(reward) in (int, float) and math.isfinite(reward)):  # (not a bool)
            raise HTTPError(400, f"reward must be a finite number or left out, not {reward!r}")
        if episode.busy or episode.episode is None or episode.last is None:
            raise HTTPError(409, "the episode has no finished reply yet: end it after a completion has returned")
        del self.episodes[episode.id]
        await self.host.end_response(episode.group, episode.index, episode.episode,
                                     episode.last.finish_reason or "length", None if reward is None else float(reward))
        return {"id": episode.id, "ended": True, "tokens": len(episode.episode.response_ids)}

    async def _complete(self, episode: _Open, body: dict[str, Any]) -> Response:
        _check_types(body)
        if episode.busy:
            raise HTTPError(409, "a completion of this episode is still running; wait for it")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                      for m in messages):
            raise HTTPError(400, "messages must be a list of {role, content} objects")
        self._check_sampling(episode, body)
        asked = next((body[key] for key in ("max_completion_tokens", "max_tokens") if body.get(key) is not None),
                     episode.sampling.max_new_tokens)
        if not isinstance(asked, int) or asked < 1:
            raise HTTPError(400, f"max_tokens must be a positive integer, not {asked!r}")
        prompt, inserted = self._context(episode, messages, body.get("tools"))
        held = (0 if episode.episode is None else len(episode.episode.response_ids)) + len(inserted)
        room = self.max_response_tokens - held
        if room <= 0:
            raise HTTPError(400, f"the episode would hold {held} of its {self.max_response_tokens} response tokens "
                                 "(--max-response-tokens) before this reply: end it")
        # Only a request taken whole changes the episode: a refused one can be corrected and sent again.
        if episode.episode is None:
            episode.episode = Episode(prompt)
        episode.episode.add_inserted(inserted)
        params = dataclasses.replace(episode.sampling, max_new_tokens=min(asked, room, episode.sampling.max_new_tokens))
        sequence, done = self.host.start_turn(episode.episode.prompt_ids + episode.episode.response_ids, params,
                                              stream=bool(body.get("stream")))
        episode.busy, episode.active = True, trio.current_time()
        episode.history = [*messages]
        recorded = trio.Event()
        reply: dict[str, Any] = {}

        async def record() -> None:
            await done.wait()
            reply.update(self._record(episode, sequence, bool(body.get("logprobs"))))
            recorded.set()
            self.host.stepped.notify()  # a stream waiting for the next step learns it was the last

        self.host.start_soon(record)
        created, model = int(time.time()), str(body.get("model", ""))
        if body.get("stream"):
            return Response(events=self._stream(sequence, recorded, reply, created, model))
        await recorded.wait()
        return Response({"id": f"chatcmpl-{sequence.request_id}", "object": "chat.completion",
                         "created": created, "model": model, "usage": reply["usage"],
                         "choices": [{"index": 0, "message": reply["message"], "finish_reason": reply["finish_reason"],
                                      "logprobs": reply["logprobs"], "token_ids": reply["token_ids"]}]})

    def _check_sampling(self, episode: _Open, body: dict[str, Any]) -> None:
        """The run's sampling, or a refusal: log-probs of another distribution would be trained on wrongly."""
        if body.get("n", 1) != 1:
            raise HTTPError(400, "n must be 1: an episode is one response (a group's others are episodes of their own)")
        for key, value in (("temperature", episode.sampling.temperature), ("top_p", episode.sampling.top_p)):
            if body.get(key) is not None and body[key] != value:
                raise HTTPError(400, f"{key} is the run's, {value} (the trainer recomputes log-probs at it); "
                                     f"leave {key} out")

    def _context(self, episode: _Open, messages: list[dict[str, Any]], tools: Any) -> tuple[list[int], list[int]]:
        """What this request adds, without changing the episode: the prompt (the first request's messages
        rendered), or the tokens of the messages new since the last reply."""
        tokenizer = self.host.tokenizer
        if episode.episode is None:
            ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                enable_thinking=self.thinking)
            return list(ids if isinstance(ids, list) else ids["input_ids"]), []
        known = episode.history
        if len(messages) <= len(known) or any(_fingerprint(a) != _fingerprint(b)
                                              for a, b in zip(messages, known)):
            raise HTTPError(400, f"messages must repeat the conversation so far ({len(known)} messages, the last "
                                 "the assistant's reply) and add tool results or a user message after it; an "
                                 "edited history cannot be trained token for token: start a new episode")
        new = messages[len(known):]
        if any(m["role"] not in ("tool", "user") for m in new):
            raise HTTPError(400, "after the assistant's reply, only tool and user messages may be added")
        assert episode.last is not None
        ended = bool(episode.last.response_ids) and episode.last.response_ids[-1] == tokenizer.eos_token_id
        added = [{"role": m["role"], "content": _text(m)} for m in new]
        return episode.episode.prompt_ids, turn_ids(tokenizer, added, ended_with_eos=ended, thinking=self.thinking)

    def _record(self, episode: _Open, sequence: Sequence, logprobs: bool) -> dict[str, Any]:
        """Keep the reply's tokens in the episode; the reply as OpenAI's message."""
        assert episode.episode is not None
        tokenizer = self.host.tokenizer
        episode.episode.add_generated(sequence.response_ids, sequence.logprobs, sequence.versions)
        episode.last = sequence
        episode.busy, episode.active = False, trio.current_time()
        text = turn_text(tokenizer, sequence.response_ids)
        calls = [call for call in parse_tool_calls(text) if not call.error]
        message: dict[str, Any] = {"role": "assistant", "content": _visible(text)}
        if calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                     for c in calls]
        episode.history.append(message)
        finish = "tool_calls" if calls else ("stop" if sequence.finish_reason == "stop" else "length")
        return {"message": message, "finish_reason": finish, "token_ids": list(sequence.response_ids),
                "logprobs": {"content": [{"token": tokenizer.convert_ids_to_tokens(t), "logprob": lp, "bytes": None,
                                          "top_logprobs": []}
                                         for t, lp in zip(sequence.response_ids, sequence.logprobs)]}
                if logprobs else None,
                "usage": {"prompt_tokens": len(sequence.prompt_ids), "completion_tokens": len(sequence.response_ids),
                          "total_tokens": len(sequence.prompt_ids) + len(sequence.response_ids)}}

    async def _stream(self, sequence: Sequence, recorded: trio.Event, reply: dict[str, Any], created: int,
                      model: str) -> AsyncIterator[dict[str, Any]]:
        """Chunks as the engine steps: the reply's visible text as it grows, its tool calls at the end."""
        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
            return {"id": f"chatcmpl-{sequence.request_id}", "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}

        yield chunk({"role": "assistant", "content": ""})
        sent = ""
        while True:
            finished = recorded.is_set()
            text = reply["message"]["content"] if finished else _visible(turn_text(self.host.tokenizer,
                                                                                   sequence.response_ids))
            if text.startswith(sent) and len(text) > len(sent):
                yield chunk({"content": text[len(sent):]})
                sent = text
            if finished:
                break
            if not recorded.is_set():  # (it may have been set while the last chunk was being written)
                await self.host.stepped.wait()
        if "tool_calls" in reply["message"]:
            yield chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(reply["message"]["tool_calls"])]})
        yield chunk({}, reply["finish_reason"], token_ids=reply["token_ids"], logprobs=reply["logprobs"])


_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str,), "a string"), "stream": ((bool,), "true or false"), "logprobs": ((bool,), "true or false"),
    "max_tokens": ((int,), "a positive integer"), "max_completion_tokens": ((int,), "a positive integer"),
    "n": ((int,), "an integer"), "temperature": ((int, float), "a number"), "top_p": ((int, float), "a number"),
    "tools": ((list,), "a list"), "messages": ((list,), "a list of {role, content} objects")}


def _check_types(body: dict[str, Any]) -> None:
    """A field of a completion request of the wrong JSON type is refused whatever the episode's state, so a
    client learns of its mistake at once (``null`` is the field left out; a bool is no number)."""
    for name, (types, what) in _FIELD_TYPES.items():
        value = body.get(name)
        if value is not None and type(value) not in types:
            raise HTTPError(400, f"{name} must be {what}, not {value!r:.80}")
    for message in body.get("messages") or []:
        if not (isinstance(message, dict) and message.get("role") in _ROLES
                and (message.get("content") is None or _is_content(message["content"]))):
            raise HTTPError(400, f"messages must be {{role, content}} objects, role one of {sorted(_ROLES)} and "
                                 f"content text or a list of text parts, not {message!r:.80}")
    for tool in body.get("tools") or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        named = isinstance(function, dict) and isinstance(function.get("name"), str)
        if not (named and tool.get("type") == "function"):
            raise HTTPError(400, f'tools must be {{"type": "function", "function": {{"name", ...}}}} objects, not '
                                 f"{tool!r:.80}")


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _is_content(content: Any) -> bool:
    return isinstance(content, str) or (isinstance(content, list) and all(
        isinstance(part, dict) and isinstance(part.get("text", ""), str) for part in content))


def _visible(text: str) -> str:
    """The text a reply shows so far: finished tool-call blocks removed, an unfinished one (and a
    character still being decoded) held back."""
    text = _CALL_BLOCK.sub("", text)
    return text.split("<tool_call>", 1)[0].rstrip("\ufffd")


def _text(message: dict[str, Any]) -> str:
    """A message's content as text (OpenAI allows a list of text parts)."""
    content = message.get("content") or ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _fingerprint(message: dict[str, Any]) -> tuple[str, str]:
    """What must not change when a conversation is repeated: the role, and the text of all but the
    assistant's replies (clients rebuild those in their own shape)."""
    return message["role"], "" if message["role"] == "assistant" else _text(message).strip()
