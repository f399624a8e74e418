"""Admission (endpoint/dataplane/admission.py): while prompts in flight take the replicas' KV caches, new prefills
wait and a request whose prefix a replica holds goes first. The order (pure), and the waiting itself with
asyncio. On real engines through the data plane: tests/endpoint/test_router_vllm.py."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hpcserve.endpoint.dataplane.admission import ACTIVE_S, AGE_S, KEEP_S, Admission, FairQueue, FairShare, Ticket, next_admitted
from hpcserve.endpoint.dataplane.routing.table import Affinity, RoutingTable
from hpcserve.endpoint.dataplane.routing.prefix_index import prompt_blocks
from hpcserve.endpoint.protocol import BackendSpec

A, B, C = "http://10.0.0.1:8001", "http://10.0.0.2:8001", "http://10.0.0.3:8001"


def test_a_held_prefix_goes_first_then_the_oldest_that_fits():
    now = 100.0
    waiting = [(600, False, now - 1), (50, True, now - 0.5), (40, True, now)]
    assert next_admitted(waiting, room=100, idle=False, now=now) == 1  # the first held prefix that fits
    assert next_admitted(waiting, room=45, idle=False, now=now) == 2
    assert next_admitted(waiting, room=30, idle=False, now=now) is None  # nothing fits: all wait
    assert next_admitted([(600, False, now), (700, False, now)], room=650, idle=False, now=now) == 0  # in order
    assert next_admitted([(700, False, now), (600, False, now)], room=650, idle=False, now=now) is None
    assert next_admitted([(5000, False, now)], room=10, idle=True, now=now) == 0  # nothing in flight: it goes
    assert next_admitted([], room=10, idle=True, now=now) is None


def test_a_request_that_waited_long_goes_before_held_prefixes():
    now = 100.0
    waiting = [(600, False, now - AGE_S), (50, True, now)]
    assert next_admitted(waiting, room=100, idle=False, now=now) is None  # the old one waits for its room
    assert next_admitted(waiting, room=600, idle=False, now=now) == 0


def pool(kv_tokens: int | None = 1000) -> RoutingTable:
    p = RoutingTable()
    p.update([BackendSpec(A, kv_tokens=kv_tokens), BackendSpec(B, kv_tokens=kv_tokens)])
    return p


def prompt(text: str, tokens: int = 400) -> Affinity:
    """A prompt of `tokens` token ids whose text blocks the approximate index matches."""
    return Affinity(blocks=prompt_blocks(text.encode()), tokens=list(range(tokens)))


def test_waiting_in_turn_with_held_prefixes_first():
    async def scenario():
        plane_pool = pool()
        admission = Admission(plane_pool, share=0.25, workers=1)  # 500 prefill tokens in flight
        assert admission.budget() == 500
        first = await admission.enter(prompt("one " * 400))
        assert first.cost == 400
        waiting_miss = asyncio.create_task(admission.enter(prompt("two " * 400)))
        await asyncio.sleep(0)
        assert not waiting_miss.done() and len(admission.waiting) == 1
        plane_pool.index.record(A, prompt_blocks(("three " * 400).encode()))  # held by replica A
        held = await asyncio.wait_for(admission.enter(prompt("three " * 400)), 5)  # passes the miss that waits
        assert held.cost == 0 and not waiting_miss.done()
        admission.leave(first)
        second = await asyncio.wait_for(waiting_miss, 5)
        assert second.cost == 400 and admission.in_flight == 400 and admission.waits == 1
        admission.leave(second)
        admission.leave(held)
        assert admission.in_flight == 0 and admission.admitted == 0

    asyncio.run(scenario())


def test_a_client_that_leaves_while_waiting_charges_nothing():
    async def scenario():
        admission = Admission(pool(), share=0.25)
        first = await admission.enter(prompt("one " * 400))
        gone = asyncio.create_task(admission.enter(prompt("two " * 400)))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert not admission.waiting
        admission.leave(first)
        assert admission.in_flight == 0 and admission.admitted == 0

    asyncio.run(scenario())


def test_no_waiting_without_cache_sizes_or_token_ids_and_all_go_when_sizes_go():
    async def scenario():
        unknown = Admission(pool(kv_tokens=None), share=0.25)
        assert unknown.budget() is None
        assert [(await unknown.enter(prompt(f"{i} " * 400))).cost for i in range(5)] == [0] * 5
        off = Admission(pool(), share=0.0)
        assert off.budget() is None
        sized = pool()
        admission = Admission(sized, share=0.25)
        await admission.enter(Affinity(blocks=prompt_blocks(b"x" * 4000)))  # no token ids: never waits
        await admission.enter(prompt("one " * 400))
        late = asyncio.create_task(admission.enter(prompt("two " * 400)))
        await asyncio.sleep(0)
        assert not late.done()
        sized.update([BackendSpec(A, kv_tokens=1000), BackendSpec(B, kv_tokens=1000), BackendSpec(C)])
        admission.admit()  # a replica joined whose cache size is not known: admission is off
        assert (await asyncio.wait_for(late, 5)).cost == 0

    asyncio.run(scenario())


def test_each_worker_admits_against_its_share_of_the_caches():
    assert Admission(pool(), share=0.5, workers=2).budget() == 500
    assert Admission(pool(), share=1.0, workers=4).budget() == 500


def test_only_as_many_waiting_requests_are_costed_as_the_choice_needs():
    now, read = 100.0, []

    def costs(items):
        for item in items:
            read.append(item)
            yield item

    waiting = [(600, False, now), (50, True, now), *[(40, True, now)] * 100]
    assert next_admitted(costs(waiting), room=100, idle=False, now=now) == 1
    assert len(read) == 2  # the first held prefix that fits ends the search
    read.clear()
    assert next_admitted(costs([(600, False, now)] * 100), room=700, idle=False, now=now) == 0
    assert len(read) == 64  # at most SCAN looked at


# ------------------------------------------------------------------ fair share (with tenants)

def test_fair_queue_gives_turns_by_weight_and_no_credit_for_idling():
    queue = FairQueue({"chem": 2.0})
    turns = []
    for _ in range(9):
        name = queue.pick(["phys", "chem"])
        queue.served(name)
        turns.append(name)
    assert turns.count("chem") == 6 and turns.count("phys") == 3  # weight 2 against 1, both waiting all along
    for _ in range(20):  # bio idles while chem is served alone...
        queue.served("chem")
    turns = [queue.pick(["chem", "bio"]) for _ in range(1)]
    queue.served(turns[0])
    later = []
    for _ in range(6):
        name = queue.pick(["chem", "bio"])
        queue.served(name)
        later.append(name)
    assert later.count("bio") <= 3  # ...and comes back without credit: it shares from now on, no burst


def ticket(project: str, user: str) -> Ticket:
    return Ticket(None, 0.0, project=project, user=user)


def test_fair_share_picks_projects_by_share_then_users_within_them():
    fair = FairShare({"a": 1.0, "b": 1.0})
    waiting = [ticket("a", "a1")] * 10 + [ticket("a", "a2")] * 10 + [ticket("b", "b1")] * 2
    picks = []
    for _ in range(6):
        project, user = fair.choose(waiting)
        fair.served(project, user)
        picks.append((project, user))
    assert [p for p, _ in picks].count("b") == 3  # the project with one user gets half the turns
    assert {u for p, u in picks if p == "a"} == {"a1", "a2"}  # a's turns go round its users


def test_a_user_alone_takes_every_place_and_no_more():
    fair = FairShare({})
    fair.arrived("p", "alone", 0.0)
    assert fair.may_go("p", "alone", admitted=9, capacity=8, slots=10, now=0.0)  # the extra places too
    assert not fair.may_go("p", "alone", admitted=10, capacity=8, slots=10, now=0.0)  # the rest wait here
    fair.arrived("q", "other", 0.0)
    assert not fair.may_go("q", "other", admitted=8, capacity=8, slots=10, now=0.0)  # shared: no engine queue
    assert fair.may_go("q", "other", admitted=7, capacity=8, slots=10, now=0.0)  # a free place in a batch


def test_while_the_replicas_are_full_a_light_user_passes_a_heavy_users_queue():
    async def scenario():
        table = RoutingTable()
        table.update([BackendSpec(A, capacity=2)])  # 2 run at once, 3 places (capacity + 1)
        admission = Admission(table, 0.0, fair=FairShare({}))
        heavy = [asyncio.ensure_future(admission.enter(None, "p-heavy", "heavy")) for _ in range(6)]
        await asyncio.sleep(0)
        admitted = [t for t in heavy if t.done()]
        assert len(admitted) == 3 and len(admission.waiting) == 3  # alone: the places, the rest wait here
        light = asyncio.ensure_future(admission.enter(None, "p-light", "light"))
        await asyncio.sleep(0)
        assert not light.done()  # full: it waits here, not in the engine's queue
        admission.leave(admitted[0].result())
        await asyncio.sleep(0)
        assert not light.done()  # 2 in flight: the engine's batch is full (heavy's queued one runs now)
        admission.leave(admitted[1].result())
        await asyncio.sleep(0)
        assert light.done() and len(admission.waiting) == 3  # a free place in the batch: the light user's
        # what they waited, per project: the light user's one request; heavy's that went at once are not in it
        assert sum(admission.waited["p-light"][:-1]) == 1 and admission.waited["p-light"][-1] > 0
        assert "p-heavy" not in admission.waited
        for task in heavy:
            task.cancel()

    asyncio.run(scenario())


def test_a_heavy_user_leaves_a_place_free_for_others_while_they_are_active():
    async def scenario():
        table = RoutingTable()
        table.update([BackendSpec(A, capacity=4)])  # 4 run at once, 5 places
        admission = Admission(table, 0.0, fair=FairShare({}))
        first_light = await admission.enter(None, "p-light", "light")
        heavy = [asyncio.ensure_future(admission.enter(None, "p-heavy", "heavy")) for _ in range(10)]
        await asyncio.sleep(0)
        # heavy stops at its share (2 of the 4 the replica runs), one place stays free for the light user
        assert sum(t.done() for t in heavy) == 2 and admission.admitted == 3
        second_light = asyncio.ensure_future(admission.enter(None, "p-light", "light"))
        await asyncio.sleep(0)
        assert second_light.done()  # at once: a place of the replica's, not a wait behind heavy's queue
        for ticket in (first_light, second_light.result()):
            admission.leave(ticket)
        await asyncio.sleep(0)
        assert sum(t.done() for t in heavy) == 2  # the places light freed stay light's for KEEP_S
        third_light = asyncio.ensure_future(admission.enter(None, "p-light", "light"))
        await asyncio.sleep(0)
        assert third_light.done()  # its next request starts at once, in a place of its own
        for task in heavy:
            task.cancel()

    asyncio.run(scenario())


def test_places_a_light_user_freed_go_back_to_the_heavy_user_after_keep_s():
    fair = FairShare({})
    for who in ("light", "heavy"):
        fair.arrived("p-" + who, who, 0.0)
    for _ in range(2):
        fair.served("p-light", "light")
    for _ in range(5):
        fair.served("p-heavy", "heavy")
    for _ in range(2):
        fair.ended("p-light", "light", 1.0)  # light's 2 places freed: 5 of 8 taken
    # heavy (above its share of 4) leaves RESERVE and light's two: 5 + 1 + 2 = 8
    assert not fair.may_go("p-heavy", "heavy", admitted=5, capacity=8, slots=10, now=1.0 + KEEP_S / 2)
    assert fair.may_go("p-light", "light", admitted=5, capacity=8, slots=10, now=1.0 + KEEP_S / 2)
    # KEEP_S later they are anyone's (light still active: RESERVE stays free)
    assert fair.may_go("p-heavy", "heavy", admitted=5, capacity=8, slots=10, now=1.0 + KEEP_S)
    assert not fair.may_go("p-heavy", "heavy", admitted=7, capacity=8, slots=10, now=1.0 + KEEP_S)


def test_a_heavy_user_keeps_no_places_from_another():
    """Places are kept only for users below their share: two batch jobs share by the fair order."""
    fair = FairShare({})
    for who in ("h1", "h2"):
        fair.arrived(who, who, 0.0)
    for _ in range(6):
        fair.served("h1", "h1")
    for _ in range(2):
        fair.served("h2", "h2")
    fair.ended("h1", "h1", 0.5)  # h1 (5, above its 4) freed one: not kept from h2
    assert fair.may_go("h2", "h2", admitted=7, capacity=8, slots=10, now=0.6)  # h2 below its share
    fair.served("h2", "h2")
    for _ in range(3):
        fair.served("h2", "h2")  # h2 at 6: above its share too
    assert fair.may_go("h2", "h2", admitted=6, capacity=8, slots=10, now=0.7)  # h1's freed place: not kept


def test_pause_whom_is_the_user_furthest_above_their_share_and_only_for_one_below_theirs():
    fair = FairShare({"big": 3.0})
    for project, user in (("big", "b1"), ("small", "s1"), ("small", "s2")):
        fair.arrived(project, user, 0.0)
    for _ in range(5):
        fair.served("small", "s1")  # its share: 8 x 1/4 / 2 = 1
    for _ in range(3):
        fair.served("big", "b1")  # its share: 8 x 3/4 = 6
    everyone = [("big", "b1"), ("small", "s1"), ("small", "s2")]
    assert fair.pause_whom(("small", "s2"), 8, everyone) == ("small", "s1")  # 4 above; b1 is below
    assert fair.pause_whom(("small", "s1"), 8, everyone) is None  # above its own share: it waits its turn
    assert fair.pause_whom(("small", "s2"), 8, [("big", "b1")]) is None  # b1 has no stream to spare
    fair.served("small", "s2")
    assert fair.pause_whom(("small", "s2"), 8, everyone) is None  # at its share: no pause for it


async def settle() -> None:
    """Until the tasks woken now have run (a granted wait resumes its task one turn of the loop later)."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_stream_above_its_share_pauses_for_a_light_user_and_resumes_first_among_its_users():
    async def scenario():
        table = RoutingTable()
        table.update([BackendSpec(A, capacity=2)])
        admission = Admission(table, 0.0, fair=FairShare({}))
        asked = []

        def pausable(ticket: Ticket, answer: bool):
            admission.may_pause(ticket, lambda: asked.append(ticket) or answer)

        heavy = [await admission.enter(None, "p-heavy", "heavy") for _ in range(2)]
        pausable(heavy[0], answer=True)
        pausable(heavy[1], answer=False)  # the newest, asked first, cannot (its end is on its way)
        light = asyncio.ensure_future(admission.enter(None, "p-light", "light"))
        await settle()
        # the paused stream's place went to light as it paused, not once the stream's read saw the close
        assert asked == [heavy[1], heavy[0]] and light.done() and heavy[0].out
        queued = asyncio.ensure_future(admission.enter(None, "p-heavy", "heavy"))  # shared now: it waits
        resumed = asyncio.ensure_future(admission.resume(heavy[0]))  # the stream closed: it waits for a place
        await settle()
        assert not resumed.done() and admission.admitted == 2
        assert admission.waiting[0] is heavy[0] and heavy[0].out  # before the heavy user's queued one
        second_light = asyncio.ensure_future(admission.enter(None, "p-light", "light"))
        await settle()
        assert len(asked) == 2 and not second_light.done()  # light is at its share now: nothing pauses
        admission.leave(heavy[1])
        await settle()
        assert resumed.done() and not heavy[0].out  # the paused stream first, before the queued request
        assert not queued.done() and not second_light.done()
        admission.leave(light.result())
        await settle()
        assert second_light.done() and not queued.done()
        assert admission.pauses == 1 and admission.admitted == 2
        queued.cancel()

    asyncio.run(scenario())


def test_a_paused_streams_client_that_leaves_while_it_waits_gives_nothing_back_twice():
    async def scenario():
        table = RoutingTable()
        table.update([BackendSpec(A, capacity=2)])
        admission = Admission(table, 0.0, fair=FairShare({}))
        paused, other = [await admission.enter(None, "p-heavy", "heavy") for _ in range(2)]
        admission.may_pause(paused, lambda: True)
        light = asyncio.ensure_future(admission.enter(None, "p-light", "light"))
        await settle()
        resumed = asyncio.ensure_future(admission.resume(paused))
        await settle()
        assert light.done() and admission.admitted == 2 and not resumed.done()
        resumed.cancel()  # the heavy user's client left while its stream waited for a place
        with pytest.raises(asyncio.CancelledError):
            await resumed
        admission.leave(paused)  # the turn's end: nothing, the place went back at the pause
        assert admission.admitted == 2 and not admission.waiting
        admission.leave(light.result())
        admission.leave(other)
        assert admission.admitted == 0

    asyncio.run(scenario())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["arrive", "serve", "go", "end", "wait"]), st.integers(0, 5),
                          st.floats(0.0, 2 * ACTIVE_S)), max_size=60))
def test_who_is_active_follows_its_definition_whatever_the_order(events):
    """The active users kept as requests come and go are those that sent one within ACTIVE_S or have one in
    flight, with the projects' weights summed over them: may_go answers as if counted afresh."""
    shares = {"p0": 3.0, "p1": 1.0}
    fair = FairShare(shares)
    last: dict[tuple[str, str], float] = {}
    now = 0.0
    for action, who_index, step in events:
        who = (f"p{who_index % 3}", f"u{who_index}")
        if action == "wait":
            now += step
        elif action == "arrive":
            fair.arrived(*who, now)
            last[who] = now
        elif action == "serve":
            fair.served(*who)
        elif action == "go":  # arrived and served at once (Admission's shortcut while there is room)
            fair.went(*who, now)
            last[who] = now
        elif fair.running.get(who):
            fair.ended(*who, now)
        active = {w for w, at in last.items() if now - at < ACTIVE_S} | set(fair.running)
        # expire is never due later than the first entry it has to drop
        firsts = [at + ACTIVE_S for at in fair.seen.values()][:1] + [until for _, until in fair.kept.values()][:1]
        assert fair.due <= min(firsts, default=math.inf)
        fair.expire(now)
        assert fair.active == len(active)
        projects = {p for p, _ in active}
        assert fair.weight_sum == pytest.approx(sum(shares.get(p, 1.0) for p in projects))
        assert fair.active_users == {p: sum(1 for q, _ in active if q == p) for p in projects}
        assert fair.kept_most == sum(most for most, _ in fair.kept.values())
        assert all(until > now for _, until in fair.kept.values())  # expire dropped the lapsed


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["enter", "stream", "end", "resume", "paused end", "cancel", "settle"]),
                          st.integers(0, 7)), max_size=60))
# a paused stream's client leaves while the stream waits for a place; another's leaves as its place comes
@example([("enter", 0), ("enter", 0), ("settle", 0), ("stream", 0), ("stream", 1), ("enter", 1), ("settle", 0),
          ("resume", 0), ("settle", 0), ("cancel", 0), ("settle", 0)])
@example([("enter", 0), ("enter", 0), ("settle", 0), ("stream", 0), ("enter", 1), ("settle", 0), ("resume", 0),
          ("settle", 0), ("end", 0), ("cancel", 0), ("settle", 0)])
def test_places_pauses_and_cancellations_keep_the_counts_whatever_the_order(events):
    """Requests of three users enter, their streams become pausable, pause for others, resume or end while
    paused (their last event was on its way), end, or their clients leave (while waiting, paused, in flight,
    or granted a place but not yet told): once the loop has run, the admission's counts always equal what is
    held and waiting, and never more than the places are in flight."""

    async def scenario():
        table = RoutingTable()
        table.update([BackendSpec(A, capacity=2)])
        admission = Admission(table, 0.0, fair=FairShare({}))
        entering: list[asyncio.Task] = []  # enter() under way (waiting, or granted)
        held: list[Ticket] = []  # admitted, in flight
        asked: list[Ticket] = []  # paused, not yet resumed
        resuming: dict[asyncio.Task, Ticket] = {}

        def pause_of(ticket: Ticket):
            def pause() -> bool:
                asked.append(ticket)
                held.remove(ticket)
                return True
            return pause

        for action, index in [*events, ("settle", 0)]:
            if action == "enter":
                user = ("heavy", "light", "other")[index % 3]
                entering.append(asyncio.ensure_future(admission.enter(None, "p-" + user, user)))
            elif action == "stream" and held:
                ticket = held[index % len(held)]
                admission.may_pause(ticket, pause_of(ticket))
            elif action == "end" and held:
                ticket = held.pop(index % len(held))
                admission.cannot_pause(ticket)
                admission.leave(ticket)
            elif action == "resume" and asked:
                ticket = asked.pop(index % len(asked))
                resuming[asyncio.ensure_future(admission.resume(ticket))] = ticket
            elif action == "paused end" and asked:  # its turn ends without resuming: nothing to give back
                ticket = asked.pop(index % len(asked))
                admission.cannot_pause(ticket)
                admission.leave(ticket)
            elif action == "cancel":  # a paused stream's client first, where one waits
                pending = [t for t in resuming if not t.done()] + [t for t in entering if not t.done()]
                if pending:
                    pending[index % min(2, len(pending))].cancel()
            elif action == "settle":
                settled = False
                while not settled:  # a cancelled pause's turn ends (leave), which may grant another
                    await settle()
                    settled = True
                    for task in [t for t in entering if t.done()]:
                        entering.remove(task)
                        if not task.cancelled():
                            held.append(task.result())
                    for task in [t for t in resuming if t.done()]:
                        ticket = resuming.pop(task)
                        if task.cancelled():
                            admission.leave(ticket)  # the turn's end: nothing to give back
                            settled = False
                        else:
                            held.append(ticket)
                assert admission.admitted == len(held)  # a paused stream's place was given back as it paused
                assert all(t.out for t in asked)
                assert len(admission.waiting) == len(entering) + len(resuming)
                assert all(not t.out for t in held) and all(t.out for t in resuming.values())
                assert admission.admitted <= admission.sizes()[1]  # never more than the places (slots)
        for task in entering + list(resuming):
            task.cancel()
        await settle()

    asyncio.run(scenario())
