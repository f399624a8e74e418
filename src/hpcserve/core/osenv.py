"""Process environment helpers: variables and umask, set for a block and restored."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def environment_variables(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set these variables (None: unset them) for the duration of the block, then restore what was there
    (also on errors)."""
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# Files and folders hpcserve's processes create are for their owner alone: run folders, logs (which name
# hosts, ports and prompts in errors), keys, Ray's sockets. Everything hpcserve starts runs with it.
PRIVATE_UMASK = 0o077


@contextmanager
def umask(mask: int) -> Iterator[None]:
    """This process's umask for the duration of the block (what sbatch hands on to the job, and the mode
    of files opened meanwhile), then the previous one."""
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)
