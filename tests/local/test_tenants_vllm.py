"""Users of the embedded default on real vLLM (the shared deployment of tests/local): a key made with
`hpcserve keys add` serves; its usage rows count what vLLM itself counted, streamed or not; `hpcserve usage`
reports them; `keys revoke` is in effect within a second; the default cap refuses `n: 10000`; two Unix users
get keys of their own through the self-service socket, each bound to their name, neither able to read the
store nor use a key it was not given. Keys never appear in a process list or a log."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import run_cli
from unix_users import ALICE, BOB, make_users, python_for_users

from hpcserve.tenancy.store import open_store
from hpcserve.tenancy.settings import DATABASE_SUFFIX

pytestmark = pytest.mark.slow
MODEL_PROMPT = "the usage of"


@pytest.fixture()
def deployment(local_deployment):
    assert local_deployment["up"].returncode == 0, local_deployment["up"].stderr
    return local_deployment


def database(deployment) -> Path:
    return Path(deployment["config"]).parent / "results" / (deployment["name"] + DATABASE_SUFFIX)


def ask(deployment, key: str, route: str, body: dict) -> tuple[int, dict | None]:
    """One request; its status and vLLM's own usage (the whole answer's, or a stream's usage chunk)."""
    url = f"{deployment['url']}/v1/{route}"
    headers = {"Authorization": f"Bearer {key}"}
    if not body.get("stream"):
        answer = httpx.post(url, headers=headers, json=body, timeout=120)
        return answer.status_code, answer.json().get("usage") if answer.status_code == 200 else None
    usage = None
    with httpx.stream("POST", url, headers=headers, json={**body, "stream_options": {"include_usage": True}},
                      timeout=120) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        return answer.status_code, usage


def test_a_users_key_serves_and_its_usage_rows_count_what_vllm_counted(deployment):
    added = run_cli("keys", "add", "alice", "-d", deployment["name"], "--project", "chem", "--expires", "1d")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    assert key.startswith("hps_") and key not in added.stderr
    since = time.time()
    requests = [("completions", {"prompt": f"{MODEL_PROMPT} {i}", "max_tokens": 5 + i, "temperature": 0,
                                 "stream": i % 2 == 1}) for i in range(4)]
    requests += [("chat/completions", {"messages": [{"role": "user", "content": f"chat {i}"}], "max_tokens": 4,
                                       "temperature": 0, "stream": i == 1}) for i in range(2)]
    deadline = time.monotonic() + 5  # the key reaches every data-plane worker within its poll
    while ask(deployment, key, *requests[0])[0] == 401 and time.monotonic() < deadline:
        time.sleep(0.2)
    since = time.time()
    counted = []
    for route, body in requests:
        status, usage = ask(deployment, key, route, {"model": "tiny", **body})
        assert status == 200 and usage, (route, body, status)
        counted.append((f"/v1/{route}", usage["prompt_tokens"], usage["completion_tokens"]))
    store = open_store(database(deployment))
    try:
        deadline = time.monotonic() + 10
        while len(rows := [r for r in store.rows(since) if r.user == "alice"]) < len(requests):
            assert time.monotonic() < deadline, rows
            time.sleep(0.2)
    finally:
        store.close()
    assert sorted((r.route, r.prompt_tokens, r.completion_tokens) for r in rows) == sorted(counted)
    assert {(r.project, r.model, r.status, r.migrated) for r in rows} == {("chem", "tiny", 200, False)}
    assert all(r.ttft_s is not None and 0 < r.ttft_s <= r.duration_s for r in rows)
    report = run_cli("usage", deployment["name"], "--by", "user", "--since", "1h", "--csv")
    assert report.returncode == 0, report.stderr
    line = next(r for r in csv.DictReader(io.StringIO(report.stdout)) if r["user"] == "alice")
    assert int(line["requests"]) >= len(requests)
    assert int(line["completion_tokens"]) >= sum(c for _, _, c in counted)
    # never in a process list, never in a log of the run
    assert not any(key in " ".join(p.cmdline()) for p in psutil.process_iter() if _readable(p))
    run_dir = Path(deployment["run_dir"])
    assert not [p for p in run_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    # revoked: refused from a second after
    revoked = run_cli("keys", "revoke", "alice", "-d", deployment["name"])
    assert revoked.returncode == 0, revoked.stderr
    time.sleep(1.0)
    assert [ask(deployment, key, *requests[0])[0] for _ in range(5)] == [401] * 5


def _readable(process: psutil.Process) -> bool:
    try:
        process.cmdline()
        return True
    except psutil.Error:
        return False


def test_a_key_for_a_model_not_served_is_warned_of_and_gets_no_other_model(deployment):
    added = run_cli("keys", "add", "gina", "-d", deployment["name"], "--model", "tiny-typo")
    assert added.returncode == 0 and "not tiny-typo" in added.stderr, added.stderr
    key = added.stdout.strip()
    unnamed = {"prompt": "Hello", "max_tokens": 2}  # vLLM serves its own model to a body that names none
    deadline = time.monotonic() + 5  # the key reaches every data-plane worker within its poll
    while (status := ask(deployment, key, "completions", unnamed)[0]) == 401 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 403
    assert ask(deployment, key, "completions", {"model": "tiny", **unnamed})[0] == 403


def test_the_default_cap_refuses_ten_thousand_choices(deployment):
    answer = httpx.post(f"{deployment['url']}/v1/completions", headers={"Authorization": f"Bearer {deployment['key']}"},
                        json={"model": "tiny", "prompt": "x", "n": 10000, "max_tokens": 1}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "max_n" and "max_n = 16" in answer.json()["error"]["message"]


def test_two_unix_users_get_keys_of_their_own_by_self_service(deployment):
    make_users()
    python = python_for_users()
    owner = psutil.Process().username()
    grants = {}
    for user in (ALICE, BOB):
        code = ("import json; from hpcserve.tenancy.selfservice import request_key; "
                f"g = request_key({owner!r}, {deployment['name']!r}); print(json.dumps([g.key, g.user, g.key_id]))")
        done = subprocess.run(["runuser", "-u", user, "--", *python, code], capture_output=True, text=True,
                              timeout=60, cwd="/")
        assert done.returncode == 0, done.stderr
        grants[user] = json.loads(done.stdout)
    assert {user: g[1] for user, g in grants.items()} == {ALICE: ALICE, BOB: BOB}
    assert grants[ALICE][0] != grants[BOB][0]
    for user, (key, _, key_id) in grants.items():  # each serves, and its usage is its user's
        deadline = time.monotonic() + 5
        while (status := ask(deployment, key, "completions", {"model": "tiny", "prompt": "mine", "max_tokens": 2})[0]) == 401:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert status == 200
    # neither can read the store (or the run folder with the deployment's key)
    for path in (database(deployment), Path(deployment["run_dir"]) / "api_key"):
        done = subprocess.run(["runuser", "-u", ALICE, "--", "cat", str(path)], capture_output=True, text=True)
        assert done.returncode != 0 and "Permission denied" in done.stderr, (path, done.stdout[:50])
    store = open_store(database(deployment))
    try:
        deadline = time.monotonic() + 10
        while not {ALICE, BOB} <= {r.user for r in store.rows(time.time() - 120)}:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        owners = {r.key_id: r.user for r in store.rows(time.time() - 120) if r.user in (ALICE, BOB)}
    finally:
        store.close()
    assert owners == {grants[ALICE][2]: ALICE, grants[BOB][2]: BOB}
