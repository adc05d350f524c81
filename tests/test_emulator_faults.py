"""The emulator's fault kinds added for the soak run (issue 14): API 5xx bursts, jobs that never get a
URL, and wire faults between an exposed port's gate and the job (stalls, resets mid-response and
mid-tunnel). Each is driven through the real API / gate on loopback and checked from both sides:
what the client sees, and what the job's server actually ran."""
from __future__ import annotations

import json
import socket

import pytest
import requests
from websockets.exceptions import ConnectionClosed

from hf_jobs_emulator import JobsEmulator, echo_server_command
from support import wait_until, ws_connect, ws_url

TIMEOUT = 20.0


@pytest.fixture
def wire_emu(log_guard):
    with JobsEmulator(network_faults=True) as emulator:
        log_guard.watch(emulator.token)
        yield emulator
    assert emulator.live_pids() == [], "a job process outlived the emulator"


def api(emu: JobsEmulator, method: str, path: str, **kwargs) -> requests.Response:
    headers = {"Authorization": f"Bearer {emu.token}"}
    return requests.request(method, emu.endpoint + path, headers=headers, timeout=TIMEOUT, **kwargs)


def create_echo(emu: JobsEmulator, labels=None) -> str:
    body = {"dockerImage": "echo:latest", "command": echo_server_command(), "labels": labels or {},
            "expose": {"ports": [8000], "portsPublic": []}}
    answer = api(emu, "POST", f"/api/jobs/{emu.namespace}", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def running_echo(emu: JobsEmulator) -> tuple:
    """A RUNNING echo job whose server answers /health through its gate: (job id, gate URL, session)."""
    job_id = create_echo(emu)
    emu.wait_for_stage(job_id, ["RUNNING"], timeout_s=TIMEOUT)
    url = emu.job(job_id).expose_urls[0]
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {emu.token}"
    wait_until(lambda: _healthy(session, url), "the echo job's /health through its gate", TIMEOUT)
    return job_id, url, session


def _healthy(session: requests.Session, url: str) -> bool:
    try:
        return session.get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def step_count(url: str, emu: JobsEmulator) -> int:
    fresh = requests.get(url + "/state", headers={"Authorization": f"Bearer {emu.token}"}, timeout=TIMEOUT)
    return fresh.json()["step_count"]


# -- API 5xx bursts --------------------------------------------------------------------------------


def test_injected_server_errors_answer_5xx_then_recover_and_an_errored_create_makes_no_job(emu):
    emu.inject_server_errors(2, status=502)
    body = {"dockerImage": "python:3.12", "command": ["true"]}
    first = api(emu, "POST", f"/api/jobs/{emu.namespace}", json=body)
    second = api(emu, "GET", f"/api/jobs/{emu.namespace}")
    assert (first.status_code, second.status_code) == (502, 502)
    assert "injected" in first.headers["X-Error-Message"] and first.headers["X-Request-Id"]
    assert emu.jobs == []  # the refused create made nothing
    assert api(emu, "GET", f"/api/jobs/{emu.namespace}").status_code == 200
    assert emu.api_calls["create"] == 1 and emu.api_calls["list"] == 2


def test_server_errors_can_target_one_route(emu):
    emu.inject_server_errors(1, routes=["cancel"])
    assert api(emu, "GET", f"/api/jobs/{emu.namespace}").status_code == 200
    assert api(emu, "POST", f"/api/jobs/{emu.namespace}/nope/cancel").status_code == 503
    assert api(emu, "POST", f"/api/jobs/{emu.namespace}/nope/cancel").status_code == 404


@pytest.mark.parametrize("kwargs, word", [({"calls": -1}, "calls"), ({"calls": 1, "status": 429}, "5xx"),
                                          ({"calls": 1, "routes": ["make"]}, "create")])
def test_bad_server_error_injections_are_refused_naming_the_argument(emu, kwargs, word):
    with pytest.raises(ValueError, match=word):
        emu.inject_server_errors(**kwargs)


# -- jobs that never get a URL ---------------------------------------------------------------------


def test_withheld_url_keeps_a_running_job_without_expose_urls_and_only_for_the_next_job(emu):
    emu.withhold_next_urls(1)
    silent = create_echo(emu)
    emu.wait_for_stage(silent, ["RUNNING"], timeout_s=TIMEOUT)
    served = create_echo(emu)  # created after: jobs racing to RUNNING would make "next" ambiguous
    emu.wait_for_stage(served, ["RUNNING"], timeout_s=TIMEOUT)
    silent_info = api(emu, "GET", f"/api/jobs/{emu.namespace}/{silent}").json()
    served_info = api(emu, "GET", f"/api/jobs/{emu.namespace}/{served}").json()
    assert silent_info["status"]["stage"] == "RUNNING" and not silent_info["status"].get("exposeUrls")
    assert len(served_info["status"]["exposeUrls"]) == 1
    assert api(emu, "POST", f"/api/jobs/{emu.namespace}/{silent}/cancel").status_code == 200
    assert emu.wait_for_stage(silent, ["CANCELED"], timeout_s=TIMEOUT).stage == "CANCELED"


def test_no_url_label_withholds_that_jobs_url_and_a_bad_value_is_refused(emu):
    job_id = create_echo(emu, labels={"emulator-no-url": "true"})
    emu.wait_for_stage(job_id, ["RUNNING"], timeout_s=TIMEOUT)
    assert emu.job(job_id).expose_urls is None
    body = {"dockerImage": "python:3.12", "command": ["true"], "labels": {"emulator-no-url": "maybe"}}
    refused = api(emu, "POST", f"/api/jobs/{emu.namespace}", json=body)
    assert refused.status_code == 400 and "emulator-no-url" in refused.json()["error"]


# -- wire faults between the gate and the job --------------------------------------------------------


def test_wire_faults_need_network_faults_on(emu):
    job_id = create_echo(emu)
    emu.wait_for_stage(job_id, ["RUNNING"], timeout_s=TIMEOUT)
    with pytest.raises(ValueError, match="network_faults=True"):
        emu.stall_next_responses(job_id)


@pytest.mark.slow  # waits out a 1 s client timeout
def test_a_stalled_response_ran_upstream_times_out_the_client_and_the_next_request_is_served(wire_emu):
    job_id, url, session = running_echo(wire_emu)
    assert session.post(url + "/reset", json={}, timeout=TIMEOUT).status_code == 200
    wire_emu.stall_next_responses(job_id, count=1, seconds=30.0)
    with pytest.raises(requests.ReadTimeout):
        session.post(url + "/step", json={"action": {"message": "held"}}, timeout=1.0)
    assert step_count(url, wire_emu) == 1  # the step ran; only its answer was held back
    answer = session.post(url + "/step", json={"action": {"message": "next"}}, timeout=TIMEOUT)
    assert answer.json()["observation"]["echoed_message"] == "next"
    assert step_count(url, wire_emu) == 2


def test_a_response_reset_mid_way_reaches_the_client_as_a_gate_502_after_the_step_ran(wire_emu):
    job_id, url, session = running_echo(wire_emu)
    session.post(url + "/reset", json={}, timeout=TIMEOUT)
    wire_emu.reset_next_responses(job_id, count=1, after_bytes=12)
    cut = session.post(url + "/step", json={"action": {"message": "cut"}}, timeout=TIMEOUT)
    assert cut.status_code == 502 and cut.headers.get("X-Proxy-Error")
    assert step_count(url, wire_emu) == 1
    whole = session.post(url + "/step", json={"action": {"message": "whole"}}, timeout=TIMEOUT)
    assert whole.json()["observation"]["echoed_message"] == "whole"


def test_a_response_reset_after_its_headers_ends_the_client_connection_early(wire_emu):
    job_id, url, session = running_echo(wire_emu)
    wire_emu.reset_next_responses(job_id, count=1, after_bytes=200)  # headers out, body cut
    port = int(url.rsplit(":", 1)[1])
    # Over 64 KiB, so the gate streams the answer instead of buffering it whole (a cut small answer
    # becomes a 502, as the test above shows).
    body = json.dumps({"action": {"message": "m" * 100_000}}).encode()
    request = (f"POST /step HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {wire_emu.token}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(request)
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
            if received.startswith(b"HTTP/1.1 502") and b"\r\n\r\n" in received:
                break  # the proxy's own answer (it may keep the connection open)
    head, _, rest = received.partition(b"\r\n\r\n")
    # A TCP RST may discard the bytes the gate had not read yet: then nothing of the answer reached it
    # and it says so with a 502 of its own; otherwise the head went out and the body is cut.
    if head.startswith(b"HTTP/1.1 502"):
        assert b"X-Proxy-Error: upstream-" in head
    else:
        assert head.startswith(b"HTTP/1.1 200")
    assert b"m" * 100_000 not in rest  # never a response that looks complete when it is not


def test_reset_tunnels_ends_open_websocket_sessions_and_new_ones_work(wire_emu, proxy):
    job_id, url, _ = running_echo(wire_emu)
    base_url = proxy.mount(url, wire_emu.token)  # the client holds no token (its logs show headers)
    with ws_connect(ws_url(base_url) + "/ws") as ws:
        ws.send(json.dumps({"type": "reset", "data": {}}))
        assert json.loads(ws.recv(timeout=TIMEOUT))["type"] == "observation"
        assert wire_emu.reset_tunnels(job_id) == 1
        with pytest.raises(ConnectionClosed):
            ws.send(json.dumps({"type": "step", "data": {"message": "lost"}}))
            ws.recv(timeout=TIMEOUT)
    with ws_connect(ws_url(base_url) + "/ws") as ws:
        ws.send(json.dumps({"type": "reset", "data": {}}))
        ws.recv(timeout=TIMEOUT)
        ws.send(json.dumps({"type": "step", "data": {"message": "again"}}))
        assert json.loads(ws.recv(timeout=TIMEOUT))["data"]["observation"]["echoed_message"] == "again"
    assert wire_emu.reset_tunnels(job_id) == 0


def test_wire_faults_refuse_a_job_that_is_not_running(wire_emu):
    job_id, _, _ = running_echo(wire_emu)
    api(wire_emu, "POST", f"/api/jobs/{wire_emu.namespace}/{job_id}/cancel")
    wire_emu.wait_for_stage(job_id, ["CANCELED"], timeout_s=TIMEOUT)
    with pytest.raises(ValueError, match="CANCELED"):
        wire_emu.reset_next_responses(job_id)
    with pytest.raises(ValueError, match="count"):
        wire_emu.stall_next_responses(job_id, count=-1)
