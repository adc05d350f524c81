"""The Hub as it is, end to end against the emulator: the live flavor list, the per-user rate limit shared by
processes, teardown that never waits for budget, pagination across the Hub's host names."""

from __future__ import annotations

import pytest

import hf_sandbox_provider as hsp
from hf_jobs_emulator import JobsEmulator, echo_server_command

IMAGE = "registry.hf.space/openenv-echo-env:latest"


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


def test_a_listing_whose_next_link_names_a_foreign_host_fails_loudly_after_the_first_page():
    emu, client = listing_emulator("192.0.2.1")  # TEST-NET-1: not this server
    try:
        with pytest.raises(hsp.JobsAPIError, match="next-page link 'http://192.0.2.1.*not following it.*after 2 jobs"):
            client.list_jobs("local", labels={"batch": "b1"})
        assert emu.api_calls["list"] == 1
    finally:
        client.close()
        emu.stop()
