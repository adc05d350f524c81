"""`python -m hf_sandbox_provider sweep --older-than`: real subprocesses against the local Jobs emulator."""

from __future__ import annotations

import datetime
import sys

import pytest

import hf_sandbox_cli as cli
import hf_sandbox_provider as hsp
from hf_jobs_emulator import JobsEmulator
from test_cli import clean_env, run

# Every test here runs the CLI or a script as a subprocess (seconds each): the slow tier.
pytestmark = pytest.mark.slow

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def start_sleeper(emulator):
    provider = hsp.HFSandboxProvider("python:3.12", endpoint=emulator.endpoint, token=emulator.token,
                                     command=SLEEPER, poll_interval_s=0.05)
    provider.start_container()
    return provider


def test_sweep_older_than_cancels_only_jobs_created_before_the_cutoff_and_lists_age_and_flavor(tmp_path):
    with JobsEmulator() as emulator:
        old, young = start_sleeper(emulator), start_sleeper(emulator)
        try:  # backdate one job as if a trainer had crashed two hours ago
            emulator.job(old.job_id).created_at -= datetime.timedelta(hours=2)
            env = clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token)
            dry = run(["sweep", "--dry-run", "--older-than", "1h"], env)
            assert dry.returncode == 0, dry.stderr
            assert "would cancel %s (RUNNING, cpu-basic, 2.0h old)" % old.job_id in dry.stdout
            assert "skipped %s" % young.job_id in dry.stdout and "younger than 1h" in dry.stdout
            swept = run(["sweep", "--older-than", "1h"], env)
            assert swept.returncode == 0, swept.stderr
            assert "cancelled %s" % old.job_id in swept.stdout
            assert emulator.wait_for_stage(old.job_id, ["CANCELED"]).stage == "CANCELED"
            assert emulator.job(young.job_id).stage == "RUNNING"
            assert "1 leftover job(s)" in swept.stdout
        finally:
            hsp.stop_all([old, young])


def test_sweep_without_older_than_cancels_young_jobs_too(tmp_path):
    with JobsEmulator() as emulator:
        young = start_sleeper(emulator)
        try:
            env = clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token)
            swept = run(["sweep"], env)
            assert swept.returncode == 0 and "cancelled %s" % young.job_id in swept.stdout
            assert "s old)" in swept.stdout
        finally:
            young.stop_container()


def test_sweep_refuses_an_unparseable_duration_before_any_call(tmp_path):
    result = run(["sweep", "--older-than", "soon"], clean_env(tmp_path, HF_ENDPOINT="http://127.0.0.1:9",
                                                              HF_TOKEN="hf_unused"))
    assert result.returncode == 2
    assert "--older-than 'soon' is not a duration" in result.stderr and "30m" in result.stderr


def test_job_age_is_read_from_created_at_and_unknown_when_absent():
    now = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.timezone.utc).timestamp()
    assert cli._job_age_s({"createdAt": "2026-01-01T11:30:00.000Z"}, now) == 1800
    assert cli._job_age_s({"createdAt": "not a date"}, now) is None
    assert cli._job_age_s({}, now) is None
    assert cli._format_age(None) == "age unknown" and cli._format_age(90) == "90s old"
    assert cli._format_age(1800) == "30m old" and cli._format_age(7200) == "2.0h old"


def test_sweep_finds_and_cancels_the_jobs_of_a_trainer_killed_without_any_cleanup(tmp_path):
    import signal
    import subprocess
    import textwrap

    from test_cli import REPO, RUN_TIMEOUT_S

    trainer = textwrap.dedent("""
        import sys, time, hf_sandbox_provider as hsp
        providers = [hsp.HFSandboxProvider("python:3.12", endpoint=sys.argv[1], token=sys.argv[2],
                                           command=[sys.executable, "-c", "import time; time.sleep(60)"],
                                           poll_interval_s=0.05) for _ in range(3)]
        for provider in providers:
            provider.start_container()
        print(" ".join(p.job_id for p in providers), flush=True)
        time.sleep(60)
    """)
    with JobsEmulator() as emulator:
        proc = subprocess.Popen([sys.executable, "-c", trainer, emulator.endpoint, emulator.token],
                                cwd=REPO, env=clean_env(tmp_path), stdout=subprocess.PIPE, text=True)
        try:
            job_ids = proc.stdout.readline().split()
            assert len(job_ids) == 3
            proc.send_signal(signal.SIGKILL)  # no atexit hook, no finalizer: the jobs keep running
            proc.wait(RUN_TIMEOUT_S)
            assert all(emulator.job(job_id).stage == "RUNNING" for job_id in job_ids)
            swept = run(["sweep"], clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token))
            assert swept.returncode == 0, swept.stderr
            for job_id in job_ids:
                assert "cancelled %s" % job_id in swept.stdout
                assert emulator.wait_for_stage(job_id, ["CANCELED"]).stage == "CANCELED"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(RUN_TIMEOUT_S)
            proc.stdout.close()
