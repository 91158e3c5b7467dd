"""Cold start: seconds from launching `quantkit serve` to its first successful completion (goal: < 15 s).

    python bench/cold_start.py [--model DIR] [--runs 3] [-- extra serve flags]

Each run starts a fresh server process on a free port, polls POST /v1/completions (max_tokens 1) every 50 ms
until it answers 200, records the elapsed wall time, then stops the server with SIGTERM and checks it exits 0.
Also reported: when /health first answered (the process is up and the engine ready), and the CPU seconds the
server process had used by its first answer (user + system, all threads, from /proc): on a machine shared with
other work the wall time stretches, the CPU time much less so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

GOAL_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quantkit_command() -> list[str]:
    """The installed `quantkit` console script beside this interpreter (what a user runs)."""
    script = Path(sys.executable).parent / "quantkit"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "quantkit.cli"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _post(url: str, body: dict, timeout: float) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status


def _get(url: str, timeout: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status


def one_run(model: str | None, extra: list[str], deadline_s: float) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [*quantkit_command(), "serve", *([model] if model else []), "--port", str(port), *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    health_s = answer_s = cpu_s = None
    try:
        while time.perf_counter() - start < deadline_s:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if health_s is None and _get(base + "/health", timeout=1.0) == 200:
                    health_s = time.perf_counter() - start
                if health_s is not None and _post(base + "/v1/completions",
                                                  {"prompt": "Hello", "max_tokens": 1}, timeout=30.0) == 200:
                    answer_s = time.perf_counter() - start
                    cpu_s = cpu_seconds(proc.pid)
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        if answer_s is None:
            raise RuntimeError(f"no answer within {deadline_s} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    return {"health_s": health_s, "first_answer_s": answer_s, "cpu_s": cpu_s, "exit_code": code}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="what to serve (default: the bundled model)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=120.0, help="give up on a run after this many seconds")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    env_note = f"{os.cpu_count()} CPUs"
    runs = []
    for i in range(args.runs):
        result = one_run(args.model, extra, args.deadline)
        runs.append(result)
        print(f"run {i + 1}: /health after {result['health_s']:.2f} s, first completion after "
              f"{result['first_answer_s']:.2f} s ({result['cpu_s']:.1f} CPU s), exit code {result['exit_code']}",
              flush=True)
    firsts = [r["first_answer_s"] for r in runs]
    median = statistics.median(firsts)
    load = os.getloadavg()[0]
    print(f"cold start ({args.model or 'bundled model'}, {env_note}, load average {load:.1f}): median {median:.2f} s, "
          f"min {min(firsts):.2f} s, max {max(firsts):.2f} s; goal < {GOAL_S:.0f} s: "
          f"{'met' if median < GOAL_S else 'NOT met'}")
    return 0 if all(r["exit_code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
