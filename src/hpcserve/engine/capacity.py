"""How many requests a vLLM engine runs at once, read from its arguments. Pure, and light to import:
the endpoint's data plane reads its default when it starts."""

from __future__ import annotations

# vLLM's default --max-num-seqs (its OpenAI server's default batch size on most devices)
DEFAULT_MAX_NUM_SEQS = 256


def max_num_seqs(args: list[str]) -> int:
    """The requests an engine with these extra arguments runs at once: the last --max-num-seqs (vLLM's
    argparse takes the last one), else vLLM's default. Pure."""
    found = DEFAULT_MAX_NUM_SEQS
    for index, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--max-num-seqs=") else (
            args[index + 1] if arg == "--max-num-seqs" and index + 1 < len(args) else None)
        if value is not None and value.isdigit() and int(value) > 0:
            found = int(value)
    return found
