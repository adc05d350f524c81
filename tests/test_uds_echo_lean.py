"""The lean echo stand-in benchmarks/pool.py runs in each sandbox (tests/upstreams/uds_echo_lean.py), started as
the benchmark starts it (`python -I -S`), against real clients on its unix socket: it must answer what the
emulator's echo server answers, over HTTP keep-alive and a WebSocket session, and end on SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from typing import Iterator, Tuple

import pytest
from websockets.sync.client import unix_connect

from hf_jobs_emulator import EchoEnvironment
from support import wait_until

LEAN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstreams", "uds_echo_lean.py")


@pytest.fixture
def lean_server(socket_dir) -> Iterator[Tuple[subprocess.Popen, str]]:
    path = os.path.join(socket_dir, "8000.sock")
    proc = subprocess.Popen([sys.executable, "-I", "-S", LEAN], env={**os.environ, "HF_SANDBOX_SOCKET": path},
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("uds_echo_lean: serving on %s" % path)
        yield proc, path
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def _http(path: str, raw: bytes, answers: int) -> list:
    """Send `raw` (one or more pipelined requests) on one connection; the JSON bodies of `answers` answers."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        sock.sendall(raw)
        data, bodies = b"", []
        while len(bodies) < answers:
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0:
                head = data[:head_end].decode("latin-1").lower()
                size = int(head.split("content-length:")[1].split("\r\n")[0])
                if len(data) >= head_end + 4 + size:
                    bodies.append((head.split(" ")[1], json.loads(data[head_end + 4:head_end + 4 + size])))
                    data = data[head_end + 4 + size:]
                    continue
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection early"
            data += chunk
        return bodies


def test_the_lean_server_answers_http_requests_on_one_keep_alive_connection_as_the_echo_server_does(lean_server):
    _, path = lean_server
    step = json.dumps({"action": {"message": "hello"}}).encode()
    answers = _http(path, b"GET /health HTTP/1.1\r\nHost: env\r\n\r\n"
                          b"POST /reset HTTP/1.1\r\nHost: env\r\nContent-Length: 2\r\n\r\n{}"
                          b"POST /step HTTP/1.1\r\nHost: env\r\nContent-Length: %d\r\n\r\n%s"
                          b"GET /state HTTP/1.1\r\nHost: env\r\n\r\n"
                          b"GET /nowhere HTTP/1.1\r\nHost: env\r\n\r\n" % (len(step), step), 5)
    assert answers[0] == ("200", {"status": "healthy"})
    assert answers[1] == ("200", EchoEnvironment().reset())
    assert answers[2] == ("200", EchoEnvironment().step("hello"))
    assert answers[3][0] == "200" and answers[3][1]["step_count"] == 1
    assert answers[4] == ("404", {"detail": "Not Found"})


def test_the_lean_server_runs_an_openenv_websocket_session_with_long_messages(lean_server):
    _, path = lean_server
    long_message = "x" * 70000  # a 64-bit frame length each way
    with unix_connect(path, uri="ws://env/ws", compression=None, max_size=None) as ws:
        ws.send(json.dumps({"type": "reset", "data": {}}))
        assert json.loads(ws.recv()) == {"type": "observation", "data": EchoEnvironment().reset()}
        for message in ("hi", "y" * 300, long_message):  # 7-bit, 16-bit and 64-bit lengths
            ws.send(json.dumps({"type": "step", "data": {"message": message}}))
            assert json.loads(ws.recv()) == {"type": "observation", "data": EchoEnvironment().step(message)}
        ws.send(json.dumps({"type": "state"}))
        assert json.loads(ws.recv())["data"]["step_count"] == 3
        ws.send(json.dumps({"type": "nonsense"}))
        assert json.loads(ws.recv())["data"]["code"] == "UNKNOWN_TYPE"


def test_the_lean_server_ends_on_sigterm(lean_server):
    proc, _ = lean_server
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: proc.poll() is not None, "the server to exit on SIGTERM")
    assert proc.returncode == 0
