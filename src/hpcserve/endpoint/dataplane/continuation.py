"""A stream's continuation on another replica: where it starts, its request, and each of its
events made into the client's. No I/O. What the data plane keeps of the first attempt, and whether a
request may migrate at all: endpoint/dataplane/migration.py.

- Text lags tokens in two ways: a token that ends inside a UTF-8 character (or holds invalid bytes) gives
  "" until a later token completes it; stop strings make vLLM hold back the last (longest stop - 1)
  characters until the end. A continuation prompt that ends inside a character makes vLLM's fast
  detokenizer emit the whole prompt text as the first delta (vllm-project/vllm#48853, tokenizers'
  DecodeStream(ids=...); seen here on 0.32). So the continuation starts at a clean point: after an event
  of one token whose text was not empty (certain), or at the last token when /detokenize of the tail does
  not end in U+FFFD; tokens after the clean point are generated again and what the client already has of
  them is dropped, compared first ("replay": equal under greedy; under sampling the client had no text
  of them unless events merged several tokens, else the comparison fails and the stream is cut). Stop
  text held back is read from the /detokenize answer, and a stop string that begins before the cut and
  ends after it is found here (the new engine sees only its own text): the text is then exact, but the
  tokens the new engine made while it held its own text back are counted too (ids and usage: a few more).
- Presence and frequency penalties count only output tokens (the continuation would see them as prompt):
  not migrated. A seed restarts the new engine's random stream: sampled continuations differ from an
  uninterrupted run's (valid samples, not reproducible).
"""

from __future__ import annotations

import json
from typing import Any

from hpcserve.endpoint.dataplane.migration import (
    COMPLETIONS,
    DETOKENIZE_TAIL,
    REPLACEMENT,
    CannotMigrate,
    Kind,
    Progress,
    Request,
    why_not,
)
from hpcserve.endpoint.dataplane.sse import DONE


def detokenize_body(request: Request, progress: Progress) -> bytes | None:
    """The body of POST /detokenize to send the new replica before start(), or None when nothing needs it:
    the cut is certainly clean and no stop text is held back (or none was sent yet)."""
    held = request.holdback and progress.text_len > 0
    if not held and progress.anchor[0] == len(progress.ids):
        return None
    tail = (_prompt_ids(progress) + progress.ids)[-(DETOKENIZE_TAIL + request.holdback):]
    return json.dumps({"model": request.model, "tokens": tail}).encode()


def _prompt_ids(progress: Progress) -> list[int]:
    """The prompt's token ids, known once a stream can go on (why_not)."""
    if progress.prompt_ids is None:
        raise CannotMigrate("no event was passed on yet")
    return progress.prompt_ids


def start(request: Request, progress: Progress, decoded: str | None = None) -> Continuation:
    """The continuation of a stream (why_not said it can go on). decoded: /detokenize's "prompt" for
    detokenize_body's tokens, or None (not asked, or it failed). Raises CannotMigrate."""
    reason = why_not(request, progress, 0, 1)
    if reason is not None:
        raise CannotMigrate(reason)
    sent = progress.text
    cut, held = _cut(request, progress, sent, decoded)
    replayed = progress.ids[cut:]
    replay_text = sent[progress.anchor[1]:] if replayed else ""  # cut is then the anchor's
    del progress.ids[cut:]
    context = sent[-request.straddle:] if request.include_stop and request.straddle else ""
    return Continuation(request, progress, cut, replayed, replay_text, held, context)


def _cut(request: Request, progress: Progress, sent: str, decoded: str | None) -> tuple[int, str]:
    """Where the continuation starts (tokens kept) and the stop text held back before it."""
    count = len(progress.ids)
    clean = decoded is not None and decoded and not decoded.endswith(REPLACEMENT)
    if not request.holdback:
        return (count if clean else progress.anchor[0]), ""
    if not sent:  # all of it held back: from the start again (the client has no text of it)
        return progress.anchor[0], ""
    if decoded is None:
        raise CannotMigrate("stop strings hold text back and /detokenize gave nothing to recover it")
    if not clean:
        raise CannotMigrate("the cut is inside a character while stop text is held back")
    held = decoded[-request.holdback:]
    check = sent[-8:]
    if len(decoded) < request.holdback + len(check) or not decoded[:-request.holdback].endswith(check):
        raise CannotMigrate("the detokenized tail does not continue the text sent")
    return count, held


class Continuation:
    """One continuation: its request (path, body), and each of its events made into the client's (feed)."""

    path = COMPLETIONS

    def __init__(self, request: Request, progress: Progress, cut: int, replayed: list[int], replay_text: str,
                 held: str, context: str):
        self.request, self.progress, self.cut = request, progress, cut
        self.replay = list(replayed)  # tokens generated again: the client saw them when it asked for ids
        self.replay_text = replay_text  # text of them the client already has
        self.guard = StopGuard(request.stops, request.include_stop, context, held) if context or held else None
        progress.settling = self.guard is not None
        self.ended = False  # the stream ended here (a stop string across the cut): close the continuation
        self.body = self._body()

    def _body(self) -> bytes:
        request, cut = self.request, self.cut
        body = {"model": request.model, "prompt": _prompt_ids(self.progress) + self.progress.ids,
                "max_tokens": None if request.limit is None else request.limit - cut,
                **request.carried, "stream": True, "return_token_ids": True}
        if request.min_tokens:
            body["min_tokens"] = max(0, request.min_tokens - cut)
        if request.usage:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": request.continuous}
        return json.dumps(body, ensure_ascii=False).encode()

    def feed(self, event: bytes) -> bytes:
        """What the client gets for one whole event of the continuation (b"" for nothing). Raises
        CannotMigrate when tokens generated again differ from what the client has of them (cut the stream)."""
        if self.ended:
            return b""
        if not event.startswith(b"data: {"):
            if event.startswith(b"data: [DONE]") and not self.progress.done_sent:
                self.progress.done_sent = True
                return DONE
            return b""
        data = json.loads(event[6:])
        choices = data.get("choices")
        if not choices:
            return self._usage_event(data) if data.get("usage") is not None else b""
        choice = choices[0]
        ids, raw_text = choice.get("token_ids") or [], choice.get("text") or ""
        finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        new_ids, text = self._replay(ids, raw_text, finish)
        if self.guard is not None:
            text, finish, stop_reason, self.ended = self.guard.take(text, finish, stop_reason)
            if self.guard.done:
                self.guard = None
                self.progress.settling = False
        clean = len(ids) == 1 and bool(raw_text) and not self.replay_text and self.guard is None
        self.progress.add(ids, text, clean)
        self.progress.finished = finish is not None
        if not (new_ids or text or finish is not None):
            return b""  # all of it generated again: the client has it
        out = self._event(data, choice, text, new_ids, finish, stop_reason)
        if self.ended:
            out += self._own_usage() + DONE
            self.progress.done_sent = True
        return out

    def _replay(self, ids: list[int], text: str, finish: str | None) -> tuple[list[int], str]:
        """The tokens and text new to the client, once what it has of tokens generated again is dropped
        (compared first: the same under greedy decoding)."""
        if self.replay:
            n = min(len(ids), len(self.replay))
            if not self.request.strip_ids and ids[:n] != self.replay[:n]:
                raise CannotMigrate("tokens generated again differ from those the client has")
            ids, self.replay = ids[n:], self.replay[n:]
        if self.replay_text:
            n = min(len(text), len(self.replay_text))
            if text[:n] != self.replay_text[:n]:
                raise CannotMigrate("text generated again differs from what the client has")
            text, self.replay_text = text[n:], self.replay_text[n:]
        if finish is not None and (self.replay_text or self.replay and not self.request.strip_ids):
            raise CannotMigrate("the continuation finished before it gave again what the client has")
        return ids, text

    def _usage(self, completion: int, per_chunk: bool) -> dict:
        """Usage in the client's terms: the original prompt, tokens summed over the attempts."""
        return _usage(len(_prompt_ids(self.progress)), self.cut + completion,
                      per_chunk and self.request.kind is Kind.CHAT)

    def _own_usage(self) -> bytes:
        if not self.request.usage or self.progress.usage_sent:
            return b""
        self.progress.usage_sent = True
        return usage_event(self.request, self.progress, self._usage(len(self.progress.ids) - self.cut, False))

    def _usage_event(self, data: dict) -> bytes:
        # asked for when the client asked, or sent anyway (--enable-force-include-usage): passed on either way
        if self.progress.usage_sent:
            return b""
        self.progress.usage_sent = True
        usage = self._usage(data["usage"].get("completion_tokens", 0), False)
        return usage_event(self.request, self.progress, usage, data.get("system_fingerprint"))

    def _event(self, data: dict, choice: dict, text: str, ids: list[int], finish: str | None, stop_reason) -> bytes:
        p = self.progress
        shown = None if self.request.strip_ids else ids
        if self.request.kind is Kind.CHAT:
            out_choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                          "finish_reason": finish}
            if finish is not None:
                out_choice["stop_reason"] = stop_reason
            out_choice["token_ids"] = shown
            out: dict[str, Any] = {"id": p.id, "object": "chat.completion.chunk", "created": p.created, "model": p.model,
                                   "choices": [out_choice]}
        else:
            out_choice = {**choice, "text": text, "finish_reason": finish, "stop_reason": stop_reason,
                          "prompt_token_ids": None, "token_ids": shown}
            out = {**data, "id": p.id, "created": p.created, "model": p.model, "choices": [out_choice]}
        if data.get("usage") is not None:
            out["usage"] = self._usage(data["usage"].get("completion_tokens", 0), True)
        if data.get("system_fingerprint") is not None:
            out["system_fingerprint"] = data["system_fingerprint"]
        return _sse(out)


def _usage(prompt: int, completion: int, details: bool = False) -> dict:
    usage: dict[str, int | None] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                    "completion_tokens": completion}
    if details:
        usage["completion_tokens_details"] = None
    return usage


def usage_event(request: Request, progress: Progress, usage: dict, fingerprint: str | None = None) -> bytes:
    data: dict[str, Any] = {"id": progress.id,
                            "object": "chat.completion.chunk" if request.kind is Kind.CHAT else "text_completion",
                            "created": progress.created, "model": progress.model, "choices": [], "usage": usage}
    if fingerprint is not None:
        data["system_fingerprint"] = fingerprint
    return _sse(data)


def ending(request: Request, progress: Progress) -> bytes:
    """What a client whose stream finished but broke before its end is still owed: the usage chunk (when it
    asked and has none) and [DONE]."""
    out = b""
    if request.usage and not progress.usage_sent and progress.prompt_ids is not None:
        progress.usage_sent = True
        out += usage_event(request, progress, _usage(len(progress.prompt_ids), len(progress.ids)))
    if not progress.done_sent:
        progress.done_sent = True
        out += DONE
    return out


def _sse(data: dict) -> bytes:
    # vLLM's (pydantic's) form: no spaces, UTF-8 as is
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class StopGuard:
    """A stop string that begins before the cut (in the text the client has, or in text vLLM held back
    there) and ends in the continuation's text: the new engine cannot see it, so it is looked for here,
    over the first (longest stop - 1) characters of the continuation, as vLLM would (the first stop
    string of the list found wins). Held-back text and what follows is kept until that is decided."""

    def __init__(self, stops: tuple[str, ...], include: bool, context: str, held: str):
        self.stops, self.include = stops, include
        self.before = context + held  # the text before the cut a match may begin in
        self.skip = len(context)  # of which the client already has this much
        self.span = max(map(len, stops)) - 1
        self.received = ""  # continuation text so far
        self.shown = 0  # of before[skip:] + received, characters given out
        self.done = False

    def take(self, text: str, finish: str | None, stop_reason) -> tuple[str, str | None, object, bool]:
        """(text to show, finish_reason, stop_reason, whether the stream ends here)."""
        self.received += text
        window = self.before + self.received
        edge = len(self.before)
        for stop in self.stops:
            at = window.find(stop)
            if 0 <= at < edge < at + len(stop):
                self.done = True
                end = at + len(stop) if self.include else at
                return self._show(window, end), "stop", stop, True
        if finish is not None or len(self.received) >= self.span:
            self.done = True
            return self._show(window, len(window)), finish, stop_reason, False
        if self.include:  # what the client gets includes any stop string: nothing to hold back
            return self._show(window, len(window)), None, None, False
        return "", None, None, False

    def _show(self, window: str, end: int) -> str:
        start = self.skip + self.shown
        out = window[start:max(start, end)]
        self.shown += len(out)
        return out
