"""Log lines of hpcserve's long-running processes (the driver, the endpoint's controller, its data plane):
each with its time, level and origin, in the run folder's log file that the process's stderr goes to
(driver.log or slurm.out, endpoint.log, router.log). `hpcserve logs --level` reads the level back."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable, Iterator

FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# A record's first line: ours (FORMAT), Ray's ("date time<TAB>LEVEL ...") or vLLM's ("LEVEL MM-DD ...", maybe
# after "(APIServer pid=N) "). Any other line continues the record above it (a traceback).
RECORD = re.compile(r"^(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+\s+|\(\S+ pid=\d+\) )?"
                    r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def configure_process_logging(level: int | str = logging.INFO) -> None:
    """hpcserve's own records from `level` up, other libraries' from WARNING up (aiohttp's access log stays
    off), all on stderr, written at once."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("hpcserve").setLevel(level)


def line_level(line: str) -> str | None:
    """The level a log line starts a record at; None: it starts none (a continuation, or not a log line)."""
    found = RECORD.match(line)
    return found.group(1) if found else None


def at_least(lines: Iterable[str], level: str, keep: bool = True) -> Iterator[str]:
    """The lines of records at `level` or above; a line that starts no record goes with the record above it
    (`keep`: whether lines before any record are shown)."""
    lowest = LEVELS.index(level.upper())
    for line in lines:
        found = line_level(line)
        if found is not None:
            keep = LEVELS.index(found) >= lowest
        if keep:
            yield line
