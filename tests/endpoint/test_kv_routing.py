"""Routing by the engines' KV events, the pure parts: the relay's frames and vLLM's event shapes
(engine/kv_events.py), the exact index (endpoint/dataplane/routing/token_index.py), prompts as token ids
(endpoint/dataplane/routing/prompt_tokens.py) and how balance.choose weighs exact and approximate knowledge. The relay on a
real engine and the routing it drives: tests/endpoint/test_router_vllm.py."""

from __future__ import annotations

import json

import msgspec
import pytest

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane.routing import choose
from hpcserve.endpoint.dataplane.routing.table import Affinity, RoutingTable, cached_share
from hpcserve.endpoint.dataplane.routing.prefix_index import prompt_blocks
from hpcserve.endpoint.dataplane.routing.prompt_tokens import PromptTokenizer
from hpcserve.endpoint.dataplane.routing.token_index import TokenIndex, token_blocks
from hpcserve.endpoint.protocol import BackendSpec
from hpcserve.engine.kv_events import (
    CLEARED,
    CONFIG_FLAG,
    ENDPOINT_ENV,
    HEARTBEAT_SEQ,
    MIDDLEWARE,
    FrameReader,
    Removed,
    Stored,
    decode_batch,
    frame,
    with_publisher,
)

A, B = "http://10.0.0.1:8001", "http://10.0.0.2:8001"


def batch(*events) -> bytes:
    """A batch as vLLM 0.26 and 0.32 encode it: [ts, [events as maps with a 'type'], dp_rank]."""
    return msgspec.msgpack.encode([1.0, list(events), 0])


def stored(hashes, parent, tokens, size=4, medium="GPU") -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": size, "lora_id": None, "medium": medium, "lora_name": None}


def test_frames_come_whole_from_pieces_of_any_size():
    data = frame(7, b"abc") + frame(HEARTBEAT_SEQ, b"") + frame(8, b"x" * 300)
    reader, got = FrameReader(), []
    for i in range(0, len(data), 5):
        got += list(reader.feed(data[i:i + 5]))
    assert got == [(7, b"abc"), (HEARTBEAT_SEQ, b""), (8, b"x" * 300)]
    with pytest.raises(ValueError):
        list(FrameReader().feed(b"\x00" * 8 + b"\xff\xff\xff\xff"))  # no relay sends 4 GiB frames


def test_events_of_both_vllm_encodings_and_only_the_engines_own_cache():
    events = decode_batch(batch(stored([b"h1", b"h2"], None, [1, 2, 3, 4, 5, 6, 7, 8]),
                                {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "GPU"},
                                stored([b"o1"], None, [1, 2, 3, 4], medium="CPU_OFFLOAD"),
                                {"type": "AllBlocksCleared"}))
    assert events == [Stored([b"h1", b"h2"], None, [1, 2, 3, 4, 5, 6, 7, 8], 4), Removed([b"h1"]), CLEARED]
    tagged = decode_batch(msgspec.msgpack.encode([1.0, [["BlockStored", [5], None, [1, 2], 2, None, None]]]))
    assert tagged == [Stored([5], None, [1, 2], 2)]


def test_the_publisher_goes_where_the_relay_reads_and_nowhere_else():
    argv = ["python", "-m", "hpcserve.engine.vllm_cli", "serve", "/m", "--port", "8123", "--middleware", MIDDLEWARE]
    added, endpoint = with_publisher(argv, "/tmp/hps-0-ab/n1/tmp")
    config = json.loads(added[added.index(CONFIG_FLAG) + 1])
    assert endpoint == config["endpoint"] == "ipc:///tmp/hps-0-ab/n1/tmp/kv-8123.sock"  # never TCP
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    assert with_publisher(argv[:-2], "/tmp/x") == (argv[:-2], None)  # no relay asked for
    own = [*argv, f"{CONFIG_FLAG}={{}}"]
    assert with_publisher(own, "/tmp/x") == (own, None)  # the user's own KV events are left alone
    with pytest.raises(ValueError, match="longer than"):
        with_publisher(argv, "/" + "d" * 120)
    assert ENDPOINT_ENV.startswith("HPCSERVE_")


def test_the_exact_index_follows_stores_removals_and_clears():
    index = TokenIndex()
    index.apply(decode_batch(batch(stored([b"a", b"b"], None, [1, 2, 3, 4, 5, 6, 7, 8]),
                                   stored([b"c"], b"b", [9, 10, 11, 12]))))
    prompt = token_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 4)
    assert len(prompt) == 3 and index.match(prompt) == 3
    assert index.match(token_blocks([1, 2, 3, 4, 5, 6, 7, 9, 9, 10, 11, 12], 4)) == 1  # differs in block 2
    index.apply(decode_batch(batch({"type": "BlockRemoved", "block_hashes": [b"b"], "medium": "GPU"})))
    assert index.match(prompt) == 1  # the chain is broken at its second block
    index.apply(decode_batch(batch(stored([b"z"], b"unknown", [1, 1, 1, 1]))))
    assert index.unchained == 1 and index.blocks() == 2  # a parent from before the feed cannot be chained
    index.apply([CLEARED])
    assert index.match(prompt) == 0 and index.blocks() == 0


def two_backends(exact_on: str | None = None, complete: bool = True) -> RoutingTable:
    pool = RoutingTable()
    pool.update([BackendSpec(A, 8, kv_tokens=1024), BackendSpec(B, 8, kv_tokens=1024)])
    if exact_on:
        index = pool.exact[exact_on] = TokenIndex()
        index.complete = complete
    for url in (A, B):
        if url != exact_on and exact_on is not None:
            pool.exact[url] = TokenIndex()
            pool.exact[url].complete = complete
    return pool


def test_what_the_engine_holds_wins_over_what_was_sent_there():
    tokens = list(range(100))
    affinity = Affinity(None, prompt_blocks("x" * 400), tokens)
    pool = two_backends(exact_on=B)
    pool.index.record(A, affinity.blocks)  # sent to A once: the approximate index says A holds it
    pool.exact[B].apply([Stored([f"b{i}" for i in range(25)], None, tokens, 4)])
    pool.exact[A].block_size = pool.exact[B].block_size
    assert cached_share(pool, A, affinity, 0.0) == 0.0 and cached_share(pool, B, affinity, 0.0) == 1.0
    assert choose(pool, Routing.PREFIX, affinity, now=0.0).url == B
    # an index that began after requests went there (incomplete) does not rule out what was sent
    pool = two_backends(exact_on=B, complete=False)
    pool.index.record(A, affinity.blocks)
    pool.exact[A].block_size = 4
    assert cached_share(pool, A, affinity, 0.0) == 1.0
    # without token ids (no tokenizer), the sent prompts alone decide
    assert cached_share(two_backends(), A, Affinity(None, affinity.blocks), 0.0) == 0.0


def test_a_prompt_on_its_way_into_a_cache_draws_its_repeats_until_the_engine_says_otherwise():
    """Its engine stores a prompt's blocks only once its prefill ran (seconds under load): meanwhile its
    repeats go where it was sent (PENDING_S at most), and an engine that clears its cache clears them."""
    from hpcserve.endpoint.dataplane.routing.table import PENDING_S

    tokens = list(range(100))
    pool = two_backends(exact_on=B)
    for url in (A, B):
        pool.exact[url].block_size = 4
    first = choose(pool, Routing.PREFIX, Affinity(None, prompt_blocks("y" * 400), tokens), now=10.0).url
    for now in (11.0, 12.0, 10.0 + PENDING_S - 1):  # no event yet: the repeats follow it
        assert choose(pool, Routing.PREFIX, Affinity(None, prompt_blocks("y" * 400), tokens), now=now).url == first
    pool.exact[first].apply([CLEARED])
    assert cached_share(pool, first, Affinity(None, prompt_blocks("y" * 400), tokens), 13.0) == 0.0
    repeat = Affinity(None, prompt_blocks("y" * 400), tokens)
    choose(pool, Routing.PREFIX, repeat, now=20.0)
    assert all(pool.exact[url].match(repeat.token_blocks(4), 20.0 + PENDING_S + 1) == 0 for url in (A, B))


def test_new_prefixes_count_the_prompts_on_their_way_into_a_cache():
    """A replica whose engine has not yet stored what was just sent to it (events lag under load) is not
    emptier for it: new prefixes spread by what each cache will hold. Before, they piled onto the replica
    whose events lagged (seen on CPU: 2/3 of the prefixes on one cache, then its repeats outgrew it)."""
    pool = two_backends(exact_on=B)
    for url in (A, B):
        pool.exact[url].block_size = 4
    pool.by_url[B].in_flight = 1  # a little busier (an eighth of its capacity): A has more room at first
    homes = [choose(pool, Routing.PREFIX, Affinity(None, prompt_blocks(f"prefix {p} " * 40),
                                                   [1000 * p + i for i in range(100)]), now=1.0).url
             for p in range(10)]
    assert 4 <= homes.count(A) <= 6, homes  # 25 blocks a prompt, 256 a cache: each prompt fills 0.1 of one
    assert pool.exact[A].blocks(1.0) == 25 * homes.count(A) and pool.exact[A].blocks() == 0  # pending, not held
    assert pool.exact[A].blocks(1.0 + 16.0) == 0  # never stored: after PENDING_S they no longer count


def test_prompts_sent_before_the_first_event_count_once_it_says_the_block_size():
    """The first burst goes out before any engine has stored a block (so before the index knows vLLM's
    block size): those prompts count as on their way in as soon as the first event says it. Before, they
    counted nowhere until their own events came, and their repeats in the next burst split (seen on CPU)."""
    tokens = list(range(100))
    pool = two_backends(exact_on=B)
    prompt = Affinity(None, prompt_blocks("z" * 400), tokens)
    first = choose(pool, Routing.PREFIX, prompt, now=1.0).url
    other = B if first == A else A
    pool.exact[other].apply([Stored(["o1"], None, [7, 7, 7, 7], 4)])  # both engines now speak: size 4
    pool.exact[first].apply([Stored(["f1"], None, [9, 9, 9, 9], 4)])
    repeat = Affinity(None, prompt_blocks("z" * 400), tokens)
    assert cached_share(pool, first, repeat, 2.0) == 1.0 and cached_share(pool, other, repeat, 2.0) == 0.0
    pool.by_url[first].in_flight = 1  # a little busier than the other: the prompt still draws its repeat
    assert choose(pool, Routing.PREFIX, repeat, now=2.0).url == first


def test_prompts_become_the_engines_token_ids(tmp_path):
    from hpcserve.models.tiny import tiny_model_path

    tokenizer = PromptTokenizer.load(tiny_model_path())
    assert PromptTokenizer.load(tmp_path) is None  # no tokenizer.json: routed by text
    text = tokenizer.tokens({"prompt": "hello world"})
    assert text and tokenizer.tokens({"prompt": ["hello world", "another"]}) == text  # a batch: the first
    assert tokenizer.tokens({"prompt": [5, 6, 7]}) == [5, 6, 7]
    chat = tokenizer.tokens({"messages": [{"role": "user", "content": "hello world"}]})
    parts = tokenizer.tokens({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}]})
    assert chat and chat == parts and chat != text  # the chat template applied
    assert tokenizer.tokens({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}) is None
    custom = PromptTokenizer.load(tiny_model_path(), chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert custom.tokens({"messages": [{"role": "user", "content": "hello world"}]}) == tokenizer.tokens(
        {"prompt": "hello world", "add_special_tokens": False})
