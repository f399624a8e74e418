"""Addresses and ports."""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import socket
import tempfile
from pathlib import Path

# A Unix socket's path is limited by sun_path: 108 bytes on Linux, one of them the terminating NUL.
UNIX_PATH_MAX = 107


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def port_free(port: int, host: str = "0.0.0.0") -> bool:
    """Nothing listens on host:port now (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def first_ephemeral_port() -> int:
    """The first of this machine's ephemeral ports: the kernel takes the source port of every outgoing
    connection from there, so a port a server will listen on later belongs below it."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_loopback_port() -> int:
    """A port nothing listens on now, chosen by the kernel."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def url_host(host: str) -> str:
    """The host part of a URL for a bind address: a wildcard is reached on loopback from here."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def unix_socket_path(preferred: Path, uid: int | None = None) -> Path:
    """Where a Unix socket meant for `preferred` lives: there when the kernel can bind that path, else (a
    deep run folder on a parallel file system easily passes 107 bytes) in the owner-only folder
    /tmp/hpcserve-UID/, named by a hash of preferred's absolute path, so that every process computing it
    for the same run folder finds the same socket. Touches no file."""
    preferred = Path(os.path.abspath(preferred))
    if len(os.fsencode(preferred)) <= UNIX_PATH_MAX:
        return preferred
    digest = hashlib.sha256(os.fsencode(preferred)).hexdigest()[:24]
    return shared_socket_folder(uid) / f"{digest}.sock"


def shared_socket_folder(uid: int | None = None) -> Path:
    """/tmp/hpcserve-UID: the user's sockets whose preferred path was too long (unix_socket_path)."""
    # /tmp, not $TMPDIR: another login session (an adopting controller) must compute the same path
    base = Path("/tmp") if os.path.isdir("/tmp") else Path(tempfile.gettempdir())
    return base / f"hpcserve-{os.getuid() if uid is None else uid}"


def remove_unix_socket(path: Path) -> None:
    """A socket file at a unix_socket_path answer, gone (whatever else is at that path stays); and the shared
    folder with it once nothing else of the user's is in it (another deployment may still serve from there:
    then it stays)."""
    if path.is_socket():
        path.unlink(missing_ok=True)
    if path.parent == shared_socket_folder():
        with contextlib.suppress(OSError):
            path.parent.rmdir()
