"""The data plane's settings and its command line (python -m hpcserve.endpoint.dataplane --help)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane.admission import DEFAULT_SHARE
from hpcserve.endpoint.dataplane.server import connection_cap
from hpcserve.endpoint.protocol import MODULE

MAX_WORKERS = 64


@dataclass(frozen=True)
class Settings:
    host: str
    port: int
    key_file: Path | None
    admin_socket: Path
    policy: Routing = Routing.LEAST_LOADED
    hold_s: float = 60.0
    tries: int = 3  # attempts per request on connection errors
    resends: int = 1  # of those, after a connection dropped under a sent request (wire.after_failure)
    failed_s: float = 5.0  # a backend that refused a connection is skipped this long
    max_body_bytes: int = 64 * 2**20
    max_buffer_bytes: int = 16 * 2**20  # a response with a length up to this is read whole, larger ones stream
    max_connections: int = 2048
    header_timeout_s: float = 30.0  # also how long an idle client connection stays open
    body_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    # The wait for an engine's first byte: a non-streamed answer comes whole, after its whole generation.
    first_byte_timeout_s: float = 1800.0
    read_timeout_s: float = 300.0  # a stream silent this long between chunks is cut
    grace_s: float = 5.0  # at SIGTERM: requests in flight may finish this long
    migrations: int = 2  # times a stream may continue on another replica (endpoint/dataplane/streams.py); 0: never
    workers: int = 1
    tokenizer: Path | None = None  # the model folder: prompts as token ids, to match the engines' KV events
    chat_template: Path | None = None  # the engines' --chat-template, where it replaces the model's
    routing_log: Path | None = None  # the prefix policy's choices, one JSON line each (routing_log.py)
    admit_kv_share: float = DEFAULT_SHARE  # prompts in flight above this share of the KV caches: prefills wait
    tenancy: Path | None = None  # users' keys, limits, usage (tenants.TenancySettings as JSON); None: the key alone
    model: str | None = None  # the data plane's own model (its served name); None: any, answered by the engines


def parse_args(argv: list[str], description: str = "") -> Settings:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=description)
    d = Settings("", 0, None, Path())
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key-file", type=Path, help="mode-0600 file with the key; without it the endpoint is open")
    parser.add_argument("--admin-socket", type=Path, required=True)
    parser.add_argument("--policy", choices=[str(p) for p in Routing], default=str(d.policy))
    parser.add_argument("--hold-s", type=float, default=d.hold_s)
    parser.add_argument("--tries", type=int, default=d.tries)
    parser.add_argument("--resends", type=int, default=d.resends,
                        help="times a request is sent again after its connection dropped (the engine may have had it)")
    parser.add_argument("--failed-s", type=float, default=d.failed_s)
    parser.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20)
    parser.add_argument("--max-buffer-mb", type=float, default=d.max_buffer_bytes / 2**20,
                        help="answers with a length up to this are read whole; larger ones stream through")
    parser.add_argument("--max-connections", type=int, default=d.max_connections)
    parser.add_argument("--header-timeout-s", type=float, default=d.header_timeout_s)
    parser.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s)
    parser.add_argument("--connect-timeout-s", type=float, default=d.connect_timeout_s)
    parser.add_argument("--first-byte-timeout-s", type=float, default=d.first_byte_timeout_s)
    parser.add_argument("--read-timeout-s", type=float, default=d.read_timeout_s,
                        help="a stream silent this long between two chunks is cut")
    parser.add_argument("--migrations", type=int, default=d.migrations,
                        help="times a stream may continue on another replica when its own fails or is drained (0: never)")
    parser.add_argument("--workers", type=int, default=d.workers, help="processes serving the port (SO_REUSEPORT)")
    parser.add_argument("--tokenizer", type=Path, help="the model folder (its tokenizer.json): the prefix policy "
                        "then routes by the engines' KV events too (engine/kv_events.py)")
    parser.add_argument("--chat-template", type=Path, help="the chat template the engines use, where it is not the "
                        "model folder's")
    parser.add_argument("--routing-log", type=Path, help="append the prefix policy's choices here, one JSON line "
                        "each: what each replica held of the prompt, and where it went (a diagnosis: off by default)")
    parser.add_argument("--admit-kv-share", type=float, default=d.admit_kv_share,
                        help="the prefix policy with KV events: while the prompts in flight take more than this share "
                        "of the replicas' KV caches, new prefills wait and those whose prefix is cached go first "
                        "(endpoint/dataplane/admission.py; 0: never wait)")
    parser.add_argument("--tenancy", type=Path, help="a JSON file (tenants.TenancySettings): users' own keys, their "
                        "limits and the usage record, in the database it names; without it only --key-file's key")
    parser.add_argument("--model", help="the served name of the data plane's own model: it answers GET /v1/models "
                        "itself, and other models may join it (PUT /models/NAME on the admin socket)")
    args = parser.parse_args(argv)
    if args.hold_s < 0 or args.tries < 1 or args.resends < 0 or args.max_connections < 1 or args.max_body_mb <= 0:
        parser.error("--hold-s and --resends must be >= 0, --tries and --max-connections >= 1, --max-body-mb > 0")
    if min(args.connect_timeout_s, args.first_byte_timeout_s, args.read_timeout_s) <= 0 or args.max_buffer_mb < 0:
        parser.error("--connect-timeout-s, --first-byte-timeout-s and --read-timeout-s must be > 0, "
                     "--max-buffer-mb >= 0")
    if args.migrations < 0:
        parser.error("--migrations must be >= 0")
    if not 0 <= args.admit_kv_share <= 1:
        parser.error("--admit-kv-share must be from 0 (never wait) to 1")
    if not 1 <= args.workers <= MAX_WORKERS:
        parser.error(f"--workers must be from 1 to {MAX_WORKERS}")
    return Settings(args.host, args.port, args.key_file, args.admin_socket.absolute(), Routing(args.policy),
                    hold_s=args.hold_s, tries=args.tries, resends=args.resends, failed_s=args.failed_s,
                    max_body_bytes=int(args.max_body_mb * 2**20), max_buffer_bytes=int(args.max_buffer_mb * 2**20),
                    max_connections=connection_cap(args.max_connections), header_timeout_s=args.header_timeout_s,
                    body_timeout_s=args.body_timeout_s, connect_timeout_s=args.connect_timeout_s,
                    first_byte_timeout_s=args.first_byte_timeout_s, read_timeout_s=args.read_timeout_s,
                    workers=args.workers, tokenizer=args.tokenizer, chat_template=args.chat_template,
                    migrations=args.migrations, routing_log=args.routing_log, admit_kv_share=args.admit_kv_share,
                    tenancy=args.tenancy, model=args.model or None)
