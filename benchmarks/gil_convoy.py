"""Where the proxy's CPU per HTTP request goes as connections grow: user and kernel time of the proxy
and of the CPython floor at 1 and 64 connections (or --connections), and the proxy's context switches
per request.

    python benchmarks/gil_convoy.py [--seconds 3] [--reps 2] [--upstreams plain,tls] [--hosts 1,2]
                                    [--floor-busy 800,1600] [--connections 1,64]

The same stack as benchmarks/vs_nginx.py (uvicorn upstreams, benchmarks/_floor.py, the proxy in its own
process, wrk's POST /step), one target at a time. CPU is read from /proc/<pid>/stat before and after
each wrk run. Context switches are read per thread from /proc/<pid>/task/*/status and counted for the
threads alive at the second read: the proxy's pooled workers are, the floor's threads (one per
connection, gone when wrk closes) are not, so the floor has no switch column. A diagnostic, not a published target:
vs_nginx.py stays the CPU figure. It needs wrk (`apt-get install -y wrk`).

`--hosts 1,2` adds the process host beside them, `AuthProxy.spawn(processes=N)` for each N (README's
answer for HTTP-heavy loads: N children sharing one port, each with its own GIL), its figures summed
over the N children. The host sets a 0.1 s switch interval for itself, so `host x1` is the fair
comparison for `host x2`, and `proxy` (benchmarks/_proxy_host.py, Python's 5 ms) for the floor. For
each N above 1 the floor runs as N forwarders sharing a port too (`floor x2`: `_floor.py --processes N`),
so N proxy processes can be read against N floor processes as well as against one.

`--floor-busy 800,1600` adds, for each N, a floor spinning N empty loop iterations per request
(`floor busy N`: `_floor.py --busy N`): as much pure Python per request as the proxy spends, with
nothing else of the proxy, shows whether the convoy comes with the amount of Python or with something
the proxy does.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vs_nginx  # noqa: E402  (benchmarks/ is not a package)
import ws_scale  # noqa: E402

sys.path.insert(1, os.path.dirname(HERE))  # the repo root, where proxy.py lives
from proxy import AuthProxy  # noqa: E402

CONNECTIONS = "1,64"  # the targets' two loads (--connections 4,8,16,32,64 shows where the convoy starts)


def process_counters(pid: int) -> Dict[str, Any]:
    """CPU seconds (user, kernel) of a process, and each live thread's context switches by thread id
    as (voluntary, involuntary)."""
    user_s, kernel_s = ws_scale._cpu_split(pid)
    threads: Dict[str, Tuple[int, int]] = {}
    for task in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/status" % (pid, task)) as status:
                fields = dict(line.split(":", 1) for line in status if "ctxt_switches" in line)
            threads[task] = (int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"]))
        except OSError:  # the thread ended between the listing and the read
            pass
    return {"user_s": user_s, "kernel_s": kernel_s, "threads": threads}


def group_counters(pids: List[int]) -> Dict[str, Any]:
    """process_counters summed over several processes (thread ids are unique across them)."""
    each = [process_counters(pid) for pid in pids]
    return {"user_s": sum(c["user_s"] for c in each), "kernel_s": sum(c["kernel_s"] for c in each),
            "threads": {tid: counts for c in each for tid, counts in c["threads"].items()}}


def per_request(before: Dict[str, Any], after: Dict[str, Any], requests: int) -> Dict[str, float]:
    """Growth per request: CPU in microseconds, and the context switches of the threads alive at the
    second read (one started since counts from zero; one that ended since counts nothing, rather
    than taking its whole history off the sum)."""
    n, earlier = max(requests, 1), before["threads"]
    switches = [(now[0] - earlier.get(tid, (0, 0))[0], now[1] - earlier.get(tid, (0, 0))[1])
                for tid, now in after["threads"].items()]
    return {"user_s": (after["user_s"] - before["user_s"]) * 1e6 / n,
            "kernel_s": (after["kernel_s"] - before["kernel_s"]) * 1e6 / n,
            "voluntary": sum(v for v, _ in switches) / n, "involuntary": sum(i for _, i in switches) / n}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--upstreams", default="plain,tls")
    parser.add_argument("--connections", default=CONNECTIONS, help="wrk connection counts (default %(default)s)")
    parser.add_argument("--hosts", default="", help="also AuthProxy.spawn(processes=N) for each N, e.g. 1,2")
    parser.add_argument("--floor-busy", default="", help="also a floor spinning N loop iterations per request, e.g. 800,1600")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.hosts.split(",") if n]
    busy = [int(n) for n in args.floor_busy.split(",") if n]
    workdir = tempfile.mkdtemp(prefix="gil-convoy-")
    script = vs_nginx.post_script(workdir)
    print("| rep | upstream | target | connections | req/s | user us/req | kernel us/req | voluntary switches/req "
          "| involuntary/req |\n|---|---|---|--:|--:|--:|--:|--:|--:|", flush=True)
    stack = vs_nginx.Stack(workdir).start()
    upstreams = args.upstreams.split(",")
    hosts: List[Any] = []  # the process hosts this run spawned, stopped at the end
    # target -> upstream -> (the pids its CPU is summed over, the URL of POST /step), in table order
    targets: Dict[str, Dict[str, Tuple[List[int], str]]] = {}

    def stack_target(name: str) -> Dict[str, Tuple[List[int], str]]:
        return {upstream: ([stack.pid(name, upstream)], stack.http_url(name, upstream, "/step"))
                for upstream in upstreams}

    try:
        targets["floor"] = stack_target("floor")
        floor_options = [("floor x%d" % n, ["--processes", str(n)]) for n in counts if n > 1]
        for name, options in floor_options + [("floor busy %d" % n, ["--busy", str(n)]) for n in busy]:
            for upstream in upstreams:
                info = stack._spawn(stack.floor_command(upstream) + options)
                targets.setdefault(name, {})[upstream] = (
                    [int(p) for p in info["pids"]], str(info["base_url"]) + "/step")
        targets["proxy"] = stack_target("proxy")
        for n in counts:
            for upstream in upstreams:
                host = AuthProxy.spawn(processes=n)
                hosts.append(host)
                base_url = host.mount(vs_nginx._proxy_upstream_url(stack, upstream), token=vs_nginx.BENCH_TOKEN,
                                      verify=stack.ca.ca_path if upstream == "tls" else True)
                targets.setdefault("host x%d" % n, {})[upstream] = (
                    host.pids if n > 1 else [host.pid], base_url + "/step")  # (one child has no `pids`)
        for rep in range(1, args.reps + 1):
            for upstream in upstreams:
                for target, where in targets.items():
                    pids, url = where[upstream]
                    for connections in [int(c) for c in args.connections.split(",")]:
                        before = group_counters(pids)
                        out = subprocess.run(
                            ["wrk", "-t%d" % min(2, connections), "-c%d" % connections, "-d%gs" % args.seconds,
                             "-s", script, url], capture_output=True, text=True, timeout=args.seconds + 30).stdout
                        parsed = vs_nginx._parse_wrk(out)
                        each = per_request(before, group_counters(pids), parsed["requests"] or 0)
                        switches = ("%.1f | %.1f" % (each["voluntary"], each["involuntary"])
                                    if not target.startswith("floor") else "- | -")
                        print("| %d | %s | %s | %d | %.0f | %.1f | %.1f | %s |" % (
                            rep, upstream, target, connections, parsed["rps"] or 0, each["user_s"],
                            each["kernel_s"], switches), flush=True)
    finally:
        for host in hosts:
            host.stop()
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
