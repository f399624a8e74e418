"""A hostile second user of the cluster gets nothing.

On a real cluster every other user of the login node and of the compute nodes can list processes, connect
to any port and read world-readable files. Here a second Unix user (made with useradd, removed afterwards,
no privileges) attacks one deployment with the defaults a user starts from (Slurm, the router on, no
serve.api_key_env): before `up`, it plants folders and links under the names Ray's temp folders had and
tries the run folder's and the registry's names; then, from the login node and from the replica's compute
node, it calls every vLLM route of the replica with no key and a wrong one, the router, the data plane's
admin routes on the router's port (dataplane/admin.py's table: each must get the router's JSON 401; they are
served on the owner-only admin socket alone), the router's other ports and sockets, the monitor, reads and
plants files in the run folder and HPCSERVE_HOME, connects to Ray's sockets, GETs / and /metrics on every
port that listens on the node (Ray's Prometheus pages answered there), and reads every process's
command line and environment. Every attempt must fail (a route of the engines, the router or the monitor:
refused with 401 or 403, a timeout or a reset being no refusal; a Unix socket: its connect refused), the
deployment keeps serving its owner with the backends it had, and none of its folders, Ray's on the node
included, is open to others. After `down` no copy of the key is left.

The attempts run as that user in tests/cluster/hostile_attempts.py (the system's python3, standard library
only).
HPCSERVE_HOSTILE_REPORT=FILE writes the table of attempts (docs/security.md's is from it).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import run_cli, write_config
from test_distributed_serving import status_of
from test_slurm_ray import squeue_empty

from hpcserve.core.paths import RunPaths
from hpcserve.core.runstate import RunState
from hpcserve.engine.kv_events import RELAY_PATH

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]
HERE = Path(__file__).parent
NAME = "sb-hostile"
SECRET_NAMES = ("api_key", ".router_key", "ray_auth_token")


@dataclass
class Row:
    """One attempt and what it got."""

    attack: str
    got: str
    ok: bool


@dataclass
class Target:
    """What the owner knows of the running deployment (the attacker learns the same by scanning ports
    and listing processes)."""

    endpoint: str
    run_dir: Path
    key: str | None
    replicas: list[str]
    member_dirs: list[Path]
    node: str
    router_pids: list[int]
    admin_socket: Path


# ---------------------------------------------------------------- the second user

@pytest.fixture(scope="module")
def stranger():
    """A second Unix user without privileges; removed afterwards (its only process is each attempt run)."""
    name = f"hps-stranger-{os.urandom(3).hex()}"
    subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                    "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True, timeout=60)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=True, capture_output=True, timeout=60)


def as_stranger(user: pwd.struct_passwd, script: Path, plan: dict, where: list[str] = ()) -> dict:
    """Run the attempts as that user (on a compute node: `where` enters it first, as root)."""
    argv = [*where, "runuser", "-u", user.pw_name, "--", "/usr/bin/python3", "-I", str(script)]
    done = subprocess.run(argv, input=json.dumps(plan), capture_output=True, text=True, timeout=900, cwd="/",
                          env={"PATH": "/usr/sbin:/usr/bin:/bin", "LANG": "C.UTF-8"}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["uid"] == user.pw_uid != os.getuid()
    return report


@pytest.fixture()
def arena(stranger):
    """A folder both users can enter (0755, ours): the results folder and HPCSERVE_HOME go in it, so that
    only hpcserve's own modes keep the stranger out; the attempts script is copied there."""
    base = Path(tempfile.mkdtemp(prefix="hps-hostile-", dir="/tmp"))
    base.chmod(0o755)
    (base / "results").mkdir(mode=0o755)
    script = base / "attempts.py"
    shutil.copy(HERE / "hostile_attempts.py", script)
    script.chmod(0o644)
    yield base
    shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- the test

def test_a_second_user_gets_nothing(slurm_env, stranger, arena, monkeypatch, tmp_path):
    monkeypatch.setenv("HPCSERVE_HOME", str(arena / "home"))
    results, script = arena / "results", arena / "attempts.py"
    traps, trap_target = plant_before_up(stranger, script, arena, next_job_id())
    config = write_config(tmp_path / "hostile.yaml", HERE / "sandbox-hostile.yaml", results_dir=str(results))
    up = run_cli("up", str(config), "--timeout", "900", timeout=1000)
    assert up.returncode == 0, up.stdout + up.stderr
    rows: list[Row] = [Row("pre-create Ray's temp folders (old names) and plant links in them", "ignored", True)]
    try:
        target = target_of(NAME)
        monitor = start_monitor(NAME, target.key)
        try:
            login = as_stranger(stranger, script, login_plan(target, monitor.url, arena))
            on_node = as_stranger(stranger, script, node_plan(target, node_listeners(slurm_env, target.node)),
                                  slurm_env.node_exec_argv(target.node))
        finally:
            monitor.stop()
        rows += judge_engines(login, "login node") + judge_engines(on_node, "compute node")
        rows += judge_router(login, target) + judge_monitor(login) + judge_files(login, target, arena)
        rows += judge_processes(login, target.key, "login node") + judge_processes(on_node, target.key, "compute node")
        rows += judge_ray_sockets(on_node) + judge_ports(on_node)
        rows.append(slurm_records(target.key))
        rows.append(still_serving(target))
        rows.append(private_modes(target.run_dir, arena / "home"))
        rows.append(ray_folder_modes(target))
        rows.append(traps_unused(traps, trap_target))
    finally:
        down = run_cli("down", NAME)
        remove_traps(traps, trap_target)
    rows.append(Row("down: no copy of the key or Ray's token left", leftover_secrets(results) or "none left",
                    down.returncode == 0 and not leftover_secrets(results)))
    assert squeue_empty(os.environ)
    report(rows)
    failed = [r for r in rows if not r.ok]
    assert not failed, "\n".join(f"{r.attack}: {r.got}" for r in failed)


# ---------------------------------------------------------------- before `up`: traps

def next_job_id() -> int:
    """The id Slurm gives next (a held job submitted and cancelled): what a stranger can learn too."""
    job = subprocess.run(["sbatch", "--parsable", "--hold", "--wrap=true"], capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip().split(";")[0]
    subprocess.run(["scancel", job], check=True, timeout=60)
    return int(job) + 1


def plant_before_up(user: pwd.struct_passwd, script: Path, arena: Path, first_job: int) -> tuple[list[Path], Path]:
    """The stranger makes the folders Ray's temp folder was named after (/tmp/hps-UID-<end of run id>) for
    the next job ids, with a link per node to a folder of theirs, and tries the run folder's and the
    registry's names."""
    trap_target = Path(f"/tmp/hps-stranger-target-{os.urandom(3).hex()}")
    traps = [Path(f"/tmp/hps-{os.getuid()}-{f'{NAME}-m0-{job}'[-12:]}") for job in range(first_job, first_job + 20)]
    plan = {"mkdir": [str(trap_target), *map(str, traps), str(arena / "results" / "logs"), str(arena / "home")],
            "symlink": [[str(t / f"hsn{n}"), str(trap_target)] for t in traps for n in (1, 2, 3)]}
    done = as_stranger(user, script, plan)
    assert done["mkdir"][str(trap_target)] == "made"
    assert done["mkdir"][str(arena / "results" / "logs")] != "made" and done["mkdir"][str(arena / "home")] != "made"
    return [t for t in traps if done["mkdir"][str(t)] == "made"], trap_target


def traps_unused(traps: list[Path], trap_target: Path) -> Row:
    used = [str(t) for t in traps if sorted(p.name for p in t.iterdir()) != ["hsn1", "hsn2", "hsn3"]]
    used += [str(trap_target)] if any(trap_target.iterdir()) else []
    return Row("Ray's files in a folder the stranger made", f"used: {used}" if used else "none", not used)


def remove_traps(traps: list[Path], trap_target: Path) -> None:
    for folder in [*traps, trap_target]:
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- what the owner knows

def target_of(name: str) -> Target:
    status = status_of(name)
    run_dir = Path(status["run_dir"])
    key_file = run_dir / "api_key"
    state = RunState.read(run_dir)
    router = psutil.Process(state.router_pid)
    member_dirs = [Path(m["run_dir"]) for m in status["members"]]
    node = RunState.read(member_dirs[0]).replicas[0]["nodes"][0]
    return Target(status["endpoint"], run_dir, key_file.read_text().strip() if key_file.exists() else None,
                  [r["url"] for r in status["replicas"]], member_dirs, node,
                  [router.pid, *(c.pid for c in router.children(recursive=True))], RunPaths(run_dir).router_admin)


def start_monitor(name: str, key: str | None):
    from hpcserve import api
    from hpcserve.monitoring.server import MonitorServer

    server = MonitorServer(api.gatherer(name), "127.0.0.1", 0, key)
    server.start()
    return server


def engine_routes(replica: str, key: str | None) -> list[tuple[str, str]]:
    """Every route of the replica's vLLM (its OpenAPI document, read with the key), its mounted apps, and
    hpcserve's KV-event relay (a middleware: in no OpenAPI document)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    spec = httpx.get(f"{replica}/openapi.json", headers=headers, timeout=30).json()
    routes = {(method.upper(), re.sub(r"{[^}]*}", "x", path)) for path, item in spec["paths"].items()
              for method in item if method in ("get", "post", "put", "delete", "patch")}
    routes -= {("GET", "/health")}  # open by design (no data): judged on its own row
    return sorted(routes | {("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", RELAY_PATH)})


def admin_routes() -> list[tuple[str, str]]:
    """The data plane's admin API as its code declares it (dataplane.admin.admin_app's route table; a supervisor
    of several workers, endpoint/dataplane/workers.py, serves the same routes but /stats): served on the owner-only
    Unix socket alone."""
    from hpcserve.endpoint.dataplane.admin import admin_app

    routes = sorted({(r.method, r.resource.canonical) for r in admin_app(None).router.routes() if r.method != "HEAD"})
    assert {("GET", "/backends"), ("PUT", "/backends"), ("POST", "/handover")} <= set(routes), routes
    return routes


STRANGER_BACKEND = "http://198.18.0.1:9"  # the login node's address: a backend the stranger would add


def admin_attempts(target: Target) -> list[tuple[str, str, dict | None]]:
    """Each admin route tried on the endpoint's client port, with a body that would change what it serves:
    the stranger's own backend as the whole set, the replica handed over."""
    bodies = {("PUT", "/backends"): {"backends": [{"url": STRANGER_BACKEND}]},
              ("POST", "/handover"): {"urls": target.replicas}}
    queries = {"/migrations": "?after=0"}
    return [(method, path + queries.get(path, ""), bodies.get((method, path))) for method, path in admin_routes()]


def router_listeners(pids: list[int]) -> tuple[list[str], list[str]]:
    """TCP addresses and Unix socket paths the router's processes listen on."""
    tcp, unix = [], []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            tcp += [f"{c.laddr.ip}:{c.laddr.port}" for c in proc.net_connections("inet")
                    if c.status == psutil.CONN_LISTEN]
            unix += [c.laddr for c in proc.net_connections("unix") if c.laddr]
        except psutil.NoSuchProcess:
            pass
    return sorted(set(tcp)), sorted(set(unix))


# ---------------------------------------------------------------- what the stranger tries

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
WRONG = {"Authorization": "Bearer not-the-key"}


def engine_attempts(base: str, routes: list[tuple[str, str]], tag: str) -> dict:
    attempts = {}
    for method, path in routes:
        for label, headers in (("no key", {}), ("wrong key", WRONG)):
            attempts[f"engine|{tag}|{method} {path}|{label}"] = {
                "method": method, "url": base + path, "headers": headers,
                "body": BODY if method in ("POST", "PUT", "PATCH") else None}
    attempts[f"health|{tag}"] = {"method": "GET", "url": base + "/health"}
    return attempts


def login_plan(target: Target, monitor: str, arena: Path) -> dict:
    routes = engine_routes(target.replicas[0], target.key)
    http = engine_attempts(target.replicas[0], routes, "replica")
    endpoint = target.endpoint
    http.update({
        "router|completion|no key": {"method": "POST", "url": f"{endpoint}/v1/completions", "body": BODY},
        "router|completion|wrong key": {"method": "POST", "url": f"{endpoint}/v1/completions", "body": BODY,
                                        "headers": WRONG},
        "router|models|no key": {"method": "GET", "url": f"{endpoint}/v1/models"},
        "monitor|/api/status": {"method": "GET", "url": f"{monitor}/api/status"},
        "monitor|/metrics": {"method": "GET", "url": f"{monitor}/metrics"},
    })
    for method, path, body in admin_attempts(target):
        for label, headers in (("no key", {}), ("wrong key", WRONG)):
            http[f"admin|{method} {path}|{label}"] = {"method": method, "url": endpoint + path, "headers": headers,
                                                      "body": body}
    tcp, unix = router_listeners(target.router_pids)
    serve_port = endpoint.rsplit(":", 1)[1]
    for address in (a for a in tcp if not a.endswith(f":{serve_port}")):
        host = "127.0.0.1" if address.startswith(("0.0.0.0", "::")) else address.rsplit(":", 1)[0]
        for path in ("/metrics", "/workers", "/"):
            http[f"router-port|{address}{path}"] = {"method": "GET", "url": f"http://{host}:{address.rsplit(':', 1)[1]}{path}"}
    files, folders = owned_paths([target.run_dir, arena / "home"])
    plants = [str(d / name) for d in [target.run_dir, *target.member_dirs] for name in (*SECRET_NAMES, "config.yaml.new")]
    plants += [str(arena / "home" / "deployments" / "evil.json"), str(target.run_dir / "members" / "logs" / "x")]
    return {"http": http, "read": files, "list": folders, "create": plants, "connect": unix, "proc": True,
            "mkdir": [str(target.run_dir.parent / f"{NAME}-m9-99999")]}


def node_plan(target: Target, listeners: list[str]) -> dict:
    """On the replica's node: the engine on loopback too, Ray's sockets, and every port that listens."""
    port = target.replicas[0].rsplit(":", 1)[1]
    routes = [("POST", "/invocations"), ("POST", "/v1/completions"), ("GET", "/metrics"), ("POST", "/tokenize"),
              ("GET", "/v1/models")]
    http = engine_attempts(f"http://127.0.0.1:{port}", routes, "replica on the node's loopback")
    for address in listeners:
        for path in ("/", "/metrics"):
            http[f"port|{address}{path}"] = {"method": "GET", "url": f"http://{address}{path}"}
    return {"http": http, "connect": ray_sockets(target), "proc": True}


def node_listeners(sandbox, node: str) -> list[str]:
    """host:port of every TCP port that listens on the node, as root sees them there (`ss`)."""
    out = subprocess.run([*sandbox.node_exec_argv(node), "ss", "-ltnH"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    listeners = set()
    for line in out.splitlines():
        host, _, port = line.split()[3].rpartition(":")
        host = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
        listeners.add(f"{host}:{port}")
    return sorted(listeners)


def ray_sockets(target: Target) -> list[str]:
    """Ray's Unix sockets on the node (raylet, plasma store), in its temp folder (node.json names it)."""
    info = json.loads((target.member_dirs[0] / "nodes" / target.node / "node.json").read_text())
    sockets = Path(info["temp_dir"]) / "session_latest" / "sockets"
    return sorted(str(p) for p in sockets.iterdir()) if sockets.is_dir() else []


def owned_paths(roots: list[Path]) -> tuple[list[str], list[str]]:
    files, folders = [], []
    for root in roots:
        for folder, dirs, names in os.walk(root):
            folders.append(folder)
            files += [os.path.join(folder, n) for n in names]
    return files, folders


# ---------------------------------------------------------------- judging

def refused(answer: dict) -> bool:
    """An HTTP refusal: 401 or 403. A timeout, a reset or a refused connection is no refusal: the attempt got
    no answer, so it shows nothing about what the server would have allowed."""
    return answer.get("status") in (401, 403)


SOCKET_REFUSALS = ("PermissionError", "ConnectionRefusedError")  # what a Unix socket's connect() refuses with


def socket_refused(outcome: str) -> bool:
    """The connect itself refused (the socket's folder or mode, nobody accepting); a timeout is no refusal."""
    return outcome in SOCKET_REFUSALS


def guard_refusal(answer: dict) -> bool:
    """hpcserve's KeyGuard said no: 401, OpenAI-style JSON naming hpcserve."""
    try:
        error = json.loads(answer.get("body") or "")["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return answer["status"] == 401 and error.get("code") == "invalid_api_key" and "hpcserve" in error["message"]


def judge_engines(report: dict, where: str) -> list[Row]:
    engine = {k: v for k, v in report["http"].items() if k.startswith("engine|")}
    answered = sorted(f"{k.split('|')[2]} ({k.split('|')[3]}): {v.get('status')}" for k, v in engine.items()
                      if not guard_refusal(v))
    rows = [Row(f"{where}: every vLLM route of the replica without the key or with a wrong one "
                f"({len(engine) // 2} routes)", f"answered: {answered}" if answered else f"all {len(engine)} refused",
                not answered)]
    health = next(v for k, v in report["http"].items() if k.startswith("health|"))
    rows.append(Row(f"{where}: GET /health (open by design: no data)", str(health.get("status")),
                    health.get("status") in (200, 503)))
    return rows


def judge_router(report: dict, target: Target) -> list[Row]:
    http = report["http"]
    calls = {k: v for k, v in http.items() if k.startswith("router|")}
    rows = [Row("router: completions and models without the key or with a wrong one",
                ", ".join(f"{k.split('|', 1)[1]}: {v.get('status')}" for k, v in calls.items()),
                all(refused(v) for v in calls.values()))]
    json_401 = guard_refusal(calls["router|completion|no key"])
    rows.append(Row("router: its 401 is OpenAI JSON naming hpcserve", "yes" if json_401 else
                    f"body {calls['router|completion|no key'].get('body', '')[:80]!r}", json_401))
    admin = {k: v for k, v in http.items() if k.startswith("admin|")}
    # Every admin route on the client port gets the data plane's own 401, but GET /health: open there by
    # design (this process lives), 200 with an empty body, not the admin socket's answer (pid, port).
    health = {k: admin.pop(k) for k in [k for k in admin if k.startswith("admin|GET /health|")]}
    expected = {f"admin|{m} {p}|{label}" for m, p, _ in admin_attempts(target) if p != "/health"
                for label in ("no key", "wrong key")}
    rows.append(Row(f"router: its admin routes on its TCP port, no key or a wrong one ({len(admin) // 2}: "
                    "set the backends, hand over, read them, migrations, metrics, stats)",
                    ", ".join(f"{k.split('|', 1)[1]}: {v.get('status') or v.get('error', '')[:40]}"
                              for k, v in admin.items()),
                    set(admin) == expected and all(guard_refusal(v) for v in admin.values())))
    rows.append(Row("router: GET /health on its TCP port (open: no data, not the admin socket's)",
                    ", ".join(f"{k.split('|', 2)[2]}: {v.get('status')} {(v.get('body') or '')[:40]!r}"
                              for k, v in health.items()),
                    len(health) == 2 and all(v.get("status") == 200 and not v.get("body") for v in health.values())))
    ports = {k: v for k, v in http.items() if k.startswith("router-port|")}
    rows.append(Row("router: its other TCP ports (metrics, key validator)",
                    ", ".join(f"{k.split('|', 1)[1]}: {v.get('status') or v.get('error', '')[:40]}"
                              for k, v in ports.items()) or "none",
                    all(refused(v) or v.get("status") == 404 for v in ports.values())))
    sockets = report["connect"]
    rows.append(Row("router: its Unix sockets (the admin socket: every admin route)",
                    json.dumps(sockets) if sockets else "none",
                    str(target.admin_socket) in sockets and all(socket_refused(v) for v in sockets.values())))
    rows.append(admin_unchanged(target))
    return rows


def admin_unchanged(target: Target) -> Row:
    """The owner's view through the admin socket after the attempts: the replicas alone, none handed over."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(target.admin_socket)), base_url="http://router",
                      timeout=30) as admin:
        state = admin.get("/backends").raise_for_status().json()
    urls = sorted(b["url"] for b in state["backends"])
    retired = [b["url"] for b in state["retired"]]
    return Row("router: its backends after the attempts (the owner's admin socket)",
               f"backends {urls}, retired {retired}", urls == sorted(target.replicas) and not retired)


def judge_monitor(report: dict) -> list[Row]:
    calls = {k: v for k, v in report["http"].items() if k.startswith("monitor|")}
    return [Row("monitor on loopback: /api/status and /metrics without the key",
                ", ".join(f"{k.split('|', 1)[1]}: {v.get('status')}" for k, v in calls.items()),
                all(v.get("status") == 401 for v in calls.values()))]


def judge_files(report: dict, target: Target, arena: Path) -> list[Row]:
    read = [p for p, got in report["read"].items() if got == "read"]
    listed = [p for p, got in report["list"].items() if got == "listed"]
    planted = [p for p, got in report["create"].items() if got == "created"]
    made = [p for p, got in report["mkdir"].items() if got == "made"]
    return [Row(f"read the files of the run folder and HPCSERVE_HOME ({len(report['read'])})",
                f"read: {read[:5]}" if read else "none read", not read),
            Row(f"list their folders ({len(report['list'])})", f"listed: {listed[:5]}" if listed else "none listed",
                not listed),
            Row("plant a key, Ray's token, a config, a registry record; make a run folder's name",
                f"done: {planted + made}" if planted or made else "all refused", not planted and not made)]


def judge_processes(report: dict, key: str | None, where: str) -> list[Row]:
    with_key = [c[:120] for c in report["cmdlines"] if key and key in c]
    return [Row(f"{where}: the key in a command line ({len(report['cmdlines'])} processes)",
                f"found in: {with_key}" if with_key else "not found", bool(key) and not with_key),
            Row(f"{where}: read the environment of the owner's processes",
                f"read: {len(report['environ_readable'])}", not report["environ_readable"])]


def judge_ray_sockets(report: dict) -> list[Row]:
    sockets = report["connect"]
    not_refused = {p: got for p, got in sockets.items() if not socket_refused(got)}
    return [Row(f"compute node: connect to Ray's Unix sockets ({len(sockets)})",
                f"not refused: {not_refused}" if not_refused else "all refused", bool(sockets) and not not_refused)]


def judge_ports(report: dict) -> list[Row]:
    """Nothing on the node answers a stranger's GET / or /metrics: the engine's ports refuse without the key,
    Ray's HTTP ports refuse without its token, the rest speak binary protocols. Ray's Prometheus pages (the
    dashboard agent's metrics export port on every node, the head's API server on 44227) answered 200 with
    ~1,300 lines once: actor names, PIDs, the session and job ids, node addresses."""
    ports = {k.split("|", 1)[1]: v for k, v in report["http"].items() if k.startswith("port|")}
    answered = sorted(f"{where}: {v['status']} {len((v.get('body') or '').splitlines())}+ lines"
                      for where, v in ports.items() if v.get("status") is not None and 200 <= v["status"] < 400)
    kinds = Counter(str(v["status"]) if v.get("status") else v.get("error", "").split(":")[0] for v in ports.values())
    return [Row(f"compute node: GET / and /metrics on every listening port ({len(ports) // 2} ports)",
                f"answered: {answered}" if answered else f"none answered: {dict(sorted(kinds.items()))}",
                not answered)]


def ray_folder_modes(target: Target) -> Row:
    """Ray's folders in the node's /tmp (node.json names them): none open to others (Ray chmods its temp
    and session folders 0777)."""
    folders = []
    for member in target.member_dirs:
        for info in member.glob("nodes/*/node.json"):
            temp = Path(json.loads(info.read_text())["temp_dir"])
            folders += [temp.parent] + [Path(f) for f, _, _ in os.walk(temp)]
    open_ = [f"{f} {oct(stat.S_IMODE(os.lstat(f).st_mode))}" for f in folders
             if os.path.isdir(f) and stat.S_IMODE(os.lstat(f).st_mode) & 0o022]
    return Row(f"modes of Ray's folders in the node's /tmp ({len(folders)}): none open to others",
               f"open: {open_[:5]}" if open_ else "all private", bool(folders) and not open_)


# ---------------------------------------------------------------- the owner's side

def slurm_records(key: str | None) -> Row:
    """What slurmctld keeps of the running jobs (their environment and script, in StateSaveLocation; slurmdbd
    keeps the environment too with AccountingStoreFlags=job_env): never the key."""
    conf = Path(os.environ["SLURM_CONF"]).read_text()
    state = Path(re.search(r"^StateSaveLocation=(.+)$", conf, re.MULTILINE).group(1).strip())
    records = [p for p in state.rglob("*") if p.is_file() and p.name in ("environment", "script")]
    with_key = [str(p) for p in records if key and key.encode() in p.read_bytes()]
    return Row(f"the key in Slurm's records of the jobs ({len(records)} files: environment, script)",
               f"found in: {with_key}" if with_key else "not found", bool(key) and bool(records) and not with_key)


def still_serving(target: Target) -> Row:
    reply = httpx.post(f"{target.endpoint}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {target.key}"}, timeout=120)
    return Row("the owner's completion through the router afterwards", str(reply.status_code), reply.status_code == 200)


def private_modes(run_dir: Path, home: Path) -> Row:
    """Defense in depth: nothing in the run folder or HPCSERVE_HOME is open to group or others."""
    files, folders = owned_paths([run_dir, home])
    open_ = [p for p in files + folders if not os.path.islink(p) and stat.S_IMODE(os.lstat(p).st_mode) & 0o077]
    return Row(f"modes in the run folder and HPCSERVE_HOME ({len(files) + len(folders)} entries): 0700/0600",
               f"open: {open_[:5]}" if open_ else "all private", not open_)


def leftover_secrets(results: Path) -> list[str]:
    return sorted(str(p) for name in SECRET_NAMES for p in results.rglob(name))


def report(rows: list[Row]) -> None:
    table = "\n".join(f"{'ok  ' if r.ok else 'FAIL'} {r.attack}: {r.got[:300]}"
                      for r in rows)
    print("\n" + table)
    if os.environ.get("HPCSERVE_HOSTILE_REPORT"):
        Path(os.environ["HPCSERVE_HOSTILE_REPORT"]).write_text(json.dumps([asdict(r) for r in rows], indent=1))
