"""What each replica's prefix cache holds exactly: its engine's KV events (engine.kv_events), indexed by
the blocks' token ids. No I/O; updated as events arrive, read for every request.

    index = TokenIndex()
    index.apply(events)                           # BlockStored / BlockRemoved / AllBlocksCleared, in order
    blocks = token_blocks(token_ids, index.block_size)
    index.expect(blocks, until)                   # sent there: count them as held until then, or until stored
    index.match(blocks, now)                      # leading blocks the engine holds now (or will, expected)

vLLM names a block by a hash of its tokens chained over every block before it; that hash is seeded per
engine (and may be bytes or an int), so the index computes its own chain over the same token ids
(`token_blocks`: the same function for what the engine stored and for a new prompt) and keeps, per
engine hash, which of its own it stands for, to drop it when the engine evicts it. A block whose parent
was stored before the feed began cannot be chained: it is skipped (`unchained`), and the prompt's part
it covers is left to the approximate index (prefix_index).

A prompt sent to the engine is in its cache before the engine says so: its blocks are stored once its
prefill ran, seconds later under load. Until then (or until `until`) they count as held (`expect`), so that
its repeats follow it; an engine that clears its cache clears those too.
"""

from __future__ import annotations

from collections.abc import Iterable

from hpcserve.engine.kv_events import Cleared, Removed, Stored

ROOT = 0
MAX_ENTRIES = 1 << 21  # engine blocks one replica's index keeps at most, whatever its engine publishes
MAX_PENDING = 1 << 18  # expected blocks kept at most
MAX_EARLY_TOKENS = 1 << 20  # token ids of prompts sent before the block size was known, kept at most


def token_blocks(token_ids: list[int], block_size: int, start: int = ROOT) -> list[int]:
    """The chained hashes of the whole blocks of token_ids (a partial last block is not cached). hash() of
    a tuple of ints is the same in every process and run. Pure."""
    chain, blocks = start, []
    for begin in range(0, len(token_ids) - block_size + 1, block_size):
        chain = hash((chain, *token_ids[begin:begin + block_size]))
        blocks.append(chain)
    return blocks


class TokenIndex:
    """One replica's cached blocks, from its engine's events since the feed began."""

    def __init__(self) -> None:
        self.block_size = 0  # from the first BlockStored; 0: nothing known yet
        self.ours: dict = {}  # the engine's block hash -> our chained hash
        self.held: dict[int, int] = {}  # our chained hash -> how many engine blocks stand for it
        self.pending: dict[int, float] = {}  # our chained hash of a block sent there -> expected until (monotonic)
        self.unchained = 0  # stored blocks whose parent the index never saw
        self.events = 0
        self.complete = False  # every block of ours the engine holds is here (kv_feed says when)
        # Prompts sent before the first event said the block size (a burst at the start): expected once known
        self.early: list[tuple[list[int], float]] = []
        self.early_tokens = 0

    def apply(self, events: Iterable[Stored | Removed | Cleared]) -> None:
        for event in events:
            self.events += 1
            if isinstance(event, Stored):
                self.store(event)
            elif isinstance(event, Removed):
                for engine_hash in event.hashes:
                    self.drop(engine_hash)
            else:
                self.clear()

    def store(self, event: Stored) -> None:
        if self.block_size and event.block_size != self.block_size:
            return  # another cache group's blocks (hybrid models): the first size is the one routed on
        if not self.block_size:
            self.block_size = event.block_size
            for tokens, until in self.early:
                self.expect(token_blocks(tokens, self.block_size), until)
            self.early, self.early_tokens = [], 0
        parent = ROOT if event.parent is None else self.ours.get(event.parent)
        if parent is None:
            self.unchained += len(event.hashes)
            return
        chained = token_blocks(event.token_ids, event.block_size, parent)
        for engine_hash, ours in zip(event.hashes, chained):
            if engine_hash in self.ours or len(self.ours) >= MAX_ENTRIES:
                continue
            self.ours[engine_hash] = ours
            self.held[ours] = self.held.get(ours, 0) + 1
            self.pending.pop(ours, None)

    def drop(self, engine_hash) -> None:
        ours = self.ours.pop(engine_hash, None)
        if ours is None:
            return
        count = self.held.get(ours, 0) - 1
        if count > 0:
            self.held[ours] = count
        else:
            self.held.pop(ours, None)

    def clear(self) -> None:
        self.ours.clear()
        self.held.clear()
        self.pending.clear()
        self.early, self.early_tokens = [], 0

    def expect(self, blocks: list[int], until: float) -> None:
        """Blocks just sent to the engine: held, as far as match() tells, until `until` or their events."""
        pending, held = self.pending, self.held
        if len(pending) + len(blocks) > MAX_PENDING:  # the older half goes (kept in the order expected)
            for block in list(pending)[:len(pending) // 2]:
                del pending[block]
        for block in blocks:
            if block not in held:
                pending.pop(block, None)
                pending[block] = until

    def expect_early(self, token_ids: list[int], until: float) -> None:
        """A prompt sent before the block size is known (no event yet): expected as soon as it is."""
        if self.early_tokens + len(token_ids) <= MAX_EARLY_TOKENS:
            self.early.append((token_ids, until))
            self.early_tokens += len(token_ids)

    def match(self, blocks: list[int], now: float | None = None) -> int:
        """How many of the leading blocks the engine holds (or, given `now`, is expected to hold)."""
        held, pending, depth = self.held, self.pending, 0
        for block in blocks:
            if block not in held and (now is None or pending.get(block, 0.0) <= now):
                break
            depth += 1
        return depth

    def blocks(self, now: float | None = None) -> int:
        """Blocks the engine holds; given `now`, with those on their way in (sent, not stored yet): a cache
        that has just been sent many new prompts is fuller than its events say."""
        if now is None:
            return len(self.held)
        pending = self.pending
        while pending:  # in the order expected, which is the order they expire: the expired ones go
            block, until = next(iter(pending.items()))
            if until > now:
                break
            del pending[block]
        return len(self.held) + len(pending)
