"""The long-running processes' log lines (core/logs.py): time, level and origin on each, hpcserve's INFO
shown and other libraries' hidden, and `hpcserve logs --level` reading the level back."""

from __future__ import annotations

import re
import subprocess
import sys

from hpcserve.core.logs import at_least, line_level

OURS = "2026-12-06 02:16:12,345 WARNING hpcserve.endpoint.control.controller[123]: give up: no slot"
RAY = "2026-12-06 02:16:12,345\tINFO worker.py:1821 -- Connected to Ray cluster."
VLLM = "(APIServer pid=4242) ERROR 12-06 02:16:12 [core.py:700] EngineCore failed to start."


def test_the_level_of_each_kind_of_record_line():
    assert [line_level(line) for line in (OURS, RAY, VLLM, "INFO 12-06 02:16:12 [api_server.py:1] up")] == \
        ["WARNING", "INFO", "ERROR", "INFO"]
    assert line_level("Traceback (most recent call last):") is None
    assert line_level("an INFO word later in a line") is None


def test_a_level_keeps_whole_records_and_what_precedes_the_first():
    lines = ["early output", OURS, "Traceback (most recent call last):", "  ValueError: x",
             "2026-12-06 02:16:13,000 INFO hpcserve.endpoint.control.controller[123]: join: m1", "  more of it", VLLM]
    assert list(at_least(lines, "warning")) == ["early output", OURS, *lines[2:4], VLLM]
    assert list(at_least(lines, "ERROR")) == ["early output", VLLM]
    assert list(at_least(lines, "DEBUG")) == lines


PROCESS = """
import logging
from hpcserve.core.logs import configure_process_logging
configure_process_logging()
logging.getLogger("hpcserve.endpoint.dataplane.plane").info("serving on 127.0.0.1:1")
logging.getLogger("hpcserve.deployment.driver").debug("not shown")
logging.getLogger("aiohttp.access").info("GET / 200: not shown")
logging.getLogger("aiohttp.server").error("shown: another library's error")
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("hpcserve.deployment.process").exception("failed")
"""


def test_a_process_logs_time_level_and_origin_to_stderr():
    done = subprocess.run([sys.executable, "-c", PROCESS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "", done.stderr
    lines = done.stderr.splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
    assert re.fullmatch(stamp + r"INFO hpcserve\.endpoint\.dataplane\.plane\[\d+\]: serving on 127\.0\.0\.1:1", lines[0])
    assert re.fullmatch(stamp + r"ERROR aiohttp\.server\[\d+\]: shown: another library's error", lines[1])
    assert lines[2].endswith(": failed") and lines[3] == "Traceback (most recent call last):"
    assert "not shown" not in done.stderr
    assert list(at_least(lines, "ERROR")) == lines[1:]
