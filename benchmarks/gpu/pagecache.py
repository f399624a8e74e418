"""The page cache of model files (cold reads without rebooting). No tools needed, only libc.

usage: pagecache.py resident PATH...   fraction of the files' pages in the page cache (mincore)
       pagecache.py evict PATH...      fsync, then posix_fadvise(DONTNEED) on every file: drops the
                                           files' clean pages (what `vmtouch -e` does); prints before/after
       pagecache.py dropcaches PATH... `sync; echo 3 > /proc/sys/vm/drop_caches` (root): says whether
                                           the write worked and what stayed resident (whole-machine drop:
                                           also vLLM's own Python files, so not used between timed runs)
       pagecache.py readbw PATH...     read the files once, sequentially (16 MiB blocks): GB/s, i.e.
                                           what a cold read costs here (evict first)
PATH may be a folder: its *.safetensors files. Every command prints one JSON line.
Caveat: the device is a Firecracker VM; its disk is a file on the host, and the host's own page cache may
still hold it, so a guest-cold read can be faster than a real disk or parallel filesystem (readbw says).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def files_of(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out += sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    return out


def resident_pages(path: Path) -> tuple[int, int]:
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            n = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * n)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(b & 1 for b in vec), n
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident(files: list[Path]) -> float:
    got = tot = 0
    for f in files:
        r, n = resident_pages(f)
        got, tot = got + r, tot + n
    return round(got / tot, 4) if tot else 0.0


def evict(files: list[Path]) -> dict:
    before = resident(files)
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {"method": "posix_fadvise", "resident_before": before, "resident_after": resident(files),
            "seconds": round(time.perf_counter() - t0, 2)}


def dropcaches(files: list[Path]) -> dict:
    before = resident(files)
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        ok, err = True, None
    except OSError as e:
        ok, err = False, str(e)
    return {"method": "drop_caches", "write_ok": ok, "error": err, "resident_before": before,
            "resident_after": resident(files)}


def readbw(files: list[Path]) -> dict:
    before = resident(files)
    buf = bytearray(16 << 20)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    dt = time.perf_counter() - t0
    return {"resident_before": before, "bytes": total, "seconds": round(dt, 2), "gb_s": round(total / 1e9 / dt, 2)}


def main() -> None:
    cmd, files = sys.argv[1], files_of(sys.argv[2:])
    if not files:
        print(json.dumps({"error": "no files"}))
        sys.exit(1)
    if cmd == "resident":
        out = {"resident": resident(files)}
    elif cmd == "evict":
        out = evict(files)
    elif cmd == "dropcaches":
        out = dropcaches(files)
    elif cmd == "readbw":
        out = readbw(files)
    else:
        raise SystemExit(__doc__)
    out.update({"cmd": cmd, "files": len(files)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
