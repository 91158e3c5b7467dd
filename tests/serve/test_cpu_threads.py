"""serve/cpu_threads.py: the thread-count decision from per-core busy fractions, the /proc/stat reader, the
governor's pacing and hysteresis (driven by a fake /proc/stat, clock and CPU time), the service's CPU read from a
real process, and the wait-policy default."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from quantkit.serve.cpu_threads import (SERVICE_PIDS_ENV, SPINCOUNT, ThreadGovernor, choose_threads, read_proc_stat,
                                       service_cpu_seconds, service_pids, wait_policy_env)


@pytest.mark.parametrize("busy, own, max_threads, expected", [
    ([0.0, 0.0], 0.0, 2, 2),  # idle machine: every core
    ([1.0, 1.0], 2.0, 2, 2),  # all of it is our own work
    ([1.0, 1.0], 1.0, 2, 1),  # a busy loop on one core beside our one thread
    ([1.0, 1.0], 1.5, 2, 1),  # our two spinning threads sharing a core with a busy loop: others use 0.5
    ([1.0, 0.2], 1.0, 2, 2),  # others use 0.2 of a core: still free (SLACK)
    ([1.0, 0.5], 1.0, 2, 1),  # half a core taken
    ([1.0, 1.0], 0.0, 2, 1),  # the machine is full of others: never fewer than one
    ([0.0] * 8, 0.0, 4, 4),  # never more than the count we started with
    ([1.0] * 4 + [0.0] * 4, 0.0, 8, 4),  # four of eight cores busy elsewhere
    ([0.3, 0.3, 0.3], 0.0, 3, 2),  # 0.9 of a core spread over three
])
def test_choose_threads(busy, own, max_threads, expected):
    assert choose_threads(busy, own, max_threads) == expected


STAT = """cpu  {t0} 0 0 {i0} 0 0 0 0 0 0
cpu0 {a} 0 0 {ia} 0 0 0 0 0 0
cpu1 {b} 0 {s} {ib} 5 0 0 {steal} 0 0
intr 1 2 3
"""


def write_stat(path, a, ia, b, ib, s=0, steal=0):
    path.write_text(STAT.format(t0=a + b, i0=ia + ib, a=a, ia=ia, b=b, s=s, ib=ib, steal=steal))


def test_read_proc_stat_counts_steal_as_busy_and_iowait_as_idle(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, 100, 900, 10, 80, s=20, steal=7)
    assert read_proc_stat(str(stat)) == {0: (100, 1000), 1: (37, 122)}
    assert 0 in read_proc_stat()  # the real one parses too


class Drive:
    """A fake clock, this process's CPU seconds and /proc/stat ticks (100 per second per core)."""

    def __init__(self, tmp_path):
        self.path = tmp_path / "stat"
        self.now, self.cpu, self.ticks = 0.0, 0.0, [[0, 0], [0, 0]]  # per core (busy, idle)
        self.calls = []
        self.write()

    def write(self):
        (a, ia), (b, ib) = self.ticks
        write_stat(self.path, a, ia, b, ib)

    def advance(self, seconds, busy, own):
        """seconds pass with per-core busy fractions `busy`, `own` cores of them ours."""
        self.now += seconds
        self.cpu += own * seconds
        for core, fraction in zip(self.ticks, busy):
            core[0] += round(100 * seconds * fraction)
            core[1] += round(100 * seconds * (1 - fraction))
        self.write()

    def governor(self):
        return ThreadGovernor(2, [0, 1], interval=0.2, stat_path=str(self.path), set_threads=self.calls.append,
                              clock=lambda: self.now, cpu_time=lambda: self.cpu)


def test_governor_drops_a_thread_at_once_and_takes_it_back_after_two_looks(tmp_path):
    drive = Drive(tmp_path)
    gov = drive.governor()
    drive.advance(0.1, [1.0, 1.0], 2.0)
    assert gov.update() == 2 and drive.calls == []  # within the interval: no look
    drive.advance(0.2, [1.0, 1.0], 1.5)  # a busy loop shares core 1 with our spinning thread
    assert gov.update() == 1 and drive.calls == [1]
    drive.advance(0.3, [1.0, 1.0], 1.0)
    assert gov.update() == 1
    drive.advance(0.3, [1.0, 0.1], 1.0)  # it stopped: one look is not enough
    assert gov.update() == 1
    drive.advance(0.3, [1.0, 0.1], 1.0)
    assert gov.update() == 2 and drive.calls == [1, 2]


def test_governor_stays_off_where_it_has_nothing_to_govern(monkeypatch):
    assert ThreadGovernor.for_device("cuda") is None
    monkeypatch.setenv("QUANTKIT_CPU_THREADS", "fixed")
    assert ThreadGovernor.for_device("cpu") is None


def test_wait_policy_is_set_unless_the_user_chose_one():
    assert wait_policy_env({}) == {"GOMP_SPINCOUNT": SPINCOUNT}
    assert wait_policy_env({"OMP_WAIT_POLICY": "active"}) == {"OMP_WAIT_POLICY": "active"}
    assert wait_policy_env({"GOMP_SPINCOUNT": "infinite"}) == {"GOMP_SPINCOUNT": "infinite"}


def test_the_service_processes_cpu_counts_as_the_governors_own():
    """A process burning CPU (the HTTP front end's part of serving) is read from /proc and added to this one's."""
    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time() + 0.6\n"
                                                     "while time.process_time() < t: pass\ninput()"],
                              stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while service_cpu_seconds([burner.pid]) - service_cpu_seconds() < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        extra = service_cpu_seconds([burner.pid]) - service_cpu_seconds()
        assert 0.5 <= extra < 5.0  # its 0.6 s of CPU (plus its start), read from /proc/PID/stat
    finally:
        burner.kill()
        burner.wait()
    assert service_cpu_seconds([burner.pid]) - service_cpu_seconds() < 0.05  # a pid that has gone counts 0
    assert service_pids({SERVICE_PIDS_ENV: "12, 34,x"}) == [12, 34] and service_pids({}) == []
