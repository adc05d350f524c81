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
