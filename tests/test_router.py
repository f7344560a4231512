"""The router on its own: spreading by load, and re-issuing what a dead worker held."""

from __future__ import annotations

from vime.actors.router import Router
from vime.messages.pipeline import GenerateGroup, GroupDone, WorkerLeaving, WorkerReady
from vime.runtime import ActorSettings
from vime.transports.codec import Envelope


def request(group_id: int, prompt_tokens: int = 2, max_new_tokens: int = 4) -> GenerateGroup:
    return GenerateGroup(group_id=group_id, prompt_ids=[1] * prompt_tokens, messages=[{"role": "user", "content": "1"}],
                         label="3", metadata={}, group_size=2,
                         min_weight_version=0, sampling={"max_new_tokens": max_new_tokens})


async def deliver(router: Router, payload, sender: str = "buffer") -> None:
    envelope = Envelope(type(payload).__name__, sender, "router", 1, None, 0.0, None, False, payload)
    await getattr(router, router._handlers[type(payload).__name__])(payload, envelope)


def assigned(sent: list[Envelope]) -> list[tuple[str, int]]:
    return [(e.receiver, e.payload.group_id) for e in sent if isinstance(e.payload, GenerateGroup)]


async def router_with_work(capacities: list[int], requests: int) -> tuple[Router, list[Envelope]]:
    """A router whose workers rollout-0, rollout-1 ... said hello, then got ``requests`` groups."""
    router = Router(ActorSettings(name="router", listen="ipc:///nonexistent"))
    sent: list[Envelope] = []
    router._send_hook = sent.append
    for index, capacity in enumerate(capacities):
        await deliver(router, WorkerReady(capacity=capacity, weight_version=0), sender=f"rollout-{index}")
    for group_id in range(requests):
        await deliver(router, request(group_id))
    return router, sent


async def test_requests_go_to_the_least_loaded_worker_and_wait_when_all_are_full():
    router, sent = await router_with_work([2, 1], requests=4)
    assert sorted(assigned(sent)) == [("rollout-0", 0), ("rollout-0", 2), ("rollout-1", 1)]
    await deliver(router, GroupDone(group_id=1), sender="rollout-1")
    assert assigned(sent)[-1] == ("rollout-1", 3)


async def test_a_dead_or_restarted_worker_loses_no_request():
    router, sent = await router_with_work([4, 4], requests=4)
    held = {g for w, g in assigned(sent) if w == "rollout-0"}
    await router.on_peer_gone("rollout-0")
    assert {g for w, g in assigned(sent)[4:]} == held and all(w == "rollout-1" for w, _ in assigned(sent)[4:])
    # the other order: the restarted process says hello before the driver's news of the death
    before = len(assigned(sent))
    await deliver(router, WorkerReady(capacity=8, weight_version=0), sender="rollout-1")
    reissued = assigned(sent)[before:]
    assert sorted(g for _, g in reissued) == [0, 1, 2, 3] and router.counters["reissued"] == len(held) + 4


async def test_balance_is_by_tokens_in_flight_not_by_group_count():
    router, sent = await router_with_work([4, 4], requests=0)
    await deliver(router, request(0, prompt_tokens=100, max_new_tokens=100))  # 400 tokens -> rollout-0
    for group_id in range(1, 4):  # 12 tokens each: all go to rollout-1, which still has fewer tokens
        await deliver(router, request(group_id))
    assert assigned(sent) == [("rollout-0", 0), ("rollout-1", 1), ("rollout-1", 2), ("rollout-1", 3)]
    assert router.tokens == {"rollout-0": 400, "rollout-1": 36}
    await deliver(router, GroupDone(group_id=0), sender="rollout-0")
    assert router.tokens == {"rollout-0": 0, "rollout-1": 36}
    await deliver(router, request(4))
    assert assigned(sent)[-1] == ("rollout-0", 4)


async def test_a_leaving_worker_hands_its_groups_back_and_gets_no_more():
    router, sent = await router_with_work([2, 2], requests=4)
    held = sorted(g for w, g in assigned(sent) if w == "rollout-0")
    await deliver(router, WorkerLeaving(group_ids=held), sender="rollout-0")
    assert "rollout-0" not in router.capacity and router.counters["reissued"] == 2
    await deliver(router, GroupDone(group_id=1), sender="rollout-1")
    await deliver(router, request(9))
    assert all(w == "rollout-1" for w, _ in assigned(sent)[4:])
    assert [g for _, g in assigned(sent)[4:]] == [held[0]]  # handed-back groups go first, as room frees up
    await deliver(router, GroupDone(group_id=held[1]), sender="rollout-0")  # a late report changes nothing
    assert router.counters["late_done"] == 1 and held[1] in router.requests and held[1] in router.waiting
    await deliver(router, GroupDone(group_id=held[0]), sender="rollout-1")
    assert assigned(sent)[-1] == ("rollout-1", held[1]) and router.counters["done"] == 2
