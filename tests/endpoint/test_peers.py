"""What the data plane's workers tell each other (workers.Peers): where each prompt went, so that every
worker routes with what all of them sent. Real socket pairs (workers.peer_links), one event loop."""

from __future__ import annotations

import asyncio

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane.routing import choose
from hpcserve.endpoint.dataplane.routing.table import Affinity, RoutingTable
from hpcserve.endpoint.dataplane.workers import Peers, peer_links
from hpcserve.endpoint.protocol import BackendSpec

URLS = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
PROMPT_TOKENS = 2000  # the GPU benchmark's prompts: 16 KB of token ids a message
BURST = 64  # one worker's half of the GPU benchmark's first burst (128 in flight, 2 workers)


def pool_of(urls: list[str]) -> RoutingTable:
    pool = RoutingTable()
    pool.update([BackendSpec(url) for url in urls])
    return pool


def prompt(number: int) -> Affinity:
    """A distinct prompt: its text blocks, and token ids (the sibling records both)."""
    return Affinity(None, [number * 4 + 1, number * 4 + 2, number * 4 + 3], list(range(number, number + PROMPT_TOKENS)))


def test_each_choice_knows_every_prompt_a_sibling_routed_before_it():
    """A burst: one worker routes 64 new prompts, half of them where nothing else would send them, and the
    other worker routes their repeats before its event loop comes round (busy with its own share of the
    burst). Each repeat goes where its prompt went. Before, siblings were heard only when the loop came
    round: on the GPU 60-120 ms late, and the repeats went by load (half of them to the other replica)."""

    async def burst() -> list[tuple[str, str]]:
        ends = peer_links(2)
        first, second = Peers(ends[0]), Peers(ends[1])
        first_pool, second_pool = pool_of(URLS), pool_of(URLS)
        first_pool.turn = 1  # each worker counts its own turns: alone, they would send prompt n to different replicas
        loop = asyncio.get_running_loop()
        first.listen(loop, lambda url: first_pool if url in first_pool.by_url else None)
        second.listen(loop, lambda url: second_pool if url in second_pool.by_url else None)
        routed = [first.choosing(choose)(first_pool, Routing.PREFIX, prompt(n), loop.time()).url for n in range(BURST)]
        # no await since: the second worker's loop has not run
        repeats = [second.choosing(choose)(second_pool, Routing.PREFIX, prompt(n), loop.time()).url for n in range(BURST)]
        return list(zip(routed, repeats))

    pairs = asyncio.run(burst())
    assert {url for url, _ in pairs} == set(URLS)  # the first worker spread them
    assert [n for n, (url, repeat) in enumerate(pairs) if url != repeat] == []


def test_a_prompt_for_a_backend_the_sibling_does_not_know_is_not_recorded():
    async def told() -> RoutingTable:
        ends = peer_links(2)
        teller, hearer, heard = Peers(ends[0]), Peers(ends[1]), pool_of(URLS[1:])
        teller.tell(URLS[0], prompt(1))
        teller.tell(URLS[1], prompt(2))
        hearer.choosing(choose)(heard, Routing.PREFIX, None, 0.0)
        return heard

    heard = asyncio.run(told())
    assert heard.index.match(URLS[1], prompt(2).blocks) == 3
    assert URLS[0] not in heard.by_url
