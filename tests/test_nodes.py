"""Node agents (``python -m vime.node``) on other hosts, network namespaces standing in for the hosts
(``vime.devtools.netns``): they join, the driver starts actors on them and supervises those as its own, a node
killed or cut off is noticed and its actors counted dead, and a wrong token is refused on both sides."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Awaitable, Iterator

import pytest
import trio

from conftest import open_job
from vime.devtools.netns import Hosts, NoNamespaces, make_hosts
from vime.devtools.soak import run_processes
from vime.messages.runtime import StatusQuery
from vime.metrics import MetricsFollower
from vime.pipeline import Refused, RunFailed, train
from vime.scenarios import arithmetic
from vime.scenarios.selfcheck import ECHO, Ping, Pong
from vime.transports.shm import pid_alive

JOIN_S = 120.0  # a loaded 2-core machine starts a Python with torch slowly


@contextlib.contextmanager
def _hosts(*names: str) -> Iterator[Hosts]:
    """Namespaces as hosts, or the test skipped saying why they cannot be made here."""
    try:
        with make_hosts(*names) as hosts:
            yield hosts
    except NoNamespaces as err:
        pytest.skip(str(err))


async def _start_node(command: list[str], token: str, log: Path, *, token_flag: bool = False,
                      env: dict[str, str] | None = None) -> trio.Process:
    """A node agent as a user starts one: the token in the environment, or (``token_flag``) as ``--token``;
    ``env``: more of its environment (its actors inherit it)."""
    env = {k: v for k, v in os.environ.items() if k != "VIME_TOKEN"} | {"PYTHONUNBUFFERED": "1"} | (env or {})
    if token_flag:
        command = [*command, "--token", token]
    else:
        env["VIME_TOKEN"] = token
    with open(log, "ab") as out:
        return await trio.lowlevel.open_process(command, env=env, stdout=out, stderr=out)


def _node_command(hosts, host: str, address: str, run_dir: Path, *extra: str) -> list[str]:
    return hosts.command(host, sys.executable, "-m", "vime.node", "--join", address, "--name", f"node-{host}",
                         "--allow-role", ECHO, "--run-dir", str(run_dir), *extra)


async def _gone_within(pid: int, seconds: float) -> None:
    with trio.fail_after(seconds):
        while pid_alive(pid):
            await trio.sleep(0.2)


@contextlib.asynccontextmanager
async def _agents(*started: Awaitable[trio.Process]) -> AsyncIterator[list[trio.Process]]:
    """Node agents killed at the end whatever happened, those that started before a failure included."""
    agents: list[trio.Process] = []
    try:
        for start in started:
            agents.append(await start)
        yield agents
    finally:
        for agent in agents:
            if agent.returncode is None:
                agent.kill()
                await agent.wait()


async def test_nodes_on_two_hosts_run_supervised_actors_and_a_lost_node_is_noticed(tmp_path):
    with _hosts("b", "c") as hosts:
        async with open_job(tmp_path / "run", "tcp", host=hosts.head_ip, dead_after_s=3.0) as job, _agents(*(
                _start_node(_node_command(hosts, h, job.address, tmp_path / h, "--driver-lost-s", "10"), job.token,
                            tmp_path / f"node-{h}.out") for h in ("b", "c"))) as (agent_b, agent_c):
            for h in ("b", "c"):
                await job.wait_event("node joined", f"node-{h}", timeout=JOIN_S)
            assert {n: i.address_host for n, i in job.nodes.items()} == {
                "node-b": hosts.ips["b"], "node-c": hosts.ips["c"]}
            listed = json.loads((tmp_path / "run" / "actors.json").read_text())["nodes"]
            assert sorted(n["name"] for n in listed) == ["node-b", "node-c"]

            # started there, reached there, supervised from here: a kill is seen and the actor restarted there
            first = await job.spawn(ECHO, "echo-b", node="node-b", restart=True, timeout=JOIN_S)
            echo_c = await job.spawn(ECHO, "echo-c", node="node-c", restart=True, timeout=JOIN_S)
            assert first.address.startswith(f"tcp://{hosts.ips['b']}:")
            assert echo_c.address.startswith(f"tcp://{hosts.ips['c']}:")
            assert await job.ask("echo-b", Ping(payload=b"b")) == Pong(payload=b"b")
            killed_at = time.monotonic()
            job.kill("echo-b")
            await job.wait_event("died", "echo-b", timeout=5)
            assert time.monotonic() - killed_at < 5
            await job.wait_event("restarted", "echo-b", timeout=JOIN_S)
            second = job.actors["echo-b"]
            assert second.pid != first.pid and not pid_alive(first.pid)

            # restarted on demand: the old process's exit, reported late, does not touch its successor
            third = await job.restart("echo-b", timeout=JOIN_S)
            assert third.pid != second.pid and not job.gone_for_good("echo-b")
            await trio.sleep(2)  # time for the old exit's report to arrive
            assert job.actors["echo-b"].pid == third.pid
            assert await job.ask("echo-b", Ping(payload=b"again")) == Pong(payload=b"again")

            # a frozen actor does not freeze its node: another starts there meanwhile, then it goes on
            job.kill("echo-b", signal.SIGSTOP)
            await job.spawn(ECHO, "echo-b2", node="node-b", timeout=JOIN_S)
            job.kill("echo-b", signal.SIGCONT)
            assert await job.ask("echo-b", Ping(payload=b"thawed")) == Pong(payload=b"thawed")

            # an actor failing as it starts: the driver says why, from the log its node forwarded here
            with pytest.raises(RuntimeError, match=r"exited during start-up(.|\n)*no_such_setting"):
                await job.spawn(ECHO, "broken-b", settings={"no_such_setting": 1}, node="node-b", timeout=JOIN_S)
            forwarded = (tmp_path / "run" / "logs" / "broken-b.log").read_text()
            assert "unknown field(s) ['no_such_setting']" in forwarded

            # a role the node does not allow is refused, saying how to allow it; the name stays free
            with pytest.raises(RuntimeError, match="--allow-role vime.scenarios.selfcheck:Tally"):
                await job.spawn("vime.scenarios.selfcheck:Tally", "extra-b", node="node-b")
            await job.spawn(ECHO, "extra-b", node="node-b", timeout=JOIN_S)

            # node c killed: its loss and its actor's within the heartbeat timeout; no restart on a lost node
            agent_c.kill()
            lost = await job.wait_event("node lost", "node-c", timeout=10)
            assert "echo-c" in lost.detail
            assert "node-c was lost" in (await job.wait_event("died", "echo-c", timeout=5)).detail
            assert "node-c is not in the job" in (await job.wait_event("stranded", "echo-c", timeout=5)).detail
            assert job.gone_for_good("echo-c")
            await _gone_within(echo_c.pid, 30)
            assert [n["name"] for n in json.loads((tmp_path / "run" / "actors.json").read_text())["nodes"]] == [
                "node-b"]

            # node b cut off: the driver counts it lost; the node, its driver silent, stops its actors, exits 3
            hosts.cut("b")
            await job.wait_event("node lost", "node-b", timeout=10)
            with trio.fail_after(40):
                assert await agent_b.wait() == 3
            await _gone_within(third.pid, 15)
            assert "has not answered" in (tmp_path / "node-b.out").read_text()
            assert "node-b" not in job.nodes and "echo-b" not in job.actors


async def test_a_node_cut_off_and_back_is_told_to_stop(tmp_path):
    """Counted lost, a node whose link comes back would keep its actors (and GPUs) serving nobody."""
    with _hosts("b") as hosts:
        async with open_job(tmp_path / "run", "tcp", host=hosts.head_ip, dead_after_s=3.0) as job, _agents(
                _start_node(_node_command(hosts, "b", job.address, tmp_path / "b", "--driver-lost-s", "60"),
                            job.token, tmp_path / "node-b.out")) as (agent,):
            await job.wait_event("node joined", "node-b", timeout=JOIN_S)
            echo = await job.spawn(ECHO, "echo-b", node="node-b", timeout=JOIN_S)
            hosts.cut("b")
            await job.wait_event("node lost", "node-b", timeout=10)
            hosts.restore("b")
            with trio.fail_after(30):
                assert await agent.wait() == 0  # told to stop, well before its own 60 s
            await _gone_within(echo.pid, 15)


async def test_a_job_that_ends_stops_its_nodes_and_their_actors(tmp_path):
    with _hosts("b") as hosts:
        async with _agents() as agents:
            async with open_job(tmp_path / "run", "tcp", host=hosts.head_ip) as job:
                agents.append(await _start_node(_node_command(hosts, "b", job.address, tmp_path / "b"), job.token,
                                                tmp_path / "node-b.out", token_flag=True))
                await job.wait_event("node joined", "node-b", timeout=JOIN_S)
                echo = await job.spawn(ECHO, "echo-b", node="node-b", timeout=JOIN_S)  # the agent's token passed on
            with trio.fail_after(30):
                assert await agents[0].wait() == 0
            await _gone_within(echo.pid, 15)
    assert (tmp_path / "b" / "logs" / "echo-b.log").exists()  # the node keeps its own copy of its actors' logs


@pytest.mark.parametrize("token", ["not-the-token", ""], ids=["wrong", "missing"])
async def test_a_node_with_a_wrong_token_is_refused_on_both_sides(tmp_path, token):
    async with open_job(tmp_path / "run", "tcp") as job:
        env = {k: v for k, v in os.environ.items() if k != "VIME_TOKEN"} | ({"VIME_TOKEN": token} if token else {})
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "vime.node", "--join", job.address, "--name", "intruder"], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        with trio.fail_after(JOIN_S):
            said = b""
            while chunk := await process.stderr.receive_some(1 << 16):
                said += chunk
            code = await process.wait()
        assert code == 2 and b"token" in said, said
        assert "intruder" not in job.actors and not job.nodes and job.driver.errors["unauthorized"] >= 1
        with pytest.raises(ValueError, match="no node named 'intruder'"):
            await job.spawn(ECHO, "echo-x", node="intruder")


async def _join_file(run_dir: Path) -> tuple[str, str]:
    """The driver's address and the job's token, from RUN_DIR/join once the driver writes it."""
    join = run_dir / "join"
    with trio.fail_after(JOIN_S):
        while not join.exists():
            await trio.sleep(0.1)
    text = join.read_text()
    return re.search(r"vime-node --join (\S+)", text).group(1), re.search(r"VIME_TOKEN=(\S+)", text).group(1)


async def _start_nodes_when_the_job_is_up(hosts, run_dir: Path, names: list[str], agents: list[trio.Process],
                                          tmp_path: Path, env: dict[str, str] | None = None) -> None:
    """Read the address and token from RUN_DIR/join once the driver writes it, and start a node agent on each
    host as its user would (``env``: more of its environment)."""
    address, token = await _join_file(run_dir)
    for host in names:
        agents.append(await _start_node(_node_command(hosts, host, address, tmp_path / host), token,
                                        tmp_path / f"node-{host}.out", env=env))


async def test_a_run_puts_its_rollout_workers_on_nodes_and_goes_on_when_one_is_lost(tmp_path):
    """--rollout-nodes 2: the run waits for two node agents, starts a rollout worker on each, and trains; node c
    killed at step 3 takes its worker with it (stranded: not restarted while c is away), the router re-issues
    that worker's groups to the other, and every step is still trained, no group lost or trained twice."""
    run_dir = tmp_path / "run"
    config = arithmetic.prepare(run_dir, arithmetic.defaults().replace(
        steps=8, rollout_workers=2, rollout_nodes=2, wait_for_nodes_s=JOIN_S, rollout_batch_size=16,
        max_staleness=1))
    with _hosts("b", "c") as hosts:
        async with _agents() as agents:
            addresses: dict[str, str] = {}

            async def lose_node_c(job, row: dict) -> None:
                if row["step"] == 1:
                    addresses.update({name: info.address for name, info in job.actors.items()})
                if row["step"] == 3:
                    agents[1].kill()
                    await job.wait_event("node lost", "node-c", timeout=15)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(_start_nodes_when_the_job_is_up, hosts, run_dir, ["b", "c"], agents, tmp_path)
                summary = await train(config, run_dir, transport="tcp", host=hosts.head_ip, on_step=lose_node_c,
                                      timeout_s=900)
    rows = MetricsFollower(run_dir).new_rows()
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert summary["groups"]["lost"] == 0 and summary["groups"]["trained_twice"] == 0
    assert addresses["rollout-0"].startswith(f"tcp://{hosts.ips['b']}:")
    assert addresses["rollout-1"].startswith(f"tcp://{hosts.ips['c']}:")


REJOIN_BATCH = 8  # groups a step; a worker takes 2 at once, so the frozen rollout-0 leaves some for rollout-1
REJOIN_STEPS = 5  # after step 2, three batches for both workers: the rejoined one is sent, and finishes, some


async def _hold_until_node_c_is_down(hosts, run_dir: Path, agents: list[trio.Process], tmp_path: Path) -> None:
    """Start nodes b and c with the buffer frozen (SIGSTOP), so that no batch reaches the trainer: once the
    workers have generated the first batch, freeze rollout-0 and kill node c's agent, then let the buffer go. The
    run trains step 1 and waits there: nothing else can generate until node c is back."""
    actors = run_dir / "actors.json"
    router_state = run_dir / "checkpoints" / "router.json"  # the router's counters and held groups, every 1 s
    router_log = run_dir / "logs" / "router.log"

    def read(path: Path) -> dict:
        return json.loads(path.read_text()) if path.exists() else {}

    def serving(worker: str) -> bool:
        return router_log.exists() and any("rollout worker ready" in line and f'"{worker}"' in line
                                           for line in router_log.read_text().splitlines())

    with trio.fail_after(JOIN_S):
        # no worker before the nodes: the groups the buffer issues as it starts (one batch) wait at the router
        while len(read(router_state).get("held", ())) < REJOIN_BATCH:
            await trio.sleep(0.2)
    buffer_pid = next(a["pid"] for a in read(actors)["actors"] if a["name"] == "buffer")
    os.kill(buffer_pid, signal.SIGSTOP)
    try:
        await _start_nodes_when_the_job_is_up(hosts, run_dir, ["b", "c"], agents, tmp_path)
        with trio.fail_after(JOIN_S):  # both workers serving (c's spawn done), the first batch made
            while not (serving("rollout-0") and serving("rollout-1")
                       and read(router_state).get("counters", {}).get("done", 0) >= REJOIN_BATCH):
                await trio.sleep(0.2)
        os.kill(_started_pid(tmp_path / "node-b.out", "rollout-0"), signal.SIGSTOP)
        agents[1].kill()
    finally:
        os.kill(buffer_pid, signal.SIGCONT)


async def test_a_node_that_comes_back_after_a_restart_gets_its_rollout_worker_again(tmp_path):
    """--rollout-nodes 2, node c's agent and worker killed (its host going down) once the first batch is made,
    rollout-0 frozen meanwhile (SIGSTOP; spawned actors are watched through their node, not by heartbeats), so
    that the run cannot go past step 1 without node c. Once c is counted lost, an agent started there again with
    the same name but a wrong token is refused, then one with the job's token joins; the driver restarts the
    stranded worker there, the router sends it groups of the next batches, and it finishes them: every step is
    trained, no group lost or trained twice."""
    run_dir = tmp_path / "run"
    config = arithmetic.prepare(run_dir, arithmetic.defaults().replace(
        steps=REJOIN_STEPS, rollout_workers=2, rollout_nodes=2, wait_for_nodes_s=JOIN_S,
        rollout_batch_size=REJOIN_BATCH, max_staleness=0, rollout_capacity=2))
    seen: dict[str, object] = {}

    async def router_counters(job) -> dict[str, int]:
        return (await job.ask("router", StatusQuery(), timeout=10)).counters

    with _hosts("b", "c") as hosts:
        async with _agents() as agents:
            async def bring_node_c_back(job, row: dict) -> None:
                if row["step"] == REJOIN_STEPS:  # the router still runs: what it sent the new rollout-1, what it holds
                    seen["at_end"] = await router_counters(job)
                if row["step"] != 1:
                    return
                address, token = await _join_file(run_dir)
                await job.wait_event("node lost", "node-c", timeout=15)
                seen["stranded"] = (await job.wait_event("stranded", "rollout-1", timeout=5)).detail
                with trio.fail_after(15):  # until the router has let the old process go, and re-issued its groups
                    while "assigned:rollout-1" in (counters := await router_counters(job)):
                        await trio.sleep(0.2)
                seen["sent_before"] = counters.get("dispatched_to:rollout-1", 0)

                command = _node_command(hosts, "c", address, tmp_path / "c")
                intruder = await _start_node(command, "not-the-token", tmp_path / "node-c-wrong-token.out")
                agents.append(intruder)
                with trio.fail_after(JOIN_S):
                    assert await intruder.wait() == 2
                seen["refused"] = "node-c" not in job.nodes and job.driver.errors["unauthorized"] >= 1

                agents.append(await _start_node(command, token, tmp_path / "node-c-again.out"))
                await job.wait_event("restarted", "rollout-1", timeout=JOIN_S)
                seen["address"] = job.actors["rollout-1"].address
                # step 2's groups that wait go to it; there may be none (the buffer can have issued both first batches
                # before it was frozen, and the old rollout-1 made its share): later batches are for both workers
                with trio.move_on_after(10):
                    while (await router_counters(job)).get("dispatched_to:rollout-1", 0) == seen["sent_before"]:
                        await trio.sleep(0.2)
                job.kill("rollout-0", signal.SIGCONT)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(_hold_until_node_c_is_down, hosts, run_dir, agents, tmp_path)
                summary = await train(config, run_dir, transport="tcp", host=hosts.head_ip,
                                      on_step=bring_node_c_back, timeout_s=300)
    assert "restarted there when it joins again" in seen["stranded"]
    assert seen["refused"]
    assert "token" in (tmp_path / "node-c-wrong-token.out").read_text()
    assert seen["address"].startswith(f"tcp://{hosts.ips['c']}:")
    at_end = seen["at_end"]
    # a counter that stayed 0 is absent: rollout-1 ending the run with nothing assigned has no "assigned:" key
    finished_after_rejoin = (at_end.get("dispatched_to:rollout-1", 0) - seen["sent_before"]
                             - at_end.get("assigned:rollout-1", 0))
    assert finished_after_rejoin > 0, (seen["sent_before"], at_end)
    assert [row["step"] for row in MetricsFollower(run_dir).new_rows()] == list(range(1, REJOIN_STEPS + 1))
    assert summary["groups"]["lost"] == 0 and summary["groups"]["trained_twice"] == 0
    ready = [e["worker"] for e in _events(run_dir / "logs" / "router.log", "rollout worker ready")]
    assert sorted(ready) == ["rollout-0", "rollout-1", "rollout-1"]


def _events(log: Path, event: str) -> list[dict]:
    """The structured lines of an actor's log that are ``event`` (not a library's plain-text warnings)."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line["event"] == event]


async def _broadcast_to_a_node(tmp_path: Path, node_env: dict[str, str] | None = None) -> tuple[list[dict], str]:
    """Four synchronous steps (--max-staleness 0: each batch generated with the version before it) under
    --weight-sync broadcast, the one rollout worker on node b (its agent started with ``node_env`` added to
    its environment); the rows and the trainer's log."""
    run_dir = tmp_path / "run"
    config = arithmetic.prepare(run_dir, arithmetic.defaults().replace(
        steps=4, rollout_workers=1, rollout_nodes=1, wait_for_nodes_s=JOIN_S, rollout_batch_size=16,
        max_staleness=0, weight_sync="broadcast"))
    addresses: dict[str, str] = {}

    async def note_addresses(job, row: dict) -> None:
        addresses.update({name: info.address for name, info in job.actors.items()})

    with _hosts("b") as hosts:
        async with _agents() as agents:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_start_nodes_when_the_job_is_up, hosts, run_dir, ["b"], agents, tmp_path,
                                   node_env)
                await train(config, run_dir, transport="tcp", host=hosts.head_ip, on_step=note_addresses,
                            timeout_s=120)
    assert addresses["rollout-0"].startswith(f"tcp://{hosts.ips['b']}:")
    rows = MetricsFollower(run_dir).new_rows()
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [row["staleness_max"] for row in rows] == [0.0] * 4  # generated with versions 0, 1, 2 and 3
    assert max(row["train_rollout_logprob_abs_diff"] for row in rows) < 1e-4  # with the weights trained, exactly
    return rows, (run_dir / "logs" / "trainer.log").read_text()


async def test_a_rollout_worker_on_another_host_gets_every_version_over_a_gloo_broadcast(tmp_path):
    """The group meets on the trainer's --host, and gloo listens there too (not on 127.0.0.1, where the host
    name resolves): every version reaches the worker on node b by broadcast, none falls back to nng."""
    rows, trainer_log = await _broadcast_to_a_node(tmp_path)
    assert [row["weight_paths"] for row in rows] == [{"rollout-0": "broadcast"}] * 4
    paths = [(e["worker"], e["path"], e.get("instead_of")) for e in _events(tmp_path / "run" / "logs" / "trainer.log",
                                                                             "weight path")]
    assert paths == [("rollout-0", "broadcast", None)]
    assert "weight path failed" not in trainer_log and "no broadcast group" not in trainer_log


async def test_a_broadcast_group_that_cannot_form_leaves_the_worker_on_nng(tmp_path):
    """Node b told to run gloo on an interface it lacks (GLOO_SOCKET_IFNAME copied from another host): the
    worker's side of the group fails as it forms, at the first broadcast; that version and every later one go
    over nng, and the run ends."""
    rows, trainer_log = await _broadcast_to_a_node(tmp_path, {"GLOO_SOCKET_IFNAME": "ens9f1"})
    assert [row["weight_paths"] for row in rows] == [{"rollout-0": "nng"}] * 4
    paths = [(e["worker"], e["path"], e.get("instead_of")) for e in _events(tmp_path / "run" / "logs" / "trainer.log",
                                                                             "weight path")]
    assert paths == [("rollout-0", "broadcast", None), ("rollout-0", "nng", "broadcast")]
    assert trainer_log.count("weight path failed") == 1


async def test_rollout_nodes_need_a_transport_other_hosts_reach(tmp_path):
    config = arithmetic.prepare(tmp_path / "run", arithmetic.defaults().replace(rollout_workers=2, rollout_nodes=2))
    with pytest.raises(Refused, match="--transport tcp"):
        await train(config, tmp_path / "run")


def _data_parallel_run(run_dir: Path, **overrides) -> object:
    """The default task, trained by two data-parallel Megatron ranks (fp32, CPU) for a few steps."""
    return arithmetic.prepare(run_dir, arithmetic.defaults().replace(**{
        "steps": 3, "seed": 3, "rollout_batch_size": 16, "train_backend": "megatron", "data_parallel_size": 2,
        **overrides}))


def _trained(run_dir: Path) -> dict[str, list[float]]:
    """Each step's loss, reward and trainer-rollout log-prob gap, by name."""
    rows = MetricsFollower(run_dir).new_rows()
    return {key: [row[key] for row in rows] for key in ("loss", "raw_reward", "train_rollout_logprob_abs_diff")}


async def test_trainer_ranks_on_two_hosts_train_as_on_one(tmp_path):
    """--actor-num-nodes 2 --actor-num-gpus-per-node 1: rank 1 of a TP1 x DP2 Megatron trainer runs on a node
    agent's host, started through it, in one gloo group with rank 0 (the trainer actor) over the namespaces'
    network; each step's loss and reward are those of the same run with both ranks on one host."""
    one, two = tmp_path / "one", tmp_path / "two"
    await train(_data_parallel_run(one), one, timeout_s=600)
    with _hosts("b") as hosts:
        async with _agents() as agents:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_start_nodes_when_the_job_is_up, hosts, two, ["b"], agents, tmp_path)
                config = _data_parallel_run(two, actor_num_nodes=2, actor_num_gpus_per_node=1,
                                            wait_for_nodes_s=JOIN_S)
                await train(config, two, transport="tcp", host=hosts.head_ip, timeout_s=600)
    ranks = json.loads((two / "actors.json").read_text())["trainer_ranks"]
    assert [(rank["rank"], rank["node"], rank["host"]) for rank in ranks] == [
        (0, "head", hosts.head_ip), (1, "node-b", hosts.ips["b"])]
    assert (tmp_path / "b" / "logs" / "trainer-rank-1.log").exists()  # the node's own copy of the rank's output
    expected, got = _trained(one), _trained(two)
    assert len(got["loss"]) == len(expected["loss"]) == 3
    for key, values in expected.items():
        assert got[key] == pytest.approx(values, rel=1e-5, abs=1e-6), (key, got, expected)


def _started_pid(agent_output: Path, name: str) -> int:
    """The pid of ``name`` as its node agent logged it when it started the process."""
    for line in agent_output.read_text().splitlines():
        if line.startswith("{") and (entry := json.loads(line)).get("peer") == name and "pid" in entry:
            return int(entry["pid"])
    raise AssertionError(f"{agent_output} shows no start of {name}")


@pytest.mark.parametrize("killed", ["rank", "node"])
async def test_a_trainer_rank_killed_on_its_node_stops_the_run_naming_it(tmp_path, killed):
    """Rank 1, on node b, killed after the first step, alone or with its node agent: the trainer stops within
    30 s, and the run with it, saying which rank died and on which node."""
    run_dir = tmp_path / "run"
    killed_at: list[float] = []

    async def kill_rank_1(job, row: dict) -> None:
        if row["step"] == 1:
            if killed == "rank":
                os.kill(_started_pid(tmp_path / "node-b.out", "trainer-rank-1"), signal.SIGKILL)
            else:
                agents[0].kill()
            killed_at.append(time.monotonic())

    with _hosts("b") as hosts:
        async with _agents() as agents:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_start_nodes_when_the_job_is_up, hosts, run_dir, ["b"], agents, tmp_path)
                config = _data_parallel_run(run_dir, steps=30, actor_num_nodes=2, actor_num_gpus_per_node=1,
                                            wait_for_nodes_s=JOIN_S)
                with pytest.raises(RunFailed, match=rf"trainer rank 1 on node node-b \({re.escape(hosts.ips['b'])}\) "
                                                    r"exited with code -9"):
                    await train(config, run_dir, transport="tcp", host=hosts.head_ip, on_step=kill_rank_1,
                                timeout_s=600)
    assert time.monotonic() - killed_at[0] < 30


async def test_a_killed_driver_leaves_no_trainer_rank_on_its_node(tmp_path):
    """The driver (``python -m vime.scenario``) killed with kill -9 mid-run, rank 1 of its Megatron trainer on node
    b: node b's agent, its driver silent for --driver-lost-s, stops the rank it started and exits 3, and the rank's
    process is gone within seconds of that. Rank 0 ends with the driver (--exit-with-parent), but a rank on a
    node ends with the agent that started it, not with rank 0: until the agent stops it, it waits for rank 0's
    next order."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "vime.scenario", "arithmetic", "--out", str(run_dir), "--steps", "1000",
               "--rollout-batch-size", "16", "--train-backend", "megatron", "--data-parallel-size", "2",
               "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--wait-for-nodes-s", str(JOIN_S)]
    with _hosts("b") as hosts, open(tmp_path / "driver.out", "wb") as out:
        driver = await trio.lowlevel.open_process([*command, "--transport", "tcp", "--host", hosts.head_ip],
                                                  stdout=out, stderr=out)
        try:
            async with _agents() as agents:
                address, token = await _join_file(run_dir)
                agents.append(await _start_node(_node_command(hosts, "b", address, tmp_path / "b", "--driver-lost-s",
                                                              "5"), token, tmp_path / "node-b.out"))
                metrics = run_dir / "metrics.jsonl"
                with trio.fail_after(300):  # a step: both ranks up and training together
                    while not (metrics.exists() and metrics.read_text().strip()):
                        assert driver.poll() is None, (tmp_path / "driver.out").read_text()[-3000:]
                        await trio.sleep(0.2)
                rank = _started_pid(tmp_path / "node-b.out", "trainer-rank-1")
                driver.kill()
                await driver.wait()
                with trio.fail_after(30):
                    assert await agents[0].wait() == 3
                await _gone_within(rank, 10)
        finally:
            if driver.returncode is None:
                driver.kill()
                await driver.wait()
            with trio.move_on_after(30):  # the head's orphaned actors leave through their parent watches: not
                while run_processes(run_dir):  # into the next test's share of the CPU
                    await trio.sleep(0.5)
            for pid in run_processes(run_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
