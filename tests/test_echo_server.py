"""The stdlib OpenEnv echo server of hf_jobs_emulator: HTTP endpoints, /ws sessions, and its CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

import hf_jobs_emulator
from hf_jobs_emulator import EchoServer
from support import read_to_eof

ws_sync = pytest.importorskip("websockets.sync.client")
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK  # noqa: E402

TIMEOUT = 10


@pytest.fixture
def echo():
    with EchoServer() as server:
        yield server


def ws_url(server: EchoServer) -> str:
    return server.url.replace("http://", "ws://") + "/ws"


def ask(ws, message: dict) -> dict:
    ws.send(json.dumps(message))
    return json.loads(ws.recv(timeout=TIMEOUT))


# -- HTTP ------------------------------------------------------------------------------------------


def test_health_metadata_and_schema_answer_openenv_shapes(echo):
    assert requests.get(echo.url + "/health", timeout=TIMEOUT).json() == {"status": "healthy"}
    metadata = requests.get(echo.url + "/metadata", timeout=TIMEOUT).json()
    assert metadata["name"] == "EchoEnvironment" and "description" in metadata
    schema = requests.get(echo.url + "/schema", timeout=TIMEOUT).json()
    assert set(schema) == {"action", "observation", "state"}
    assert schema["action"]["required"] == ["message"]


def test_http_endpoints_share_one_stateful_environment_over_one_session(echo):
    with requests.Session() as http:
        reset = http.post(echo.url + "/reset", json={"episode_id": "ep-1"}, timeout=TIMEOUT).json()
        assert reset == {"observation": {"echoed_message": "Echo environment ready!", "message_length": 23},
                         "reward": 0.0, "done": False}
        step = http.post(echo.url + "/step", json={"action": {"message": "hello"}}, timeout=TIMEOUT).json()
        assert step["observation"] == {"echoed_message": "hello", "message_length": 5}
        assert step["reward"] == pytest.approx(0.5) and step["done"] is False
        http.post(echo.url + "/step", json={"action": {"message": "again"}}, timeout=TIMEOUT)
        assert http.get(echo.url + "/state", timeout=TIMEOUT).json() == {"episode_id": "ep-1", "step_count": 2}
    # another client sees the same environment: legacy servers keep one env for all HTTP callers
    assert requests.get(echo.url + "/state", timeout=TIMEOUT).json()["step_count"] == 2


def test_reset_without_body_starts_a_fresh_episode(echo):
    requests.post(echo.url + "/step", json={"action": {"message": "x"}}, timeout=TIMEOUT)
    assert requests.post(echo.url + "/reset", timeout=TIMEOUT).status_code == 200
    state = requests.get(echo.url + "/state", timeout=TIMEOUT).json()
    assert state["step_count"] == 0 and state["episode_id"]


@pytest.mark.parametrize("body, field", [
    ({"action": {}}, "message"),
    ({"action": {"message": 3}}, "message"),
    ({"action": {"message": "a", "extra": 1}}, "extra"),
    ({"no_action": 1}, "action"),
])
def test_invalid_step_answers_422_naming_the_field(echo, body, field):
    answer = requests.post(echo.url + "/step", json=body, timeout=TIMEOUT)
    assert answer.status_code == 422
    assert any(field in error["loc"] for error in answer.json()["detail"])


def test_invalid_json_and_bad_reset_options_answer_422(echo):
    bad_json = requests.post(echo.url + "/step", data=b"{nope", timeout=TIMEOUT,
                             headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 422 and bad_json.json()["detail"][0]["type"] == "json_invalid"
    bad_seed = requests.post(echo.url + "/reset", json={"seed": -1}, timeout=TIMEOUT)
    assert bad_seed.status_code == 422 and bad_seed.json()["detail"][0]["loc"] == ["body", "seed"]


def test_unknown_route_is_404_and_wrong_method_is_405(echo):
    assert requests.get(echo.url + "/nope", timeout=TIMEOUT).status_code == 404
    assert requests.get(echo.url + "/step", timeout=TIMEOUT).status_code == 405
    assert requests.post(echo.url + "/health", timeout=TIMEOUT).status_code == 405


def test_negative_step_delay_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="step_delay_s"):
        EchoServer(step_delay_s=-1)


# -- WebSocket -------------------------------------------------------------------------------------


@pytest.mark.parametrize("compression", ["deflate", None])
def test_websocket_reset_step_state_and_close(echo, compression):
    with ws_sync.connect(ws_url(echo), open_timeout=TIMEOUT, close_timeout=TIMEOUT, compression=compression) as ws:
        reset = ask(ws, {"type": "reset", "data": {"episode_id": "ws-1"}})
        assert reset["type"] == "observation"
        assert reset["data"]["observation"]["echoed_message"] == "Echo environment ready!"
        step = ask(ws, {"type": "step", "data": {"message": "héllo"}})
        assert step["data"]["observation"] == {"echoed_message": "héllo", "message_length": 5}
        assert ask(ws, {"type": "state"}) == {"type": "state", "data": {"episode_id": "ws-1", "step_count": 1}}
        ws.send(json.dumps({"type": "close"}))
        with pytest.raises(ConnectionClosedOK):  # the server ends the session after a close message
            ws.recv(timeout=TIMEOUT)
        assert ws.close_code == 1000


def test_each_websocket_session_has_its_own_environment(echo):
    with ws_sync.connect(ws_url(echo), open_timeout=TIMEOUT) as first, \
            ws_sync.connect(ws_url(echo), open_timeout=TIMEOUT) as second:
        ask(first, {"type": "reset", "data": {"episode_id": "a"}})
        ask(second, {"type": "reset", "data": {"episode_id": "b"}})
        for _ in range(3):
            ask(first, {"type": "step", "data": {"message": "x"}})
        assert ask(first, {"type": "state"})["data"] == {"episode_id": "a", "step_count": 3}
        assert ask(second, {"type": "state"})["data"] == {"episode_id": "b", "step_count": 0}
    # and neither touched the shared HTTP environment
    assert requests.get(echo.url + "/state", timeout=TIMEOUT).json()["step_count"] == 0


def test_websocket_errors_use_openenv_error_codes(echo):
    with ws_sync.connect(ws_url(echo), open_timeout=TIMEOUT) as ws:
        ws.send("{not json")
        assert json.loads(ws.recv(timeout=TIMEOUT))["data"]["code"] == "INVALID_JSON"
        assert ask(ws, {"type": "dance"})["data"]["code"] == "UNKNOWN_TYPE"
        invalid = ask(ws, {"type": "step", "data": {"msg": "typo"}})
        assert invalid["type"] == "error" and invalid["data"]["code"] == "VALIDATION_ERROR"
        ws.send(b"\x00\x01")
        assert json.loads(ws.recv(timeout=TIMEOUT))["data"]["code"] == "INVALID_JSON"
        # the session survives its errors
        assert ask(ws, {"type": "step", "data": {"message": "ok"}})["type"] == "observation"


def test_websocket_fragmented_messages_pings_and_compression_work(echo):
    with ws_sync.connect(ws_url(echo), open_timeout=TIMEOUT, compression="deflate") as ws:
        assert "permessage-deflate" in ws.response.headers.get("Sec-WebSocket-Extensions", "")
        big = "z" * 200_000
        text = json.dumps({"type": "step", "data": {"message": big}})
        ws.send([text[:1000], text[1000:50_000], text[50_000:]])  # one message in three frames
        assert json.loads(ws.recv(timeout=TIMEOUT))["data"]["observation"]["message_length"] == len(big)
        ws.ping().wait(TIMEOUT)


def test_stop_closes_open_websocket_sessions():
    server = EchoServer().start()
    try:
        with ws_sync.connect(ws_url(server), open_timeout=TIMEOUT) as ws:
            ask(ws, {"type": "reset", "data": {}})
            server.stop()
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=TIMEOUT)
    finally:
        server.stop()


def test_a_plain_get_on_ws_is_a_400_not_a_hang(echo):
    answer = requests.get(echo.url + "/ws", timeout=TIMEOUT)
    assert answer.status_code == 400


def test_openenv_generic_client_talks_to_the_echo_server(echo):
    openenv = pytest.importorskip("openenv.core")
    with openenv.GenericEnvClient(base_url=echo.url).sync() as client:
        result = client.reset()
        assert result.observation["echoed_message"] == "Echo environment ready!"
        result = client.step({"message": "from openenv"})
        assert result.observation["echoed_message"] == "from openenv"
        assert result.reward == pytest.approx(1.2)
        assert client.state()["step_count"] == 1


# -- CLI -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(url: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} never answered /health")
        time.sleep(0.05)


def test_cli_echo_server_listens_on_dollar_port_and_exits_cleanly_on_sigterm():
    port = free_port()
    env = dict(os.environ, PORT=str(port), ECHO_STEP_DELAY_S="0")
    proc = subprocess.Popen([sys.executable, hf_jobs_emulator.__file__, "echo-server"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
        step = requests.post(f"http://127.0.0.1:{port}/step", json={"action": {"message": "cli"}}, timeout=TIMEOUT)
        assert step.json()["observation"]["echoed_message"] == "cli"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0
        assert f"127.0.0.1:{port}" in out.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)


def test_cli_echo_server_refuses_a_bad_step_delay_with_the_variable_name():
    env = dict(os.environ, PORT=str(free_port()), ECHO_STEP_DELAY_S="slow")
    done = subprocess.run([sys.executable, hf_jobs_emulator.__file__, "echo-server"], env=env,
                          capture_output=True, timeout=TIMEOUT)
    assert done.returncode != 0
    assert b"ECHO_STEP_DELAY_S" in done.stderr


def _unix_request(path: str, raw: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT)
        sock.connect(path)
        sock.sendall(raw)
        return read_to_eof(sock)


def test_cli_echo_server_in_a_pooled_sandbox_binds_the_sbx_proxy_dir_socket_of_its_port(socket_dir):
    """In a pooled sandbox ($SBX_PROXY_DIR set, no TCP port to bind) it serves HTTP and /ws on
    `$SBX_PROXY_DIR/<port>.sock`, the socket the host's `proxy/<port>/...` forwards to."""
    env = dict(os.environ, SBX_PROXY_DIR=socket_dir, PORT="8123")
    proc = subprocess.Popen([sys.executable, hf_jobs_emulator.__file__, "echo-server"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    path = os.path.join(socket_dir, "8123.sock")
    try:
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(path):
            assert proc.poll() is None and time.monotonic() < deadline, "no socket at %s" % path
            time.sleep(0.02)
        body = json.dumps({"action": {"message": "socket"}}).encode()
        head = (b"POST /step HTTP/1.1\r\nHost: sandbox\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        step = _unix_request(path, head + body)
        assert step.startswith(b"HTTP/1.1 200") and b'"echoed_message": "socket"' in step, step
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(path)
            with ws_sync.connect("ws://sandbox/ws", sock=raw, open_timeout=TIMEOUT) as ws:
                answer = ask(ws, {"type": "step", "data": {"message": "ws"}})
        assert answer["data"]["observation"]["echoed_message"] == "ws"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0 and path in out.decode()
        assert not os.path.exists(path)  # removed at exit: the port's next server binds it afresh
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
