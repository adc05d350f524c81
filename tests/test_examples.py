"""Every example's `--local` path, run as a real subprocess against the local Jobs emulator.

Each run carries a unique marker in its environment, which the emulator's job processes (and the TRL
example's spawned worker) inherit; after the run no live process may still carry it, so a job or
worker left behind fails the test even if the example claimed to have cleaned up.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import uuid
from typing import List

import pytest

# Every test here runs the CLI or a script as a subprocess (seconds each): the slow tier.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
# Generous: the machine running the suite may be heavily loaded; a healthy run takes a few seconds.
RUN_TIMEOUT_S = 110.0
LEFTOVER_WAIT_S = 5.0
MARKER_VAR = "HF_SANDBOX_EXAMPLE_RUN"
# A token-shaped string in any output means a token leaked into a print or a log line.
TOKEN_SHAPE = re.compile(r"hf_[A-Za-z]{30,}")  # HF and emulator tokens: hf_ + 34 letters


class Run:
    def __init__(self, proc: "subprocess.CompletedProcess[str]", marker: str) -> None:
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr
        self.marker = marker

    def __repr__(self) -> str:  # shown by pytest when an assertion fails
        return "<exit %s>\n--- stdout ---\n%s\n--- stderr ---\n%s" % (self.code, self.out, self.err)


def _processes_carrying(marker: str) -> List[int]:
    """Live processes whose environment holds the marker (Linux /proc; elsewhere none are seen)."""
    found: List[int] = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as handle:
                if marker.encode() in handle.read():
                    found.append(int(name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _kill_leftovers(marker: str) -> List[int]:
    """SIGKILL the processes a run left behind (found by its marker, so only ours); returns their pids."""
    leftovers = _processes_carrying(marker)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return leftovers


def run_example(script: str, *args: str, home: str) -> Run:
    """Run examples/<script> with args; assert that no process it started outlives it."""
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")}
    env.update({MARKER_VAR: marker, "HF_HOME": home, "PYTHONUNBUFFERED": "1"})
    try:
        proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        _kill_leftovers(marker)  # its job processes (own process groups) survive its kill
        pytest.fail("%s %s did not finish within %gs; output so far:\n%s" % (script, " ".join(args), RUN_TIMEOUT_S,
                                                                            exc.stdout))
    run = Run(proc, marker)
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while _processes_carrying(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _kill_leftovers(marker) == [], "processes outlived the example: %r" % run
    assert not TOKEN_SHAPE.search(run.out + run.err), "a token appeared in the output: %r" % run
    return run


@pytest.fixture
def home(tmp_path) -> str:
    """An empty HF_HOME: no token file to discover."""
    return str(tmp_path)


def test_legacy_http_client_runs_an_episode_and_cancels_its_job(home: str) -> None:
    run = run_example("legacy_http_client.py", "--local", home=home)
    assert run.code == 0, run
    assert "step   -> 'Hello'" in run.out, run
    assert "episode done: total reward 2.9" in run.out, run  # 0.1 per echoed character
    assert re.search(r"sandbox stopped: job \w+ is CANCELED", run.out), run
    assert "1 jobs run, 0 job processes left" in run.out, run


def test_openenv_client_runs_a_sync_and_an_async_episode(home: str) -> None:
    run = run_example("openenv_client.py", "--local", home=home)
    assert run.code == 0, run
    assert "both episodes done: total reward sync 3.5, async 3.5" in run.out, run
    assert len(re.findall(r"job \w+ is CANCELED", run.out)) == 2, run
    assert "2 jobs run, 0 job processes left" in run.out, run


def test_many_envs_runs_24_episodes_from_threads(home: str) -> None:
    run = run_example("many_envs.py", "--local", home=home)
    assert run.code == 0, run
    assert "24 environments ready" in run.out, run
    assert "24 of 24 episodes x 5 steps done" in run.out, run
    assert "still running: none" in run.out, run
    assert "24 jobs run, 0 job processes left" in run.out, run
    assert "FAILED" not in run.err, run


def test_many_envs_exits_nonzero_naming_the_environment_whose_job_died(home: str) -> None:
    run = run_example("many_envs.py", "--local", "--n", "4", "--kill-env", "2", home=home)
    assert run.code == 1, run
    failures = re.findall(r"FAILED environment (\d+) \(job \w+\): (.*)", run.err)
    assert failures == [("2", "SessionRefusedError: the WebSocket was refused: HTTP 502 from the proxy "
                              "(upstream-unreachable: the job is gone or not serving; start a new one)")], run
    assert "3 of 4 episodes" in run.out, run
    assert "still running: none" in run.out and "4 jobs run, 0 job processes left" in run.out, run


def test_many_envs_start_failure_cancels_every_job_and_exits_nonzero(home: str) -> None:
    run = run_example("many_envs.py", "--local", "--n", "4", "--fault", "crash-at-boot=boom-at-boot", home=home)
    assert run.code == 1, run
    assert "error: StartManyError" in run.err and "boom-at-boot" in run.err, run
    assert "episodes" not in run.out, run  # no episode ran on a partial fleet
    assert "0 job processes left" in run.out, run


def test_many_envs_pooled_kill_env_kills_the_host_job_and_reports_every_environment_on_it(home: str) -> None:
    if importlib.util.find_spec("cryptography") is None:
        pytest.skip("--local --pool needs cryptography (the emulator's TLS hosts)")
    run = run_example("many_envs.py", "--local", "--pool", "ex-pool", "--n", "3", "--kill-env", "1", home=home)
    assert run.code == 1, run
    assert "killed environment 1's host job" in run.out, run
    assert sorted(re.findall(r"FAILED environment (\d+) ", run.err)) == ["0", "1", "2"], run  # one host for all
    assert "still running: none" in run.out and "0 job processes left" in run.out, run


def test_many_envs_pooled_fault_reaches_the_host_jobs_and_an_unknown_fault_is_a_usage_error(home: str) -> None:
    if importlib.util.find_spec("cryptography") is None:
        pytest.skip("--local --pool needs cryptography (the emulator's TLS hosts)")
    run = run_example("many_envs.py", "--local", "--pool", "ex-pool", "--n", "2", "--fault",
                      "crash-at-boot=boom-on-the-host", home=home)
    assert run.code == 1 and "boom-on-the-host" in run.err and "episodes" not in run.out, run
    assert "0 job processes left" in run.out, run
    run = run_example("many_envs.py", "--local", "--n", "2", "--fault", "no-such-fault=1", home=home)
    assert run.code == 2 and "no-such-fault: unknown fault" in run.err and "crash-at-boot" in run.err, run


def test_trl_example_runs_an_episode_here_and_from_its_pickled_factory_in_a_spawned_worker(home: str) -> None:
    run = run_example("trl_environment_factory.py", "--local", home=home)
    assert run.code == 0, run
    assert "tools TRL would offer the model: ['echo']" in run.out, run
    here = re.search(r"\[this process\]   job (\w+): 3 tool calls, reward 4\.3 \(pid (\d+)\)", run.out)
    worker = re.search(r"\[spawned worker\] job (\w+): 3 tool calls, reward 4\.3 \(pid (\d+), inside a running "
                       r"event loop\)", run.out)
    assert here and worker, run
    assert here.group(1) != worker.group(1) and here.group(2) != worker.group(2), run  # own job, own process
    assert "2 jobs run, 0 job processes left" in run.out, run


@pytest.mark.parametrize("script", ["legacy_http_client.py", "openenv_client.py", "many_envs.py",
                                    "trl_environment_factory.py"])
def test_hub_mode_without_a_token_exits_2_with_the_fix(script: str, home: str) -> None:
    run = run_example(script, home=home)
    assert run.code == 2, run
    assert "no Hugging Face token found" in run.err and "smoke --local" in run.err, run


def test_trl_train_checks_the_token_before_it_loads_a_model(home: str) -> None:
    if not all(importlib.util.find_spec(name) for name in ("trl", "datasets", "torch")):
        pytest.skip("--train needs trl, datasets and torch (pip install '.[trl]')")
    run = run_example("trl_environment_factory.py", "--train", "--model", "no-such-org/no-such-model", home=home)
    assert run.code == 2, run  # a model load would have failed first, naming the model
    assert "no Hugging Face token found" in run.err and "no-such-model" not in run.out + run.err, run


def test_failure_injection_without_local_is_a_usage_error(home: str) -> None:
    run = run_example("many_envs.py", "--kill-env", "1", home=home)
    assert run.code == 2, run
    assert "add --local" in run.err, run


# -- the examples' classes in this process, against an in-process emulator or echo server ----------


@pytest.fixture
def common():
    """examples/_common.py, imported the way the examples import it."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import _common
    return _common


@pytest.fixture
def trl_example(common):
    import trl_environment_factory
    return trl_environment_factory


@pytest.fixture
def emulator(log_guard):
    from hf_jobs_emulator import JobsEmulator, echo_server_command
    with JobsEmulator() as emu:
        log_guard.watch(emu.token)
        emu.provider_settings = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command())
        yield emu
    assert emu.live_pids() == []


def test_trl_environment_offers_only_echo_as_a_tool_and_needs_reset_first(trl_example) -> None:
    env = trl_example.EchoSandboxEnv("any/image:tag", token="hf_unused", begin=False)
    # TRL 1.16's rule: plain and static methods except reset/get_reward; close_all (a classmethod) is no tool
    assert trl_example.trl_tools(env) == ["echo"]
    assert callable(trl_example.EchoSandboxEnv.close_all) and env.get_reward() == 0.0
    with pytest.raises(RuntimeError, match=r"call reset\(\)"):
        env.echo("too early")


def test_trl_environment_pickles_until_its_own_sandbox_begins_and_a_shared_one_always(trl_example, emulator) -> None:
    lazy = trl_example.EchoSandboxEnv("any/image:tag", begin=False, **emulator.provider_settings)
    clone = pickle.loads(pickle.dumps(lazy))
    with trl_example.EchoSandboxEnv("any/image:tag", **emulator.provider_settings) as begun:
        with pytest.raises(TypeError, match=r"cannot pickle a Sandbox that has begun"):
            pickle.dumps(begun)
        begun.reset()
        assert begun.echo("mine") == "mine"
    assert emulator.wait_for_stage(begun.job_id, ["CANCELED"]).stage == "CANCELED"
    shared = trl_example.EchoSandboxEnv("any/image:tag", shared="pickle-test", **emulator.provider_settings)
    try:
        shared.reset()
        copy = pickle.loads(pickle.dumps(shared))  # in this process the copy joins the same group
        copy.reset()
        assert copy.job_id == shared.job_id and copy.echo("shared") == "shared"
        with clone:  # the clone of the lazy one starts its own job when first used
            clone.reset()
            assert clone.echo("again") == "again" and clone.job_id not in (begun.job_id, shared.job_id)
    finally:
        trl_example.EchoSandboxEnv.close_all()
    assert len(emulator.jobs) == 3  # own, shared (one job for both copies), the clone's own
    assert all(emulator.wait_for_stage(job.id, ["CANCELED"]).terminal for job in emulator.jobs), emulator.jobs


def test_trl_environment_replaces_a_sandbox_that_died_between_episodes(trl_example, emulator, capsys) -> None:
    env = trl_example.EchoSandboxEnv("any/image:tag", **emulator.provider_settings)
    with env:
        env.reset()
        assert env.echo("one") == "one"
        first = env.job_id
        emulator.kill_job(first)
        emulator.wait_for_stage(first, ["ERROR"])
        env.reset()
        assert env.job_id != first
        assert env.echo("two") == "two"
        assert env.reward == pytest.approx(0.3)  # the new episode's reward only
    assert len(emulator.jobs) == 2 and emulator.job(first).stage == "ERROR"  # one replacement, by the slot
    assert emulator.wait_for_stage(env.job_id, ["CANCELED"]).stage == "CANCELED"
