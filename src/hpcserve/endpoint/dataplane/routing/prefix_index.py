"""What each replica's prefix cache holds, as the data plane knows it: the prompts it sent there, cut into
blocks, each block named by a hash chained over everything before it (as vLLM names its KV blocks), so
that a block's hash stands for the whole prefix up to its end. No I/O; it runs for every request.

    index = PrefixIndex()
    blocks = prompt_blocks(prompt_text(body))     # [] when the body has no prompt/messages to key on
    depth = index.match(backend, blocks)          # leading blocks that backend holds
    index.record(backend, blocks)                 # sent there: its engine caches them now
    index.forget(url)                             # a backend left the pool: its cache went with it

The text is the parsed prompt, never the raw JSON: the same prompt sent with or without spaces, with
escaped or literal non-ASCII, lands on the same blocks, and a long shared system prompt followed by
different conversations shares exactly its own blocks. Each replica's entries are bounded by what its
KV cache can hold (BackendSpec.kv_tokens, else DEFAULT_BLOCKS) and evicted least recently used first,
deepest block first, as vLLM frees a sequence's blocks from its tail.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BLOCK_CHARS = 64  # about vLLM's 16-token block at ~4 characters a token
MAX_BLOCKS = 2048  # a prompt's first 128 KB is what routing looks at
TOKENS_PER_BLOCK = 16
# Without the engine's KV size: 65,536 blocks = ~1M tokens, about an 8B model's cache on one H200.
DEFAULT_BLOCKS = 65536
MAX_BLOCKS_PER_BACKEND = 1 << 20  # ~100 MB of entries at most, whatever a backend claims
FIELD_SEPARATOR = "\x1f"  # between a message's role and content, and between messages


def request_json(body: bytes | None) -> dict | None:
    """A request body's JSON object; None when it is none. Pure."""
    if not body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def prompt_text(body: bytes | dict | None) -> str | None:
    """The prompt as the engine sees it, from a request body (or its parsed JSON): completions' `prompt` (a
    string, a list of strings: the first, or token ids), chat's `messages` (role and text of each, in
    order), embeddings' `input`. None when the body is no JSON object or has none of them. Pure."""
    data = body if isinstance(body, dict) else request_json(body)
    if data is None:
        return None
    messages = data.get("messages")
    if isinstance(messages, list):
        return FIELD_SEPARATOR.join(message_text(m) for m in messages)
    for field in ("prompt", "input"):
        value = data.get(field)
        if isinstance(value, list) and value:
            value = value[0] if not isinstance(value[0], int) else " ".join(map(str, value))
        if isinstance(value, list):  # a batch of token-id lists: the first
            value = " ".join(map(str, value))
        if isinstance(value, str):
            return value
    return None


def message_text(message: object) -> str:
    """A chat message's role and text (the text parts of multi-part content, in order). Pure."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return f"{message.get('role', '')}{FIELD_SEPARATOR}{content if isinstance(content, str) else ''}"


def prompt_blocks(text: str | None) -> list[int]:
    """The chained hashes of the text's whole blocks (a partial last block is not cached by vLLM either).
    hash() is seeded per process tree: the data plane's workers are forked from one parent, so they agree. Pure."""
    if not text:
        return []
    chain, blocks = 0, []
    for start in range(0, min(len(text), MAX_BLOCKS * BLOCK_CHARS) - BLOCK_CHARS + 1, BLOCK_CHARS):
        chain = hash((chain, text[start:start + BLOCK_CHARS]))
        blocks.append(chain)
    return blocks


def blocks_for(kv_tokens: int | None) -> int:
    """How many blocks of ours a replica's KV cache of kv_tokens holds."""
    if not kv_tokens:
        return DEFAULT_BLOCKS
    return max(1, min(MAX_BLOCKS_PER_BACKEND, kv_tokens // TOKENS_PER_BLOCK))


class PrefixIndex:
    """Per backend URL, the blocks sent there, least recently used first."""

    def __init__(self) -> None:
        self.held: dict[str, OrderedDict[int, None]] = {}
        self.limits: dict[str, int] = {}

    def match(self, url: str, blocks: Sequence[int]) -> int:
        """How many of the leading blocks url holds."""
        held = self.held.get(url)
        if not held:
            return 0
        depth = 0
        for block in blocks:
            if block not in held:
                break
            depth += 1
        return depth

    def fill(self, url: str) -> float:
        """How full url's cache is by our count (0 empty, 1 full): where a new prefix has most room."""
        return len(self.held.get(url) or ()) / self.limits.get(url, DEFAULT_BLOCKS)

    def record(self, url: str, blocks: Sequence[int]) -> None:
        """Blocks sent to url: the most recently used now, the first block most of all (a chain is freed
        from its tail: losing its first block would make the whole chain unmatchable)."""
        if not blocks:
            return
        held = self.held.get(url)
        if held is None:
            held = self.held[url] = OrderedDict()
        for block in reversed(blocks):
            held[block] = None
            held.move_to_end(block)
        limit = self.limits.get(url, DEFAULT_BLOCKS)
        while len(held) > limit:
            held.popitem(last=False)

    def set_limit(self, url: str, kv_tokens: int | None) -> None:
        self.limits[url] = blocks_for(kv_tokens)

    def forget(self, url: str) -> None:
        self.held.pop(url, None)
        self.limits.pop(url, None)

    def keep_only(self, urls: Iterable[str]) -> None:
        """Drop what is known of backends no longer in the pool (their replicas and caches are gone, or
        will be: a replica coming back under the same URL starts with an empty cache)."""
        wanted = set(urls)
        for url in [url for url in self.held if url not in wanted]:
            self.forget(url)

    def entries(self) -> int:
        return sum(len(held) for held in self.held.values())
