"""A model that sleeps when idle (autoscale.min 0): what its room knows of the wake, and how a request
waits for it.

    room.sleep.set(Waking(...))       # PUT /waking: the controller says asleep, queued, starting or serving
    room.sleep.ask()                  # a request found no replica: the count a GET /waking long poll reads
    backend_or_answer = await wait_for_wake(plane, request, room, affinity, body, until, refuse)

A request that finds no replica of a sleeping model is held (as any held request, plane.hold) up to the
controller's wake_wait_s, and told the controller at once (ask: a GET /waking waiting there returns). A
streamed one gets its 200 and SSE comments (`: waking model X (queued 12 s)`) at once and every
COMMENT_EVERY_S while it waits, and its answer follows in the same stream; when the wait would pass its
limit (Slurm's expected start later than it, or the time is up) it gets 503 with Retry-After and the
reason, or, once its stream began, that error as an SSE event. The decisions are pure (wake_refusal).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import datetime

from aiohttp import web

from hpcserve.endpoint.dataplane import wire
from hpcserve.endpoint.dataplane.server import RELAYED, RelayedStream, request_key
from hpcserve.endpoint.protocol import Wakes, Waking

COMMENT_EVERY_S = 3.0  # an SSE comment to a waiting stream this often (proxies close silent streams)
# the request's waiting stream (already answered 200), for relay to go on in
WAITING = request_key("hpcserve.waking", RelayedStream)


class Sleep:
    """One room's sleep: the controller's last word (None: the model does not sleep) and the requests that
    asked for a replica while none served."""

    def __init__(self) -> None:
        self.waking: Waking | None = None
        self.asked = 0
        self.changed = asyncio.Event()  # set when a request asks: GET /waking returns

    @property
    def enabled(self) -> bool:
        return self.waking is not None

    def set(self, waking: Waking) -> None:
        self.waking = waking

    def ask(self) -> None:
        self.asked += 1
        self.changed.set()
        self.changed = asyncio.Event()

    async def wakes(self, after: int, wait_s: float, held: int) -> Wakes:
        """GET /waking: at once when more than `after` asked, else when one does or after wait_s."""
        if self.asked <= after and wait_s > 0:
            changed = self.changed
            try:
                async with asyncio.timeout(wait_s):
                    await changed.wait()
            except TimeoutError:
                pass
        return Wakes(self.asked, held)


def wake_refusal(waking: Waking, model: str, now: float, deadline: float) -> tuple[int, bytes] | None:
    """(Retry-After seconds, the 503 body) when a request waiting for a sleeping model must give up now: its
    wait is over, or the replica is expected later than its wait allows (Slurm's start estimate); None
    while it may wait on. now, deadline: epoch seconds. Pure."""
    ready_at = waking.ready_at
    late = ready_at is not None and ready_at > deadline
    if now < deadline and not late:
        return None
    state = waking.describe(now)
    if late and ready_at is not None:
        retry = max(wire.RETRY_AFTER_S, round(ready_at - now))
        expected = datetime.fromtimestamp(ready_at).strftime("%H:%M:%S")
        why = (f"its replica is {state}, expected to serve at about {expected}, later than this request may wait "
               f"({waking.wait_s:g} s, autoscale.wake_wait_s)")
    else:
        retry = max(wire.RETRY_AFTER_S, round(waking.ready_at - now)) if waking.ready_at else wire.RETRY_AFTER_S
        why = f"no replica woke within {waking.wait_s:g} s (autoscale.wake_wait_s); its replica is {state}"
    message = f"hpcserve endpoint: model {model[:200]!r} was asleep (scaled to zero) and is waking: {why}. " \
              f"Retry after {retry} s."
    return retry, wire.error_body(message, "service_unavailable", "model_waking")


def comment(model: str, waking: Waking, now: float) -> bytes:
    """An SSE comment line for a stream that waits (clients ignore it). Pure."""
    return f": waking model {model[:200]} ({waking.describe(now)})\n\n".encode()


def streamed(body: bytes | None) -> bool:
    """Whether the request asks for a stream (its body's "stream": true)."""
    if not body or b'"stream"' not in body:
        return False
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("stream") is True


async def wait_for_wake(plane, request: web.BaseRequest, room, affinity, body: bytes | None, until: float,
                        refuse: Callable[[int, bytes, int], Exception]):
    """Hold a request for a sleeping (or waking) model until a backend can take it: returns that backend, or
    the finished answer of a stream whose wait ran out. until: the hold's monotonic deadline. refuse(status,
    body, retry_after) makes the data plane's refusal (raised while nothing was answered)."""
    sleep, stats = room.sleep, plane.stats
    stats.holds += 1
    stats.held += 1
    room.held += 1
    sleep.ask()  # the controller's GET /waking returns now: the wake does not wait for a poll
    response: RelayedStream | None = None
    stream = streamed(body)
    next_comment = time.monotonic()
    try:
        while True:
            if room.closed:
                raise refuse(404, wire.error_body(f"The model {room.name[:200]!r} was removed from this endpoint "
                                                  "while the request waited.", "invalid_request_error",
                                                  "model_not_found"), 0)
            now = time.monotonic()
            epoch = time.time()
            refusal = wake_refusal(sleep.waking, room.name, epoch, epoch + until - now)
            if refusal is not None:
                stats.hold_timeouts += 1
                retry, answer = refusal
                if response is None:
                    raise refuse(503, answer, retry)
                await response.write(b"data: " + answer + b"\n\n")
                await response.write_eof()
                return response
            if stream and now >= next_comment:
                if response is None:
                    response = request[RELAYED] = request[WAITING] = RelayedStream(
                        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                    await response.prepare(request)
                await response.write(comment(room.name, sleep.waking, epoch))
                next_comment = now + COMMENT_EVERY_S
            wait = min(until, next_comment) - now if stream else until - now
            changed = room.changed
            try:
                async with asyncio.timeout(max(0.0, wait)):
                    await changed.wait()
            except TimeoutError:
                pass
            backend = plane.choose(room.pool, room.policy, affinity, time.monotonic())
            if backend is not None:
                return backend
    finally:
        stats.held -= 1
        room.held -= 1


async def answer_in_stream(response: RelayedStream, status: int, body: bytes) -> web.StreamResponse:
    """An engine's whole answer (an error, most likely) to a request whose stream already began while it
    waited: as one SSE event, then the end."""
    try:
        text = json.dumps(json.loads(body), separators=(",", ":")).encode()
    except ValueError:
        text = wire.error_body(f"the replica answered {status}: {body[:200]!r}", "server_error", "engine_error")
    await response.write(b"data: " + text + b"\n\n")
    await response.write_eof()
    return response


def waiting_stream(request: web.BaseRequest) -> RelayedStream | None:
    """The stream a request already began while it waited for a wake (its 200 sent), or None."""
    return request.get(WAITING)
