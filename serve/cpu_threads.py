"""How many threads a CPU engine step may use, and how they wait: sharing the machine gracefully.

A decode step is ~200 OpenMP regions (one per kernel call), each ending at a barrier. When another process keeps a
core busy, the thread torch left there is descheduled for whole time slices and every barrier waits for it: on the
project's 2-core machine single-request decode fell from 40 to 1 tok/s with one busy loop beside it (issue 19;
bench/cpu_sharing.py measures it). Two remedies, both here:

ThreadGovernor: before a step (at most every `interval` seconds) reads the per-core busy time of /proc/stat since
its last look, subtracts this process's own CPU time (and its service's: SERVICE_PIDS_ENV), and sets torch's thread count to the cores the others leave
free (torch.set_num_threads; the C kernels read torch.get_num_threads()). Never more than the count it started
with (the user's OMP_NUM_THREADS / torch.set_num_threads), never fewer than 1; fewer at once, more only after two
looks agree. QUANTKIT_CPU_THREADS=fixed turns it off. Cost: one clock read per step (0.1 us), ~30 us per look.

wait_policy_env(): libgomp's spin-wait. Its default spins 300,000 times (~4 ms) at a barrier before sleeping, so threads
between kernels burn their core and fight other processes for it; a short bound (GOMP_SPINCOUNT, read once when
libgomp loads, i.e. before torch is imported) keeps the spin for back-to-back kernels and sleeps soon after.
Set by the processes that start serving (quantkit/commands/serve.py) unless the user chose OMP_WAIT_POLICY or
GOMP_SPINCOUNT. This module imports nothing heavy, so it can run before torch loads.
"""

from __future__ import annotations

import os
import time
from typing import Optional, Sequence

# GOMP_SPINCOUNT for serving: ~0.4 ms of spinning (a pause takes ~13 ns on the project's CPU) spans the gaps
# between one step's kernels (tens of us), not the idle time between steps; the default (300,000) spins ~4 ms
SPINCOUNT = "30000"
SLACK = 0.3  # free cores round up from within SLACK of a whole one (others using 0.3 of a core leave it free)
INTERVAL_S = 0.2
# pids whose CPU use is the engine's own (comma-separated): `quantkit serve`'s HTTP front end streams every token the
# engine process makes, ~0.3 of a core at 100 tok/s; counted as foreign load it took a thread away (bf16 TPOT 7.9 ->
# 10 ms on 2 cores, bench/serve_vs_naive.py --concurrency 1)
SERVICE_PIDS_ENV = "QUANTKIT_SERVICE_PIDS"


def wait_policy_env(environ: Optional[dict] = None) -> dict:
    """The environment (os.environ by default, changed in place) with a bounded OpenMP spin-wait unless the user
    set one; call before torch is imported (child processes inherit it)."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = SPINCOUNT
    return env


def choose_threads(busy: Sequence[float], own: float, max_threads: int) -> int:
    """Threads for the next steps. busy: per-core busy fraction (0..1, steal included) over the last interval, of
    every process; own: this process's CPU use over it, in cores. The others' load is sum(busy) - own; the free
    cores are the rest, rounded down unless within SLACK of the next one."""
    others = max(0.0, sum(busy) - own)
    free = len(busy) - others
    return max(1, min(max_threads, int(free + SLACK)))


def read_proc_stat(path: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """cpu index -> (busy, total) clock ticks since boot (busy: user, nice, system, irq, softirq, steal)."""
    cores = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in (fields + ["0"] * 8)[:8])
            busy = user + nice + system + irq + softirq + steal
            cores[int(name[3:])] = (busy, busy + idle + iowait)
    return cores


def service_cpu_seconds(pids: Sequence[int] = ()) -> float:
    """CPU seconds of this process and of `pids` (the same service's other processes; one that has gone or cannot
    be read counts 0): the load the governor counts as its own."""
    t = os.times()
    total = t.user + t.system
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        except (OSError, ValueError, IndexError):
            continue
    return total


def service_pids(environ=None) -> list[int]:
    """The pids in SERVICE_PIDS_ENV (set by serve/engine_process.py for its child: the HTTP front end)."""
    value = (os.environ if environ is None else environ).get(SERVICE_PIDS_ENV, "")
    return [int(p) for p in value.split(",") if p.strip().isdigit()]


class ThreadGovernor:
    """Adjusts torch's thread count to the cores other processes leave free (module docstring)."""

    def __init__(self, max_threads: int, cpus: Sequence[int], interval: float = INTERVAL_S,
                 stat_path: str = "/proc/stat", set_threads=None, clock=time.monotonic, cpu_time=None):
        """set_threads(n) (torch.set_num_threads), clock() seconds and cpu_time() (this process's CPU seconds) are
        parameters so a test can drive the governor."""
        import torch

        self.max_threads, self.cpus, self.interval, self.stat_path = max_threads, list(cpus), interval, stat_path
        self.set_threads = set_threads or torch.set_num_threads
        self.clock, self.cpu_time = clock, cpu_time or service_cpu_seconds
        self.threads = max_threads
        self._pending = None  # a larger count seen once: applied when the next look agrees
        self._last = clock()
        self._sample = self._read()

    @classmethod
    def for_device(cls, device) -> "ThreadGovernor | None":
        """A governor for a CPU engine (None on other devices, with QUANTKIT_CPU_THREADS=fixed, or without
        /proc/stat)."""
        import torch

        if getattr(device, "type", device) != "cpu" or os.environ.get("QUANTKIT_CPU_THREADS") == "fixed":
            return None
        try:
            cpus = sorted(os.sched_getaffinity(0))
            read_proc_stat()
        except (OSError, AttributeError, ValueError):
            return None
        threads = min(torch.get_num_threads(), len(cpus))
        pids = service_pids()
        return cls(threads, cpus, cpu_time=lambda: service_cpu_seconds(pids)) if threads > 1 else None

    def _read(self):
        """(per-core (busy, total) of our cpus, this process's CPU seconds)."""
        stat = read_proc_stat(self.stat_path)
        return [stat[c] for c in self.cpus if c in stat], self.cpu_time()

    def update(self) -> int:
        """Call before a step: re-decides at most every `interval` seconds; returns the thread count in use."""
        now = self.clock()
        if now - self._last < self.interval:
            return self.threads
        try:
            sample = self._read()
        except OSError:
            return self.threads
        elapsed, (before, own_before) = now - self._last, self._sample
        self._last, self._sample = now, sample
        cores, own = sample
        busy = [(b - b0) / (t - t0) if t > t0 else 0.0 for (b, t), (b0, t0) in zip(cores, before)]
        want = choose_threads(busy, (own - own_before) / elapsed, self.max_threads)
        if want > self.threads and self._pending != want:
            self._pending = want  # more threads only when two looks agree
            return self.threads
        self._pending = None
        if want != self.threads:
            self.threads = want
            self.set_threads(want)
        return self.threads
