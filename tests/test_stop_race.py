"""`stop_container()` from another thread while `start_container()` is in flight: whatever point the stop
lands on (create in flight, create answer lost and the job found by its start label, job recorded but
not serving), the start raises a clear error, the stop returns only once the start has let go, and no
job is left running. Checked against the real local Jobs emulator over many randomised iterations."""

from __future__ import annotations

import random
import threading
import time

import pytest

import hf_sandbox_provider as hsp
from hf_jobs_emulator import JobsEmulator, echo_server_command
from hf_sandbox_provider import Phase
from support import wait_until

IMAGE = "registry.hf.space/openenv-echo-env:latest"
# Enough iterations that a 1-in-10 leak shows up with near certainty (0.9 ** 60 < 0.2 %).
ITERATIONS = 60
JOIN_TIMEOUT_S = 60


class Recording(hsp.HFSandboxProvider):
    """Records every phase change (through the one setter), to tell a start the stop interrupted from one
    that had already returned when the stop came."""

    def _move(self, phase):
        previous = super()._move(phase)
        self.moves.append((previous, phase))
        return previous


def _stop_mid_start(emu: JobsEmulator, proxy, rng: random.Random, lose_create: bool, replicas: int = 1) -> dict:
    """One iteration: begin a start, stop it at a random moment after it was claimed, and report."""
    if lose_create:
        emu.lose_next_create_responses(1)  # the job is made, its answer never comes: found by label
    provider = Recording(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=proxy,
                         command=echo_server_command(), poll_interval_s=0.05, replicas=replicas)
    provider.moves = []
    outcome: list = []

    def start() -> None:
        try:
            outcome.append(provider.start_container())
        except BaseException as exc:  # recorded for the test to inspect
            outcome.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    wait_until(lambda: provider.phase is not Phase.IDLE or outcome, "the start to be claimed")
    time.sleep(rng.choice([0.0, rng.uniform(0, 0.005), rng.uniform(0, 0.05), rng.uniform(0, 0.3)]))
    provider.stop_container()
    # stop_container() has returned: the start has ended and every job it made is cancelled already.
    phase_after_stop = provider.phase
    live = [job.id for job in emu.jobs if not job.terminal and job._stop_reason is None]
    thread.join(JOIN_TIMEOUT_S)
    # at once, not after the other iterations: a stuck start would make each of them wait out every bound
    assert not thread.is_alive(), "the start thread outlived its stop by %ss: %s" % (JOIN_TIMEOUT_S, provider.moves)
    leaked = [job.id for job in emu.jobs if not job.terminal and job._stop_reason is None]  # after the start too
    return {"phase": phase_after_stop, "live": live, "leaked": leaked, "outcome": outcome, "alive": thread.is_alive(),
            "stopped_running": provider.moves[-1:] == [(Phase.RUNNING, Phase.IDLE)]}


def _assert_no_job_outlived_its_stop(emu: JobsEmulator, results: list) -> None:
    leaked = [r["live"] for r in results if r["live"]]
    assert leaked == [], "jobs left running after stop_container() returned: %s" % leaked
    assert [r for r in results if r["alive"] or r["phase"] is not Phase.IDLE] == []
    for result in results:  # a URL only from a start that had returned before the stop came
        (answer,) = result["outcome"]
        if result["stopped_running"]:
            assert isinstance(answer, str), answer
        else:
            assert isinstance(answer, hsp.SandboxError) and "stop_container() was called" in str(answer), answer
    wait_until(lambda: all(job.terminal for job in emu.jobs), "every job to end")
    assert all(job.stage == "CANCELED" for job in emu.jobs)
    assert emu.live_pids() == []


@pytest.mark.slow
def test_a_stop_racing_a_start_at_random_points_leaves_no_job_running_and_the_start_raises(proxy):
    rng = random.Random(1111)
    with JobsEmulator(scheduling_delay_s=0.1) as emu:
        results = [_stop_mid_start(emu, proxy, rng, lose_create=i % 3 == 0) for i in range(ITERATIONS)]
        _assert_no_job_outlived_its_stop(emu, results)
        assert sum(not r["stopped_running"] for r in results) > ITERATIONS // 2  # most stops land mid-start


@pytest.mark.slow
def test_a_stop_racing_a_replicated_start_cancels_every_replica_before_it_returns(proxy):
    rng = random.Random(2222)
    with JobsEmulator(scheduling_delay_s=0.1) as emu:
        results = [_stop_mid_start(emu, proxy, rng, lose_create=i % 3 == 0, replicas=2)
                   for i in range(ITERATIONS // 4)]
        _assert_no_job_outlived_its_stop(emu, results)


class SlowToTearDown(hsp.HFSandboxProvider):
    """Holds the teardown of a failed readiness wait (a descheduled thread) until the test lets it go."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held, self.go = threading.Event(), threading.Event()

    def _teardown(self, *args, **kwargs):
        if threading.current_thread().name == "old-wait":
            self.held.set()
            self.go.wait(JOIN_TIMEOUT_S)
        super()._teardown(*args, **kwargs)


def test_a_readiness_wait_ended_by_a_stop_does_not_tear_down_the_start_made_after_that_stop(proxy):
    with JobsEmulator() as emu:
        slow_boot = ["sh", "-c", "sleep 30; exec " + " ".join(echo_server_command())]
        provider = SlowToTearDown(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=proxy, command=slow_boot,
                                  poll_interval_s=0.05)
        try:
            provider.start_container()
            first_job, outcome = provider.job_id, []
            waiter = threading.Thread(name="old-wait", target=lambda: outcome.append(
                pytest.raises(hsp.SandboxError, provider.wait_for_ready)))
            waiter.start()
            wait_until(lambda: provider._watch is not None, "the wait to begin")
            provider.stop_container()  # the old wait fails and its teardown is held
            wait_until(provider.held.is_set, "the old wait's teardown")
            provider.command = echo_server_command()
            base_url = provider.start_container()  # the same provider, restarted by another thread
            provider.go.set()
            waiter.join(JOIN_TIMEOUT_S)
            assert "stop_container() was called" in str(outcome[0].value)
            provider.wait_for_ready(base_url, timeout_s=30)  # before the fix: the old wait had stopped this start
            assert emu.job(provider.job_id).stage == "RUNNING" and emu.job(first_job).stage == "CANCELED"
        finally:
            provider.go.set()
            provider.stop_container()
        assert emu.wait_for_stage(provider.job_id, ["CANCELED"]).stage == "CANCELED"


class StoppedAsItSeesTheCrash(hsp.HFSandboxProvider):
    """Has a stop requested from another thread (as start_many's abort does after another start failed) the
    moment its start first sees its job crashed, before the start acts on it."""

    def _observe(self, job):
        stage = super()._observe(job)
        if stage == "ERROR" and not self.stoppers:
            self.stoppers.append(threading.Thread(target=self.stop_container))
            self.stoppers[0].start()
            wait_until(lambda: self.phase is Phase.STOPPING, "the stop to be requested")
        return stage


def test_a_start_whose_job_crashed_reports_the_crash_with_its_logs_even_when_a_stop_came_first(proxy):
    # no-url: the start waits for the crash, whatever the load (a URL published before it would end the start)
    with JobsEmulator(faults={"crash-at-boot": "boom: out of memory", "no-url": "true"}) as emu:
        provider = StoppedAsItSeesTheCrash(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=proxy,
                                           command=echo_server_command(), poll_interval_s=0.05)
        provider.stoppers = []
        try:
            with pytest.raises(hsp.SandboxError) as info:
                provider.start_container()
        finally:
            provider.stop_container()
        provider.stoppers[0].join(JOIN_TIMEOUT_S)
        # before: "stop_container() was called while job ... was starting", and start_many counted it as aborted
        assert isinstance(info.value, hsp.JobFailedError), info.value
        assert info.value.stage == "ERROR" and "boom: out of memory" in str(info.value)
        assert provider.phase is Phase.IDLE and emu.job(provider.job_id).stage == "ERROR"
