"""Run one `proxy.AuthProxy` in its own process for benchmarks/ws_scale.py.

The proxy gets a process of its own so its resident memory and thread count can be read from
/proc/<pid>/status without counting the load generator or the upstream. It mounts one upstream,
prints `{"base_url": ..., "pid": ...}` on stdout, and serves until stdin closes (or SIGTERM):

    python benchmarks/_proxy_host.py http://127.0.0.1:PORT
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
# The benchmark token: any string works, the upstream here has no gate; never a real credential.
BENCH_TOKEN = "ws-scale-benchmark-token"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("upstream", help="loopback http:// URL of the environment server")
    args = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    sys.path.insert(1, os.path.dirname(HERE))  # the repo root, where proxy.py lives
    from _loadgen import raise_nofile_limit
    from proxy import AuthProxy

    raise_nofile_limit()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with AuthProxy() as proxy:
        base_url = proxy.mount(args.upstream, token=BENCH_TOKEN)
        print(json.dumps({"base_url": base_url, "pid": os.getpid()}), flush=True)
        waiter = threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True)
        waiter.start()
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
