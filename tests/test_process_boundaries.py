"""What crosses a process boundary: the library's errors pickled out of a worker process, and a child
made by fork, which owns none of its parent's jobs or proxy. Real processes, the emulator, the shared proxy.
"""
from __future__ import annotations

import concurrent.futures
import importlib
import json
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from typing import Any, Callable, Dict, List

import pytest
import requests

import hf_sandbox_provider as hsp
from hf_jobs_emulator import EchoServer, echo_server_command
from support import wait_until

for _layer in ("hf_sandbox_pool", "hf_sandbox_training"):  # their errors subclass the core's
    importlib.import_module(_layer)
IMAGE = "registry.hf.space/openenv-echo-env:latest"
TIMEOUT = 60

# One instance per error class: constructor arguments as the library passes them.
_SAMPLES: Dict[str, tuple] = {
    "JobsAPIError": ("creating the job in namespace 'alice'", 402, "no credits", "req1", "add a payment method"),
    "JobFailedError": ("job1", "ERROR", "boom", ["line 1", "line 2"]),
    "JobStartTimeout": ("no URL within 5s", "job1", "SCHEDULING"),
    "StartManyError": (3, [(0, ValueError("bad")), (2, hsp.JobsAPIError("x", 500, None))], 1),
    "ReplicaStartError": ("get ready", 2, [(1, RuntimeError("down"))], 0, ["job1", "job2"]),
    "_StartFailures": ("headline", "item", [(0, ValueError("bad"))], 0),
    "SessionRefusedError": (503, "upstream-unreachable", "job gone"),
    "EnvError": ({"code": "E1", "message": "bad action"},),
}


def _subclasses(cls: type) -> List[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub] + _subclasses(sub)
    return found


@pytest.mark.parametrize("cls", sorted(set(_subclasses(hsp.SandboxError)) | {hsp.SandboxError},
                                       key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_error_of_the_library_survives_pickling_with_its_message_type_and_attributes(cls):
    # A worker process's error once came back as BrokenProcessPool: required constructor arguments broke unpickling.
    error = cls(*_SAMPLES.get(cls.__name__, ("a message",)))
    error.note = "kept"  # attributes set after construction travel too
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls and str(copy) == str(error) and copy.args == error.args
    assert set(copy.__dict__) == set(error.__dict__) and copy.note == "kept"
    for name, value in vars(error).items():
        if not isinstance(value, list):  # (lists of (index, exception) hold fresh exception objects)
            assert getattr(copy, name) == value, name


def _raise_no_credits() -> None:
    raise hsp.JobsAPIError("creating the job in namespace 'alice'", 402, "no credits", "req1")


def test_an_error_raised_in_a_process_pool_worker_reaches_the_parent_as_itself():
    context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        with pytest.raises(hsp.JobsAPIError) as raised:
            pool.submit(_raise_no_credits).result(TIMEOUT)
    assert raised.value.status_code == 402 and "HTTP 402: no credits" in str(raised.value)


def _in_forked_child(work: Callable[[], Any]) -> Any:
    """Run `work` in a child made by os.fork; return what it returned (JSON), or raise what it raised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            try:
                answer = {"ok": work()}
            except BaseException as exc:
                answer = {"error": "%s: %s" % (type(exc).__name__, exc)}
            os.write(write_end, json.dumps(answer).encode())
        finally:
            os._exit(0)  # (this process's other exit hooks, the emulator's among them, belong to the parent)
    os.close(write_end)
    deadline = time.monotonic() + TIMEOUT
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child did not finish within %ss" % TIMEOUT)
        time.sleep(0.05)
    with os.fdopen(read_end, "rb") as answer_file:
        answer = json.loads(answer_file.read() or b'{"error": "no answer"}')
    assert "error" not in answer, answer["error"]
    return answer["ok"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_neither_cancels_nor_unmounts_its_parents_job_and_starts_its_own(emu):
    # The child once inherited the parent's safety nets and shared proxy: its exit hook cancelled the parent's jobs
    # and shut the listener both share, and its own start mounted on a proxy no thread of its serves (404).
    settings = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command(), poll_interval_s=0.05)
    parent = hsp.HFSandboxProvider(IMAGE, **settings)  # on the process's shared in-process proxy
    try:
        parent.wait_for_ready(parent.start_container())

        def child() -> str:
            parent.stop_container()  # an inherited copy: the parent's job is not the child's to end
            own = hsp.HFSandboxProvider(IMAGE, **settings)
            own.wait_for_ready(own.start_container())
            status = requests.get(own.base_url + "/health", timeout=10).status_code
            own.stop_container()
            hsp._stop_everything_at_exit()  # what a normal exit of the child runs
            return "own job served %d" % status

        assert _in_forked_child(child) == "own job served 200"
        assert emu.job(parent.job_id).stage == "RUNNING"
        assert requests.get(parent.base_url + "/health", timeout=10).status_code == 200
        own = next(job for job in emu.jobs if job.id != parent.job_id)
        wait_until(lambda: own.stage == "CANCELED", "the child's own job to be cancelled (by the child)")
    finally:
        parent.stop_container()
    wait_until(lambda: emu.job(parent.job_id).stage == "CANCELED", "the parent's job to be cancelled by the parent")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_while_another_thread_cancels_a_job_leaves_the_childs_exit_neither_waiting_for_it_nor_naming_it():
    # The parent's cancel thread does not exist in the child: its exit hook would wait out EXIT_SETTLE_S for it,
    # then warn that the parent's job may run on.
    under_way, release = threading.Event(), threading.Event()

    def cancel() -> None:
        with hsp._unsettled_while("the cancel of HF job parent-1", "sweep"):
            under_way.set()
            release.wait(TIMEOUT)

    thread = threading.Thread(target=cancel, daemon=True)
    thread.start()
    assert under_way.wait(TIMEOUT)
    try:
        def child() -> List[str]:
            said: List[str] = []
            handler = logging.Handler(logging.WARNING)
            handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
            logging.getLogger("hf_sandbox_provider").addHandler(handler)
            hsp._stop_everything_at_exit()  # what a normal exit of the child runs
            return [line for line in said if "parent-1" in line]

        assert _in_forked_child(child) == []
    finally:
        release.set()
        thread.join(TIMEOUT)


def test_one_job_cancelled_by_two_threads_stays_waited_for_until_both_cancels_end(caplog):
    # The registry was keyed by the job alone: the first cancel to end took the second's entry with it, and the
    # exit hook then neither waited for the second cancel nor named its job.
    first_in, second_in, first_out, second_out = (threading.Event() for _ in range(4))

    def cancel(came_in: threading.Event, leave: threading.Event) -> None:
        with hsp._unsettled_while("the cancel of HF job twice-1", "sweep"):
            came_in.set()
            leave.wait(TIMEOUT)

    threads = [threading.Thread(target=cancel, args=args, daemon=True)
               for args in ((first_in, first_out), (second_in, second_out))]
    for thread in threads:
        thread.start()
    assert first_in.wait(TIMEOUT) and second_in.wait(TIMEOUT)
    first_out.set()
    threads[0].join(TIMEOUT)
    try:
        with caplog.at_level(logging.WARNING, logger="hf_sandbox_provider"):
            hsp._settle(0.2)
        named = [r.getMessage() for r in caplog.records if "twice-1" in r.getMessage()]
        assert len(named) == 1 and "the cancel of HF job twice-1 had not ended" in named[0], named
    finally:
        second_out.set()
        threads[1].join(TIMEOUT)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_sandbox_provider"):
        hsp._settle(0.2)
    assert not [r for r in caplog.records if "twice-1" in r.getMessage()]


def _status_in_a_child(action) -> int:
    """Run `action` in a forked child; its exit status: 0 if it raised SessionError, 1 if it returned, 2 else."""
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            action()
            code = 1
        except Exception as exc:
            code = 0 if type(exc).__name__ == "SessionError" else 2
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_plain_env_session_inherited_over_fork_is_refused_in_the_child_and_the_parents_episode_goes_on():
    with EchoServer(step_delay_s=0.3) as server:
        session = hsp.EnvSession("http://127.0.0.1:%d" % server.port, timeout_s=5)
        session.reset()

        def give_up_on_a_reply():
            session.timeout_s = 0.05
            session.step({"message": "from the child"})

        assert _status_in_a_child(give_up_on_a_reply) == 0  # refused: it would have talked on the parent's socket
        assert _status_in_a_child(session.close) == 1  # closes only its own descriptor
        reply = session.step({"message": "from the parent"})
        assert reply["observation"]["echoed_message"] == "from the parent"
        assert session.state()["step_count"] == 1
        session.close()
