"""Where the proxy's cost to the trainer goes, in-process and with the process host (`AuthProxy.spawn()`):
CPU or GIL, and what the token design chosen for the host costs.

benchmarks/trainer_cost.py gives the issue's grid (paced rates, HTTP and WebSocket, both proxy modes).
On a shared machine its one figure, the loop's speed per wall second, moves with everybody else's load;
this script adds what tells the two apart, for paced HTTP steps and for full load (`wrk -t1 -c64`):

- "with a core of its own": the loop's speed per second its thread was not sitting runnable while every
  CPU was busy (/proc schedstat). That takes out CPU contention (other users, the load generator, the
  upstream, the proxy's child) and keeps what the GIL costs;
- "GIL wait": the share of the window the loop's thread was blocked (neither running nor runnable);
- "ask-parent": the token design the host did not take (the child asking the parent per request),
  simulated as a parent thread answering that many length-prefixed JSON questions a second.

Each loaded run is paired with an idle run just before it; rounds interleave every mode. The paced
client and the upstreams (uvicorn, plain and TLS, in their own processes) are trainer_cost.py's.

    python benchmarks/trainer_cost_process.py [--rate 1000] [--seconds 3] [--rounds 5] [--write]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import trainer_cost as grid  # noqa: E402  (puts the repository and tests/ on sys.path too)
from _results import replace_marked_section  # noqa: E402

# Paced load: keep-alive connections the paced client spreads the rate over.
PACED_CONNECTIONS = 8
# Full load: wrk's connections, as in issue 22's figures (wrk -t1 -c64).
FULL_CONNECTIONS = 64
# The load runs this long before the loop is timed, so the proxy's threads and connections are warm.
WARMUP_S = 1.0
# The loop's unit of work: enough iterations that reading the clock is a rounding error.
SPIN_BATCH = 2000
STEP_BODY = json.dumps({"action": {"message": "hello"}}).encode()
RESULTS = os.path.join(HERE, "RESULTS.md")
SECTION_START = "<!-- trainer_cost_process:start -->"
SECTION_END = "<!-- trainer_cost_process:end -->"


# --------------------------------------------------------------------------------------------------
# The measurement
# --------------------------------------------------------------------------------------------------


def spin(seconds: float) -> Dict[str, float]:
    """Run a pure-Python loop on this (the main) thread for `seconds`. Returns its speed per wall second
    (`wall`), its speed per second the thread could have run (`own_core`: wall minus the time it sat
    runnable while every CPU was busy, from /proc schedstat, so other users of this shared machine, and
    our own load generator and upstream, do not count), and the share of wall time it was blocked
    while runnable work existed for it, i.e. waiting for the GIL (`gil_wait`)."""
    count, x = 0, 0
    cpu0, queued0 = _schedstat()
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for i in range(SPIN_BATCH):
            x = (x * 31 + i) & 0xFFFF
        count += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    cpu1, queued1 = _schedstat()
    wall, cpu, queued = now - start, cpu1 - cpu0, queued1 - queued0
    return {"wall": count / wall, "own_core": count / max(1e-9, wall - queued),
            "gil_wait": max(0.0, wall - cpu - queued) / wall}


def _schedstat() -> Tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread."""
    with open("/proc/self/task/%d/schedstat" % threading.get_native_id()) as handle:
        on_cpu, queued = handle.read().split()[:2]
    return int(on_cpu) / 1e9, int(queued) / 1e9


class Machine:
    """CPU used over a window by processes that are not this benchmark's (the machine is shared): all
    CPUs' busy time (/proc/stat) minus ours (this process and `pids`), in cores."""

    def __init__(self, pids: List[int]) -> None:
        self.pids = pids

    def __enter__(self) -> "Machine":
        self.start = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._read()
        self.others = max(0.0, (end[1] - self.start[1]) - (end[2] - self.start[2])) / (end[0] - self.start[0])

    def _read(self) -> Tuple[float, float, float]:
        with open("/proc/stat") as handle:
            fields = [int(v) for v in handle.readline().split()[1:]]
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        ours = process_cpu_s(os.getpid())
        for pid in self.pids:
            try:
                ours += process_cpu_s(pid)
            except OSError:
                pass
        return time.monotonic(), busy, ours


def process_cpu_s(pid: int) -> float:
    with open("/proc/%d/stat" % pid) as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_load(url: str, rate: int, seconds: float) -> subprocess.Popen:
    """Start the load for `seconds`: trainer_cost.py's paced client when rate > 0, else wrk at full load."""
    if rate > 0:
        return grid.paced(url, "http", rate, seconds, PACED_CONNECTIONS)
    script = os.path.join(tempfile.gettempdir(), "trainer_cost_post.lua")
    with open(script, "w") as handle:
        handle.write('wrk.method = "POST"\nwrk.body = %s\nwrk.headers["Content-Type"] = "application/json"\n'
                     % json.dumps(STEP_BODY.decode()))
    return subprocess.Popen(["wrk", "-t1", "-c%d" % FULL_CONNECTIONS, "-d%ds" % max(1, round(seconds)), "-s", script,
                             url + "/step"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def load_result(proc: subprocess.Popen, rate: int) -> Dict[str, Any]:
    out, _ = proc.communicate(timeout=120)
    if rate > 0:
        answer = json.loads(out.strip().splitlines()[-1])
        return {"rps": answer["achieved_per_s"], "errors": answer["errors"]}
    found = {"errors": 0, "rps": 0.0}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Requests/sec:"):
            found["rps"] = float(line.split()[1])
        elif line.startswith("Non-2xx") or line.startswith("Socket errors"):
            found["errors"] += sum(int(v) for v in line.replace(",", " ").split() if v.isdigit())
    return found


def measure(proxy_pids: List[int], url: str, rate: int, seconds: float, ours: List[int]) -> Dict[str, Any]:
    """One loaded run: the loop's speed while the load runs, what the load achieved, the proxy's CPU."""
    child_pid = proxy_pids[0] if proxy_pids else None
    proc = run_load(url, rate, WARMUP_S + seconds + 0.5)
    time.sleep(WARMUP_S)
    cpu_before = process_cpu_s(child_pid) if child_pid else _process_cpu_but_main()
    with Machine(ours + [proc.pid]) as machine:
        speed = spin(seconds)
    cpu = (process_cpu_s(child_pid) if child_pid else _process_cpu_but_main()) - cpu_before
    load = load_result(proc, rate)
    return {"loop": speed, "rps": load["rps"], "errors": load["errors"], "proxy_cpu_s": cpu,
            "window_s": seconds, "others": machine.others}



def _process_cpu_but_main() -> float:
    """This process's CPU time minus the main thread's (the loop's): what its other threads used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime - time.thread_time()


# --------------------------------------------------------------------------------------------------
# The rejected token design, measured: the child asks the parent per request
# --------------------------------------------------------------------------------------------------


def measure_ask_parent(rate: int, seconds: float) -> Dict[str, Any]:
    """A parent thread answering `rate` token questions per second over a socketpair (length-prefixed
    JSON, as the control channel), asked by a subprocess: the trainer's share of that design."""
    parent_end, child_end = socket.socketpair()
    asker = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--asker", str(child_end.fileno()),
                              str(rate), str(WARMUP_S + seconds + 0.5)], pass_fds=(child_end.fileno(),),
                             stdout=subprocess.PIPE, text=True)
    child_end.close()
    answered = [0]

    def answer() -> None:
        frame = struct.Struct("!I")
        while True:
            head = parent_end.recv(4, socket.MSG_WAITALL)
            if len(head) < 4:
                return
            question = json.loads(parent_end.recv(frame.unpack(head)[0], socket.MSG_WAITALL))
            reply = json.dumps({"id": question["id"], "token": grid.BENCH_TOKEN}).encode()
            parent_end.sendall(frame.pack(len(reply)) + reply)
            answered[0] += 1

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    time.sleep(WARMUP_S)
    before = answered[0]
    with Machine([asker.pid]) as machine:
        speed = spin(seconds)
    rps = (answered[0] - before) / seconds
    latency = json.loads(asker.communicate(timeout=60)[0])
    thread.join(10)
    parent_end.close()
    return {"loop": speed, "rps": rps, "errors": 0, "proxy_cpu_s": 0.0, "window_s": seconds,
            "others": machine.others, "ask_ms": latency}


def asker_main(fd: int, rate: int, seconds: float) -> int:
    sock = socket.socket(fileno=fd)
    frame = struct.Struct("!I")
    start = time.monotonic()
    n = 0
    waits: List[float] = []
    while time.monotonic() - start < seconds:
        due = start + n / rate
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        data = json.dumps({"id": n, "op": "token", "route": "x" * 32}).encode()
        asked = time.perf_counter()
        sock.sendall(frame.pack(len(data)) + data)
        head = sock.recv(4, socket.MSG_WAITALL)
        sock.recv(frame.unpack(head)[0], socket.MSG_WAITALL)
        waits.append(time.perf_counter() - asked)
        n += 1
    sock.close()
    waits.sort()
    print(json.dumps({"p50": 1000 * waits[len(waits) // 2], "p99": 1000 * waits[int(len(waits) * 0.99)]}))
    return 0


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=1000, help="paced HTTP steps per second (default 1000)")
    parser.add_argument("--seconds", type=float, default=3.0, help="loop timing window per run (default 3)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--no-full", action="store_true", help="skip the full-load (wrk) runs")
    parser.add_argument("--no-tls", action="store_true", help="skip the TLS upstream")
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    kinds = ["plain"] + ([] if args.no_tls else ["tls"])
    loads = [args.rate] + ([] if args.no_full else [0])
    rows: Dict[Tuple[str, str, int], List[Dict[str, Any]]] = {}
    idle: List[Dict[str, float]] = []
    with contextlib.ExitStack() as stack:
        # {kind: (url, verify, pid)}: a proxy mounts the url with its verify
        ups = stack.enter_context(grid.upstreams(tempfile.mkdtemp(prefix="trainer-cost-"), kinds))
        modes = {name: stack.enter_context(grid.PROXY_MODES[name]()) for name in ("in-process", "process")}
        urls = {(mode, kind): mount(*ups[kind][:2]) for mode, (mount, _) in modes.items() for kind in kinds}
        ours = _child_pids()  # the upstreams and the proxy's child: not "others"
        for round_no in range(args.rounds):
            print("round %d" % (round_no + 1), flush=True)
            cases = [(mode, kind, rate) for rate in loads for kind in kinds for mode in modes]
            cases.append(("ask-parent", "-", args.rate))
            for mode, kind, rate in cases:
                paired_idle = spin(args.seconds)  # just before: the machine's other load drifts
                idle.append(paired_idle)
                if mode == "ask-parent":
                    result = measure_ask_parent(rate, args.seconds)
                else:
                    result = measure(modes[mode][1], urls[mode, kind], rate, args.seconds, ours)
                result["fraction"] = result["loop"]["wall"] / paired_idle["wall"]
                result["own_core"] = result["loop"]["own_core"] / paired_idle["own_core"]
                result["gil_wait"] = result["loop"]["gil_wait"]
                rows.setdefault((mode, kind, rate), []).append(result)
                print("  %-10s %-5s %-6s loop %5.1f%% of idle (%5.1f%% with a core of its own, GIL wait %4.1f%%), "
                      "%6.0f req/s, %d errors, others %.2f cores%s"
                      % (mode, kind, rate or "full", 100 * result["fraction"], 100 * result["own_core"],
                         100 * result["gil_wait"], result["rps"], result["errors"], result["others"],
                         ", answer p50 %(p50).2f ms p99 %(p99).2f ms" % result["ask_ms"] if "ask_ms" in result else ""),
                      flush=True)
    table = render(rows, idle, args)
    print(table)
    if args.write:
        replace_marked_section(RESULTS, SECTION_START, SECTION_END, table)
    return 0


def _child_pids() -> List[int]:
    """This process's child processes (the upstreams, the proxy's host), from /proc."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name) as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return found


def render(rows: Dict[Tuple[str, str, int], List[Dict[str, Any]]], idle: List[Dict[str, float]],
           args: argparse.Namespace) -> str:
    def median(values: List[float]) -> float:
        values = sorted(values)
        return values[len(values) // 2]

    lines = [SECTION_START, "## The trainer's cost: in-process proxy vs the process host (`AuthProxy.spawn()`)", "",
             "`python benchmarks/trainer_cost_process.py --rate %d --seconds %g --rounds %d` on %d CPUs, "
             "%s. The trainer's loop speed as a fraction of its idle speed measured just before (median of %d "
             "rounds, min-max in brackets; idle loop %.0f iterations/s, median): per wall second, and \"with a "
             "core of its own\", per second the main thread was not sitting runnable while every CPU was busy "
             "(schedstat), which takes out the other users of this shared machine, the load generator and the "
             "upstream, and keeps what the GIL costs; \"GIL wait\": share of the window the main thread was "
             "blocked. \"others\": CPU used meanwhile by processes not this benchmark's, in cores. Paced: %d "
             "keep-alive connections from trainer_cost.py's client (benchmarks/_paced.py); full: `wrk -t1 -c%d`. Upstream: uvicorn (benchmarks/_asgi_upstream.py)."
             % (args.rate, args.seconds, args.rounds, os.cpu_count() or 0, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                args.rounds, median([i["wall"] for i in idle]), PACED_CONNECTIONS, FULL_CONNECTIONS), "",
             "| proxy | upstream | load | trainer loop vs idle | with a core of its own | GIL wait | req/s achieved "
             "| proxy CPU per request | others |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (mode, kind, rate), results in rows.items():
        fractions = [r["fraction"] for r in results]
        per_request = [1e6 * r["proxy_cpu_s"] / (r["rps"] * r["window_s"]) for r in results if r["rps"] and r["proxy_cpu_s"]]
        own = [r["own_core"] for r in results]
        lines.append("| %s | %s | %s | %.0f%% (%.0f-%.0f%%) | %.0f%% (%.0f-%.0f%%) | %.1f%% | %.0f | %s | %.2f |" % (
            mode, kind, "%d/s" % rate if rate else "full", 100 * median(fractions), 100 * min(fractions),
            100 * max(fractions), 100 * median(own), 100 * min(own), 100 * max(own),
            100 * median([r["gil_wait"] for r in results]), median([r["rps"] for r in results]),
            "%.0f us" % median(per_request) if per_request else "-",
            median([r["others"] for r in results])))
    asks = rows.get(("ask-parent", "-", args.rate), [])
    lines += ["", "ask-parent: the rejected token design (the child asks the parent per request), simulated as "
              "a parent thread answering that many length-prefixed JSON questions per second while the main "
              "thread loops; each question waited %s ms at p50 and %s ms at p99 (per round) for its answer, "
              "time every proxied request would wait." % (
                  ", ".join("%.2f" % r["ask_ms"]["p50"] for r in asks), ", ".join("%.1f" % r["ask_ms"]["p99"] for r in asks)),
              SECTION_END, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--asker"]:
        sys.exit(asker_main(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
    sys.exit(main())
