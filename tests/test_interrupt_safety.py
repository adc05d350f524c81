"""An interrupt (Ctrl-C, a teardown signal's handler, pytest-timeout's alarm) that lands in the main thread as
it takes one of the library's locks leaves no lock held. `with cond:` on a threading.Condition runs
Condition.__enter__, which is Python code: a handler can raise there after the acquire and before the `with`
block exists, and the lock stays held for ever. A CI run sat for an hour that way: the cancel registry's
Condition was left held by the main thread, and every later create in another thread blocked on it. The
library enters each Condition's lock itself (a C lock: no such gap), and these tests hold it to that."""
from __future__ import annotations

import ast
import gc
import os
import signal
import sys
import threading
import weakref
from typing import Callable, List, Optional, Set

import pytest
import requests

import hf_sandbox_provider as hsp
from support import LIBRARY_MODULES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOIN_S = 10


def _conditions_entered_with_with(path: str) -> List[str]:
    """`with X:` where X names something assigned a threading.Condition in the same module (by its last name)."""
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)

    def last_name(node: ast.AST) -> str:
        return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""

    conditions: Set[str] = set()
    for node in ast.walk(tree):
        value = getattr(node, "value", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(value, ast.Call) and (
                last_name(value.func) == "Condition"):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            conditions.update(last_name(target) for target in targets)
    return ["%s:%d with %s" % (os.path.basename(path), node.lineno, last_name(item.context_expr))
            for node in ast.walk(tree) if isinstance(node, ast.With) for item in node.items
            if last_name(item.context_expr) in conditions - {""}]


def test_the_condition_scan_finds_a_condition_entered_by_with(tmp_path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import threading\nlock = threading.Lock()\nCHANGED = threading.Condition(lock)\n"
                      "class A:\n    def __init__(self):\n        self._cond = threading.Condition()\n"
                      "    def f(self):\n        with self._cond:\n            pass\n        with lock:\n"
                      "            CHANGED.notify_all()\n        with CHANGED:\n            pass\n")
    assert [found.split(" ", 1)[1] for found in _conditions_entered_with_with(str(sample))] == [
        "with _cond", "with CHANGED"]


def test_no_library_module_enters_a_condition_through_its_python_enter() -> None:
    found = [use for module in LIBRARY_MODULES for use in _conditions_entered_with_with(os.path.join(ROOT, module))]
    assert found == [], "enter the Condition's own lock instead (`with lock:`): %s" % found


class _RaiseAfterALibraryAcquire:
    """A profile hook that raises KeyboardInterrupt, once, where a signal handler's raise is possible and
    harmful: on return from a lock's acquire made inside Condition.__enter__ called from library code."""

    def __init__(self) -> None:
        self.raised = False

    def __call__(self, frame, event: str, arg) -> None:
        if (not self.raised and event == "c_return" and getattr(arg, "__name__", "") in ("__enter__", "acquire")
                and frame.f_code.co_name == "__enter__" and frame.f_back is not None
                and os.path.basename(frame.f_back.f_code.co_filename) in LIBRARY_MODULES):
            self.raised = True
            raise KeyboardInterrupt("landed just after the acquire")


def _interrupted_once(action: Callable[[], None], hook: Optional[Callable[..., None]] = None) -> None:
    """Run `action` with `hook` (by default _RaiseAfterALibraryAcquire) as the profile hook; its raise is expected."""
    sys.setprofile(hook or _RaiseAfterALibraryAcquire())
    try:
        action()
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)


def _runs_in_another_thread(action: Callable[[], None]) -> bool:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    thread.join(JOIN_S)
    return not thread.is_alive()


def test_an_interrupt_as_a_cancel_is_recorded_leaves_other_threads_free_to_record_theirs_and_exit() -> None:
    def record(what: str) -> Callable[[], None]:
        def action() -> None:
            with hsp._unsettled_while(what, "sweep"):
                pass
        return action

    _interrupted_once(record("the cancel of HF job main-1"))
    assert _runs_in_another_thread(record("the cancel of HF job other-1")), "the other thread's cancel blocked"
    assert _runs_in_another_thread(lambda: hsp._settle(1.0)), "the exit hook's wait blocked"
    assert not [key for key in list(hsp._unsettled) if "main-1" in key[0] or "other-1" in key[0]]


def test_an_interrupt_as_a_job_is_watched_leaves_the_watcher_free_for_other_jobs() -> None:
    watcher = hsp._JobWatcher()

    def watch_and_unwatch(job_id: str) -> Callable[[], None]:
        def action() -> None:
            watch = watcher.register("http://127.0.0.1:9", "hf_not_a_token", requests.Session, "ns", job_id, 60.0,
                                     threading.Event())
            watcher.unregister(watch)
        return action

    _interrupted_once(watch_and_unwatch("main-1"))
    assert _runs_in_another_thread(watch_and_unwatch("other-1")), "the watcher's lock was left held"


class _RaiseAfterTheNthMaskChange:
    """A profile hook that raises KeyboardInterrupt on return from the `nth` pthread_sigmask call made by
    proxy._library_signal_mask: where a handler of a signal that came just before could raise."""

    def __init__(self, nth: int) -> None:
        self.calls, self.nth = 0, nth

    def __call__(self, frame, event: str, arg) -> None:
        # (signal.pthread_sigmask is a Python wrapper: its C call returns inside it, called from the mask's frame)
        if event == "c_return" and getattr(arg, "__name__", "") == "pthread_sigmask" and frame.f_back is not None and (
                frame.f_back.f_code.co_name == "_library_signal_mask"):
            self.calls += 1
            if self.calls == self.nth:
                raise KeyboardInterrupt("landed just after a mask change")


def test_a_finalizer_the_garbage_collector_runs_inside_register_may_unregister_without_a_deadlock() -> None:
    # A slot's start collected unstopped unregisters its watches from a weakref finalizer, run wherever the garbage
    # collector happens to run: here while register() holds the watcher's lock to make a group thread. With a plain
    # Lock that thread hung, and every later start of the process behind it (found by the clean-clone CI run).
    watcher = hsp._JobWatcher()

    def watch(endpoint: str, job_id: str) -> "hsp._Watch":
        return watcher.register(endpoint, "hf_not_a_token", requests.Session, "ns", job_id, 60.0, threading.Event())

    dropped = watch("http://127.0.0.1:9", "dropped-1")
    cycle: dict = {}
    cycle["self"] = cycle
    holder = _Collectable()
    holder.cycle = cycle
    cycle["holder"] = holder
    weakref.finalize(holder, watcher.unregister, dropped)
    del holder, cycle  # garbage now, collected at the next gc.collect()
    made: List["hsp._Watch"] = []

    def collect_as_a_thread_is_made(frame, event: str, arg) -> None:
        if event == "call" and frame.f_code is threading.Thread.__init__.__code__:
            sys.setprofile(None)
            gc.collect()  # what an allocation inside register() may set off

    def register_with_a_collection_inside() -> None:
        sys.setprofile(collect_as_a_thread_is_made)
        try:
            made.append(watch("http://127.0.0.1:10", "other-1"))
        finally:
            sys.setprofile(None)

    assert _runs_in_another_thread(register_with_a_collection_inside), "register() deadlocked on its own lock"
    assert made and not [g for g in watcher._groups.values() if dropped in g.watches]
    watcher.unregister(made[0])


class _Collectable:
    """An object a weakref finalizer can watch (a dict cannot be weakly referenced)."""


class _HeldWatcher(hsp._JobWatcher):
    """A job watcher whose group threads wait for `go` before their first look, so a register can come first."""

    def __init__(self) -> None:
        super().__init__()
        self.go, self.threads = threading.Event(), []

    def _run(self, key, group) -> None:
        self.threads.append(threading.current_thread())
        self.go.wait(JOIN_S)
        super()._run(key, group)


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no per-thread signal masks")
def test_an_interrupt_just_after_a_watch_groups_thread_began_leaves_that_thread_serving_the_next_watch() -> None:
    # register() took it for a refused thread and forgot the group; the thread, running all the same, then forgot
    # the next caller's group by its key: that watch was never unregistered and was refreshed for good (review).
    watcher = _HeldWatcher()

    def watch(job_id: str) -> "hsp._Watch":
        return watcher.register("http://127.0.0.1:9", "hf_not_a_token", requests.Session, "ns", job_id, 60.0,
                                threading.Event())

    _interrupted_once(lambda: watch("main-1"), _RaiseAfterTheNthMaskChange(3))  # the mask restored: it runs
    assert len(watcher.threads) == 1
    other = watch("other-1")
    (group,) = watcher._groups.values()
    assert group.watches == [other] and group.thread is watcher.threads[0]  # no second thread for the group
    watcher.go.set()
    watcher.unregister(other)
    for thread in watcher.threads:
        thread.join(JOIN_S)
    assert watcher._groups == {} and not [t for t in watcher.threads if t.is_alive()]


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no per-thread signal masks")
@pytest.mark.parametrize("nth", [1, 2])
def test_an_interrupt_as_a_library_thread_starts_leaves_the_main_threads_signal_mask_as_it_was(nth: int) -> None:
    # The block was made before its try: a raise right after it left SIGINT, SIGTERM and SIGALRM blocked in the
    # main thread for good, so Ctrl-C, a SIGTERM and pytest-timeout's alarm never reached it again.
    import proxy

    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        _interrupted_once(lambda: proxy._start_thread(threading.Thread(target=lambda: None, daemon=True)),
                          _RaiseAfterTheNthMaskChange(nth))
    finally:
        after = signal.pthread_sigmask(signal.SIG_SETMASK, before)  # (put back for the rest of the suite)
    assert after == before, "left blocked: %s" % sorted(after - before)
