"""`install_signal_teardown()`: a real trainer-like subprocess killed by SIGTERM (or SIGHUP) during a cold
start and while its sessions run cancels every job before it dies of the signal; a handler installed
before is chained; uninstall restores; off the main thread nothing is installed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import hf_sandbox_provider
import hf_sandbox_training
from hf_jobs_emulator import JobsEmulator, echo_server_command
from hf_sandbox_provider import install_signal_teardown, uninstall_signal_teardown
from support import signalled, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOTS = 4
SCHEDULING_DELAY_S = 6.0  # long enough that "during a cold start" is certain when the signal lands
CHILD_TIMEOUT_S = 60.0
CREATE_ANSWER_S = 1.5  # how long the emulator holds each create's answer in the in-flight test

# CPython runs a Python signal handler only between bytecodes: a signal that lands after the child's last
# check and before a sleep's system call waits out the whole sleep (about 1 run in 10 with one 120 s sleep
# right after the "cold" line), which is CPython's behaviour, not the library's; the child therefore
# sleeps in short steps, as a training loop returns to Python between its steps.
# A trainer in miniature: SLOTS sandboxes begun in the background (plus a shared group of 2), then
# either it waits for nothing ("cold"), or opens one session per slot and reports "ready".
CHILD = textwrap.dedent('''
    import json, signal, sys, time
    from hf_sandbox_provider import Sandbox, install_signal_teardown

    settings, phase, chain = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3] == "chain"
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal, even when this suite runs under nohup
    if chain:
        def previous(signum, frame):
            print("previous handler ran for signal %d" % signum, flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, previous)
    print("installed %s" % install_signal_teardown(), flush=True)
    boxes = [Sandbox("img:tag", **settings) for _ in range(SLOTS)]
    boxes.append(Sandbox("img:tag", shared="group", replicas=2, **settings))
    if phase in ("running", "locked"):
        sessions = [box.session() for box in boxes]
        for session in sessions:
            session.reset()
    if phase == "locked":  # the signal lands inside a library lock, as it may in a slot's begin() or stop()
        import hf_sandbox_training
        hf_sandbox_training._slots_lock.acquire()
    print(phase, flush=True)
    for _ in range(240):  # a trainer's loop: back in Python bytecode often (see the note below)
        time.sleep(0.5)
    print("not killed", flush=True)
''').replace("SLOTS", str(SLOTS))


@pytest.fixture
def slow_emu(make_emu):
    return make_emu(scheduling_delay_s=SCHEDULING_DELAY_S)


def run_child_until(emu: JobsEmulator, phase: str, chain: bool = False) -> subprocess.Popen:
    settings = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command(), poll_interval_s=0.1)
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(settings), phase, "chain" if chain else "-"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "installed True"
        assert child.stdout.readline().strip() == phase
    except BaseException:
        child.kill()
        child.wait()
        raise
    return child


def wait_for_jobs(emu: JobsEmulator, count: int) -> None:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while len(emu.jobs) < count:
        assert time.monotonic() < deadline, "the child created %d of %d jobs" % (len(emu.jobs), count)
        time.sleep(0.02)


def assert_every_job_cancelled(emu: JobsEmulator, count: int) -> None:
    assert len(emu.jobs) == count, emu.jobs
    for job in emu.jobs:
        assert emu.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED", job
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while emu.live_pids():
        assert time.monotonic() < deadline, "job processes still running: %s" % emu.live_pids()
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_the_cold_start_cancels_every_job_then_kills_the_process(slow_emu, signum) -> None:
    child = run_child_until(slow_emu, "cold")
    wait_for_jobs(slow_emu, SLOTS + 2)  # every create answered; all jobs still SCHEDULING
    assert all(job.stage == "SCHEDULING" for job in slow_emu.jobs)
    out, err = signalled(child, signum, CHILD_TIMEOUT_S)
    assert child.returncode == -signum, (out, err)  # then died of the signal, as by default
    assert "cancelling this process's HF jobs" in err and "not killed" not in out
    assert_every_job_cancelled(slow_emu, SLOTS + 2)


def test_sigterm_while_every_create_is_in_flight_waits_for_the_answers_and_cancels_each_job(slow_emu) -> None:
    # Every create is made at once but answered CREATE_ANSWER_S later, and the signal lands while all of
    # them are held: the teardown must wait for the answers (or look the jobs up) and cancel every one.
    slow_emu.delay_next_create_answers(SLOTS + 2, CREATE_ANSWER_S)
    child = run_child_until(slow_emu, "cold")
    wait_until(lambda: slow_emu.create_answers_held == SLOTS + 2, "every create to be in flight",
               timeout_s=CHILD_TIMEOUT_S)
    out, err = signalled(child, signal.SIGTERM, CHILD_TIMEOUT_S)
    assert child.returncode == -signal.SIGTERM, (out, err)
    assert_every_job_cancelled(slow_emu, SLOTS + 2)


# A provider-level trainer: `start_many` (its creates run on worker threads) or one `start_container()` on the
# main thread, the signal landing while the Hub holds the create answers.
PROVIDER_CHILD = textwrap.dedent('''
    import json, sys, time
    from hf_sandbox_provider import HFSandboxProvider, install_signal_teardown

    settings, how = json.loads(sys.argv[1]), sys.argv[2]
    print("installed %s" % install_signal_teardown(), flush=True)
    print(how, flush=True)
    if how == "start_many":
        HFSandboxProvider.start_many(SLOTS, "img:tag", progress=False, **settings)
    else:
        HFSandboxProvider("img:tag", **settings).start_container()
    for _ in range(240):
        time.sleep(0.5)
    print("not killed", flush=True)
''').replace("SLOTS", str(SLOTS))


def sigterm_while_creates_are_held(emu: JobsEmulator, how: str, count: int, held_s: float) -> str:
    """Run PROVIDER_CHILD, SIGTERM it once the Hub holds `count` create answers (each `held_s`); returns its
    stderr."""
    emu.delay_next_create_answers(count, held_s)
    settings = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command(), poll_interval_s=0.1)
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    child = subprocess.Popen([sys.executable, "-c", PROVIDER_CHILD, json.dumps(settings), how], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "installed True"
        assert child.stdout.readline().strip() == how
        wait_until(lambda: emu.create_answers_held == count, "the creates to be in flight", timeout_s=CHILD_TIMEOUT_S)
    finally:
        out, err = signalled(child, signal.SIGTERM, CHILD_TIMEOUT_S)
    assert child.returncode == -signal.SIGTERM, (out, err)
    return err


def test_sigterm_while_start_manys_creates_are_in_flight_cancels_each_job_once_answered(make_emu) -> None:
    # The creates answered after the teardown had run the safety nets: their jobs got safety nets nothing ran
    # any more, and the process died with every job running and not a word (found by review).
    emu = make_emu(scheduling_delay_s=0.5)
    err = sigterm_while_creates_are_held(emu, "start_many", SLOTS, CREATE_ANSWER_S)
    assert_every_job_cancelled(emu, SLOTS)
    assert "had not ended" not in err, err


def test_sigterm_while_the_main_threads_create_waits_for_its_answer_cancels_the_job_it_made_at_once(make_emu):
    # The handler runs on the thread holding the create, so its answer cannot arrive: the teardown waited its
    # whole budget for it, warned, and the process died with the job running (found by review).
    emu = make_emu(scheduling_delay_s=0.5)
    err = sigterm_while_creates_are_held(emu, "start_container", 1, CHILD_TIMEOUT_S)
    assert_every_job_cancelled(emu, 1)
    assert "had not ended" not in err, err  # before: the whole budget waited, then this warning


@pytest.mark.slow
def test_sigterm_while_sessions_run_cancels_every_job_and_chains_the_previous_handler(make_emu) -> None:
    emu = make_emu(scheduling_delay_s=0.5)
    child = run_child_until(emu, "running", chain=True)
    assert all(job.stage == "RUNNING" for job in emu.jobs)
    out, err = signalled(child, signal.SIGTERM, CHILD_TIMEOUT_S)
    assert child.returncode == 7, (out, err)  # the handler installed before ours ran, after the teardown
    assert "previous handler ran for signal %d" % signal.SIGTERM in out
    assert_every_job_cancelled(emu, SLOTS + 2)
    assert emu.token not in out + err


def test_sigterm_while_the_main_thread_holds_a_library_lock_still_cancels_every_job(make_emu) -> None:
    # The teardown's helper thread listed the slots under the lock the interrupted main thread held: it
    # blocked before it cancelled anything, and the process died with every job running.
    emu = make_emu(scheduling_delay_s=0.5)
    child = run_child_until(emu, "locked")
    out, err = signalled(child, signal.SIGTERM, CHILD_TIMEOUT_S)
    assert child.returncode == -signal.SIGTERM, (out, err)
    assert_every_job_cancelled(emu, SLOTS + 2)


def test_uninstall_restores_the_previous_handler_and_an_ignored_signal_is_left_alone() -> None:
    def mine(signum, frame):
        pass

    before_term, before_hup = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    signal.signal(signal.SIGTERM, mine)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # e.g. under nohup
    try:
        assert install_signal_teardown() is True
        assert install_signal_teardown() is True  # twice: harmless, still chains to `mine`
        assert signal.getsignal(signal.SIGTERM) is hf_sandbox_training._on_teardown_signal
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        uninstall_signal_teardown()
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        uninstall_signal_teardown()  # nothing installed: no-op
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before_term)
        signal.signal(signal.SIGHUP, before_hup)


def test_off_the_main_thread_nothing_is_installed() -> None:
    before = signal.getsignal(signal.SIGTERM)
    results = []
    thread = threading.Thread(target=lambda: results.append(install_signal_teardown()))
    thread.start()
    thread.join(10)
    assert results == [False] and signal.getsignal(signal.SIGTERM) is before


def test_a_handler_set_on_top_of_ours_stays_and_the_whole_chain_runs_once() -> None:
    before = signal.getsignal(signal.SIGTERM)
    calls = []

    def theirs(signum, frame):  # e.g. a framework that saved ours and calls it from its own handler
        calls.append("theirs")
        saved(signum, frame)

    def innermost(signum, frame):
        calls.append("innermost")

    signal.signal(signal.SIGTERM, innermost)
    try:
        assert install_signal_teardown() is True
        saved = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, theirs)
        assert install_signal_teardown() is True  # already installed: theirs stays on top
        assert signal.getsignal(signal.SIGTERM) is theirs
        signal.raise_signal(signal.SIGTERM)  # nothing runs in this process: the teardown has nothing to cancel
        assert calls == ["theirs", "innermost"]  # theirs -> ours (teardown) -> the one before ours
        uninstall_signal_teardown()
        assert signal.getsignal(signal.SIGTERM) is theirs  # not ours to restore
    finally:
        uninstall_signal_teardown()
        signal.signal(signal.SIGTERM, before)


def _blocked_signals_of_thread(native_id: int) -> set:
    """The signals a thread of this process blocks, read from the kernel (/proc), not from Python."""
    with open("/proc/self/task/%d/status" % native_id) as fh:
        mask = int(next(line for line in fh if line.startswith("SigBlk:")).split()[1], 16)
    return {signum for signum in range(1, 65) if mask & (1 << (signum - 1))}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread signal masks from Linux /proc")
def test_library_threads_leave_termination_signals_to_the_main_thread() -> None:
    # A SIGTERM the kernel hands to a library thread would leave a main thread blocked in a sleep or a
    # join deaf to it (CPython runs handlers only in the main thread): every thread the proxy, the
    # provider's parallel runner and the job watcher start must block them; the main thread must not.
    import requests

    from proxy import MAIN_THREAD_SIGNALS, AuthProxy

    wanted = {int(s) for s in MAIN_THREAD_SIGNALS}
    assert {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)} <= wanted
    seen = {}

    def record() -> None:
        seen[threading.current_thread().name] = _blocked_signals_of_thread(threading.get_native_id())

    hf_sandbox_provider._in_parallel([record, record])
    hf_sandbox_provider._Parallel([None, None], lambda index, provider: record(), 2).run("hf-sandbox-start")
    with AuthProxy() as proxy:
        proxy_threads = []
        base = proxy.mount("http://127.0.0.1:9", token="t")  # nothing listens: a 502 still runs a worker
        requests.get(base + "/health", timeout=10)
        for thread in threading.enumerate():
            if thread.name.startswith("proxy") and thread.native_id is not None:
                proxy_threads.append(thread.name)
                seen[thread.name + "#%d" % thread.native_id] = _blocked_signals_of_thread(thread.native_id)
    assert any(name.startswith("hf-sandbox-stop") for name in seen), seen
    assert any(name.startswith("hf-sandbox-start") for name in seen), seen  # start_many's pool workers
    assert len(proxy_threads) >= 2, proxy_threads  # the listener and at least one pool worker
    assert all(wanted <= blocked for blocked in seen.values()), seen
    assert not wanted & _blocked_signals_of_thread(threading.get_native_id())  # the main thread's mask is untouched


def test_bad_signals_are_refused_naming_them_and_none_is_installed() -> None:
    # install_signal_teardown([SIGTERM, 9]) installed SIGTERM's handler, then failed on SIGKILL with an OSError.
    before = signal.getsignal(signal.SIGTERM)
    for signals in ([signal.SIGTERM, signal.SIGKILL], [signal.SIGTERM, "SIGHUP"], [signal.SIGTERM, 0], "SIGTERM"):
        with pytest.raises(hf_sandbox_provider.SandboxConfigError, match="signal"):
            install_signal_teardown(signals)
        assert signal.getsignal(signal.SIGTERM) is before and not hf_sandbox_training._signal_previous


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_acts_only_on_jobs_it_started_and_its_sigterm_leaves_the_parents_running(make_emu) -> None:
    # A fork worker (a multiprocessing Pool, a DataLoader) inherited the parent's slots, providers and signal
    # handler: its SIGTERM, its stop_sandboxes() and its inherited Sandbox's stop() cancelled the parent's jobs.
    from hf_sandbox_provider import Sandbox, SessionError, stop_sandboxes

    emu = make_emu()
    settings = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command(), poll_interval_s=0.1)
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the child then dies of the signal after its teardown
    own = Sandbox("img:tag", **settings)
    shared = Sandbox("img:tag", shared="fork", **settings)
    session = own.session()
    session.reset()
    shared.wait()
    parents = own.job_ids + shared.job_ids
    read_end, write_end = os.pipe()
    try:
        assert install_signal_teardown()
        pid = os.fork()
        if pid == 0:  # the child: whatever happens, it leaves through os._exit or the signal
            try:
                os.close(read_end)
                report: dict = {}
                try:
                    session.step({"message": "on the parent's connection?"})
                except SessionError as exc:  # the inherited session let go of the parent's socket
                    report["inherited_session"] = type(exc).__name__
                with own.session() as mine:  # the inherited Sandbox starts the child's own job
                    report["reset"] = mine.reset()["observation"]["echoed_message"]
                report["child_jobs"] = own.job_ids
                own.stop()
                shared.stop()
                stop_sandboxes()
                os.write(write_end, json.dumps(report).encode())
                os.close(write_end)
                os.kill(os.getpid(), signal.SIGTERM)  # as Pool.terminate() does: teardown, then death by it
                time.sleep(CHILD_TIMEOUT_S)
            except BaseException as exc:
                os.write(write_end, json.dumps({"error": repr(exc)}).encode())
            finally:
                os._exit(3)
        os.close(write_end)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child did not end")
            time.sleep(0.05)
        report = json.loads(_read_all(read_end).decode() or "{}")
    finally:
        os.close(read_end)
        uninstall_signal_teardown()
        signal.signal(signal.SIGTERM, before)
    try:
        assert "error" not in report, report
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, (status, report)
        # (no cancel requested: the emulator marks a cancel at once, and ends the job a moment later)
        assert [(emu.job(job).stage, emu.job(job)._stop_reason) for job in parents] == [("RUNNING", None)] * 2
        assert report["child_jobs"] and not set(report["child_jobs"]) & set(parents), (report, parents)
        assert report["inherited_session"] == "SessionError" and report["reset"]
        for job in report["child_jobs"]:  # the child's own job: cancelled by its stop()
            assert emu.wait_for_stage(job, ["CANCELED"]).stage == "CANCELED"
        assert own.job_ids + shared.job_ids == parents  # the parent's slots never saw their jobs die
        assert session.step({"message": "still mine"})["observation"]["echoed_message"] == "still mine"
    finally:
        session.close()
        stop_sandboxes()
    for job in emu.jobs:
        assert emu.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED", job


NO_THREAD_CHILD = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, %r)
    from hf_jobs_emulator import echo_server_command
    from hf_sandbox_provider import HFSandboxProvider, install_signal_teardown
    p = HFSandboxProvider("img", endpoint=sys.argv[1], token=sys.argv[2], namespace=sys.argv[3],
                          command=echo_server_command(), poll_interval_s=0.1)
    p.wait_for_ready(p.start_container())
    install_signal_teardown()
    threading.stack_size(2 ** 46)  # no new thread can start from here on (the process is out of threads)
    print("READY", p.job_id, flush=True)
    while True:
        try:
            time.sleep(0.2)
        except Exception as exc:  # a loop that logs a failed step and goes on
            print("caught", repr(exc), flush=True)
""") % ROOT


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="POSIX signals")
def test_a_sigterm_whose_teardown_gets_no_thread_still_ends_the_process_and_the_exit_hooks_cancel_its_job(tmp_path):
    with JobsEmulator() as emu:
        child = subprocess.Popen([sys.executable, "-c", NO_THREAD_CHILD, emu.endpoint, emu.token, emu.namespace],
                                 stdout=subprocess.PIPE, text=True)
        try:
            line = child.stdout.readline()
            while line and not line.startswith("READY"):
                line = child.stdout.readline()
            job_id = line.split()[1]
            child.send_signal(signal.SIGTERM)
            try:
                code = child.wait(15)
            except subprocess.TimeoutExpired:
                code = None
            assert code is not None, "SIGTERM was swallowed: the process runs on"
            wait_until(lambda: emu.job(job_id).stage == "CANCELED", "the job cancelled by the exit hooks", 10)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
