"""Continuing a streamed completion on another replica (issue 29, "migrate"): the pure part. No I/O, no
event loop; the data plane (dataplane.py) does the requests.

When a replica fails mid-stream (connection lost, an error event, finish_reason "abort") or must go (a
drain), the data plane sends a continuation to another replica: a /v1/completions request whose prompt is
the token ids of the first attempt's prompt plus the tokens the client already has, with max_tokens and
min_tokens reduced by them and the same sampling settings. Chat continues the same way (the chat template
was applied in the first attempt: its prompt_token_ids include it) and the continuation's completion events
are translated back to chat.completion.chunk events. The client sees one SSE stream: its first id, created
and model, no text twice or lost, usage summed (prompt_tokens of the original prompt). With temperature 0
the text equals an uninterrupted run's (tests/endpoint/test_migration_vllm.py).

How the data plane uses it (one request):

    prep = prepare(target, body)                # at request time: request None = forward as today
    send prep.body                              # return_token_ids added when the client did not ask
    record, events = Record(), EventSplitter()
    for chunk from the engine: for event in events.feed(chunk):
        if is_failure(event): migrate           # an error event or finish_reason "abort": not passed on
        record.add(event); write(strip_ids(event) if prep.request.strip_ids else event)
    on a broken stream or a drain (the partial event in `events` is dropped, never sent):
        progress = record.progress()
        reason = why_not(prep.request, progress, migrations, max_migrations)   # str: cut as today
        check = detokenize_body(prep.request, progress)                         # bytes or None
        decoded = POST other/detokenize check -> ["prompt"]     (None when check is None or it failed)
        cont = start(prep.request, progress, decoded)                           # CannotMigrate: cut
        POST other/v1/completions cont.body; for each whole event: is_failure -> migrate again (same
        request and progress); else write(cont.feed(event)); cont.ended -> close it (vLLM aborts)
    a stream that broke after its finish event: write(ending(prep.request, progress))

What vLLM sends (0.32 measured on CPU, 0.26 read in its source: the same fields and order):
- return_token_ids, completions: every chunk's choice has "prompt_token_ids" (the first chunk: the list,
  later ones: null) and "token_ids" (that chunk's new tokens). Chat: the first chunk (the role delta, no
  token) has a top-level "prompt_token_ids" list (chat template included), each later choice "token_ids".
  Without return_token_ids the same keys are there with null, so replacing each list by null (strip_ids)
  gives the client exactly the stream it would have had.
- include_usage moves system_fingerprint from the finishing chunk to the usage chunk; so it is not added
  for a client that did not ask (token counts come from the token ids).
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
from dataclasses import dataclass, field
from enum import Enum

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
COMPLETIONS_MAX_TOKENS = 16  # vLLM's default for /v1/completions (chat's is the model's length)
FOLD_BYTES = 64 * 1024  # raw events a Record keeps before it parses them into its Progress
DETOKENIZE_TAIL = 24  # prompt and generated tokens decoded to check the cut, besides held-back stop text
REPLACEMENT = "\ufffd"

_IDS = b'token_ids":['  # ends both "token_ids" and "prompt_token_ids"
_ERROR = b'data: {"error"'
_ABORT = b'"finish_reason":"abort"'
_DONE = b"data: [DONE]\n\n"


class Kind(Enum):
    COMPLETION = "completion"
    CHAT = "chat"


ROUTES = {COMPLETIONS: Kind.COMPLETION, CHAT: Kind.CHAT}


class CannotMigrate(Exception):
    """The stream cannot be continued elsewhere: cut it as before (reason says why)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ------------------------------------------------------------------ the client's request

# Sent to the continuation as the client sent them: they act per step, or on prompt and output alike.
CARRIED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
           "ignore_eos", "repetition_penalty", "logit_bias", "allowed_token_ids", "skip_special_tokens",
           "spaces_between_special_tokens", "user", "priority", "cache_salt", "stream_interval",
           "presence_penalty", "frequency_penalty")  # the last two only when 0 (checked below)
# Read here or without effect on a continuation (on token ids, its template already applied).
HANDLED = frozenset({
    "model", "prompt", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens",
    "return_token_ids", "request_id", "truncate_prompt_tokens", "truncation_side", "add_special_tokens",
    "return_prompt_text", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "reasoning_effort", "include_reasoning", "parallel_tool_calls", "tool_choice", "session_id",
    "mm_processor_kwargs", "media_io_kwargs", "metadata", "store", "service_tier", "return_tokens_as_token_ids",
    "return_token_offsets", "routed_experts_prompt_start"})
# Not migrated unless they have their default (or a value without effect): why, for the reason.
NEEDS_DEFAULT = {
    "n": ((None, 1), "several choices"), "best_of": ((None, 1), "best_of"),
    "use_beam_search": ((None, False), "beam search"), "echo": ((None, False), "echo"),
    "logprobs": ((None, False), "logprobs"), "top_logprobs": ((None, 0), "top_logprobs"),
    "prompt_logprobs": ((None,), "prompt_logprobs"), "logprob_token_ids": ((None,), "logprob_token_ids"),
    "suffix": ((None,), "suffix"), "tools": ((None, []), "tools"), "functions": ((None, []), "functions"),
    "function_call": ((None,), "function_call"), "response_format": ((None, {"type": "text"}), "response_format"),
    "structured_outputs": ((None,), "structured outputs"), "guided_json": ((None,), "guided decoding"),
    "guided_regex": ((None,), "guided decoding"), "guided_choice": ((None,), "guided decoding"),
    "guided_grammar": ((None,), "guided decoding"), "bad_words": ((None, []), "bad_words"),
    "vllm_xargs": ((None,), "vllm_xargs (custom logits processors)"),
    "thinking_token_budget": ((None,), "thinking_token_budget"),
    "repetition_detection": ((None,), "repetition_detection"),
    "kv_transfer_params": ((None,), "kv_transfer_params"), "ec_transfer_params": ((None,), "ec_transfer_params"),
    "prompt_embeds": ((None,), "prompt embeddings"), "mm_payload": ((None,), "multimodal input"),
    "return_mm_kwargs": ((None, False), "return_mm_kwargs"), "watermarking": ((None, False), "watermarking"),
    "presence_penalty": ((None, 0), "a presence penalty (it counts output tokens only)"),
    "frequency_penalty": ((None, 0), "a frequency penalty (it counts output tokens only)"),
    "length_penalty": ((None, 1), "length_penalty"),
}


@dataclass(frozen=True)
class Request:
    """What the data plane keeps about a request it may migrate."""

    kind: Kind
    model: str | None
    carried: dict  # sampling settings sent on as they are
    limit: int | None  # the client's max tokens (None: up to the model's length)
    min_tokens: int
    stops: tuple[str, ...]
    include_stop: bool
    strip_ids: bool  # the client did not ask for token ids: each event's lists become null
    usage: bool  # the client asked for a usage chunk
    continuous: bool  # ... and usage in every chunk

    @property
    def holdback(self) -> int:
        """Characters vLLM holds back while streaming (stop strings not to be shown)."""
        return max(map(len, self.stops)) - 1 if self.stops and not self.include_stop else 0

    @property
    def straddle(self) -> int:
        """Characters before a cut that a stop string found after it may begin in (its length - 1)."""
        return max(map(len, self.stops)) - 1 if self.stops else 0


@dataclass(frozen=True)
class Prepared:
    body: bytes  # what to send: the client's body, with return_token_ids when the request may migrate
    request: Request | None  # None: forward as before, never migrated
    reason: str | None  # why not, when request is None


def prepare(target: str, body: bytes | None, parsed: dict | None = None) -> Prepared:
    """At request time: whether this request may migrate and what to send the first replica. parsed: the
    body's JSON object when the caller already has it (the prefix policy parses it)."""
    kind = ROUTES.get(target)
    if kind is None or not body:
        return Prepared(body or b"", None, "not a completions or chat request")
    data = parsed if parsed is not None else _json_object(body)
    if data is None:
        return Prepared(body, None, "the body is no JSON object")
    reason = request_reason(kind, data)
    if reason is not None:
        return Prepared(body, None, reason)
    return Prepared(_with_token_ids(body, data), _request(kind, data), None)


def request_reason(kind: Kind, data: dict) -> str | None:
    """Why a request cannot migrate (None: it can)."""
    if data.get("stream") is not True:
        return "not streamed"
    for key, value in data.items():
        if key in NEEDS_DEFAULT:
            allowed, what = NEEDS_DEFAULT[key]
            if not _is_default(value, allowed):
                return f"{what} ({key}={_short(value)})"
        elif key not in HANDLED and key not in CARRIED:
            return f"the field {key!r}, whose effect on a continuation is not known"
    if kind is Kind.COMPLETION:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) != 1:
            return "a batch of prompts"
    else:
        if not isinstance(data.get("messages"), list):
            return "no messages"
        for message in data["messages"]:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                return "a message with non-text parts (the continuation is token ids only)"
    stop = data.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        return "stop is neither a string nor a list"
    return None


def _is_default(value, allowed: tuple) -> bool:
    """value is one of allowed; None and booleans only as themselves (0 is no False, False no 0)."""
    for default in allowed:
        if default is None or isinstance(default, bool) or isinstance(value, bool) or value is None:
            if value is default:
                return True
        elif value == default:
            return True
    return False


def _request(kind: Kind, data: dict) -> Request:
    if kind is Kind.CHAT:
        limit = data.get("max_completion_tokens")
        limit = data.get("max_tokens") if limit is None else limit
    else:
        limit = data["max_tokens"] if "max_tokens" in data else COMPLETIONS_MAX_TOKENS
    stop = data.get("stop") or ()
    options = data.get("stream_options") or {}
    return Request(kind=kind, model=data.get("model"),
                   carried={k: data[k] for k in CARRIED if k in data},
                   limit=limit, min_tokens=data.get("min_tokens") or 0,
                   stops=(stop,) if isinstance(stop, str) else tuple(s for s in stop if s),
                   include_stop=bool(data.get("include_stop_str_in_output")),
                   strip_ids=not data.get("return_token_ids"),
                   usage=bool(options.get("include_usage")),
                   continuous=bool(options.get("include_usage") and options.get("continuous_usage_stats")))


def _with_token_ids(body: bytes, data: dict) -> bytes:
    """The body with "return_token_ids": true. Spliced after the opening brace when the key is absent (no
    second copy of a large prompt); written again when the client set it false or null."""
    if data.get("return_token_ids") is True:
        return body
    if "return_token_ids" in data:
        return json.dumps({**data, "return_token_ids": True}, ensure_ascii=False).encode()
    start = body.index(b"{") + 1
    rest = body[start:]
    return b'{"return_token_ids":true' + (b"," if rest.lstrip()[:1] != b"}" else b"") + rest


def _json_object(body: bytes) -> dict | None:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


# ------------------------------------------------------------------ the hot path: each event passed on

class EventSplitter:
    """Whole SSE events out of a byte stream (vLLM ends each with a blank line): a partial event stays here
    and is never passed on, so a stream that breaks leaves the client no half event."""

    def __init__(self):
        self.buffer = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        self.buffer += chunk
        end = self.buffer.rfind(b"\n\n")
        if end < 0:
            return []
        whole = bytes(self.buffer[:end + 2])
        del self.buffer[:end + 2]
        if whole.count(b"\n\n") == 1:
            return [whole]
        return [part + b"\n\n" for part in whole[:-2].split(b"\n\n")]


def is_failure(event: bytes) -> bool:
    """An event that must not reach the client when the stream can migrate: vLLM's error event (a
    generation error, the engine dead) or a choice finished with "abort"."""
    return event.startswith(_ERROR) or _ABORT in event


def strip_ids(event: bytes) -> bytes:
    """The event with every token id list ("token_ids", "prompt_token_ids") written null, as vLLM writes
    them when the client did not ask. Bytes only: inside a JSON string a quote is escaped, so
    `token_ids":[` can only be a key, and a list of ints holds no ']'."""
    start = event.find(_IDS)
    if start < 0:
        return event
    parts, position = [], 0
    while start >= 0:
        opening = start + len(_IDS) - 1
        parts += (event[position:opening], b"null")
        position = event.index(b"]", opening) + 1
        start = event.find(_IDS, position)
    parts.append(event[position:])
    return b"".join(parts)


# ------------------------------------------------------------------ what the client has

@dataclass
class Progress:
    """What the client has of one request, in the original request's terms (across migrations)."""

    kind: Kind
    id: str | None = None
    created: int | None = None
    model: str | None = None
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)  # generated tokens on the path the client follows
    pieces: list[str] = field(default_factory=list)  # text the client got, in order
    text_len: int = 0
    anchor: tuple[int, int] = (0, 0)  # (tokens, characters) at the last certainly clean cut
    finished: bool = False
    role_sent: bool = False
    usage_sent: bool = False
    done_sent: bool = False
    missing_ids: bool = False  # an event without its token ids (or unreadable)
    other_content: str | None = None  # a chat delta part besides content (reasoning, tool calls)
    settling: bool = False  # a continuation holds text back to look for a stop string across its cut

    @property
    def text(self) -> str:
        if len(self.pieces) > 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def add(self, ids: list[int], text: str, clean: bool) -> None:
        self.ids += ids
        if text:
            self.pieces.append(text)
            self.text_len += len(text)
        if clean:
            self.anchor = (len(self.ids), self.text_len)

    def absorb(self, event: bytes) -> None:
        """One event of a first attempt, as the engine sent it (token ids included)."""
        if not event.startswith(b"data: {"):
            self.done_sent = self.done_sent or event.startswith(b"data: [DONE]")
            return
        try:
            data = json.loads(event[6:])
        except ValueError:  # not vLLM's: nothing to continue from
            self.missing_ids = True
            return
        if self.id is None:
            self.id, self.created, self.model = data.get("id"), data.get("created"), data.get("model")
        choices = data.get("choices")
        if not choices:
            self.usage_sent = self.usage_sent or data.get("usage") is not None
            return
        choice = choices[0]
        if self.kind is Kind.COMPLETION:
            text = choice.get("text") or ""
            if choice.get("prompt_token_ids") is not None:
                self.prompt_ids = choice["prompt_token_ids"]
        else:
            delta = choice.get("delta") or {}
            if "role" in delta and "token_ids" not in choice:  # the first chunk: role, prompt ids, no token
                self.role_sent = True
                self.prompt_ids = data.get("prompt_token_ids")
                return
            text = delta.get("content") or ""
            other = [k for k, v in delta.items() if k not in ("content", "role") and v]
            self.other_content = self.other_content or (", ".join(other) if other else None)
        ids = choice.get("token_ids")
        if ids is None:
            self.missing_ids = True
            ids = []
        self.add(ids, text, len(ids) == 1 and bool(text))
        self.finished = self.finished or choice.get("finish_reason") is not None


class Record:
    """The events passed on from a first attempt: kept as bytes (cheap per event), parsed only when a
    migration needs them, or in batches once they pass FOLD_BYTES (memory stays near the token ids)."""

    def __init__(self, kind: Kind, fold_bytes: int = FOLD_BYTES):
        self._progress = Progress(kind)
        self._raw: list[bytes] = []
        self._size = 0
        self._fold = fold_bytes

    def add(self, event: bytes) -> None:
        self._raw.append(event)
        self._size += len(event)
        if self._size > self._fold:
            self._absorb()

    def progress(self) -> Progress:
        self._absorb()
        return self._progress

    def _absorb(self) -> None:
        for event in self._raw:
            self._progress.absorb(event)
        self._raw.clear()
        self._size = 0


# ------------------------------------------------------------------ the decision and the continuation

def why_not(request: Request, progress: Progress, migrations: int, max_migrations: int) -> str | None:
    """Why this stream cannot be continued elsewhere now (None: it can)."""
    if migrations >= max_migrations:
        return f"{migrations} migration(s) already, the limit"
    if progress.finished:
        return "the stream had finished"
    if progress.missing_ids or progress.id is not None and progress.prompt_ids is None:
        return "events came without token ids (or could not be read)"
    if progress.prompt_ids is None:
        return "no event was passed on yet (nothing to continue: the request can be sent again as it is)"
    if progress.other_content:
        return f"the assistant message has other parts than content ({progress.other_content})"
    if progress.settling:
        return "the previous continuation was still looking for a stop string across its cut"
    if request.limit is not None and len(progress.ids) >= request.limit:
        return "no tokens left to generate"
    return None


def detokenize_body(request: Request, progress: Progress) -> bytes | None:
    """The body of POST /detokenize to send the new replica before start(), or None when nothing needs it:
    the cut is certainly clean and no stop text is held back (or none was sent yet)."""
    held = request.holdback and progress.text_len > 0
    if not held and progress.anchor[0] == len(progress.ids):
        return None
    tail = (progress.prompt_ids + progress.ids)[-(DETOKENIZE_TAIL + request.holdback):]
    return json.dumps({"model": request.model, "tokens": tail}).encode()


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
        body = {"model": request.model, "prompt": self.progress.prompt_ids + self.progress.ids,
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
                return _DONE
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
            out += self._own_usage() + _DONE
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
        return _usage(len(self.progress.prompt_ids), self.cut + completion,
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
            out_choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                out_choice["stop_reason"] = stop_reason
            out_choice["token_ids"] = shown
            out = {"id": p.id, "object": "chat.completion.chunk", "created": p.created, "model": p.model,
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
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    if details:
        usage["completion_tokens_details"] = None
    return usage


def usage_event(request: Request, progress: Progress, usage: dict, fingerprint: str | None = None) -> bytes:
    data = {"id": progress.id, "object": "chat.completion.chunk" if request.kind is Kind.CHAT else "text_completion",
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
        out += _DONE
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
