"""A real PostgreSQL server for tests, from Debian's packages: made fresh in a folder, reachable only through a
Unix socket in that folder (no TCP port: nothing else on the machine can reach it, and no port to find free),
trust authentication, stopped and removed on exit.

    with postgres_server(tmp_path) as url:        # postgresql://postgres@/hpcserve?host=/that/folder&port=5432
        store = open_store(url)

As root the server runs as Debian's `postgres` system user (PostgreSQL refuses root). That user must be able to
reach the folder; pytest's own temporary folders are not reachable by other users (mode 0700), so as root the
server's files then go into a private folder of their own under /var/tmp instead, removed on exit as well.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import psutil
import psycopg
from psycopg import sql

from hpcserve.core.apt import install_once
from hpcserve.core.errors import CommandError, UsageError

log = logging.getLogger(__name__)

POSTGRES_LIB = Path("/usr/lib/postgresql")  # Debian's: one <version>/bin per installed major version
PACKAGES = ["postgresql"]
# The tests' installers queue here (two pytest workers): apt refuses a second apt-get while one runs.
INSTALL_LOCK = Path("/run/lock/hpcserve-test-packages.lock")
SERVER_USER = "postgres"
SUPERUSER = "postgres"  # the role initdb makes
PORT = 5432  # only names the socket file (.s.PGSQL.5432) in the server's own folder: no TCP port is opened
ROOT_FALLBACK = Path("/var/tmp")
SOCKET_PATH_MAX = 107  # sun_path, less its final NUL
TIMEOUT_S = 60

# A disposable server: durability buys nothing, and without it a test's CREATE DATABASE and commits are quick.
# Its time zone is far from UTC (+14 h), so that SQL that takes the server's zone for UTC gives other dates.
SETTINGS = {"listen_addresses": "", "port": str(PORT), "fsync": "off", "synchronous_commit": "off",
            "full_page_writes": "off", "max_connections": "200", "timezone": "Pacific/Kiritimati"}


def installed_bin() -> Path | None:
    """The bin folder of the newest PostgreSQL installed (/usr/lib/postgresql/<version>/bin), or None. Never
    what PATH finds: a pg_ctl there may be a link to a version that is gone."""
    found = []
    for initdb in POSTGRES_LIB.glob("*/bin/initdb"):
        try:
            found.append((tuple(int(part) for part in initdb.parents[1].name.split(".")), initdb.parent))
        except ValueError:
            continue
    return max(found)[1] if found else None


def ensure_installed() -> Path:
    """The bin folder of PostgreSQL's server, installed from Debian's packages (as root) when missing."""
    found = installed_bin()
    if found is not None:
        return found
    if os.geteuid() != 0:
        raise UsageError("PostgreSQL's server is not installed (/usr/lib/postgresql/*/bin/initdb), and installing "
                         "it needs root: apt-get install postgresql")
    log.info("installing PostgreSQL's Debian packages")
    install_once(PACKAGES, lambda: installed_bin() is None, INSTALL_LOCK)
    found = installed_bin()
    if found is None:
        raise UsageError(f"apt-get installed {' '.join(PACKAGES)}, but no {POSTGRES_LIB}/*/bin/initdb is there")
    return found


@contextmanager
def postgres_server(folder: Path, database: str = "hpcserve") -> Iterator[str]:
    """A running server with `database`, made in `folder` (made when missing); yields its URL (no password: trust
    on the socket). On exit the server is stopped and `folder` removed, with whatever the server wrote."""
    bindir = ensure_installed()
    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    home = folder
    try:
        home = _server_home(folder)
        data = home / "data"
        _run(bindir / "initdb", "-D", str(data), "-U", SUPERUSER, "-E", "UTF8", "--locale=C", "--auth-local=trust",
             "--auth-host=reject", "--no-sync", "--no-instructions", cwd=home)
        settings = {**SETTINGS, "unix_socket_directories": str(home)}
        with open(data / "postgresql.conf", "a") as conf:
            conf.writelines(f"{name} = '{value.replace(chr(39), chr(39) * 2)}'\n" for name, value in settings.items())
        try:
            try:
                _run(bindir / "pg_ctl", "-D", str(data), "-l", str(home / "server.log"), "-w", "-t", str(TIMEOUT_S),
                     "start", cwd=home)
                url = create_database(server_url(home, "postgres"), database)
            except BaseException:
                _log_server_log(home / "server.log")
                raise
            log.info("PostgreSQL %s runs in %s", bindir.parent.name, home)
            yield url
        finally:
            _stop(bindir, data, home)
    finally:
        if home != folder:
            shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


def server_url(socket_folder: Path, database: str) -> str:
    """The URL of a database of the server whose socket is in socket_folder (libpq reads host= as that folder)."""
    return f"postgresql://{SUPERUSER}@/{quote(database)}?host={quote(str(socket_folder), safe='/')}&port={PORT}"


def create_database(url: str, name: str) -> str:
    """Make database `name` on the server of `url` (the URL of any of its databases); the new one's URL."""
    with psycopg.connect(url, autocommit=True, connect_timeout=TIMEOUT_S) as db:
        db.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return urlunsplit(urlsplit(url)._replace(path="/" + quote(name)))


def _server_home(folder: Path) -> Path:
    """Where the server keeps its files: `folder`, or as root, when the server's user cannot reach it or the
    socket's path would be too long, a private folder of its own made for it."""
    socket_fits = len(str(folder / f".s.PGSQL.{PORT}")) <= SOCKET_PATH_MAX
    if os.geteuid() != 0:
        if not socket_fits:
            raise UsageError(f"{folder}: too long a path for PostgreSQL's socket (at most {SOCKET_PATH_MAX - 13})")
        folder.chmod(0o700)
        return folder
    user = pwd.getpwnam(SERVER_USER)
    os.chown(folder, user.pw_uid, user.pw_gid)
    folder.chmod(0o700)
    if socket_fits and _run("test", "-w", str(folder), "-a", "-x", str(folder), check=False, cwd=Path("/")) == 0:
        return folder
    home = Path(tempfile.mkdtemp(prefix="hpcserve-postgres-", dir=ROOT_FALLBACK))  # mode 0700
    os.chown(home, user.pw_uid, user.pw_gid)
    log.debug("%s: not reachable by the %s user; the server's files go into %s", folder, SERVER_USER, home)
    return home


def _run(*argv: str | Path, cwd: Path, check: bool = True) -> int:
    """Run argv as the server's user (as root) or as ourselves; its exit status. Output goes to the log; with
    check, CommandError quoting it when argv fails."""
    command = [str(part) for part in argv]
    if os.geteuid() == 0:
        command = ["runuser", "-u", SERVER_USER, "--", *command]
    env = {name: value for name, value in os.environ.items() if not name.startswith("PG")}  # PGPORT, PGDATA, ...
    try:
        done = subprocess.run(command, check=False, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S + 30)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        raise CommandError(command, None, out or "") from None
    if done.stdout.strip():
        log.debug("%s: %s", " ".join(command), done.stdout.strip())
    if check and done.returncode != 0:
        raise CommandError(command, done.returncode, done.stdout)
    return done.returncode


def _stop(bindir: Path, data: Path, home: Path) -> None:
    """Stop the server if it runs, and wait for its postmaster to be gone: pg_ctl returns once the postmaster
    removed its pid file, a moment before it exits."""
    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return  # never started, or stopped
    _run(bindir / "pg_ctl", "-D", str(data), "-m", "fast", "-w", "-t", str(TIMEOUT_S), "stop", cwd=home)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    log.warning("PostgreSQL's postmaster (PID %d) still runs %d s after pg_ctl stop", pid, TIMEOUT_S)


def _log_server_log(path: Path) -> None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return
    if text.strip():
        log.error("PostgreSQL's log (%s), last lines:\n%s", path, "\n".join(text.splitlines()[-40:]))
