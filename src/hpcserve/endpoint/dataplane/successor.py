"""A handed-over stream with no other replica to go to waits for the next one, as a held request does.

    limit = wait_limit(room.hold_s, room.sleep.waking, bool(room.pool.active))
    await stream.wait_for_successor(limit)      # streams.Stream: a backend, or None when none came

Its replica must go (a walltime handover, a scale-down, `down --member`) while no other serves: the stream
does not count against the leaving replica meanwhile (its drain does not wait for it), counts as held for
its model (the controller sees it: a model at zero wakes for it), gets an SSE comment every COMMENT_EVERY_S
(proxies close silent streams), and continues on the first replica that joins (continuation.py). When none
joins within the limit (the room's hold_s, or wake_wait_s while its model is at zero and waking) the client
gets an SSE error event and [DONE]: an ending it can read, not a cut. The limit and the texts are pure.
"""

from __future__ import annotations

from hpcserve.endpoint.dataplane import wire
from hpcserve.endpoint.protocol import Waking

COMMENT_EVERY_S = 3.0  # as waking.py: a comment to the waiting stream this often


def wait_limit(hold_s: float, waking: Waking | None, active: bool) -> tuple[float, str]:
    """(seconds, what set them) a stream waits for a successor replica: wake_wait_s where the model sleeps
    and no replica is in its pool (at zero, waking), else the room's hold_s. Pure."""
    if waking is not None and not active:
        return waking.wait_s, "autoscale.wake_wait_s"
    return hold_s, "hold_s"


def comment(model: str, cause: str, waited_s: float) -> bytes:
    """An SSE comment line for a stream waiting for a successor (clients ignore it). Pure."""
    return f": waiting for a replica of model {model[:200] or '-'} ({cause}, {waited_s:.0f} s)\n\n".encode()


def gave_up(model: str, tokens: int, limit_s: float, source: str) -> bytes:
    """The SSE error event of a stream whose successor did not come within limit_s. Pure."""
    message = (f"hpcserve endpoint: the replica serving this stream had to stop after {tokens} token(s) and no "
               f"other replica of model {model[:200]!r} joined within {limit_s:g} s ({source}) to continue it; "
               "the answer is incomplete. Retry the request.")
    return b"data: " + wire.error_body(message, "service_unavailable", "no_replica") + b"\n\n"
