"""HFSandboxProvider against the local Jobs emulator: many providers on one proxy, and the pickled
factory that TRL ships to worker processes. Real processes, real sockets, nothing mocked."""

from __future__ import annotations

import multiprocessing
import pickle
import re
import sys
import threading

import pytest
import requests

import hf_sandbox_provider as hsp
from hf_jobs_emulator import echo_server_command
from support import wait_until

IMAGE = "registry.hf.space/openenv-echo-env:latest"
TIMEOUT = 30


def test_eight_providers_started_from_threads_share_one_proxy_and_keep_their_own_jobs(emu, proxy):
    providers = [hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=proxy,
                                       command=echo_server_command(), env_vars={"WHO": str(i)},
                                       poll_interval_s=0.05) for i in range(8)]
    errors = []

    def bring_up(provider):
        try:
            provider.wait_for_ready(provider.start_container())
        except BaseException as exc:  # reported below; the thread must not die silently
            errors.append(exc)

    threads = [threading.Thread(target=bring_up, args=(p,)) for p in providers]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=TIMEOUT)
        assert not errors, errors
        assert len({p.job_id for p in providers}) == 8
        assert len({p.base_url for p in providers}) == 8
        assert {p.base_url.split("/")[2] for p in providers} == {"127.0.0.1:%d" % proxy.port}
        with requests.Session() as http:
            for index, provider in enumerate(providers):
                http.post(provider.base_url + "/reset", json={}, timeout=TIMEOUT).raise_for_status()
                for _ in range(index + 1):
                    http.post(provider.base_url + "/step", json={"action": {"message": "x"}},
                              timeout=TIMEOUT).raise_for_status()
            counts = [http.get(p.base_url + "/state", timeout=TIMEOUT).json()["step_count"] for p in providers]
        assert counts == list(range(1, 9))  # each base URL reaches its own job
    finally:
        for provider in providers:
            provider.stop_container()
    wait_until(lambda: all(job.terminal for job in emu.jobs), "every job to end")
    assert all(job.stage == "CANCELED" for job in emu.jobs)
    wait_until(lambda: emu.live_pids() == [], "every job process to exit")


def _worker(pickled: bytes, results) -> None:
    """A worker process: unpickle the factory's provider, use it, stop it, report."""
    provider = pickle.loads(pickled)
    try:
        base_url = provider.start_container()
        provider.wait_for_ready(base_url)
        status = requests.get(base_url + "/health", timeout=TIMEOUT).status_code
        results.put((provider.job_id, status))
    except BaseException as exc:
        results.put((None, repr(exc)))
    finally:
        provider.stop_container()


@pytest.mark.slow  # a spawned worker interpreter
def test_unstarted_provider_pickled_to_a_spawned_worker_runs_its_own_job(emu):
    provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token,
                                     command=echo_server_command(), poll_interval_s=0.05)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    worker = context.Process(target=_worker, args=(pickle.dumps(provider), results))
    worker.start()
    try:
        job_id, status = results.get(timeout=60)
    finally:
        worker.join(timeout=TIMEOUT)
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)
    assert job_id is not None, status
    assert status == 200
    assert worker.exitcode == 0
    assert emu.wait_for_stage(job_id, ["CANCELED"]).stage == "CANCELED"
    assert provider.job_id is None  # the parent's provider never started anything


# A job whose server answers every request with $STATUS: a stand-in for a job proxy that refuses the token.
_REFUSING_SERVER = """
import http.server, os
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"error": "refused"}'
        self.send_response(int(os.environ["STATUS"]))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
"""


@pytest.mark.parametrize("status", [401, 403])
def test_health_answering_auth_refusal_gives_up_with_an_error_naming_it_and_cancels_the_job(emu, proxy, status):
    provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=proxy,
                                     command=[sys.executable, "-c", _REFUSING_SERVER], env_vars={"STATUS": status},
                                     poll_interval_s=0.05, ready_timeout_s=15)
    try:
        base_url = provider.start_container()
        with pytest.raises(hsp.SandboxError) as caught:
            provider.wait_for_ready(base_url)
        # Given up on the refusal itself, not after the 15 s readiness budget.
        assert not isinstance(caught.value, hsp.JobStartTimeout)
        assert "/health answered HTTP %d" % status in str(caught.value)
        assert "refused the token" in str(caught.value)
        assert provider.phase is hsp.Phase.IDLE  # the failed wait tore the job down
    finally:
        provider.stop_container()
    wait_until(lambda: all(job.terminal for job in emu.jobs), "every job to end")
    assert [job.stage for job in emu.jobs] == ["CANCELED"]


@pytest.mark.slow  # waits out a 1.5 s ready timeout
def test_health_answering_503_is_not_a_refusal_the_wait_goes_on_until_its_deadline(emu, proxy):
    provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=proxy,
                                     command=[sys.executable, "-c", _REFUSING_SERVER], env_vars={"STATUS": 503},
                                     poll_interval_s=0.05)
    try:
        base_url = provider.start_container()
        with pytest.raises(hsp.JobStartTimeout) as caught:
            provider.wait_for_ready(base_url, timeout_s=1.5)
        assert "last: HTTP 503" in str(caught.value)
    finally:
        provider.stop_container()
    wait_until(lambda: all(job.terminal for job in emu.jobs), "every job to end")
    assert [job.stage for job in emu.jobs] == ["CANCELED"]


# -- first contact: a wrong URL never costs a healthy job (issue 30) -----------------------------------


def test_wait_for_ready_refuses_a_url_that_is_not_the_providers_at_once_and_keeps_the_job(emu, proxy):
    from urllib.parse import urljoin

    with hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=proxy,
                               command=echo_server_command(), poll_interval_s=0.05) as provider:
        base_url = provider.start_container()
        typo = base_url[:-1] + ("x" if base_url[-1] != "x" else "y")  # a route id with one wrong character
        origin, route_id = base_url.rsplit("/", 1)
        for wrong in ("http://127.0.0.1:1/other", typo, urljoin(base_url, "/step")):
            with pytest.raises(hsp.SandboxConfigError, match="not this provider's base URL, which is %s/<route id>"
                               % re.escape(origin)) as refused:
                provider.wait_for_ready(wrong, timeout_s=300)
            assert route_id not in str(refused.value) and typo.rsplit("/", 1)[1] not in str(refused.value)
        assert route_id not in repr(provider) and "base_url='%s/<route id>'" % origin in repr(provider)
        with pytest.raises(hsp.SandboxConfigError, match=r"urljoin\(base_url, '/step'\) drops its route id"):
            provider.wait_for_ready(urljoin(base_url, "/step"))
        assert provider.phase is hsp.Phase.RUNNING and emu.job(provider.job_id).stage == "RUNNING"
        provider.wait_for_ready(base_url + "/")  # the right URL still works after the refusals
    assert emu.wait_for_stage(provider.job_id, ["CANCELED"]).stage == "CANCELED"


def test_a_route_the_proxy_does_not_know_ends_the_wait_at_once_speaking_of_the_provider(emu, proxy):
    provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=proxy,
                                     command=echo_server_command(), poll_interval_s=0.05)
    base_url = provider.start_container()
    proxy.unmount(base_url)  # behind the provider's back: every probe now answers 404 unknown-route
    with pytest.raises(hsp.SandboxError) as info:
        provider.wait_for_ready(timeout_s=300)
    assert not isinstance(info.value, hsp.JobStartTimeout)  # a permanent answer, not waited out
    origin, route_id = base_url.rsplit("/", 1)
    assert "no route at %s/<route id>" % origin in str(info.value) and "provider.base_url" in str(info.value)
    assert route_id not in str(info.value)  # the route id is the loopback credential: never in an error
    assert "AuthProxy.mount" not in str(info.value)
    assert provider.phase is hsp.Phase.IDLE  # the failed wait cancelled the job, as any failure does


def test_wait_for_ready_after_a_stop_says_the_job_was_stopped(emu, proxy):
    provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=proxy,
                                     command=echo_server_command(), poll_interval_s=0.05)
    provider.start_container()
    job_id = provider.job_id
    provider.stop_container()
    with pytest.raises(hsp.SandboxError, match="job %s was stopped; call start_container" % job_id):
        provider.wait_for_ready()


def test_a_misspelt_flavor_is_refused_with_the_closest_one_suggested():
    with pytest.raises(hsp.SandboxConfigError, match=r"unknown flavor 'cpu-basci' \(did you mean 'cpu-basic'\?\)"):
        hsp.HFSandboxProvider(IMAGE, flavor="cpu-basci")
