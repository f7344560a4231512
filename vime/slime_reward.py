"""slime's custom reward, ``--custom-rm-path``, on vime's reward path.

slime calls a user's reward as ``await custom_rm(args, sample)``: ``args`` its parsed command line, ``sample`` its
``slime.utils.types.Sample``, the return a number (or a dict, of which slime's ``--reward-key`` picks one). vime's
own plug-in is ``fn(response, label, **metadata)`` (``--custom-reward``). A function named by ``--custom-rm-path``
is wrapped in :class:`SlimeReward`, which builds a slime-like sample and ``args`` for each call, so a slime user's
reward runs unchanged where vime's run: plain ones in the reward worker processes, async ones in the reward actor,
each call under ``--reward-timeout`` (``vime.reward_workers``). It is imported by its path in each process that
calls it, never sent; what travels to a worker is the sample's plain fields (msgpack).

What differs from slime: a plain (not async) function is taken too (slime awaits the call, so it takes async only);
``module:function`` is taken beside slime's ``module.function``; a dict return is refused (vime has no
``--reward-key``: return the number); slime's batched form ``custom_rm(args, samples)`` (``--group-rm``) and a
sample's own ``custom_rm_path`` are not read. It imports no torch: a worker process stays small.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
from typing import Any, Callable

from vime.plugins import import_function

FLAG = "--custom-rm-path"


@dataclasses.dataclass
class SlimeSample:
    """The fields of slime's ``Sample`` that vime fills, with slime's names and meanings.

    Filled: ``group_index`` (the prompt group's id, counted over the run), ``prompt`` (the prompt as the engine saw
    it, decoded from its tokens: slime's too is that text with ``--apply-chat-template``; without it slime's is the
    data row's prompt as it is), ``tokens`` (prompt then response token ids), ``response`` (the response text,
    special tokens skipped), ``response_length`` (its tokens), ``label``, ``metadata`` (the data row's ``metadata``
    field, as slime reads it with its default ``--metadata-key metadata``; {} when the row has none. vime's
    ``--custom-reward`` gets the row's other fields instead), ``status`` (COMPLETED for a response that stopped,
    TRUNCATED for one cut at its length limit).

    Not filled, there at slime's defaults: ``index`` (slime counts samples over the run; vime numbers them within
    the group), ``reward``, ``loss_mask``, ``rollout_log_probs``, ``weight_versions`` and ``remove_sample``. Not
    there (AttributeError): slime's other fields, the multimodal inputs, ``rollout_routed_experts``, the teacher
    log-probs, ``train_metadata``, ``session_id``, ``generate_function_path`` and the rollout statistics.
    """

    class Status(enum.Enum):
        """slime's ``Sample.Status``, by the same names and values."""

        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    prompt: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = dataclasses.field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def sample_fields(sample: Any) -> dict[str, Any]:
    """What a :class:`SlimeSample` is built from, beyond the response, label and metadata every reward gets: plain
    values taken from vime's ``Sample`` (``vime.messages.pipeline``) that a reward worker can be sent."""
    return {"group_index": sample.group_id, "prompt": sample.prompt_text,
            "tokens": [*sample.prompt_ids, *sample.response_ids], "response_length": len(sample.response_ids),
            "finish_reason": sample.finish_reason}


def slime_sample(response: str, label: str, metadata: dict[str, Any], fields: dict[str, Any]) -> SlimeSample:
    """The sample a slime reward is called with, from one call's response, label, metadata and
    :func:`sample_fields` (``{}`` where there is no rollout sample: the preflight's call on a label)."""
    row_metadata = metadata.get("metadata")
    status = {"stop": SlimeSample.Status.COMPLETED, "length": SlimeSample.Status.TRUNCATED}.get(
        fields.get("finish_reason", ""), SlimeSample.Status.COMPLETED)
    return SlimeSample(group_index=fields.get("group_index"), prompt=fields.get("prompt", ""),
                       tokens=list(fields.get("tokens", [])), response=response,
                       response_length=fields.get("response_length", 0), label=label,
                       metadata=dict(row_metadata) if isinstance(row_metadata, dict) else {}, status=status)


def slime_args(settings: dict[str, dict[str, Any]] | None) -> argparse.Namespace:
    """slime's ``args`` for a run's settings (``RunConfig.to_dict()``): every setting under vime's name and under
    each flag that spells it, slime's aliases among them (``args.hf_checkpoint`` is ``args.model_path``,
    ``args.n_samples_per_prompt`` is ``args.group_size``), with vime's value. slime's arguments that are no vime
    setting (``args.rm_url``, ``args.reward_key``, Megatron's) are absent: reading one raises AttributeError."""
    from vime.config import RunConfig
    from vime.settings import flags_of

    config, values = RunConfig() if settings is None else RunConfig.from_dict(settings), {}
    for part in dataclasses.fields(config):
        section = getattr(config, part.name)
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            values[field.name] = value
            for flag in flags_of(field):
                values.setdefault(flag.removeprefix("--").replace("-", "_"), value)
    return argparse.Namespace(**values)


class SlimeReward:
    """A reward function of slime's signature, ``custom_rm(args, sample)``, sync or async, with the ``args`` of the
    run it scores for. :func:`vime.rewards.call` calls it with a :class:`SlimeSample` built per call."""

    def __init__(self, function: Callable[..., Any], args: argparse.Namespace) -> None:
        self.function, self.args = function, args
        self.__qualname__ = getattr(function, "__qualname__", repr(function))  # named in vime's reward errors

    def __call__(self, response: str, label: str, metadata: dict[str, Any], fields: dict[str, Any]) -> Any:
        """The function's value for one response: a number, or a coroutine giving one when it is async."""
        return self.function(self.args, slime_sample(response, label, metadata, fields))


def load(spec: str, settings: dict[str, dict[str, Any]] | None = None) -> SlimeReward:
    """The function ``--custom-rm-path spec`` names (slime's ``package.module.function``, or vime's
    ``package.module:function``), checked to take slime's ``(args, sample)``, with the ``args`` of the run's
    ``settings`` (``RunConfig.to_dict()``; None: vime's defaults); ValueError saying what to fix."""
    function = import_function(spec, FLAG, dotted=True)
    name = getattr(function, "__qualname__", function)
    if parameters(function)[:2] == ["response", "label"]:  # it would bind (args, sample) and score the wrong things
        raise ValueError(f"{FLAG} {spec}: {name} takes (response, label, ...), vime's signature: pass it as "
                         f"--custom-reward, or write it as slime's custom_rm(args, sample)")
    try:
        inspect.signature(function).bind("args", "sample")
    except TypeError as err:
        raise ValueError(f"{FLAG} {spec}: {name} does not take slime's (args, sample) ({err}); write it as "
                         "custom_rm(args, sample), or pass a function of (response, label, **metadata) as "
                         "--custom-reward instead") from None
    return SlimeReward(function, slime_args(settings))


def parameters(function: Callable[..., Any]) -> list[str]:
    """The names of ``function``'s parameters, to tell slime's signature from vime's; [] when it has none to read."""
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return []
