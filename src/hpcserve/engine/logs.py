"""What an engine's log says when it failed. Pure."""

from __future__ import annotations

import re

ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(Error|Exception)\b:?\s")


def engine_error(log_text: str) -> str:
    """The engine's own error message from its log: the last line naming an error, with the indented
    lines that continue it (pydantic puts the actual reason there). Pure."""
    lines = [line.rstrip() for line in log_text.splitlines() if line.strip()]
    for index in range(len(lines) - 1, -1, -1):
        if ERROR_LINE.search(lines[index]) and "Traceback" not in lines[index]:
            message = [lines[index].strip()]
            for follow in lines[index + 1:index + 4]:
                if not follow.startswith((" ", "\t")) or "further information" in follow:
                    break
                message.append(follow.strip())
            return " ".join(message)[:600]
    return lines[-1].strip()[-400:] if lines else "(the engine wrote nothing to its log)"
