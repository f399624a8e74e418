"""The embedded default, deployed once for every test that only reads from it (tests/local): `hpcserve up`
of a copy of examples/local.yaml that changes five things and keeps the rest (the model, vLLM's default
compile path, the engine's arguments, local mode, the router in front):
- name: t-local, not local-tiny, the name the tests look it up by (status, logs, bench, down);
- serve.port: a free port of its own (helpers.free_port), not 8000, which another process or test of this
  machine may hold;
- results_dir: the test's temporary folder, not ./results of the checkout (listed in RESULTS_DIRS, where
  to look when a test fails);
- the key: HPCSERVE_API_KEY set empty for `up`, so that hpcserve generates the key (the file api_key of the
  run folder, which the tests read) as for a user without the variable, whatever the caller's environment;
- tenancy.self_service: allowed for the two test users (unix_users.py), for the self-service test.
It is registered in the session's own HPCSERVE_HOME (hpcserve_home). The last test module
(test_zz_down.py) stops it and checks that nothing it started is still alive."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, RESULTS_DIRS, free_port, process_tree, run_cli, write_config
from unix_users import ALICE, BOB

NAME = "t-local"


@pytest.fixture(scope="session")
def local_deployment(hpcserve_home, tmp_path_factory):
    work = tmp_path_factory.mktemp("local")
    RESULTS_DIRS.append(work / "results")
    port = free_port()
    config = write_config(work / "local.yaml", REPO / "examples" / "local.yaml", name=NAME,
                          serve={"port": port}, results_dir=str(work / "results"),
                          tenancy={"self_service": {"allow": True, "users": [ALICE, BOB]}})
    up = run_cli("up", str(config), "--timeout", "600", env={"HPCSERVE_API_KEY": ""})
    info = {"up": up, "config": config, "port": port, "name": NAME}
    if up.returncode == 0:
        status = json.loads(run_cli("status", NAME, "--json").stdout)[0]
        run_dir = Path(status["run_dir"])
        info.update(status=status, run_dir=run_dir, url=f"http://127.0.0.1:{port}",
                    key=(run_dir / "api_key").read_text().strip(),
                    driver_tree=process_tree(json.loads((run_dir / "state.json").read_text())["driver_pid"]))
    yield info
    run_cli("down", NAME)  # test_zz_down did it already when it ran; this is for a run that stopped early
