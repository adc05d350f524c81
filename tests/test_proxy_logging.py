"""What the proxy tells its logger about a failing upstream: one WARNING when a run of identical failures
starts (a booting job fails every readiness probe alike), the repeats at DEBUG, one INFO on recovery."""

from __future__ import annotations

import http.server
import logging
import socket
import threading

import requests

from proxy import AuthProxy


class _Ok(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - stdlib hook name
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def _proxy_records(caplog, level: int):
    return [r for r in caplog.records if r.name == "proxy" and r.levelno == level]


def test_a_run_of_identical_upstream_failures_warns_once_and_recovery_is_noted(caplog):
    caplog.set_level(logging.DEBUG, logger="proxy")
    reserved = socket.socket()
    reserved.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
    port = reserved.getsockname()[1]
    with AuthProxy() as proxy, requests.Session() as session:
        base = proxy.mount("http://127.0.0.1:%d" % port, token="t")
        answers = [session.get(base + "/health", timeout=10) for _ in range(5)]
        assert [a.status_code for a in answers] == [502] * 5
        assert all(a.headers["X-Proxy-Error"] == "upstream-unreachable" for a in answers)
        warnings = [r.getMessage() for r in _proxy_records(caplog, logging.WARNING)]
        assert len(warnings) == 1 and "upstream-unreachable" in warnings[0], warnings
        repeats = [r for r in _proxy_records(caplog, logging.DEBUG) if "upstream-unreachable" in r.getMessage()]
        assert len(repeats) == 4

        reserved.close()
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Ok)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            assert session.get(base + "/health", timeout=10).status_code == 200
            assert session.get(base + "/health", timeout=10).status_code == 200
        finally:
            server.shutdown()
            server.server_close()
            thread.join(5)
        infos = [r.getMessage() for r in _proxy_records(caplog, logging.INFO) if "answering again" in r.getMessage()]
        assert len(infos) == 1 and "5 failed attempt(s)" in infos[0], infos
        assert len(_proxy_records(caplog, logging.WARNING)) == 1
