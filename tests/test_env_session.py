"""`EnvSession`, the library's blocking OpenEnv WebSocket session: against the stdlib echo server, through
the provider and the emulator's token gate, against a real OpenEnv `create_app` server, from plain
threads and from inside a running asyncio loop; typed errors when the environment, the proxy or the job
says no; timeouts that close the session instead of mixing up replies."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from hf_jobs_emulator import EchoEnvironment, EchoServer, echo_server_command
from support import wait_until
from hf_sandbox_provider import (EnvError, EnvSession, HFSandboxProvider, SandboxConfigError, SessionError,
                                 SessionRefusedError, SessionTimeout)

TIMEOUT = 30.0
SEQUENCE_SEEDS = range(6)
SEQUENCE_LENGTH = 40


@pytest.fixture
def echo_url():
    with EchoServer() as server:
        yield server.url


def run_sequence(session: EnvSession, seed: int) -> dict:
    """A random sequence of OpenEnv messages, each answer checked against a local EchoEnvironment."""
    rng = random.Random(seed)
    model = EchoEnvironment()
    session.reset(episode_id="seed-%d" % seed)
    model.reset(episode_id="seed-%d" % seed)
    for _ in range(SEQUENCE_LENGTH):
        op = rng.choice(["step", "step", "state", "reset", "bad-step", "unknown"])
        if op == "step":
            message = "".join(rng.choice("ab ✓\n\"") for _ in range(rng.randint(0, 12)))
            assert session.step({"message": message}) == model.step(message)
        elif op == "state":
            assert session.state() == model.state()
        elif op == "reset":
            episode = "e%d" % rng.randint(0, 1000)
            assert session.reset(episode_id=episode) == model.reset(episode_id=episode)
        elif op == "bad-step":
            with pytest.raises(EnvError) as caught:
                session.step({"not-a-field": 1})
            assert caught.value.code == "VALIDATION_ERROR"
        else:
            with pytest.raises(EnvError, match="UNKNOWN_TYPE"):
                session.request({"type": "dance"})
    assert session.state() == model.state()  # the errors changed nothing on the server's side
    return model.state()


@pytest.mark.parametrize("seed", SEQUENCE_SEEDS)
def test_a_random_message_sequence_matches_the_echo_environment_model(echo_url, seed, no_leaks) -> None:
    with EnvSession(echo_url, timeout_s=TIMEOUT) as session:
        run_sequence(session, seed)
    assert session.closed


def test_sessions_in_plain_threads_and_inside_a_running_loop_keep_their_own_episodes(echo_url, no_leaks) -> None:
    errors = []

    def in_thread(seed: int) -> None:
        try:
            with EnvSession(echo_url, timeout_s=TIMEOUT) as session:
                run_sequence(session, seed)
        except BaseException as exc:  # collected: a failing thread must fail the test
            errors.append(exc)

    async def in_loop() -> dict:
        assert asyncio.get_running_loop() is not None
        with EnvSession(echo_url, timeout_s=TIMEOUT) as session:  # blocks the loop briefly; needs none
            expected = run_sequence(session, 99)
            return session.state(), expected

    threads = [threading.Thread(target=in_thread, args=(seed,)) for seed in SEQUENCE_SEEDS]
    for thread in threads:
        thread.start()
    state, expected = asyncio.run(in_loop())
    for thread in threads:
        thread.join(TIMEOUT)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert state == expected and state["episode_id"].startswith(("seed-99", "e"))


def test_an_environment_error_keeps_the_session_and_a_refused_upgrade_names_the_environment(echo_url) -> None:
    with EnvSession(echo_url, timeout_s=TIMEOUT) as session:
        session.reset()
        with pytest.raises(EnvError, match="environment error VALIDATION_ERROR") as caught:
            session.step({"not-a-field": 1})
        assert caught.value.data["errors"] and not session.closed
        assert session.step({"message": "still here"})["reward"] == pytest.approx(1.0)
    with pytest.raises(SessionRefusedError, match="HTTP 404 from the environment") as refused:
        EnvSession(echo_url + "/no-such-prefix", timeout_s=TIMEOUT)
    assert refused.value.status_code == 404 and refused.value.proxy_error is None
    assert isinstance(refused.value, ConnectionError)  # code that caught ConnectionError keeps working


@pytest.mark.slow  # a step that takes 1 s on purpose
def test_a_slow_reply_times_out_closes_the_session_and_never_answers_the_next_request(no_leaks) -> None:
    with EchoServer(step_delay_s=1.0) as server:
        session = EnvSession(server.url, timeout_s=0.3)
        session.reset()
        with pytest.raises(SessionTimeout, match="no answer"):
            session.step({"message": "slow"})
        assert session.closed
        with pytest.raises(SessionError, match="closed"):
            session.state()  # the late reply to "slow" must never be taken for this one
        session.close()  # idempotent, never raises
        session.close()


def test_bad_urls_and_actions_are_refused_with_the_fix(echo_url) -> None:
    for url in ("", "ftp://127.0.0.1/x", "127.0.0.1:8000", None):
        with pytest.raises(SandboxConfigError, match="base_url"):
            EnvSession(url)  # type: ignore[arg-type]
    with pytest.raises(SandboxConfigError, match="timeout_s"):
        EnvSession(echo_url, timeout_s=0)
    with EnvSession(echo_url) as session:
        with pytest.raises(SandboxConfigError, match="mapping"):
            session.step("hello")  # type: ignore[arg-type]
    with pytest.raises(SessionError, match="could not connect"):
        EnvSession("http://127.0.0.1:1", connect_timeout_s=5)


def test_through_the_provider_a_dead_job_and_a_stopped_provider_raise_typed_session_errors(emu, proxy) -> None:
    provider = HFSandboxProvider("img:tag", endpoint=emu.endpoint, token=emu.token, command=echo_server_command(),
                                 proxy=proxy, poll_interval_s=0.1)
    with provider:
        base_url = provider.start_container()
        provider.wait_for_ready()
        session = EnvSession(base_url, timeout_s=TIMEOUT)
        assert base_url.split("/")[-1] not in repr(session)  # the route id is a secret
        assert session.reset()["observation"]["echoed_message"] == "Echo environment ready!"
        assert session.step({"message": "via the gate"})["reward"] == pytest.approx(1.2)
        emu.kill_job(provider.job_id)
        emu.wait_for_stage(provider.job_id, ["ERROR"])
        with pytest.raises(SessionError) as lost:
            session.step({"message": "after death"})
        assert session.closed
        with pytest.raises(SessionRefusedError, match="HTTP 502 from the proxy") as refused:
            EnvSession(base_url, timeout_s=TIMEOUT)
        assert refused.value.proxy_error == "upstream-unreachable"
        route_id = base_url.rstrip("/").split("/")[-1]
        assert route_id not in str(lost.value) and route_id not in str(refused.value)
    with pytest.raises(SessionRefusedError) as gone:  # the route is unmounted with the job
        EnvSession(base_url, timeout_s=TIMEOUT)
    assert gone.value.status_code == 404 and gone.value.proxy_error == "unknown-route"


OPENENV_TIMEOUT = 90.0  # the job imports fastapi, uvicorn and openenv


@pytest.mark.slow
def test_a_real_openenv_create_app_server_from_a_thread_and_from_inside_a_loop(emu, proxy, tmp_path) -> None:
    pytest.importorskip("openenv.core.env_server.http_server")
    pytest.importorskip("uvicorn")
    from test_e2e_openenv import OPENENV_SERVER

    script = tmp_path / "server.py"
    script.write_text(OPENENV_SERVER)
    provider = HFSandboxProvider("img:tag", endpoint=emu.endpoint, token=emu.token, command=[sys.executable, str(script)],
                                 proxy=proxy, poll_interval_s=0.1, start_timeout_s=OPENENV_TIMEOUT,
                                 ready_timeout_s=OPENENV_TIMEOUT)
    with provider:
        base_url = provider.start_container()
        provider.wait_for_ready()
        seen = {}

        def episode(name: str) -> None:
            with EnvSession(base_url, timeout_s=TIMEOUT) as session:
                first = session.reset(episode_id=name)
                step = session.step({"message": name})
                with pytest.raises(EnvError):
                    session.step({"wrong": 1})  # openenv validates the action
                seen[name] = (first["observation"]["echoed_message"], step["observation"]["echoed_message"],
                              step["reward"], session.state())

        thread = threading.Thread(target=episode, args=("thread",))
        thread.start()
        thread.join(TIMEOUT)

        async def in_loop() -> None:
            episode("loop")

        asyncio.run(in_loop())
    assert seen["thread"][:3] == ("ready", "thread", pytest.approx(0.6))
    assert seen["loop"][:3] == ("ready", "loop", pytest.approx(0.4))
    assert seen["loop"][3]["episode_id"] == "loop" and seen["loop"][3]["step_count"] == 1


@pytest.mark.slow  # a step that takes 2 s on purpose
def test_close_from_another_thread_ends_a_request_in_flight_with_a_session_error(no_leaks) -> None:
    with EchoServer(step_delay_s=2.0) as server:
        session = EnvSession(server.url, timeout_s=TIMEOUT)
        session.reset()
        outcome = []
        started = threading.Event()

        def slow_step() -> None:
            started.set()
            try:
                outcome.append(session.step({"message": "slow"}))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=slow_step)
        thread.start()
        started.wait(TIMEOUT)
        wait_until(session._lock.locked, "the step to wait for its reply")
        session.close()  # e.g. close_all() at the end of training
        thread.join(TIMEOUT)
        assert len(outcome) == 1 and isinstance(outcome[0], SessionError), outcome  # not the late reply
        assert session.closed


# -- wss:// straight to a TLS server: `verify` as requests and the proxy read it ----------------------

_PLAIN_RUN = 'uvicorn.run(app, host="127.0.0.1", port=int(os.environ["PORT"]), log_level="warning")'
_TLS_RUN = _PLAIN_RUN[:-1] + ', ssl_certfile=os.environ["CERT"], ssl_keyfile=os.environ["KEY"])'


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def openenv_tls(test_ca, tmp_path_factory):
    """A real OpenEnv `create_app` server under uvicorn with TLS (the test CA's certificate), in its own
    process; yields its https:// base URL."""
    pytest.importorskip("openenv.core.env_server.http_server")
    from test_e2e_openenv import OPENENV_SERVER

    assert _PLAIN_RUN in OPENENV_SERVER
    script = tmp_path_factory.mktemp("openenv_tls") / "server.py"
    script.write_text(OPENENV_SERVER.replace(_PLAIN_RUN, _TLS_RUN))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PORT=str(port), CERT=test_ca.cert_path, KEY=test_ca.key_path)
    server = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        wait_until(lambda: server.poll() is not None or _listening(port), "the OpenEnv TLS server",
                   OPENENV_TIMEOUT)
        assert server.poll() is None, "the OpenEnv TLS server exited"
        yield "https://127.0.0.1:%d" % port
    finally:
        server.terminate()
        server.wait(10)


def test_a_wss_session_trusts_a_ca_bundle_file_or_directory_and_sessions_share_one_tls_context(
        openenv_tls, test_ca, tmp_path, no_leaks) -> None:
    with EnvSession(openenv_tls, verify=test_ca.ca_path) as first, \
            EnvSession(openenv_tls, verify=test_ca.ca_path) as second:
        assert first.reset(episode_id="a")["observation"]["echoed_message"] == "ready"
        assert second.step({"message": "over tls"})["observation"]["echoed_message"] == "over tls"
        assert first.state()["episode_id"] == "a"
        assert first._sock.context is second._sock.context  # one ~1 MiB context, not one per session
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to hash a CA directory")
    shutil.copy(test_ca.ca_path, str(tmp_path / "ca.pem"))
    subprocess.run(["openssl", "rehash", str(tmp_path)], check=True, capture_output=True)
    with EnvSession(openenv_tls, verify=str(tmp_path)) as session:  # a directory, like requests' verify
        assert session.step({"message": "dir"})["observation"]["echoed_message"] == "dir"


def test_a_wss_session_to_an_untrusted_certificate_raises_a_session_error_naming_verify(
        openenv_tls, no_leaks) -> None:
    with pytest.raises(SessionError, match="not trusted.*verify=<CA bundle path>") as caught:
        EnvSession(openenv_tls)  # the test CA is in neither the system store nor certifi's
    assert not isinstance(caught.value, ssl.SSLError) and "127.0.0.1" in str(caught.value)
    with EnvSession(openenv_tls, verify=False) as session:
        assert session.reset()["observation"]["echoed_message"] == "ready"
    with pytest.raises(SandboxConfigError, match="no such CA bundle"):
        EnvSession(openenv_tls, verify="/nonexistent/ca.pem")


@pytest.mark.parametrize("scheme, what", [("https", "the TLS handshake .* within 0.5s"),
                                           ("http", "no answer to the WebSocket upgrade .* connect_timeout_s=0.5s")])
def test_a_handshake_the_server_never_answers_raises_a_session_timeout_naming_connect_timeout_s(
        scheme, what, no_leaks) -> None:
    with socket.socket() as silent:  # accepts in its backlog, never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = "%s://127.0.0.1:%d" % (scheme, silent.getsockname()[1])
        with pytest.raises(SessionTimeout, match=what):  # (the upgrade's named timeout_s=600, never waited)
            EnvSession(url, connect_timeout_s=0.5, timeout_s=600)


class Interrupted(BaseException):
    """What a Ctrl-C is to the library: a BaseException raised in the main thread while it waits."""


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted()


@pytest.mark.slow  # a step that takes 1 s on purpose
def test_an_interrupted_request_closes_the_session_so_its_late_reply_never_answers_the_next(no_leaks) -> None:
    # A KeyboardInterrupt while a reply was due left the session open: the next request returned that reply.
    previous = signal.signal(signal.SIGUSR1, _raise_interrupted)
    timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
    try:
        with EchoServer(step_delay_s=1.0) as server:
            with EnvSession(server.url, timeout_s=TIMEOUT) as session:
                session.reset()
                timer.start()
                with pytest.raises(Interrupted):
                    session.step({"message": "first"})
                timer.join()
                assert session.closed
                with pytest.raises(SessionError, match="closed"):
                    session.step({"message": "second"})
    finally:
        timer.cancel()  # a late signal after the restore would end pytest (SIGUSR1's default)
        if timer.ident is not None:
            timer.join()
        signal.signal(signal.SIGUSR1, previous)


def test_a_url_with_a_bad_port_or_bracket_and_a_message_that_is_not_a_mapping_are_refused(echo_url) -> None:
    for url in ("http://127.0.0.1:99999/r", "http://127.0.0.1:port/r", "http://[::1/r"):
        with pytest.raises(SandboxConfigError, match="base_url"):
            EnvSession(url)
    with EnvSession(echo_url) as session:
        with pytest.raises(SandboxConfigError, match="mapping"):
            session.request("hi")  # type: ignore[arg-type]
        with pytest.raises(SandboxConfigError, match="mapping"):
            session.exchange(["reset"])  # type: ignore[arg-type]
        assert session.reset()["observation"]["echoed_message"]  # nothing was sent: the session goes on


def _one_reply_server(reply_frame: bytes) -> socket.socket:
    """A WebSocket server (loopback) that answers the first message with these raw frame bytes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        ws = WSConnection(ConnectionType.SERVER)
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, Request):
                        conn.sendall(ws.send(AcceptConnection()))
                    elif isinstance(event, TextMessage):
                        conn.sendall(reply_frame)

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_a_binary_reply_that_is_not_utf8_raises_a_session_error_and_closes_the_session() -> None:
    listener = _one_reply_server(b"\x82\x02\xff\xfe")  # a binary frame of two bytes that are not UTF-8
    try:
        session = EnvSession("http://127.0.0.1:%d/x" % listener.getsockname()[1], timeout_s=TIMEOUT)
        with pytest.raises(SessionError, match="not JSON"):
            session.reset()
        assert session.closed
        session.close()
    finally:
        listener.close()


def _resetting_server(connections: int, answer: bytes = b"") -> socket.socket:
    """A loopback server that reads the upgrade request of each of `connections` connections, writes
    `answer` (e.g. half a 101), then resets the connection (SO_LINGER 0): a proxy or job dying mid-upgrade."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def serve() -> None:
        for _ in range(connections):
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                if answer:
                    conn.sendall(answer)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    threading.Thread(target=serve, daemon=True).start()
    return listener


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"])
def test_a_connection_reset_during_the_upgrade_raises_a_session_error_naming_the_url_without_its_route(
        answer, no_leaks) -> None:
    # A raw ConnectionResetError escaped EnvSession(...) (review F2): not the documented SessionError.
    listener = _resetting_server(2, answer)
    try:
        where = "ws://127.0.0.1:%d" % listener.getsockname()[1]
        for _ in range(2):
            with pytest.raises(SessionError, match="the connection to %s broke during the WebSocket upgrade"
                               % where) as caught:
                EnvSession("http://127.0.0.1:%d/SeCrEtRoUtE" % listener.getsockname()[1], timeout_s=TIMEOUT)
            assert not isinstance(caught.value, SessionTimeout)
            assert "SeCrEtRoUtE" not in str(caught.value)
            assert isinstance(caught.value.__cause__, ConnectionResetError)
    finally:
        listener.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: x\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    b"NOT HTTP AT ALL\r\n\r\n",
], ids=["wrong-accept", "two-lengths", "not-http"])
def test_an_upgrade_answer_that_breaks_the_protocol_raises_a_session_error_naming_the_url(answer, no_leaks) -> None:
    # wsproto's own RemoteProtocolError escaped EnvSession(...): not the documented SessionError.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_once() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)
            conn.recv(1)  # until the client closes

    server = threading.Thread(target=answer_once)
    server.start()
    try:
        with pytest.raises(SessionError, match="the answer to the WebSocket upgrade from ws://127.0.0.1:%d broke "
                           "the protocol" % port):
            EnvSession("http://127.0.0.1:%d/SeCrEtRoUtE" % port, timeout_s=TIMEOUT)
    finally:
        server.join(TIMEOUT)
        listener.close()
