"""What a second, unprivileged user of the cluster tries against someone else's deployment.

Run by tests/cluster/test_hostile_user.py as that user, with the system's /usr/bin/python3 and the standard
library only (the owner's virtual environment is not theirs to use): a JSON plan on stdin, a JSON report of
what each attempt got on stdout. It judges nothing; the test does.

    http     {id: {method, url, headers, body}}   -> {id: {status, body, error}}
    read     [path]                                -> {path: "read" | error name}
    list     [folder]                              -> {folder: "listed" | error name}
    create   [path]  (a new file, as a plant)      -> {path: "created" | error name}
    mkdir    [folder]                              -> {folder: "made" | error name}
    symlink  [[link, target]]                      -> {link: "linked" | error name}
    connect  [unix socket path]                    -> {path: "connected" | error name}
    proc     true: every process's command line, and the PIDs whose environment could be read
"""

from __future__ import annotations

import json
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
import urllib.error
import urllib.request

TIMEOUT_S = 5.0
# The HTTP attempts run side by side: a port that never answers HTTP (Ray's and gloo's on a compute node)
# costs TIMEOUT_S, and one after another they took minutes.
HTTP_AT_ONCE = 32
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to the target


def http(attempt: dict) -> dict:
    body = attempt.get("body")
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **attempt.get("headers", {})}
    request = urllib.request.Request(attempt["url"], data=data, method=attempt["method"], headers=headers)
    try:
        with OPENER.open(request, timeout=TIMEOUT_S) as response:
            return {"status": response.status, "body": response.read(400).decode(errors="replace")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read(400).decode(errors="replace")}
    except Exception as exc:  # noqa: BLE001 - refused, reset, timed out: all are answers here
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"[:200]}


def http_all(attempts: dict) -> dict:
    with ThreadPoolExecutor(max_workers=HTTP_AT_ONCE) as pool:
        return dict(zip(attempts, pool.map(http, attempts.values())))


def outcome(action, done: str) -> str:
    try:
        action()
        return done
    except OSError as exc:
        return type(exc).__name__


def read(path: str) -> None:
    with open(path, "rb") as handle:
        handle.read(1)


def create(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.write(fd, b"planted by another user\n")
    os.close(fd)


def connect(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.connect(path)


def processes() -> dict:
    cmdlines, environ_readable = [], []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmdlines.append(handle.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if handle.read(1):
                    environ_readable.append(int(pid))
        except OSError:
            pass
    return {"cmdlines": cmdlines, "environ_readable": environ_readable}


def main() -> int:
    plan = json.load(sys.stdin)
    report = {
        "uid": os.getuid(),
        "http": http_all(plan.get("http", {})),
        "read": {p: outcome(lambda p=p: read(p), "read") for p in plan.get("read", [])},
        "list": {p: outcome(lambda p=p: os.listdir(p), "listed") for p in plan.get("list", [])},
        "create": {p: outcome(lambda p=p: create(p), "created") for p in plan.get("create", [])},
        "mkdir": {p: outcome(lambda p=p: os.mkdir(p, 0o777), "made") for p in plan.get("mkdir", [])},
        "symlink": {link: outcome(lambda a=link, b=target: os.symlink(b, a), "linked")
                    for link, target in plan.get("symlink", [])},
        "connect": {p: outcome(lambda p=p: connect(p), "connected") for p in plan.get("connect", [])},
    }
    if plan.get("proc"):
        report.update(processes())
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
