"""vLLM's sleep mode against a restart, on the GPU device (issue "zero": GPUs held only while they serve).

usage: sleep_wake.py PHASE... [--budget S] [--dir D] [--out O]
  starts   plain `vllm serve` to its first completion: cold (empty compile caches VLLM_CACHE_ROOT,
           TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR; model files evicted from the page cache; on a
           fresh machine also no .pyc of vLLM) then warm (the caches of the cold run, files in the page cache)
  sleep    one engine with --enable-sleep-mode (warm start): 3 x (POST /sleep?level=1, POST /wake_up,
           first completion), then level 2 (POST /sleep?level=2, /wake_up?tags=weights, /collective_rpc
           reload_weights, /wake_up?tags=kv_cache, first completion); GPU memory, the engine's host RSS
           and the machine's MemAvailable awake / asleep; a request sent to a sleeping engine; greedy
           output compared before / after each wake
  swap     two engines of the 8B shape on the one GPU that do not both fit awake (each
           --gpu-memory-utilization ZERO_SWAP_UTIL, 0.80): A starts, sleeps; B starts (A asleep), sleeps;
           A wakes; 8 closed-loop streams on A; swap 1: A sleeps (mode=abort), B wakes, first request to B
           (its TTFT from the swap's start); 8 streams on B; swap 2: B sleeps (mode=wait: its streams
           finish first), A wakes, first request to A
  all      starts sleep swap
Phases run in this order, each only if its estimate fits the budget left (else it and the later ones
wait for the next call); a phase done (recorded in DIR/done) is not run again, so the same command in a
later call runs what was left. Results: DIR/results.jsonl (one line per
measurement, every call), OUT/zero.json (all of them), OUT/summary.txt, OUT/logs_<phase>.tar.gz.

Environment: ZERO_VLLM (the server command, default `vllm`; a dry run puts vllm_standin.py here),
ZERO_MODEL (the model folder), ZERO_COMMON (flags of every server), ZERO_SWAP_UTIL, ZERO_STREAMS (8),
ZERO_PROMPT (prompt words of the streams, 256), ZERO_OUT_TOKENS (256), ZERO_LOAD_S (15), ZERO_CYCLES (3).
Stops only the processes it started, by pid (and their descendants).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import aiohttp
import device_util

try:
    import psutil
except ImportError:  # the device image has it; a dry run may not
    psutil = None

HERE = Path(__file__).resolve().parent
T0 = time.monotonic()
ENV_COMMON = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
              "VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
              "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
              "TOKENIZERS_PARALLELISM": "false", "VLLM_SERVER_DEV_MODE": "1"}
SLEEP_PATTERNS = {  # what a server's log says of its sleeps, beside device_util's start figures
    "sleep_freed_gib": r"sleep freed ([\d.]+) GiB memory in total",
    "sleep_backed_up_gib": r"of which ([\d.]+) GiB is backed up in CPU",
}
ESTIMATE = {"starts": 330, "sleep": 200, "swap": 300}  # seconds a phase needs (warm compile cache)


class Ctx:
    def __init__(self, a):
        self.budget = a.budget
        self.dir = Path(a.dir)
        self.out = Path(a.out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results = self.dir / "results.jsonl"
        self.summary = self.out / "summary.txt"
        self.model = os.environ.get("ZERO_MODEL") or str(base_dir(self.dir) / "llama8b")
        self.vllm = shlex.split(os.environ.get("ZERO_VLLM", "vllm"))
        self.common = shlex.split(os.environ.get(
            "ZERO_COMMON", "--host 127.0.0.1 --dtype bfloat16 --max-model-len 2048 --disable-custom-all-reduce"))
        self.cache = self.dir / "vcache"
        self.logs = self.dir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.servers: list[Server] = []

    def left(self) -> float:
        return self.budget - (time.monotonic() - T0)

    def log(self, msg: str) -> None:
        line = f"[+{time.monotonic() - T0:6.1f}s] {msg}"
        print(line, flush=True)
        with open(self.summary, "a") as f:
            f.write(line + "\n")

    def rec(self, **kw) -> dict:
        kw.setdefault("at", time.strftime("%Y-%m-%dT%H:%M:%S"))
        with open(self.results, "a") as f:
            f.write(json.dumps(kw) + "\n")
        self.log("RESULT " + json.dumps(kw)[:900])
        return kw


def base_dir(state: Path) -> Path:
    """A disk-backed folder with room for the 16 GB model (tmpfs pages cannot be evicted: no cold read)."""
    f = state / "base"
    if f.exists():
        return Path(f.read_text().strip())
    best, best_free = None, 0
    for d in ("/tmp", "/var/tmp", "/root", "/opt", "/home"):
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            continue
        fs = subprocess.run(["stat", "-f", "-c", "%T", d], capture_output=True, text=True).stdout.strip()
        free = shutil.disk_usage(d).free
        if fs not in ("tmpfs", "ramfs") and free > best_free:
            best, best_free = d, free
    b = Path(best or "/tmp") / "zero-data"
    b.mkdir(parents=True, exist_ok=True)
    f.write_text(str(b))
    return b


# ------------------------------------------------------------------ measurements of the machine
def gpu_mem() -> dict | None:
    """nvidia-smi: the GPU's used / total MiB and each compute process's MiB."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        g = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20).stdout.split("\n")[0].split(",")
        p = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20).stdout
        procs = {}
        for line in p.splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) == 2 and parts[1].isdigit():
                procs[parts[0]] = int(parts[1])
        return {"used_mib": int(g[0]), "total_mib": int(g[1]), "procs_mib": procs}
    except (OSError, ValueError, IndexError, subprocess.SubprocessError) as e:
        return {"error": str(e)[:200]}


def mem_available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


def tree(pid: int) -> list:
    if psutil is None:
        return []
    try:
        p = psutil.Process(pid)
        return [p] + p.children(recursive=True)
    except psutil.Error:
        return []


def rss(pid: int) -> dict:
    """Host memory of a server's process tree: RSS of each process (API server, engine core), summed."""
    out, total = {}, 0
    for p in tree(pid):
        try:
            r = p.memory_info().rss
            name = " ".join(p.cmdline()[:3])[-60:] or p.name()
            out[f"{p.pid}:{name}"] = round(r / 2**30, 2)
            total += r
        except Exception:  # noqa: BLE001 (psutil.Error; a process may end under us)
            continue
    return {"rss_gib": round(total / 2**30, 2), "by_process": out}


def snapshot(label: str, servers: list) -> dict:
    return {"label": label, "gpu": gpu_mem(), "mem_available_gib": mem_available_gib(),
            "host": {s.name: rss(s.proc.pid) for s in servers if s.proc and s.proc.poll() is None}}


def pagecache(cmd: str, path: str) -> dict:
    r = subprocess.run([sys.executable, str(HERE / "pagecache.py"), cmd, path], capture_output=True, text=True)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": (r.stderr or r.stdout)[-300:]}


def logstats(path: Path) -> dict:
    out = device_util.logstats(str(path), {**device_util.LOG_PATTERNS, **SLEEP_PATTERNS})
    if "log" not in out:
        errs = [ln for ln in path.read_text(errors="replace").splitlines() if re.search(r"Traceback|ERROR|Error:", ln)]
        if errs:
            out["first_error"] = errs[0][-300:]
    return out


# ------------------------------------------------------------------ servers
class Server:
    def __init__(self, ctx: Ctx, name: str, port: int, extra: list[str], sleep_mode: bool, tag: str):
        self.ctx, self.name, self.port, self.tag = ctx, name, port, tag
        self.url = f"http://127.0.0.1:{port}"
        self.args = ctx.vllm + ["serve", ctx.model, "--served-model-name", name, "--port", str(port)] + ctx.common + extra
        if sleep_mode:
            self.args.append("--enable-sleep-mode")
        self.logf = ctx.logs / f"{tag}.log"
        self.proc: subprocess.Popen | None = None
        self.t_start = 0.0

    def start(self) -> None:
        env = dict(os.environ, **ENV_COMMON)
        c = str(self.ctx.cache)
        env.update({"VLLM_CACHE_ROOT": c, "TRITON_CACHE_DIR": c + "/triton", "TORCHINDUCTOR_CACHE_DIR": c + "/inductor",
                    "VLLM_PORT": str(30000 + 1000 * (self.port % 10)),
                    "VLLM_DP_MASTER_PORT": str(40000 + 1000 * (self.port % 10))})
        self.ctx.log(f"start {self.tag}: {' '.join(self.args)}")
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(self.args, stdout=open(self.logf, "w"), stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL)
        self.ctx.servers.append(self)
        (self.ctx.dir / f"pid.{self.tag}").write_text(str(self.proc.pid))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if not self.proc:
            return
        procs = tree(self.proc.pid)
        for p in procs:
            try:
                p.terminate()
            except Exception:  # noqa: BLE001
                pass
        if psutil is not None and procs:
            _, alive = psutil.wait_procs(procs, timeout=20)
            for p in alive:
                try:
                    p.kill()
                except Exception:  # noqa: BLE001
                    pass
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        (self.ctx.dir / f"pid.{self.tag}").unlink(missing_ok=True)
        if self in self.ctx.servers:
            self.ctx.servers.remove(self)


def leftovers(ctx: Ctx) -> None:
    """A server that a call cut off left behind holds the GPU: stop it (by the pid this driver recorded)."""
    for f in ctx.dir.glob("pid.*"):
        try:
            pid = int(f.read_text())
        except ValueError:
            continue
        if psutil is not None and psutil.pid_exists(pid):
            try:
                if "serve" in " ".join(psutil.Process(pid).cmdline()):
                    ctx.log(f"stopping leftover server pid {pid} ({f.name})")
                    procs = tree(pid)
                    for p in procs:
                        p.terminate()
                    _, alive = psutil.wait_procs(procs, timeout=20)
                    for p in alive:
                        p.kill()
            except psutil.Error:
                pass
        f.unlink(missing_ok=True)


def prompt(n: int, seed: int) -> str:
    r = random.Random(seed)
    return " ".join(f"w{r.randrange(3, 10000)}" for _ in range(n))


async def complete(session, srv: Server, text: str, max_tokens: int, timeout: float = 60, stream: bool = True) -> dict:
    """One completion, streamed: status, TTFT, end time, tokens (chunks), finish reason, text (greedy)."""
    body = {"model": srv.name, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    t0 = time.monotonic()
    res = {"status": None, "ttft_s": None, "e2e_s": None, "chunks": 0, "finish": None, "text": "", "error": None}
    try:
        async with session.post(srv.url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            res["status"] = r.status
            if r.status != 200:
                res["error"] = (await r.text())[:300]
            elif not stream:
                d = await r.json()
                res["ttft_s"] = time.monotonic() - t0
                res["text"] = d["choices"][0]["text"]
                res["finish"] = d["choices"][0].get("finish_reason")
            else:
                async for raw in r.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        d = json.loads(data)
                    except ValueError:
                        continue
                    if "error" in d:
                        res["error"] = str(d["error"])[:300]
                        continue
                    for ch in d.get("choices") or []:
                        if ch.get("text"):
                            if res["ttft_s"] is None:
                                res["ttft_s"] = time.monotonic() - t0
                            res["chunks"] += 1
                            res["text"] += ch["text"]
                        if ch.get("finish_reason"):
                            res["finish"] = ch["finish_reason"]
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        res["error"] = f"{type(e).__name__}: {e}"[:300]
    res["e2e_s"] = time.monotonic() - t0
    res["t_end"] = time.monotonic()
    return res


async def wait_ready(session, srv: Server, deadline_s: float) -> tuple[bool, float]:
    """Until a completion answers (hpcserve's readiness rule): (ok, seconds since the process started)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not srv.alive():
            return False, time.monotonic() - srv.t_start
        r = await complete(session, srv, "w11 w12 w13 w14", 4, timeout=10, stream=False)
        if r["status"] == 200:
            return True, time.monotonic() - srv.t_start
        await asyncio.sleep(0.2)
    return False, time.monotonic() - srv.t_start


async def post(session, srv: Server, path: str, body: dict | None = None, timeout: float = 300) -> dict:
    t0 = time.monotonic()
    try:
        async with session.post(srv.url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            text = await r.text()
            return {"status": r.status, "s": round(time.monotonic() - t0, 3), "body": text[:200]}
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return {"status": None, "s": round(time.monotonic() - t0, 3), "error": f"{type(e).__name__}: {e}"[:200]}


async def is_sleeping(session, srv: Server):
    try:
        async with session.get(srv.url + "/is_sleeping", timeout=aiohttp.ClientTimeout(total=10)) as r:
            return (await r.json()).get("is_sleeping")
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
        return f"error: {e}"[:100]


async def gpu_free(ctx: Ctx, limit_mib: int = 1500, wait_s: float = 60) -> None:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        g = gpu_mem()
        if not g or "used_mib" not in g or g["used_mib"] < limit_mib:
            return
        await asyncio.sleep(0.5)
    ctx.log(f"warning: GPU memory still in use: {gpu_mem()}")


def r3(x):
    return None if x is None else round(x, 3)


# ------------------------------------------------------------------ phase: starts
async def phase_starts(ctx: Ctx, session) -> None:
    for case in ("cold", "warm"):
        need = 200 if case == "cold" else 120
        if ctx.left() < need:
            ctx.rec(phase="starts", case=case, ok=False, skipped=f"{ctx.left():.0f} s left")
            continue
        await gpu_free(ctx)
        if case == "cold":
            shutil.rmtree(ctx.cache, ignore_errors=True)
            pc = pagecache("evict", ctx.model)
        else:
            pc = pagecache("resident", ctx.model)
        ctx.cache.mkdir(parents=True, exist_ok=True)
        srv = Server(ctx, "m", 8001, [], sleep_mode=False, tag=f"start_{case}")
        srv.start()
        ok, ready = await wait_ready(session, srv, min(480, ctx.left() - 15))
        snap = snapshot("awake", [srv])
        srv.stop()
        ctx.rec(phase="starts", case=case, ok=ok, ready_s=round(ready, 1), pagecache=pc, log=logstats(srv.logf),
                gpu=snap["gpu"], host=snap["host"])
        if not ok:
            ctx.log("---- tail of " + str(srv.logf) + "\n" + tail(srv.logf))


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])[-4000:]
    except OSError:
        return "(no log)"


# ------------------------------------------------------------------ phase: sleep
async def phase_sleep(ctx: Ctx, session) -> None:
    await gpu_free(ctx)
    pc = pagecache("resident", ctx.model)
    srv = Server(ctx, "m", 8001, [], sleep_mode=True, tag="sleep")
    srv.start()
    ok, ready = await wait_ready(session, srv, min(400, ctx.left() - 15))
    ctx.rec(phase="sleep", step="start", ok=ok, ready_s=round(ready, 1), pagecache=pc, log=logstats(srv.logf))
    if not ok:
        ctx.log("---- tail of " + str(srv.logf) + "\n" + tail(srv.logf))
        srv.stop()
        return
    probe = prompt(64, 7)
    ref = await complete(session, srv, probe, 32)  # greedy reference output
    base = [await complete(session, srv, prompt(256, 100 + i), 16) for i in range(3)]
    awake0 = snapshot("awake", [srv])
    ctx.rec(phase="sleep", step="awake", ttft_ms=[r3(1e3 * b["ttft_s"]) if b["ttft_s"] else None for b in base],
            snapshot=awake0)
    cycles = int(os.environ.get("ZERO_CYCLES", "3"))
    for i in range(1, cycles + 1):
        if ctx.left() < 40:
            ctx.rec(phase="sleep", step="level1", cycle=i, ok=False, skipped=f"{ctx.left():.0f} s left")
            break
        s = await post(session, srv, "/sleep?level=1")
        sl = await is_sleeping(session, srv)
        asleep = snapshot("asleep", [srv])
        during = None
        if i == cycles:  # what a request to a sleeping engine gets (3 s, then the client gives up)
            during = await complete(session, srv, "w11 w12 w13", 4, timeout=3, stream=False)
            during = {k: during[k] for k in ("status", "error", "e2e_s")}
            await asyncio.sleep(0.5)
        t0 = time.monotonic()
        w = await post(session, srv, "/wake_up")
        t_woke = time.monotonic()
        first = await complete(session, srv, prompt(256, 200 + i), 16)
        again = await complete(session, srv, probe, 32)
        awake = snapshot("awake", [srv])
        ctx.rec(phase="sleep", step="level1", cycle=i, ok=w["status"] == 200 and first["status"] == 200,
                sleep_s=s["s"], sleep_status=s["status"], is_sleeping=sl, wake_s=w["s"], wake_status=w["status"],
                first_ttft_ms=r3(1e3 * first["ttft_s"]) if first["ttft_s"] else None,
                wake_to_first_token_s=r3(first["t_end"] - t0 - first["e2e_s"] + (first["ttft_s"] or 0)),
                wake_to_woke_s=r3(t_woke - t0), same_output=again["text"] == ref["text"], request_while_asleep=during,
                asleep=asleep, awake=awake, first_error=first["error"])
    levels2 = int(os.environ.get("ZERO_LEVEL2", "1"))
    for i in range(1, levels2 + 1):
        if ctx.left() < 45:
            ctx.rec(phase="sleep", step="level2", cycle=i, ok=False, skipped=f"{ctx.left():.0f} s left")
            break
        s = await post(session, srv, "/sleep?level=2")
        sl = await is_sleeping(session, srv)
        asleep = snapshot("asleep", [srv])
        t0 = time.monotonic()
        w1 = await post(session, srv, "/wake_up?tags=weights")
        rl = await post(session, srv, "/collective_rpc", {"method": "reload_weights"})
        w2 = await post(session, srv, "/wake_up?tags=kv_cache")
        t_woke = time.monotonic()
        first = await complete(session, srv, prompt(256, 300 + i), 16)
        again = await complete(session, srv, probe, 32)
        awake = snapshot("awake", [srv])
        ctx.rec(phase="sleep", step="level2", cycle=i, ok=all(x["status"] == 200 for x in (w1, rl, w2, first)),
                sleep_s=s["s"], sleep_status=s["status"], is_sleeping=sl, wake_weights_s=w1["s"],
                reload_weights_s=rl["s"], reload=rl, wake_kv_s=w2["s"], wake_to_woke_s=r3(t_woke - t0),
                first_ttft_ms=r3(1e3 * first["ttft_s"]) if first["ttft_s"] else None,
                wake_to_first_token_s=r3(first["t_end"] - t0 - first["e2e_s"] + (first["ttft_s"] or 0)),
                same_output=again["text"] == ref["text"], asleep=asleep, awake=awake, first_error=first["error"])
    srv.stop()
    ctx.rec(phase="sleep", step="log", log=logstats(srv.logf))


# ------------------------------------------------------------------ phase: swap
class Load:
    """N closed-loop streams on one server until stopped; every request's outcome is kept."""

    def __init__(self, session, srv: Server, n: int, words: int, out_tokens: int):
        self.session, self.srv, self.n, self.words, self.out = session, srv, n, words, out_tokens
        self.stopping = False
        self.done: list[dict] = []
        self.tasks: list[asyncio.Task] = []
        self.seq = 0

    async def _worker(self, k: int) -> None:
        while not self.stopping:
            self.seq += 1
            t_sent = time.monotonic()
            r = await complete(self.session, self.srv, prompt(self.words, 1000 * k + self.seq), self.out, timeout=120)
            r["t_sent"] = t_sent
            r.pop("text", None)
            self.done.append(r)
            if r["status"] != 200 and not self.stopping:
                await asyncio.sleep(0.2)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._worker(k)) for k in range(self.n)]

    def stop_new(self) -> None:
        self.stopping = True

    async def drain(self, timeout: float = 60) -> int:
        """Until the streams in flight have ended; those still open after `timeout` are cancelled (counted)."""
        _, pending = await asyncio.wait(self.tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        return len(pending)

    def report(self, t_swap: float | None) -> dict:
        """Requests finished before the swap; those in flight when it was asked and how they ended."""
        before = [r for r in self.done if t_swap is None or r["t_end"] < t_swap]
        inflight = [r for r in self.done if t_swap is not None and r["t_sent"] < t_swap <= r["t_end"]]
        ok = [r for r in before if r["status"] == 200 and r["finish"] == "length"]
        ttft = sorted(r["ttft_s"] for r in ok if r["ttft_s"])
        span = (max(r["t_end"] for r in before) - min(r["t_sent"] for r in before)) if before else 0
        out = {"finished_before_swap": len(before), "ok_before_swap": len(ok),
               "ttft_p50_ms": r3(1e3 * ttft[len(ttft) // 2]) if ttft else None,
               "ttft_max_ms": r3(1e3 * ttft[-1]) if ttft else None,
               "tokens_per_s": round(sum(r["chunks"] for r in ok) / span, 1) if span else None}
        if t_swap is not None:
            out["in_flight_at_swap"] = len(inflight)
            out["in_flight_outcomes"] = {}
            for r in inflight:
                key = f"{r['status']}/{r['finish']}" + ("/error" if r["error"] else "")
                out["in_flight_outcomes"][key] = out["in_flight_outcomes"].get(key, 0) + 1
            out["in_flight_tokens"] = [r["chunks"] for r in inflight]
            out["in_flight_end_after_swap_s"] = [r3(r["t_end"] - t_swap) for r in inflight]
            out["in_flight_errors"] = sorted({(r["error"] or "")[:120] for r in inflight if r["error"]})
        return out


async def swap(ctx: Ctx, session, frm: Server, to: Server, mode: str, label: str, load: Load) -> dict:
    t0 = time.monotonic()
    load.stop_new()  # what a router does: no new request to the engine that goes to sleep
    s = await post(session, frm, f"/sleep?level=1&mode={mode}")
    t_slept = time.monotonic()
    w = await post(session, to, "/wake_up")
    t_woke = time.monotonic()
    first = await complete(session, to, prompt(256, 5000 + len(label)), 16)
    hung = await load.drain()
    rep = load.report(t0)
    rep["still_open_after_60s"] = hung
    snap = snapshot("after_swap", [frm, to])
    return ctx.rec(phase="swap", step=label, mode=mode, ok=s["status"] == 200 and w["status"] == 200 and first["status"] == 200,
                   sleep_s=s["s"], wake_s=w["s"], swap_to_slept_s=r3(t_slept - t0), swap_to_woke_s=r3(t_woke - t0),
                   first_ttft_ms=r3(1e3 * first["ttft_s"]) if first["ttft_s"] else None,
                   swap_to_first_token_s=r3(first["t_end"] - first["e2e_s"] + (first["ttft_s"] or 0) - t0)
                   if first["ttft_s"] else None, first_error=first["error"], streams=rep, snapshot=snap)


async def phase_swap(ctx: Ctx, session) -> None:
    util = os.environ.get("ZERO_SWAP_UTIL", "0.80")
    n = int(os.environ.get("ZERO_STREAMS", "8"))
    words = int(os.environ.get("ZERO_PROMPT", "256"))
    out_tokens = int(os.environ.get("ZERO_OUT_TOKENS", "256"))
    load_s = float(os.environ.get("ZERO_LOAD_S", "15"))
    await gpu_free(ctx)
    extra = ["--gpu-memory-utilization", util]
    a = Server(ctx, "a", 8001, extra, sleep_mode=True, tag="swap_a")
    b = Server(ctx, "b", 8002, extra, sleep_mode=True, tag="swap_b")
    try:
        a.start()
        ok, ready = await wait_ready(session, a, min(400, ctx.left() - 15))
        ctx.rec(phase="swap", step="start_a", ok=ok, ready_s=round(ready, 1), log=logstats(a.logf), snapshot=snapshot("a_awake", [a]))
        if not ok:
            ctx.log(tail(a.logf))
            return
        s = await post(session, a, "/sleep?level=1")
        b.start()
        ok, ready = await wait_ready(session, b, min(400, ctx.left() - 15))
        ctx.rec(phase="swap", step="start_b_while_a_asleep", ok=ok, ready_s=round(ready, 1), a_sleep_s=s["s"],
                log=logstats(b.logf), snapshot=snapshot("a_asleep_b_awake", [a, b]))
        if not ok:
            ctx.log(tail(b.logf))
            return
        s = await post(session, b, "/sleep?level=1")
        w = await post(session, a, "/wake_up")
        first = await complete(session, a, prompt(256, 4000), 16)
        ctx.rec(phase="swap", step="b_asleep_a_awake", ok=first["status"] == 200, b_sleep_s=s["s"], a_wake_s=w["s"],
                first_ttft_ms=r3(1e3 * first["ttft_s"]) if first["ttft_s"] else None, snapshot=snapshot("b_asleep_a_awake", [a, b]))
        if ctx.left() < load_s * 2 + 60:
            ctx.log("swap runs skipped: no time left")
            return
        load = Load(session, a, n, words, out_tokens)
        load.start()
        await asyncio.sleep(load_s)
        rec1 = await swap(ctx, session, a, b, "abort", "swap_a_to_b", load)
        load = Load(session, b, n, words, out_tokens)
        load.start()
        await asyncio.sleep(load_s)
        rec2 = await swap(ctx, session, b, a, "wait", "swap_b_to_a", load)
        ctx.log(f"swap 1 (abort): first token on B {rec1.get('swap_to_first_token_s')} s after the swap was asked; "
                f"swap 2 (wait): first token on A {rec2.get('swap_to_first_token_s')} s")
    finally:
        a.stop()
        b.stop()
        ctx.rec(phase="swap", step="logs", a=logstats(a.logf), b=logstats(b.logf))


# ------------------------------------------------------------------ main
PHASES = {"starts": phase_starts, "sleep": phase_sleep, "swap": phase_swap}


async def run(ctx: Ctx, phases: list[str]) -> None:
    done_f = ctx.dir / "done"
    done = set(done_f.read_text().split()) if done_f.exists() else set()
    async with aiohttp.ClientSession() as session:
        for ph in phases:
            if ph in done:
                ctx.log(f"phase {ph}: done in an earlier call")
                continue
            if ctx.left() < ESTIMATE[ph] * float(os.environ.get("ZERO_EST_SCALE", "1")):
                # in order: a later phase would warm the caches that `starts` must find cold
                ctx.log(f"phase {ph} and later ones skipped: {ctx.left():.0f} s left, {ph} needs ~{ESTIMATE[ph]} s "
                        "(the same command in the next call runs them)")
                break
            ctx.log(f"phase {ph} (model {ctx.model})")
            t0 = time.monotonic()
            try:
                await PHASES[ph](ctx, session)
            except Exception as e:  # noqa: BLE001 - keep the other phases and the results
                ctx.log(f"phase {ph} FAILED: {type(e).__name__}: {e}")
                import traceback

                ctx.log(traceback.format_exc()[-2000:])
            finally:
                for s in list(ctx.servers):
                    s.stop()
            with open(done_f, "a") as f:
                f.write(ph + "\n")
            ctx.log(f"phase {ph} ended after {time.monotonic() - t0:.0f} s")
            with tarfile.open(ctx.out / f"logs_{ph}.tar.gz", "w:gz") as tf:
                for lf in ctx.logs.glob("*.log"):
                    if lf.stat().st_mtime >= time.time() - (time.monotonic() - t0) - 5:
                        tf.add(lf, arcname=lf.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phases", nargs="+", choices=["starts", "sleep", "swap", "all"])
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--dir", default="/tmp/zero")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/zero/out"))
    a = ap.parse_args()
    phases = ["starts", "sleep", "swap"] if "all" in a.phases else a.phases
    ctx = Ctx(a)
    leftovers(ctx)
    ctx.log(f"sleep_wake.py {' '.join(phases)} budget {a.budget} s; GPU {gpu_mem()}; MemAvailable {mem_available_gib()} GiB")
    try:
        asyncio.run(run(ctx, phases))
    finally:
        for s in list(ctx.servers):
            s.stop()
        rows = [json.loads(x) for x in ctx.results.read_text().splitlines() if x.strip()] if ctx.results.exists() else []
        (ctx.out / "zero.json").write_text(json.dumps(rows, indent=1))
        ctx.log("==== table\n" + table(rows))


def table(rows: list[dict]) -> str:
    """The figures of the issue from every result so far."""
    out = []
    for r in rows:
        ph, st = r.get("phase"), r.get("step") or r.get("case")
        if ph == "starts":
            out.append(f"start {st}: ok={r.get('ok')} ready {r.get('ready_s')} s {r.get('skipped', '')} "
                       f"(weights {r.get('log', {}).get('weights_s')} s, compile cache {r.get('log', {}).get('compile_cache')}, "
                       f"page cache {r.get('pagecache', {}).get('resident_after', r.get('pagecache', {}).get('resident'))})")
        elif ph == "sleep" and st == "start":
            out.append(f"sleep-mode engine start: ok={r.get('ok')} ready {r.get('ready_s')} s")
        elif ph == "sleep" and st in ("level1", "level2"):
            gpu_a = ((r.get("asleep") or {}).get("gpu") or {}).get("used_mib")
            gpu_w = ((r.get("awake") or {}).get("gpu") or {}).get("used_mib")
            h_a = [v["rss_gib"] for v in ((r.get("asleep") or {}).get("host") or {}).values()]
            h_w = [v["rss_gib"] for v in ((r.get("awake") or {}).get("host") or {}).values()]
            out.append(f"{st} #{r.get('cycle')}: ok={r.get('ok')} sleep {r.get('sleep_s')} s, wake {r.get('wake_s', r.get('wake_to_woke_s'))} s, "
                       f"wake->first token {r.get('wake_to_first_token_s')} s, GPU MiB asleep {gpu_a} / awake {gpu_w}, "
                       f"host RSS GiB asleep {h_a} / awake {h_w}, same output {r.get('same_output')} {r.get('skipped', '')}")
        elif ph == "swap" and st and st.startswith("swap_"):
            s = r.get("streams") or {}
            out.append(f"{st} ({r.get('mode')}): ok={r.get('ok')} first token {r.get('swap_to_first_token_s')} s after the swap "
                       f"(sleep {r.get('sleep_s')} s, wake {r.get('wake_s')} s); streams before: {s.get('ok_before_swap')} ok, "
                       f"TTFT p50 {s.get('ttft_p50_ms')} ms, {s.get('tokens_per_s')} tok/s; in flight {s.get('in_flight_at_swap')}: "
                       f"{s.get('in_flight_outcomes')}")
        elif ph == "swap" and st and st.startswith("start_"):
            out.append(f"swap {st}: ok={r.get('ok')} ready {r.get('ready_s')} s")
    return "\n".join(out)


if __name__ == "__main__":
    main()
