"""A stream's SSE events as bytes, on the data plane's hot path (every chunk of every stream that may
migrate): whole events out of a byte stream, vLLM's failure events, token ids written null. No parsing.
"""

from __future__ import annotations

IDS = b'token_ids":['  # ends both "token_ids" and "prompt_token_ids"
QUOTE = ord('"')  # before "token_ids" (before "prompt_token_ids": '_')
ERROR = b'data: {"error"'
ABORT = b'"finish_reason":"abort"'
DONE = b"data: [DONE]\n\n"
DONE_MARK = b"data: [DONE]"  # the end of a stream, anywhere in a chunk


class EventSplitter:
    """Whole SSE events out of a byte stream (vLLM ends each with a blank line): a partial event stays here
    and is never passed on, so a stream that breaks leaves the client no half event."""

    def __init__(self):
        self.buffer = bytearray()

    def feed_whole(self, chunk: bytes) -> bytes:
        """The events completed by this chunk, as one piece (most chunks end on an event: no copy)."""
        if not self.buffer and chunk.endswith(b"\n\n"):
            return chunk
        self.buffer += chunk
        end = self.buffer.rfind(b"\n\n")
        if end < 0:
            return b""
        whole = bytes(self.buffer[:end + 2])
        del self.buffer[:end + 2]
        return whole

    def feed(self, chunk: bytes) -> list[bytes]:
        return split_events(self.feed_whole(chunk))


def split_events(whole: bytes) -> list[bytes]:
    """Whole events (each ending with a blank line) one by one."""
    if not whole:
        return []
    if whole.count(b"\n\n") == 1:
        return [whole]
    return [part + b"\n\n" for part in whole[:-2].split(b"\n\n")]


def has_failure(events: bytes) -> bool:
    """is_failure of any of these whole events (a key inside a JSON string has its quotes escaped: these
    bytes only match where vLLM wrote them)."""
    return ERROR in events or ABORT in events


def is_failure(event: bytes) -> bool:
    """An event that must not reach the client when the stream can migrate: vLLM's error event (a
    generation error, the engine dead) or a choice finished with "abort"."""
    return event.startswith(ERROR) or ABORT in event


class IdCount:
    """What strip_ids wrote null, counted where a caller asks (a usage row's generated tokens): the "token_ids"
    lists (not the prompt's), and the ids in them. The lists are found there anyway; counting them costs a
    stream a count per list, where a scan of its events at the end cost a pass over all of them."""

    __slots__ = ("ids", "lists")

    def __init__(self) -> None:
        self.ids = 0
        self.lists = 0


def strip_ids(event: bytes, count: IdCount | None = None) -> bytes:
    """The event with every token id list ("token_ids", "prompt_token_ids") written null, as vLLM writes
    them when the client did not ask. Bytes only: inside a JSON string a quote is escaped, so
    `token_ids":[` can only be a key, and a list of ints holds no ']'. count: the "token_ids" lists and their
    ids added to it."""
    start = event.find(IDS)
    if start < 0:
        return event
    parts: list[bytes] = []
    position = 0
    while start >= 0:
        opening = start + len(IDS) - 1
        parts += (event[position:opening], b"null")
        position = event.index(b"]", opening) + 1
        if count is not None and start and event[start - 1] == QUOTE:  # "token_ids", not "prompt_token_ids"
            count.lists += 1
            if position - opening > 2:  # not empty: its commas and one
                count.ids += event.count(b",", opening, position) + 1
        start = event.find(IDS, position)
    parts.append(event[position:])
    return b"".join(parts)
