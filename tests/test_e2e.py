"""End to end, offline: HFSandboxProvider -> local Jobs emulator -> token gate -> job process, with the
echo server, every emulator fault, and the promise that each failure leaves no job process and no
proxy route behind."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import requests

import hf_jobs_emulator
import hf_sandbox_provider
from hf_jobs_emulator import JobsEmulator
from hf_sandbox_provider import START_LABEL_KEY, HFSandboxProvider, JobFailedError, JobStartTimeout
from proxy import AuthProxy
from support import wait_until
from test_cli import clean_env
from test_cli import run as run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 30  # generous: other work may load the 2 cores; passing tests never wait this long
IMAGE = "registry.hf.space/openenv-echo-env:latest"  # not pulled: the emulator runs the command
ECHO = hf_jobs_emulator.echo_server_command()
SLEEP_FOREVER = [sys.executable, "-c", "import time\nprint('booting forever', flush=True)\ntime.sleep(600)"]


def mounted_routes(proxy: AuthProxy) -> int:
    return len(proxy._routes)  # read-only look at the proxy's route table: nothing public counts them


def provider_for(emu: JobsEmulator, proxy: AuthProxy, **kwargs) -> HFSandboxProvider:
    settings = dict(endpoint=emu.endpoint, token=emu.token, command=ECHO, proxy=proxy,
                    poll_interval_s=0.05, start_timeout_s=TIMEOUT, ready_timeout_s=TIMEOUT)
    settings.update(kwargs)
    return HFSandboxProvider(IMAGE, **settings)


def assert_nothing_left(emu: JobsEmulator, proxy: AuthProxy) -> None:
    """No job process alive, every job terminal, no route mounted."""
    wait_until(lambda: emu.live_pids() == [], "every job process to end")
    wait_until(lambda: all(job.terminal for job in emu.jobs), "every job to reach a terminal stage")
    assert mounted_routes(proxy) == 0


# -- the happy path ------------------------------------------------------------------------------


def test_echo_environment_over_http_and_websocket_then_close_cancels_the_job(no_leaks, emu, proxy):
    ws_sync = pytest.importorskip("websockets.sync.client")
    with provider_for(emu, proxy) as provider:
        base_url = provider.start_container()
        provider.wait_for_ready()
        assert base_url.startswith(proxy.url + "/")
        with requests.Session() as http:
            assert http.post(base_url + "/reset", json={}, timeout=TIMEOUT).status_code == 200
            step = http.post(base_url + "/step", json={"action": {"message": "e2e"}}, timeout=TIMEOUT).json()
            assert step["observation"]["echoed_message"] == "e2e"
        with ws_sync.connect(base_url.replace("http://", "ws://") + "/ws", open_timeout=TIMEOUT) as ws:
            ws.send(json.dumps({"type": "step", "data": {"message": "over ws"}}))
            assert json.loads(ws.recv(timeout=TIMEOUT))["data"]["observation"]["echoed_message"] == "over ws"
        job = emu.job(provider.job_id)
        wait_until(lambda: job.first_health_ok_mono is not None, "the emulator's health probe")
        assert job.stage == "RUNNING"
        assert set(provider.timings) >= {"created", "running", "url", "ready"}
    assert emu.wait_for_stage(provider.job_id, ["CANCELED"]).stage == "CANCELED"  # cancel is asynchronous
    assert requests.get(base_url + "/health", timeout=TIMEOUT).status_code == 404  # route gone
    assert_nothing_left(emu, proxy)


def test_legacy_http_client_flow_of_from_docker_image(emu, proxy):
    """What OpenEnv's old HTTPEnvClient does: start_container(image, **kwargs), wait_for_ready(base_url),
    then stateful POST /reset, POST /step, GET /state over one requests.Session, close() at the end."""
    provider = provider_for(emu, proxy)
    base_url = provider.start_container(IMAGE, env_vars={"EXTRA": "1"}, wait_timeout=30.0)
    try:
        provider.wait_for_ready(base_url)
        with requests.Session() as http:
            http.post(base_url + "/reset", json={"episode_id": "legacy"}, timeout=TIMEOUT).raise_for_status()
            for word in ("one", "two", "three"):
                http.post(base_url + "/step", json={"action": {"message": word}}, timeout=TIMEOUT).raise_for_status()
            assert http.get(base_url + "/state", timeout=TIMEOUT).json() == {"episode_id": "legacy", "step_count": 3}
    finally:
        provider.close()
    provider.close()  # twice is fine
    assert emu.wait_for_stage(provider.job_id, ["CANCELED"]).stage == "CANCELED"
    assert_nothing_left(emu, proxy)


def test_emulator_token_never_reaches_the_job_and_env_vars_do(emu, proxy):
    show = [sys.executable, "-c",
            "import os, json, sys\nfrom http.server import BaseHTTPRequestHandler, ThreadingHTTPServer\n"
            "class H(BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        body = json.dumps({'auth': self.headers.get('Authorization'), 'env': os.environ.get('MODE')}).encode()\n"
            "        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()\n"
            "        self.wfile.write(body)\n"
            "    def log_message(self, *a): pass\n"
            "ThreadingHTTPServer(('127.0.0.1', int(os.environ['PORT'])), H).serve_forever()\n"]
    with provider_for(emu, proxy, command=show, env_vars={"MODE": "e2e"}) as provider:
        provider.start_container()
        provider.wait_for_ready()
        seen = requests.get(provider.base_url + "/anything", timeout=TIMEOUT).json()
        assert seen == {"auth": None, "env": "e2e"}
    assert_nothing_left(emu, proxy)


# -- every fault, and nothing left behind --------------------------------------------------------


def test_crash_at_boot_raises_job_failed_with_the_message_and_log_tail(emu, proxy):
    provider = provider_for(emu, proxy, env_vars={"HF_JOBS_EMULATOR_CRASH_AT_BOOT": "ModuleNotFoundError: server"})
    with pytest.raises(JobFailedError) as caught:
        provider.start_container()
        provider.wait_for_ready()
    error = caught.value
    assert error.stage == "ERROR" and error.message == "ModuleNotFoundError: server"
    assert "ModuleNotFoundError: server" in "\n".join(error.log_tail)
    assert error.job_id == provider.job_id
    provider.close()
    assert_nothing_left(emu, proxy)


def test_a_server_that_exits_raises_job_failed_naming_the_exit_code(emu, proxy):
    crash = [sys.executable, "-c", "import sys; print('config missing', file=sys.stderr); sys.exit(4)"]
    provider = provider_for(emu, proxy, command=crash)
    with pytest.raises(JobFailedError) as caught:
        provider.start_container()
        provider.wait_for_ready()
    assert "exit code: 4" in caught.value.message and "config missing" in caught.value.log_tail
    provider.close()
    assert_nothing_left(emu, proxy)


def test_slow_scheduling_past_the_start_timeout_raises_and_cancels_the_job(emu, proxy):
    provider = provider_for(emu, proxy, labels={"emulator-scheduling-delay-s": "60"}, start_timeout_s=0.5)
    with pytest.raises(JobStartTimeout):
        provider.start_container()
    assert emu.wait_for_stage(emu.jobs[0].id, ["CANCELED"]).stage == "CANCELED" and emu.jobs[0].pid is None
    assert_nothing_left(emu, proxy)


@pytest.mark.slow  # a start that waits 11 s in SCHEDULING, to hear its heartbeat
def test_a_long_start_logs_its_job_page_at_once_then_a_heartbeat_with_stage_and_seconds(emu, proxy, caplog):
    provider = provider_for(emu, proxy, labels={"emulator-scheduling-delay-s": "11"})
    with caplog.at_level("DEBUG", logger="hf_sandbox_provider"):
        provider.start_container()
    provider.close()
    ours = [record for record in caplog.records if record.name == "hf_sandbox_provider"]
    lines = [record.getMessage() for record in ours]
    created = next(i for i, line in enumerate(lines) if "created" in line)
    assert provider.job_id in lines[created] and provider.job_url in lines[created]
    heartbeat = next(i for i, line in enumerate(lines) if "still SCHEDULING" in line)
    running = next(i for i, line in enumerate(lines) if "-> RUNNING" in line)
    assert created < heartbeat < running, lines
    assert re.search(r"still SCHEDULING, 1[0-9]s after submit \(start_timeout_s=", lines[heartbeat]), lines[heartbeat]
    # a library user with no logging configured sees none of it: nothing above INFO for a healthy start
    assert all(record.levelno <= logging.INFO for record in ours), lines
    assert_nothing_left(emu, proxy)


@pytest.mark.slow  # waits out a ready timeout
def test_a_server_that_never_answers_health_times_out_and_is_cancelled(emu, proxy):
    provider = provider_for(emu, proxy, command=SLEEP_FOREVER, ready_timeout_s=1.0)
    provider.start_container()
    with pytest.raises(JobStartTimeout):
        provider.wait_for_ready()
    assert emu.wait_for_stage(emu.jobs[0].id, ["CANCELED"]).stage == "CANCELED"
    assert_nothing_left(emu, proxy)


@pytest.mark.slow  # the create is retried with backoff
def test_rate_limited_api_calls_are_retried_and_the_start_succeeds(emu, proxy):
    emu.inject_rate_limit(2, retry_after_s=0, routes=["create"])
    with provider_for(emu, proxy) as provider:
        provider.start_container()
        provider.wait_for_ready()
        assert requests.get(provider.base_url + "/health", timeout=TIMEOUT).status_code == 200
    assert emu.api_calls["create"] == 3  # two answered 429, the third created the job
    assert len(emu.jobs) == 1
    assert_nothing_left(emu, proxy)


@pytest.mark.slow  # retried with backoff
def test_rate_limit_right_after_create_is_survived(emu, proxy):
    with provider_for(emu, proxy, labels={"emulator-rate-limit-after-create": "1"}) as provider:
        provider.start_container()
        provider.wait_for_ready()
    assert len(emu.jobs) == 1
    assert_nothing_left(emu, proxy)


def test_lost_create_response_adopts_the_created_job_instead_of_making_a_second(emu, proxy, caplog):
    caplog.set_level(logging.INFO, logger="hf_sandbox_provider")
    emu.lose_next_create_responses(1)
    with provider_for(emu, proxy) as provider:
        provider.start_container()
        provider.wait_for_ready()
        assert [job.id for job in emu.jobs] == [provider.job_id]
        assert "create answer was lost; adopting job %s found by its start label" % provider.job_id in [
            r.getMessage() for r in caplog.records]
    assert_nothing_left(emu, proxy)


def test_a_create_answered_5xx_whose_job_appears_after_the_retry_leaves_neither_job_running(emu, proxy, caplog):
    # The gateway gives up (504) while the Hub goes on making the job: the lookup right after finds
    # none, the create is sent again, and the first job appears later with the same start label.
    caplog.set_level(logging.INFO, logger="hf_sandbox_provider")
    emu.make_next_creates_late(1, after_s=1.0)
    with provider_for(emu, proxy) as provider:
        provider.start_container()
        provider.wait_for_ready()
        wait_until(lambda: len(emu.jobs) == 2, "the first create's late job")
        assert provider.job_id in [job.id for job in emu.jobs]
        twin = next(job.id for job in emu.jobs if job.id != provider.job_id)
    assert_nothing_left(emu, proxy)
    said = [r.getMessage() for r in caplog.records]
    assert "the first create made HF job %s anyway: cancelling it" % twin in said, said
    assert not [m for m in said if "listed yet" in m]  # the stop found the twin: nothing to warn about


def test_a_twin_not_yet_made_when_its_start_stops_is_named_with_the_sweep_that_then_cancels_it(emu, proxy, caplog,
                                                                                                   tmp_path):
    # When the Hub makes the first create's job is unknown: a stop that finds none yet cannot cancel it, so it
    # must say how to find it later (its start label), never stay silent while a twin bills for an hour.
    caplog.set_level(logging.INFO, logger="hf_sandbox_provider")
    emu.make_next_creates_late(1, after_s=6.0)
    with provider_for(emu, proxy) as provider:
        provider.start_container()
        label = "%s=%s" % (START_LABEL_KEY, emu.job(provider.job_id).spec["labels"][START_LABEL_KEY])
        assert len(emu.jobs) == 1, "the twin came before the stop: this test needs a longer after_s"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [m for m in warnings if "no job of the first create is listed yet" in m
            and "sweep --label %s" % label in m], warnings
    wait_until(lambda: len(emu.jobs) == 2, "the first create's late job")
    twin = next(job.id for job in emu.jobs if job.id != provider.job_id)
    swept = run_cli(["sweep", "--label", label], clean_env(tmp_path, HF_ENDPOINT=emu.endpoint, HF_TOKEN=emu.token))
    assert swept.returncode == 0 and "cancelled %s" % twin in swept.stdout, (swept.stdout, swept.stderr)
    assert_nothing_left(emu, proxy)


def test_the_exit_safety_net_also_cancels_the_late_twin_of_a_create_sent_twice(emu, proxy):
    emu.make_next_creates_late(1, after_s=1.0)
    provider = provider_for(emu, proxy)
    provider.start_container()
    provider.wait_for_ready()
    wait_until(lambda: len(emu.jobs) == 2, "the first create's late job")
    del provider  # never stopped: its finalizer (what runs at exit) cancels
    gc.collect()
    assert_nothing_left(emu, proxy)


_COLLECTED_MID_MOUNT_CHILD = """
import gc, json, sys, threading
import hf_sandbox_provider, proxy, proxy_host
settings, (module, cls) = json.loads(sys.argv[1]), sys.argv[2].split(".")
allocation = getattr(sys.modules[module], cls).__init__.__code__  # made while its object's owner holds a lock
gc.disable()  # the one collection below is the test's
dropped = hf_sandbox_provider.HFSandboxProvider("python:3.12", **settings)
dropped.start_container()
dropped.cycle = {"provider": dropped}  # held by a cycle: only a collection frees it, in whatever thread runs it
del dropped

def collect_inside(frame, event, arg):
    if event == "call" and frame.f_code is allocation:
        sys.setprofile(None)
        gc.collect()

def start_another():
    other = hf_sandbox_provider.HFSandboxProvider("python:3.12", **settings)
    sys.setprofile(collect_inside)
    try:
        other.start_container()
    finally:
        sys.setprofile(None)
    other.stop_container()
    print("started and stopped another", flush=True)

thread = threading.Thread(target=start_another, daemon=True)
thread.start()
thread.join(60)
sys.stdout.flush()
sys.exit(1 if thread.is_alive() else 0)
"""


@pytest.mark.parametrize("mode, allocation", [(None, "proxy._HostPool"), ("process", "proxy_host._PendingAnswer")])
def test_a_provider_collected_while_another_start_holds_the_proxys_lock_is_released_without_a_deadlock(
        emu, mode, allocation):
    # The GC runs a finalizer in whichever thread allocates. A start mounting its route allocates under the proxy's
    # host-pool lock (the proxy child's handle lock with proxy="process"); a release run there took that lock again
    # and hung the start, and every later mount and unmount, for good.
    settings = dict(endpoint=emu.endpoint, token=emu.token, command=ECHO, poll_interval_s=0.05, proxy=mode)
    child = subprocess.run([sys.executable, "-c", _COLLECTED_MID_MOUNT_CHILD, json.dumps(settings), allocation],
                           capture_output=True, text=True, timeout=TIMEOUT * 4, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": ROOT})
    assert child.returncode == 0 and "started and stopped another" in child.stdout, child.stderr[-3000:]
    assert "garbage-collected): cancelling it" in child.stderr
    wait_until(lambda: len(emu.jobs) == 2 and all(job.stage == "CANCELED" for job in emu.jobs), "both jobs cancelled")


def test_providers_whose_progress_callback_raised_are_not_kept_alive_by_a_handler_that_keeps_records(emu, proxy):
    # The callback's failure was logged with exc_info: a handler keeping its records (pytest's, a MemoryHandler)
    # kept the traceback, whose frames held start_many's workers and every provider, and their jobs ran on.
    import logging.handlers

    keeper = logging.handlers.MemoryHandler(capacity=100000, flushLevel=logging.CRITICAL + 1)
    library = logging.getLogger("hf_sandbox_provider")
    level = library.level
    library.addHandler(keeper)
    library.setLevel(logging.DEBUG)
    calls: list = []

    def progress(ready: int, failed: int, total: int) -> None:
        calls.append(ready)
        if len(calls) == 1:
            raise RuntimeError("the display broke")

    try:
        providers = HFSandboxProvider.start_many(2, IMAGE, progress=progress, endpoint=emu.endpoint, token=emu.token,
                                                 command=ECHO, proxy=proxy, poll_interval_s=0.05)
        assert any("progress callback raised" in record.getMessage() for record in keeper.buffer)
        job_ids = [provider.job_id for provider in providers]
        del providers
        gc.collect()
        wait_until(lambda: all(emu.job(job_id).stage == "CANCELED" for job_id in job_ids), "both jobs cancelled")
    finally:
        library.removeHandler(keeper)
        library.setLevel(level)
        keeper.close()


_EXIT_CHILD = """
import json, sys
import hf_sandbox_provider
settings = json.loads(sys.argv[1])
providers = [hf_sandbox_provider.HFSandboxProvider("python:3.12", **settings) for _ in range(4)]
for provider in providers:
    provider.start_container()
print("started", flush=True)
"""  # then the interpreter exits with every job running: its exit hooks must cancel them


def test_at_a_real_exit_the_safety_nets_cancel_the_jobs_left_running_together_not_one_after_another(emu):
    in_flight, peak, lock = [], [0], threading.Lock()
    original = JobsEmulator._cancel

    def slow_cancel(self, job):  # a Hub whose cancel takes a while: one by one, hundreds outlast a kill
        with lock:
            in_flight.append(job.id)
            peak[0] = max(peak[0], len(in_flight))
        time.sleep(0.3)
        with lock:
            in_flight.remove(job.id)
        return original(self, job)

    emu_cancel = JobsEmulator._cancel
    JobsEmulator._cancel = slow_cancel
    try:
        settings = dict(endpoint=emu.endpoint, token=emu.token, command=ECHO, poll_interval_s=0.05)
        child = subprocess.run([sys.executable, "-c", _EXIT_CHILD, json.dumps(settings)], capture_output=True,
                               text=True, timeout=TIMEOUT * 4, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    finally:
        JobsEmulator._cancel = emu_cancel
    assert child.returncode == 0 and "started" in child.stdout, child.stderr[-2000:]
    assert peak[0] == 4, "the exit cancelled %d job(s) at a time" % peak[0]
    wait_until(lambda: all(job.terminal for job in emu.jobs) and len(emu.jobs) == 4, "every job to end")


_EXIT_WITH_CREATES_IN_FLIGHT_CHILD = """
import json, sys, threading, time
import hf_sandbox_provider
settings = json.loads(sys.argv[1])
for _ in range(3):  # (each provider is dropped as its start's thread ends: its net fires then, at exit)
    provider = hf_sandbox_provider.HFSandboxProvider("python:3.12", **settings)
    threading.Thread(target=provider.start_container, daemon=True).start()
time.sleep(0.6)
print("exiting with the creates in flight", flush=True)
"""  # the exit hook waits for the creates (EXIT_SETTLE_S); the jobs they record meanwhile must be cancelled


def test_at_a_real_exit_the_jobs_that_creates_in_flight_record_while_the_exit_waits_are_cancelled(emu):
    emu.delay_next_create_answers(3, 1.5)
    settings = dict(endpoint=emu.endpoint, token=emu.token, command=ECHO, poll_interval_s=0.05)
    child = subprocess.run([sys.executable, "-c", _EXIT_WITH_CREATES_IN_FLIGHT_CHILD, json.dumps(settings)],
                           capture_output=True, text=True, timeout=TIMEOUT * 4, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": ROOT})
    assert child.returncode == 0 and "in flight" in child.stdout, child.stderr[-2000:]
    wait_until(lambda: len(emu.jobs) == 3 and all(job.terminal for job in emu.jobs), "every job to end")
    assert {job.stage for job in emu.jobs} == {"CANCELED"}, child.stderr[-2000:]


_EXIT_WITH_A_RELEASE_UNDER_WAY_CHILD = """
import gc, json, sys, threading, time
import hf_sandbox_provider
from proxy import AuthProxy
settings = json.loads(sys.argv[1])
proxy = AuthProxy().start()
gc.disable()
provider = hf_sandbox_provider.HFSandboxProvider("python:3.12", proxy=proxy, **settings)
provider.start_container()
provider.cycle = provider  # only a collection frees it
del provider
held = threading.Event()

def busy():  # the proxy's route table busy for a moment, as in a burst of mounts
    with proxy._lock:
        held.set()
        time.sleep(1.0)

threading.Thread(target=busy, daemon=True).start()
held.wait()
gc.collect()  # the release goes to the reaper thread, which waits for that lock to unmount the route
print("exiting with the release under way", flush=True)
"""


def test_at_a_real_exit_a_collected_providers_release_under_way_on_the_reaper_is_waited_for(emu):
    settings = dict(endpoint=emu.endpoint, token=emu.token, command=ECHO, poll_interval_s=0.05)
    child = subprocess.run([sys.executable, "-c", _EXIT_WITH_A_RELEASE_UNDER_WAY_CHILD, json.dumps(settings)],
                           capture_output=True, text=True, timeout=TIMEOUT * 4, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": ROOT})
    assert child.returncode == 0 and "under way" in child.stdout, child.stderr[-2000:]
    wait_until(lambda: len(emu.jobs) == 1 and emu.jobs[0].terminal, "the job to end")
    assert emu.jobs[0].stage == "CANCELED", child.stderr[-2000:]


def test_a_watcher_thread_refused_once_by_a_thread_limit_is_started_by_the_next_start(emu, proxy, monkeypatch):
    real_start, refused = hf_sandbox_provider._start_thread, []

    def once_no_watcher(thread):
        if thread.name == "hf-sandbox-job-watcher" and not refused:
            refused.append(thread)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(hf_sandbox_provider, "_start_thread", once_no_watcher)
    with provider_for(emu, proxy, start_timeout_s=10) as first:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            first.start_container()
    with provider_for(emu, proxy, start_timeout_s=10) as second:  # saw no stage or URL before the fix
        second.wait_for_ready(second.start_container())
    assert refused
    assert_nothing_left(emu, proxy)


def test_logs_while_a_429_pauses_the_token_return_at_once_instead_of_waiting_out_the_pause(emu, proxy):
    with provider_for(emu, proxy) as provider:
        provider.start_container()
        provider.wait_for_ready()
        emu.inject_rate_limit(1, retry_after_s=20, routes=["inspect"])
        with pytest.raises(hf_sandbox_provider.JobsAPIError):  # any call of this token, answered 429
            provider._job_client.get_job(provider._job_namespace, provider.job_id, retries=0)
        before = emu.api_calls.get("logs", 0)
        assert provider.logs() == []  # (a JobFailedError's log tail is read the same way)
        assert provider._job_client._budget.wait_s() > 0  # returned while the pause still held
        assert emu.api_calls.get("logs", 0) == before
    assert_nothing_left(emu, proxy)


def test_a_stop_while_the_create_waits_out_a_429_pause_returns_at_once_and_no_job_is_made(emu, proxy):
    provider = provider_for(emu, proxy)
    emu.inject_rate_limit(1, retry_after_s=30, routes=["create"])
    outcome = []

    def start() -> None:
        try:
            outcome.append(provider.start_container())
        except BaseException as exc:
            outcome.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    wait_until(lambda: emu.api_calls.get("create", 0) == 1, "the create answered 429")
    budget = provider._job_client._budget
    wait_until(lambda: budget.wait_s() > 0, "the budget to pause the token's calls")
    provider.stop_container()
    starter.join(TIMEOUT)
    assert budget.wait_s() > 0  # the start gave up while the 31 s pause still held
    assert isinstance(outcome[0], hf_sandbox_provider.SandboxError), outcome
    assert "stop_container() was called while creating the job" in str(outcome[0])
    assert emu.api_calls.get("create") == 1 and emu.jobs == []  # the held create was never sent
    assert emu.api_calls.get("list", 0) == 0  # a 429 made nothing: no lookup by label either
    assert provider.phase is hf_sandbox_provider.Phase.IDLE


def test_a_stop_during_a_429_pause_cancels_a_job_whose_create_was_sent_twice_at_once(emu, proxy):
    # The lookup of the first create's twin once came first, budgeted like any call: the cancel waited out the pause.
    emu.inject_server_errors(1, routes=["create"])  # looked up, then sent again: the provider has a twin label
    provider = provider_for(emu, proxy)
    provider.wait_for_ready(provider.start_container())
    assert provider._twin_label is not None
    emu.inject_rate_limit(1, retry_after_s=30, routes=["inspect"])
    with pytest.raises(hf_sandbox_provider.JobsAPIError):
        provider._job_client.get_job(provider._job_namespace, provider.job_id, retries=0)
    budget = provider._job_client._budget
    provider.stop_container()
    assert budget.wait_s() > 0  # stopped while the 31 s pause held
    assert emu.api_calls.get("cancel") == 1
    assert_nothing_left(emu, proxy)


def test_a_stop_whose_cancel_is_slow_does_not_wait_for_a_start_made_after_its_teardown(emu, proxy, caplog,
                                                                                        monkeypatch):
    monkeypatch.setattr(hf_sandbox_provider, "STOP_WAIT_S", 3.0)
    provider = provider_for(emu, proxy)
    provider.wait_for_ready(provider.start_container())
    emu.inject_server_errors(5, routes=["cancel"])  # the stop's cancel is retried for a few seconds
    stopper = threading.Thread(target=provider.stop_container)
    stopper.start()
    wait_until(lambda: provider.phase is hf_sandbox_provider.Phase.IDLE, "the stop's teardown")
    starter = threading.Thread(target=lambda: provider.start_container(labels={"emulator-scheduling-delay-s": "8"}))
    starter.start()  # claimed after the stop's teardown: not that stop's to wait for
    stopper.join(TIMEOUT)
    starter.join(TIMEOUT)
    assert provider.phase is hf_sandbox_provider.Phase.RUNNING and provider.stage == "RUNNING"
    assert not [r for r in caplog.records if "has not ended after" in r.getMessage()]
    provider.stop_container()
    assert_nothing_left(emu, proxy)


def test_a_start_made_while_a_slow_stop_cancels_keeps_its_own_stage(emu, proxy):
    provider = provider_for(emu, proxy)
    provider.wait_for_ready(provider.start_container())
    emu.inject_server_errors(8, routes=["cancel"])  # the old job's cancel is retried for seconds
    stopper = threading.Thread(target=provider.stop_container)
    stopper.start()
    wait_until(lambda: provider.phase is hf_sandbox_provider.Phase.IDLE, "the stop's teardown")
    provider.wait_for_ready(provider.start_container())  # a new job, while the stop still cancels the old one
    stopper.join(TIMEOUT)
    assert provider.stage == "RUNNING" and emu.job(provider.job_id).stage == "RUNNING", repr(provider)
    provider.stop_container()
    assert_nothing_left(emu, proxy)


def test_a_netrc_entry_for_the_hub_does_not_replace_the_providers_token(emu, proxy, tmp_path, monkeypatch):
    # requests applies ~/.netrc to a request whose auth is unset: it once replaced "Bearer <token>" on every call.
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login someone password git-credential\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    with provider_for(emu, proxy) as provider:
        provider.wait_for_ready(provider.start_container())  # the emulator refuses any other credential
    assert_nothing_left(emu, proxy)


def test_a_job_that_dies_mid_use_answers_502_and_teardown_still_works(emu, proxy):
    with provider_for(emu, proxy) as provider:
        provider.start_container()
        provider.wait_for_ready()
        emu.kill_job(provider.job_id)
        emu.wait_for_stage(provider.job_id, ["ERROR"])
        answer = requests.get(provider.base_url + "/health", timeout=TIMEOUT)
        assert answer.status_code == 502 and answer.headers.get("X-Proxy-Error")
    assert emu.job(provider.job_id).stage == "ERROR"
    assert_nothing_left(emu, proxy)


def test_die_after_fault_ends_a_started_job_in_error_and_the_provider_reports_it(emu, proxy):
    provider = provider_for(emu, proxy, command=SLEEP_FOREVER, env_vars={"HF_JOBS_EMULATOR_DIE_AFTER_S": "0.5"})
    provider.start_container()
    with pytest.raises(JobFailedError) as caught:
        provider.wait_for_ready()
    assert caught.value.stage == "ERROR" and "die-after-s" in caught.value.message
    provider.close()
    assert_nothing_left(emu, proxy)


@pytest.mark.slow  # waits out a 1 s job timeout
def test_job_timeout_is_sent_and_enforced_server_side(emu, proxy):
    provider = provider_for(emu, proxy, job_timeout=1)
    try:
        provider.start_container()
    except JobFailedError as exc:  # a busy machine may only look after the job already timed out
        assert exc.stage == "CANCELED"
    (job,) = emu.jobs
    assert job.spec["timeoutSeconds"] == 1
    assert emu.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED" and "timed out" in job.message
    provider.close()
    assert_nothing_left(emu, proxy)


@pytest.mark.slow  # the provider's cancel is retried with backoff against a stopped API
def test_stopping_the_emulator_while_the_provider_runs_leaves_nothing_behind(proxy):
    emu = JobsEmulator().start()
    provider = provider_for(emu, proxy)
    try:
        provider.start_container()
        provider.wait_for_ready()
        emu.stop()
        assert emu.live_pids() == []
    finally:
        provider.close()  # the API is gone: close logs what it could not cancel, never raises
        emu.stop()
    assert mounted_routes(proxy) == 0


# -- the smoke CLI as users run it ----------------------------------------------------------------
