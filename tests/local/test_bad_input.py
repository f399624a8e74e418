"""Bad input through the shared local deployment's endpoint: malformed requests to
the data plane in front of real vLLM on CPU, on /v1/completions and /v1/chat/completions. Each gets a 4xx
JSON error in OpenAI's shape ({"error": {"message": str, "type": str, "code": ...}}), never a 5xx and never a
traceback, while a keyed client sends good requests beside them (completions and streamed chat, in a loop
over the whole run) with no failure.

Who answers what: vLLM's own 4xx in OpenAI's shape is passed on as it is (no case here gets a 500 from vLLM
0.32 on CPU). The data plane answers itself only a body vLLM cannot decode as JSON (not UTF-8, nested too
deeply: vLLM's 400 is {"detail": ...}, and the data plane's own parse raised RecursionError, a 500), and
must not fail on what it reads for migration (endpoint/migration.py: stream_options "x" was a 500). vLLM
serves unknown fields (it logs them; OpenAI's API refuses them), any role (chat templates know roles OpenAI's
API has not) and a message without content: those must be served like vLLM serves them (200), not refused.

HPCSERVE_BAD_INPUT_REPORT=FILE writes each case's status from the endpoint and, for comparison, from the
replica itself (the same request sent to vLLM directly), one JSON line each.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

pytestmark = pytest.mark.slow

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
NESTED = b"[" * 100_000 + b"]" * 100_000
GOOD_TIMEOUT_S = 120


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    content_type: str | None = "application/json"
    names: str = ""  # what the error message must name (case-insensitive), where the case says
    accepted: bool = False  # a request vLLM serves (unknown fields, roles): 200, like one without them

    def __str__(self) -> str:
        return self.name


def _json(base: dict, **changes) -> bytes:
    return json.dumps({**base, **changes}).encode()


def _cases() -> list[Case]:
    cases = []
    for short, path, field, base in (
            ("completions", COMPLETIONS, "prompt", {"model": "tiny", "prompt": "hello", "max_tokens": 2}),
            ("chat", CHAT, "messages", {"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                                        "max_tokens": 2})):
        good = _json(base)

        def case(name: str, body: bytes, short=short, path=path, **kw) -> Case:
            return Case(f"{short}:{name}", path, body, **kw)

        cases += [
            case("max_tokens='ten'", _json(base, max_tokens="ten")),
            case("temperature='hot'", _json(base, temperature="hot")),
            case(f"{field} of the wrong type", _json(base, **{field: 5 if field == "prompt" else "hello"})),
            case("model=5", _json(base, model=5)),
            case("unknown model", _json(base, model="no-such-model")),
            case("stream='maybe'", _json(base, stream="maybe")),
            case("invalid JSON", good[:-5]),
            case("JSON string, not an object", b'"hello"'),
            case("JSON array, not an object", b"[1, 2, 3]"),
            case("100,000 nested brackets", NESTED, names="nests"),
            case(f"100,000 nested brackets in {field}", good[:-1] + b', "' + field.encode() + b'": ' + NESTED + b"}",
                 names="nests"),
            case("100,000 nested brackets, streamed", b'{"stream": true, "x": ' + NESTED + b"}", names="nests"),
            case("max_tokens=10**30", _json(base, max_tokens=10**30), names="max_tokens"),
            case("max_tokens=10**30, streamed", _json(base, max_tokens=10**30, stream=True), names="max_tokens"),
            case("n=10**12", _json(base, n=10**12), names="max_n = 16"),  # the deployment's cap, before vLLM
            case("temperature=1e400", good[:-1] + b', "temperature": 1e400}', names="temperature"),
            case("temperature=NaN", good[:-1] + b', "temperature": NaN}', names="temperature"),
            case("stream_options='x', streamed", _json(base, stream=True, stream_options="x"), names="stream_options"),
            case("stream_options='x', not streamed", _json(base, stream=False, stream_options="x"),
                 names="stream_options"),
            case("stream_options=[1], streamed", _json(base, stream=True, stream_options=[1]), names="stream_options"),
            case("stop=[1], streamed", _json(base, stream=True, stop=[1]), names="stop"),
            case("min_tokens='x', streamed", _json(base, stream=True, min_tokens="x"), names="min_tokens"),
            case("bad UTF-8", good[:-1] + b', "user": "\xff\xfe\xc3("}', names="UTF-8"),
            case("bad UTF-8, streamed", good[:-1] + b', "stream": true, "user": "\xff\xfe"}', names="UTF-8"),
            case("bad UTF-8 as text/plain", good[:-1] + b', "user": "\xff"}', content_type="text/plain"),
            case("empty body", b""),
            case("content-type text/plain", good, content_type="text/plain"),
            case("content-type form", good, content_type="application/x-www-form-urlencoded"),
            case("unknown field", _json(base, frobnicate={"a": 1}), accepted=True),
            case("unknown field, streamed", _json(base, frobnicate=1, stream=True), accepted=True),
        ]
        if path == CHAT:
            wizard = [{"role": "wizard", "content": "hi"}]
            cases += [  # vLLM takes any role (chat templates know roles OpenAI's API has not) and no content
                case("role='wizard'", _json(base, messages=wizard), accepted=True),
                case("role='wizard', streamed", _json(base, stream=True, messages=wizard), accepted=True),
                case("message without content", _json(base, messages=[{"role": "user"}]), accepted=True),
                case("message without role", _json(base, messages=[{"content": "hi"}]), names="role"),
                case("message not an object", _json(base, messages=["hi"])),
                case("role=5", _json(base, messages=[{"role": 5, "content": "hi"}])),
                case("content=5", _json(base, messages=[{"role": "user", "content": 5}])),
            ]
    return cases


CASES = _cases()


def _send(client: httpx.Client, url: str, case: Case) -> httpx.Response:
    headers = {"Content-Type": case.content_type} if case.content_type else {}
    return client.post(url + case.path, content=case.body, headers=headers)


def _problems(case: Case, response: httpx.Response) -> list[str]:
    """What is wrong with the endpoint's answer to one case (none: right)."""
    text = response.text
    problems = []
    if "Traceback" in text or 'File "' in text:
        problems.append(f"a traceback in the body: {text[:300]!r}")
    if case.accepted:
        if response.status_code != 200:
            problems.append(f"status {response.status_code}, not 200: {text[:300]!r}")
        return problems
    if not 400 <= response.status_code < 500:
        problems.append(f"status {response.status_code}, not 4xx: {text[:300]!r}")
    if not response.headers.get("content-type", "").startswith("application/json"):
        problems.append(f"content-type {response.headers.get('content-type')!r}, not JSON")
    try:
        error = json.loads(text)["error"]
        if not (isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
                and "code" in error):
            problems.append(f"not OpenAI's error shape: {text[:300]!r}")
        elif case.names.lower() not in error["message"].lower():
            problems.append(f"the message does not name {case.names!r}: {error['message'][:300]!r}")
    except (ValueError, KeyError, TypeError):
        problems.append(f"not OpenAI's error shape: {text[:300]!r}")
    return problems


class GoodTraffic(threading.Thread):
    """A keyed client's good requests in a loop: a completion, then a streamed chat, until stopped."""

    def __init__(self, url: str, key: str):
        super().__init__(daemon=True)
        self.url, self.key = url, key
        self.stopping = threading.Event()
        self.ok = 0
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=GOOD_TIMEOUT_S,
                          headers={"Authorization": f"Bearer {self.key}"}) as client:
            i = 0
            while not self.stopping.is_set():
                i += 1
                try:
                    self.one(client, i)
                    self.ok += 1
                except Exception as exc:  # noqa: BLE001 - every failure is the finding: kept, the loop goes on
                    self.failures.append(f"request {i}: {exc!r}"[:400])

    @staticmethod
    def one(client: httpx.Client, i: int) -> None:
        if i % 2:
            r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": f"good request {i}", "max_tokens": 4,
                                               "temperature": 0})
            assert r.status_code == 200, (r.status_code, r.text[:300])
            body = r.json()
            assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 4, body
            return
        with client.stream("POST", CHAT, json={"model": "tiny", "max_tokens": 4, "stream": True,
                                               "messages": [{"role": "user", "content": f"good request {i}"}]}) as r:
            assert r.status_code == 200, (r.status_code, r.read()[:300])
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", events[-3:]
        assert any(json.loads(e[6:]).get("choices") and json.loads(e[6:])["choices"][0]["delta"].get("content")
                   for e in events[:-1]), events


@pytest.fixture(scope="module")
def endpoint(local_deployment):
    assert local_deployment["up"].returncode == 0, local_deployment["up"].stderr
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {local_deployment['key']}"}) as client:
        yield local_deployment, client


@pytest.fixture(scope="module")
def good_traffic(endpoint):
    deployment, _ = endpoint
    traffic = GoodTraffic(deployment["url"], deployment["key"])
    traffic.start()
    deadline = time.monotonic() + GOOD_TIMEOUT_S
    while traffic.ok == 0 and not traffic.failures and time.monotonic() < deadline:  # serving before any bad input
        time.sleep(0.05)
    yield traffic
    traffic.stopping.set()
    traffic.join(GOOD_TIMEOUT_S)


@pytest.fixture(scope="module")
def report():
    lines: list[dict] = []
    yield lines
    if os.environ.get("HPCSERVE_BAD_INPUT_REPORT"):
        with open(os.environ["HPCSERVE_BAD_INPUT_REPORT"], "w") as out:
            out.writelines(json.dumps(line) + "\n" for line in lines)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_gets_an_openai_4xx(endpoint, good_traffic, report, case):
    deployment, client = endpoint
    started = time.monotonic()
    response = _send(client, deployment["url"], case)
    line = {"case": case.name, "status": response.status_code, "s": round(time.monotonic() - started, 3),
            "body": response.text[:240]}
    if os.environ.get("HPCSERVE_BAD_INPUT_REPORT"):  # the same request to vLLM itself, past the data plane
        direct = _send(client, deployment["status"]["replicas"][0]["url"], case)
        line.update(vllm_status=direct.status_code, vllm_body=direct.text[:240])
    report.append(line)
    problems = _problems(case, response)
    assert not problems, f"{case.name}: " + "; ".join(problems)


def test_good_requests_beside_the_bad_ones_all_succeed(good_traffic):
    done = good_traffic.ok
    deadline = time.monotonic() + GOOD_TIMEOUT_S
    while good_traffic.ok < done + 2 and good_traffic.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)  # still serving after the last bad input
    good_traffic.stopping.set()
    good_traffic.join(GOOD_TIMEOUT_S)
    assert not good_traffic.failures, good_traffic.failures
    assert good_traffic.ok >= done + 2 >= 3, (done, good_traffic.ok)
