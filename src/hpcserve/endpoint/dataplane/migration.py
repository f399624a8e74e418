"""Continuing a streamed completion on another replica: the pure part. No I/O, no
event loop; the data plane (plane.py, streams.py) does the requests.

When a replica fails mid-stream (connection lost, an error event, finish_reason "abort") or must go (a
drain), the data plane sends a continuation to another replica: a /v1/completions request whose prompt is
the token ids of the first attempt's prompt plus the tokens the client already has, with max_tokens and
min_tokens reduced by them and the same sampling settings. Chat continues the same way (the chat template
was applied in the first attempt: its prompt_token_ids include it) and the continuation's completion events
are translated back to chat.completion.chunk events. The client sees one SSE stream: its first id, created
and model, no text twice or lost, usage summed (prompt_tokens of the original prompt). With temperature 0
the text equals an uninterrupted run's (tests/endpoint/test_migration_vllm.py).

The data plane (endpoint/dataplane/streams.py) prepares each request (`prepare`: return_token_ids added when the
client did not ask), passes on whole events only (`EventSplitter`, `strip_ids`), keeps them (`Record`),
and on a broken stream, an error event (`is_failure`) or a drain asks `why_not` and continues elsewhere
(endpoint/dataplane/continuation.py: `start`, `Continuation.feed`, `ending`).

What vLLM sends (0.32 measured on CPU, 0.26 read in its source: the same fields and order):
- return_token_ids, completions: every chunk's choice has "prompt_token_ids" (the first chunk: the list,
  later ones: null) and "token_ids" (that chunk's new tokens). Chat: the first chunk (the role delta, no
  token) has a top-level "prompt_token_ids" list (chat template included), each later choice "token_ids".
  Without return_token_ids the same keys are there with null, so replacing each list by null (strip_ids)
  gives the client exactly the stream it would have had.
- include_usage moves system_fingerprint from the finishing chunk to the usage chunk; so it is not added
  for a client that did not ask (token counts come from the token ids).
- Where a continuation starts, and why there: endpoint/dataplane/continuation.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum

from hpcserve.endpoint.dataplane.routing.prefix_index import request_json
from hpcserve.endpoint.dataplane.sse import IdCount, split_events

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
COMPLETIONS_MAX_TOKENS = 16  # vLLM's default for /v1/completions (chat's is the model's length)
FOLD_BYTES = 64 * 1024  # raw events a Record keeps before it parses them into its Progress
DETOKENIZE_TAIL = 24  # prompt and generated tokens decoded to check the cut, besides held-back stop text
REPLACEMENT = "\ufffd"



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
NEEDS_DEFAULT: dict[str, tuple[tuple, str]] = {
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
    data = parsed if parsed is not None else request_json(body)
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
    # What _request reads must have its type; a request without it is not migrated but sent on as it is, for
    # vLLM to refuse (a 400 that names the field) or to read its own way (pydantic takes "5" for 5).
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return f"stream_options is not an object ({_short(options)})"
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = data.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{key} is not a whole number ({_short(value)})"
    stop = data.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        return "stop is neither a string nor a list"
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        return "stop is a list of other things than strings"
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
        limit = data.get("max_tokens", COMPLETIONS_MAX_TOKENS)
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


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


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
        self._folded = False  # some events were parsed into _progress

    def add(self, events: bytes) -> None:
        """One or more whole events, as passed on."""
        self._raw.append(events)
        self._size += len(events)
        if self._size > self._fold:
            self._absorb()

    def progress(self) -> Progress:
        self._absorb()
        return self._progress

    def token_counts(self, counted: IdCount | None = None) -> tuple[int | None, int | None]:
        """(prompt tokens, generated tokens) that the events carried as token ids, without parsing the events
        not yet folded (a usage record's count, at every stream's end: parsing them all cost the data plane 40 %
        more CPU per streamed request). None where the ids were not there. counted: the "token_ids" lists of
        every event added, as strip_ids counted them while it wrote them null (then no event is scanned again;
        used while none is folded)."""
        if counted is not None and not self._folded:
            prompt = None
            for events in self._raw:  # the first prompt list (in the first event, as the engine sends it)
                at = events.find(PROMPT_IDS)
                if at >= 0:
                    prompt = _list_length(events, at + len(PROMPT_IDS))
                    break
            return prompt, counted.ids if counted.lists or prompt is not None else None
        folded = self._progress
        prompt = len(folded.prompt_ids) if folded.prompt_ids is not None else None
        # The events not folded yet, scanned as one piece: a handful of calls per stream rather than a few per
        # event (per event, this cost as much as the rest of tenancy's work on a request).
        raw = b"".join(self._raw)
        if prompt is None:
            at = raw.find(PROMPT_IDS)
            prompt = _list_length(raw, at + len(PROMPT_IDS)) if at >= 0 else None
        lists = TOKEN_ID_LISTS.findall(raw)
        if folded.missing_ids or not (folded.ids or prompt is not None or lists):
            return prompt, None
        return prompt, len(folded.ids) + ids_in(lists)

    def _absorb(self) -> None:
        self._folded = self._folded or bool(self._raw)
        for events in self._raw:
            for event in split_events(events):
                self._progress.absorb(event)
        self._raw.clear()
        self._size = 0


PROMPT_IDS = b'"prompt_token_ids":['
# Each generated list's contents: the opening quote is never inside "prompt_token_ids", a list of ints holds no ']'.
TOKEN_ID_LISTS = re.compile(rb'"token_ids":\[([^\]]*)\]')


def ids_in(lists: list[bytes]) -> int:
    """How many integers the contents of these JSON lists of integers hold (each: none, or its commas + 1). Pure."""
    return len(lists) - lists.count(b"") + b"".join(lists).count(b",")


def _list_length(data: bytes, start: int) -> int:
    """The length of the JSON list of integers that starts at start (just after its '['). Pure."""
    end = data.find(b"]", start)
    if end < 0 or end == start:
        return 0
    return data.count(b",", start, end) + 1


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
