"""JobsEmulator(tls=True): exposed ports serve https under job-shaped names with a test CA, so the
provider's exposed-URL rule and the proxy's upstream TLS run as they do against the Hub."""
from __future__ import annotations

import os
import socket
import ssl
from typing import Iterator
from urllib.parse import urlsplit

import pytest
import requests

import hf_sandbox_provider as hsp
from hf_jobs_emulator import TLS_HOST_SUFFIX, JobsEmulator, echo_server_command
from proxy import AuthProxy
from support import wait_until, ws_connect, ws_url

IMAGE = "registry.hf.space/openenv-echo-env:latest"
TIMEOUT = 30


@pytest.fixture
def tls_emu(log_guard) -> Iterator[JobsEmulator]:
    with JobsEmulator(tls=True) as emulator:
        log_guard.watch(emulator.token)
        yield emulator
    assert emulator.live_pids() == [], "a job process outlived the emulator"


def _provider(emu: JobsEmulator, proxy: AuthProxy, **kwargs: object) -> hsp.HFSandboxProvider:
    options = dict(endpoint=emu.endpoint, token=emu.token, proxy=proxy, command=echo_server_command(),
                   poll_interval_s=0.05, verify=emu.ca_path)
    options.update(kwargs)
    return hsp.HFSandboxProvider(IMAGE, **options)


def test_a_provider_reaches_a_tls_job_by_its_job_shaped_https_url_over_http_and_websocket(tls_emu, proxy):
    provider = _provider(tls_emu, proxy)
    try:
        base_url = provider.start_container()
        provider.wait_for_ready(base_url)
        upstream = urlsplit(provider.upstream_url)
        assert upstream.scheme == "https"
        assert upstream.hostname == "%s--8000.%s" % (provider.job_id, TLS_HOST_SUFFIX)
        with requests.Session() as http:
            for i in range(3):  # a sequence on kept-alive upstream TLS connections
                http.post(base_url + "/reset", json={}, timeout=TIMEOUT).raise_for_status()
                answer = http.post(base_url + "/step", json={"action": {"message": "m%d" % i}}, timeout=TIMEOUT)
                answer.raise_for_status()
            assert http.get(base_url + "/state", timeout=TIMEOUT).json()["step_count"] == 1
        for session in range(2):  # WebSocket tunnels over fresh upstream TLS connections
            with ws_connect(ws_url(base_url) + "/ws") as ws:
                ws.send('{"type": "reset", "data": {}}')
                assert '"observation"' in ws.recv(TIMEOUT)
                ws.send('{"type": "step", "data": {"message": "over tls %d"}}' % session)
                assert "over tls %d" % session in ws.recv(TIMEOUT)
    finally:
        provider.stop_container()
    wait_until(lambda: all(job.terminal for job in tls_emu.jobs), "the job to end")


def test_a_job_whose_exposed_url_names_another_job_gets_no_token_and_is_cancelled(proxy, log_guard):
    """The exposed-URL rule on the real path: the Jobs API answers with a URL naming another job id (the
    emulator's foreign-url fault; the URL still reaches this job's gate, on loopback). The start must
    refuse it before the token is sent, cancel the job and mount nothing."""
    with JobsEmulator(tls=True, faults={"foreign-url": "true"}) as emu:
        log_guard.watch(emu.token)
        provider = _provider(emu, proxy, start_timeout_s=TIMEOUT)
        with pytest.raises(hsp.InsecureURLError, match="does not belong to job") as refused:
            provider.start_container()
        job = emu.jobs[0]
        assert job.id[::-1] in str(refused.value) and emu.token not in str(refused.value)
        assert emu.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED"
        assert provider.base_url is None and proxy._routes == {}
    assert emu.live_pids() == []


def test_the_gate_over_tls_still_wants_the_token_and_an_untrusting_proxy_gets_502_upstream_tls(tls_emu, proxy):
    provider = _provider(tls_emu, proxy)
    try:
        provider.wait_for_ready(provider.start_container())
        url = provider.upstream_url
        assert requests.get(url + "/health", verify=tls_emu.ca_path, timeout=TIMEOUT).status_code == 401
        authorized = requests.get(url + "/health", verify=tls_emu.ca_path, timeout=TIMEOUT,
                                  headers={"Authorization": "Bearer " + tls_emu.token})
        assert authorized.status_code == 200
        with pytest.raises(requests.exceptions.SSLError):  # the CA is the emulator's, not the system's
            requests.get(url + "/health", timeout=TIMEOUT)
        untrusting = proxy.mount(url, tls_emu.token)  # verify=True: the system store only
        answer = requests.get(untrusting + "/health", timeout=TIMEOUT)
        assert answer.status_code == 502
        assert answer.headers["X-Proxy-Error"].startswith("upstream-tls")
    finally:
        provider.stop_container()


def test_the_provider_refuses_a_tls_url_of_another_job_before_sending_the_token(tls_emu):
    job_url = "https://%s--8000.%s:443" % ("a" * 24, TLS_HOST_SUFFIX)
    assert hsp._exposed_url_rejection(job_url, "a" * 24, 8000, tls_emu.endpoint) is None
    reason = hsp._exposed_url_rejection(job_url, "b" * 24, 8000, tls_emu.endpoint)
    assert reason and "does not belong to job" in reason
    assert "not https" in hsp._exposed_url_rejection(job_url.replace("https", "http"), "a" * 24, 8000,
                                                     tls_emu.endpoint)


def test_job_shaped_names_resolve_to_loopback_only_while_a_tls_emulator_runs():
    name = "x--8000." + TLS_HOST_SUFFIX
    original = socket.getaddrinfo
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo(name, 443)
    with JobsEmulator(tls=True) as emu:
        ca_dir = os.path.dirname(emu.ca_path)
        assert {info[4][0] for info in socket.getaddrinfo(name, 443)} == {"127.0.0.1"}
        assert socket.getaddrinfo("127.0.0.1", 80)[0][4][0] == "127.0.0.1"  # other names unchanged
        with JobsEmulator(tls=True):  # a second one shares the resolver; the first keeps it after
            pass
        assert {info[4][0] for info in socket.getaddrinfo(name, 443)} == {"127.0.0.1"}
    assert socket.getaddrinfo is original
    assert not os.path.exists(ca_dir)  # the CA and key files are gone with the emulator
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo(name, 443)


def test_the_tls_front_sends_no_session_ticket_a_two_thread_client_could_race_its_first_write_with(tls_emu, proxy):
    # The websockets sync client reads its SSL socket in one thread while it writes the upgrade request
    # in another; a TLS 1.3 ticket arriving then made OpenSSL lose the request (the handshake hung until
    # the test timed out) or crash. After a whole exchange, any ticket the front sent has been read.
    provider = _provider(tls_emu, proxy)
    try:
        provider.wait_for_ready(provider.start_container())
        upstream = urlsplit(provider.upstream_url)
        context = ssl.create_default_context(cafile=tls_emu.ca_path)
        with socket.create_connection(("127.0.0.1", upstream.port), timeout=TIMEOUT) as raw:
            with context.wrap_socket(raw, server_hostname=upstream.hostname) as tls:
                assert tls.version() == "TLSv1.3"
                tls.sendall(b"GET /health HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
                            % upstream.netloc.encode())
                answer = b""
                while True:
                    chunk = tls.recv(65536)
                    if not chunk:
                        break
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 ")
                assert not tls.session.has_ticket
    finally:
        provider.stop_container()
