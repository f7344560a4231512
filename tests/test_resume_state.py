"""What a resumed run takes back beyond the trainer's and the buffer's checkpoint: the router's counters and
the groups it held at the crash (real processes, a trainer killed with kill -9), and the rollout side's sampling,
which is a function of the run's seed and the response alone, tool turns included."""

from __future__ import annotations

import json
import signal

import pytest
import trio
from test_episode import TOKENIZER, ScriptedEngine, _engine_output, rollout_group

from vime import checkpoint
from vime.cluster import Cluster
from vime.config import RunConfig
from vime.devtools.make_tiny_model import make_tiny_model
from vime.messages.runtime import StatusQuery
from vime.metrics import MetricsFollower
from vime.pipeline import RunFailed, train
from vime.scenarios import arithmetic
from vime.seeds import sampling_seed

STEPS = 12  # the run still going when the second part's row is seen (a step takes a fraction of a second)


@pytest.mark.slow  # about 90 s on 2 cores: two runs, the first ended by a kill -9
async def test_a_resumed_run_keeps_the_routers_counters_and_counts_the_groups_it_held(tmp_path):
    run_dir = tmp_path / "run"
    config = arithmetic.prepare(run_dir, arithmetic.defaults().replace(
        steps=STEPS, save_every=2, rollout_workers=2, rollout_batch_size=8, rollout_capacity=2, max_staleness=1,
        max_new_tokens=8))
    before: dict[str, int] = {}
    done: set[str] = set()

    async def router_holds(job: Cluster, workers: tuple[str, ...]) -> dict[str, int]:
        """Once the router has given one of the frozen ``workers`` a group, its counters."""
        with trio.fail_after(60):
            while True:
                counters = (await job.ask("router", StatusQuery())).counters
                if any(counters.get(f"assigned:{worker}") for worker in workers):
                    return counters
                await trio.sleep(0.05)

    async def kill_a_worker_then_the_trainer(job: Cluster, row: dict) -> None:
        """Each part at the first row at or past its step: the run goes on while a part waits, so the next row
        seen may be several steps on."""
        if row["step"] >= 2 and "worker" not in done:  # frozen with groups, then killed: the router re-issues them
            done.add("worker")
            # rollout-1 frozen meanwhile, so the run waits for rollout-0: on a loaded machine it may not be ready
            # yet, and frozen before it is, it is never given a group
            job.kill("rollout-1", signal.SIGSTOP)
            with trio.fail_after(120):
                while "assigned:rollout-0" not in (await job.ask("router", StatusQuery())).counters:
                    await trio.sleep(0.05)
            job.kill("rollout-0", signal.SIGSTOP)
            await router_holds(job, ("rollout-0",))
            job.kill("rollout-0")
            job.kill("rollout-1", signal.SIGCONT)
            with trio.fail_after(60):
                while not (await job.ask("router", StatusQuery())).counters.get("reissued"):
                    await trio.sleep(0.05)
        elif row["step"] >= 5 and "trainer" not in done:  # after a checkpoint; the workers frozen hold groups
            done.add("trainer")
            for worker in ("rollout-0", "rollout-1"):
                job.kill(worker, signal.SIGSTOP)
            before.update(await router_holds(job, ("rollout-0", "rollout-1")))
            job.kill("trainer")

    with pytest.raises(RunFailed, match="trainer died"):
        await train(config, run_dir, on_step=kill_a_worker_then_the_trainer, timeout_s=300)
    held = json.loads((checkpoint.folder(run_dir) / "router.json").read_text())["held"]
    assert before["reissued"] > 0 and held
    summary = await train(config, run_dir, resume=True, timeout_s=300)
    groups = summary["groups"]
    assert groups["reissued"] >= before["reissued"]  # was 0: a resumed router started its counters afresh
    assert groups["held_by_router_at_crash"] == len(held)
    assert groups["lost"] == 0 and groups["trained_twice"] == 0
    assert [row["step"] for row in MetricsFollower(run_dir).new_rows()] == list(range(1, STEPS + 1))


@pytest.fixture(scope="module")
def tokenizer():
    if not (TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"the Qwen3 tokenizer is not at {TOKENIZER} (the shared data folder is absent on this machine)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return make_tiny_model("qwen3", TOKENIZER, tmp_path_factory.mktemp("tools") / "model", seed=0)


async def test_a_tool_calls_next_turn_samples_with_its_responses_own_seed(tokenizer, tool_model, monkeypatch):
    """Every turn of every response is seeded by the run's seed, its group, its index and its turn: a worker
    started by a resume (or a restart) samples what the first one would have, with no state to carry over."""
    seeds: list[tuple[int, int | None]] = []  # (turn, seed) of every sequence the engine is given
    tool_response = tokenizer.convert_tokens_to_ids("<tool_response>")

    def add(engine: ScriptedEngine, sequences: list) -> None:
        seeds.extend((s.prompt_ids.count(tool_response), s.seed) for s in sequences)
        engine.queue += sequences

    monkeypatch.setattr(ScriptedEngine, "add", add)
    eos = tokenizer.eos_token_id
    call = _engine_output(tokenizer, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}'
                                     '\n</tool_call>') + [eos]
    answer = _engine_output(tokenizer, "The answer is 4") + [eos]
    group, counters = await rollout_group(tokenizer, tool_model, [call, answer],
                                          tool=("vime.agent.calculator:calculator",))
    assert counters["tool_calls"] == 2 and sorted(turn for turn, _ in seeds) == [0, 0, 1, 1]
    run_seed = RunConfig().job.seed
    expected = {sampling_seed(run_seed, 0, index, turn) for index in (0, 1) for turn in (0, 1)}
    assert {seed for _, seed in seeds} == expected  # four distinct seeds, none drawn from the worker's stream
