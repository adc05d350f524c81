"""A real TRL `GRPOTrainer` run with pooled placement (`pool=`): 4 rollout slots, each environment its
own sandbox on ONE host job of the emulator (TLS, huggingface_hub's real SandboxPool), with servers that
refuse a second session (as OpenEnv servers do by default), so packing sessions into shared servers would
fail while one sandbox per slot works. Checked: the environment's rewards reach the trainer's logs, one
host job, one sandbox per slot, and `close_all()` (stop_sandboxes) leaves no sandbox and cancels the host.
"""

from __future__ import annotations

import os
import sys

import pytest

import test_trl_training as base  # skips (or fails under CI) without TRL, like the dedicated run

hub = pytest.importorskip("huggingface_hub")

import hf_sandbox_pool  # noqa: E402
import support  # noqa: E402
from hf_jobs_emulator import JobsEmulator  # noqa: E402

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ONE_SESSION_SERVER = [sys.executable, os.path.join(HERE, "upstreams", "uds_echo_env.py"), "{socket}", "--one-session"]


@pytest.fixture
def tls_emu(monkeypatch, tmp_path, log_guard):
    emu = JobsEmulator(tls=True, sandbox_host_boot_s=3.0, sandbox_host_ready_s=0.0, sandbox_create_s=0.3).start()
    log_guard.watch(emu.token)
    monkeypatch.setattr(hub.constants, "HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("SSL_CERT_FILE", emu.ca_path)
    yield emu
    hf_sandbox_pool.close_pools()
    assert emu.stop() == [] and emu.live_pids() == []


@pytest.mark.skipif(bool(hf_sandbox_pool.hub_rejection()), reason=hf_sandbox_pool.hub_rejection() or "")
def test_grpo_trains_with_one_pooled_sandbox_per_slot_on_one_host(base_trl_example, tls_emu, tmp_path,
                                                                   monkeypatch) -> None:
    monkeypatch.setattr(base, "echo_server_command", lambda: ONE_SESSION_SERVER)
    created = []
    real_create = hub.SandboxPool.create
    monkeypatch.setattr(hub.SandboxPool, "create", lambda self, **kw: created.append(1) or real_create(self, **kw))
    steps = base.train(base_trl_example, tls_emu, tmp_path, pool="trl-pool", verify=tls_emu.ca_path)
    base.assert_rewards_reached_the_trainer(steps)
    assert len(tls_emu.jobs) == 1  # one host job for every slot
    assert len(created) >= base.SLOTS  # a sandbox (and server) per slot: their servers take one session each
    host = tls_emu.jobs[0]
    assert tls_emu.wait_for_stage(host.id, ["CANCELED"]).stage == "CANCELED"  # stop_sandboxes closed the pool


@pytest.mark.skipif(bool(hf_sandbox_pool.hub_rejection()), reason=hf_sandbox_pool.hub_rejection() or "")
def test_grpo_with_pooled_sandboxes_trains_on_after_the_proxy_child_is_killed(base_trl_example, tls_emu, tmp_path,
                                                                              monkeypatch) -> None:
    # Pooled routes carry each sandbox's token in a headers callable: the replacement child must get them too.
    import hf_sandbox_provider as hsp

    monkeypatch.setattr(base, "echo_server_command", lambda: ONE_SESSION_SERVER)
    env_class, killed = base.proxy_killed_once_env(base_trl_example)
    with support.own_process_proxy():
        steps = base.train(base_trl_example, tls_emu, tmp_path, env_class=env_class, steps=3, pool="trl-pool",
                           verify=tls_emu.ca_path, proxy="process")
        host = hsp._shared_proxies["process"]
    assert killed and host.pid != killed[0]
    failures = [entry["tools/failure_frequency"] for entry in steps]
    assert failures == [0.0, pytest.approx(1 / base.SLOTS), 0.0], failures
    assert steps[2]["reward"] == pytest.approx(base.EXPECTED_REWARD), steps[2]
    assert len(tls_emu.jobs) == 1


@pytest.fixture
def base_trl_example(monkeypatch):
    """The TRL example module, as tests/test_trl_training.py's `trl_example` fixture loads it."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    examples = os.path.join(base.ROOT, "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import trl_environment_factory
    return trl_environment_factory
