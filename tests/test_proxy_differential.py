"""Differential tests: the proxy must answer exactly what a direct connection answers.

Hypothesis draws sequences of HTTP requests (2-20, over one to three client connections of one
client library: raw sockets, requests, http.client, httpx) against real upstreams in their own
processes (uvicorn serving an ASGI app, and a stdlib http.server; plain and TLS). Each sequence runs
once straight to the upstream (the test adds the token) and once through a freshly mounted route;
the transcripts must be equal (status, reason, end-to-end headers, body bytes, interim responses).
A proxy-made 502/504 the direct run did not get, a disagreement or a hang fails with the shrunk
minimal sequence and the seed. WebSocket sessions (websockets sync client, uvicorn) are compared the
same way: ordered messages, pongs, close codes.

Sizes: PROXY_DIFF_EXAMPLES (default 1000) sequences in the slow tier, a sample of 40 in the fast
tier; PROXY_DIFF_SEED fixes the seed (default below; "random" draws a new one). See
docs/proxy-conformance.md.
"""
from __future__ import annotations

import os
import random
import threading
from typing import Dict, Iterator, List

import pytest
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

import support
from diff_clients import (PROXY_MADE, Sequence, Step, Target, UpstreamProcess, run_sequence, start_upstreams)
from proxy import AuthProxy

TOKEN = "hf_difftoken_" + "Qm3Lr8Vx2Kp7"
SEED_ENV = os.environ.get("PROXY_DIFF_SEED", "20261123")
SEED = random.randrange(1 << 32) if SEED_ENV == "random" else int(SEED_ENV)
SLOW_EXAMPLES = int(os.environ.get("PROXY_DIFF_EXAMPLES", "1000"))
FAST_EXAMPLES = 30
WS_SLOW_EXAMPLES = max(1, SLOW_EXAMPLES // 5)
WS_FAST_EXAMPLES = 12

# name -> (script, tls, extra args). "uvicorn-ka" closes idle keep-alive connections after 0.3 s, so
# sequences with an idle step meet stale pooled connections (the proxy pools for up to 4 s).
UPSTREAMS = {
    "uvicorn": ("asgi_app.py", False, ()),
    "uvicorn-tls": ("asgi_app.py", True, ()),
    "uvicorn-ka": ("asgi_app.py", False, ("--keep-alive", "0.3")),
    "stdlib": ("stdlib_server.py", False, ()),
    "stdlib-tls": ("stdlib_server.py", True, ()),
}
IDLE_S = 0.45
SIZES = [0, 1, 100, 65535, 65536, 65537, 1 << 20, 8 << 20]
SIZE_WEIGHTS = [24, 10, 24, 8, 8, 8, 2, 1]
METHODS = ["GET", "GET", "GET", "POST", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
STATUSES = [200, 200, 200, 200, 201, 204, 304, 400, 404, 418, 500, 503]
BODY_SIZES = [0, 1, 1000, 65536, (1 << 20) + 1]
CLIENTS = ["raw", "raw", "requests", "httpx", "http.client"]


# --------------------------------------------------------------------------------------------------
# Fixtures: upstream processes; the module's one proxy is conftest's shared_proxy (a fresh route per sequence)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstreams(test_ca: support.TestCA) -> Iterator[Dict[str, UpstreamProcess]]:
    specs = [(name, script, tls, extra) for name, (script, tls, extra) in UPSTREAMS.items()]
    started = start_upstreams(specs, TOKEN, (test_ca.cert_path, test_ca.key_path))
    yield started
    for up in started.values():
        up.stop()


# --------------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------------


def _weighted(values: List[int], weights: List[int]) -> st.SearchStrategy[int]:
    return st.sampled_from([v for v, w in zip(values, weights) for _ in range(w)])


@st.composite
def steps(draw: st.DrawFn, upstream: str, client: str, keep_alive_only: bool, http10: bool = False) -> Step:
    stdlib = upstream.startswith("stdlib")
    method = draw(st.sampled_from(METHODS))
    with_body = method in ("POST", "PUT", "PATCH", "DELETE") and draw(st.integers(0, 4)) > 0
    body = draw(st.sampled_from(["length", "length", "chunked"])) if with_body else "none"
    size = draw(_weighted(SIZES, SIZE_WEIGHTS))
    return Step(
        method=method, size=size,
        mode=draw(st.sampled_from(["length", "chunked"] + (["close"] if stdlib and not keep_alive_only else []))),
        status=draw(st.sampled_from(STATUSES)),
        gzip=draw(st.integers(0, 5)) == 0,
        slow=size <= (1 << 20) and draw(st.integers(0, 8)) == 0,
        # http.client (so requests) takes a 1xx other than 100 for the final answer, directly or not
        interim=stdlib and client in ("raw", "httpx") and draw(st.integers(0, 5)) == 0,
        close=not keep_alive_only and draw(st.integers(0, 10)) == 0,
        body=body, body_size=draw(st.sampled_from(BODY_SIZES)) if with_body else 0,
        # not over HTTP/1.0: RFC 9110 10.1.1 has a server ignore Expect there (the proxy does), while
        # uvicorn still sends 100 Continue, so the two would differ by design
        expect=client == "raw" and with_body and not keep_alive_only and not http10 and draw(st.integers(0, 3)) == 0,
        abandon=client == "raw" and not keep_alive_only and draw(st.integers(0, 15)) == 0,
        # only clients that reconnect a stale keep-alive connection themselves (as the proxy does for
        # its pool): http.client and the raw client would fail on their own idle connection, directly
        idle=IDLE_S if upstream == "uvicorn-ka" and client in ("requests", "httpx") and draw(st.integers(0, 8)) == 0
        else 0.0,
    )


@st.composite
def sequences(draw: st.DrawFn) -> Sequence:
    upstream = draw(st.sampled_from(sorted(UPSTREAMS)))
    client = draw(st.sampled_from(CLIENTS))
    pipelined = client == "raw" and draw(st.integers(0, 4)) == 0
    http10 = client == "raw" and not pipelined and draw(st.integers(0, 6)) == 0
    total = draw(st.integers(2, 20) if draw(st.integers(0, 5)) == 0 else st.integers(2, 5))
    n_conns = draw(st.integers(1, min(3, total)))
    cuts = sorted(draw(st.lists(st.integers(1, total - 1), min_size=n_conns - 1, max_size=n_conns - 1, unique=True)))
    bounds = [0] + cuts + [total]
    conns = [draw(st.lists(steps(upstream, client, pipelined, http10), min_size=b - a, max_size=b - a))
             for a, b in zip(bounds, bounds[1:])]
    return Sequence(upstream, client, conns, pipelined, http10)


# --------------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------------


def _targets(up: UpstreamProcess, proxy: AuthProxy, test_ca: support.TestCA):  # type: ignore[no-untyped-def]
    direct = Target(up.url, {"Authorization": "Bearer " + TOKEN}, test_ca if up.tls else None)
    base = proxy.mount(up.url, TOKEN, verify=test_ca.ca_path)
    return direct, Target(base, {}, None), base


def _run_both(seq: Sequence, direct: Target, proxied: Target, limit_s: float):  # type: ignore[no-untyped-def]
    """Run the sequence directly and through the proxy at the same time (independent connections,
    so neither run sees the other), each in a thread; a run not done in time is a hang (a failure)."""
    results: Dict[str, list] = {}
    threads = [threading.Thread(target=lambda k=k, t=t: results.__setitem__(k, run_sequence(seq, t)), daemon=True)
               for k, t in (("direct", direct), ("proxy", proxied))]
    for thread in threads:
        thread.start()
    for thread, name in zip(threads, ("direct", "proxy")):
        thread.join(limit_s)
        assert not thread.is_alive(), "hang: the %s run did not finish within %.0f s" % (name, limit_s)
    assert len(results) == 2, "a client runner raised (see the captured stderr)"
    return results["direct"], results["proxy"]


def check_sequence(seq: Sequence, upstreams: Dict[str, UpstreamProcess], proxy: AuthProxy,
                   test_ca: support.TestCA) -> None:
    note("seed=%d (PROXY_DIFF_SEED)" % SEED)
    direct_target, proxy_target, base = _targets(upstreams[seq.upstream], proxy, test_ca)
    try:
        direct, proxied = _run_both(seq, direct_target, proxy_target, 120)
    finally:
        proxy.unmount(base)
    for conn_no, (want, got) in enumerate(zip(direct, proxied)):
        for step_no, (a, b) in enumerate(zip(want, got)):
            where = "connection %d, step %d: %r" % (conn_no, step_no, seq.connections[conn_no][step_no])
            if b[0] in PROXY_MADE and a[0] != b[0]:
                pytest.fail("proxy-made %s where direct got %s at %s" % (b[0], a[0], where))
            assert b == a, "disagreement at %s" % where


# PROXY_DIFF_SHRINK=0 reports the first failing sequence as drawn (shrinking a hang takes minutes).
SHRINK = os.environ.get("PROXY_DIFF_SHRINK", "1") != "0"
DIFF_SETTINGS = dict(deadline=None, database=None, print_blob=True, report_multiple_bugs=False,
                     phases=[Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if SHRINK else []),
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.function_scoped_fixture])


@seed(SEED)
@settings(max_examples=FAST_EXAMPLES, **DIFF_SETTINGS)
@given(seq=sequences())
def test_proxy_answers_what_a_direct_connection_answers_sample(seq, upstreams, shared_proxy, test_ca):
    check_sequence(seq, upstreams, shared_proxy, test_ca)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@seed(SEED + 1)
@settings(max_examples=SLOW_EXAMPLES, **DIFF_SETTINGS)
@given(seq=sequences())
def test_proxy_answers_what_a_direct_connection_answers(seq, upstreams, shared_proxy, test_ca):
    check_sequence(seq, upstreams, shared_proxy, test_ca)
