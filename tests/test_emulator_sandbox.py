"""The emulated sandbox server (hf_sbx_emulator) driven by huggingface_hub's real, unmodified
`SandboxPool` and `Sandbox` over TLS: host boot, sandboxes, commands, background servers on
`$SBX_PROXY_DIR/<port>.sock` reached through `proxy_url_for` + `proxy_headers` (HTTP and WebSocket),
credential scoping, capacity, idle eviction, kill, host death, faults, signals and cleanup."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import signal
import secrets
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List

import pytest
import requests

import hf_jobs_emulator
import hf_sbx_emulator
from hf_jobs_emulator import JobsEmulator, spawn_process
from support import alive, processes, wait_until

hub = pytest.importorskip("huggingface_hub")
sandbox_mod = pytest.importorskip("huggingface_hub._sandbox")
if not hasattr(sandbox_mod.Sandbox, "proxy_url_for"):  # pragma: no cover - older huggingface_hub
    pytest.skip("huggingface_hub has no Sandbox.proxy_url_for", allow_module_level=True)
from huggingface_hub import Sandbox, SandboxPool  # noqa: E402
from huggingface_hub.errors import SandboxError  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect as ws_connect  # noqa: E402

IMAGE = "python:3.12"
PY = sys.executable
CHILD_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Small delays: the defaults (13 s cold host, 0.27 s per sandbox) are for benchmarks.
FAST = dict(tls=True, sandbox_host_boot_s=0.0, sandbox_host_ready_s=0.1, sandbox_create_s=0.0)

# The in-sandbox HTTP app: answers what it received (method, path, headers, body) as JSON, and
# `/stream` as three chunks sent a moment apart; it listens only on $SBX_PROXY_DIR/8000.sock.
HTTP_APP = r'''
import json, os, socketserver, time
from http.server import BaseHTTPRequestHandler
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def do_GET(self):
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                line = ("part %d\n" % i).encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"0\r\n\r\n")
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        answer = json.dumps({"method": self.command, "path": self.path, "body": body,
                             "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)
    do_POST = do_GET
class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    def get_request(self):
        request, _ = super().get_request()
        return request, ("sandbox", 0)
Server(os.environ["SBX_PROXY_DIR"] + "/8000.sock", Handler).serve_forever()
'''
# The in-sandbox WebSocket echo server on $SBX_PROXY_DIR/8001.sock.
WS_APP = r'''
import asyncio, os, websockets
async def echo(ws):
    async for message in ws:
        await ws.send(message)
async def main():
    async with websockets.unix_serve(echo, os.environ["SBX_PROXY_DIR"] + "/8001.sock"):
        await asyncio.Future()
asyncio.run(main())
'''


@pytest.fixture(autouse=True)
def _quiet_websockets_client() -> Iterator[None]:
    """The websockets client logs request headers (the bearer) at DEBUG, which the log guard catches."""
    logger = logging.getLogger("websockets")
    level = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(level)


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, log_guard: Any) -> Callable[..., JobsEmulator]:
    """`hub_env(**JobsEmulator_kwargs)`: a TLS emulator that huggingface_hub's module-level API, its
    pool cache and its httpx2 clients (SSL_CERT_FILE) all point at. After the test the emulator is
    stopped and every process it ran, sandboxes included, must be gone."""
    made: List[JobsEmulator] = []

    def make(cls: Any = JobsEmulator, **kwargs: Any) -> JobsEmulator:
        emulator = cls(**{**FAST, **kwargs}).start()
        made.append(emulator)
        log_guard.watch(emulator.token)
        monkeypatch.setattr(hub.constants, "ENDPOINT", emulator.endpoint)
        monkeypatch.setattr(hub.hf_api.api, "endpoint", emulator.endpoint)  # whoami() and friends
        monkeypatch.setattr(hub.constants, "HF_HOME", str(tmp_path / "hf-home"))  # the pool cache
        monkeypatch.setenv("HF_TOKEN", emulator.token)  # list_jobs() resolves the token itself
        monkeypatch.setenv("SSL_CERT_FILE", emulator.ca_path)  # huggingface_hub's httpx2 clients
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", emulator.ca_path)  # this test's own requests calls
        return emulator

    yield make
    for emulator in made:
        pids = emulator.live_pids()
        assert emulator.stop() == []
        assert [pid for pid in pids if alive(pid)] == [], "a job or sandbox process outlived the emulator"


def _pool(emu: JobsEmulator, **kwargs: Any) -> SandboxPool:
    return SandboxPool(IMAGE, token=emu.token, start_timeout=60, **kwargs)


def _host_token(emu: JobsEmulator, host_job_id: str) -> str:
    """The host's management credential, derived the way huggingface_hub documents it (HMAC of the
    HF token over the job's public nonce label)."""
    nonce = emu.job(host_job_id).spec["labels"]["hf-sandbox-nonce"]
    return hmac.new(emu.token.encode(), f"hf-sandbox:{nonce}".encode(), hashlib.sha256).hexdigest()


def _host_url(emu: JobsEmulator, host_job_id: str) -> str:
    return emu.job(host_job_id).expose_urls[0]


def _start_app(sbx: Sandbox, name: str, source: str, port: int) -> None:
    """Write an app into the sandbox, start it in the background, wait until its socket answers."""
    sbx.files.write(name, source)
    sbx.run([PY, name], background=True)
    wait_until(lambda: _probe(sbx, port), f"the sandbox app on port {port}", timeout_s=30)


def _probe(sbx: Sandbox, port: int) -> bool:
    return requests.get(sbx.proxy_url_for(port, "/"), headers=sbx.proxy_headers, timeout=10).status_code != 502


def _ws_ssl(emu: JobsEmulator) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=emu.ca_path)


def _ws_echo(emu: JobsEmulator, sbx: Sandbox) -> Any:
    """Start the WebSocket echo app on port 8001 of `sbx` and open a session to it through the host's proxy."""
    _start_app(sbx, "ws.py", WS_APP, 8001)
    return ws_connect(sbx.proxy_url_for(8001, "/ws", scheme="wss://"), additional_headers=sbx.proxy_headers,
                      ssl=_ws_ssl(emu))


def _signal_state(pid: int) -> Dict[str, int]:
    """The SigBlk and SigIgn masks of a process, from /proc."""
    masks = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("SigBlk", "SigIgn"):
                masks[key] = int(value.strip(), 16)
    return masks


def _bits(signals: Any) -> int:
    return sum(1 << (int(sig) - 1) for sig in signals)


def _in_blocked_thread(fn: Callable[[], Any]) -> Any:
    """Run `fn` in a thread that blocks SIGTERM/SIGINT/SIGHUP, as library threads do; returns its result."""
    result: Dict[str, Any] = {}

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, CHILD_SIGNALS)
        try:
            result["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    if "error" in result:
        raise result["error"]
    return result.get("value")


# ------------------------------------------------------------------------------------------------
# Boot, commands, background servers through the proxy route
# ------------------------------------------------------------------------------------------------


def test_a_pool_host_boots_as_a_job_and_a_sandbox_runs_a_command(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create(env={"GREETING": "hello"})
        host = emu.job(pool.host_ids[0])
        assert host.stage == "RUNNING" and host.spec["labels"]["hf-sandbox-mode"] == "pool"
        assert sbx.host_id == host.id and sbx.id.startswith(host.id + ".")
        result = sbx.run("echo $GREETING; echo $SBX_PROXY_DIR; echo oops >&2; exit 3", check=False)
        assert result.exit_code == 3
        greeting, proxy_dir = result.stdout.split()
        assert greeting == "hello" and os.path.isdir(proxy_dir)
        assert result.stderr == "oops\n"
        assert sbx.run(["pwd"]).stdout.strip() == os.path.dirname(proxy_dir) + "/home"
        assert sbx.run("echo $HF_TOKEN$SBX_TOKEN").stdout == "\n"  # no credential reaches a sandbox
        health = requests.get(_host_url(emu, host.id) + "/health", headers={"Authorization": f"Bearer {emu.token}"})
        assert health.json()["protocol"] == 3


def test_an_exec_timeout_kills_the_command_and_says_so(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        result = pool.create().run("echo started; sleep 30", timeout=0.5, check=False)
        assert result.timed_out and result.stdout == "started\n" and result.signal == signal.SIGKILL


def test_an_exec_ends_with_its_command_not_with_descendants_holding_its_output(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        result = sbx.run("sleep 600 & echo $! > child.pid; echo done")  # waiting for it hits the test timeout
        assert result.stdout == "done\n"
        wait_until(lambda: not alive(int(sbx.files.read_text("child.pid"))), "the leftover child to be killed")


@pytest.mark.slow  # waits out 1 s of boot and ready delays
def test_host_boot_and_ready_delays_are_applied_and_a_booting_host_answers_503(hub_env, log_guard):
    emu = hub_env(sandbox_host_boot_s=0.6, sandbox_host_ready_s=0.4)
    with _pool(emu) as pool:
        host = emu.job(pool.host_ids[0])
        assert host.started_mono - host.created_mono >= 0.6
        # the emulator's own prober records the first 200 (it may come a moment after the client's)
        wait_until(lambda: host.first_health_ok_mono is not None, "the emulator to record the host ready")
        # The host's ready clock starts when its process has started, a few ms before the job records
        # RUNNING (`started_mono`), so the margin allows for that step (the delay itself is 0.4 s).
        assert host.first_health_ok_mono - host.started_mono >= 0.4 - 0.05
    # The client polled /health through the job's gate all along: a server that is not up yet answers
    # 503, so the gate never failed to reach it (and never logged that it could not).
    assert "upstream-unreachable" not in log_guard.text()


def test_a_background_server_on_the_unix_socket_is_reached_over_http_through_proxy_url_for(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        _start_app(sbx, "app.py", HTTP_APP, 8000)
        with requests.Session() as session:
            got = session.post(sbx.proxy_url_for(8000, "/echo?x=1&y=2"), data=b"payload",
                               headers={**sbx.proxy_headers, "X-Custom": "kept"}, timeout=10)
            assert got.status_code == 200
            seen = got.json()
            assert (seen["method"], seen["path"], seen["body"]) == ("POST", "/echo?x=1&y=2", "payload")
            assert seen["headers"]["x-custom"] == "kept"
            # The host consumes both credentials: the app sees neither the HF bearer nor the sandbox token.
            assert "authorization" not in seen["headers"] and "x-sandbox-token" not in seen["headers"]
            streamed = session.get(sbx.proxy_url_for(8000, "/stream"), headers=sbx.proxy_headers, stream=True)
            assert list(streamed.iter_lines()) == [b"part 0", b"part 1", b"part 2"]


def test_a_host_under_a_long_tmpdir_still_gives_its_sandbox_servers_a_unix_socket_they_can_listen_on(
        hub_env, monkeypatch, tmp_path):
    # macOS's TMPDIR (/var/folders/...) or pytest-xdist's: a sandbox's `<port>.sock` under it passed the unix
    # socket path limit (104-108 bytes), and no server in a sandbox could listen (the smoke's pooled stage failed).
    long_tmp = tmp_path / ("a-temporary-directory-as-long-as-some-systems-give-" + "x" * 30)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))  # as TMPDIR sets it (the hosts run in this process)
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        _start_app(sbx, "app.py", HTTP_APP, 8000)
        answer = requests.get(sbx.proxy_url_for(8000, "/long-tmpdir"), headers=sbx.proxy_headers, timeout=10)
        assert answer.status_code == 200 and answer.json()["path"] == "/long-tmpdir"


def test_a_websocket_server_on_the_unix_socket_is_reached_through_proxy_url_for(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        with _ws_echo(emu, sbx) as ws:
            for message in ("hello", "x" * 100_000):
                ws.send(message)
                assert ws.recv(timeout=10) == message
            ws.send(b"\x00\x01binary")
            assert ws.recv(timeout=10) == b"\x00\x01binary"


@pytest.mark.slow  # idles 3 s past a keep-alive timeout on purpose
def test_a_websocket_session_outlives_the_hosts_keep_alive_timeout(hub_env, monkeypatch):
    # Idle keep-alive connections to the host close after 2 s (120 s by default); a busy machine still
    # sends a request head well within that.
    monkeypatch.setattr(hf_sbx_emulator._SbxHandler, "timeout", 2.0)
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        with _ws_echo(emu, sbx) as ws:
            time.sleep(3.0)  # idle past that timeout
            ws.send("still here")
            assert ws.recv(timeout=10) == "still here"


def test_nothing_listening_on_the_port_answers_502_naming_the_socket(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        got = requests.get(sbx.proxy_url_for(8000, "/"), headers=sbx.proxy_headers, timeout=10)
        assert got.status_code == 502 and "$SBX_PROXY_DIR/8000.sock" in got.json()["error"]


def test_background_processes_are_listed_and_killed(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        sleeper = sbx.run(["sleep", "60"], background=True)
        quick = sbx.run("exit 7", background=True)
        wait_until(lambda: not {p.id: p for p in sbx.processes()}[quick.id].running, "the quick process to end")
        listed = {p.id: p for p in sbx.processes()}
        assert listed[sleeper.id].running and listed[sleeper.id].cmd == ["sleep", "60"]
        assert listed[quick.id].exit_code == 7
        assert sleeper.kill() is True
        assert not alive(sleeper.pid)
        assert sleeper.kill() is False  # already gone: idempotent, not an error
        assert not {p.id: p for p in sbx.processes()}[sleeper.id].running


def test_files_are_rooted_at_the_sandbox_home_and_symlinks_are_refused(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        sbx.files.write("/data/a.txt", "alpha")
        assert sbx.files.read_text("data/a.txt") == "alpha"
        assert sbx.files.read_text("/../../data/a.txt") == "alpha"  # '..' cannot leave the home
        assert [e.name for e in sbx.files.list("/data")] == ["a.txt"]
        assert sbx.files.stat("/data").type == "dir"
        sbx.run("ln -s /etc/passwd $HOME/link")
        with pytest.raises(SandboxError):
            sbx.files.read("link")
        sbx.files.delete("/data", recursive=True)
        assert not sbx.files.exists("/data/a.txt")


# ------------------------------------------------------------------------------------------------
# Credentials: the host token on management routes, each sandbox's own token on its routes
# ------------------------------------------------------------------------------------------------


def test_sandbox_routes_want_that_sandboxs_own_token_and_management_routes_the_hosts(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        first, second = pool.create(), pool.create()
        host_id = first.host_id
        base = _host_url(emu, host_id)
        bearer = {"Authorization": f"Bearer {emu.token}"}
        host_token = _host_token(emu, host_id)
        own = first.proxy_headers["X-Sandbox-Token"]
        other = second.proxy_headers["X-Sandbox-Token"]
        assert own not in (other, host_token)
        processes = f"{base}/v1/sandboxes/{first.id.split('.')[1]}/processes"

        def status(method: str, url: str, token: Any, with_bearer: bool = True) -> int:
            headers = dict(bearer) if with_bearer else {}
            if token is not None:
                headers["X-Sandbox-Token"] = token
            return requests.request(method, url, headers=headers, json={"count": 1}, timeout=10).status_code

        assert status("GET", processes, own) == 200
        assert status("GET", processes, None) == 401
        assert status("GET", processes, other) == 403
        assert status("GET", processes, host_token) == 403
        assert status("GET", processes, own, with_bearer=False) == 401  # the job's gate wants the bearer
        assert status("GET", processes.replace("/processes", "/proxy/8000/"), host_token) == 403
        assert status("GET", f"{base}/v1/sandboxes", own) == 403
        assert status("POST", f"{base}/v1/sandboxes", own) == 403
        assert status("GET", f"{base}/v1/sandboxes/{first.id.split('.')[1]}/token", own) == 403
        assert status("GET", f"{base}/v1/sandboxes", host_token) == 200
        assert status("DELETE", processes.rsplit("/", 1)[0], other) == 403
        assert first.run("true").ok  # still there after the refused delete


def test_a_lenient_emulator_also_opens_sandboxes_with_the_host_token(hub_env):
    emu = hub_env(sandbox_strict_tokens=False)
    with _pool(emu) as pool:
        sbx = pool.create()
        url = f"{_host_url(emu, sbx.host_id)}/v1/sandboxes/{sbx.id.split('.')[1]}/processes"
        headers = {"Authorization": f"Bearer {emu.token}", "X-Sandbox-Token": _host_token(emu, sbx.host_id)}
        assert requests.get(url, headers=headers, timeout=10).status_code == 200
        headers["X-Sandbox-Token"] = "0" * 64
        assert requests.get(url, headers=headers, timeout=10).status_code == 403


def test_sandbox_connect_and_a_second_pool_of_the_same_name_reuse_the_running_host(hub_env):
    emu = hub_env()
    with _pool(emu, name="shared") as pool:
        sbx = pool.create()
        again = Sandbox.connect(sbx.id)
        try:
            assert again.run("echo reattached").stdout == "reattached\n"
            assert again.proxy_headers["X-Sandbox-Token"] == sbx.proxy_headers["X-Sandbox-Token"]
        finally:
            again.close()
        with _pool(emu, name="shared") as second:
            assert second.create().host_id == sbx.host_id
        assert len(emu.jobs) == 1


# ------------------------------------------------------------------------------------------------
# Capacity, idle eviction, kill, host death
# ------------------------------------------------------------------------------------------------


def test_a_full_host_refuses_a_create_and_the_pool_boots_another_host(hub_env):
    emu = hub_env(sandbox_capacity=2)
    with _pool(emu) as pool:
        boxes = [pool.create() for _ in range(3)]
        hosts = [b.host_id for b in boxes]
        assert hosts[0] == hosts[1] != hosts[2]
        assert sorted(pool.host_ids) == sorted(set(hosts)) and len(emu.jobs) == 2
        assert emu.sandbox_hosts.host(hosts[0]).capacity == 2


@pytest.mark.slow  # waits out a 1 s idle timeout
def test_an_idle_sandbox_is_evicted_but_one_running_a_process_is_not(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        idle, busy = pool.create(idle_timeout=1), pool.create(idle_timeout=1)
        sleeper = busy.run(["sleep", "60"], background=True)
        host = emu.sandbox_hosts.host(idle.host_id)
        wait_until(lambda: idle.id.split(".")[1] not in host.sandbox_ids, "the idle sandbox to be evicted")
        with pytest.raises(SandboxError) as refused:
            idle.run("true")
        assert refused.value.status_code == 404
        assert busy.id.split(".")[1] in host.sandbox_ids and alive(sleeper.pid)


def test_an_emulator_idle_timeout_overrides_what_the_create_asks(hub_env):
    emu = hub_env(sandbox_idle_timeout_s=0.5)
    with _pool(emu) as pool:
        sbx = pool.create(idle_timeout=None)  # the client asks for no eviction at all
        host = emu.sandbox_hosts.host(sbx.host_id)
        wait_until(lambda: not host.sandbox_ids, "the sandbox to be evicted")


@pytest.mark.slow  # waits out a 1 s idle timeout
def test_an_empty_pool_host_idle_past_its_timeout_ends_its_job(hub_env):
    emu = hub_env()
    with _pool(emu, idle_timeout=1) as pool:
        job = emu.wait_for_stage(pool.host_ids[0], ["COMPLETED"], timeout_s=30)
        assert job.stage == "COMPLETED"


def test_killing_a_sandbox_ends_its_processes_and_its_routes(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx, neighbour = pool.create(), pool.create()
        sleeper = sbx.run("sleep 60", background=True)
        survivor = neighbour.run("sleep 60", background=True)
        sbx.kill()
        assert not alive(sleeper.pid) and alive(survivor.pid)
        url = f"{_host_url(emu, sbx.host_id)}/v1/sandboxes/{sbx.id.split('.')[1]}/processes"
        headers = {"Authorization": f"Bearer {emu.token}", **sbx.proxy_headers}
        assert requests.get(url, headers=headers, timeout=10).status_code == 404


@pytest.mark.slow  # kills a host job and waits for its processes to end
def test_a_host_killed_while_serving_fails_its_sessions_promptly_and_ends_its_sandboxes(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        _start_app(sbx, "ws.py", WS_APP, 8001)
        app_pids = [p.pid for p in sbx.processes()]
        url = sbx.proxy_url_for(8001, "/ws", scheme="wss://")
        with ws_connect(url, additional_headers=sbx.proxy_headers, ssl=_ws_ssl(emu)) as ws:
            ws.send("before")
            assert ws.recv(timeout=10) == "before"
            emu.kill_job(sbx.host_id)
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=20)  # the session ends when the host does, not at a timeout
        assert emu.wait_for_stage(sbx.host_id, ["ERROR"]).stage == "ERROR"
        wait_until(lambda: not [pid for pid in app_pids if alive(pid)], "the host's sandbox processes to end")
        with pytest.raises(requests.RequestException):
            requests.get(sbx.proxy_url_for(8001, "/"), headers=sbx.proxy_headers, timeout=10)


# ------------------------------------------------------------------------------------------------
# Faults a caller must survive
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a host job that crashes at boot
def test_a_host_whose_server_crashes_at_boot_fails_the_pool_start_with_its_log(hub_env):
    emu = hub_env(faults={"crash-at-boot": "sbx-server: cannot start (emulated crash)"})
    with pytest.raises(SandboxError, match="emulated crash"):
        _pool(emu)
    assert [job.stage for job in emu.jobs] == ["ERROR"]


class _GateFailingEmulator(JobsEmulator):
    """An emulator whose job gates cannot start: an error inside the emulator while it runs a host job
    (a clean CI run once met `OSError(14, 'Bad address')` there)."""

    def make_gate(self, job: Any, exposed_port: int, public: bool = False) -> Any:
        raise OSError(14, "Bad address")


def test_a_host_job_the_emulator_fails_to_run_answers_its_create_at_once_and_logs_where(hub_env, caplog):
    emu = hub_env(cls=_GateFailingEmulator)
    started = time.monotonic()
    with pytest.raises(SandboxError):
        _pool(emu)
    # the create answered once the job was ERROR, not after SANDBOX_GATES_WAIT_S (60 s)
    assert time.monotonic() - started < hf_jobs_emulator.SANDBOX_GATES_WAIT_S / 3
    [job] = emu.jobs
    assert job.stage == "ERROR" and "Bad address" in job.message
    logged = [r for r in caplog.records if r.getMessage() == f"hf_jobs_emulator: running job {job.id} failed"]
    assert logged and "make_gate" in "".join(traceback.format_exception(*logged[0].exc_info))


def test_429_and_503_on_sandbox_create_reach_the_client_and_later_creates_succeed(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        emu.sandbox_hosts.inject_create_errors(1, 429)
        with pytest.raises(SandboxError) as limited:
            pool.create()
        assert limited.value.status_code == 429
        emu.sandbox_hosts.inject_create_errors(1, 503)
        with pytest.raises(SandboxError) as unavailable:
            pool.create()
        assert unavailable.value.status_code == 503
        assert pool.create().run("true").ok
        host = pool.host_ids[0]
        emu.sandbox_hosts.inject_create_errors(1, 429, retry_after_s=7)
        raw = requests.post(f"{_host_url(emu, host)}/v1/sandboxes", json={"count": 1}, timeout=10,
                            headers={"Authorization": f"Bearer {emu.token}", "X-Sandbox-Token": _host_token(emu, host)})
        assert (raw.status_code, raw.headers["Retry-After"]) == (429, "7")


def test_a_dedicated_sandbox_runs_commands_and_its_kill_cancels_the_job(hub_env):
    emu = hub_env()
    sbx = Sandbox.create(IMAGE, token=emu.token, start_timeout=60)
    try:
        assert sbx.run("echo dedicated").stdout == "dedicated\n"
    finally:
        sbx.kill()
    assert emu.wait_for_stage(sbx.id, ["CANCELED"]).stage == "CANCELED"


def test_a_dedicated_sandboxs_commands_get_its_env_and_secrets_but_not_the_servers_token(hub_env):
    emu = hub_env()
    with Sandbox.create(IMAGE, token=emu.token, start_timeout=60, env={"GREETING": "hello"},
                        secrets={"API_KEY": "s3cret"}) as sbx:
        seen = sbx.run("echo $GREETING $API_KEY ${SBX_TOKEN:-no-token}").stdout
        assert seen == "hello s3cret no-token\n"
        server = sbx.run(["sh", "-c", "echo $GREETING > $HOME/env.txt; sleep 60"], background=True)
        wait_until(lambda: sbx.files.exists("env.txt"), "the background process's file")
        assert sbx.files.read_text("env.txt") == "hello\n"
        server.kill()


def test_a_dedicated_sandboxs_file_paths_are_absolute_on_its_container(hub_env, tmp_path):
    emu = hub_env()
    with Sandbox.create(IMAGE, token=emu.token, start_timeout=60) as sbx:
        target = str(tmp_path / "written" / "a.txt")
        sbx.files.write(target, "alpha")
        with open(target) as fh:  # the emulated container's filesystem is this machine's
            assert fh.read() == "alpha"
        assert sbx.files.stat(target).path == target
        assert [e.name for e in sbx.files.list(str(tmp_path / "written"))] == ["a.txt"]
        sbx.files.write("relative.txt", "beta")  # a relative path is under the sandbox's home
        assert sbx.run("cat $HOME/relative.txt").stdout == "beta"


def test_killing_a_process_id_the_sandbox_never_issued_answers_400(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        unknown = sandbox_mod.SandboxProcess(id="0123456789ab", pid=1, cmd="sleep 1", _sandbox=sbx)
        with pytest.raises(SandboxError) as refused:
            unknown.kill()
        assert refused.value.status_code == 400 and "0123456789ab" in str(refused.value)


@pytest.mark.slow  # waits out a 1 s idle timeout
def test_an_idle_dedicated_sandbox_ends_its_job_unless_a_process_runs(hub_env):
    emu = hub_env()
    busy = Sandbox.create(IMAGE, token=emu.token, start_timeout=60, idle_timeout=1)
    idle = Sandbox.create(IMAGE, token=emu.token, start_timeout=60, idle_timeout=1)
    try:
        busy.run(["sleep", "60"], background=True)
        assert idle.run("echo used").ok
        assert emu.wait_for_stage(idle.id, ["COMPLETED"], timeout_s=30).stage == "COMPLETED"
        assert emu.job(busy.id).stage == "RUNNING"
    finally:
        busy.kill()
        idle.kill()


# ------------------------------------------------------------------------------------------------
# Signals and cleanup
# ------------------------------------------------------------------------------------------------


def test_a_child_spawned_from_a_thread_that_blocks_signals_has_them_unblocked_and_dies_on_sigterm():
    child = _in_blocked_thread(lambda: spawn_process(["sleep", "60"]))
    try:
        assert _signal_state(child.pid)["SigBlk"] & _bits(CHILD_SIGNALS) == 0
        child.send_signal(signal.SIGTERM)
        assert child.wait(10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


def _comm(pid: int) -> str:
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return ""


@pytest.mark.parametrize("reset", ["gnu-env", "python-shim"])
def test_a_child_gets_default_dispositions_even_when_this_process_ignores_a_signal(reset, monkeypatch):
    if reset == "python-shim":  # where env has no --default-signal (BSD, coreutils < 8.31)
        monkeypatch.setattr(hf_jobs_emulator, "_default_signal_env_found", [None])
    elif hf_jobs_emulator._default_signal_env() is None:
        pytest.skip("this env has no --default-signal")
    # SIGHUP alone ignored here, whatever this run inherited: under nohup or a script's background job SIGINT
    # starts ignored too (Python then installs no handler), and spawn_process would rightly reset it as well.
    previous = {sig: signal.getsignal(sig) for sig in CHILD_SIGNALS}
    try:
        for sig in CHILD_SIGNALS:
            if sig == signal.SIGHUP:
                signal.signal(sig, signal.SIG_IGN)
            elif previous[sig] == signal.SIG_IGN:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        child = spawn_process(["sleep", "60"])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        if reset == "gnu-env":  # no interpreter start per child (the shim's ~15 ms of CPU: 64 sandboxes ~1 CPU-s)
            env = hf_jobs_emulator._default_signal_env()
            assert child.args[:3] == [env, "--default-signal=HUP", "--"] and sys.executable not in child.args
        wait_until(lambda: _comm(child.pid) == "sleep", "the child to exec sleep", 10)  # past the shim that resets the disposition
        assert _signal_state(child.pid)["SigIgn"] & _bits(CHILD_SIGNALS) == 0
        child.send_signal(signal.SIGHUP)
        assert child.wait(10) == -signal.SIGHUP
    finally:
        child.kill()
        child.wait()


def test_no_python_runs_in_a_child_between_fork_and_exec_when_this_process_ignores_a_signal():
    # Under nohup SIGHUP is ignored, and a child must not inherit that. Resetting it with Python code
    # between fork and exec (preexec_fn) left forks of pytest that never reached exec in a CI run under
    # nohup (a fork of a process with threads may inherit a lock another thread held). An at-fork hook
    # runs in a child exactly when Python code does, so it tells whether any does.
    read_end, write_end = os.pipe()
    armed = [write_end]
    os.register_at_fork(after_in_child=lambda: armed and os.write(armed[0], b"x"))
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        child = spawn_process([sys.executable, "-I", "-S", "-c", "import signal, sys; "
                               "sys.exit(signal.getsignal(signal.SIGHUP) != signal.SIG_DFL)"])
        assert child.wait(30) == 0  # the command ran, with SIGHUP at its default
    finally:
        signal.signal(signal.SIGHUP, previous)
        armed.clear()
        os.close(write_end)
    with os.fdopen(read_end, "rb") as hooks_run:
        assert hooks_run.read() == b"", "Python code ran in the child between fork and exec"


def test_sandbox_and_job_processes_of_an_emulator_started_in_a_blocked_thread_end_on_sigterm(hub_env):
    # Every thread of this emulator inherits the blocked mask from the thread that started it.
    emu = _in_blocked_thread(lambda: hub_env())
    with _pool(emu) as pool:
        sbx = pool.create()
        sleeper = sbx.run(["sleep", "60"], background=True)
        assert _signal_state(sleeper.pid)["SigBlk"] & _bits(CHILD_SIGNALS) == 0
        os.kill(sleeper.pid, signal.SIGTERM)
        wait_until(lambda: not alive(sleeper.pid), "the sandbox process to end on SIGTERM", timeout_s=10)
        host_stub = emu.job(sbx.host_id).pid
        assert _signal_state(host_stub)["SigBlk"] & _bits(CHILD_SIGNALS) == 0
    echo = hf_jobs_emulator.echo_server_command()  # a zygote child, then a plain Popen job
    for command in (echo, ["sleep", "60"]):
        created = requests.post(f"{emu.endpoint}/api/jobs/{emu.namespace}", timeout=10,
                                headers={"Authorization": f"Bearer {emu.token}"},
                                json={"dockerImage": IMAGE, "command": command, "expose": {"ports": [8000]}})
        job = emu.wait_for_stage(created.json()["id"], ["RUNNING"])
        if command == echo:  # glibc blocks every signal for a moment while a thread starts: wait till it has
            wait_until(lambda: job.first_health_ok_mono is not None, "the echo server to answer")
        assert _signal_state(job.pid)["SigBlk"] & _bits(CHILD_SIGNALS) == 0, command
        os.kill(job.pid, signal.SIGTERM)
        assert emu.wait_for_stage(job.id, ["ERROR", "COMPLETED"]).terminal


def test_no_sandbox_process_or_directory_is_left_after_the_emulator_stops(hub_env):
    emu = hub_env()
    pool = _pool(emu)
    boxes = [pool.create() for _ in range(3)]
    pids = [b.run(["sleep", "60"], background=True).pid for b in boxes]
    homes = [os.path.dirname(b.run("pwd").stdout.strip()) for b in boxes]
    cut: List[BaseException] = []

    def run_until_cut() -> None:
        try:
            boxes[0].run("echo $$ > fg.pid; exec sleep 60")
        except Exception as exc:  # the host goes away under it
            cut.append(exc)

    running = threading.Thread(target=run_until_cut, daemon=True)
    running.start()  # a command still being exec'd when the emulator stops
    wait_until(lambda: boxes[0].files.exists("fg.pid"), "the exec'd command to start")
    pids.append(int(boxes[0].files.read_text("fg.pid")))
    assert sorted(emu.live_pids()) == sorted(pids + [emu.job(pool.host_ids[0]).pid])
    assert emu.stop() == []
    running.join(30)
    assert len(cut) == 1
    assert [pid for pid in pids if alive(pid)] == []
    assert [home for home in homes if os.path.exists(home)] == []
    with pytest.raises(SandboxError):
        pool.close()  # its host is gone already: close() says it could not cancel it


@pytest.mark.slow  # the emulator CLI as a subprocess
def test_serve_takes_the_sandbox_settings_and_prints_the_ca_to_trust(tmp_path):
    proc = subprocess.Popen([PY, hf_jobs_emulator.__file__, "serve", "--json", "--tls", "--sandbox-host-boot-s", "0",
                             "--sandbox-host-ready-s", "0", "--sandbox-create-s", "0", "--sandbox-capacity", "3",
                             "--sandbox-idle-timeout-s", "5"], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert os.path.isfile(info["ca_path"]) and info["endpoint"].startswith("http://127.0.0.1:")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        proc.stdout.close()
    bad = subprocess.run([PY, hf_jobs_emulator.__file__, "serve", "--sandbox-capacity", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "sandbox_capacity must be an int >= 1" in bad.stderr


def test_no_thread_or_descriptor_is_left_after_a_host_served_http_websocket_and_exec(no_leaks, hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        with _ws_echo(emu, sbx) as ws:
            ws.send("x")
            assert ws.recv(timeout=10) == "x"
        assert sbx.run("echo out; echo err >&2").stdout == "out\n"
    assert emu.stop() == []
    hub.utils._http.close_session()  # huggingface_hub's own keep-alive connection to the Jobs API


@pytest.mark.slow  # a host job behind fault links, then a tunnel reset
def test_a_host_behind_network_fault_links_serves_and_its_tunnels_can_be_reset(hub_env):
    emu = hub_env(network_faults=True)
    with _pool(emu) as pool:
        sbx = pool.create()
        with _ws_echo(emu, sbx) as ws:
            ws.send("through the link")
            assert ws.recv(timeout=10) == "through the link"
            assert emu.reset_tunnels(sbx.host_id) >= 1
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=20)


# ------------------------------------------------------------------------------------------------
# Older huggingface_hub clients (fresh virtualenvs: slow)
# ------------------------------------------------------------------------------------------------

# Run in a virtualenv holding one huggingface_hub release: boot a pool against the emulator, run a
# command, start a server on the sandbox's unix socket, reach it through proxy_url_for + proxy_headers.
OLD_CLIENT = r'''
import json, os, socket, sys, time
import requests
# The emulator maps *.jobs.localhost to loopback in its own process only; this one needs the same.
_resolve = socket.getaddrinfo
socket.getaddrinfo = lambda host, *a, **k: _resolve(
    "127.0.0.1" if str(host).endswith(".jobs.localhost") else host, *a, **k)
from huggingface_hub import SandboxPool
from huggingface_hub import __version__
APP = """import os, socketserver, http.server
class S(socketserver.UnixStreamServer):
    def get_request(self):
        request, _ = super().get_request()
        return request, ("sandbox", 0)
S(os.environ["SBX_PROXY_DIR"] + "/8000.sock", http.server.SimpleHTTPRequestHandler).serve_forever()
"""
result = {"version": __version__}
try:
    with SandboxPool("python:3.12", token=os.environ["HF_TOKEN"], start_timeout=60) as pool:
        sbx = pool.create()
        result["run"] = sbx.run("echo hi").stdout
        sbx.files.write("app.py", APP)
        sbx.run([sys.argv[1], "app.py"], background=True)
        for _ in range(300):
            status = requests.get(sbx.proxy_url_for(8000, "/"), headers=sbx.proxy_headers, timeout=10).status_code
            if status != 502:
                break
            time.sleep(0.1)
        result["proxy"] = status
        sbx.kill()
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(result))
'''


@pytest.mark.slow  # a fresh virtualenv per huggingface_hub release
@pytest.mark.timeout(420)
@pytest.mark.parametrize("version, strict, works", [
    ("1.22.0", False, True),   # the first release with Sandbox.proxy_url_for / proxy_headers
    ("1.22.0", True, False),   # ... sends the host token on sandbox routes: the strict emulator refuses it
    ("1.32.0", True, True),    # the first release with per-sandbox tokens (and no redirect following)
    ("2.1.1", True, True),     # the first release of sbx protocol 3
], ids=["1.22.0-lenient", "1.22.0-strict", "1.32.0", "2.1.1"])
def test_older_huggingface_hub_releases_drive_the_emulated_server(tmp_path, hub_env, version, strict, works):
    venv = tmp_path / "venv"
    subprocess.run([PY, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              f"huggingface_hub=={version}", "requests"], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    emu = hub_env(sandbox_strict_tokens=strict)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "VIRTUAL_ENV"))}
    env.update(HF_ENDPOINT=emu.endpoint, HF_TOKEN=emu.token, HF_HOME=str(tmp_path / "hf-home"),
               SSL_CERT_FILE=emu.ca_path, REQUESTS_CA_BUNDLE=emu.ca_path)
    client = subprocess.run([python, "-c", OLD_CLIENT, PY], env=env, capture_output=True, text=True, timeout=240)
    result = json.loads(client.stdout.strip().splitlines()[-1])
    assert result["version"] == version
    if works:
        assert (result.get("error"), result.get("run"), result.get("proxy")) == (None, "hi\n", 200)
    else:
        assert "403" in result["error"] and "own token" in result["error"]


KILLED_EMULATOR_CHILD = r'''
import json, os, sys, tempfile, time
sys.path[:0] = [os.environ["ROOT"]]
import huggingface_hub, huggingface_hub.constants, huggingface_hub.hf_api
import hf_jobs_emulator
from hf_jobs_emulator import JobsEmulator
hf_jobs_emulator._LoopbackNames.add(hf_jobs_emulator.TLS_HOST_SUFFIX)
emu = JobsEmulator(tls=True, sandbox_host_boot_s=0, sandbox_host_ready_s=0, sandbox_create_s=0).start()
os.environ.update(SSL_CERT_FILE=emu.ca_path, HF_TOKEN=emu.token)
huggingface_hub.constants.ENDPOINT = huggingface_hub.hf_api.api.endpoint = emu.endpoint
huggingface_hub.constants.HF_HOME = tempfile.mkdtemp()
pool = huggingface_hub.SandboxPool("python:3.12", token=emu.token, start_timeout=60)
process = pool.create().run("sleep 300 & sleep 301; wait", background=True)  # a leader and a child
print(json.dumps({"pgid": process.pid}), flush=True)
time.sleep(300)
'''


def _group_members(pgid: int) -> List[int]:
    """Live processes (not zombies) of the process group `pgid`."""
    return processes(lambda stat: stat[2] == pgid)


@pytest.mark.slow  # an emulator and a pool in a child process
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_emulator_killed_outright_leaves_no_sandbox_process(tmp_path):
    child = subprocess.Popen([PY, "-c", KILLED_EMULATOR_CHILD], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "ROOT": os.path.dirname(hf_jobs_emulator.__file__)})
    pgid = None
    try:
        pgid = json.loads(child.stdout.readline())["pgid"]
        wait_until(lambda: len(_group_members(pgid)) >= 2, "the sandbox's shell and its sleep", 30)
        child.kill()  # SIGKILL: no teardown of the emulator's runs
        child.wait(30)
        wait_until(lambda: _group_members(pgid) == [], "the sandbox's processes to end with the emulator", 30)
    finally:
        child.kill()
        child.wait(30)
        child.stdout.close()
        if pgid is not None and _group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)  # a failed run leaves nothing either


# -- what a sandbox leaves behind, and inputs the server must refuse in words (review, stop 46) -------------------


def test_a_sandbox_without_an_idle_timeout_neither_stops_eviction_of_the_others_nor_keeps_its_host_up(hub_env):
    emu = hub_env()
    with _pool(emu, idle_timeout=2) as pool:
        forever, brief = pool.create(idle_timeout=None), pool.create(idle_timeout=1)  # None: never evicted
        host = emu.sandbox_hosts.host(forever.host_id)
        wait_until(lambda: brief.id.split(".")[1] not in host.sandbox_ids, "the brief sandbox's eviction")
        assert forever.id.split(".")[1] in host.sandbox_ids and host._janitor.is_alive()
        forever.kill()
        emu.wait_for_stage(forever.host_id, ["COMPLETED"], timeout_s=30)  # the empty host idled out


@pytest.mark.parametrize("escape", ["background", "fork", "setsid"])
def test_deleting_a_sandbox_ends_what_left_its_process_group_too(hub_env, escape):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        seconds = unique_seconds()  # names the process to look for, and only ours
        command = {"background": "sleep %s >/dev/null 2>&1 &" % seconds,  # the leader exits at once
                   "fork": [PY, "-c", "import os, time\nif os.fork() == 0:\n    time.sleep(%s)\n" % seconds],
                   "setsid": "setsid sleep %s >/dev/null 2>&1 &" % seconds}[escape]  # a session of its own
        sbx.run(command, background=True)
        wait_until(lambda: processes_named(seconds) and not any(p.running for p in sbx.processes()),
                   "the command to exit, leaving its escaped process")
        try:
            sbx.kill()
            wait_until(lambda: not processes_named(seconds), "the escaped process to end with its sandbox")
        finally:
            for pid in processes_named(seconds):  # a failing run leaves nothing behind either
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # kills a host job and waits for its sandboxes to end
def test_ending_a_host_ends_what_left_each_of_its_sandboxes_process_groups(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        first, second = pool.create(), pool.create()
        assert first.host_id == second.host_id
        marks = (unique_seconds(), unique_seconds())
        for sbx, seconds in zip((first, second), marks):
            sbx.run("sleep %s >/dev/null 2>&1 &" % seconds, background=True)
        wait_until(lambda: all(processes_named(seconds) for seconds in marks), "both escapes")
        try:
            emu.kill_job(first.host_id)
            wait_until(lambda: not any(processes_named(seconds) for seconds in marks),
                       "both escaped processes to end with their host")
        finally:
            for pid in processes_named(*marks):
                os.kill(pid, signal.SIGKILL)


def test_a_command_printing_without_pause_still_times_out_and_one_whose_child_keeps_writing_still_ends(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        began = time.monotonic()
        chatty = sbx.run([PY, "-u", "-c", "while True: print('x' * 200)"], timeout=1, check=False,
                         capture_output=False, on_stdout=lambda line: None)
        assert chatty.timed_out and time.monotonic() - began < 30
        ended = sbx.run("yes chatter & exit 3", check=False, capture_output=False, on_stdout=lambda line: None)
        assert ended.exit_code == 3


def test_a_background_start_racing_its_sandboxs_delete_never_outlives_the_sandbox(hub_env):
    emu = hub_env()
    with _pool(emu) as pool:
        seconds = unique_seconds()
        for _ in range(10):
            sbx = pool.create()
            started = threading.Barrier(2)

            def spawn() -> None:
                started.wait()
                try:
                    sbx.run("sleep " + seconds, background=True)
                except SandboxError:  # deleted first: refused, or its process killed at once
                    pass
            thread = threading.Thread(target=spawn)
            thread.start()
            started.wait()
            sbx.kill()
            thread.join(30)
        wait_until(lambda: not processes_named(seconds), "no sleeper in a deleted sandbox")


def unique_seconds() -> str:
    """A sleep length no other process on this machine carries (9,000 s and 12 random decimals), so a test
    that finds and kills its escaped processes by it never reaches another's (a bare "9100" could match,
    and kill, any process of the machine: a CI run died in these tests)."""
    return "9%03d.%012d" % (secrets.randbelow(1000), secrets.randbelow(10 ** 12))


def processes_named(*marks: str) -> List[int]:
    """Live processes of this user with one of `marks` in an argument of their command line."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{entry}").st_uid != os.getuid():
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if any(mark.encode() in arg for arg in handle.read().split(b"\0") for mark in marks):
                    found.append(int(entry))
        except OSError:  # gone meanwhile
            continue
    return [pid for pid in found if alive(pid)]


def test_a_create_on_a_host_that_stopped_meanwhile_leaves_no_directory(hub_env):
    emu = hub_env(sandbox_create_s=1.0)
    with _pool(emu) as pool:
        first = pool.create()  # the host is up
        host = emu.sandbox_hosts.host(first.host_id)
        late = threading.Thread(target=_quietly(pool.create), daemon=True)
        late.start()
        time.sleep(0.3)  # the second create is in its 1 s of work
        emu.kill_job(first.host_id)
        late.join(30)
        wait_until(lambda: not os.path.exists(host._state_dir), "the host's files to stay removed", timeout_s=5)
        time.sleep(1.0)  # past the create's work: it must not make them again
        assert not os.path.exists(host._state_dir)


def _quietly(action: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        try:
            action()
        except Exception:  # (the host died under it: what the test provokes)
            pass
    return run


def test_a_dedicated_sandbox_gets_the_hf_token_it_forwards_even_when_this_process_has_the_same(hub_env):
    emu = hub_env()  # (it sets HF_TOKEN to the emulator's token in this process, as docs/emulator.md says)
    assert os.environ["HF_TOKEN"] == emu.token
    with Sandbox.create(IMAGE, token=emu.token, start_timeout=60, forward_hf_token=True) as sbx:
        assert sbx.run("echo ${HF_TOKEN:+set}").stdout == "set\n"


def test_malformed_commands_and_paths_are_4xx_naming_them_not_a_dropped_connection(hub_env, caplog):
    emu = hub_env()
    with _pool(emu) as pool:
        sbx = pool.create()
        sbx.files.write("f.txt", "x")
        sbx.run("mkfifo pipe")
        for action, status, words in [
            (lambda: sbx.run("true", env={"A=B": "1"}), 400, "illegal environment variable name"),
            (lambda: sbx.run(["echo", "a\0b"]), 400, "embedded null byte"),
            (lambda: sbx.run("sleep 1", env={"A": "x\0y"}, background=True), 400, "embedded null byte"),
            (lambda: sbx.files.stat("f.txt/x"), 404, "does not exist"),
            (lambda: sbx.files.read("a\0b"), 400, "NUL byte"),
            (lambda: sbx.files.read("pipe"), 400, "is not a file"),  # (a FIFO: the open never blocks)
            (lambda: sbx.files.write("pipe", "x"), 400, "is not a file"),
        ]:
            with pytest.raises(SandboxError) as refused:
                action()
            assert refused.value.status_code == status and words in str(refused.value), str(refused.value)
        assert sbx.files.exists("f.txt/x") is False
        assert sbx.run("echo alive").stdout == "alive\n"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_a_proxied_stream_cut_by_the_sandboxs_server_ends_the_clients_body_without_an_error_logged(hub_env, caplog):
    emu = hub_env()
    app = HTTP_APP.replace('for i in range(3):', 'for i in range(3):\n                if i == 1: os._exit(1)')
    with _pool(emu) as pool:
        sbx = pool.create()
        _start_app(sbx, "app.py", app, 8000)
        with pytest.raises(requests.exceptions.RequestException):
            requests.get(sbx.proxy_url_for(8000, "/stream"), headers=sbx.proxy_headers, timeout=10).content
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
