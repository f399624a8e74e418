"""What a client sees when a greedy stream is cut after any of its events and continued with
endpoint/dataplane/migration.py and endpoint/dataplane/continuation.py on a real vLLM engine (tests/endpoint/test_router_vllm.py
runs it on its engines): the same text, token ids, finish, usage and id as the uninterrupted stream, for
completions and chat (translated back from completions), with several tokens per event (stream_interval),
and with a stop string that can run across the cut."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
from router_fixtures import KEY

from hpcserve.endpoint.dataplane import continuation as c
from hpcserve.endpoint.dataplane import migration as m
from hpcserve.endpoint.dataplane import sse

MODEL = "tiny"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ROUTE = {kind: route for route, kind in m.ROUTES.items()}
COMPLETION = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 40, "temperature": 0,
              "ignore_eos": True, "stream": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story about a cat."}], "max_tokens": 40,
        "temperature": 0, "ignore_eos": True, "stream": True}
CONCURRENT = 16  # continuations in flight at once
ASKED = {"return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
CASES = {  # name: (kind, the client's body)
    "completion": (m.Kind.COMPLETION, COMPLETION),
    "completion, ids and usage asked": (m.Kind.COMPLETION, {**COMPLETION, **ASKED}),
    "completion, 3 tokens per event": (m.Kind.COMPLETION, {**COMPLETION, "stream_interval": 3}),
    "completion, stop string": (m.Kind.COMPLETION, {**COMPLETION, "stop": ["k c c"], "return_token_ids": True}),
    "chat": (m.Kind.CHAT, CHAT),
    "chat, ids and usage asked": (m.Kind.CHAT, {**CHAT, **ASKED}),
    "chat, 3 tokens per event": (m.Kind.CHAT, {**CHAT, "stream_interval": 3, "return_token_ids": True}),
}


def post(url: str, path: str, body: bytes) -> bytes:
    response = httpx.post(f"{url}{path}", content=body, timeout=120,
                          headers={**HEADERS, "Content-Type": "application/json"})
    response.raise_for_status()
    return response.content


def summary(stream: bytes, kind: m.Kind) -> dict:
    """What a client reads from a stream. Usage in every chunk is checked against the token ids so far
    (its chunking may differ between runs: vLLM merges tokens when its server falls behind)."""
    text, ids, finishes, usages, heads, done, running = "", [], [], [], set(), False, []
    for event in sse.EventSplitter().feed(stream):
        if event == b"data: [DONE]\n\n":
            done = True
            continue
        data = json.loads(event[6:])
        heads.add((data["id"], data["created"], data["model"], data["object"]))
        for choice in data["choices"]:
            text += choice["text"] if kind is m.Kind.COMPLETION else choice["delta"].get("content") or ""
            ids += choice.get("token_ids") or []
            if choice["finish_reason"] is not None:
                finishes.append((choice["finish_reason"], choice.get("stop_reason")))
        usage = data.get("usage")
        if usage is not None and not data["choices"]:
            usages.append(usage)
        elif usage is not None:
            running.append((usage["prompt_tokens"], usage["total_tokens"] - usage["completion_tokens"],
                            usage["completion_tokens"] - len(ids)))
    return {"text": text, "ids": ids, "finish": finishes, "usage": usages, "heads": heads, "done": done,
            "running": sorted(set(running))}  # one (prompt, prompt, 0) when consistent


def migrated(url: str, request: m.Request, events: list[bytes], cut: int) -> tuple[bytes, dict]:
    """The client's stream when the first attempt (events) broke after `cut` events and went on with the
    module's continuation on the engine; and how (tokens kept, generated again, /detokenize asked)."""
    record, out = m.Record(request.kind), b""
    for event in events[:cut]:
        record.add(event)
        out += sse.strip_ids(event) if request.strip_ids else event
    progress = record.progress()
    assert m.why_not(request, progress, 0, 1) is None
    had = len(progress.ids)
    check = c.detokenize_body(request, progress)
    decoded = json.loads(post(url, "/detokenize", check))["prompt"] if check else None
    cont = c.start(request, progress, decoded)
    for event in sse.EventSplitter().feed(post(url, cont.path, cont.body)):
        assert not sse.is_failure(event), event
        out += cont.feed(event)
        if cont.ended:
            break
    return out, {"kept": cont.cut, "again": had - cont.cut, "asked": check is not None}


def cut_anywhere(engine: str) -> list[str]:
    """Every case cut after each event and continued on the engine; one report line a case."""
    report = []
    for name, (kind, body) in CASES.items():
        prepared = m.prepare(ROUTE[kind], json.dumps(body).encode())
        assert prepared.request is not None, prepared.reason
        request = prepared.request
        raw = post(engine, ROUTE[kind], prepared.body)  # the uninterrupted run (greedy: each attempt's too)
        events = sse.EventSplitter().feed(raw)
        client = b"".join(sse.strip_ids(e) if request.strip_ids else e for e in events)
        want = summary(client, kind)
        assert want["done"] and want["finish"] and want["text"], name
        finish_at = next(i for i, e in enumerate(events) if b'"finish_reason":"' in e)
        first = 2 if kind is m.Kind.CHAT else 1  # completions' first event has prompt ids, chat's the role
        kept, again, asked, straddled = [], [], 0, 0
        cuts = range(first, finish_at + 1)
        # sent together: the engine runs the continuations in one batch (one at a time, this test took 100 s)
        with ThreadPoolExecutor(CONCURRENT) as pool:
            continued = list(pool.map(lambda cut: migrated(engine, request, events, cut), cuts))
        for cut, (stream, how) in zip(cuts, continued, strict=True):
            got = summary(stream, kind)
            if got != want and got["finish"] == want["finish"] == [("stop", "k c c")] and got["text"] == want["text"]:
                # the stop string ran across the cut: found by the data plane, after the tokens the new
                # engine made before its text showed it (text exact, a few token ids more)
                assert got["ids"][:len(want["ids"])] == want["ids"], (name, cut)
                straddled += 1
            else:
                assert got == want, (name, cut, how)
            kept.append(how["kept"])
            again.append(how["again"])
            asked += how["asked"]
        report.append(f"{name}: {finish_at + 1 - first} cuts exact (text {len(want['text'])} chars, "
                      f"{len(want['ids']) or 'ids not shown'}), /detokenize asked {asked}x, tokens generated "
                      f"again at {sum(1 for a in again if a)} cuts (at most {max(again)}), stop across the cut "
                      f"{straddled}; text {want['text'][:40]!r}")
    return report
