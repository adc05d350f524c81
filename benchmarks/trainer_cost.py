"""What the proxy costs the trainer: a pure-Python loop on the main thread while environments step
through the proxy at fixed rates, as a fraction of the loop's idle speed.

    python benchmarks/trainer_cost.py --write        # about 4 minutes; updates RESULTS.md
    python benchmarks/trainer_cost.py --rates 250,1000 --kinds http --upstreams plain --seconds 3

The trainer is this process: its main thread runs a pure-Python loop (the stand-in for a trainer's
Python: tokenising, reward code, the training loop's bookkeeping) and the proxy runs here too, as
`HFSandboxProvider` runs it by default. Everything else is a process of its own, so only the proxy's
work lands on this process's GIL: the upstreams (uvicorn serving benchmarks/_asgi_upstream.py, plain
and TLS) and the environments' clients (benchmarks/_paced.py: one selectors loop starting one step
every 1/rate seconds over keep-alive HTTP connections or WebSocket sessions). Each cell measures the
loop idle, under load, and idle again, and reports the loaded speed over the mean of the two idle ones,
with the load average and the CPU other processes used. Proxy modes are rows of PROXY_MODES: a mode is
a context manager yielding `mount(upstream_url, verify) -> base_url` (and the pids of any process
it runs the proxy in), so another way of hosting the proxy is one entry more.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, REPO)
sys.path.insert(2, os.path.join(REPO, "tests"))  # support.make_test_ca: the tests' throwaway CA
import ws_scale as scale  # noqa: E402
from _results import replace_marked_section  # noqa: E402

DEFAULT_RESULTS = os.path.join(HERE, "RESULTS.md")
SECTION_START, SECTION_END = "<!-- trainer_cost:start -->", "<!-- trainer_cost:end -->"
# The paced rates (environment steps per second through the proxy, all environments together).
RATES = (250, 1000, 4000)
KINDS = ("http", "ws")
UPSTREAMS = ("plain", "tls")
# How long the loop runs under each load (and idle before and after it).
SECONDS = 5.0
IDLE_SECONDS = 2.0
# Keep-alive connections (or WebSocket sessions) the paced clients spread their steps over: enough for
# 4,000 steps/s at a few hundred microseconds each, few enough to stand for a trainer's environments.
CONNECTIONS = 16
# The benchmark token: any string works, nothing checks it; never a real credential.
BENCH_TOKEN = "trainer-cost-benchmark-token"


def spin(seconds: float) -> float:
    """The trainer's stand-in: pure-Python work on this thread for `seconds`; iterations per second."""
    done, deadline = 0, time.perf_counter() + seconds
    total = 0
    while True:
        for i in range(2000):  # arithmetic, a dict and a list: the interpreter, not a C call, does the work
            total += i * i % 7
        done += 2000
        if time.perf_counter() >= deadline:
            return done / seconds


@contextlib.contextmanager
def in_process_proxy() -> Iterator[Tuple[Callable[[str, Any], str], List[int]]]:
    """The default: an AuthProxy in this (the trainer's) process."""
    from proxy import AuthProxy

    with AuthProxy() as proxy:
        yield (lambda upstream, verify: proxy.mount(upstream, BENCH_TOKEN, verify=verify)), []


@contextlib.contextmanager
def process_host() -> Iterator[Tuple[Callable[[str, Any], str], List[int]]]:
    """The out-of-process host: the proxy in a child process (`AuthProxy.spawn()`, what
    `HFSandboxProvider(proxy="process")` uses); this process keeps only the handle's control thread."""
    from proxy import AuthProxy

    with AuthProxy.spawn() as host:
        yield (lambda upstream, verify: host.mount(upstream, BENCH_TOKEN, verify=verify)), [host.pid]  # type: ignore[list-item]


# name -> context manager yielding (mount, pids of the proxy's own processes, if any).
PROXY_MODES: Dict[str, Callable[[], Any]] = {"in-process": in_process_proxy, "process": process_host}


@contextlib.contextmanager
def upstreams(workdir: str, kinds: Sequence[str]) -> Iterator[Dict[str, Tuple[str, Any, int]]]:
    """uvicorn upstreams in their own processes: {kind: (url, verify, pid)}."""
    import support

    ca = support.make_test_ca(workdir)
    procs, out = [], {}
    try:
        for kind in kinds:
            extra = ["--certfile", ca.cert_path, "--keyfile", ca.key_path] if kind == "tls" else []
            proc = subprocess.Popen([sys.executable, os.path.join(HERE, "_asgi_upstream.py")] + extra,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(proc)
            info = json.loads(scale._read_line(proc, scale.CHILD_START_TIMEOUT_S))
            scheme = "https" if kind == "tls" else "http"
            out[kind] = ("%s://127.0.0.1:%d" % (scheme, info["port"]), ca.ca_path if kind == "tls" else True,
                         int(info["pid"]))
        yield out
    finally:
        for proc in procs:
            scale._stop_child(proc, terminate_first=True)


def paced(base_url: str, kind: str, rate: float, seconds: float, connections: int) -> subprocess.Popen:
    match = re.match(r"http://127\.0\.0\.1:(\d+)(/.*)?$", base_url)
    assert match, base_url
    path = (match.group(2) or "") + ("/ws" if kind == "ws" else "/step")
    return subprocess.Popen([sys.executable, os.path.join(HERE, "_paced.py"), "--port", match.group(1), "--path", path,
                             "--kind", kind, "--rate", str(rate), "--seconds", str(seconds),
                             "--connections", str(connections)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def measure_cell(mount: Callable[[str, Any], str], up: Tuple[str, Any, int], kind: str, rate: float, seconds: float,
                 idle_seconds: float, connections: int, proxy_pids: Sequence[int] = ()) -> Dict[str, Any]:
    """Idle loop, loop under the paced load, idle loop again: the loaded speed as a fraction of idle.
    `proxy_pids`: the proxy's own processes (the process host), whose CPU counts as the proxy's."""
    base = mount(up[0], up[1])
    idle_before = spin(idle_seconds)
    load0 = os.getloadavg()[0]
    client = paced(base, kind, rate, seconds, connections)
    ready = scale._read_line(client, scale.CHILD_START_TIMEOUT_S)  # connected: its steps start now
    own0, busy0, t0 = time.process_time(), scale._machine_busy_seconds(), time.monotonic()
    upstream0 = scale._cpu_seconds(up[2])
    hosts0 = sum(scale._cpu_seconds(pid) for pid in proxy_pids)
    main0 = time.thread_time()
    loaded = spin(seconds)
    main_cpu = time.thread_time() - main0
    out, err = client.communicate(timeout=seconds + 60)
    wall = time.monotonic() - t0
    own = time.process_time() - own0
    busy = scale._machine_busy_seconds() - busy0
    upstream_cpu = scale._cpu_seconds(up[2]) - upstream0
    hosts_cpu = sum(scale._cpu_seconds(pid) for pid in proxy_pids) - hosts0
    idle_after = spin(idle_seconds)
    if "ready" not in ready:
        raise RuntimeError("the paced client did not start: %s %s" % (ready, err.strip()[-500:]))
    try:
        load = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError("the paced client failed: %s" % err.strip()[-500:])
    # The quieter of the two idle measures: another process's burst during one of them would otherwise
    # make the loaded loop look faster than idle.
    idle = max(idle_before, idle_after)
    return {"kind": kind, "rate": rate, "fraction_of_idle": loaded / idle, "idle_per_s": idle,
            "idle_spread": abs(idle_before - idle_after) / idle, "achieved_per_s": load["achieved_per_s"],
            "steps": load["steps"], "errors": load["errors"], "p50_us": load["p50_us"], "p99_us": load["p99_us"],
            "trainer_cpu": own / wall, "upstream_cpu": upstream_cpu / wall,
            # the proxy's CPU (this process's minus the loop's own thread, plus a process host's): robust to load
            "proxy_us_per_step": (max(0.0, own - main_cpu) + hosts_cpu) / max(1, load["steps"]) * 1e6,
            "others": max(0.0, busy - own - load["cpu_s"] - upstream_cpu - hosts_cpu) / wall,
            "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def run(modes: Sequence[str], kinds: Sequence[str], kinds_up: Sequence[str], rates: Sequence[float], seconds: float,
        idle_seconds: float, connections: int, say: Callable[[str], None] = print) -> Dict[str, Any]:
    result: Dict[str, Any] = {"machine": scale.machine_info(), "seconds": seconds, "connections": connections, "rows": []}
    workdir = tempfile.mkdtemp(prefix="trainer-cost-")
    with upstreams(workdir, kinds_up) as ups:
        for mode in modes:
            with PROXY_MODES[mode]() as (mount, pids):
                for upstream in kinds_up:
                    for kind in kinds:
                        for rate in rates:
                            row = dict(measure_cell(mount, ups[upstream], kind, rate, seconds, idle_seconds,
                                                    connections, pids), mode=mode, upstream=upstream)
                            result["rows"].append(row)
                            say("%-10s %-5s %-4s %5d/s: loop at %.0f%% of idle (achieved %.0f/s, %d errors, "
                                "others %.2f cores, load %s)" % (mode, upstream, kind, rate, 100 * row["fraction_of_idle"],
                                                                 row["achieved_per_s"], row["errors"], row["others"],
                                                                 row["loadavg"]))
    return result


def render(result: Dict[str, Any], command: str) -> str:
    m = result["machine"]
    lines = [SECTION_START, "## The trainer's cost (benchmarks/trainer_cost.py)", "",
             "Command: `%s`  " % command,
             "Machine: %s, %d cores, Python %s; proxy.py at %s. Finished %s." % (
                 m["cpu"], m["cores"], m["python"], m["proxy_version"], m["when"]), "",
             "A pure-Python loop on the trainer's main thread while environments (another process, %d keep-alive "
             "connections or WebSocket sessions) step through the proxy at a paced rate; the loop's speed under load "
             "as a fraction of its idle speed (idle measured right before and after each cell, the quieter one kept; %g s "
             "under load); the proxy's CPU per step is the trainer process's CPU minus the loop thread's, per step "
             "relayed (robust to the machine's load, unlike the fraction). "
             "Upstreams: uvicorn in their own processes." % (result["connections"], result["seconds"]), "",
             "| proxy mode | upstream | steps | paced rate | achieved | loop speed / idle | step p50 | step p99 | "
             "proxy CPU per step | trainer process CPU | upstream CPU | others (cores) | load average |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in result["rows"]:
        lines.append("| %s | %s | %s | %d/s | %.0f/s | **%.0f%%** | %s us | %s us | %.0f us | %.2f | %.2f | %.2f | %s |" % (
            r["mode"], r["upstream"], r["kind"], r["rate"], r["achieved_per_s"], 100 * r["fraction_of_idle"],
            r["p50_us"], r["p99_us"], r.get("proxy_us_per_step", 0.0), r["trainer_cpu"], r.get("upstream_cpu", 0.0), r["others"], " -> ".join(str(x) for x in r["loadavg"])))
    return "\n".join(lines + ["", SECTION_END]) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(PROXY_MODES), help="proxy modes (%s)" % ",".join(PROXY_MODES))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--upstreams", default=",".join(UPSTREAMS))
    parser.add_argument("--rates", default=",".join(str(r) for r in RATES))
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS)
    parser.add_argument("--connections", type=int, default=CONNECTIONS)
    parser.add_argument("--write", action="store_true", help="update the trainer_cost section of RESULTS.md")
    parser.add_argument("--results", default=DEFAULT_RESULTS)
    parser.add_argument("--json", default=None, help="also write the raw rows as JSON here")
    args = parser.parse_args(argv)
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]
    modes, kinds, ups = split(args.modes), split(args.kinds), split(args.upstreams)
    for name, chosen, allowed in (("mode", modes, tuple(PROXY_MODES)), ("kind", kinds, KINDS), ("upstream", ups, UPSTREAMS)):
        bad = [c for c in chosen if c not in allowed]
        if bad:
            parser.error("unknown %s %s; choose from %s" % (name, ", ".join(bad), ", ".join(allowed)))
    rates = [float(r) for r in split(args.rates)]
    result = run(modes, kinds, ups, rates, args.seconds, args.idle_seconds, args.connections)
    shown = list(argv if argv is not None else sys.argv[1:])
    if "--json" in shown[:-1]:  # where the raw rows went is no part of how to reproduce them
        del shown[shown.index("--json"):shown.index("--json") + 2]
    command = "python benchmarks/trainer_cost.py " + " ".join(shown)
    section = render(result, command.strip())
    print(section)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.write:
        replace_marked_section(args.results, SECTION_START, SECTION_END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
