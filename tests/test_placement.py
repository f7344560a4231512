"""Placement: which GPUs each actor process sees, from slime's flags and the host's GPUs."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import trio

from conftest import open_job
from vime.config import RunConfig
from vime.gpu_turns import engines_sharing_gpus
from vime.pipeline import _spawn_rollouts
from vime.placement import Placement, describe, place, visible_gpus
from vime.scenarios.selfcheck import ECHO
from vime.startup import StartupClock
from vime.weights import CudaIpc

GPU_RUN = RunConfig().replace(train_backend="megatron", rollout_backend="vllm")


def test_without_gpu_flags_every_process_inherits_the_drivers_view():
    assert place(RunConfig().replace(rollout_workers=3), ["0", "1"]) == Placement(None, [None] * 3, None)


@pytest.mark.parametrize("flags, gpus, trainer, engines", [
    ({"actor_num_gpus_per_node": 1, "rollout_num_gpus": 1}, ["0", "1"], "0", ["1"]),  # two GPUs: NCCL
    ({"actor_num_gpus_per_node": 1, "colocate": True}, ["0"], "0", ["0"]),  # one GPU: CUDA IPC
    ({"actor_num_gpus_per_node": 1, "rollout_num_gpus": 1, "colocate": True}, ["3"], "3", ["3"]),
    ({"actor_num_gpus_per_node": 1, "rollout_num_gpus": 4, "rollout_num_gpus_per_engine": 2},
     ["0", "1", "2", "3", "4", "5"], "0", ["1,2", "3,4"]),
    ({"actor_num_gpus_per_node": 1, "rollout_num_gpus": 3}, ["GPU-a", "GPU-b", "GPU-c", "GPU-d"], "GPU-a",
     ["GPU-b", "GPU-c", "GPU-d"]),
    ({"rollout_num_gpus": 2, "rollout_workers": 2}, ["0", "1"], "", ["0", "1"]),  # a CPU trainer
    ({"actor_num_gpus_per_node": 1, "rollout_workers": 2}, ["0"], "0", ["", ""]),  # CPU engines
    ({"actor_num_gpus_per_node": 2, "tensor_model_parallel_size": 2, "rollout_num_gpus": 2}, ["0", "1", "2", "3"],
     "0,1", ["2", "3"]),  # two tensor-parallel ranks
    ({"actor_num_gpus_per_node": 1, "colocate": True, "rollout_workers": 2,
      "vllm_args": {"gpu_memory_utilization": 0.3}}, ["0"], "0", ["0", "0"]),  # two engines beside the trainer
    ({"actor_num_gpus_per_node": 1, "rollout_num_gpus": 2, "rollout_workers": 4,
      "vllm_args": {"gpu_memory_utilization": 0.45}}, ["0", "1", "2"], "0", ["1", "2", "1", "2"]),
    ({"actor_num_gpus_per_node": 1, "rollout_num_gpus": 4, "rollout_num_gpus_per_engine": 2, "rollout_workers": 4,
      "vllm_args": {"gpu_memory_utilization": 0.4}}, ["0", "1", "2", "3", "4"], "0", ["1,2", "3,4", "1,2", "3,4"]),
    ({"actor_num_gpus_per_node": 8, "tensor_model_parallel_size": 8, "expert_model_parallel_size": 8,
      "colocate": True, "rollout_num_gpus_per_engine": 8}, [str(gpu) for gpu in range(8)], "0,1,2,3,4,5,6,7",
     ["0,1,2,3,4,5,6,7"]),  # qwen3_30b_a3b_dapo's 8-GPU layout: one vLLM engine of 8 beside 8 trainer ranks
    ({"actor_num_gpus_per_node": 8, "tensor_model_parallel_size": 4, "data_parallel_size": 2,
      "expert_model_parallel_size": 8, "colocate": True, "rollout_num_gpus_per_engine": 8},
     [str(gpu) for gpu in range(8)], "0,1,2,3,4,5,6,7", ["0,1,2,3,4,5,6,7"]),  # slime's: two copies of TP 4
    ({"actor_num_gpus_per_node": 2, "tensor_model_parallel_size": 2, "colocate": True,
      "vllm_args": {"enable_sleep_mode": True}}, ["0", "1"], "0,1", ["0", "1"]),  # engines sleep beside both ranks
    ({"actor_num_nodes": 2, "actor_num_gpus_per_node": 2, "tensor_model_parallel_size": 2, "data_parallel_size": 2,
      "rollout_num_gpus": 1}, ["0", "1", "2"], "0,1", ["2"]),  # this host holds the first copy of two ranks
])
def test_separate_and_colocated_layouts(flags, gpus, trainer, engines):
    assert place(GPU_RUN.replace(**flags), gpus) == Placement(trainer, engines, "")


@pytest.mark.parametrize("flags, gpus, said", [
    ({"actor_num_gpus_per_node": 1, "rollout_num_gpus": 2}, ["0", "1"],
     r"needs 3 GPUs \(trainer 1, rollout 2\) but this host shows 2 \(CUDA_VISIBLE_DEVICES=0,1\)"),
    ({"actor_num_gpus_per_node": 1}, [], "needs 1 GPUs .* shows 0$"),
    ({"actor_num_nodes": 2, "actor_num_gpus_per_node": 1}, ["0"],
     r"--actor-num-nodes 2 x --actor-num-gpus-per-node 1 \(ranks per host on CPU\) must be the trainer's 1 ranks"),
    ({"actor_num_nodes": 2, "actor_num_gpus_per_node": 1, "train_backend": "torch"}, ["0"],
     "only the Megatron trainer spans hosts; pass --train-backend megatron"),
    ({"actor_num_nodes": 2, "actor_num_gpus_per_node": 1, "tensor_model_parallel_size": 2}, ["0"],
     "would split a tensor-parallel group of --tensor-model-parallel-size 2 over hosts"),
    ({"actor_num_gpus_per_node": 2}, ["0", "1"], r"one rank per GPU, .* \(1 x 1 x 1\); make the product the GPU"),
    ({"actor_num_gpus_per_node": 8, "tensor_model_parallel_size": 2, "data_parallel_size": 2}, ["0"] * 8,
     r"\(2 x 2 x 1\)"),
    ({"actor_num_gpus_per_node": 1, "tensor_model_parallel_size": 2}, ["0"] * 2, r"\(2 x 1 x 1\)"),
    ({"colocate": True}, ["0"], "pass --actor-num-gpus-per-node too"),
    ({"actor_num_gpus_per_node": 1, "rollout_num_gpus": 2, "colocate": True}, ["0", "1"],
     "must be 1 or left out, not 2"),
    ({"actor_num_gpus_per_node": 1, "rollout_num_gpus": 3, "rollout_num_gpus_per_engine": 2}, ["0"] * 4,
     "not a multiple of --rollout-num-gpus-per-engine 2"),
    ({"actor_num_gpus_per_node": 1, "rollout_num_gpus": 2, "rollout_workers": 3}, ["0"] * 3,
     "--rollout-workers 3 is not a multiple of the 2 engine slots"),
    ({"actor_num_gpus_per_node": 1, "rollout_num_gpus": 1, "rollout_workers": 2}, ["0", "1"],
     "2 engines share each rollout GPU.*pass at most 0.45"),
    ({"actor_num_gpus_per_node": 1, "colocate": True, "rollout_workers": 3,
      "vllm_args": {"gpu_memory_utilization": 0.4}}, ["0"], "3 engines share .* at most 0.30"),
    ({"actor_num_gpus_per_node": 8, "tensor_model_parallel_size": 8, "expert_model_parallel_size": 4}, ["0"] * 8,
     r"--expert-model-parallel-size 4: .* one copy of the trainer \(--tensor-model-parallel-size 8\) or of all "
     r"copies \(x --data-parallel-size 1 = 8\)"),
    ({"actor_num_gpus_per_node": 8, "tensor_model_parallel_size": 4, "data_parallel_size": 2,
      "expert_model_parallel_size": 2}, ["0"] * 8, r"\(--tensor-model-parallel-size 4\) or of all copies \(x "
                                                  r"--data-parallel-size 2 = 8\)"),
])
def test_impossible_layouts_are_refused_with_what_to_change(flags, gpus, said):
    with pytest.raises(ValueError, match=said):
        place(GPU_RUN.replace(**flags), gpus)


def test_trainer_ranks_fill_this_host_then_each_node_in_megatrons_order():
    """Four ranks, two a host: this host keeps ranks 0 and 1 (a tensor-parallel pair), the node the next pair;
    a node short of GPUs, or missing, is refused by name."""
    from types import SimpleNamespace

    from vime.trainer_ranks import RankSlot, plan_ranks

    node = SimpleNamespace(name="node-b", address_host="10.0.0.2", gpus=2)
    plan = plan_ranks(4, 2, "10.0.0.1", [node], on_gpu=True)
    assert plan.slots == (RankSlot(1, 1, None, "10.0.0.1"), RankSlot(2, 0, "node-b", "10.0.0.2"),
                          RankSlot(3, 1, "node-b", "10.0.0.2"))
    assert [(row["rank"], row["node"]) for row in plan.rows("10.0.0.1")] == [
        (0, "head"), (1, "head"), (2, "node-b"), (3, "node-b")]
    with pytest.raises(ValueError, match="node-b offers 1 GPU"):
        plan_ranks(4, 2, "10.0.0.1", [SimpleNamespace(name="node-b", address_host="10.0.0.2", gpus=1)], on_gpu=True)
    assert plan_ranks(4, 2, "10.0.0.1", [SimpleNamespace(name="node-b", address_host="10.0.0.2", gpus=0)],
                      on_gpu=False).slots[-1].node == "node-b"  # on CPU, ranks per host
    with pytest.raises(ValueError, match="needs 2 node"):
        plan_ranks(6, 2, "10.0.0.1", [node], on_gpu=True)
    spanning = GPU_RUN.replace(actor_num_nodes=2, actor_num_gpus_per_node=2, tensor_model_parallel_size=2,
                               data_parallel_size=2, rollout_num_gpus=1)
    assert "ranks 0-1 on this host, the next 2 on each of 1 node agent(s)" in describe(spanning, place(
        spanning, ["0", "1", "2"]))[0]


def test_engines_on_the_same_gpus_form_a_group():
    assert engines_sharing_gpus(Placement("0", ["0", "1", "0", "1"], "")) == [[0, 2], [1, 3]]
    assert engines_sharing_gpus(Placement("0", ["", ""], "")) == [[0], [1]]  # engines on CPU
    assert engines_sharing_gpus(Placement(None, [None, None], None)) == [[0], [1]]  # nothing placed


async def test_engines_on_the_same_gpus_start_one_after_another():
    """A worker on GPUs that another engine uses starts once that engine is built (it answers a status
    query only then); workers on other GPUs start meanwhile. The trainer hears once every engine is built."""
    calls = []

    class Job:
        async def spawn(self, role: str, name: str, *args, **kwargs) -> None:
            calls.append(("spawn", name))

        async def ask(self, name: str, query, timeout: float) -> None:
            await trio.sleep(0.05)  # the engine builds
            calls.append(("built", name))

        async def tell(self, name: str, message) -> None:
            calls.append((type(message).__name__, name))

    await _spawn_rollouts(Job(), GPU_RUN.replace(rollout_workers=4), {}, Placement("0", ["0", "1", "0", "1"], ""),
                          StartupClock())
    assert set(calls[:2]) == {("spawn", "rollout-0"), ("spawn", "rollout-1")}
    assert calls.index(("spawn", "rollout-2")) > calls.index(("built", "rollout-0"))
    assert calls.index(("spawn", "rollout-3")) > calls.index(("built", "rollout-1"))
    assert len(calls) == 9 and calls[-1] == ("EnginesStarted", "trainer")


async def test_the_next_engine_waits_through_a_restart_but_not_for_one_given_up_on(autojump_clock):
    from vime.runtime import PeerGone

    calls, failures = [], {"rollout-0": 2, "rollout-1": 99}

    class Job:
        async def spawn(self, role: str, name: str, *args, **kwargs) -> None:
            calls.append(("spawn", name))

        async def ask(self, name: str, query, timeout: float) -> None:
            if failures.get(name):
                failures[name] -= 1
                raise PeerGone(name) if name == "rollout-0" else LookupError(name)
            calls.append(("built", name))

        def gone_for_good(self, name: str) -> bool:
            return name == "rollout-1" and failures[name] < 97  # given up on after its third failure

        async def tell(self, name: str, message) -> None:
            raise PeerGone(name)  # the trainer died meanwhile: the run's watch reports that

    await _spawn_rollouts(Job(), GPU_RUN.replace(rollout_workers=4), {}, Placement("0", ["0", "1", "0", "1"], ""),
                          StartupClock())
    assert calls.index(("spawn", "rollout-2")) > calls.index(("built", "rollout-0"))  # after its two restarts
    assert ("spawn", "rollout-3") in calls and ("built", "rollout-1") not in calls


@pytest.mark.parametrize("departure", ["clean exit", "never back"])
async def test_the_next_engine_waits_for_no_worker_that_left_or_stays_away(autojump_clock, departure):
    """A worker that exited cleanly is not restarted (the job says it is gone for good), so nothing waits for it;
    one that never answers is waited for ENGINE_BUILD_S at most. The trainer hears either way."""
    from vime.gpu_turns import ENGINE_BUILD_S
    from vime.runtime import PeerGone

    calls = []

    class Job:
        def gone_for_good(self, name: str) -> bool:
            return departure == "clean exit"

        async def spawn(self, role: str, name: str, *args, **kwargs) -> None:
            calls.append(("spawn", name, trio.current_time()))

        async def ask(self, name: str, query, timeout: float) -> None:
            if name == "rollout-0":
                raise PeerGone(name)
            calls.append(("built", name))

        async def tell(self, name: str, message) -> None:
            calls.append(("told", name))

    await _spawn_rollouts(Job(), GPU_RUN, {}, Placement("0", ["0", "0"], ""), StartupClock())
    spawned = {call[1]: call[2] for call in calls if call[0] == "spawn"}
    waited = spawned["rollout-1"] - spawned["rollout-0"]
    assert waited < 5 if departure == "clean exit" else ENGINE_BUILD_S <= waited < ENGINE_BUILD_S + 5
    assert calls[-1] == ("told", "trainer")


def _trainer(tmp_path: Path, colocate: bool):
    """A trainer actor outside any job (the arithmetic scenario's tiny model): what it sends is kept in the
    returned list, and its handlers are called directly by ``deliver``."""
    from vime.actors.trainer import Trainer
    from vime.runtime import ActorSettings
    from vime.scenarios import arithmetic
    from vime.transports.codec import Envelope

    config = arithmetic.prepare(tmp_path, arithmetic.defaults().replace(colocate=colocate)).to_dict()
    trainer = Trainer(ActorSettings(name="trainer", listen="ipc:///none", run_dir=str(tmp_path)), config)
    trainer.build()
    sent: list[Envelope] = []
    trainer._send_hook = sent.append

    async def present(name: str, timeout: float) -> None:
        return None

    trainer.wait_for_peer = present

    async def deliver(sender: str, payload):
        envelope = Envelope(type(payload).__name__, sender, "trainer", 1, None, 0.0, None, True, payload)
        return await getattr(trainer, trainer._handlers[envelope.kind])(payload, envelope)

    return trainer, sent, deliver


@pytest.mark.parametrize("colocate", [True, False])
async def test_a_colocated_trainer_asks_for_its_first_batch_once_the_engines_are_built(tmp_path, colocate):
    from vime.messages.gpu_turns import EnginesStarted
    from vime.messages.pipeline import WantBatch

    trainer, sent, deliver = _trainer(tmp_path, colocate)

    def asked() -> list[WantBatch]:
        return [envelope.payload for envelope in sent if isinstance(envelope.payload, WantBatch)]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trainer._train_loop)
        await trio.sleep(0.5)
        assert asked() == ([] if colocate else [WantBatch(step=0)])
        await deliver("driver", EnginesStarted())
        await trio.sleep(0.1)
        assert asked() == [WantBatch(step=0)]
        nursery.cancel_scope.cancel()


def _one_group_batch(step: int):
    from vime.messages.pipeline import Sample, TrainBatch

    samples = [Sample(group_id=step, index=i, prompt_ids=[5, 6, 7], response_ids=[8, 9], logprobs=[-1.0, -1.0],
                      versions=[0, 0], finish_reason="length", label="", metadata={}, reward=float(i))
               for i in range(2)]
    return TrainBatch(step=step, samples=samples, stats={"time_generate_s": 0.1, "time_reward_s": 0.0})


@pytest.mark.parametrize("release", ["ready", "gone", "silent"])
async def test_a_colocated_engine_is_built_only_between_training_steps(tmp_path, monkeypatch, release):
    """A worker (a restarted one, say) asking to build its engine on the trainer's GPU during a long step is
    refused but keeps its place; the next step then waits until it has been let build and has asked WantWeights
    (or died, or stayed silent past ENGINE_BUILD_S): no engine profiles its memory beside training."""
    import threading

    from vime.messages.gpu_turns import BuildTurn, EnginesStarted, MayBuildEngine
    from vime.weights import WantWeights

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr("vime.gpu_turns.ENGINE_BUILD_S", 3.0 if release == "silent" else 600.0)
    monkeypatch.setattr("vime.gpu_turns.BUILD_TURN_KEPT_S", 1.0)  # the step below lasts longer
    trainer, _, deliver = _trainer(tmp_path, colocate=True)
    await deliver("driver", EnginesStarted())
    in_step, step_may_end, busy_in_steps = threading.Event(), threading.Event(), []
    train_step = trainer.engine.train_step

    def long_step(batch):
        busy_in_steps.append(trainer.gpu.busy)
        in_step.set()
        step_may_end.wait(60)
        return train_step(batch)

    trainer.engine.train_step = long_step
    order: list[str] = []
    ask = MayBuildEngine(host=os.uname().nodename, gpus=["0"])

    async def worker() -> None:
        while await deliver("rollout-1", ask) != BuildTurn(granted=True):
            if order[-1:] != ["refused"]:
                order.append("refused")
            await trio.sleep(0.5)
        order.append("granted")
        if release != "silent":
            await trio.sleep(1.0)  # it builds
            order.append("released")
            if release == "ready":
                await deliver("rollout-1", WantWeights(weight_version=0, gpus=["0"]))
            else:
                await trainer.on_peer_gone("rollout-1")

    async with trio.open_nursery() as nursery:
        trainer._nursery = nursery
        nursery.start_soon(trainer._train_loop)
        await trainer._on_batch(_one_group_batch(0), None)
        await trio.to_thread.run_sync(in_step.wait, 60)
        nursery.start_soon(worker)
        await trio.sleep(2.0)  # refused for twice as long as a place is kept: asking again keeps it
        await trainer._on_batch(_one_group_batch(1), None)
        step_may_end.set()
        with trio.fail_after(60):
            for _ in range(2):
                order.append(f"row {(await trainer.rows.unwritten.receive())['step']}")
        nursery.cancel_scope.cancel()
    assert order == ["refused", "row 1", "granted", *(["released"] if release != "silent" else []), "row 2"]
    assert busy_in_steps == [True, True] and not trainer.gpu.builds and not trainer.gpu.queued


async def test_engines_on_the_trainers_gpu_are_built_one_at_a_time_and_others_at_once(tmp_path, monkeypatch):
    from vime.messages.gpu_turns import BuildTurn, MayBuildEngine
    from vime.weights import WantWeights

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    trainer, _, deliver = _trainer(tmp_path, colocate=True)
    here = MayBuildEngine(host=os.uname().nodename, gpus=["0"])
    async with trio.open_nursery() as nursery:
        trainer._nursery = nursery
        assert await deliver("rollout-0", here) == BuildTurn(granted=True)
        assert await deliver("rollout-1", here) == BuildTurn(granted=False)  # two profiles would see each other
        assert await deliver("elsewhere", MayBuildEngine(host="another-host", gpus=["0"])) == BuildTurn(granted=True)
        assert await deliver("other-gpu", MayBuildEngine(host=here.host, gpus=["1"])) == BuildTurn(granted=True)
        assert set(trainer.gpu.builds) == {"rollout-0"} and set(trainer.gpu.queued) == {"rollout-1"}
        await deliver("rollout-0", WantWeights(weight_version=0, gpus=["0"]))
        assert await deliver("rollout-1", here) == BuildTurn(granted=True)
        assert set(trainer.gpu.builds) == {"rollout-1"} and not trainer.gpu.queued
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("colocate", [True, False])
async def test_a_colocated_worker_builds_its_engine_only_once_the_trainer_lets_it(tmp_path, colocate):
    from vime.actors.rollout import RolloutWorker
    from vime.messages.gpu_turns import BuildTurn
    from vime.runtime import ActorSettings
    from vime.scenarios import arithmetic

    config = arithmetic.prepare(tmp_path, arithmetic.defaults().replace(colocate=colocate)).to_dict()
    worker = RolloutWorker(ActorSettings(name="rollout-1", listen="ipc:///none", run_dir=str(tmp_path)), config)
    calls: list[str] = []
    turns = iter([False, False, True])

    async def ask(name: str, payload, timeout: float) -> BuildTurn:
        calls.append(f"{type(payload).__name__} to {name}")
        return BuildTurn(granted=next(turns))

    async def present(name: str, timeout: float) -> None:
        return None

    class Built(Exception):
        """Stops on_start once the engine would be built."""

    def build():
        calls.append("build")
        raise Built

    worker.ask, worker.wait_for_peer, worker._build_engine = ask, present, build
    with pytest.raises(Built):
        await worker.on_start()
    assert calls == (["MayBuildEngine to trainer"] * 3 + ["build"] if colocate else ["build"])


def test_reference_engines_stay_on_cpu():
    with pytest.raises(ValueError, match="pass --train-backend megatron"):
        place(RunConfig().replace(actor_num_gpus_per_node=1, rollout_backend="vllm"), ["0"])
    with pytest.raises(ValueError, match="pass --rollout-backend vllm"):
        place(RunConfig().replace(rollout_num_gpus=1), ["0"])


def test_the_hosts_gpus_are_those_cuda_visible_devices_names(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-x,GPU-y")
    assert visible_gpus() == ["GPU-x", "GPU-y"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def _environment(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(pair.decode().split("=", 1) for pair in pairs if b"=" in pair)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads a process's environment from /proc")
async def test_a_placed_process_keeps_its_gpus_across_a_restart(tmp_path):
    async with open_job(tmp_path) as job:
        info = await job.spawn(ECHO, "echo0", restart=True, env={"CUDA_VISIBLE_DEVICES": "1"})
        assert _environment(info.pid)["CUDA_VISIBLE_DEVICES"] == "1"
        os.kill(info.pid, signal.SIGKILL)
        await job.wait_event("restarted", "echo0", timeout=30)
        assert _environment(job.actors["echo0"].pid)["CUDA_VISIBLE_DEVICES"] == "1"


class _Buckets:
    """Stands in for the trainer's engine in a CUDA IPC publication: three buckets, counted as they are made
    (each one a gather on every tensor-parallel rank); it notes in ``events`` when it gives its memory back."""

    weight_version = 1

    def __init__(self, events: list) -> None:
        self.made: list[int] = []
        self.events = events

    def shared_buckets(self, bucket_bytes: int, dtype):
        for index in range(3):
            self.made.append(index)
            yield [["w", [1], "float32"]], [{"gpu": "GPU-a"}]

    def release_memory(self) -> None:
        self.events.append("released")


@pytest.mark.parametrize("sleeping", [False, True])
async def test_weights_over_cuda_ipc_stop_being_gathered_once_no_receiver_is_left(tmp_path, sleeping):
    """A worker whose load fails gets no further buckets (the caller sends it the weights over nng); the others
    get them all, then the message that ends the version, which engines put to sleep get only once the
    trainer has given back what the publication used. Once no receiver is left the trainer's ranks stop
    gathering."""
    from vime.messages.runtime import ErrorReply
    from vime.runtime import RemoteError

    trainer, _, _ = _trainer(tmp_path, colocate=True)
    if sleeping:
        trainer.run = trainer.weights.run = trainer.run.replace(rollout_backend="vllm",
                                                                vllm_args={"enable_sleep_mode": True})
    events: list = []
    trainer.engine = trainer.weights.engine = engine = _Buckets(events)

    async def ask(worker: str, message, timeout: float) -> None:
        events.append((worker, message.index, message.last))
        if worker == "rollout-0":
            raise RemoteError(worker, ErrorReply(reason="handler failed", error="no memory"))

    trainer.ask = ask
    released = ["released"] if sleeping else []
    ipc = trainer.weights.half(CudaIpc)
    assert await ipc.send(["rollout-0", "rollout-1"], {}) == ["rollout-0"]
    assert [e for e in events if e == "released" or e[0] == "rollout-1"] == [
        ("rollout-1", 0, False), ("rollout-1", 1, False), ("rollout-1", 2, False), *released, ("rollout-1", 3, True)]
    assert [e for e in events if e[0] == "rollout-0"] == [("rollout-0", 0, False)]
    assert engine.made == [0, 1, 2]
    events.clear()
    engine.made = []
    assert await ipc.send(["rollout-0"], {}) == ["rollout-0"]
    assert events == [("rollout-0", 0, False), *released] and engine.made == [0]


async def test_a_worker_joining_over_nng_gets_the_chunks_already_made_without_a_new_gather(tmp_path):
    """The chunks of the current version are kept until the next (the outbox may still be sending them), so a
    worker that joins or falls back to nng later in the step gets them as they are: a tensor-parallel trainer
    would otherwise gather the whole model again."""
    from vime.weights import Nng, WeightsChunk

    trainer, sent, _ = _trainer(tmp_path, colocate=False)
    gathers = []
    weights = trainer.engine.named_weights

    def named_weights(device=None):
        gathers.append(device)
        return weights(device)

    trainer.engine.named_weights = named_weights
    trainer.weights.paths = {"rollout-0": Nng, "rollout-1": Nng}
    await trainer.weights.publish(["rollout-0"])
    await trainer.weights.publish(["rollout-1"])
    chunks = [(envelope.receiver, envelope.payload.index) for envelope in sent
              if isinstance(envelope.payload, WeightsChunk)]
    count = len(trainer.weights.half(Nng).chunks)
    assert gathers == ["cpu"] and count >= 1
    assert chunks == [("rollout-0", i) for i in range(count)] + [("rollout-1", i) for i in range(count)]


async def test_a_colocated_trainer_shares_one_buffer_whatever_its_receivers_do(tmp_path, monkeypatch):
    """Sixty versions over CUDA IPC (share stood in on CPU) from the real engine of the arithmetic scenario:
    one receiver loads every bucket, one fails its loads from version 10 on, one dies at version 20. The
    trainer shares one buffer of exactly the model's size for the whole run, and every receiver that answers
    reads the version being published from it. Before, each version shared a new bucket-sized buffer that
    torch never freed once opened: the colocated H200 runs died of it at step 96."""
    from vime.messages.runtime import ErrorReply
    from vime.runtime import PeerGone, RemoteError
    from vime.transports import gpu

    buffers: dict[int, object] = {}

    def share(tensor):
        buffers[len(buffers)] = tensor
        return {"gpu": "GPU-a", "buffer": len(buffers) - 1}

    monkeypatch.setattr(gpu, "share", share)
    trainer, _, _ = _trainer(tmp_path, colocate=True)
    engine = trainer.engine
    read: dict[str, list[int]] = {"rollout-0": [], "rollout-1": [], "rollout-2": []}
    dead: set[str] = set()

    async def ask(worker: str, message, timeout: float) -> None:
        if worker == "rollout-2" and engine.weight_version >= 20:
            dead.add(worker)
            raise PeerGone(worker)
        if worker == "rollout-1" and engine.weight_version >= 10:
            raise RemoteError(worker, ErrorReply(reason="handler failed", error="out of memory"))
        if message.specs:
            flat = buffers[message.buffers[0]["buffer"]]
            expected = dict(engine.rollout_weights(torch.float32))
            for name, view in gpu.unpack(flat, [tuple(spec) for spec in message.specs]):
                assert torch.equal(view, expected[name]), (worker, name)
        read[worker].append(engine.weight_version)

    trainer.ask = ask
    receivers = list(read)
    for version in range(60):
        engine.weight_version = version
        with torch.no_grad():
            next(iter(engine.named_weights().values())).add_(1.0)  # the version's own weights
        failed = await trainer.weights.half(CudaIpc).send(receivers, {})  # the caller: nng for those from now on
        receivers = [worker for worker in receivers if worker not in failed and worker not in dead]
    model_bytes = sum(gpu._spec_bytes(gpu._spec(name, tensor))
                      for name, tensor in engine.rollout_weights(torch.float32))
    assert len(buffers) == 1 and buffers[0].numel() == model_bytes < trainer.run.job.weight_bucket_mb << 20
    assert sorted(set(read["rollout-0"])) == list(range(60))
    assert sorted(set(read["rollout-1"])) == list(range(10)) and sorted(set(read["rollout-2"])) == list(range(20))


async def test_a_worker_forgotten_before_it_is_served_leaves_no_group_and_is_not_brought_back(tmp_path):
    """A broadcast group is formed before its worker is served (outside the weights lock); a worker that dies
    or asks again meanwhile must leave no group behind, or the next publication would broadcast to a dead
    peer. A worker forgotten while its GPU load failed is not put back on nng."""
    from vime.weights import Broadcast, Nng

    trainer, _, _ = _trainer(tmp_path, colocate=False)
    groups = trainer.weights.half(Broadcast).groups
    groups["rollout-0"] = object()  # attached, not yet served
    trainer._forget("rollout-0")
    assert "rollout-0" not in groups and not trainer.weights.serves("rollout-0")
    trainer.weights.serve("rollout-1", Nng)
    trainer._forget("rollout-1")
    with pytest.raises(LookupError, match="no longer served"):
        trainer.weights.fall_back("rollout-1")
    assert not trainer.weights.serves("rollout-1")
