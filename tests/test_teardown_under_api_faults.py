"""A trainer (a real subprocess) ended by Ctrl-C or SIGTERM while the Hub is slow or refusing calls: the cancels
and creates still under way are waited for within the exit's budget, and any left is named with the sweep that
finds its job, never dropped silently with its job billing on."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

from hf_jobs_emulator import JobsEmulator, echo_server_command, spawn_process
from support import signalled, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENVS = 4
CHILD_TIMEOUT_S = 90.0

# start_many(ENVS) echo environments, "started", then stop_all() on a line from the parent, which interrupts it.
CHILD = textwrap.dedent('''
    import json, sys
    import hf_sandbox_provider as hsp
    settings, teardown = json.loads(sys.argv[1]), sys.argv[2] == "teardown"
    if teardown:
        hsp.install_signal_teardown()
    print("starting", flush=True)
    providers = hsp.HFSandboxProvider.start_many(ENVS, "img:tag", progress=False, **settings)
    print("started", flush=True)
    sys.stdin.readline()
    print("stopping", flush=True)
    hsp.stop_all(providers)
    print("stopped", flush=True)
''').replace("ENVS", str(ENVS))


def _child(emu: JobsEmulator, teardown: bool) -> subprocess.Popen:
    settings = {"endpoint": emu.endpoint, "token": emu.token, "poll_interval_s": 0.05,
                "command": echo_server_command()}
    # spawn_process: the child gets the default SIGINT (Ctrl-C) even when the suite runs with it ignored (nohup,
    # a script's background job), as Python installs no KeyboardInterrupt handler for an ignored SIGINT.
    return spawn_process([sys.executable, "-c", CHILD, json.dumps(settings), "teardown" if teardown else "-"],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_until(child: subprocess.Popen, line: str) -> None:
    for got in child.stdout:
        if got.strip() == line:
            return
    raise AssertionError("the child ended before printing %r: %s" % (line, child.stderr.read()))


def test_ctrl_c_during_a_stop_all_whose_cancels_wait_out_a_429_still_cancels_every_job_at_exit(make_emu):
    emu = make_emu()
    child = _child(emu, teardown=False)
    try:
        _read_until(child, "started")
        emu.inject_rate_limit(2 * ENVS, retry_after_s=4, routes=["cancel"])  # each cancel waits out two 429s
        child.stdin.write("stop\n")
        child.stdin.flush()
        _read_until(child, "stopping")
        wait_until(lambda: emu.api_calls.get("cancel", 0) >= ENVS, "every cancel's first (429) answer")
        child.send_signal(signal.SIGINT)  # while they wait it out: the natural answer to a stop that looks stuck
        _, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "KeyboardInterrupt" in err
    # before: the exit found no safety net (each stop had retired its own) and killed the cancels' threads
    wait_until(lambda: all(job.terminal for job in emu.jobs), "every job to end", 10)
    assert sorted(job.stage for job in emu.jobs) == ["CANCELED"] * ENVS, err


def _sigterm_while_creates_wait_longer_than_the_teardown(emu: JobsEmulator) -> str:
    """SIGTERM a start_many child while the Hub, which made every job at once, holds each create's answer
    past the signal teardown's budget; returns the child's stderr."""
    emu.delay_next_create_answers(ENVS, 12.0)
    child = _child(emu, teardown=True)
    try:
        _read_until(child, "starting")
        wait_until(lambda: len(emu.jobs) == ENVS, "every job to be made while its create waits")
    finally:
        _, err = signalled(child, signal.SIGTERM, CHILD_TIMEOUT_S)
    assert child.returncode == -signal.SIGTERM, err
    return err


def test_sigterm_while_creates_wait_longer_than_the_teardown_cancels_each_job_found_by_its_start_label(make_emu):
    emu = make_emu()
    err = _sigterm_while_creates_wait_longer_than_the_teardown(emu)
    # before: each create was named with its sweep, and its job ran on until the Hub's timeout
    for job in emu.jobs:
        assert emu.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED", (job, err)
    assert "had not ended" not in err, err


def test_sigterm_while_creates_wait_and_the_listing_fails_names_each_unanswered_create_with_its_sweep(make_emu):
    emu = make_emu()
    emu.inject_server_errors(1000, routes=["list"])  # nothing can be looked up by its start label
    err = _sigterm_while_creates_wait_longer_than_the_teardown(emu)
    # before the names: the teardown waited its 4 s, the process died, and no line named any job or label
    named = re.findall(r"the create of start (\w+) had not ended as this process exits .* `python -m "
                       r"hf_sandbox_provider sweep --label hf-sandbox-start=(\w+)`", err)
    assert sorted(label for label, again in named if label == again) == sorted(
        job.spec["labels"]["hf-sandbox-start"] for job in emu.jobs), err  # (the emulator's stop ends them)
