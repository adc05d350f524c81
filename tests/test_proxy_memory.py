"""What the proxy keeps over time: nothing per route, request, session or upstream restart (issue 22's
memory target). Counts, not timings: live Python objects and threads after a bounded sequence."""
from __future__ import annotations

import gc
import logging
import os
import threading
import time
from pathlib import Path

import certifi
import pytest
import requests

import proxy as proxy_module
import support
from proxy import AuthProxy
from support import TEST_TOKEN

TIMEOUT = 10
# Rounds of mount / requests / WebSocket session / unmount before the baseline (caches, pools and
# interned strings fill: urllib.parse keeps the last 128 URLs it split, ~10 new ones per round) and
# measured after it.
WARM_ROUNDS = 16
MEASURED_ROUNDS = 24
# Allowed growth of the live object count from the baseline to the end. The floor of several samples
# is compared (robust to objects that merely happen to be alive at one sample); a route, connection
# or session kept per round would add hundreds of objects over the measured rounds.
OBJECT_SLACK = 60


def _live_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_routes_with_the_same_verify_share_one_tls_context_and_an_edited_bundle_is_reread(tmp_path, test_ca):
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(Path(test_ca.ca_path).read_bytes())
    first = proxy_module.Route("https://localhost:1", TEST_TOKEN, verify=str(bundle))
    second = proxy_module.Route("https://localhost:2", TEST_TOKEN, verify=str(bundle))
    assert first.tls_context() is second.tls_context()
    unverified = proxy_module.Route("https://localhost:3", TEST_TOKEN, verify=False)
    assert unverified.tls_context() is not first.tls_context()
    bundle.write_bytes(Path(test_ca.ca_path).read_bytes() + b"\n")  # edited: size and mtime change
    os.utime(str(bundle), ns=(time.time_ns() + 10 ** 9, time.time_ns() + 10 ** 9))
    third = proxy_module.Route("https://localhost:4", TEST_TOKEN, verify=str(bundle))
    assert third.tls_context() is not first.tls_context()


def test_routes_racing_to_their_first_tls_use_build_and_keep_one_context_between_them(tmp_path):
    # A CA bundle of certifi's size at a new path: a context nothing built before, whose load takes
    # long enough (the GIL let go while OpenSSL reads it) that routes unserialised each built their own.
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(Path(certifi.where()).read_bytes())
    routes = [proxy_module.Route("https://localhost:%d" % port, TEST_TOKEN, verify=str(bundle))
              for port in range(1, 17)]
    start = threading.Barrier(len(routes))
    contexts: list = [None] * len(routes)

    def first_use(index: int) -> None:
        start.wait()
        contexts[index] = routes[index].tls_context()

    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(len(routes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert all(context is contexts[0] for context in contexts) and contexts[0] is not None


@pytest.mark.slow  # many warm-up and measured rounds
def test_repeated_mount_request_session_unmount_keeps_the_live_object_count_flat_and_leaves_no_thread(
        test_ca, no_leaks):
    logging.disable(logging.INFO)  # pytest's and the test's log captures keep every record they see
    try:
        with support.Upstream() as plain, support.Upstream(tls=test_ca) as tls, \
                AuthProxy(read_timeout_s=TIMEOUT) as proxy, requests.Session() as session:
            samples = []
            for round_no in range(WARM_ROUNDS + MEASURED_ROUNDS):
                for upstream in (plain, tls):
                    base = proxy.mount(upstream.url, TEST_TOKEN, verify=test_ca.ca_path)
                    for _ in range(3):
                        assert session.post(base + "/step", json={"action": {}}, timeout=TIMEOUT).status_code == 200
                    with support.ws_connect(support.ws_url(base) + "/ws") as ws:
                        ws.send("ping")
                        assert ws.recv(timeout=TIMEOUT) == "ping"
                    assert proxy.unmount(base)
                    upstream.requests.clear()  # the test upstream records each request; the proxy must not
                if round_no % 6 == 5:
                    plain.kill_connections()  # the upstream "restarts": pooled connections die
                    tls.kill_connections()
                if round_no >= WARM_ROUNDS - 3:
                    samples.append(_live_objects())

            baseline, end = min(samples[:3]), min(samples[-3:])
            assert end - baseline <= OBJECT_SLACK, "live objects grew by %d over %d rounds (%s)" % (
                end - baseline, MEASURED_ROUNDS, samples)
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_an_unmounted_route_is_freed_once_its_last_websocket_session_ends_while_its_workers_park(
        scheme, test_ca):
    # A tunnel's two threads go back to the pool and park there: whatever a parked worker still
    # names (the last tunnel, its route) must not keep an unmounted route alive.
    with support.Upstream(tls=test_ca if scheme == "https" else None) as upstream, \
            AuthProxy(read_timeout_s=TIMEOUT) as proxy:
        base = proxy.mount(upstream.url, TEST_TOKEN, verify=test_ca.ca_path)
        with support.ws_connect(support.ws_url(base) + "/ws") as ws:
            ws.send("ping")
            assert ws.recv(timeout=TIMEOUT) == "ping"
        support.wait_until(lambda: not proxy._server.live_threads(), "the tunnel's threads to park",
                           TIMEOUT)
        assert proxy.unmount(base)
        support.wait_until(lambda: gc.collect() is not None and not len(proxy._seen_routes),
                           "the unmounted route to be freed", TIMEOUT)
        assert proxy._server.workers.counts()[1] >= 2  # both still parked, waiting for the next job
