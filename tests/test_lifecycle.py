"""The provider's lifecycle as one explicit phase, replicas as plain single-job providers, and pickling by
an allowlist of settings: checked against the real local Jobs emulator and the real proxy."""

from __future__ import annotations

import pickle

import pytest

import hf_sandbox_provider as hsp
from hf_jobs_emulator import JobsEmulator, echo_server_command
from hf_sandbox_provider import Phase
from support import in_thread, wait_until

IMAGE = "registry.hf.space/openenv-echo-env:latest"
TIMEOUT = 60


def provider_on(emu, proxy, cls=hsp.HFSandboxProvider, **kwargs):
    options = dict(endpoint=emu.endpoint, token=emu.token, proxy=proxy, command=echo_server_command(),
                   poll_interval_s=0.05)
    options.update(kwargs)
    return cls(IMAGE, **options)


def test_phases_follow_a_start_a_readiness_wait_and_a_stop(proxy):
    with JobsEmulator(scheduling_delay_s=0.5) as emu:
        provider = provider_on(emu, proxy)
        assert provider.phase is Phase.IDLE
        thread, outcome = in_thread(provider.start_container)
        wait_until(lambda: len(emu.jobs) == 1, "the create")
        wait_until(lambda: provider.phase is Phase.STARTING, "the job to be recorded")
        thread.join(TIMEOUT)
        assert isinstance(outcome[0], str) and provider.phase is Phase.RUNNING
        provider.wait_for_ready()
        assert provider.phase is Phase.RUNNING
        provider.stop_container()
        assert provider.phase is Phase.IDLE and provider.stage == "CANCELED"
        provider.stop_container()  # idempotent: stays IDLE
        assert provider.phase is Phase.IDLE


def test_a_stop_during_the_start_leaves_stopping_until_the_start_returns_then_a_new_start_is_allowed(proxy):
    with JobsEmulator(scheduling_delay_s=30.0) as emu:
        provider = provider_on(emu, proxy)
        thread, outcome = in_thread(provider.start_container)
        wait_until(lambda: provider.phase is Phase.STARTING, "the job to be recorded")
        job_id = provider.job_id
        provider.stop_container()
        thread.join(TIMEOUT)
        assert isinstance(outcome[0], hsp.SandboxError) and "stop_container" in str(outcome[0])
        assert provider.phase is Phase.IDLE
        assert emu.wait_for_stage(job_id, ["CANCELED"]).stage == "CANCELED"
        # nothing is held any more: the same provider may start again, and a second start is refused meanwhile
        thread, outcome = in_thread(provider.start_container)
        wait_until(lambda: provider.phase is Phase.STARTING, "the second job to be recorded")
        with pytest.raises(hsp.SandboxError, match="already runs job"):
            provider.start_container()
        provider.stop_container()
        thread.join(TIMEOUT)
        assert isinstance(outcome[0], hsp.SandboxError) and provider.phase is Phase.IDLE


def test_a_phase_change_off_the_table_is_refused_naming_both_phases():
    provider = hsp.HFSandboxProvider(IMAGE)
    with pytest.raises(hsp.SandboxError, match="IDLE cannot move to RUNNING"):
        provider._move(Phase.RUNNING)
    assert provider.phase is Phase.IDLE


def test_every_phase_change_of_a_replicated_start_and_stop_is_on_the_table(emu, proxy):
    """All K replica providers and their owner walk only the allowed moves (a refused move would raise)."""
    provider = provider_on(emu, proxy, replicas=2)
    provider.wait_for_ready(provider.start_container())
    replicas = provider._replicas.children
    assert provider.phase is Phase.RUNNING and [r.phase for r in replicas] == [Phase.RUNNING] * 2
    assert all(type(replica) is hsp.HFSandboxProvider for replica in replicas)  # built by the constructor
    provider.stop_container()
    assert provider.phase is Phase.IDLE and [r.phase for r in replicas] == [Phase.IDLE] * 2
    assert provider.stage == "CANCELED" and len(provider.job_ids) == 2


class CountingSessions(hsp.HFSandboxProvider):
    """Counts the Jobs API answers its sessions receive, through the documented `_new_session` hook."""

    answers = []

    def _new_session(self):
        session = super()._new_session()
        session.hooks["response"].append(lambda response, *a, **k: self.answers.append(response.request.method))
        return session


def test_replica_jobs_use_their_owners_hooks(emu, proxy):
    CountingSessions.answers = []
    provider = provider_on(emu, proxy, cls=CountingSessions, replicas=3)
    try:
        provider.start_container()
        assert CountingSessions.answers.count("POST") == 3  # each replica's create went through the hook
    finally:
        provider.stop_container()
    assert CountingSessions.answers.count("POST") == 6  # and each cancel


class WithRole(hsp.HFSandboxProvider):
    _pickled_settings = hsp.HFSandboxProvider._pickled_settings + ("role",)

    def __init__(self, *args, role="learner", **kwargs):
        super().__init__(*args, **kwargs)
        self.role = role
        self.scratch = object()  # not a setting: never pickled


def test_pickling_carries_exactly_the_allowlisted_settings():
    provider = WithRole(IMAGE, flavor="t4-small", labels={"team": "rl"}, role="actor", token="hf_" + "x" * 20)
    state = provider.__getstate__()
    assert set(state) == set(WithRole._pickled_settings)
    clone = pickle.loads(pickle.dumps(provider))
    assert (clone.role, clone.flavor, clone.labels, clone._token) == ("actor", "t4-small", {"team": "rl"}, provider._token)
    assert not hasattr(clone, "scratch") and clone.phase is Phase.IDLE and clone.job_id is None
    assert clone._lock is not provider._lock


# Where a stop lands relative to the start it races: before the create answers, while the job is
# recorded but not serving, after the start returned, after the readiness wait.
STOP_POINTS = ["submitting", "starting", "running", "ready"]


@pytest.mark.slow  # twelve start/stop cycles, some waiting out Retry-After
def test_a_sequence_of_starts_each_stopped_at_a_different_point_leaves_nothing_behind(proxy):
    """One provider, reused: every cycle ends IDLE with its job cancelled and no route left, whatever
    the previous cycle's stop interrupted (bugs live in what the previous start left behind)."""
    with JobsEmulator(scheduling_delay_s=0.3) as emu:
        provider = provider_on(emu, proxy)
        seen_jobs = []
        for cycle, point in enumerate(STOP_POINTS * 2):
            creates = emu.api_calls.get("create", 0)
            if point == "submitting":  # the create is answered 429: the start waits 1 s in SUBMITTING
                emu.inject_rate_limit(1, retry_after_s=1, routes=["create"])
            thread, outcome = in_thread(lambda: provider.wait_for_ready(provider.start_container()))
            if point == "submitting":
                wait_until(lambda: emu.api_calls.get("create", 0) > creates, "the refused create")
                assert provider.phase is Phase.SUBMITTING
            elif point == "starting":
                wait_until(lambda: provider.phase is Phase.STARTING, "the job to be recorded")
            elif point == "running":
                wait_until(lambda: provider.phase is Phase.RUNNING, "the start to return")
            else:
                thread.join(TIMEOUT)
                assert outcome == [None], outcome
            provider.stop_container()
            thread.join(TIMEOUT)
            assert not thread.is_alive()
            assert provider.phase is Phase.IDLE, (cycle, point)
            assert provider.base_url is None
            with proxy._lock:
                assert proxy._routes == {}, (cycle, point)
            if provider.job_id:
                seen_jobs.append(provider.job_id)
        wait_until(lambda: all(job.terminal for job in emu.jobs) and emu.live_pids() == [], "every job to end")
        assert {emu.job(job_id).stage for job_id in seen_jobs} <= {"CANCELED"}
        assert len(emu.jobs) >= len(seen_jobs) and all(job.stage == "CANCELED" for job in emu.jobs)
