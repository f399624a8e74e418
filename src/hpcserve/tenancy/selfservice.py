"""Keys without an administrator, the HPC way: a user logged in on the host where the endpoint's controller
runs gets a key of their own with one command, identified by the operating system, as munge identifies them.

The controller (running as the deployment's owner) listens on a Unix socket any local user may connect to.
The kernel tells it who connected (SO_PEERCRED: the client's uid at connect time, which the client cannot
forge), so no password, token or administrator is involved: the key is bound to that Unix name and, where
Slurm's accounting knows it, to the user's default account as the project. The owner's config
(tenancy.self_service) decides whether that is allowed, for whom, with which limits and for how long.

Both ends check the other: the server refuses a socket folder it does not own alone (another user could
have made it first and would then control what sits in it), and the client refuses a socket whose server is
not the owner (a user who made the folder first could otherwise hand out fake keys or collect requests).

The wire is one JSON line in, one JSON line out, small and bounded, with a deadline per connection. The
whole key crosses it once; only its hash is stored, and the log names the user, key id and project only.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from hpcserve.core.errors import UnsafePathError, UsageError
from hpcserve.tenancy.records import KeyRecord, KeySource, Limits, new_key
from hpcserve.tenancy.settings import limits_of
from hpcserve.tenancy.store import Store

if TYPE_CHECKING:
    from hpcserve.core.config import SelfServiceSpec

log = logging.getLogger(__name__)

SOCKET_BASE = Path("/tmp")  # local to the login node, where users and the controller meet
DIR_MODE = 0o755  # others may enter it to connect, never write into it
SOCKET_MODE = 0o666  # any local user may connect: that is the point
MAX_REQUEST_BYTES = 4096  # a request is a few dozen bytes; anything longer is not a client of ours
MAX_ANSWER_BYTES = 65536
CONNECTION_TIMEOUT_S = 5.0  # a client that connects and stays silent holds a slot this long at most
MAX_CONNECTIONS = 8  # connections served at once; more are answered "busy" at once
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, the last a NUL
PROTOCOL = 1
REQUEST_OP = "request-key"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

DefaultAccount = Callable[[str], "str | None"]


class SelfServiceError(UsageError):
    """No self-service key could be had: the socket is missing, not the owner's, or did not answer."""


class SelfServiceRefused(SelfServiceError):
    """The endpoint answered, and said no (the user is not allowed, or it could not store the key)."""


@dataclass(frozen=True)
class KeyGrant:
    """What a user got: the whole key (shown once, never again) and what it is bound to."""

    key: str = field(repr=False)  # kept out of repr so that logging a grant cannot leak the key
    key_id: str
    user: str
    project: str | None
    expires_at: float | None  # epoch seconds; None: no end
    deployment: str
    owner: str
    limits: dict[str, int] = field(default_factory=dict)  # only the limits that are set
    replaced: tuple[str, ...] = ()  # ids of the user's earlier self-service keys, revoked by this one
    url: str | None = None  # the endpoint's address, when the server knows it


# ---------------------------------------------------------------- where the socket lives


def socket_dir(owner_uid: int, base: Path = SOCKET_BASE) -> Path:
    """The folder of an owner's self-service sockets: one per owner, shared by their deployments, so that a
    user finds a deployment's socket from the owner's name and the deployment's name alone."""
    return Path(base) / f"hpcserve-keys-{owner_uid}"


def socket_path(owner_uid: int, name: str, base: Path = SOCKET_BASE) -> Path:
    """The socket of deployment `name` of the owner with `owner_uid`. The name becomes a file name: one that
    could leave the folder (a '/', a leading '.') or overflow a socket address is refused."""
    if not name or "/" in name or "\0" in name or name.startswith("."):
        raise UsageError(f"{name!r} is not a deployment name: use the name of the owner's deployment "
                         "(`hpcserve status` as the owner lists them)")
    path = socket_dir(owner_uid, base) / f"{name}.sock"
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise UsageError(f"the socket path {path} is longer than a Unix socket address may be "
                         f"({UNIX_PATH_MAX} bytes): use a shorter deployment name")
    return path


def socket_dir_problem(st: os.stat_result, uid: int) -> str | None:
    """Why an existing socket folder (lstat) must not be used by the server running as uid, or None. Pure.

    Whoever owns or can write into the folder can replace the socket with their own, and then answer the
    users who come for keys."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link, not a folder"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != uid:
        return f"belongs to {describe_uid(st.st_uid)}, not to you (uid {uid}): another user made it"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"can be written by others (mode {oct(st.st_mode & 0o7777)})"
    return None


def prepare_socket_dir(folder: Path) -> Path:
    """The socket folder, made (0755, ours) when missing; an existing one is used only when it is ours alone.
    Raises UnsafePathError otherwise, before anything listens."""
    made = True
    try:
        os.mkdir(folder, DIR_MODE)
    except FileExistsError:
        made = False
    problem = socket_dir_problem(os.lstat(folder), os.geteuid())
    if problem:
        raise UnsafePathError(f"the self-service socket folder {folder} {problem}: hpcserve will not serve keys "
                              "from it, since whoever controls it could answer the users who ask. Remove it (as "
                              "its owner, or root) and start the endpoint again")
    if made or stat.S_IMODE(os.lstat(folder).st_mode) != DIR_MODE:
        os.chmod(folder, DIR_MODE)  # the umask may have taken away the bits that let others connect
    return folder


# ---------------------------------------------------------------- who is on the other end


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, from the kernel: what it
    was when that process called connect() (or listen()), not something it says about itself."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def user_name(uid: int) -> str | None:
    """The Unix name of uid, None when the user database has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def describe_uid(uid: int) -> str:
    name = user_name(uid)
    return f"{name} (uid {uid})" if name else f"uid {uid}"


def limits_dict(limits: Limits) -> dict[str, int]:
    """The limits that are set, by name (what a user is told). Pure."""
    return {k: v for k, v in limits.__dict__.items() if v is not None}


def may_ask(user: str, allowed: list[str] | None) -> bool:
    """Whether tenancy.self_service.users lets this Unix name ask (None: every user of the host). Pure."""
    return allowed is None or user in allowed


# ---------------------------------------------------------------- the server


class SelfServiceServer:
    """The controller's side: a socket in a thread of its own that hands each allowed local user a key.

    store: a store, or a function that opens one (then opened per grant, on the server's thread, and
    closed after: grants are rare, and a store object is then never shared between threads). Grants are
    serialized, so a user's earlier keys are revoked exactly once even if they ask twice at once.
    base_limits: tenancy.limits; spec.limits are laid over them one by one.
    default_account: the user's default Slurm account or None (SlurmClient.default_account); asked only
    when spec.project_from_slurm. url: the endpoint's address, told to the user with the key.
    """

    def __init__(self, store: Store | Callable[[], Store], spec: SelfServiceSpec, deployment: str,
                 base_limits: Limits, default_account: DefaultAccount | None = None, *, url: str | None = None,
                 base: Path = SOCKET_BASE, clock: Callable[[], float] = time.time):
        self._store = store
        self._spec = spec
        self.deployment = deployment
        self._limits = base_limits.merged(limits_of(spec.limits))
        self._default_account = default_account
        self._url = url
        self._clock = clock
        self.owner_uid = os.geteuid()
        self.owner = user_name(self.owner_uid) or str(self.owner_uid)
        self.path = socket_path(self.owner_uid, deployment, base)
        self._grant_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we made
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Path:
        """Listen, and serve on a daemon thread; returns the socket's path. Raises UnsafePathError for a
        folder that is not ours alone, UsageError when self-service is off or another server has the path."""
        if not self._spec.allow:
            raise UsageError("tenancy.self_service.allow is false: the endpoint serves no self-service keys")
        if self._thread is not None:
            return self.path
        prepare_socket_dir(self.path.parent)
        self._clear_stale_socket()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, SOCKET_MODE)
            st = os.lstat(self.path)
            self._bound = (st.st_dev, st.st_ino)
            listener.listen(16)
            listener.settimeout(0.5)  # the loop looks at the stop flag this often
        except BaseException:
            listener.close()
            self._remove_socket()
            raise
        self._listener = listener
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name=f"hpcserve-keys-{self.deployment}", daemon=True)
        self._thread.start()
        log.info("self-service keys for deployment %s served on %s (users: %s)", self.deployment, self.path,
                 "every local user" if self._spec.users is None else ", ".join(self._spec.users) or "none")
        return self.path

    def close(self) -> None:
        """Stop serving, and leave nothing in /tmp: the socket goes, and its folder if no other deployment of
        the owner still has a socket there."""
        self._stop.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() at once on Linux
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if listener is not None:
            listener.close()
        self._remove_socket()
        try:
            os.rmdir(self.path.parent)
        except OSError:
            pass  # not empty (another deployment's socket), or gone already

    # ------------------------------------------------------------ granting

    def grant(self, uid: int) -> dict[str, Any]:
        """The answer for a user with this uid: a new key (their earlier self-service keys revoked), or a
        refusal saying why and what to do. Also the logic the socket serves, callable without one."""
        user = user_name(uid)
        if user is None:
            return _refusal(f"uid {uid} has no name in this host's user database: a key is bound to a Unix name")
        if not may_ask(user, self._spec.users):
            return _refusal(f"user {user} may not ask for keys of deployment {self.deployment}: "
                            f"tenancy.self_service.users does not name them. Ask the deployment's owner "
                            f"({self.owner}) to add {user} there, or for a key (`hpcserve keys add`)")
        project = self._project(user)
        now = self._clock()
        days = self._spec.expires_days
        expires_at = None if days is None else now + days * 86400.0
        key, record = new_key(user, project=project, limits=self._limits, source=KeySource.SELF_SERVICE,
                              expires_at=expires_at, now=now)
        try:
            with self._grant_lock:
                replaced = self._with_store(lambda store: self._store_key(store, record, now))
        except Exception:
            log.exception("self-service key for user %s of deployment %s could not be stored", user, self.deployment)
            return _refusal(f"the endpoint could not store a key: its owner ({self.owner}) finds why in the "
                            "endpoint's log")
        log.info("self-service key %s for user %s (project %s) of deployment %s%s", record.key_id, user,
                 project or "-", self.deployment, f"; revoked their earlier {', '.join(replaced)}" if replaced else "")
        return {"ok": True, "key": key, "key_id": record.key_id, "user": user, "project": project,
                "expires_at": expires_at, "deployment": self.deployment, "owner": self.owner,
                "limits": limits_dict(record.limits), "replaced": replaced, "url": self._url}

    def _project(self, user: str) -> str | None:
        if not self._spec.project_from_slurm or self._default_account is None:
            return None
        try:
            return self._default_account(user) or None
        except Exception:  # accounting is a nicety here: a key without a project is still a key
            log.warning("no default Slurm account for %s: the lookup failed", user, exc_info=True)
            return None

    @staticmethod
    def _store_key(store: Store, record: KeyRecord, now: float) -> list[str]:
        """Store the new key, then revoke the user's other live self-service keys (a user who lost their key
        asks again; the old one must stop working). The new key goes in first, so that a failure between
        the two leaves the user with a key rather than none."""
        earlier = [r.key_id for r in store.keys()  # noqa: SIM118 - a Store, not a dict
                   if r.user == record.user and r.source == KeySource.SELF_SERVICE
                   and r.revoked_at is None and r.key_id != record.key_id]
        store.add_key(record)
        return [key_id for key_id in earlier if store.revoke(key_id, now)]

    def _with_store(self, work: Callable[[Store], list[str]]) -> list[str]:
        if hasattr(self._store, "add_key"):
            return work(self._store)  # type: ignore[arg-type]
        store = self._store()  # type: ignore[operator]
        try:
            return work(store)
        finally:
            store.close()

    # ------------------------------------------------------------ the socket

    def _serve(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    break
                log.warning("self-service socket %s: accept failed", self.path, exc_info=True)
                time.sleep(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                try:
                    conn.settimeout(1.0)
                    _send(conn, _refusal("the endpoint is busy answering other requests: ask again in a few "
                                         "seconds"))
                except OSError:
                    pass  # it left already
                finally:
                    conn.close()
                continue
            threading.Thread(target=self._handle, args=(conn,), name="hpcserve-keys-conn", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(CONNECTION_TIMEOUT_S)
            pid, uid, _gid = peer_credentials(conn)
            request = _read_line(conn, MAX_REQUEST_BYTES, time.monotonic() + CONNECTION_TIMEOUT_S)
            try:
                message = json.loads(request)
            except ValueError:
                message = None
            if not isinstance(message, dict) or message.get("op") != REQUEST_OP:
                log.warning("self-service socket %s: a malformed request from uid %d (pid %d)", self.path, uid, pid)
                answer = _refusal(f"not a request this endpoint understands: use `hpcserve keys request "
                                  f"{self.deployment} --owner {self.owner}`")
            else:
                answer = self.grant(uid)
            _send(conn, answer)
        except (OSError, ValueError) as exc:
            log.info("self-service socket %s: a connection ended early: %s", self.path, exc)
        finally:
            conn.close()
            self._slots.release()

    def _clear_stale_socket(self) -> None:
        """A socket left by a controller that died is removed; one that still answers is another server's."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise UnsafePathError(f"{self.path} exists and is not a socket: remove it and start the endpoint again")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except OSError:
            os.unlink(self.path)  # nobody listens: a leftover
            return
        finally:
            probe.close()
        raise UsageError(f"{self.path} is served already: another endpoint of deployment {self.deployment} "
                         "runs on this host (`hpcserve status`)")

    def _remove_socket(self) -> None:
        """Remove the socket only if it is still the one this server made."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if self._bound is not None and (st.st_dev, st.st_ino) == self._bound:
            os.unlink(self.path)
        self._bound = None


# ---------------------------------------------------------------- the client


def request_key(owner: str, name: str, timeout_s: float = 10.0, *, base: Path = SOCKET_BASE) -> KeyGrant:
    """Ask deployment `name` of Unix user `owner` on this host for a key of one's own. The caller is
    identified by the kernel, so there is nothing to pass. Raises SelfServiceError (a UsageError) saying what
    is wrong, SelfServiceRefused when the endpoint said no."""
    try:
        owner_uid = pwd.getpwnam(owner).pw_uid
    except KeyError:
        raise SelfServiceError(f"there is no user {owner!r} on this host: --owner is the Unix name of the user "
                               "who runs the deployment") from None
    path = socket_path(owner_uid, name, base)
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, NotADirectoryError):
            raise SelfServiceError(f"deployment {name} of {owner} serves no self-service keys on this host ({path} "
                                   f"does not exist). Is the endpoint up (`hpcserve status {name}`, as {owner}), "
                                   "with tenancy.self_service.allow: true, and are you on the host where its "
                                   "controller runs?") from None
        except ConnectionRefusedError:
            raise SelfServiceError(f"nothing answers on {path}: the endpoint of deployment {name} of {owner} is not "
                                   "running (its socket was left behind). Ask its owner to start it") from None
        except PermissionError as exc:
            raise SelfServiceError(f"cannot connect to {path}: {exc.strerror}. The socket should be open to every "
                                   f"local user: ask {owner} to check it") from None
        except TimeoutError:
            raise SelfServiceError(f"{path} did not accept the connection within {timeout_s:g} s: the endpoint is "
                                   "overloaded or stuck; ask again later") from None
        _pid, server_uid, _gid = peer_credentials(sock)
        if server_uid != owner_uid:
            raise SelfServiceError(f"the socket {path} is served by {describe_uid(server_uid)}, not "
                                   f"by {owner} (uid {owner_uid}): refusing to talk to it, since another user may be "
                                   f"posing as the endpoint. Tell {owner} (or the admins); nothing was sent")
        try:
            _send(sock, {"op": REQUEST_OP, "version": PROTOCOL})
            line = _read_line(sock, MAX_ANSWER_BYTES, deadline)
        except TimeoutError:
            raise SelfServiceError(f"the endpoint of deployment {name} gave no answer within {timeout_s:g} s: ask "
                                   "again later") from None
        except (OSError, ValueError) as exc:
            raise SelfServiceError(f"the endpoint of deployment {name} broke off its answer: {exc}") from None
    finally:
        sock.close()
    try:
        answer = json.loads(line)
    except ValueError:
        raise SelfServiceError(f"the endpoint of deployment {name} answered something that is not JSON") from None
    if not isinstance(answer, dict):
        raise SelfServiceError(f"the endpoint of deployment {name} answered something unexpected")
    if not answer.get("ok"):
        raise SelfServiceRefused(f"deployment {name} of {owner} refused: {answer.get('error') or 'no reason given'}")
    try:
        return KeyGrant(key=str(answer["key"]), key_id=str(answer["key_id"]), user=str(answer["user"]),
                        project=answer.get("project"), expires_at=answer.get("expires_at"), deployment=name,
                        owner=owner, limits=dict(answer.get("limits") or {}),
                        replaced=tuple(answer.get("replaced") or ()), url=answer.get("url"))
    except KeyError as exc:
        raise SelfServiceError(f"the endpoint of deployment {name} answered without {exc}") from None


# ---------------------------------------------------------------- the wire


def _refusal(reason: str) -> dict[str, Any]:
    return {"ok": False, "error": reason}


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _read_line(sock: socket.socket, limit: int, deadline: float) -> str:
    """One line (without its newline) of at most `limit` bytes, before `deadline` (monotonic). A line cut off
    by the other end closing is taken as it is; one too long, or too slow, is an error."""
    data = bytearray()
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no complete line in time")
        sock.settimeout(remaining)
        chunk = sock.recv(min(4096, limit + 1 - len(data)))
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise ValueError(f"a line longer than {limit} bytes")
    return bytes(data).split(b"\n", 1)[0].decode("utf-8", errors="strict")
