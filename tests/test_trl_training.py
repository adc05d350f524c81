"""A real TRL run: `GRPOTrainer` (TRL 1.16, CPU) trains a tiny offline model for 2 steps with the TRL
example's `EchoSandboxEnv` as `environment_factory`, against the emulator with a 3 s cold start.

The tiny model always calls the `echo` tool once (tests/tiny_trl.py), so each rollout makes a real tool
call through the proxy into a job's WebSocket session. Checked: the environment's rewards reach the
trainer's logs, the rollout slots' cold starts overlapped (every slot's job was created before any of
them left SCHEDULING), shared jobs use K jobs for all slots, a proxy="process" child SIGKILLed
mid-training costs one rollout, and `close_all()` leaves no job or job process. Skips without TRL,
except under CI (env CI set), where it fails: CI installs `.[trl]`.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
import time

import pytest

NEEDED = ("torch", "trl", "transformers", "datasets", "accelerate")
_missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
if _missing and os.environ.get("CI"):
    pytest.fail("CI must run the real TRL test, but %s is not installed: pip install torch==2.13.0, then "
                "pip install -e '.[test,trl]'" % ", ".join(_missing), pytrace=False)
if _missing:
    pytest.skip("needs %s (pip install torch==2.13.0, then pip install -e '.[test,trl]')" % ", ".join(_missing),
                allow_module_level=True)

from hf_jobs_emulator import JobsEmulator, echo_server_command  # noqa: E402

import support  # noqa: E402
import tiny_trl  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULING_DELAY_S = 3.0
SLOTS = 4  # rollout slots per step: per_device_train_batch_size, each with its own environment
STEPS = 2
EXPECTED_REWARD = 0.1 * len(tiny_trl.TOOL_MESSAGE)  # the echo environment: 0.1 per echoed character


@pytest.fixture
def trl_example(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything is made here: nothing may be downloaded
    examples = os.path.join(ROOT, "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import trl_environment_factory
    return trl_environment_factory


@pytest.fixture
def cold_emu(make_emu):
    return make_emu(scheduling_delay_s=SCHEDULING_DELAY_S)


def train(trl_example, emu: JobsEmulator, tmp_path, env_class=None, steps: int = STEPS, callbacks=(),
          **env_kwargs) -> list:
    """GRPO for `steps` steps with SLOTS environments; returns the trainer's per-step logs."""
    import functools

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = tiny_trl.build_tokenizer()
    settings = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command(), poll_interval_s=0.1)
    factory = functools.partial(env_class or trl_example.EchoSandboxEnv, "img:tag", **settings, **env_kwargs)
    prompts = [[{"role": "user", "content": "Echo '%s'." % tiny_trl.TOOL_MESSAGE}]] * (SLOTS * steps)
    config = GRPOConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=SLOTS,
                        num_generations=SLOTS, max_completion_length=64, max_tool_calling_iterations=1,
                        learning_rate=1e-6, logging_steps=1, use_cpu=True, bf16=False, report_to="none",
                        save_strategy="no", seed=0)
    trainer = GRPOTrainer(model=tiny_trl.build_model(tokenizer), processing_class=tokenizer, reward_funcs=[],
                          args=config, train_dataset=Dataset.from_dict({"prompt": prompts}),
                          environment_factory=factory, callbacks=list(callbacks))
    try:
        trainer.train()
    finally:
        trl_example.EchoSandboxEnv.close_all()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def assert_rewards_reached_the_trainer(steps: list) -> None:
    assert len(steps) == STEPS
    for entry in steps:
        assert entry["tools/call_frequency"] == 1.0 and entry["tools/failure_frequency"] == 0.0, entry
        assert entry["rewards/EchoSandboxEnv/mean"] == pytest.approx(EXPECTED_REWARD), entry
        assert entry["reward"] == pytest.approx(EXPECTED_REWARD), entry


def assert_nothing_left(emu: JobsEmulator) -> None:
    for job in emu.jobs:
        assert emu.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED", job
    assert not [t.name for t in threading.enumerate() if t.name.startswith("hf-sandbox-background")]


def test_grpo_trains_two_steps_with_one_sandbox_per_slot_started_together(trl_example, cold_emu, tmp_path) -> None:
    steps = train(trl_example, cold_emu, tmp_path)
    assert_rewards_reached_the_trainer(steps)
    jobs = sorted(cold_emu.jobs, key=lambda job: job.created_mono)
    assert len(jobs) == SLOTS  # one per slot, reused by the second step
    # TRL builds one environment at init and the rest just before the first step's resets: those
    # were all created before any of them left SCHEDULING, so the first step waited one cold start.
    batch = jobs[1:]
    assert max(job.created_mono for job in batch) < min(job.started_mono for job in batch)
    assert_nothing_left(cold_emu)


def test_grpo_slots_share_two_jobs_each_with_its_own_session(trl_example, cold_emu, tmp_path) -> None:
    steps = train(trl_example, cold_emu, tmp_path, shared="trl-test", replicas=2,
                  env_vars={"MAX_CONCURRENT_ENVS": str(SLOTS)})
    assert_rewards_reached_the_trainer(steps)
    assert len(cold_emu.jobs) == 2  # SLOTS environments, 2 jobs
    assert_nothing_left(cold_emu)


# Lifetimes: each job lives LIFETIME_S; training runs until LIFETIMES of them have passed.
LIFETIME_S = 16
LIFETIMES = 2.5
KILL_AFTER_S = 20.0  # one job is killed under a rollout this long into training


def test_grpo_environments_outlive_their_jobs_and_only_the_rollout_under_a_killed_job_fails(
        trl_example, make_emu, tmp_path) -> None:
    from transformers import TrainerCallback

    emu = make_emu(scheduling_delay_s=0.5)
    began = time.monotonic()
    killed: list = []

    class KilledOnceEnv(trl_example.EchoSandboxEnv):
        """The example's environment; once, KILL_AFTER_S into training, its job's process is SIGKILLed
        right after a reset, so this rollout's tool call runs on a dead job."""

        def reset(self, **kwargs):
            super().reset(**kwargs)
            if not killed and time.monotonic() - began > KILL_AFTER_S:
                killed.append(self.job_id)
                os.kill(emu.job(self.job_id).pid, signal.SIGKILL)
                emu.wait_for_stage(self.job_id, ["ERROR"])

    class StopAfterLifetimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = time.monotonic() - began > LIFETIMES * LIFETIME_S

    steps = train(trl_example, emu, tmp_path, env_class=KilledOnceEnv, steps=500, callbacks=[StopAfterLifetimes()],
                  job_timeout=LIFETIME_S, renew_before_s=LIFETIME_S / 2)
    assert killed and len(steps) >= 3
    failures = [entry["tools/failure_frequency"] for entry in steps]
    assert sorted(failures)[-1] == pytest.approx(1 / SLOTS) and sorted(failures)[:-1] == [0.0] * (len(steps) - 1), \
        failures  # one failed rollout: the one under the killed job
    assert all(entry["tools/call_frequency"] == 1.0 for entry in steps)
    assert len(emu.jobs) >= 3 * SLOTS  # each slot crossed two lifetimes at least
    assert_nothing_left_but(emu, killed)


def assert_nothing_left_but(emu: JobsEmulator, killed: list) -> None:
    for job in emu.jobs:
        stage = emu.wait_for_stage(job.id, ["CANCELED", "ERROR"]).stage
        assert stage == ("ERROR" if job.id in killed else "CANCELED"), job
    assert not [t.name for t in threading.enumerate() if t.name.startswith("hf-sandbox-background")]


def proxy_killed_once_env(trl_example) -> tuple:
    """(an environment class, the killed pids): the example's environment, whose first reset of the second
    step SIGKILLs the proxy="process" child after it returns, so that rollout's tool call finds its
    connection dead. The OOM killer picks the biggest process it can free: a proxy child holding thousands
    of sessions is a candidate."""
    import hf_sandbox_provider as hsp

    resets: list = []
    killed: list = []

    class ProxyKilledOnceEnv(trl_example.EchoSandboxEnv):
        def reset(self, **kwargs):
            super().reset(**kwargs)
            resets.append(self.job_id)
            if len(resets) == SLOTS + 1:
                host = hsp._shared_proxies["process"]
                killed.append(host.pid)
                os.kill(host.pid, signal.SIGKILL)

    return ProxyKilledOnceEnv, killed


@pytest.mark.parametrize("placement", [{}, {"shared": "trl-test", "replicas": 2,
                                       "env_vars": {"MAX_CONCURRENT_ENVS": str(SLOTS)}}],
                         ids=["a-job-per-slot", "shared-replicas"])
def test_grpo_with_the_proxy_in_a_child_process_trains_on_after_that_child_is_killed(
        trl_example, make_emu, tmp_path, placement) -> None:
    # Training must go on with the same jobs: the child is replaced, and the next resets wait for it.
    import hf_sandbox_provider as hsp

    emu = make_emu(scheduling_delay_s=0.5)
    env_class, killed = proxy_killed_once_env(trl_example)
    with support.own_process_proxy():
        steps = train(trl_example, emu, tmp_path, env_class=env_class, steps=3, proxy="process", **placement)
        host = hsp._shared_proxies["process"]
    assert killed and host.pid != killed[0]  # replaced, not ended (it served the rest of training)
    failures = [entry["tools/failure_frequency"] for entry in steps]
    # only the rollout whose connection died with the child failed; every later reset reached its job again
    assert failures == [0.0, pytest.approx(1 / SLOTS), 0.0], failures
    assert steps[2]["reward"] == pytest.approx(EXPECTED_REWARD), steps[2]
    assert len(emu.jobs) == (2 if placement else SLOTS)  # the jobs were fine: none was replaced
    assert_nothing_left(emu)
