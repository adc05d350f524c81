"""HFSandboxProvider(replicas=K): K jobs of one image behind one replica route, on the real Jobs
emulator (real job processes, real sockets, real WebSocket clients); nothing of ours mocked."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import pickle
import sys
import threading
import uuid

import pytest
import requests

import hf_sandbox_provider as hsp
from hf_jobs_emulator import JobsEmulator, echo_server_command
from support import in_thread, wait_until, ws_connect, ws_url

IMAGE = "registry.hf.space/openenv-echo-env:latest"
TIMEOUT = 30
# A job whose server never answers /health.
NEVER_READY = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def warm_emu(emu, proxy):
    """The emulator after one job ran: its lazily started helpers (zygote, health prober) exist, so a
    leak check that starts after this sees only what the test itself leaves behind."""
    provider = replicated(emu, proxy, replicas=1)
    provider.wait_for_ready(provider.start_container())
    provider.stop_container()
    wait_until(lambda: all_jobs_gone(emu), "the warm-up job to end")
    return emu


def replicated(emu, proxy, cls=hsp.HFSandboxProvider, **kwargs):
    options = dict(endpoint=emu.endpoint, token=emu.token, proxy=proxy, command=echo_server_command(),
                   poll_interval_s=0.05, replicas=3)
    options.update(kwargs)
    return cls(IMAGE, **options)


def mounted_routes(proxy):
    with proxy._lock:
        return len(proxy._routes)


def open_sessions(provider):
    return [entry["open_sessions"] for entry in provider.replica_status()]


def all_jobs_gone(emu):
    return all(job.terminal for job in emu.jobs) and emu.live_pids() == []


@contextlib.contextmanager
def sessions(base_url, n):
    """n open WebSocket sessions on the route, each reset once; closed on exit."""
    with contextlib.ExitStack() as stack:
        opened = []
        for _ in range(n):
            ws = stack.enter_context(ws_connect(ws_url(base_url) + "/ws"))
            ws.send(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(ws.recv(timeout=TIMEOUT))["type"] == "observation"
            opened.append(ws)
        yield opened


def step(ws, message):
    ws.send(json.dumps({"type": "step", "data": {"message": message}}))
    reply = json.loads(ws.recv(timeout=TIMEOUT))
    assert reply["type"] == "observation", reply
    return reply["data"]


def state(ws):
    ws.send(json.dumps({"type": "state"}))
    return json.loads(ws.recv(timeout=TIMEOUT))["data"]


class CrashOneReplica(hsp.HFSandboxProvider):
    """Replica 1's job crashes at boot (an emulator fault on that job only)."""

    def _replica_settings(self, index, settings):
        if index == 1:
            settings = dict(settings, env_vars={**settings["env_vars"], "HF_JOBS_EMULATOR_CRASH_AT_BOOT": "replica 1 boom"})
        return settings


class OneReplicaNeverReady(hsp.HFSandboxProvider):
    """Replica 2 runs a server that never answers /health; the others are ready at once."""

    def _replica_settings(self, index, settings):
        return dict(settings, command=NEVER_READY) if index == 2 else settings


# -- start, readiness, sessions -----------------------------------------------------------------------


def test_three_replicas_start_behind_one_route_with_every_job_id_and_stage(emu, proxy):
    provider = replicated(emu, proxy)
    try:
        provider.wait_for_ready(provider.start_container())
        base_url = provider.base_url
        assert base_url.startswith(proxy.url + "/")
        assert len(provider.job_ids) == 3 and len(set(provider.job_ids)) == 3
        assert provider.job_id == provider.job_ids[0]
        assert sorted(provider.job_ids) == sorted(job.id for job in emu.jobs)
        assert provider.stage == "RUNNING"
        assert set(provider.timings) == {"created", "running", "url", "ready"}
        status = provider.replica_status()
        assert [entry["index"] for entry in status] == [0, 1, 2]
        assert [entry["job_id"] for entry in status] == provider.job_ids
        assert all(entry["healthy"] and entry["stage"] == "RUNNING" and entry["reason"] is None for entry in status)
        assert len({entry["upstream"] for entry in status}) == 3
        assert "job_ids=" in repr(provider) and emu.token not in repr(provider)
    finally:
        provider.stop_container()


@pytest.mark.slow  # waits out a 1 s ready timeout
def test_wait_for_ready_checks_every_jobs_own_health_and_fails_all_when_one_never_answers(emu, proxy, log_guard):
    provider = replicated(emu, proxy, cls=OneReplicaNeverReady, ready_timeout_s=1.0)
    provider.start_container()
    job_ids = provider.job_ids
    # The replicated URL answers /health from a live replica (two are ready); only per-job checks
    # can see that replica 2 never answers.
    with pytest.raises(hsp.ReplicaStartError) as caught:
        provider.wait_for_ready()
    error = caught.value
    assert [index for index, _ in error.errors] == [2]
    assert isinstance(error.errors[0][1], hsp.JobStartTimeout)
    assert error.errors[0][1].job_id == job_ids[2]
    assert "replica 2" in str(error) and sorted(error.job_ids) == sorted(job_ids)
    assert provider.base_url is None
    wait_until(lambda: all_jobs_gone(emu), "every replica job to end")
    assert {emu.job(job_id).stage for job_id in job_ids} == {"CANCELED"}
    assert mounted_routes(proxy) == 0


def test_websocket_sessions_go_to_the_replica_with_fewest_sessions_and_stay_isolated(emu, proxy):
    provider = replicated(emu, proxy)
    try:
        provider.wait_for_ready(provider.start_container())
        with sessions(provider.base_url, 6) as opened:
            assert open_sessions(provider) == [2, 2, 2]
            for count, ws in enumerate(opened, start=1):
                for _ in range(count):
                    step(ws, "x")
            assert [state(ws)["step_count"] for ws in opened] == [1, 2, 3, 4, 5, 6]  # one env per session
        wait_until(lambda: open_sessions(provider) == [0, 0, 0], "every session to close")
        with sessions(provider.base_url, 1):  # a lone session lands on one replica
            assert sorted(open_sessions(provider)) == [0, 0, 1]
    finally:
        provider.stop_container()


def test_http_reset_on_the_replicated_url_is_refused_409_while_health_passes(emu, proxy):
    provider = replicated(emu, proxy)
    try:
        provider.wait_for_ready(provider.start_container())
        with requests.Session() as http:
            refused = http.post(provider.base_url + "/reset", json={}, timeout=TIMEOUT)
            assert refused.status_code == 409
            assert refused.headers["X-Proxy-Error"] == "replicated-http-refused"
            assert http.get(provider.base_url + "/health", timeout=TIMEOUT).status_code == 200
    finally:
        provider.stop_container()


# -- a replica that dies ----------------------------------------------------------------------------


def test_a_killed_replica_leaves_rotation_new_sessions_go_to_the_others_and_status_names_its_job(
        emu, proxy, log_guard):
    provider = replicated(emu, proxy)
    try:
        provider.wait_for_ready(provider.start_container())
        dead = provider.job_ids[0]
        with sessions(provider.base_url, 3):
            assert open_sessions(provider) == [1, 1, 1]
            emu.kill_job(dead)
            emu.wait_for_stage(dead, ["ERROR"])
            wait_until(lambda: provider.replica_status()[0]["open_sessions"] == 0, "the dead job's session to end")
            # The dead replica has the fewest sessions: the proxy tries it, takes it out and retries.
            with sessions(provider.base_url, 4):
                status = provider.replica_status()
                assert [entry["open_sessions"] for entry in status] == [0, 3, 3]
        assert status[0]["job_id"] == dead and status[0]["stage"] == "ERROR"
        assert status[0]["healthy"] is False and "ERROR" in status[0]["reason"]
        assert all(entry["healthy"] and entry["stage"] == "RUNNING" for entry in status[1:])
        assert provider.stage == "RUNNING"  # the route still serves
        assert len(proxy.replica_status(provider.base_url)) == 2  # removed from the route for good
        warnings = [line for line in log_guard.text().splitlines() if "WARNING" in line and dead in line]
        assert any("taken out of rotation" in line for line in warnings)
    finally:
        provider.stop_container()
    wait_until(lambda: all_jobs_gone(emu), "every job to end")


def test_status_refresh_finds_a_dead_replica_before_any_session_tried_it(emu, proxy, log_guard):
    provider = replicated(emu, proxy)
    try:
        provider.wait_for_ready(provider.start_container())
        dead = provider.job_ids[1]
        emu.kill_job(dead)
        emu.wait_for_stage(dead, ["ERROR"])
        assert provider.replica_status()[1]["stage"] == "RUNNING"  # no API call without refresh or a failure
        status = provider.replica_status(refresh=True)
        assert status[1]["stage"] == "ERROR" and status[1]["healthy"] is False
        with sessions(provider.base_url, 4):
            assert [entry["open_sessions"] for entry in provider.replica_status()] == [2, 0, 2]
        assert any("WARNING" in line and dead in line for line in log_guard.text().splitlines())
    finally:
        provider.stop_container()


# -- all or nothing, teardown -----------------------------------------------------------------------


def test_one_replica_crashing_at_boot_cancels_every_job_and_leaves_no_route(emu, proxy):
    provider = replicated(emu, proxy, cls=CrashOneReplica)
    with pytest.raises(hsp.ReplicaStartError) as caught:
        provider.wait_for_ready(provider.start_container())
    error = caught.value
    assert [index for index, _ in error.errors] == [1]
    failure = error.errors[0][1]
    assert isinstance(failure, hsp.JobFailedError) and failure.stage == "ERROR"
    assert "replica 1 boom" in str(failure)
    assert len(error.job_ids) == 3 and "replica 1" in str(error)
    wait_until(lambda: all_jobs_gone(emu), "every replica job to end")
    assert len(emu.jobs) == 3
    assert mounted_routes(proxy) == 0
    assert provider.base_url is None and provider.stage == "ERROR"
    provider.stop_container()  # still safe


def test_stop_cancels_every_replica_job_unmounts_every_route_and_is_idempotent(no_leaks, warm_emu, proxy):
    emu = warm_emu
    provider = replicated(emu, proxy)
    provider.wait_for_ready(provider.start_container())
    base_url, job_ids = provider.base_url, provider.job_ids
    assert mounted_routes(proxy) == 4  # the replica route and each job's own route
    with pytest.raises(TypeError, match="running"):
        pickle.dumps(provider)
    provider.stop_container()
    provider.stop_container()
    assert provider.base_url is None and provider.stage == "CANCELED"
    assert mounted_routes(proxy) == 0
    assert requests.get(base_url + "/health", timeout=TIMEOUT).status_code == 404
    wait_until(lambda: all_jobs_gone(emu), "every replica job to end")
    assert {emu.job(job_id).stage for job_id in job_ids} == {"CANCELED"}
    assert mounted_routes(proxy) == 0
    assert pickle.loads(pickle.dumps(provider)).replicas == 3  # stopped: pickles again


def test_stop_from_another_thread_while_replicas_schedule_cancels_every_job(proxy, log_guard):
    with JobsEmulator(scheduling_delay_s=1.0) as emu:
        log_guard.watch(emu.token)
        provider = replicated(emu, proxy)
        starter, outcome = in_thread(provider.start_container)
        try:
            wait_until(lambda: len(emu.jobs) == 3, "three creates")
            provider.stop_container()
            starter.join(TIMEOUT)
            assert not starter.is_alive()
            assert isinstance(outcome[0], hsp.SandboxError) and "stop_container" in str(outcome[0])
        finally:
            provider.stop_container()
        wait_until(lambda: all_jobs_gone(emu), "every replica job to end")
        assert {job.stage for job in emu.jobs} == {"CANCELED"}
        assert mounted_routes(proxy) == 0


def test_a_collected_replica_provider_cancels_every_job_and_unmounts_its_route(emu, proxy, log_guard):
    provider = replicated(emu, proxy)
    provider.start_container()
    job_ids = provider.job_ids
    del provider
    gc.collect()
    wait_until(lambda: all_jobs_gone(emu), "every replica job to end")
    assert {emu.job(job_id).stage for job_id in job_ids} == {"CANCELED"}
    assert mounted_routes(proxy) == 0
    assert all(job_id in log_guard.text() for job_id in job_ids)


class FirstCrashesOthersHang(hsp.HFSandboxProvider):
    """For start_many: environment 0's replica 0 crashes at boot; every other replica never gets ready."""

    made = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.role, FirstCrashesOthersHang.made = FirstCrashesOthersHang.made, FirstCrashesOthersHang.made + 1

    def _replica_settings(self, index, settings):
        if self.role == 0 and index == 0:
            return dict(settings, env_vars={**settings["env_vars"], "HF_JOBS_EMULATOR_CRASH_AT_BOOT": "env 0 boom"})
        return dict(settings, command=NEVER_READY)


def test_start_many_of_replicated_providers_aborts_the_waiting_ones_when_one_fails(emu, proxy):
    FirstCrashesOthersHang.made = 0
    options = dict(endpoint=emu.endpoint, token=emu.token, proxy=proxy, poll_interval_s=0.05, replicas=2,
                   ready_timeout_s=300)  # the hanging replicas would wait this long if the abort were lost
    starter, outcome = in_thread(lambda: FirstCrashesOthersHang.start_many(2, IMAGE, progress=False, **options))
    starter.join(TIMEOUT)
    assert not starter.is_alive(), "the abort did not reach the replicas waiting for /health"
    error = outcome[0]
    assert isinstance(error, hsp.StartManyError)
    assert [index for index, _ in error.errors] == [0] and error.aborted == 1
    assert isinstance(error.errors[0][1], hsp.ReplicaStartError)
    wait_until(lambda: all_jobs_gone(emu), "every replica job to end")
    assert len(emu.jobs) == 4 and {job.stage for job in emu.jobs} <= {"CANCELED", "ERROR"}
    assert mounted_routes(proxy) == 0


def test_the_exit_hook_cancels_every_replica_job_and_unmounts_the_route(emu, proxy):
    provider = replicated(emu, proxy)
    provider.start_container()
    job_ids = provider.job_ids
    hsp._stop_everything_at_exit()
    wait_until(lambda: all_jobs_gone(emu), "every replica job to end")
    assert {emu.job(job_id).stage for job_id in job_ids} == {"CANCELED"}
    assert mounted_routes(proxy) == 0
    provider.stop_container()  # the provider learns nothing is left to cancel
    assert emu.api_calls.get("cancel", 0) == 3


# -- settings -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 2.0, "3", True, hsp.MAX_REPLICAS + 1])
def test_bad_replicas_value_is_refused_with_its_name_before_any_job(emu, proxy, bad):
    with pytest.raises(hsp.SandboxConfigError, match="replicas"):
        replicated(emu, proxy, replicas=bad)
    provider = replicated(emu, proxy, replicas=1)
    with pytest.raises(hsp.SandboxConfigError, match="replicas"):
        provider.start_container(replicas=bad)
    assert emu.jobs == []


def test_replicas_given_per_start_override_the_constructor(emu, proxy):
    provider = replicated(emu, proxy, replicas=1)
    try:
        provider.wait_for_ready(provider.start_container(replicas=2))
        assert len(provider.job_ids) == 2 and len(emu.jobs) == 2
    finally:
        provider.stop_container()


def test_replica_status_of_a_single_job_provider_says_to_use_stage_and_job_id(emu, proxy):
    provider = replicated(emu, proxy, replicas=1)
    try:
        provider.wait_for_ready(provider.start_container())
        assert provider.job_ids == [provider.job_id]
        with pytest.raises(hsp.SandboxError, match="replicas > 1"):
            provider.replica_status()
    finally:
        provider.stop_container()


def test_stop_landing_while_the_replica_route_is_mounted_leaves_no_route(emu, log_guard):
    """A stop_container() from another thread that runs just before mount_replicas() (after the
    replicas started) must not leave the replica route mounted."""
    holder, stoppers = [], []

    class StopBeforeMount(hsp._proxy.AuthProxy):
        def mount_replicas(self, upstreams, token, **kwargs):
            stopper = threading.Thread(target=holder[0].stop_container)
            stoppers.append(stopper)
            stopper.start()
            # The stop cancels the replica jobs, then waits for this start to end: once they are gone it
            # has done all it can before the mount (joining it would wait out its bounded wait).
            wait_until(lambda: all_jobs_gone(emu) or not stopper.is_alive(), "the stop to cancel the replicas")
            return super().mount_replicas(upstreams, token, **kwargs)

    with StopBeforeMount() as racing_proxy:
        provider = replicated(emu, racing_proxy, replicas=2)
        holder.append(provider)
        with pytest.raises(hsp.SandboxError, match="stop_container"):
            provider.start_container()
        assert mounted_routes(racing_proxy) == 0  # the failed start took its route down itself
        provider.stop_container()
        stoppers[0].join(TIMEOUT)
        assert not stoppers[0].is_alive()  # its wait ended with the start, not by timing out
    wait_until(lambda: all_jobs_gone(emu), "every replica job to end")


def test_replicas_keep_their_owners_choice_not_to_warn_about_credential_like_env_vars(emu, proxy, caplog):
    # Each replica is a provider of its own: built with the owner's warn_env_credentials=False, it
    # must not warn about the owner's environment either.
    name = "X_%s_SECRET" % uuid.uuid4().hex[:8].upper()
    provider = replicated(emu, proxy, replicas=2, env_vars={name: "1"}, warn_env_credentials=False)
    try:
        with caplog.at_level(logging.WARNING, logger="hf_sandbox_provider"):
            provider.start_container()
        assert len(provider.job_ids) == 2
    finally:
        provider.stop_container()
    assert "looks like a credential" not in caplog.text


def test_a_stop_that_outwaits_a_replica_start_names_each_replicas_label_and_never_a_label_of_none(emu, proxy, caplog,
                                                                                                   monkeypatch):
    # The group's owner has no start label of its own: its warning once told users to run
    # `sweep --label hf-sandbox-start=None`, which finds nothing while the replicas' late jobs bill.
    monkeypatch.setattr(hsp, "STOP_WAIT_S", 0.5)
    emu.delay_next_create_answers(2, 3.0)  # both creates in flight when the stop comes
    provider = replicated(emu, proxy, replicas=2)
    starter, outcome = in_thread(provider.start_container)
    wait_until(lambda: emu.api_calls.get("create", 0) == 2, "both replicas' creates in flight")
    with caplog.at_level(logging.WARNING, logger="hf_sandbox_provider"):
        provider.stop_container()
    starter.join(30)
    assert isinstance(outcome[0], hsp.SandboxError), outcome
    said = [r.getMessage() for r in caplog.records if "has not ended after" in r.getMessage()]
    assert not [m for m in said if "=None" in m], said
    assert len([m for m in said if "sweep --label hf-sandbox-start=" in m]) == 2, said  # one per replica
    wait_until(lambda: len(emu.jobs) == 2 and all(job.terminal for job in emu.jobs), "both late jobs cancelled")
