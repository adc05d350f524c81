"""README promises that had no guard of their own, each proved through the library's own path against the
emulator (section names are README's): a malformed HF_SANDBOX_RATE_LIMIT is refused before any call and a
well-formed one paces the library's calls while cancels still go through (Errors, Many environments);
a stop that cannot wait for a start to end warns naming what to look for, and the job is still
cancelled (Cost safety); start_many keeps at most `max_parallel` starts in flight (Many environments)."""

from __future__ import annotations

import logging
import threading

import pytest

import hf_sandbox_provider as hsp
from hf_jobs_emulator import echo_server_command
from support import in_thread, wait_until

IMAGE = "registry.hf.space/openenv-echo-env:latest"
HELD_WINDOW_S = 2.0  # how long a start held by the API budget is watched for calls it should not make


def _provider(emu, proxy, **kwargs) -> hsp.HFSandboxProvider:
    options = dict(endpoint=emu.endpoint, token=emu.token, proxy=proxy, command=echo_server_command(),
                   poll_interval_s=0.05, start_timeout_s=60, ready_timeout_s=60)
    options.update(kwargs)
    return hsp.HFSandboxProvider(IMAGE, **options)


# -- Errors: a malformed HF_SANDBOX_RATE_LIMIT ---------------------------------------------------------


@pytest.mark.parametrize("value", ["lots", "0/300", "100/0", "100/soon", "-5/300"])
def test_a_malformed_rate_limit_setting_is_refused_before_any_jobs_api_call(make_emu, proxy, monkeypatch, value):
    emu = make_emu()
    monkeypatch.setenv(hsp.RATE_LIMIT_ENV, value)
    provider = _provider(emu, proxy)
    with pytest.raises(hsp.SandboxConfigError, match="HF_SANDBOX_RATE_LIMIT=%r" % value):
        provider.start_container()
    assert emu.api_calls == {} and emu.jobs == []


# -- Many environments: the budget follows HF_SANDBOX_RATE_LIMIT; cancels are never held --------------


def test_the_rate_limit_setting_holds_the_librarys_calls_and_a_stop_still_cancels_the_job(make_emu, proxy,
                                                                                           monkeypatch):
    # 8 calls a 10-minute window with a server that sends no RateLimit headers: once only the teardown
    # reserve (RATE_LIMIT_RESERVE_MIN) is left, the start's job watcher waits for the window to pass.
    emu = make_emu()
    monkeypatch.setenv(hsp.RATE_LIMIT_ENV, "8/600")
    provider = _provider(emu, proxy)
    thread, errors = in_thread(provider.start_container)
    wait_until(lambda: emu.jobs and emu.jobs[0].stage == "RUNNING", "the job to run")
    # Unheld, the watcher (polling every 0.05 s) would see RUNNING and the URL well within this window.
    threading.Event().wait(HELD_WINDOW_S)
    assert thread.is_alive() and provider.base_url is None, errors
    assert sum(emu.api_calls.values()) == 8 - hsp.RATE_LIMIT_RESERVE_MIN, emu.api_calls
    provider.stop_container()  # the cancel spends the reserve: it is not held
    assert emu.wait_for_stage(emu.jobs[0].id, ["CANCELED"]).stage == "CANCELED"
    thread.join(30)
    assert not thread.is_alive() and isinstance(errors[0], hsp.SandboxError)


# -- Cost safety: a stop that cannot wait for its start --------------------------------------------------


def test_a_stop_whose_start_outlasts_the_wait_warns_with_the_start_label_and_the_job_is_still_cancelled(
        make_emu, proxy, monkeypatch, caplog):
    emu = make_emu()
    monkeypatch.setattr(hsp, "STOP_WAIT_S", 0.5)  # README: 30 s; the rule, not its length, is under test
    emu.delay_next_create_answers(1, 3.0)  # the create is in flight when the stop comes
    provider = _provider(emu, proxy)
    thread, errors = in_thread(provider.start_container)
    wait_until(lambda: emu.create_answers_held == 1, "the create to be in flight")
    label = emu.jobs[0].spec["labels"][hsp.START_LABEL_KEY]  # the job already exists; its answer is held
    provider.stop_container()
    assert thread.is_alive()  # returned after STOP_WAIT_S, not after the start
    warning = [r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING and "has not ended" in r.getMessage()]
    assert warning and "%s=%s" % (hsp.START_LABEL_KEY, label) in warning[0] and "sweep" in warning[0]
    thread.join(30)
    assert not thread.is_alive() and isinstance(errors[0], hsp.SandboxError)
    assert len(emu.jobs) == 1
    assert emu.wait_for_stage(emu.jobs[0].id, ["CANCELED"]).stage == "CANCELED"


# -- Many environments: start_many's bound ---------------------------------------------------------------


def test_start_many_keeps_at_most_max_parallel_creates_in_flight(make_emu, proxy):
    emu = make_emu()
    emu.delay_next_create_answers(6, 0.4)  # long enough that unbounded starts would overlap
    providers = hsp.HFSandboxProvider.start_many(6, IMAGE, max_parallel=2, progress=False,
                                                 endpoint=emu.endpoint, token=emu.token, proxy=proxy,
                                                 command=echo_server_command(), poll_interval_s=0.05)
    try:
        assert len(emu.jobs) == 6 and emu.create_answers_peak == 2
    finally:
        hsp.stop_all(providers)
