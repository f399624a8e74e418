"""What a benchmark sends and when: prompts (random token ids or a JSONL dataset) and arrival times.

Everything here is drawn up front from a seeded RNG, before the first request leaves, so a run is
reproducible and the clock-critical loop does no sampling work.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from hpcserve.benchmark.loadgen import RequestInput
from hpcserve.core.errors import UsageError

# Token ids below this exist in every tokenizer hpcserve serves (the tiny test model has 587 tokens);
# which ids a prompt holds does not change the cost of serving it, only how many.
# The first few are skipped because tokenizers put special tokens there.
DEFAULT_VOCAB_SIZE = 500
FIRST_ORDINARY_TOKEN_ID = 10


@dataclass(frozen=True)
class LengthRange:
    """Prompt length in tokens: fixed when low == high, else uniform over [low, high]."""

    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)


def parse_length_range(text: str) -> LengthRange:
    """'64' -> fixed 64; '32:128' (or '32-128') -> uniform over [32, 128]."""
    parts = text.replace("-", ":").split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2) or numbers[0] < 1 or numbers[-1] < numbers[0]:
        raise UsageError(f"input length '{text}': expected N or MIN:MAX with 1 <= MIN <= MAX, e.g. 32:128")
    return LengthRange(numbers[0], numbers[-1])


def random_token_prompts(num_prompts: int, input_len: LengthRange, output_len: int, seed: int,
                         vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[RequestInput]:
    """Prompts of random token ids: sent as ids, so the server sees exactly the drawn length."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        length = input_len.draw(rng)
        ids = [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(length)]
        prompts.append(RequestInput(prompt=ids, output_len=output_len, prompt_len=length))
    return prompts


def load_dataset(path: str | Path, num_prompts: int | None, default_output_len: int) -> list[RequestInput]:
    """A JSONL file of {"prompt": str | [ids], "output_len": int}; cycled when num_prompts exceeds it."""
    rows = _read_jsonl(Path(path))
    inputs = [_row_to_input(row, default_output_len, f"{path}:{line}") for line, row in rows]
    if not inputs:
        raise UsageError(f"--dataset {path}: no prompts in the file")
    count = len(inputs) if num_prompts is None else num_prompts
    return [inputs[i % len(inputs)] for i in range(count)]


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise UsageError(f"--dataset {path}: no such file")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise UsageError(f"--dataset {path}:{number}: not JSON ({exc.msg})") from None
    return rows


def _row_to_input(row: object, default_output_len: int, where: str) -> RequestInput:
    if not isinstance(row, dict) or "prompt" not in row:
        raise UsageError(f"--dataset {where}: expected an object with a 'prompt' key")
    prompt = row["prompt"]
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise UsageError(f"--dataset {where}: 'prompt' must be a non-empty string or list of token ids")
    output_len = row.get("output_len", default_output_len)
    if not isinstance(output_len, int) or output_len < 1:
        raise UsageError(f"--dataset {where}: 'output_len' must be a positive integer")
    return RequestInput(prompt=prompt, output_len=output_len, prompt_len=len(prompt) if is_ids else None)


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start of the run: a Poisson process, or all at 0 for rate inf.

    The first request goes at 0 so a run's duration is not padded by an idle wait before it.
    """
    if request_rate <= 0:
        raise UsageError(f"request rate must be positive or inf, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for index in range(num_requests):
        if index:
            now += rng.expovariate(request_rate)
        offsets.append(now)
    return offsets
