"""The data plane's side of the engines' KV events: one feed per backend (GET /hpcserve/kv-events on the
engine's own port, with the key; engine.kv_events relays it), each keeping that replica's TokenIndex in
pool.exact while it is live.

    feeds = Feeds(session, key, pool)
    feeds.sync()        # after every change of the pool: feeds for new backends, none for removed ones
    await feeds.close()

A feed that breaks (engine restarted, network) is dropped from pool.exact at once and tried again with
backoff; a new connection starts an empty index (the engine's cache from before is unknown: the
approximate index speaks for it). A gap in the publisher's sequence numbers (events dropped) empties the
index too. An engine that answers 404 publishes no events: its backend is routed by the approximate index
alone, and asked again only when it rejoins.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp

from hpcserve.endpoint.dataplane.routing.table import RoutingTable
from hpcserve.endpoint.dataplane.routing.token_index import TokenIndex
from hpcserve.engine.kv_events import HEARTBEAT_S, HEARTBEAT_SEQ, RELAY_PATH, FrameReader, decode_batch

READ_TIMEOUT_S = 5 * HEARTBEAT_S  # a relay sends a heartbeat each second: silence this long is a dead feed
RETRY_S = (0.5, 10.0)  # backoff between tries: first, most
NO_RELAY = (401, 403, 404, 405)


@dataclass
class FeedStats:
    events: int = 0
    gaps: int = 0  # batches lost between two received ones: the index started over
    connects: int = 0
    absent: set[str] = field(default_factory=set)  # backends whose engine publishes no events


class Feeds:
    def __init__(self, session: aiohttp.ClientSession, key: str | None, pool: RoutingTable):
        self.session, self.pool = session, pool
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.stats = FeedStats()

    def sync(self) -> None:
        wanted = set(self.pool.by_url)
        for url in [u for u in self.tasks if u not in wanted]:
            self.tasks.pop(url).cancel()
            self.pool.exact.pop(url, None)
        self.stats.absent &= wanted  # a backend that left and rejoins is asked again
        for url in wanted - set(self.tasks) - self.stats.absent:
            self.tasks[url] = asyncio.get_running_loop().create_task(self.follow(url))

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self.tasks.clear()

    async def follow(self, url: str) -> None:
        """Keep url's index while the backend is in the pool."""
        delay = RETRY_S[0]
        while True:
            try:
                if await self.read(url) is False:
                    self.stats.absent.add(url)
                    self.tasks.pop(url, None)
                    return
                delay = RETRY_S[0]  # it had served: the next try comes soon
            except (aiohttp.ClientError, TimeoutError, ValueError, OSError):
                pass
            finally:
                self.pool.exact.pop(url, None)
            await asyncio.sleep(delay)
            delay = min(RETRY_S[1], delay * 2)

    async def read(self, url: str) -> bool:
        """One connection's events into a new index; False when the engine has no relay."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=READ_TIMEOUT_S)
        async with self.session.get(url + RELAY_PATH, headers=self.headers, timeout=timeout) as response:
            if response.status in NO_RELAY:
                return False
            if response.status != 200:
                return True
            self.stats.connects += 1
            backend = self.pool.by_url.get(url)
            index = TokenIndex()
            # Complete: nothing was sent there before the feed began, so every block it holds of ours is in
            # the index; else its older blocks are only in the approximate index (balance.cached_share).
            index.complete = backend is not None and backend.requests == 0
            self.pool.exact[url] = index
            reader, expected = FrameReader(), None
            async for data in response.content.iter_any():
                for seq, payload in reader.feed(data):
                    if seq == HEARTBEAT_SEQ:
                        continue
                    if expected is not None and seq != expected:
                        self.stats.gaps += 1
                        index.clear()
                        index.complete = False
                    expected = seq + 1
                    events = decode_batch(payload)
                    self.stats.events += len(events)
                    index.apply(events)
            return True
