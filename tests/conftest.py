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
def sandbox():
    """A running 3-node sandbox, shared by the whole test session and stopped at its end."""
    reason = sandbox_unusable_reason()
    if reason:
        pytest.skip(reason)
    from hpcserve.sandbox.cluster import ensure_sandbox

    cluster = ensure_sandbox(nodes=SANDBOX_NODES)
    yield cluster
    cluster.down()


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
