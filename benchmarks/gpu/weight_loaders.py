"""vLLM 0.26's own weight iterators, timed alone (no `vllm serve` around them).

usage: weight_loaders.py run VARIANT[,VARIANT...] MODEL_DIR [--stage-dir DIR]
           one process: each variant in turn, one JSON line each (vLLM imported once)
       weight_loaders.py all MODEL_DIR OUT.jsonl --logdir DIR [--budget S] [--stage-dir DIR] [--groups G;G;...]
           each group of variants in its own process (a crash in a native loader loses only that group),
           skipping a group that might not end within the budget; results appended to OUT.jsonl

Each variant iterates over every tensor of the checkpoint the way vLLM's loader does and puts it on the
GPU (CPU tensors: `.to('cuda')`, what the weight_loader's copy_ does; the GPU loaders yield GPU tensors),
keeps them all (as the model would), then synchronizes. Cold variants first drop the files' pages from
the page cache (posix_fadvise DONTNEED, pagecache.py). The CUDA context and the vLLM import are
made before the clock starts: they are the same for every loader.

Variants (the `--load-format` / option each one stands for in `vllm serve`):
  st_lazy          default loader (`auto`), safetensors mmap, cold page cache
  st_lazy_warm     the same, files already in the page cache (the loader's own cost)
  st_prefetch      `--safetensors-load-strategy prefetch` (8 threads read the files first; vLLM's default
                   on NFS/Lustre when the checkpoint fits in 90% of RAM)
  st_eager         `--safetensors-load-strategy eager` (whole file read, then parsed)
  st_mt8           `--model-loader-extra-config '{"enable_multithread_load": true, "num_threads": 8}'`
  runai            `--load-format runai_streamer` (runai-model-streamer, 16 reader threads by default)
  fastsafetensors  `--load-format fastsafetensors` (GDS if present, else pread + bounce buffer to GPU)
  instanttensor    `--load-format instanttensor` (io_uring / AIO direct I/O, pipelined to the GPU)
  stage            node-local staging: copy the files (4 in parallel) to --stage-dir, then st_lazy from
                   the copy (its pages are warm after the copy, as on a real node); copy removed after
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEV = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu" only for a dry run of this script without a GPU
sys.path.insert(0, str(HERE))
import pagecache as pc

DEFAULT_GROUPS = "st_lazy,runai,fastsafetensors,instanttensor;st_prefetch,stage,st_lazy_warm,st_mt8,st_eager"
# rough seconds a variant may take (cold read of 16 GB + copies); +15 s a process (imports). Budget check only.
GROUP_COST = {"st_lazy": 20, "runai": 20, "fastsafetensors": 20, "instanttensor": 20, "st_prefetch": 20,
              "stage": 40, "st_lazy_warm": 10, "st_mt8": 20, "st_eager": 25}
PROCESS_COST = 15


def iterator(variant: str, files: list[str]):
    from vllm.model_executor.model_loader import weight_utils as wu

    if variant in ("st_lazy", "st_lazy_warm", "stage"):
        return wu.safetensors_weights_iterator(files, False, None)
    if variant == "st_prefetch":
        return wu.safetensors_weights_iterator(files, False, "prefetch")
    if variant == "st_eager":
        return wu.safetensors_weights_iterator(files, False, "eager")
    if variant == "st_mt8":
        return wu.multi_thread_safetensors_weights_iterator(files, False, max_workers=8)
    if variant == "runai":
        return wu.runai_safetensors_weights_iterator(files, False, False)
    if variant == "fastsafetensors":
        return wu.fastsafetensors_weights_iterator(files, False)
    if variant == "instanttensor":
        return wu.instanttensor_weights_iterator(files, False)
    raise ValueError(f"unknown variant {variant}")


def load_all(variant: str, files: list[str]) -> dict:
    import torch

    kept, nbytes, on_gpu = [], 0, 0
    t0 = time.perf_counter()
    for _name, t in iterator(variant, files):
        if t.device.type != "cuda":
            t = t.to(DEV) if DEV != "cpu" else t.clone()
        else:
            on_gpu += 1
        nbytes += t.numel() * t.element_size()
        kept.append(t)
    if DEV != "cpu":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = len(kept)
    del kept
    if DEV != "cpu":
        torch.cuda.empty_cache()
    return {"seconds": round(dt, 2), "tensors": n, "yielded_on_gpu": on_gpu, "bytes": nbytes,
            "gb_s": round(nbytes / 1e9 / dt, 2)}


def copy_files(src: Path, dst: Path) -> float:
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    t0 = time.perf_counter()
    names = [p for p in src.iterdir() if p.is_file()]
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda p: shutil.copyfile(p, dst / p.name), names))
    return time.perf_counter() - t0


def run_variants(variants: list[str], model: Path, stage_dir: Path | None) -> None:
    import torch

    t0 = time.perf_counter()
    if DEV != "cpu":
        torch.cuda.set_device(0)
        torch.zeros(1, device=DEV)
    t1 = time.perf_counter()
    from vllm.model_executor.model_loader import weight_utils  # noqa: F401  (import before the clock)

    setup = {"cuda_init_s": round(t1 - t0, 2), "vllm_import_s": round(time.perf_counter() - t1, 2)}
    files = [str(p) for p in pc.files_of([str(model)])]
    expected = json.loads((model / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    for v in variants:
        if v == "_crash":  # test hook: a loader that takes the process down
            os._exit(3)
        rec: dict = {"phase": "micro", "variant": v, **setup}
        try:
            if v == "stage":
                if stage_dir is None:
                    raise ValueError("stage needs --stage-dir")
                rec["cache"] = pc.evict(pc.files_of([str(model)]))
                copy_s = copy_files(model, stage_dir)
                staged = [str(p) for p in pc.files_of([str(stage_dir)])]
                rec["resident_staged"] = pc.resident(pc.files_of([str(stage_dir)]))
                res = load_all(v, staged)
                res["copy_s"] = round(copy_s, 2)
                res["load_s"] = res["seconds"]
                res["seconds"] = round(copy_s + res["seconds"], 2)
                shutil.rmtree(stage_dir, ignore_errors=True)
            else:
                if v == "st_lazy_warm":
                    if pc.resident(pc.files_of(files)) < 0.99:
                        pc.readbw(pc.files_of(files))
                    rec["cache"] = {"method": "warm", "resident_before": pc.resident(pc.files_of(files))}
                else:
                    rec["cache"] = pc.evict(pc.files_of(files))
                res = load_all(v, files)
            rec.update(res)
            rec["ok"] = res["bytes"] == expected
            if not rec["ok"]:
                rec["error"] = f"bytes {res['bytes']} != checkpoint {expected}"
        except Exception as e:  # noqa: BLE001 -- report and go on with the next variant
            rec.update({"ok": False, "error": f"{type(e).__name__}: {e}"[:600],
                        "trace": traceback.format_exc()[-1500:]})
        print(json.dumps(rec), flush=True)


def run_group(variants: list[str], model: Path, out: Path, log: Path, timeout: float,
              stage_dir: Path | None) -> list[str]:
    """Run the variants in one process; returns those it printed no result for (crash or timeout)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "run", ",".join(variants), str(model)]
    if stage_dir:
        cmd += ["--stage-dir", str(stage_dir)]
    try:
        with log.open("a") as lf:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=lf, text=True, timeout=timeout, check=False)
        stdout, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    seen = set()
    with out.open("a") as f:
        for line in stdout.splitlines():
            if line.startswith("{"):
                f.write(line + "\n")
                rec = json.loads(line)
                seen.add(rec.get("variant"))
                print(json.dumps({k: rec.get(k) for k in ("variant", "ok", "seconds", "gb_s", "copy_s", "load_s",
                                                          "error")}), flush=True)
    missing = [v for v in variants if v not in seen]
    if missing:
        # the first one without a result is the one that crashed or hung: record it, retry the rest
        tail = log.read_text()[-800:] if log.exists() else ""
        with out.open("a") as f:
            f.write(json.dumps({"phase": "micro", "variant": missing[0], "ok": False,
                                "error": f"process rc={rc}", "stderr_tail": tail}) + "\n")
        print(json.dumps({"variant": missing[0], "ok": False, "error": f"process rc={rc}"}), flush=True)
    return missing[1:]


def run_all(model: Path, out: Path, logdir: Path, budget: float, stage_dir: Path | None, groups: str) -> None:
    start = time.time()
    logdir.mkdir(parents=True, exist_ok=True)
    queue = [g.split(",") for g in groups.split(";") if g]
    n = 0
    while queue:
        variants = queue.pop(0)
        left = budget - (time.time() - start)
        while variants and PROCESS_COST + sum(GROUP_COST.get(v, 30) for v in variants) > left:
            dropped = variants.pop()  # the last ones are worth least
            with out.open("a") as f:
                f.write(json.dumps({"phase": "micro", "variant": dropped, "ok": False,
                                    "error": f"skipped: {left:.0f} s left"}) + "\n")
            print(json.dumps({"variant": dropped, "ok": False, "error": f"skipped: {left:.0f} s left"}), flush=True)
        if not variants:
            continue
        n += 1
        cost = PROCESS_COST + sum(GROUP_COST.get(v, 30) for v in variants)
        rest = run_group(variants, model, out, logdir / f"micro_{n}.log", max(30.0, min(left - 5, 3 * cost)),
                         stage_dir)
        if rest:
            queue.insert(0, rest)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["run", "all"])
    ap.add_argument("args", nargs="+")
    ap.add_argument("--stage-dir", type=Path)
    ap.add_argument("--logdir", type=Path, default=Path("/tmp/gpubench-micro-logs"))
    ap.add_argument("--budget", type=float, default=300)
    ap.add_argument("--groups", default=os.environ.get("BENCH_MICRO_GROUPS", DEFAULT_GROUPS))
    a = ap.parse_args()
    if a.cmd == "run":
        run_variants(a.args[0].split(","), Path(a.args[1]), a.stage_dir)
    else:
        run_all(Path(a.args[0]), Path(a.args[1]), a.logdir, a.budget, a.stage_dir, a.groups)


if __name__ == "__main__":
    main()
