"""Self-service keys on real Unix users: the kernel's peer credentials, not anything a client says, decide
whose key it is, and each end refuses an impostor at the other.

The tests that need other users run as root (CI): they make two users, hpcs-alice and hpcs-bob (no home,
no login shell, marked by their comment), idempotently, and keep them: another pytest process (or xdist
worker) may be using them at the same moment, so removing them at the end could break its tests. The
server runs in the test process as root, who is the deployment's "owner" here; the clients run as the
users, through runuser, each in a process of its own.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from hpcserve.core.config import LimitsSpec, SelfServiceSpec
from hpcserve.core.errors import UnsafePathError, UsageError
from hpcserve.slurm.client import SlurmClient, parse_default_account
from hpcserve.tenancy.records import KeySource, Limits, matches, new_key, split_key
from hpcserve.tenancy.selfservice import (
    KeyGrant,
    SelfServiceError,
    SelfServiceRefused,
    SelfServiceServer,
    limits_of,
    prepare_socket_dir,
    request_key,
    socket_dir,
    socket_path,
)
from hpcserve.tenancy.store import open_store
from unix_users import ALICE, BOB, make_users
from unix_users import python_for_users as user_python

BASE_LIMITS = Limits(max_n=16, max_best_of=16)
ACCOUNTS = {ALICE: "physics"}  # bob has no account: a key without a project

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: makes Unix users and runs clients as them")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def users() -> None:
    make_users()


@pytest.fixture(scope="module")
def python_for_users(users) -> list[str]:
    return user_python()


@pytest.fixture
def base() -> Path:
    """A socket base folder of the test's own (not /tmp itself: a real endpoint of root's may use
    /tmp/hpcserve-keys-0 on this host), mode 1777 like /tmp: any user may make a folder in it first."""
    folder = Path(tempfile.mkdtemp(prefix="hpcs-ss-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def db(base) -> Path:
    """The store's file, in a folder the store makes itself (as the endpoint's RESULTS_DIR would be)."""
    return base / "results" / "t.sqlite"


def spec(**overrides) -> SelfServiceSpec:
    fields = {"allow": True, "users": [ALICE, BOB], "limits": LimitsSpec(requests_per_minute=30),
              "expires_days": 7.0}
    return SelfServiceSpec(**{**fields, **overrides})


def server(db: Path, base: Path, name: str = "demo", **spec_overrides) -> SelfServiceServer:
    return SelfServiceServer(lambda: open_store(db), spec(**spec_overrides), name, BASE_LIMITS, ACCOUNTS.get,
                             url="http://login1:8000", base=base)


def as_user(python: list[str], user: str, code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run Python code as user (a process of theirs: the kernel's credentials are theirs)."""
    argv = [*python, textwrap.dedent(code)]
    return subprocess.run(["runuser", "-u", user, "--", *argv], check=False, capture_output=True, text=True,
                          timeout=timeout, cwd="/")


ASK = """
import json, dataclasses
from pathlib import Path
from hpcserve.tenancy.selfservice import request_key
try:
    grant = request_key({owner!r}, {name!r}, base=Path({base!r}))
    print(json.dumps({{"grant": dataclasses.asdict(grant)}}))
except Exception as exc:
    print(json.dumps({{"error": type(exc).__name__, "message": str(exc)}}))
"""


def ask_as(python: list[str], user: str, base: Path, name: str = "demo", owner: str = "root") -> dict:
    done = as_user(python, user, ASK.format(owner=owner, name=name, base=str(base)))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- as real users


def test_each_user_gets_a_key_bound_to_their_own_name(python_for_users, base, db, caplog):
    caplog.set_level(logging.INFO, logger="hpcserve.tenancy.selfservice")
    before = time.time()
    with server(db, base):
        alice = ask_as(python_for_users, ALICE, base)["grant"]
        bob = ask_as(python_for_users, BOB, base)["grant"]
    assert (alice["user"], alice["project"]) == (ALICE, "physics")
    assert (bob["user"], bob["project"]) == (BOB, None)
    assert alice["key"] != bob["key"] and alice["key_id"] != bob["key_id"]
    assert alice["expires_at"] == pytest.approx(before + 7 * 86400, abs=60)
    assert alice["limits"] == {"requests_per_minute": 30, "max_n": 16, "max_best_of": 16}
    assert alice["url"] == "http://login1:8000"
    store = open_store(db)
    try:
        records = {r.key_id: r for r in store.keys()}
    finally:
        store.close()
    for grant, user in ((alice, ALICE), (bob, BOB)):
        record = records[grant["key_id"]]
        assert (record.user, record.source) == (user, KeySource.SELF_SERVICE)
        key_id, secret = split_key(grant["key"].encode())
        assert key_id == record.key_id and matches(record, secret)  # the key handed out is the one stored
    assert records[alice["key_id"]].project == "physics" and records[bob["key_id"]].project is None
    assert records[alice["key_id"]].limits == Limits(requests_per_minute=30, max_n=16, max_best_of=16)
    logged = caplog.text
    assert alice["key_id"] in logged and ALICE in logged and "physics" in logged
    assert alice["key"] not in logged and bob["key"] not in logged
    assert alice["key"].rsplit("_", 1)[1] not in logged  # not even the secret part


def test_a_second_request_revokes_the_users_earlier_key_only(python_for_users, base, db):
    with server(db, base):
        bob = ask_as(python_for_users, BOB, base)["grant"]
        first = ask_as(python_for_users, ALICE, base)["grant"]
        second = ask_as(python_for_users, ALICE, base)["grant"]
    assert second["key_id"] != first["key_id"]
    assert second["replaced"] == [first["key_id"]]
    store = open_store(db)
    try:
        records = {r.key_id: r for r in store.keys()}
    finally:
        store.close()
    now = time.time()
    assert not records[first["key_id"]].usable(now)
    assert records[second["key_id"]].usable(now)
    assert records[bob["key_id"]].usable(now)


def test_the_store_is_the_owners_alone(python_for_users, base, db):
    with server(db, base):
        assert "grant" in ask_as(python_for_users, ALICE, base)
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
    files = [p for p in db.parent.iterdir() if p.name.startswith(db.name)]  # the file, -wal, -shm
    assert db in files
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    tries = """
    import json, os
    said = {{}}
    for what, call in (("list", lambda: os.listdir({folder!r})), ("read", lambda: open({file!r}, "rb").read(1))):
        try:
            call()
            said[what] = "allowed"
        except PermissionError:
            said[what] = "denied"
    print(json.dumps(said))
    """
    done = as_user(python_for_users, ALICE, tries.format(folder=str(db.parent), file=str(db)))
    assert json.loads(done.stdout) == {"list": "denied", "read": "denied"}, done.stderr
    db.parent.chmod(0o711)  # the folder open to passers-by: the file's own mode still keeps them out
    done = as_user(python_for_users, ALICE, tries.format(folder=str(db.parent), file=str(db)))
    assert json.loads(done.stdout)["read"] == "denied", done.stderr


def test_a_user_the_allowlist_does_not_name_is_refused(python_for_users, base, db):
    with server(db, base, users=[ALICE]):
        said = ask_as(python_for_users, BOB, base)
        assert "grant" in ask_as(python_for_users, ALICE, base)
    assert said["error"] == SelfServiceRefused.__name__
    assert BOB in said["message"] and "tenancy.self_service.users" in said["message"]
    assert "root" in said["message"]  # whom to ask
    store = open_store(db)
    try:
        assert [r.user for r in store.keys()] == [ALICE]
    finally:
        store.close()


def test_a_socket_folder_another_user_made_first_stops_the_server(python_for_users, base, db):
    planted = socket_dir(0, base)
    done = as_user(python_for_users, ALICE, f"import os; os.mkdir({str(planted)!r}, 0o755)")
    assert done.returncode == 0, done.stderr
    srv = server(db, base)
    with pytest.raises(UnsafePathError, match=f"belongs to {ALICE}"):
        srv.start()
    assert list(planted.iterdir()) == []  # nothing bound in it
    assert not db.exists()  # nor any store opened


HOSTILE_SERVER = """
import os, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.bind({path!r})
os.chmod({path!r}, 0o666)
sock.listen(1)
print("ready", flush=True)
conn, _ = sock.accept()
conn.settimeout(2)
got = b""
try:
    while True:
        chunk = conn.recv(4096)
        if not chunk:
            break
        got += chunk
except OSError:
    pass
print(len(got), flush=True)
"""


def test_the_client_refuses_a_server_that_is_not_the_owner(python_for_users, base):
    """The owner's endpoint is down; alice made the owner's socket folder and listens there. A user asking
    the owner's deployment must notice that the kernel says alice, not the owner, and send nothing."""
    planted = socket_dir(0, base)
    path = socket_path(0, "demo", base)
    assert as_user(python_for_users, ALICE, f"import os; os.mkdir({str(planted)!r}, 0o755)").returncode == 0
    argv = [*python_for_users, textwrap.dedent(HOSTILE_SERVER.format(path=str(path)))]
    hostile = subprocess.Popen(["runuser", "-u", ALICE, "--", *argv], stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert hostile.stdout.readline().strip() == "ready"
        with pytest.raises(SelfServiceError, match=f"served by {ALICE}") as raised:
            request_key("root", "demo", timeout_s=5, base=base)
        assert "posing" in str(raised.value) and "nothing was sent" in str(raised.value)
        out, _ = hostile.communicate(timeout=10)
    finally:
        hostile.kill()
        hostile.wait()
    assert out.strip() == "0"  # the impostor got not one byte


# ---------------------------------------------------------------- the socket, as whoever runs the tests


def test_socket_folder_and_socket_modes_and_close_leaves_nothing(base, db):
    uid = os.geteuid()
    with server(db, base) as srv:
        folder = srv.path.parent
        assert srv.path == socket_path(uid, "demo", base) == base / f"hpcserve-keys-{uid}" / "demo.sock"
        st = os.lstat(folder)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o755
        st = os.lstat(srv.path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666
        with server(db, base, name="other") as other:  # a second deployment of the same owner
            assert other.path.parent == folder
        assert folder.exists()  # demo's socket is still there
    assert not srv.path.exists() and not folder.exists()


def test_default_socket_path_is_per_owner_in_tmp():
    assert socket_path(1234, "demo") == Path("/tmp/hpcserve-keys-1234/demo.sock")


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "x" * 120])
def test_a_name_that_could_leave_the_folder_is_refused(name):
    with pytest.raises(UsageError):
        socket_path(1000, name)


def folder_made_writable(folder: Path) -> None:
    folder.mkdir()
    folder.chmod(0o777)


def folder_made_group_writable(folder: Path) -> None:
    folder.mkdir()
    folder.chmod(0o775)


def folder_made_a_link(folder: Path) -> None:
    target = folder.with_name("elsewhere")
    target.mkdir(mode=0o755)
    folder.symlink_to(target)


def folder_made_a_file(folder: Path) -> None:
    folder.write_text("")


@pytest.mark.parametrize("plant, problem", [(folder_made_writable, "can be written by others"),
                                            (folder_made_group_writable, "can be written by others"),
                                            (folder_made_a_link, "symbolic link"),
                                            (folder_made_a_file, "not a folder")])
def test_an_unsafe_socket_folder_is_refused(base, db, plant, problem):
    plant(socket_dir(os.geteuid(), base))
    with pytest.raises(UnsafePathError, match=problem):
        server(db, base).start()


def test_an_existing_folder_of_ours_is_used(base):
    folder = socket_dir(os.geteuid(), base)
    folder.mkdir(mode=0o700)
    prepare_socket_dir(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755  # others must be able to reach the socket


def test_a_leftover_socket_is_replaced_and_a_live_one_is_not(base, db):
    path = socket_path(os.geteuid(), "demo", base)
    path.parent.mkdir(mode=0o755)
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(path))
    leftover.close()  # a controller that died: the file stays, nobody listens
    with server(db, base, users=None):
        with pytest.raises(UsageError, match="served already"):
            server(db, base).start()
        assert request_key(pwd.getpwuid(os.geteuid()).pw_name, "demo", base=base).key.startswith("hps_")


def test_self_service_off_serves_nothing(base, db):
    with pytest.raises(UsageError, match="allow is false"):
        server(db, base, allow=False).start()
    assert not socket_dir(os.geteuid(), base).exists()


def test_no_socket_says_what_to_check(base):
    with pytest.raises(SelfServiceError, match="tenancy.self_service.allow: true") as raised:
        request_key("root", "nothing-here", timeout_s=2, base=base)
    assert isinstance(raised.value, UsageError)


def test_an_unknown_owner_is_named(base):
    with pytest.raises(SelfServiceError, match="no user 'no-such-owner-hpcs'"):
        request_key("no-such-owner-hpcs", "demo", base=base)


def raw_exchange(path: Path, payload: bytes, timeout: float = 10) -> bytes:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        sock.sendall(payload)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    finally:
        sock.close()


def test_garbage_and_silence_get_nothing_and_do_not_stop_the_server(base, db):
    me = pwd.getpwuid(os.geteuid()).pw_name
    with server(db, base, users=None) as srv:
        answer = json.loads(raw_exchange(srv.path, b"hello\n"))
        assert answer["ok"] is False and "keys request demo" in answer["error"]
        try:  # too long: dropped without an answer
            assert raw_exchange(srv.path, b"x" * 10000) == b""
        except ConnectionResetError:
            pass  # dropped with bytes unread: the kernel resets the connection
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.connect(str(srv.path))  # holds a connection and says nothing
        try:
            started = time.monotonic()
            grant = request_key(me, "demo", timeout_s=10, base=base)
            assert time.monotonic() - started < 3  # not queued behind the silent one
        finally:
            silent.close()
    assert grant.user == me
    store = open_store(db)
    try:
        assert [r.key_id for r in store.keys()] == [grant.key_id]
    finally:
        store.close()


# ---------------------------------------------------------------- the grant's logic, without a socket


def test_grant_takes_limits_lifetime_and_project_from_the_spec(base, db):
    srv = SelfServiceServer(lambda: open_store(db), spec(users=None, expires_days=None,
                                                         limits=LimitsSpec(max_n=2, tokens_per_day=1000)),
                            "demo", BASE_LIMITS, lambda user: "chem", base=base, clock=lambda: 1000.0)
    answer = srv.grant(os.geteuid())
    assert answer["ok"] and answer["project"] == "chem" and answer["expires_at"] is None
    assert answer["limits"] == {"tokens_per_day": 1000, "max_n": 2, "max_best_of": 16}


def test_a_grant_never_shows_its_key_in_repr():
    grant = KeyGrant(key="hps_0123456789abcdef_secret", key_id="0123456789abcdef", user="u", project=None,
                     expires_at=None, deployment="demo", owner="root")
    assert "secret" not in repr(grant) and "0123456789abcdef" in repr(grant)


def test_a_failing_account_lookup_still_gives_a_key_without_project(base, db):
    def broken(user: str) -> str | None:
        raise RuntimeError("slurmdbd is down")

    srv = SelfServiceServer(lambda: open_store(db), spec(users=None), "demo", BASE_LIMITS, broken, base=base)
    answer = srv.grant(os.geteuid())
    assert answer["ok"] and answer["project"] is None


def test_project_from_slurm_off_does_not_ask_slurm(base, db):
    asked = []
    srv = SelfServiceServer(lambda: open_store(db), spec(users=None, project_from_slurm=False), "demo",
                            BASE_LIMITS, lambda user: asked.append(user) or "physics", base=base)
    assert srv.grant(os.geteuid())["project"] is None and asked == []


def test_a_store_that_fails_is_a_refusal_that_names_no_secret(base, caplog):
    def broken_store():
        raise OSError("disk full")

    srv = SelfServiceServer(broken_store, spec(users=None), "demo", BASE_LIMITS, base=base)
    answer = srv.grant(os.geteuid())
    assert answer == {"ok": False, "error": answer["error"]} and "endpoint's log" in answer["error"]
    assert "disk full" in caplog.text


def test_admin_keys_of_the_user_are_not_revoked(base, db):
    me = pwd.getpwuid(os.geteuid()).pw_name
    store = open_store(db)
    _, admin = new_key(me)  # `hpcserve keys add` by the owner: not the self-service's to revoke
    store.add_key(admin)
    store.close()
    srv = SelfServiceServer(lambda: open_store(db), spec(users=None), "demo", BASE_LIMITS, base=base)
    first = srv.grant(os.geteuid())
    second = srv.grant(os.geteuid())
    assert second["replaced"] == [first["key_id"]]
    store = open_store(db)
    try:
        assert next(r for r in store.keys() if r.key_id == admin.key_id).revoked_at is None
    finally:
        store.close()


def test_limits_of_covers_every_limit():
    every = LimitsSpec(requests_per_minute=1, tokens_per_minute=2, tokens_per_day=3, max_n=4, max_best_of=5,
                       max_tokens=6)
    assert limits_of(every) == Limits(1, 2, 3, 4, 5, 6)


# ---------------------------------------------------------------- the default Slurm account


@pytest.mark.parametrize("stdout, account", [("physics\n", "physics"), ("physics|\n", "physics"),
                                             ("", None), ("\n\n", None), ("  chem  \n", "chem")])
def test_parse_default_account(stdout, account):
    assert parse_default_account(stdout) == account


def answering(*replies):
    calls = []

    def runner(argv, timeout):
        calls.append((argv, timeout))
        reply = replies[len(calls) - 1]
        if isinstance(reply, BaseException):
            raise reply
        return reply

    return runner, calls


def completed(stdout: str = "", stderr: str = "", returncode: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess([], returncode, stdout, stderr)


def test_default_account_asks_sacctmgr_for_the_user():
    runner, calls = answering(completed("physics\n"))
    assert SlurmClient(runner=runner).default_account("alice") == "physics"
    assert calls == [(["sacctmgr", "-nP", "show", "user", "alice", "format=defaultaccount"], 5.0)]


# What sacctmgr said on a cluster without slurmdbd (AccountingStorageType=accounting_storage/none, as the
# project's Slurm sandbox runs), and without any Slurm configuration.
NO_SLURMDBD = completed("You are not running a supported accounting_storage plugin\n"
                        "Only 'accounting_storage/slurmdbd' is supported.\n", returncode=1)
NO_CONFIG = completed(stderr="sacctmgr: fatal: Could not establish a configuration source\n", returncode=1)


@pytest.mark.parametrize("reply", [NO_SLURMDBD, NO_CONFIG, completed(""),
                                   FileNotFoundError(2, "No such file or directory: 'sacctmgr'"),
                                   subprocess.TimeoutExpired(["sacctmgr"], 5.0)])
def test_default_account_is_none_when_accounting_cannot_say(reply):
    runner, calls = answering(reply)
    assert SlurmClient(runner=runner).default_account("alice") is None
    assert len(calls) == 1


@pytest.mark.parametrize("user", ["-n", "a b", "", "x;y"])
def test_default_account_never_passes_a_strange_name(user):
    runner, calls = answering()
    assert SlurmClient(runner=runner).default_account(user) is None and calls == []


def test_default_account_without_sacctmgr_on_path(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert SlurmClient().default_account("root") is None
