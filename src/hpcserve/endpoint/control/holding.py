"""What clients of an endpoint get while no replica can take their requests.

The data plane holds a request while none of its backends can take it (up to serve.hold_s, then 503 with
Retry-After), so clients wait rather than fail. The controller's state.json may still say `ready` then: in
a walltime handover whose successor is late, the old member is drained before its job's end whether the
successor serves or not; a replacement that is still loading leaves the pool empty the same way. `status`
says what clients get: it asks the data plane (GET /backends on its admin socket, the owner's alone), and
when no backend there can take a request the endpoint is `holding`, with the requests held now, the
member(s) it waits for and since when.

    read_backends(admin_socket, model)      the data plane's answer (for one model's room), or None where it
                                            does not answer
    read_models(admin_socket)               every model the data plane serves, with its state (GET /models)
    holding(answer, members, decisions)     None while a backend can take requests, else what clients get
    describe(hold, now)                     one line for `hpcserve status`
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from hpcserve.core.statuses import MemberStatus
from hpcserve.endpoint.protocol import BACKENDS, MODEL_PARAM, MODELS, Backends

ASK_TIMEOUT_S = 2.0


def read_backends(admin_socket: Path, model: str | None = None, timeout_s: float = ASK_TIMEOUT_S) -> dict | None:
    """GET /backends of the data plane (protocol.Backends' JSON), of one model's room (None: its own);
    None when its socket does not answer (stopped, restarting)."""
    return _ask(admin_socket, BACKENDS, {MODEL_PARAM: model} if model else {}, timeout_s)


def read_models(admin_socket: Path, timeout_s: float = ASK_TIMEOUT_S) -> list[dict] | None:
    """GET /models of the data plane: each model (protocol.ModelRoom's JSON); None when it does not answer."""
    answer = _ask(admin_socket, MODELS, {}, timeout_s)
    return answer.get("models") if answer else None


def _ask(admin_socket: Path, path: str, params: dict, timeout_s: float) -> dict | None:
    if not Path(admin_socket).exists():
        return None
    transport = httpx.HTTPTransport(uds=str(admin_socket))
    try:
        with httpx.Client(transport=transport, base_url="http://router", timeout=timeout_s, trust_env=False) as c:
            answer = c.get(path, params=params)
            return answer.json() if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, OSError):
        return None


def since_when(decisions: list[dict]) -> float | None:
    """When the last replica left the pool: the last `leave` after the last `join`; None when the
    decisions kept do not tell (the pool's backends are there but failing, or the leave is too old). Pure."""
    joined = max((d["time"] for d in decisions if d.get("action") == "join"), default=float("-inf"))
    left = [d["time"] for d in decisions if d.get("action") == "leave" and d["time"] >= joined]
    return max(left) if left else None


def waited_for(members: list[dict]) -> list[dict]:
    """The members that would serve next: those launching (a successor, a replacement, a scale-up). Pure."""
    return [{"name": m["name"], "role": m["role"], "runner": m.get("runner", ""), "note": m.get("note") or ""}
            for m in members if m.get("status") == MemberStatus.LAUNCHING]


def holding(answer: dict, members: list[dict], decisions: list[dict]) -> dict | None:
    """None while the data plane has a backend that takes requests; else what clients get: requests held
    now (each up to hold_s, then 503), since when, and the members it waits for. Pure.
    members: the member lines of `status` (name, role, status, runner, note)."""
    backends = Backends.from_json(answer)
    if backends.can_take_requests():
        return None
    return {"held": backends.held, "hold_s": backends.hold_s, "backends": len(backends.backends),
            "since": since_when(decisions),
            "waiting_for": waited_for(members)}


def describe(hold: dict, now: float | None = None) -> str:
    """`holding 2 request(s) since 21:05:10 (40 s): no replica takes requests, each held up to 60 s then
    503; waiting for sb-m3 [successor]: job 12 (Resources)`. Pure but for the local time zone."""
    now = time.time() if now is None else now
    since = hold.get("since")
    when = (f" since {time.strftime('%H:%M:%S', time.localtime(since))} ({now - since:.0f} s)"
            if since is not None else "")
    limit = f" up to {hold['hold_s']:g} s, then 503" if hold.get("hold_s") is not None else ""
    waits = [f"{m['name']} [{m['role']}]: {m['runner']}" + (f" ({m['note']})" if m["note"] else "")
             for m in hold["waiting_for"]]
    waiting = f"waiting for {'; '.join(waits)}" if waits else "no member is launching to serve next"
    return (f"holding {hold['held']} request(s){when}: no replica takes requests, each is held{limit}; "
            f"{waiting}")
