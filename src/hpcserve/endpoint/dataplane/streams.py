"""A streamed answer, passed on to its client event by event, and continued on another replica when its
replica fails mid-stream or is handed over.

    stream = Stream(plane, response, backend, request, headers)
    await stream.run(upstream, first_chunk)      # ConnectionError: cut (not migratable, or no replica)

Only whole SSE events reach the client (migration.EventSplitter), so a replica that dies mid-event leaves
the client no half event. What caused a migration:
    broken     the connection to the engine dropped, or it fell silent for read_timeout_s (the replica is
               marked failed, as a refused connection is)
    error      the engine sent an error event or finished the choice with "abort" (it lives: not marked)
    handover   the controller drains the replica (its job ends, a scale-down, `down --member`): its open
               streams move now instead of being waited out, each at once (Stream.hand_over_now: an
               engine that has stalled, or is busy prefilling others, may send no next chunk for
               seconds or ever); one that cannot move finishes where it is. With no other replica
               serving, it waits for the next to join, as a held request does (successor.py), and
               continues there; past the wait the client gets an SSE error event, not a cut
    paused     fair share: its user is above their share and one below must otherwise wait for a place
               (admission.py); the stream gives its place back, waits in the admission, and continues
               (on the same replica where it has room: its prefix cache holds the tokens) when it gets
               another; not counted or listed as a migration (Admission.pauses is)
The continuation goes to the replica routing.choose picks among those not yet tried for this request, at
most settings.migrations times; every migration, and every stream that could not be migrated, is counted
(/metrics) and listed on the admin socket (GET /migrations: the controller writes them into its decisions).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from dataclasses import dataclass

import aiohttp

from hpcserve.endpoint.dataplane import successor
from hpcserve.endpoint.dataplane.admission import Ticket
from hpcserve.endpoint.dataplane.continuation import Continuation, detokenize_body, ending, start
from hpcserve.endpoint.dataplane.migration import CannotMigrate, Record, Request, why_not
from hpcserve.endpoint.dataplane.routing import choose
from hpcserve.endpoint.dataplane.routing.base import has_room
from hpcserve.endpoint.dataplane.routing.table import Backend
from hpcserve.endpoint.dataplane.sse import (
    DONE,
    DONE_MARK,
    EventSplitter,
    IdCount,
    has_failure,
    is_failure,
    split_events,
    strip_ids,
)
from hpcserve.endpoint.protocol import Migration

DETOKENIZE_TIMEOUT_S = 10.0

log = logging.getLogger(__name__)


class StreamFailed(Exception):
    def __init__(self, cause: str, detail: str = "", event: bytes = b""):
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause, self.detail, self.event = cause, detail, event  # event: an engine's error event


@dataclass
class Lease:
    """The backend a request counts against (in_flight) now: the stream's current replica. A drained
    replica is released the moment its streams move, so its drain does not wait for them."""

    backend: Backend
    held: bool = True  # counted in backend.in_flight now (not while a stream waits for a successor)

    def release(self, pool) -> None:
        """The request no longer counts against its backend (idempotent)."""
        if self.held:
            pool.release(self.backend)
            self.held = False

    def move(self, pool, target: Backend) -> None:
        self.release(pool)
        target.in_flight += 1
        target.requests += 1
        self.backend, self.held = target, True


class Stream:
    """One streamed answer whose request may migrate (migration.prepare gave it a Request)."""

    def __init__(self, plane, room, response, lease: Lease, request: Request, headers: dict[str, str],
                 ticket: Ticket | None = None):
        """plane: the dataplane.DataPlane (its session, settings, stats); room: the model's rooms.Room (its
        pool, policy and migration log: a stream continues only on a replica of the same model); lease: the
        backend the request counts against, moved with the stream (the caller releases it at the end);
        ticket: its place in the room's admission, where fair share may ask it to pause."""
        self.plane, self.room, self.response, self.lease, self.backend = plane, room, response, lease, lease.backend
        self.request, self.headers = request, headers
        self.events, self.record = EventSplitter(), Record(request.kind)
        # With tenants, the ids that strip_ids writes null are counted there for the usage row (token_counts)
        self.ids = IdCount() if plane.tenants is not None and request.strip_ids else None
        self.progress = None  # the Progress once a migration began (the record's, then the continuation's)
        self.continuation: Continuation | None = None
        self.tried: list[Backend] = [lease.backend]
        self.migrations = 0
        self.done = False  # [DONE] passed on
        self.stays = False  # handed over but not migratable: finishes where it is
        self.upstream: aiohttp.ClientResponse | None = None  # the engine's response being read; None while moving
        self.leaving = False  # handed over at once: the upstream was closed under the read
        self.wait_limit_s, self.wait_source = 0.0, ""  # a wait for a successor replica: its limit, what set it
        self.ticket = ticket
        self.pausing = False  # asked to pause (pause): the upstream was closed under the read
        self.paused = False  # paused once: not asked again

    async def run(self, upstream: aiohttp.ClientResponse, chunk: bytes) -> None:
        """Until the client has the whole answer. ConnectionError: cut (the client sees its stream end
        early, as without migration). Whatever ends it early closes the engine's connection (vLLM aborts)."""
        self.plane.streams.add(self)
        admission = self.room.admission
        if self.ticket is not None:
            admission.may_pause(self.ticket, self.pause)
        try:
            while True:
                try:
                    self.upstream = upstream
                    await self.pass_on(upstream, chunk)
                    return
                except StreamFailed as exc:
                    upstream.close()
                    self.upstream = None
                    failed = exc
                    if self.leaving:  # the read ended because hand_over_now or pause closed it: not a failure
                        failed, self.leaving = StreamFailed("paused" if self.pausing else "handover"), False
                    moved = await self.migrate(failed)
                    if moved is None:
                        return
                    upstream, chunk = moved
                except CannotMigrate as exc:  # a continuation that no longer matches what the client has
                    self.refused("continuation", exc.reason)
                    raise ConnectionError(f"the continuation on {self.backend.url} was cut: {exc.reason}") from exc
        finally:
            self.plane.streams.discard(self)
            if self.ticket is not None:
                admission.cannot_pause(self.ticket)
            upstream.close()  # released already when it ended whole; closed (engine aborts) otherwise

    async def pass_on(self, upstream: aiohttp.ClientResponse, chunk: bytes) -> None:
        """This upstream's events to the client until its end; StreamFailed when it fails or must go."""
        silence = self.plane.settings.read_timeout_s
        while chunk:
            whole = self.events.feed_whole(chunk)
            if whole and self.continuation is None and not has_failure(whole):  # most chunks: as they came
                self.record.add(whole)
                self.done = self.done or DONE_MARK in whole
                await self.response.write(strip_ids(whole, self.ids) if self.request.strip_ids else whole)
            elif whole:
                await self.pass_events(whole)
                if self.continuation is not None and self.continuation.ended:
                    upstream.close()
                    return
            if self.backend.handing_over and not self.stays:
                self.check_handover()
            try:
                async with asyncio.timeout(silence):
                    chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise StreamFailed("broken", type(exc).__name__) from exc
        if not self.done:  # the engine closed without [DONE]: cut before its end
            raise StreamFailed("broken", "the stream ended before its end")
        upstream.release()

    async def pass_events(self, whole: bytes) -> None:
        """Event by event: an error event among them, or a continuation's events to make the client's."""
        out = []
        try:
            for event in split_events(whole):
                out.append(self.translate(event))
                if self.continuation is not None and self.continuation.ended:
                    break
        finally:  # what came before a failure reaches the client
            if any(out):
                await self.response.write(b"".join(out))

    def translate(self, event: bytes) -> bytes:
        if is_failure(event):  # an engine's error event: not passed on while the stream may move
            raise StreamFailed("error", event[:200].decode(errors="replace"), event)
        if event.startswith(DONE_MARK):
            self.done = True
        if self.continuation is not None:
            return self.continuation.feed(event)  # CannotMigrate: the stream is cut (ConnectionError)
        self.record.add(event)
        return strip_ids(event, self.ids) if self.request.strip_ids else event

    def hand_over_now(self) -> None:
        """Its replica was just handed over: move now rather than at the engine's next chunk (closing the
        engine's response ends the read that waits for it; the engine aborts the request), or, where the
        stream cannot move, finish where it is."""
        if self.upstream is None or self.stays or self.leaving or self.done:
            return  # moving already, staying, or complete: its end is on its way
        if self.may_leave():
            self.leaving = True
            self.upstream.close()

    def pause(self) -> bool:
        """Asked by the admission (fair share): give the place to a user below their share now and continue
        once another frees (the read ends, run() sees why). False where it cannot: not under way, moving,
        ending, paused once already, or not continuable (migration.why_not, its count of migrations aside)."""
        if self.upstream is None or self.leaving or self.done or self.paused or self.stays:
            return False
        if why_not(self.request, self.current_progress(), 0, 1) is not None:
            return False
        self.leaving = self.pausing = self.paused = True
        self.upstream.close()
        self.lease.release(self.room.pool)  # its place goes to whom it paused for, who is routed there
        return True

    def check_handover(self) -> None:
        """The replica is drained (seen at a chunk): move now if the stream can, else let it finish there."""
        if self.may_leave():
            raise StreamFailed("handover")

    def may_leave(self) -> bool:
        """Whether a handed-over stream can move; one that cannot stays where it is, and that is on record."""
        reason = why_not(self.request, self.current_progress(), self.migrations, self.plane.settings.migrations)
        if reason is not None:
            self.stays = True
            self.refused("handover", reason)
        return reason is None

    def token_counts(self) -> tuple[int | None, int | None]:
        """(prompt, generated) tokens of what the client got: the original prompt, each token once however
        often the stream moved."""
        if self.progress is None:
            return self.record.token_counts(self.ids)
        progress = self.progress
        generated = None if progress.missing_ids else len(progress.ids)
        return (len(progress.prompt_ids) if progress.prompt_ids is not None else None), generated

    def current_progress(self):
        if self.progress is None:
            return self.record.progress()
        return self.progress

    async def migrate(self, failed: StreamFailed) -> tuple[aiohttp.ClientResponse, bytes] | None:
        """A continuation on another replica: its response and first chunk; None when the stream had
        finished (the client gets what it is owed); ConnectionError: cut."""
        source = self.backend
        if failed.cause == "broken":
            source.failed_until = time.monotonic() + self.plane.settings.failed_s
            source.failures += 1
        progress = self.current_progress()
        self.progress = progress
        paused = failed.cause == "paused"
        if paused:
            self.pausing = False
            if self.done:  # its end had come with the last chunk read
                return None
            if not progress.finished:
                assert self.ticket is not None, "only a stream with a ticket is asked to pause"
                await self.room.admission.resume(self.ticket)
        if progress.finished:
            await self.response.write(ending(self.request, progress))
            return None
        reason = (why_not(self.request, progress, 0, 1) if paused
                  else why_not(self.request, progress, self.migrations, self.plane.settings.migrations))
        waited = False
        while reason is None:
            # a paused stream goes back where its prefix is cached while that replica has room; a
            # continuation that fails goes elsewhere, as after a failure
            resuming, paused = paused, False
            target = (self.resume_on(source) if resuming
                      else choose(self.room.pool, self.room.policy, None, time.monotonic(), tuple(self.tried)))
            if target is None or target in self.tried and not resuming:
                if failed.cause not in ("handover", "paused") or waited:
                    reason = "no other replica can take it"
                    break
                waited = True  # it must leave its replica and none other serves: wait for the next (successor.py)
                target = await self.wait_for_successor(failed.cause)
                if target is None:
                    await self.gave_up()
                    return None
            self.tried.append(target)
            try:
                return await self.continue_on(target, progress, failed.cause, source)
            except CannotMigrate as exc:
                reason = exc.reason
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                target.failed_until = time.monotonic() + self.plane.settings.failed_s
                target.failures += 1
                reason = None if len(self.tried) < self.plane.settings.tries + 1 else f"{type(exc).__name__}"
        self.refused(failed.cause, reason)
        if failed.cause == "error":  # the engine's own error, passed on as it would be without migration
            await self.response.write(failed.event + (b"" if self.done else DONE))
            return None
        self.plane.stats.broken_streams += 1
        raise ConnectionError(f"the stream from {source.url} ended ({failed}); not continued elsewhere: {reason}")

    def resume_on(self, source: Backend) -> Backend | None:
        """Where a paused stream continues: its replica while it serves and has a free place, else the
        policy's choice."""
        pool, now = self.room.pool, time.monotonic()
        if source in pool.active and has_room(source, now):
            return source
        return choose(pool, self.room.policy, None, now)

    async def wait_for_successor(self, cause: str) -> Backend | None:
        """A replica of the room that was not tried, once one joins within the limit (successor.wait_limit);
        None when none did. Meanwhile the stream counts as held, not against the replica that leaves."""
        room, stats = self.room, self.plane.stats
        limit_s, self.wait_source = successor.wait_limit(room.hold_s, room.sleep.waking, bool(room.pool.active))
        self.wait_limit_s = limit_s
        self.lease.release(room.pool)  # the leaving replica's drain does not wait for this stream
        start = time.monotonic()
        until, next_comment = start + limit_s, start
        stats.holds += 1
        stats.held += 1
        room.held += 1
        if room.sleep.enabled:
            room.sleep.ask()  # a model at zero wakes for it (GET /waking returns now)
        try:
            while not room.closed:
                now = time.monotonic()
                target = choose(room.pool, room.policy, None, now, tuple(self.tried))
                if target is not None and target not in self.tried:
                    return target
                if now >= until:
                    break
                if now >= next_comment:
                    await self.response.write(successor.comment(room.name, cause, now - start))
                    next_comment = now + successor.COMMENT_EVERY_S
                changed = room.changed
                try:
                    async with asyncio.timeout(max(0.0, min(until, next_comment) - now)):
                        await changed.wait()
                except TimeoutError:
                    pass
            stats.hold_timeouts += 1
            return None
        finally:
            stats.held -= 1
            room.held -= 1

    async def gave_up(self) -> None:
        """No successor came: the client gets an error event and the end, not a cut."""
        tokens = len(self.current_progress().ids)
        reason = f"no replica joined within {self.wait_limit_s:g} s ({self.wait_source})"
        self.refused("handover", reason)
        self.plane.stats.broken_streams += 1
        await self.response.write(successor.gave_up(self.room.name, tokens, self.wait_limit_s, self.wait_source)
                                  + (b"" if self.done else DONE))

    def refused(self, cause: str, reason: str | None) -> None:
        self.plane.stats.migrations_refused += 1
        progress = self.current_progress()
        self.plane.log_migration(self.room, Migration(time.time(), cause, self.backend.url, None, self.request.kind.value,
                                           len(progress.ids), reason))

    async def continue_on(self, target: Backend, progress, cause: str, source: Backend):
        session, settings = self.plane.session, self.plane.settings
        attempt = copy.deepcopy(progress)  # start() cuts it; a failed try must leave it whole
        check = detokenize_body(self.request, attempt)
        decoded = await self.detokenize(target, check) if check is not None else None
        continuation = start(self.request, attempt, decoded)
        upstream = None
        try:
            async with asyncio.timeout(settings.first_byte_timeout_s):
                upstream = await session.post(self.plane.upstream_url(target.url, continuation.path),
                                              data=continuation.body, headers=self.headers, allow_redirects=False)
                if upstream.status != 200:
                    raise CannotMigrate(f"{target.url} answered {upstream.status} to the continuation")
                first = await upstream.content.readany()
        except BaseException:
            if upstream is not None:
                upstream.close()
            raise
        self.progress, self.continuation, self.backend = attempt, continuation, target
        self.lease.move(self.room.pool, target)
        self.events = EventSplitter()
        if cause == "paused":  # counted by the admission; a migration's record would list every pause
            log.debug("a paused %s stream continues on %s after %d token(s)", self.request.kind.value, target.url,
                      len(progress.ids))
            return upstream, first
        self.migrations += 1
        self.plane.stats.migrations += 1
        self.plane.log_migration(self.room, Migration(time.time(), cause, source.url, target.url, self.request.kind.value,
                                           len(progress.ids)))
        return upstream, first

    async def detokenize(self, target: Backend, body: bytes) -> str | None:
        """vLLM's /detokenize of the tail, where the cut needs it; None when it does not answer."""
        try:
            async with asyncio.timeout(DETOKENIZE_TIMEOUT_S):
                async with self.plane.session.post(self.plane.upstream_url(target.url, "/detokenize"), data=body,
                                                   headers=self.headers) as answer:
                    if answer.status != 200:
                        return None
                    return json.loads(await answer.read()).get("prompt")
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
