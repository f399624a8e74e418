"""The trip `hpcserve up` makes through hpcserve's packages, measured on a real local `up`.

    .venv/bin/python scripts/trip.py [CONFIG]        up CONFIG traced (default examples/local.yaml), then down
    .venv/bin/python scripts/trip.py --from DIR      the trip of traces kept earlier (--keep DIR)

The trip follows `up`'s config through the code: every hpcserve function that holds the deployment's
config (its DeploymentConfig, a section, its Layout, or an object whose `cfg` is one: as an argument, or
from the call that made it) and every function such a function calls, in the order each is first entered, across the
processes `up` starts (the command, the endpoint's controller, the deployment's driver; merged by time),
until `up` returns. A function entered again (a loop, a poll) is not a new step. Left out: core's
toolbox (paths, files, keys, the registry: what every floor uses, like the standard library; core.config
is the trip's first step), the schema's own methods, comprehensions. The engines, the data plane and
Ray's nodes get command lines, not the config: they are where the trip ends.

    rooms    the top-level packages of hpcserve (and api.py) the trip enters
    stays    runs of consecutive steps in one room
    returns  stays in a room the trip had left before (stays - rooms)
    climbs   stays on a higher floor than the stay before (floors: the import-linter layers in
             pyproject.toml, cli on top, core at the bottom)

Tracing needs no change to the product: a sitecustomize.py on PYTHONPATH installs a profiler in every
process started as `python -m hpcserve...`. `up` starts vLLM: on a shared machine run it under the lock
(`flock /tmp/hpcserve-heavy.lock .venv/bin/python scripts/trip.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TRACE_ENV = "HPCSERVE_TRIP_DIR"
UP_FILE = "up.json"  # when `up` returned
CONFIG_MODULE = "hpcserve.core.config"

# Installed in each traced process before its main module runs: one JSON line per function the config
# passes through, at its first entry.
SITECUSTOMIZE = r'''
import json, os, sys, threading, time

_argv = getattr(sys, "orig_argv", [])
_main = _argv[_argv.index("-m") + 1] if "-m" in _argv[:-1] else ""
if os.environ.get("HPCSERVE_TRIP_DIR") and _main.startswith("hpcserve"):
    _out = open(os.path.join(os.environ["HPCSERVE_TRIP_DIR"], f"{os.getpid()}.jsonl"), "a", buffering=1)
    _seen, _entered, _lock = set(), {}, threading.Lock()
    _SCHEMA = "hpcserve.core.config"

    def _module(frame):
        module = frame.f_globals.get("__name__") or ""
        return _main if module == "__main__" else module  # python -m hpcserve.x runs x as __main__

    def _ours(frame):
        code = frame.f_code  # a function (not a module's or class's body, not a comprehension) of hpcserve
        return (code.co_flags & 1 and not code.co_name.startswith("<") and "__create_fn__" not in code.co_qualname
                and _module(frame).startswith("hpcserve"))

    def _is_config(value):
        if isinstance(value, tuple):
            return any(map(_is_config, value))
        return type(value).__module__ == _SCHEMA or type(getattr(value, "cfg", None)).__module__ == _SCHEMA

    def _holds(frame):
        return frame is not None and _ours(frame) and any(map(_is_config, frame.f_locals.values()))

    def _step(frame, kind, when):
        if (frame.f_code, kind) in _seen:
            return
        with _lock:
            _seen.add((frame.f_code, kind))
        _out.write(json.dumps({"t": when, "module": _module(frame), "function": frame.f_code.co_qualname,
                               "kind": kind}) + "\n")

    def _profile(frame, event, arg):
        if event == "call" and _ours(frame):
            _entered[frame] = now = time.time()
            if _holds(frame):
                _step(frame, "holds", now)
            if _holds(frame.f_back):
                _step(frame, "called", now)
        elif event == "return" and frame in _entered:
            started = _entered.pop(frame)
            if _is_config(arg):  # it made the config: so did its caller get it, from then on
                if frame.f_back is not None and _ours(frame.f_back):
                    _step(frame.f_back, "holds", started - 1e-6)
                _step(frame, "returns", started)

    sys.setprofile(_profile)
    threading.setprofile(_profile)
'''


@dataclass(frozen=True)
class Step:
    room: str  # hpcserve's top-level package (or api)
    module: str
    function: str


def room_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def floors() -> dict[str, int]:
    """Each room's floor: its layer's index in the import-linter contract (0: the top)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    layers = next(c["layers"] for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return {room_of(name.strip()): index for index, layer in enumerate(layers) for name in layer.split("|")}


def on_trip(module: str, function: str) -> bool:
    """Not the shared toolbox (core's modules but the config: hpcserve's standard library, used on every
    floor), not the schema's own methods (the config itself). Pure."""
    if module.startswith("hpcserve.core.") and module != CONFIG_MODULE:
        return False
    return not (module == CONFIG_MODULE and "." in function)


def read_trace(folder: Path) -> list[Step]:
    """The functions `up` entered, each at its first entry, every process's merged by time, until `up`
    returned (what the processes do afterwards, serving and stopping, is not `up`'s trip)."""
    returned = json.loads((folder / UP_FILE).read_text())["returned"]
    entries = [json.loads(line) for path in folder.glob("*.jsonl") for line in path.read_text().splitlines()]
    steps: dict[tuple[str, str], Step] = {}
    for entry in sorted(entries, key=lambda e: e["t"]):
        if entry["t"] <= returned and on_trip(entry["module"], entry["function"]):
            steps.setdefault((entry["module"], entry["function"]),
                             Step(room_of(entry["module"]), entry["module"], entry["function"]))
    return list(steps.values())


def stays(steps: list[Step]) -> list[list[Step]]:
    """Consecutive steps in one room, together. Pure."""
    runs: list[list[Step]] = []
    for step in steps:
        if runs and runs[-1][0].room == step.room:
            runs[-1].append(step)
        else:
            runs.append([step])
    return runs


def figures(runs: list[list[Step]], floor: dict[str, int]) -> dict[str, int]:
    """stays, rooms, returns and climbs of a trip (see the module's docstring). Pure."""
    rooms = [run[0].room for run in runs]
    climbs = sum(1 for before, now in zip(rooms, rooms[1:]) if floor.get(now, 99) < floor.get(before, 99))
    return {"stays": len(rooms), "rooms": len(set(rooms)), "returns": len(rooms) - len(set(rooms)),
            "climbs": climbs}


def report(steps: list[Step]) -> str:
    runs = stays(steps)
    lines = []
    for number, run in enumerate(runs, start=1):
        modules = ", ".join(dict.fromkeys(f"{s.module.removeprefix('hpcserve.')}.{s.function}" for s in run))
        lines.append(f"{number:3} {run[0].room:<11} {modules}")
    numbers = figures(runs, floors())
    lines.append(f"{numbers['stays']} stays in {numbers['rooms']} rooms, {numbers['returns']} returns, "
                 f"{numbers['climbs']} climbs")
    return "\n".join(lines)


def traced_up(config: Path, folder: Path, port: int | None) -> None:
    """`hpcserve up CONFIG` with every hpcserve process traced into `folder`, then `down` (untraced). The
    deployment is renamed (trip-NAME) and keeps its run folders in `folder`: a deployment of the same
    config that runs beside it is left alone."""
    raw = yaml.safe_load(config.read_text())
    raw.update(name=f"trip-{raw['name']}"[:40], results_dir=str(folder / "results"))
    if port:
        raw.setdefault("serve", {})["port"] = port
    traced_config = folder / "config.yaml"
    traced_config.write_text(yaml.safe_dump(raw))
    (folder / "site").mkdir()
    (folder / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, TRACE_ENV: str(folder),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(folder / "site"), os.environ.get("PYTHONPATH")]))}
    cli = [sys.executable, "-m", "hpcserve.cli"]
    try:
        subprocess.run([*cli, "up", str(traced_config)], env=env, check=True)
        (folder / UP_FILE).write_text(json.dumps({"returned": time.time()}))
    finally:
        subprocess.run([*cli, "down", raw["name"]], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", type=Path, default=REPO / "examples" / "local.yaml")
    parser.add_argument("--from", dest="source", type=Path, help="traces kept by an earlier --keep")
    parser.add_argument("--keep", type=Path, help="keep the traces in this new folder")
    parser.add_argument("--port", type=int, help="serve.port (default: the config's)")
    args = parser.parse_args()
    if args.source:
        print(report(read_trace(args.source)))
        return 0
    with tempfile.TemporaryDirectory(prefix="hpcserve-trip-") as tmp:
        folder = Path(tmp)
        traced_up(args.config.resolve(), folder, args.port)
        print(report(read_trace(folder)))
        if args.keep:
            args.keep.mkdir(parents=True)
            for trace in [*folder.glob("*.jsonl"), folder / UP_FILE]:
                (args.keep / trace.name).write_text(trace.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
