"""Run one `proxy.AuthProxy` in its own process for benchmarks/ws_scale.py.

The proxy gets a process of its own so its resident memory and thread count can be read from
/proc/<pid>/status without counting the load generator or the upstream. It mounts one upstream,
prints `{"base_url": ..., "pid": ...}` on stdout once every thread of the idle proxy runs, and serves
until stdin closes (or SIGTERM). On SIGUSR1 it prints `{"threads": [{"name", "stack"}, ...]}`, one line
naming each live thread with its stack, so a caller whose thread count did not drain can name a leak:

    python benchmarks/_proxy_host.py http://127.0.0.1:PORT [--verify CA_PEM] [--profile proxy.pstats]

`--profile` runs every thread of the proxy under cProfile and writes the merged statistics on exit
(read them with `python -m pstats FILE`): a diagnostic for finding where the proxy spends its CPU.
It slows the proxy down, so never combine it with numbers you publish.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import signal
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
# The benchmark token: any string works, the upstream here has no gate; never a real credential.
BENCH_TOKEN = "ws-scale-benchmark-token"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("upstream", help="loopback http:// (or https://) URL of the environment server")
    parser.add_argument("--verify", default=None, metavar="CA_PEM",
                        help="CA bundle for an https upstream (default: the system store)")
    parser.add_argument("--profile", metavar="FILE", default=None,
                        help="profile every proxy thread, write merged pstats here on exit")
    parser.add_argument("--switch-interval", type=float, default=None, metavar="S",
                        help="sys.setswitchinterval(S) first, as `python proxy.py` does (default: Python's 5 ms)")
    parser.add_argument("--worker-idle-s", type=float, default=None, metavar="S",
                        help="parked worker threads end after S idle seconds (default proxy.WORKER_IDLE_S)")
    args = parser.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    profiles = _profile_all_threads() if args.profile else None
    sys.path.insert(0, HERE)
    sys.path.insert(1, os.path.dirname(HERE))  # the repo root, where proxy.py lives
    from _loadgen import raise_nofile_limit
    import proxy as proxy_module
    from proxy import AuthProxy

    if args.worker_idle_s:
        proxy_module.WORKER_IDLE_S = args.worker_idle_s  # read when the server starts

    raise_nofile_limit()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, _print_threads)
    with AuthProxy() as proxy:
        base_url = proxy.mount(args.upstream, token=BENCH_TOKEN, verify=args.verify or True)
        # Started before the ready line: ws_scale takes the thread count it reads right after that
        # line as the idle baseline, and under load it read it before this thread existed (2, not 3).
        waiter = threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), name="stdin-waiter", daemon=True)
        waiter.start()
        print(json.dumps({"base_url": base_url, "pid": os.getpid()}), flush=True)
        stop.wait()
    if profiles is not None:
        _write_profile(profiles, args.profile)
    return 0


def _print_threads(signum: int, interrupted: Optional[FrameType]) -> None:
    """Answer SIGUSR1 with one stdout line naming every live thread with its stack (innermost frame
    last; for the main thread, which runs this handler, where the signal interrupted it)."""
    frames: Dict[int, Optional[FrameType]] = dict(sys._current_frames())
    frames[threading.get_ident()] = interrupted
    threads = [{"name": t.name, "stack": traceback.format_stack(frames[t.ident]) if frames.get(t.ident) else []}
               for t in threading.enumerate()]
    print(json.dumps({"threads": threads}), flush=True)


def _profile_all_threads() -> List[cProfile.Profile]:
    """Wrap Thread.run so each thread started from now on runs under its own cProfile.Profile."""
    profiles: List[cProfile.Profile] = []
    lock = threading.Lock()
    original_run = threading.Thread.run

    def profiled_run(self: threading.Thread) -> None:
        prof = cProfile.Profile(time.thread_time)  # CPU, not wall: blocking reads cost nothing
        prof.enable()
        try:
            original_run(self)
        finally:
            prof.disable()
            with lock:
                profiles.append(prof)

    threading.Thread.run = profiled_run  # type: ignore[method-assign]
    return profiles


def _write_profile(profiles: List[cProfile.Profile], path: str) -> None:
    """Merge the finished threads' profiles into one pstats file (threads still running are lost)."""
    done = list(profiles)
    if not done:
        print("no proxy thread finished: nothing profiled", file=sys.stderr)
        return
    stats = pstats.Stats(done[0])
    for prof in done[1:]:
        stats.add(prof)
    stats.dump_stats(path)


if __name__ == "__main__":
    sys.exit(main())
