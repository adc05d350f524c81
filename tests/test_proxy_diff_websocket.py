"""Differential WebSocket tests: the same seeded session (websockets sync client) against uvicorn
directly and through a freshly mounted proxy route must see the same ordered messages, pongs and
close codes. Sizes straddle the frame-length encodings (0, 125, 126, 65535, 65536) and 1 MiB; text
and binary both ways, fragmented messages, bursts both ways, pings, close codes from either side.
Runs PROXY_DIFF_EXAMPLES / 5 sessions in the slow tier and a small sample in the fast tier.
"""
from __future__ import annotations

import faulthandler
import hashlib
import threading
from typing import Dict, Iterator, List, Tuple

import pytest
from hypothesis import given, note, reject, seed, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed

import support
from diff_clients import UpstreamProcess, start_upstreams
from test_proxy_differential import DIFF_SETTINGS, SEED, TOKEN, WS_FAST_EXAMPLES, WS_SLOW_EXAMPLES

WS_SIZES = [0, 125, 126, 65535, 65536, 1 << 20]
CLIENT_CLOSE_CODES = [1000, 1001, 3000, 4000, 4999]
SERVER_CLOSE_CODES = [1000, 1008, 1011, 3001, 4001]
Op = Tuple


@pytest.fixture(scope="module")
def ws_upstreams(test_ca: support.TestCA) -> Iterator[Dict[str, UpstreamProcess]]:
    started = start_upstreams([("uvicorn", "asgi_app.py", False, ()), ("uvicorn-tls", "asgi_app.py", True, ())],
                              TOKEN, (test_ca.cert_path, test_ca.key_path))
    yield started
    for up in started.values():
        up.stop()


size = st.sampled_from(WS_SIZES)
ops = st.one_of(
    st.tuples(st.just("text"), size),
    st.tuples(st.just("binary"), size),
    st.tuples(st.just("fragmented"), st.sampled_from(["text", "binary"]), st.lists(size, min_size=2, max_size=4)),
    st.tuples(st.just("ping"), st.binary(max_size=125)),
    st.tuples(st.just("burst"), st.integers(1, 30), st.sampled_from([0, 125, 126, 65536])),
    st.tuples(st.just("client-burst"), st.integers(2, 30), st.sampled_from([1, 126, 65535])),
)
endings = st.one_of(st.tuples(st.just("client-close"), st.sampled_from(CLIENT_CLOSE_CODES)),
                    st.tuples(st.just("server-close"), st.sampled_from(SERVER_CLOSE_CODES)))
sessions = st.tuples(st.sampled_from(["uvicorn", "uvicorn-tls"]), st.lists(ops, min_size=1, max_size=12), endings)


def _payload(kind: str, n: int, salt: int) -> object:
    data = (hashlib.sha256(b"ws%d" % salt).hexdigest() * (n // 64 + 1))[:n]
    return data if kind == "text" else data.encode()


def _digest(message: object) -> Tuple[str, int, str]:
    raw = message.encode() if isinstance(message, str) else message
    return ("text" if isinstance(message, str) else "binary", len(raw), hashlib.sha256(raw).hexdigest()[:16])  # type: ignore[arg-type]


def play(url: str, headers: Dict[str, str], tls: object, steps: List[Op], ending: Op) -> List[object]:
    """Run one session; the transcript of everything the client received, in order."""
    got: List[object] = []
    # max_queue=None: the client's background reader never stops reading. With the default (16
    # messages) a client burst can deadlock against the server's echoes when it talks to the server
    # directly: the server stops reading while its sends wait, and the client blocks in send.
    options = {"additional_headers": headers, "max_queue": None}
    if tls is not None:
        options["ssl"] = tls.client_context()  # type: ignore[attr-defined]
    with support.ws_connect(url, **options) as ws:
        for i, op in enumerate(steps):
            if op[0] in ("text", "binary"):
                ws.send(_payload(op[0], op[1], i))
                got.append(_digest(ws.recv(timeout=20)))
            elif op[0] == "fragmented":
                ws.send([_payload(op[1], n, i * 10 + j) for j, n in enumerate(op[2])])
                got.append(_digest(ws.recv(timeout=20)))
            elif op[0] == "ping":
                waiter = ws.ping(op[1])
                got.append(("pong", waiter.wait(20)))
            elif op[0] == "burst":
                ws.send("burst:%d:%d" % (op[1], op[2]))
                got.extend(_digest(ws.recv(timeout=20)) for _ in range(op[1]))
            elif op[0] == "client-burst":
                for j in range(op[1]):
                    ws.send(_payload("binary", op[2], j))
                got.extend(_digest(ws.recv(timeout=20)) for _ in range(op[1]))
        if ending[0] == "client-close":
            ws.close(ending[1], "client says bye")
        else:
            ws.send("close:%d" % ending[1])
            try:
                ws.recv(timeout=20)
                got.append("no close")
            except ConnectionClosed:
                pass
        got.append(("close", ws.close_code, ws.close_reason))
    return got


def check_session(session, upstreams, proxy, test_ca) -> None:  # type: ignore[no-untyped-def]
    name, steps, ending = session
    note("seed=%d (PROXY_DIFF_SEED)" % SEED)
    up = upstreams[name]
    base = proxy.mount(up.url, TOKEN, verify=test_ca.ca_path)
    results: Dict[str, List[object]] = {}
    try:
        runs = {"direct": (support.ws_url(up.url) + "/ws", {"Authorization": "Bearer " + TOKEN}, test_ca if up.tls else None),
                "proxy": (support.ws_url(base) + "/ws", {}, None)}
        threads = [threading.Thread(target=lambda k=k, a=a: results.__setitem__(k, play(a[0], a[1], a[2], steps, ending)),
                                    daemon=True) for k, a in runs.items()]
        for thread in threads:
            thread.start()
        direct, proxied = threads
        proxied.join(120)
        if proxied.is_alive():  # say where every thread (the proxy's included) is stuck
            faulthandler.dump_traceback(all_threads=True)
        assert not proxied.is_alive(), "hang: the WebSocket session through the proxy did not finish within 120 s"
        direct.join(20)  # it ran beside the proxied one: it is done by now unless it is stuck
    finally:
        proxy.unmount(base)
    assert "proxy" in results, "the session through the proxy raised (see the captured stderr)"
    if "direct" not in results:
        # The reference run itself failed: now and then uvicorn leaves a direct TLS handshake unanswered
        # for over 10 s, and the websockets client then blocks in its own cleanup. That says nothing about
        # the proxy (whose run finished), so the example is inconclusive rather than a disagreement.
        note("the direct run failed or hung: example rejected")
        reject()
    assert results["proxy"] == results["direct"]


@pytest.mark.timeout(600)  # an inconclusive example waits for its stuck reference run
@seed(SEED + 2)
@settings(max_examples=WS_FAST_EXAMPLES, **DIFF_SETTINGS)
@given(session=sessions)
def test_websocket_through_the_proxy_matches_direct_sample(session, ws_upstreams, shared_proxy, test_ca):
    check_session(session, ws_upstreams, shared_proxy, test_ca)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@seed(SEED + 3)
@settings(max_examples=WS_SLOW_EXAMPLES, **DIFF_SETTINGS)
@given(session=sessions)
def test_websocket_through_the_proxy_matches_direct(session, ws_upstreams, shared_proxy, test_ca):
    check_session(session, ws_upstreams, shared_proxy, test_ca)
