"""A wall-clock jump for one process, at run time: a small ``LD_PRELOAD`` library, built here with the system C
compiler, that adds an offset read from a file to ``CLOCK_REALTIME`` (``clock_gettime``, ``gettimeofday``,
``time``). The monotonic clocks and every sleep and timed wait are left alone, as an NTP step leaves them; the whole
process sees the jump (Python's ``time.time()``, ``datetime``, logging, gRPC's C core).

    lib = build(directory)                       # cc -shared ...; cached by the source's hash
    env = preload_env(lib, offset_file)          # the process's extra environment
    set_offset(offset_file, 3600)                # one hour ahead, atomically; the process sees it within 10 ms

Why not libfaketime: its Debian build (0.9.10) breaks Python 3.11 either way. With the monotonic clock left alone
(``FAKETIME_DONT_FAKE_MONOTONIC=1``) every ``time.sleep()`` fails with EINVAL (its ``clock_nanosleep`` wrapper);
with it faked, ``threading.Event.wait(timeout)`` hangs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

OFFSET_ENV = "MEMSTORE_CLOCK_OFFSET_FILE"

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static int (*real_clock_gettime)(clockid_t, struct timespec *);
static volatile long long offset_ns;      /* the current offset, seconds in the file */
static volatile long long next_read_ns;   /* monotonic time of the next look at the file */

__attribute__((constructor)) static void init(void) {
    real_clock_gettime = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
}

static long long offset(void) {
    struct timespec m;
    real_clock_gettime(CLOCK_MONOTONIC, &m);
    long long now = m.tv_sec * 1000000000LL + m.tv_nsec;
    if (now >= next_read_ns) {  /* threads may race here: each reads the same file */
        const char *path = getenv("MEMSTORE_CLOCK_OFFSET_FILE");
        FILE *f = path ? fopen(path, "r") : NULL;
        double seconds = 0;
        if (f) {
            if (fscanf(f, "%lf", &seconds) != 1) seconds = 0;
            fclose(f);
        }
        offset_ns = (long long)(seconds * 1e9);
        next_read_ns = now + 10000000LL;
    }
    return offset_ns;
}

int clock_gettime(clockid_t clock, struct timespec *tp) {
    if (!real_clock_gettime) init();
    int r = real_clock_gettime(clock, tp);
    if (r == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        long long ns = tp->tv_sec * 1000000000LL + tp->tv_nsec + offset();
        tp->tv_sec = ns / 1000000000LL;
        tp->tv_nsec = ns % 1000000000LL;
    }
    return r;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    struct timespec t;
    int r = clock_gettime(CLOCK_REALTIME, &t);
    if (r == 0 && tv) {
        tv->tv_sec = t.tv_sec;
        tv->tv_usec = t.tv_nsec / 1000;
    }
    return r;
}

time_t time(time_t *out) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    if (out) *out = t.tv_sec;
    return t.tv_sec;
}
"""


def build(directory: Path) -> Path:
    """The library, compiled into ``directory`` unless a build of this source is there already."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc) to build the clock-jump library: apt-get install gcc")
    lib = Path(directory) / f"clockshift-{hashlib.sha256(SOURCE.encode()).hexdigest()[:12]}.so"
    if not lib.exists():
        src = lib.with_suffix(f".{os.getpid()}.c")
        src.write_text(SOURCE)
        tmp = lib.with_suffix(f".{os.getpid()}.so")
        try:
            cmd = [compiler, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(src), "-ldl"]
            subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"building the clock-jump library failed: {exc.stderr.decode(errors='replace')[-500:]}") from None
        finally:
            src.unlink(missing_ok=True)
        tmp.replace(lib)  # atomic: a concurrent build of the same source writes the same bytes
    return lib


def preload_env(lib: Path, offset_file: Path) -> dict[str, str]:
    """The environment that makes a process's wall clock follow ``offset_file``."""
    return {"LD_PRELOAD": str(lib), OFFSET_ENV: str(offset_file)}


def set_offset(offset_file: Path, seconds: float) -> None:
    """Move the clock of every process following ``offset_file`` to real time + ``seconds``; atomic (rename)."""
    tmp = offset_file.with_name(offset_file.name + ".tmp")
    tmp.write_text(f"{seconds}\n")
    tmp.replace(offset_file)


def loaded(pid: int, lib: Path) -> bool:
    """Whether process ``pid`` has ``lib`` mapped (it was preloaded)."""
    try:
        return str(lib) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
