"""Two models on one member's GPUs (swap), end to end in local mode: the real endpoint process (data plane,
controller) whose member is a local process running stand-in engines with vLLM's sleep routes (as GPU engines
in sleep mode have them: the config says one GPU, the stand-ins need none), one per model on its own port, the
swap model's asleep from the start. A request for the sleeping model puts the awake one to sleep and wakes it
(POST /sleep, POST /wake_up: the member and its allocation stay), and gets a real answer through the data plane;
the decision log says why; a request for the first model swaps back; a burst for both fails nothing. The
decisions alone: test_swap_decisions.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from zero_endpoint import HTTP, decisions, local_endpoint, state

from hpcserve import api
from hpcserve.core.runstate import RunState
from hpcserve.endpoint.control.joining import joined_deployments, refuse_down_while_joined
from hpcserve.testing.harness import wait_until

NAME = "st-swap"
KEY = "swap-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
FIRST, OTHER = "stub", "qwen"  # the deployment's model (awake at the start) and its swap model


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with local_endpoint(tmp_path_factory.mktemp("swap"), NAME, "HPCSERVE_SWAP_KEY", KEY,
                        cluster={"scheduler": "local", "gpus_per_node": 1},
                        swap={"models": [{"path": "builtin:tiny-llama", "served_name": OTHER}], "awake": 1,
                              "min_awake_s": 0, "wake_wait_s": 30}) as running:
        url = running[1]
        wait_until(lambda: model_states(url) == {FIRST: "serving", OTHER: "asleep"}, 30, "both models listed")
        # the data plane lists them a moment before the controller's next round writes its state.json
        wait_until(lambda: state(running[0]).members and state(running[0]).members[0]["backends"]
                   and RunState.read(state(running[0]).members[0]["record"]["run_dir"]).swap, 30,
                   "the member's engines in state.json")
        yield running


def model_states(url: str) -> dict[str, str]:
    return {m["id"]: m["state"] for m in HTTP.get(f"{url}/v1/models", headers=HEADERS).json()["data"]}


def ask(url: str, model: str) -> int:
    answer = HTTP.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4},
                       headers=HEADERS)
    assert answer.status_code != 200 or answer.json()["choices"][0]["text"], answer.text
    return answer.status_code


def swap_engine(record, model: str) -> str:
    """The URL of the member's engine of a swap model (its state.json lists them)."""
    member = state(record).members[0]
    return next(e["url"] for e in RunState.read(member["record"]["run_dir"]).swap if e["model"] == model)


def sleeping(engine: str) -> bool:
    return HTTP.get(f"{engine}/is_sleeping", headers=HEADERS).json()["is_sleeping"]


def test_a_request_for_the_sleeping_model_swaps_it_in_and_back(endpoint):
    record, url = endpoint
    first = state(record).members[0]["backends"][0]
    other = swap_engine(record, OTHER)
    assert not sleeping(first) and sleeping(other)  # the member's first model ends awake
    asked = time.time()
    assert ask(url, OTHER) == 200
    wait_until(lambda: decisions(record, "swapped", asked), 5, "the swap on record")  # state.json: each round
    swap = decisions(record, "swap", asked)
    assert swap and f"{FIRST} sleeps, {OTHER} wakes" in swap[-1].reason, [d.reason for d in swap]
    assert "request(s) waiting" in swap[-1].reason and "least recently used" in swap[-1].reason
    assert sleeping(first) and not sleeping(other)  # in the same member: its process and allocation kept
    assert len(state(record).members) == 1
    assert model_states(url) == {FIRST: "asleep", OTHER: "serving"}
    took = decisions(record, "swapped", asked)[-1]
    wait_until(lambda: state(record).swapped.get(f"{NAME}-m0", {}).get("awake") == [OTHER], 5, "state.json")
    row = api.status(NAME)[0]
    assert any(f"{NAME}-m0 awake {OTHER}" in line for line in row.swap), row.swap
    print(f"\nFIGURES swap to {OTHER} answered in {took.time - asked:.2f} s: {took.reason}")

    back = time.time()
    assert ask(url, FIRST) == 200
    wait_until(lambda: decisions(record, "swapped", back), 5, "the swap back on record")
    swap = decisions(record, "swap", back)
    assert swap and f"{OTHER} sleeps, {FIRST} wakes" in swap[-1].reason
    assert not sleeping(first) and sleeping(other)
    assert model_states(url) == {FIRST: "serving", OTHER: "asleep"}


def test_a_burst_for_both_models_fails_nothing(endpoint):
    _, url = endpoint
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: ask(url, (FIRST, OTHER)[i % 2]), range(8)))
    assert codes == [200] * 8


def test_its_swap_models_do_not_hold_its_down_back(endpoint):
    """Their rooms are made as joined models' are; they are the deployment's own, not another deployment's."""
    record, url = endpoint
    assert model_states(url).keys() == {FIRST, OTHER}
    assert joined_deployments(record) == []
    refuse_down_while_joined(record)  # no UsageError: `hpcserve down` goes on
