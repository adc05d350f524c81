"""The Hub as it is, end to end against the emulator: the live flavor list, the per-user rate limit shared by
processes, teardown that never waits for budget, pagination across the Hub's host names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import requests

import hf_sandbox_provider as hsp
from hf_jobs_emulator import JobsEmulator, echo_server_command

IMAGE = "registry.hf.space/openenv-echo-env:latest"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_flavor_the_hubs_live_list_lacks_is_refused_before_any_create(proxy):
    with JobsEmulator(flavors=["cpu-basic", "cpu-upgrade"]) as emu:
        provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=proxy,
                                         flavor="a100-large", command=echo_server_command())
        with pytest.raises(hsp.SandboxConfigError, match="valid Jobs flavors: cpu-basic, cpu-upgrade"):
            provider.start_container()
        assert emu.api_calls == {"hardware": 1} and emu.jobs == []


# -- pagination ------------------------------------------------------------------------------------------


def listing_emulator(link_host):
    """An emulator paginating 2 jobs a page, with 5 jobs; its next links name `link_host` (same port)."""
    emu = JobsEmulator(list_page_size=2).start()
    emu.next_link_base = "http://%s:%d" % (link_host, emu.port)
    client = hsp._JobsClient(emu.endpoint, emu.token)
    for _ in range(5):
        client.create_job("local", {"dockerImage": "python:3.12", "command": ["true"], "labels": {"batch": "b1"}},
                          {"batch": "b1"})
    return emu, client


def test_a_listing_follows_next_links_naming_the_emulator_under_another_loopback_name():
    emu, client = listing_emulator("localhost")  # the endpoint says 127.0.0.1
    try:
        listed = client.list_jobs("local", labels={"batch": "b1"})
        assert sorted(job["id"] for job in listed) == sorted(job.id for job in emu.jobs)
        assert emu.api_calls["list"] == 3
        from huggingface_hub import HfApi  # the Hub's own client reads the same pages
        assert len(list(HfApi(endpoint=emu.endpoint, token=emu.token).list_jobs(namespace="local"))) == 5
    finally:
        client.close()
        emu.stop()


@pytest.mark.parametrize("link_base, refusal", [
    ("http://192.0.2.1", "next-page link 'http://192.0.2.1.*not following it.*after 2 jobs"),  # TEST-NET-1
    ("http://user@127.0.0.1", "next-page link .*not following it"),
    ("http://user:pw@127.0.0.1", "next-page link .*not following it"),
    ("https://127.0.0.1", "next-page link .*not following it"),
    ("http://127.0.0.1:notaport", "next-page link .*not following it"),
])
def test_a_next_link_to_a_foreign_host_with_credentials_another_scheme_or_a_bad_port_is_not_followed(
        link_base, refusal):
    emu, client = listing_emulator("127.0.0.1")
    emu.next_link_base = link_base if link_base.endswith("notaport") else "%s:%d" % (link_base, emu.port)
    try:
        with pytest.raises(hsp.JobsAPIError, match=refusal):
            client.list_jobs("local", labels={"batch": "b1"})
        assert emu.api_calls["list"] == 1
    finally:
        client.close()
        emu.stop()


# -- the per-user rate limit ---------------------------------------------------------------------------


# A process of a trainer (say one rank of `accelerate launch`), in miniature: its own budget and client,
# the user's token, a run of Jobs API calls. Prints how many it made and the quota its budget learnt.
QUOTA_CHILD = textwrap.dedent("""
    import json, sys
    import hf_sandbox_provider as hsp
    endpoint, token, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = hsp._JobsClient(endpoint, token)
    made = sum(1 for _ in range(calls) if client.list_jobs("local", retries=0) is not None)
    print(json.dumps([made, client._budget.calls, client._budget.window_s]))
""")


@pytest.mark.slow  # waits out rate-limit windows
def test_processes_of_one_user_share_its_quota_through_the_servers_count_without_a_429():
    """Four real processes, each with its own budget and the user's token: the server's RateLimit count
    is all they share, and it keeps them under the quota across windows (README, Many environments)."""
    processes, calls, quota = 4, 25, 40
    with JobsEmulator(rate_limit=(quota, 4)) as emu:
        env = dict(os.environ, PYTHONPATH=ROOT)
        children = [subprocess.Popen([sys.executable, "-c", QUOTA_CHILD, emu.endpoint, emu.token, str(calls)],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for _ in range(processes)]
        outcomes = [child.communicate(timeout=120) for child in children]
        assert [child.returncode for child in children] == [0] * processes, outcomes
        assert [json.loads(out) for out, _ in outcomes] == [[calls, quota, 4.0]] * processes
        # 100 calls for a quota of 40: more than two windows, none refused, no window over the quota
        assert emu.rate_limited_calls == 0 and 0 < emu.window_peaks["local"] <= quota


@pytest.mark.slow  # spends a rate-limit window
def test_a_process_that_spent_its_window_still_cancels_its_jobs_at_once(proxy):
    """The budget holds ordinary calls once only the reserve is left (a replica_status(refresh=True) loop
    got a process there; here plain calls of the same user spend it faster); stop_container's cancels pass
    while such a call still waits for the reset."""
    with JobsEmulator(rate_limit=(60, 300)) as emu:
        provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=proxy, replicas=2,
                                         namespace="local", command=echo_server_command(), poll_interval_s=0.05)
        provider.wait_for_ready(provider.start_container())
        budget = hsp._api_budget(emu.endpoint, emu.token)
        spender = hsp._JobsClient(emu.endpoint, emu.token)
        auth = {"Authorization": "Bearer " + emu.token}
        while hsp._ratelimit_info(requests.get(emu.endpoint + "/api/jobs/local", headers=auth).headers)[0] > 6:
            pass  # another tool of the same user spends the window, down to the reserve
        spender.list_jobs("local", retries=0)  # this process's next answer says so
        assert budget.wait_s() > 60
        held = threading.Thread(target=provider.replica_status, kwargs={"refresh": True})
        held.start()  # an ordinary call: waits for the reset, minutes away
        try:
            provider.stop_container()
            assert held.is_alive()  # the stop did not wait for the budget
            assert provider.stage == "CANCELED"  # both cancels were answered
            assert {emu.wait_for_stage(job.id, ["CANCELED"]).stage for job in emu.jobs} == {"CANCELED"}
            assert emu.rate_limited_calls == 0 and budget.teardown_sent >= 2
        finally:
            with budget._lock:  # let the held call go (the emulator will answer it 429: it is not waited out)
                budget.remaining, budget.reset_at = float(budget.calls), budget.clock() + 300
            held.join(30)
            spender.close()


WHOAMI_WINDOW_S = 6


def test_a_429_of_whoamis_own_bucket_holds_that_call_not_every_jobs_call_of_the_token():
    with JobsEmulator(rate_limit=(200, WHOAMI_WINDOW_S)) as emu:  # whoami's bucket: 10 calls per window
        headers = {"Authorization": "Bearer " + emu.token}
        for _ in range(10):  # another tool of the same user spends the whoami bucket
            requests.get(emu.endpoint + "/api/whoami-v2", headers=headers)
        common = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command(), poll_interval_s=0.1)
        asks = hsp.HFSandboxProvider("img", **common)  # no namespace=: its whoami is answered 429 ("whoami";r=0)
        given = hsp.HFSandboxProvider("img", namespace=emu.namespace, **common)
        thread = threading.Thread(target=asks.start_container, daemon=True)
        try:
            thread.start()
            time.sleep(0.5)
            began = time.monotonic()
            given.start_container()
            assert time.monotonic() - began < WHOAMI_WINDOW_S / 2, "a start that needs no whoami waited for its bucket"
            thread.join(WHOAMI_WINDOW_S + 10)
            assert asks.job_id, "the whoami call retried after its own reset"
        finally:
            given.stop_container()
            asks.stop_container()
