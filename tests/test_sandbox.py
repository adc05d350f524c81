"""`Sandbox`: starts begun in the background when an environment is built (so N of them overlap), shared
groups of `replicas=K` jobs that many environments open sessions on, and teardown that leaves no job
running whether a sandbox is stopped before, during or after its start."""

from __future__ import annotations

import pickle
import socket
import sys
import threading
import time
import traceback

import pytest

from hf_jobs_emulator import JobsEmulator, echo_server_command
from support import in_thread, wait_until
import hf_sandbox_provider as core
import proxy as proxy_module
from hf_sandbox_provider import (JobFailedError, JobStartTimeout, Sandbox, SandboxConfigError, SessionError,
                                 SessionRefusedError, stop_sandboxes)

SLOTS = 6
SCHEDULING_DELAY_S = 1.5
# Stop a sandbox this long after it began: before its create, during SCHEDULING, while RUNNING.
STOP_AFTER_S = (0.0, 0.01, 0.05, 0.3, 1.0, 2.5)


@pytest.fixture
def slow_emu(make_emu):
    """An emulator whose jobs wait SCHEDULING_DELAY_S before RUNNING, like a (short) cold start."""
    emulator = make_emu(scheduling_delay_s=SCHEDULING_DELAY_S)
    emulator.settings = dict(endpoint=emulator.endpoint, token=emulator.token, command=echo_server_command(),
                             poll_interval_s=0.1)
    yield emulator
    stop_sandboxes()


def all_ended(emu: JobsEmulator) -> None:
    for job in emu.jobs:
        assert emu.wait_for_stage(job.id, ["CANCELED", "ERROR", "COMPLETED"]).terminal, job


@pytest.mark.slow  # jobs wait SCHEDULING_DELAY_S before running
def test_sandboxes_built_together_start_together_and_each_waits_for_its_own_job(slow_emu) -> None:
    boxes = [Sandbox("img:tag", **slow_emu.settings) for _ in range(SLOTS)]
    for index, box in enumerate(boxes):  # what TRL does: reset slot after slot
        with box.session() as session:
            assert session.step({"message": "slot %d" % index})["observation"]["echoed_message"] == "slot %d" % index
    jobs = slow_emu.jobs
    assert sorted(j.id for j in jobs) == sorted(b.job_ids[0] for b in boxes)
    # Every create reached the emulator before the first job left SCHEDULING: the cold starts overlapped.
    assert max(j.created_mono for j in jobs) < min(j.started_mono for j in jobs)
    for box in boxes:
        box.stop()
    all_ended(slow_emu)


@pytest.mark.slow  # jobs wait SCHEDULING_DELAY_S before running
@pytest.mark.parametrize("delay", STOP_AFTER_S)
def test_a_sandbox_stopped_at_any_point_of_its_start_leaves_no_job(slow_emu, delay) -> None:
    box = Sandbox("img:tag", **slow_emu.settings)
    time.sleep(delay)
    box.stop()  # returns once the job (if it was created) is cancelled
    assert not box.ready and box.provider is None
    assert len(slow_emu.jobs) <= 1
    assert all(slow_emu.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED" for job in slow_emu.jobs)
    box.stop()  # idempotent
    box.begin()  # a stopped sandbox can start again
    assert box.wait(timeout_s=60).startswith("http://127.0.0.1:")
    box.stop()
    all_ended(slow_emu)


@pytest.mark.slow  # jobs wait SCHEDULING_DELAY_S before running
def test_a_start_that_fails_raises_in_the_waiting_environment_with_its_job_cancelled(slow_emu) -> None:
    box = Sandbox("img:tag", labels={"emulator-crash-at-boot": "boom-at-boot"}, **slow_emu.settings)
    with pytest.raises(JobFailedError, match="boom-at-boot"):
        box.session()
    with pytest.raises(JobFailedError):  # asked again: the same answer, no second job
        box.wait()
    assert len(slow_emu.jobs) == 1 and slow_emu.jobs[0].stage == "ERROR"
    with pytest.raises(JobStartTimeout, match="still starting"):
        Sandbox("img:tag", **slow_emu.settings).wait(timeout_s=0.05)  # bounded wait; the start goes on
    stop_sandboxes()
    all_ended(slow_emu)


@pytest.mark.slow  # jobs wait SCHEDULING_DELAY_S before running
def test_a_lazy_sandbox_starts_nothing_until_used_and_pickles_until_then(slow_emu) -> None:
    lazy = Sandbox("img:tag", begin=False, **slow_emu.settings)
    assert slow_emu.jobs == [] and lazy.provider is None and "not begun" in repr(lazy)
    copy = pickle.loads(pickle.dumps(lazy))
    with copy.session() as session:
        session.reset()
    assert len(slow_emu.jobs) == 1 and lazy.provider is None
    with pytest.raises(TypeError, match="begun its job"):
        pickle.dumps(copy)
    copy.stop()
    assert pickle.loads(pickle.dumps(copy)).provider is None  # stopped: settings only again
    all_ended(slow_emu)


def test_many_environments_share_a_few_jobs_each_with_its_own_session(slow_emu) -> None:
    boxes = [Sandbox("img:tag", shared="pool", replicas=2, **slow_emu.settings) for _ in range(SLOTS)]
    sessions = [box.session() for box in boxes]
    try:
        for index, session in enumerate(sessions):
            session.reset(episode_id="slot-%d" % index)
        for index, session in enumerate(sessions):
            for _ in range(index + 1):
                session.step({"message": "x"})
        states = [session.state() for session in sessions]
        assert [s["episode_id"] for s in states] == ["slot-%d" % i for i in range(SLOTS)]
        assert [s["step_count"] for s in states] == list(range(1, SLOTS + 1))  # no two slots share an episode
        assert len(slow_emu.jobs) == 2 and {tuple(b.job_ids) for b in boxes} == {tuple(boxes[0].job_ids)}
        assert [r["open_sessions"] for r in boxes[0].provider.replica_status()] == [SLOTS // 2, SLOTS // 2]
        copy = pickle.loads(pickle.dumps(boxes[0]))  # a shared handle pickles at any time
        assert copy.wait() == boxes[0].wait()  # and in this process it joins the same group
        with pytest.raises(SandboxConfigError, match="other settings"):
            Sandbox("img:tag", shared="pool", replicas=3, **slow_emu.settings)
        boxes[0].stop()  # one environment lets go: the group runs on for the others
        assert sessions[1].step({"message": "still"})["observation"]["echoed_message"] == "still"
    finally:
        for session in sessions:
            session.close()
    stop_sandboxes()
    all_ended(slow_emu)


@pytest.mark.slow  # jobs wait SCHEDULING_DELAY_S before running
def test_a_lost_shared_group_is_replaced_once_however_many_environments_ask(slow_emu) -> None:
    # renew=False: restart() by hand, as before slots renewed and replaced their jobs (tests/test_slots.py)
    boxes = [Sandbox("img:tag", shared="lost", replicas=2, renew=False, **slow_emu.settings) for _ in range(4)]
    sessions = [box.session() for box in boxes]
    for session in sessions:
        session.reset()
    old_jobs = list(boxes[0].job_ids)
    for job_id in old_jobs:
        slow_emu.kill_job(job_id)
        slow_emu.wait_for_stage(job_id, ["ERROR"])
    for session in sessions:
        with pytest.raises(SessionError):
            session.step({"message": "dead"})
    errors = []

    def replace(box: Sandbox) -> None:
        try:
            box.restart()
            with box.session() as session:
                session.reset()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=replace, args=(box,)) for box in boxes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(slow_emu.jobs) == 4  # the 2 lost ones and ONE replacement group of 2
    assert {tuple(box.job_ids) for box in boxes} == {tuple(j for j in boxes[0].job_ids)}
    assert not set(boxes[0].job_ids) & set(old_jobs)
    stop_sandboxes()
    all_ended(slow_emu)


@pytest.mark.slow  # jobs wait SCHEDULING_DELAY_S before running
def test_a_shared_group_with_one_live_job_is_kept_and_new_sessions_go_to_that_job(slow_emu) -> None:
    # renew=False: with it, a group that lost a job is renewed as a whole (tests/test_slots.py)
    boxes = [Sandbox("img:tag", shared="half", replicas=2, renew=False, **slow_emu.settings) for _ in range(2)]
    sessions = [box.session() for box in boxes]
    for session in sessions:
        session.reset()
    jobs = list(boxes[0].job_ids)
    victim = jobs[0]
    slow_emu.kill_job(victim)
    slow_emu.wait_for_stage(victim, ["ERROR"])
    try:
        for box, session in zip(boxes, sessions):
            try:
                session.step({"message": "probe"})
                continue  # this slot's session lives on the other job
            except SessionError:
                session.close()
            box.restart()  # one job still serves: the group is kept
            with box.session() as fresh:
                assert fresh.step({"message": "moved"})["observation"]["echoed_message"] == "moved"
        assert len(slow_emu.jobs) == 2 and boxes[0].job_ids == boxes[1].job_ids
    finally:
        for session in sessions:
            session.close()
    stop_sandboxes()
    all_ended(slow_emu)


@pytest.mark.slow  # jobs wait SCHEDULING_DELAY_S before running
def test_restart_keeps_a_single_job_group_whose_job_serves_and_the_others_episodes_go_on(slow_emu) -> None:
    # With replicas=1 (the default) restart() replaced the group's job without asking whether it served:
    # every other environment of the group lost its episode to one environment's own timeout.
    boxes = [Sandbox("img:tag", shared="one", **slow_emu.settings) for _ in range(2)]
    sessions = [box.session() for box in boxes]
    try:
        for session in sessions:
            session.reset()
        job = boxes[0].job_ids[0]
        boxes[1].restart()  # e.g. after its own SessionTimeout: the job still serves
        assert sessions[0].step({"message": "goes on"})["observation"]["echoed_message"] == "goes on"
        assert boxes[0].job_ids == boxes[1].job_ids == [job] and len(slow_emu.jobs) == 1
        slow_emu.kill_job(job)
        slow_emu.wait_for_stage(job, ["ERROR"])
        boxes[1].restart()  # now none serves: the group is replaced
        with boxes[1].session() as fresh:
            assert fresh.step({"message": "moved"})["observation"]["echoed_message"] == "moved"
        assert boxes[0].job_ids == boxes[1].job_ids != [job]
    finally:
        for session in sessions:
            session.close()
    stop_sandboxes()
    all_ended(slow_emu)


@pytest.mark.slow  # jobs wait SCHEDULING_DELAY_S before running
def test_stop_sandboxes_cancels_own_shared_and_in_flight_starts_in_one_call(slow_emu) -> None:
    ready = Sandbox("img:tag", **slow_emu.settings)
    ready.wait()
    shared = Sandbox("img:tag", shared="all", replicas=2, **slow_emu.settings)
    shared.wait()
    starting = [Sandbox("img:tag", **slow_emu.settings) for _ in range(3)]
    stop_sandboxes()
    assert not any(box.ready for box in starting)
    assert all(job.stage == "CANCELED" or slow_emu.wait_for_stage(job.id, ["CANCELED"]) for job in slow_emu.jobs)
    assert len(slow_emu.jobs) <= 6
    all_ended(slow_emu)


def test_bad_settings_and_a_missing_token_fail_at_construction(monkeypatch, tmp_path) -> None:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(SandboxConfigError, match="no Hugging Face token"):
        Sandbox("img:tag")
    with pytest.raises(SandboxConfigError, match="shared="):
        Sandbox("img:tag", shared="", token="hf_x")
    with pytest.raises(SandboxConfigError, match="proxy="):
        Sandbox("img:tag", proxy=object(), token="hf_x")
    with pytest.raises(SandboxConfigError, match="flavor"):
        Sandbox("img:tag", flavor="no-such-flavor", token="hf_x")


@pytest.mark.slow  # a reset retries for seconds at the proxy's cap
def test_a_reset_the_proxy_refuses_as_busy_waits_and_retries_and_never_replaces_the_healthy_job(
        make_emu, monkeypatch) -> None:
    # Any X-Proxy-Error made the slot report its job dead: the proxy shedding load (503 proxy-busy, "retry
    # shortly") got a healthy shared job cancelled and replaced, and every other session lost its episode.
    monkeypatch.setattr(proxy_module, "MAX_WORKERS", 8)  # filled below: a session holds two, an idle connection one
    monkeypatch.setattr(core, "_shared_proxies", {})  # this test's own process-wide proxy, made with that cap
    emu = make_emu()
    idle: list = []
    try:
        settings = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command(), poll_interval_s=0.1)
        boxes = [Sandbox("img:tag", shared="busy", **settings) for _ in range(3)]
        sessions = [box.session() for box in boxes]
        try:
            for session in sessions[:2]:
                session.reset()
            job = boxes[0].job_ids[0]
            idle.extend(_fill_the_proxy(core._shared_proxies[None].port))
            with pytest.raises(SessionRefusedError, match="proxy-busy.*retry shortly") as refused:
                sessions[2].reset()  # busy at each of its attempts
            assert refused.value.proxy_error == "proxy-busy"
            freed = [idle.pop(), idle.pop()]  # a session's two workers, freed while the reset retries
            closer = threading.Timer(1.5, lambda: [sock.close() for sock in freed])
            closer.start()
            assert sessions[2].reset()["observation"]["echoed_message"]
            closer.join()
            assert sessions[0].step({"message": "still here"})["observation"]["echoed_message"] == "still here"
            assert boxes[0].job_ids == [job] and emu.job(job).stage == "RUNNING" and len(emu.jobs) == 1
        finally:
            for session in sessions:
                session.close()
            stop_sandboxes()
    finally:
        for sock in idle:
            sock.close()
        for proxy in core._shared_proxies.values():
            proxy.stop()
    all_ended(emu)


def _fill_the_proxy(port: int) -> list:
    """Idle connections to the proxy, each holding one of its worker threads, until one is refused (503)."""
    held = []
    for _ in range(proxy_module.MAX_WORKERS + 1):
        sock = socket.create_connection(("127.0.0.1", port), timeout=0.3)
        try:
            answer = sock.recv(64)  # an accepted connection waits silently for its request
        except socket.timeout:
            held.append(sock)
            continue
        sock.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        return held
    raise AssertionError("the proxy never refused a connection")


def test_threads_using_a_lazy_sandbox_at_once_begin_one_job_and_its_stop_leaves_none_running(make_emu) -> None:
    # Sandbox.begin() checked, then set, its slot without a lock: threads at a begin=False sandbox's first use
    # each began a slot and a job, the sandbox kept the last, and its stop() left the others running.
    emu = make_emu()
    settings = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command(), poll_interval_s=0.1)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # more switches between threads: the race, if any, shows sooner
    try:
        for trial in range(40):
            box = Sandbox("img:tag", begin=False, labels={"trial": str(trial)}, **settings)
            barrier = threading.Barrier(4)
            users = [threading.Thread(target=lambda: (barrier.wait(), box.begin())) for _ in range(4)]
            for user in users:
                user.start()
            for user in users:
                user.join(30)
            box.stop()
            mine = [job for job in emu.jobs if (job.spec.get("labels") or {}).get("trial") == str(trial)]
            assert len(mine) <= 1, "trial %d: %d jobs for one sandbox" % (trial, len(mine))
    finally:
        sys.setswitchinterval(interval)
        stop_sandboxes()
    all_ended(emu)


@pytest.mark.slow  # jobs wait SCHEDULING_DELAY_S before running
def test_close_while_a_reset_waits_for_the_slots_job_fails_that_reset_and_holds_no_job(slow_emu) -> None:
    # The reset went on after close(): it opened a connection on the closed session and counted the job as
    # used, so the job, once retired, was never cancelled before its lifetime ended.
    box = Sandbox("img:tag", **slow_emu.settings)
    session = box.session()
    session.reset()
    box.restart()  # a new job, starting: the next reset waits for it
    thread, outcome = in_thread(session.reset)
    time.sleep(0.5)
    session.close()
    thread.join(30)
    assert isinstance(outcome[0], SessionError) and "closed" in str(outcome[0]), outcome
    assert session._conn is None and (session._job is None or session._job.users == 0)
    stop_sandboxes()
    all_ended(slow_emu)


def test_close_wakes_a_reset_waiting_for_a_cold_start_at_once_and_opens_no_connection(make_emu) -> None:
    # close() set a flag the waiting reset read only once the job was ready (a whole cold start later, minutes
    # on a GPU flavor), and that reset then opened a WebSocket session only to close it.
    emu = make_emu()
    box = Sandbox("img:tag", endpoint=emu.endpoint, token=emu.token, command=echo_server_command(),
                  poll_interval_s=0.1)
    try:
        session = box.session()
        session.reset()
        emu.default_faults["scheduling-delay-s"] = "60"  # the next job's cold start outlasts the test
        box.restart()
        thread, outcome = in_thread(session.reset)
        wait_until(lambda: len(emu.jobs) == 2 and session._lock.locked(), "the reset to wait for the new job")
        time.sleep(0.2)
        closed_at = time.monotonic()
        session.close()
        thread.join(30)
        assert time.monotonic() - closed_at < 10  # not the 60 s cold start
        assert isinstance(outcome[0], SessionError) and "closed" in str(outcome[0]), outcome
        assert session._conn is None and emu.jobs[1].stage == "SCHEDULING"
    finally:
        stop_sandboxes()
    all_ended(emu)


def test_bad_wait_and_session_arguments_are_refused_naming_them_before_anything_starts(slow_emu) -> None:
    # They were checked after the cold start (timeout_s=0), or not at all (a TypeError from inside the wait).
    box = Sandbox("img:tag", begin=False, **slow_emu.settings)
    with pytest.raises(SandboxConfigError, match="timeout_s='5'"):
        box.wait(timeout_s="5")  # type: ignore[arg-type]
    with pytest.raises(SandboxConfigError, match="timeout_s=0"):
        box.session(timeout_s=0)
    with pytest.raises(SandboxConfigError, match="wait_timeout_s='5'"):
        box.session(wait_timeout_s="5")  # type: ignore[arg-type]
    with pytest.raises(SandboxConfigError, match="wait_timeout_s=-1"):
        box.session(wait_timeout_s=-1)
    assert slow_emu.jobs == [] and box.provider is None  # refused before the sandbox began
    with box.session(wait_timeout_s=60) as session:
        with pytest.raises(SandboxConfigError, match="mapping"):
            session.request("hi")  # type: ignore[arg-type]
        assert session.request({"type": "reset", "data": {}})["observation"]["echoed_message"]
    stop_sandboxes()
    all_ended(slow_emu)


def test_a_shared_group_accepts_equal_settings_whatever_the_order_of_a_dict_keyword(slow_emu) -> None:
    first = Sandbox("img:tag", shared="order", env_vars={"MAX_CONCURRENT_ENVS": "32", "MODE": "x"},
                    **slow_emu.settings)
    second = Sandbox("img:tag", shared="order", env_vars={"MODE": "x", "MAX_CONCURRENT_ENVS": "32"},
                     **slow_emu.settings)
    assert first.wait() == second.wait() and len(slow_emu.jobs) == 1
    with pytest.raises(SandboxConfigError, match="other settings"):  # a different value still differs
        Sandbox("img:tag", shared="order", env_vars={"MODE": "y", "MAX_CONCURRENT_ENVS": "32"}, **slow_emu.settings)
    stop_sandboxes()
    all_ended(slow_emu)


def test_a_failed_start_raised_again_and_again_keeps_a_traceback_of_one_size(make_emu) -> None:
    # The one stored exception was raised at each call, and CPython added each raise's frames to its
    # traceback: 605 entries after 200 calls, with every frame (and its locals) kept alive.
    emu = make_emu()
    box = Sandbox("img:tag", endpoint=emu.endpoint, token=emu.token, command=echo_server_command(),
                  poll_interval_s=0.1, labels={"emulator-crash-at-boot": "boom-at-boot"})
    sizes = []
    for _ in range(20):
        with pytest.raises(JobFailedError, match="boom-at-boot") as failed:
            box.wait()
        sizes.append(len(traceback.extract_tb(failed.value.__traceback__)))
    assert len(set(sizes)) == 1, sizes
    stop_sandboxes()
    all_ended(emu)


def test_resets_after_a_failed_first_start_raise_its_error_and_start_nothing_within_the_backoff(make_emu) -> None:
    # A reset that got a failed first start cleared it, so the next reset started another job at once.
    emu = make_emu()
    box = Sandbox("img:tag", endpoint=emu.endpoint, token=emu.token, command=echo_server_command(),
                  poll_interval_s=0.1)
    try:
        with box.session() as session:
            session.reset()
            emu.default_faults["crash-at-boot"] = "broken image"
            box.restart()  # a new slot whose first start fails
            for _ in range(10):  # well within the first 5 s of backoff
                with pytest.raises(JobFailedError, match="broken image"):
                    session.reset()
            assert len(emu.jobs) == 2  # the first job and the one failed start
    finally:
        stop_sandboxes()
    all_ended(emu)
