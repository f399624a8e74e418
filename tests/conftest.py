import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import helpers  # noqa: E402 - tests/ is on the path from the line above


@pytest.fixture(scope="session")
def hpcserve_home(tmp_path_factory) -> Path:
    """A private registry for the test session: tests never see the user's deployments."""
    home = tmp_path_factory.mktemp("hpcserve-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("HPCSERVE_HOME", str(home))
    yield home
    mp.undo()


# ---------------------------------------------------------------- the Slurm sandbox

SANDBOX_NODES = 3


def sandbox_unusable_reason() -> str | None:
    """Why the sandbox cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the Slurm sandbox needs root (network namespaces, mounts)"
    for tool in ("ip", "nsenter", "unshare"):
        if not shutil.which(tool):
            return f"the Slurm sandbox needs `{tool}` (iproute2 / util-linux)"
    for probe in (["ip", "netns", "list"], ["unshare", "--net", "--pid", "--fork", "true"]):
        try:
            done = subprocess.run(probe, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"`{' '.join(probe)}` failed: {exc}"
        if done.returncode != 0:
            return f"namespaces are not usable here: `{' '.join(probe)}`: {done.stderr.strip()}"
    return None


@pytest.fixture(scope="session")
def sandbox(request):
    """A running 3-node sandbox, shared by the whole test session (by one worker's tests under
    pytest-xdist) and stopped at its end. Its folder (logs, Slurm's state) is removed then too, unless a
    test failed: its logs say where to look."""
    reason = sandbox_unusable_reason()
    if reason:
        pytest.skip(reason)
    from hpcserve.sandbox.cluster import ensure_sandbox

    cluster = ensure_sandbox(nodes=SANDBOX_NODES, **sandbox_settings(worker_index()))
    yield cluster
    cluster.down()
    if not request.session.testsfailed:
        shutil.rmtree(cluster.root, ignore_errors=True)


# ---------------------------------------------------------------- side by side (pytest-xdist)
# `bash scripts/test.sh` (CI) runs the suite on two workers (their waits overlap: a handover waiting for its
# jobs' end beside a TP start; the fast tests fill the gaps). Each worker has a sandbox of its own (namespaces, bridge,
# Slurm, munge), so their jobs never meet; the first keeps the default one, whose names (hsn1, 198.18.0.11)
# some tests spell out: those run on it (PINNED). Tests that share a deployment run on one worker (GROUPS),
# so that the two workers end together (durations: docs/testing.md).

def worker_index() -> int:
    """0 for gw0 and for a run without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker[2:]) if worker.startswith("gw") else 0


def sandbox_settings(index: int) -> dict:
    if index == 0:
        return {}
    # Names that do not start with the default's (hs, /tmp/hpcserve-sandbox): its checks match by prefix
    return {"root": Path(f"/tmp/hpcserve-w{index}-sandbox"), "prefix": f"hx{index}", "net": f"198.18.{index}"}


# Groups of test files that must run on one worker, in the order their scopes are handed out; every other
# file is a group of its own, after these. Measured on two workers (2026-12-03, seconds): handover 470,
# distributed serving 400, adoption 365, slurm_ray 205 (70 of it the time-limit test, half idle), two
# replicas 165, endpoint scaling 155 (a third idle), local 250, site profiles 210, router 140, rolling
# handover with stand-ins 110 (half idle). The order pairs the tests that mostly wait with CPU-heavy ones on
# the other worker: the handover test (gw1) with gw0's TP/PP starts, the scaling test with the two-replica
# deployment, the time-limit and rolling-handover tests with the adoption test. PINNED files come early,
# so that gw0 is not left with them while gw1 runs dry; at the end the fast files fill the gaps.
GROUPS = [
    "tests/cluster/test_handover.py",
    "tests/cluster/test_distributed_serving.py",
    "tests/cluster/test_endpoint.py",  # before the adoption test's node kills (a node died in the scaling test after)
    "tests/cluster/test_two_replicas.py",
    "tests/cluster/test_slurm_ray.py",
    "tests/cluster/test_adopt.py",
    "tests/cluster/test_scale_sandbox.py",
    "tests/cluster/test_hostile_user.py",
    "tests/doctor/test_doctor_sandbox.py",
    "tests/local/",  # one local deployment for every module; test_zz_down.py ends it
    "tests/cluster/test_site_profiles.py",
    "tests/endpoint/test_router_vllm.py",
]
# It compares hpcserve's benchmark figures with vLLM's own client on one server: under the other worker's
# load hpcserve's client (heavier) reported 0.80 of vLLM's req/s; alone, within 5 %. Run when nothing else does.
SOLO = "tests/benchmark/test_agrees_with_vllm_bench.py"
LAST = "tests/sandbox/"  # its last test takes the default sandbox down
PINNED = {"tests/cluster/test_two_replicas.py", "tests/cluster/test_slurm_ray.py", "tests/cluster/test_hostile_user.py",
          "tests/doctor/test_doctor_sandbox.py", LAST}  # they name the default sandbox's nodes and addresses
NOT_FIRST_WORKER = {"tests/cluster/test_handover.py"}  # gw0 has PINNED files to run


def allowed_on(worker: str, scope: str) -> bool:
    return scope not in PINNED if worker != "gw0" else scope not in NOT_FIRST_WORKER


def group_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((g for g in [*GROUPS, LAST] if path.startswith(g)), path)


def group_rank(group: str) -> int:
    return GROUPS.index(group) if group in GROUPS else len(GROUPS) + (group == SOLO) + 2 * (group == LAST)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: group_rank(group_of(item.nodeid)))  # stable: file order within a group


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """xdist's loadscope with our groups, PINNED ones only on gw0 (NOT_FIRST_WORKER not there), SOLO
        only once the other worker has nothing left to run (xdist's own loadgroup put tests of one
        xdist_group on two workers under pytest 9.2)."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # A worker holds its last test until it gets another or the run ends (pytest needs the next
            # item): one pending test is an idle worker, two or more a busy one (as xdist's tests_finished).
            others_busy = any(self._pending_of(work) >= 2 for other, work in self.assigned_work.items() if other is not node)
            scope = next((s for s in self.workqueue if allowed_on(node.gateway.id, s)
                          and (s != SOLO or not others_busy)), None)
            if scope is None:
                return  # only the other worker's groups (or SOLO) are left: this one waits
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False  # our order (GROUPS first), not xdist's biggest-file-first
    return ByGroup(config, log)


# ---------------------------------------------------------------- where to look when a test fails

LOG_TAIL_LINES = 12


def run_folders(results: Path) -> list[Path]:
    """Every run folder under a results folder, an endpoint's members' included, newest last."""
    folders = [p.parent for p in results.glob("**/state.json")]
    return sorted(set(folders), key=lambda p: p.stat().st_mtime)


def where_to_look(results_dirs: list[Path]) -> str:
    """The run folders, what each one's state says, and the tail of the logs that explain a failure."""
    from hpcserve.core.runstate import RunState

    lines = []
    for folder in [f for results in results_dirs for f in run_folders(results)][-6:]:
        state = RunState.read(folder)
        error = f"; error at stage '{state.error.stage}': {state.error.diagnosis}" if state.error else ""
        lines.append(f"{folder}: {state.status}, stage {state.stage}{error}")
        logs = [*sorted(folder.glob("engines/*.log")), *(folder / name for name in
                ("driver.log", "slurm.out", "endpoint.log", "router.log") if (folder / name).is_file())]
        for log in logs[-3:]:
            tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            lines += [f"  --- {log.name} (last {len(tail)} lines)"] + [f"  {line[:240]}" for line in tail]
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    tmp = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    dirs = [d for d in [tmp, *helpers.RESULTS_DIRS] if d is not None and Path(d).is_dir()]
    text = where_to_look([Path(d) for d in dirs]) if dirs else ""
    if text:
        report.sections.append(("where to look", text))


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory):
    """One real PostgreSQL server for the session (per pytest-xdist worker), from Debian's packages
    (hpcserve.testing.postgres; scripts/test.sh installs them before the workers start)."""
    from hpcserve.testing.postgres import installed_bin, postgres_server

    if installed_bin() is None and os.geteuid() != 0:
        pytest.skip("PostgreSQL's server is not installed and installing it needs root")
    with postgres_server(tmp_path_factory.mktemp("postgres")) as url:
        yield url
