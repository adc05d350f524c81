"""Pooled placement (`HFSandboxProvider(..., pool=...)`, hf_sandbox_pool.py) against the emulator over TLS:
huggingface_hub's real SandboxPool boots host jobs on `JobsEmulator(tls=True)` (hf_sbx_emulator runs
their sandbox server), each environment is a sandbox whose server (the emulator's echo environment)
binds `$SBX_PROXY_DIR/<port>.sock`, reached through the shared AuthProxy. Checked: the provider's
contract (loopback base_url, readiness, typed errors, stop), packing and host reuse, the caller's own
pool, credentials (no token in a sandbox or a log), version refusal, faults (server crash at boot, host
killed, full host, eviction, 429/503 on create), and that nothing is left: no sandbox, no host we
booted, no process.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
import threading
import time
from typing import Any, Callable, Iterator, List, Tuple

import pytest
import requests

hub = pytest.importorskip("huggingface_hub")
pytest.importorskip("huggingface_hub._sandbox")

import hf_sandbox_pool  # noqa: E402
import hf_sandbox_training  # noqa: E402
import hf_sandbox_provider as hsp  # noqa: E402
from hf_jobs_emulator import JobsEmulator, echo_server_command  # noqa: E402
from hf_sandbox_provider import (EnvSession, HFSandboxProvider, InsecureURLError, JobFailedError,  # noqa: E402
                                 JobStartTimeout, JobsAPIError, SandboxConfigError, SandboxError, SessionError)
from proxy import AuthProxy  # noqa: E402
import support  # noqa: E402
from support import wait_until  # noqa: E402

if hf_sandbox_pool.hub_rejection():  # pragma: no cover - an older huggingface_hub: see test_versions
    pytest.skip(hf_sandbox_pool.hub_rejection(), allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = echo_server_command()  # binds $SBX_PROXY_DIR/8000.sock in the sandbox
FAULTY_SERVER = [sys.executable, os.path.join(HERE, "upstreams", "uds_echo_env.py"), "{socket}"]
IMAGE = "python:3.12"
# Small delays: the defaults (13 s cold host, 0.27 s per sandbox) are for benchmarks.
FAST = dict(tls=True, sandbox_host_boot_s=0.0, sandbox_host_ready_s=0.1, sandbox_create_s=0.0)
TIMEOUT = 60.0


@pytest.fixture
def pool_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, log_guard: Any) -> Iterator[Callable[..., JobsEmulator]]:
    """`pool_env(**JobsEmulator_kwargs)`: a TLS emulator huggingface_hub's clients trust (SSL_CERT_FILE)
    with its pool cache under tmp_path. After the test: named pools are closed, the emulator stopped,
    and every process it ran (hosts, sandboxes, servers) must be gone."""
    made: List[JobsEmulator] = []

    def make(**kwargs: Any) -> JobsEmulator:
        emulator = JobsEmulator(**{**FAST, **kwargs}).start()
        made.append(emulator)
        log_guard.watch(emulator.token)
        monkeypatch.setattr(hub.constants, "HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("SSL_CERT_FILE", emulator.ca_path)
        return emulator

    yield make
    hf_sandbox_pool.close_pools()
    hub.utils.close_session()  # huggingface_hub's process-wide HTTP client keeps a connection to the Jobs API
    for emulator in made:
        assert emulator.stop() == []
        assert emulator.live_pids() == [], "a job, sandbox or server process outlived the emulator"


def provider(emu: JobsEmulator, proxy: AuthProxy, **kwargs: Any) -> HFSandboxProvider:
    options = dict(endpoint=emu.endpoint, token=emu.token, verify=emu.ca_path, proxy=proxy, command=SERVER,
                   pool="test-pool", start_timeout_s=TIMEOUT, ready_timeout_s=TIMEOUT)
    options.update(kwargs)
    return HFSandboxProvider(IMAGE, **options)


def host_sandboxes(emu: JobsEmulator, host_id: str) -> List[str]:
    return list(emu.sandbox_hosts.host(host_id).sandbox_ids)


def local_id(p: HFSandboxProvider) -> str:
    return (p.job_id or "").split(".", 1)[1]


def watch_sandbox_token(p: HFSandboxProvider, log_guard: Any) -> None:
    log_guard.watch(p._pooled.sandbox.proxy_headers["X-Sandbox-Token"])


# -- the provider's contract, pooled ----------------------------------------------------------------


def test_a_pooled_environment_serves_http_and_websocket_through_the_proxy_and_stop_kills_only_its_sandbox(
        no_leaks, pool_env, proxy, log_guard):
    emu = pool_env()
    with provider(emu, proxy) as p:
        base_url = p.start_container()
        watch_sandbox_token(p, log_guard)
        p.wait_for_ready()
        host_id = p._pooled.host_id
        assert base_url.startswith(proxy.url + "/")
        assert p.job_id == "%s.%s" % (host_id, local_id(p))
        assert p.upstream_url.startswith("https://%s--49983." % host_id)
        assert p.upstream_url.endswith("/v1/sandboxes/%s/proxy/8000" % local_id(p))
        assert set(p.timings) == {"created", "running", "url", "ready"} and p.stage == "RUNNING"
        assert requests.post(base_url + "/reset", json={}, timeout=10).status_code == 200
        step = requests.post(base_url + "/step", json={"action": {"message": "abc"}}, timeout=10).json()
        assert step["observation"]["echoed_message"] == "abc"
        with EnvSession(base_url) as session:
            session.reset()
            assert session.step({"message": "hello"})["observation"]["echoed_message"] == "hello"
        assert any("echo environment listening on unix:" in line for line in p.logs())
        assert host_sandboxes(emu, host_id) == [local_id(p)]
    assert host_sandboxes(emu, host_id) == []  # killed; the host keeps running for the pool
    assert emu.job(host_id).stage == "RUNNING" and p.stage == "CANCELED"
    assert requests.get(base_url + "/health", timeout=10).status_code == 404  # unmounted
    hf_sandbox_pool.close_pools()
    assert emu.wait_for_stage(host_id, ["CANCELED"]).stage == "CANCELED"  # a host we booted is cancelled


@pytest.mark.parametrize("port", [8000, 9000])
def test_a_pooled_environment_left_at_openenvs_default_command_runs_the_emulators_echo_environment(
        pool_env, proxy, port):
    emu = pool_env()
    with provider(emu, proxy, command=None, port=port, pool="default-command") as p:
        p.wait_for_ready(p.start_container())
        with EnvSession(p.base_url) as session:
            session.reset()
            assert session.step({"message": "image"})["observation"]["echoed_message"] == "image"
        assert p.upstream_url.endswith("/proxy/%d" % port)


@pytest.mark.slow  # four environments on one host job
def test_environments_of_one_named_pool_pack_onto_one_host_with_one_jobs_api_create(pool_env, proxy, log_guard):
    emu = pool_env()
    providers = HFSandboxProvider.start_many(4, IMAGE, progress=False, endpoint=emu.endpoint, token=emu.token,
                                             verify=emu.ca_path, proxy=proxy, command=SERVER, pool="packed",
                                             start_timeout_s=TIMEOUT, ready_timeout_s=TIMEOUT)
    try:
        hosts = {p._pooled.host_id for p in providers}
        assert len(hosts) == 1 and len(emu.jobs) == 1
        assert sorted(host_sandboxes(emu, hosts.pop())) == sorted(local_id(p) for p in providers)
        for index, p in enumerate(providers):
            with EnvSession(p.base_url) as session:
                session.reset()
                assert session.step({"message": "env %d" % index})["observation"]["echoed_message"] == "env %d" % index
    finally:
        for p in providers:
            p.stop_container()


@pytest.mark.slow  # boots two host jobs
def test_hosts_booting_at_once_are_watched_with_one_list_per_refresh_not_an_inspect_per_host(pool_env, proxy):
    emu = pool_env(sandbox_host_boot_s=hf_sandbox_pool.HOST_WATCH_INTERVAL_S + 1.0)  # at least one refresh
    p = provider(emu, proxy, pool="two-hosts")
    hf_sandbox_pool.prewarm(p, hf_sandbox_pool.HOST_CAPACITY_ASSUMED + 1)  # boots two hosts in parallel
    calls = emu.api_calls
    assert len(emu.jobs) == 2 and all(job.stage == "RUNNING" for job in emu.jobs)
    assert calls.get("inspect", 0) == 0 and calls["list"] >= 2, calls  # huggingface_hub's checks: the watcher's
    assert all(job.spec["labels"]["hf-sandbox-process"] == hsp._process_label for job in emu.jobs)
    assert hsp._watcher._groups == {} or all(not g.watches for g in hsp._watcher._groups.values())


@pytest.mark.slow  # boots two host jobs
def test_start_many_plans_its_hosts_and_its_first_start_boots_them_all_at_once(pool_env, proxy, monkeypatch):
    monkeypatch.setattr(hf_sandbox_pool, "HOST_CAPACITY_ASSUMED", 2)  # 3 environments: plan 2 hosts
    emu = pool_env()
    providers = HFSandboxProvider.start_many(3, IMAGE, progress=False, endpoint=emu.endpoint, token=emu.token,
                                             verify=emu.ca_path, proxy=proxy, command=SERVER, pool="planned",
                                             start_timeout_s=TIMEOUT, ready_timeout_s=TIMEOUT)
    try:
        assert len(emu.jobs) == 2 and all(job.stage == "RUNNING" for job in emu.jobs)  # one boot of both hosts
        assert all(p.base_url for p in providers)
    finally:
        for p in providers:
            p.stop_container()


@pytest.mark.slow  # a host job that crashes at boot, seen through the job watcher's 3 s refresh
def test_starts_waiting_for_a_pools_first_host_fail_with_its_boot_error_instead_of_booting_one_each(pool_env, proxy):
    emu = pool_env(faults={"crash-at-boot": "sbx-server: cannot start (emulated crash)"})
    ready, errors = HFSandboxProvider.start_many(4, IMAGE, all_or_nothing=False, progress=False, endpoint=emu.endpoint,
                                                 token=emu.token, verify=emu.ca_path, proxy=proxy, command=SERVER,
                                                 pool="crashing", start_timeout_s=TIMEOUT, ready_timeout_s=TIMEOUT)
    assert ready == [] and len(errors) == 4
    assert all(isinstance(error, SandboxError) and "pool crashing could not start a host job" in str(error)
               and "emulated crash" in str(error) for _, error in errors), errors
    assert len(emu.jobs) == 1 and proxy._routes == {}  # one boot, its failure shared by the starts that waited


def _slow_cache_writes(monkeypatch: pytest.MonkeyPatch) -> List[Tuple[int, str]]:
    """Make huggingface_hub's pool-cache write take 1 s (a slow disk, or a contended file lock); returns the
    list of (live sandboxes the write recorded, the thread that wrote) it fills."""
    import huggingface_hub._sandbox as hub_sandbox
    writes: List[Tuple[int, str]] = []
    real_save = hub_sandbox.save_pool_cache

    def slow_save(*args: Any, **kwargs: Any) -> None:
        time.sleep(1.0)
        writes.append((sum(host.live for host in kwargs["hosts"]), threading.current_thread().name))
        real_save(*args, **kwargs)

    monkeypatch.setattr(hub_sandbox, "save_pool_cache", slow_save)
    return writes


def _named_pool() -> Any:
    (entry,) = hf_sandbox_pool._pools.values()
    return entry.pool


@pytest.mark.slow  # eight environments, a 1 s cache write each
def test_pool_cache_saves_go_to_one_background_writer_that_folds_them_and_keeps_the_last_state(
        pool_env, proxy, monkeypatch):
    emu = pool_env()
    writes = _slow_cache_writes(monkeypatch)
    providers = HFSandboxProvider.start_many(8, IMAGE, progress=False, endpoint=emu.endpoint, token=emu.token,
                                             verify=emu.ca_path, proxy=proxy, command=SERVER, pool="slow-cache",
                                             start_timeout_s=TIMEOUT, ready_timeout_s=TIMEOUT)
    try:
        _named_pool().flush_cache()
        assert len(writes) < 1 + len(providers), writes  # the warm-up's write, then fewer than one per create
        assert writes[-1][0] == len(providers)  # the last write has every sandbox: no save was lost
        assert {thread for _, thread in writes} == {"hf-sandbox-pool-cache"}  # no start waited for a write
    finally:
        for p in providers:
            p.stop_container()


@pytest.mark.slow  # a pooled start
def test_a_pool_cache_save_with_no_thread_to_spare_is_written_by_the_start_itself(pool_env, proxy, monkeypatch):
    import huggingface_hub._sandbox as hub_sandbox
    real_start = hsp._start_thread

    def no_cache_thread(thread: threading.Thread) -> None:
        if thread.name == "hf-sandbox-pool-cache":
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(hsp, "_start_thread", no_cache_thread)
    emu = pool_env()
    p = provider(emu, proxy, pool="no-threads")
    p.wait_for_ready(p.start_container())  # the create succeeds
    try:
        cached = hub_sandbox.read_pool_cache("no-threads", _named_pool()._cache_context)
        assert cached is not None and sum(host.live for host in cached.hosts) == 1
    finally:
        p.stop_container()


def test_a_host_job_whose_watch_cannot_start_a_thread_still_serves_and_is_cancelled_with_its_pool(
        pool_env, proxy, monkeypatch):
    real_start = hsp._start_thread

    def no_watcher_thread(thread: threading.Thread) -> None:
        if thread.name == "hf-sandbox-job-watcher":
            raise RuntimeError("can't start new thread")  # a thread limit, hundreds of environments in
        real_start(thread)

    monkeypatch.setattr(hsp, "_start_thread", no_watcher_thread)
    emu = pool_env()
    p = provider(emu, proxy, pool="no-watcher")
    p.wait_for_ready(p.start_container())  # huggingface_hub's own inspects follow the boot
    host_id = p._pooled.host_id
    p.stop_container()
    hf_sandbox_pool.close_pools()
    assert emu.wait_for_stage(host_id, ["CANCELED"]).stage == "CANCELED"
    # no group is left behind without the thread that would forget it (before: later tests found two groups)
    assert [g for g in list(hsp._watcher._groups.values()) if g.thread is None] == []


@pytest.mark.slow  # a 1 s cache write
def test_closing_a_pool_waits_for_a_cache_write_in_flight_so_no_entry_is_left_for_its_cancelled_hosts(
        pool_env, proxy, monkeypatch):
    import huggingface_hub._sandbox as hub_sandbox
    emu = pool_env()
    writes = _slow_cache_writes(monkeypatch)
    p = provider(emu, proxy, pool="closing")
    p.wait_for_ready(p.start_container())
    pool = _named_pool()
    wait_until(lambda: pool._cache_writer is not None, "a cache write in flight")
    p.stop_container()
    hf_sandbox_pool.close_pools()  # cancels the host and deletes the pool's cache entry
    wait_until(lambda: not any(t.name == "hf-sandbox-pool-cache" for t in threading.enumerate()),
               "every cache writer to end")  # a write close_pools did not wait for lands before this
    assert hub_sandbox.read_pool_cache("closing", pool._cache_context) is None, writes


def test_a_host_whose_cancel_failed_is_not_taken_for_cancelled_by_its_sandboxes_stop(pool_env, proxy, caplog):
    emu = pool_env()
    p = provider(emu, proxy, pool="flaky-cancel")
    p.wait_for_ready(p.start_container())
    host_id = p._pooled.host_id
    emu.inject_server_errors(50, status=503, routes=["cancel"])  # the Hub's cancel is down for a while
    hf_sandbox_pool.close_pools()  # fails to cancel the host (logged): the host runs on
    emu.inject_server_errors(0, routes=["cancel"])
    assert emu.job(host_id).stage == "RUNNING"
    caplog.clear()
    # Its sandbox must be killed on its own (huggingface_hub closed the host's client: that fails) and never
    # reported cancelled while the host and the sandbox run on; the warning names the host job to cancel.
    p.stop_container()
    assert host_sandboxes(emu, host_id) == [local_id(p)] and p.stage != "CANCELED"
    assert any("could not kill it. It ends with its host job %s" % host_id in r.getMessage() and "sweep --pool"
               in r.getMessage() for r in caplog.records)  # (the emulator's stop ends the host)


@pytest.mark.slow  # boots two host jobs
def test_close_pools_during_a_prewarm_of_an_existing_pool_cancels_the_host_it_was_booting(pool_env, proxy):
    emu = pool_env(sandbox_host_boot_s=2.0)
    p = provider(emu, proxy, pool="warming")
    hf_sandbox_pool.prewarm(p, 1)  # the pool exists, with one host
    assert len(emu.jobs) == 1
    warming = threading.Thread(target=hf_sandbox_pool.prewarm, args=(p, hf_sandbox_pool.HOST_CAPACITY_ASSUMED + 1))
    warming.start()  # a second start_many's prewarm: boots a second host (2 s)
    wait_until(lambda: len(emu.jobs) == 2, "the second host's create")
    hf_sandbox_pool.close_pools()  # what atexit, signal teardown or the user calls meanwhile
    warming.join(TIMEOUT)
    for job in emu.jobs:
        assert emu.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED", job.id


@pytest.mark.slow  # boots two host jobs
def test_a_full_host_makes_the_pool_boot_another(pool_env, proxy):
    emu = pool_env(sandbox_capacity=2)
    providers = [provider(emu, proxy, pool="small-hosts") for _ in range(3)]
    try:
        for p in providers:
            p.wait_for_ready(p.start_container())
        hosts = [p._pooled.host_id for p in providers]
        assert hosts[0] == hosts[1] != hosts[2] and len(emu.jobs) == 2
    finally:
        for p in providers:
            p.stop_container()
    hf_sandbox_pool.close_pools()
    for host in set(hosts):
        assert emu.wait_for_stage(host, ["CANCELED"]).stage == "CANCELED"


def test_a_callers_own_sandbox_pool_is_used_as_given_and_its_host_is_never_cancelled(pool_env, proxy, monkeypatch):
    emu = pool_env()
    monkeypatch.setattr(hub.constants, "ENDPOINT", emu.endpoint)  # the caller's pool uses huggingface_hub's
    with hub.SandboxPool(IMAGE, token=emu.token, namespace=emu.namespace, start_timeout=TIMEOUT) as pool:
        with provider(emu, proxy, pool=pool) as p:
            p.wait_for_ready(p.start_container())
            assert p._pooled.host_id == pool.host_ids[0]
        hf_sandbox_pool.close_pools()
        assert emu.job(pool.host_ids[0]).stage == "RUNNING" and host_sandboxes(emu, pool.host_ids[0]) == []
        host_id = pool.host_ids[0]
    assert emu.wait_for_stage(host_id, ["CANCELED"]).stage == "CANCELED"  # the caller's close did it


@pytest.mark.parametrize("ended_url_status", [None, 502])
def test_a_callers_own_sandbox_pool_whose_host_died_places_the_next_start_on_a_new_host(
        pool_env, proxy, monkeypatch, caplog, ended_url_status):
    emu = pool_env(ended_url_status=ended_url_status)
    monkeypatch.setattr(hub.constants, "ENDPOINT", emu.endpoint)  # the caller's pool uses huggingface_hub's
    with hub.SandboxPool(IMAGE, token=emu.token, namespace=emu.namespace, start_timeout=TIMEOUT) as pool:
        with provider(emu, proxy, pool=pool) as p:
            p.wait_for_ready(p.start_container())
            dead = p._pooled.host_id
            emu.kill_job(dead)
            emu.wait_for_stage(dead, ["ERROR"])
            p.stop_container()
            p.wait_for_ready(p.start_container())
            assert p._pooled.host_id != dead and pool.host_ids == [p._pooled.host_id]
            assert "host job(s) %s (ERROR) ended" % dead in caplog.text
            p.stop_container()


def test_a_start_container_override_places_one_start_in_a_pool(pool_env, proxy):
    emu = pool_env()
    with provider(emu, proxy, pool=None) as p:
        p.wait_for_ready(p.start_container(pool="override"))
        assert p._pooled is not None and "." in (p.job_id or "")


# -- credentials ------------------------------------------------------------------------------------


def test_the_sandbox_gets_no_hf_token_and_the_sandbox_token_never_reaches_a_log(pool_env, proxy, log_guard):
    emu = pool_env()
    with provider(emu, proxy, env_vars={"GREETING": "hi"}) as p:
        p.wait_for_ready(p.start_container())
        watch_sandbox_token(p, log_guard)
        seen = p._pooled.sandbox.run("echo ${HF_TOKEN:-none} ${HUGGING_FACE_HUB_TOKEN:-none} $GREETING").stdout
        assert seen.split() == ["none", "none", "hi"]
        assert emu.token not in repr(p) and "X-Sandbox-Token" not in repr(proxy._routes)


def test_a_sandbox_url_that_is_not_its_hosts_own_gets_no_token_and_the_sandbox_is_killed(pool_env, proxy,
                                                                                           monkeypatch):
    """The token goes only to the host job's own exposed URL: a caller's pool whose sandboxes name another
    job's URL (a misbehaving pool object; the URL still reaches the emulator, on loopback) is refused on
    the sandbox's real upstream, and the sandbox it made is killed."""
    emu = pool_env()
    monkeypatch.setattr(hub.constants, "ENDPOINT", emu.endpoint)
    offered: List[str] = []

    class MisroutingPool(hub.SandboxPool):
        def create(self, *args: Any, **kwargs: Any) -> Any:
            sandbox = super().create(*args, **kwargs)
            real = sandbox.proxy_url_for

            def foreign(port: Any, path: str = "/", **options: Any) -> str:
                url = real(port, path, **options)
                host_id = url.split("//", 1)[1].split("--", 1)[0]
                offered.append(url.replace("//%s--" % host_id, "//%s--" % host_id[::-1]))
                return offered[-1]

            sandbox.proxy_url_for = foreign
            return sandbox

    with MisroutingPool(IMAGE, token=emu.token, namespace=emu.namespace, start_timeout=TIMEOUT) as pool:
        p = provider(emu, proxy, pool=pool)
        with pytest.raises(InsecureURLError, match="does not belong to job") as refused:
            p.start_container()
        host_id = pool.host_ids[0]
        assert offered and offered[-1].split("/v1/")[0] in str(refused.value)
        assert host_sandboxes(emu, host_id) == [] and proxy._routes == {}


# -- refusals before anything starts ----------------------------------------------------------------


def test_an_older_huggingface_hub_is_refused_naming_the_version_needed(monkeypatch, proxy):
    monkeypatch.setattr(hub, "__version__", "2.0.0")
    with pytest.raises(SandboxConfigError, match=r"huggingface_hub >= 2\.1\.1.*2\.0\.0 is installed"):
        HFSandboxProvider(IMAGE, pool=hub.SandboxPool.__new__(hub.SandboxPool), token="x", proxy=proxy)
    p = HFSandboxProvider(IMAGE, pool="named", token="hf_x", endpoint="http://127.0.0.1:9", proxy=proxy)
    with pytest.raises(SandboxConfigError, match=r"2\.1\.1"):
        p.start_container()


def test_a_named_pool_refuses_a_flavor_the_hubs_live_list_lacks_before_booting_a_host(pool_env, proxy):
    emu = pool_env(flavors=["cpu-basic", "cpu-upgrade"])
    p = provider(emu, proxy, pool="big-iron", flavor="a100-large")
    with pytest.raises(hsp.SandboxConfigError, match="valid Jobs flavors: cpu-basic, cpu-upgrade"):
        p.start_container()
    assert emu.jobs == [] and emu.api_calls.get("create", 0) == 0


def test_pool_and_replicas_cannot_be_combined(proxy):
    p = HFSandboxProvider(IMAGE, pool="named", replicas=2, token="hf_x", endpoint="http://127.0.0.1:9", proxy=proxy)
    with pytest.raises(SandboxConfigError, match="replicas=2 and pool= cannot be combined"):
        p.start_container()


def test_the_server_command_places_the_socket_and_keeps_list_arguments_as_words():
    default = hf_sandbox_pool.server_command(None, 8000)
    assert 'uvicorn server.app:app --uds "$SBX_PROXY_DIR/8000.sock"' in default
    listed = hf_sandbox_pool.server_command(["python", "my server.py", "--uds={socket}", ""], 9000)
    assert listed.endswith("""exec python 'my server.py' --uds="$SBX_PROXY_DIR/9000.sock" ''""")
    assert 'export HF_SANDBOX_SOCKET="$SBX_PROXY_DIR/9000.sock"' in listed


# -- faults -----------------------------------------------------------------------------------------


def test_a_server_that_crashes_at_boot_fails_fast_with_its_own_output_and_its_sandbox_is_killed(pool_env, proxy):
    emu = pool_env()
    p = provider(emu, proxy, command=FAULTY_SERVER + ["--crash-after", "0"])
    p.start_container()
    host_id = p._pooled.host_id
    with pytest.raises(JobFailedError) as failed:
        p.wait_for_ready()
    assert "exited (code 3)" in str(failed.value)
    assert any("crashing at boot" in line for line in failed.value.log_tail)
    assert host_sandboxes(emu, host_id) == [] and proxy._routes == {}


def test_a_sandbox_evicted_before_its_server_starts_fails_the_start_with_this_librarys_error(pool_env, proxy,
                                                                                            monkeypatch):
    # sandbox.run()'s failure escaped as huggingface_hub's own SandboxError, which `except SandboxError` (this
    # library's) missed, while the create just before it was wrapped (found by review).
    emu = pool_env()
    first = provider(emu, proxy, pool="run-fault")
    first.wait_for_ready(first.start_container())  # a warm host
    host_id = first._pooled.host_id
    real_create = hub.SandboxPool.create

    def create_then_evict(self, **kwargs):  # the host evicts the sandbox right after its create
        sandbox = real_create(self, **kwargs)
        emu.sandbox_hosts.host(host_id).delete_sandbox(sandbox.id.split(".", 1)[1])
        return sandbox

    monkeypatch.setattr(hub.SandboxPool, "create", create_then_evict)
    p = provider(emu, proxy, pool="run-fault")
    with pytest.raises(SandboxError, match="starting the server in sandbox .* failed: HTTP 404") as failed:
        p.start_container()
    assert isinstance(failed.value, JobsAPIError) and failed.value.status_code == 404
    assert host_sandboxes(emu, host_id) == [local_id(first)] and p.phase == hsp.Phase.IDLE
    first.stop_container()


def test_a_stop_of_a_sandbox_its_host_evicted_says_so_and_frees_its_place_so_no_extra_host_is_booted(
        pool_env, proxy, caplog):
    # huggingface_hub's kill() counts the host's 404 for an evicted sandbox as a failure: the stop warned "could
    # not kill it ... sweep --pool", left the stage RUNNING, and kept the sandbox's place on the host taken, so after
    # a host's worth of such stops the pool booted (and billed) a new host for an empty one (found by review).
    emu = pool_env()
    cheap = ["sleep", "600"]  # start_container() only: no readiness needed
    first = provider(emu, proxy, pool="evicted", command=cheap)
    first.start_container()
    host_id = first._pooled.host_id
    first.stop_container()
    capacity = hf_sandbox_pool._pools[next(iter(hf_sandbox_pool._pools))].pool.sandboxes_per_host
    caplog.clear()
    for _ in range(capacity):
        p = provider(emu, proxy, pool="evicted", command=cheap)
        p.start_container()
        emu.sandbox_hosts.host(host_id).delete_sandbox(local_id(p))  # the host's idle eviction
        p.stop_container()
        assert p.stage == "DELETED" and p.phase == hsp.Phase.IDLE
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "hf_sandbox" in r.name]
    jobs = len(emu.jobs)
    last = provider(emu, proxy, pool="evicted", command=cheap)
    last.start_container()
    assert last._pooled.host_id == host_id and len(emu.jobs) == jobs  # before: a new host job for an empty one
    last.stop_container()


def test_a_slow_kill_that_ends_after_the_environment_was_started_again_leaves_the_new_stage_alone(
        pool_env, proxy, monkeypatch):
    # The pooled teardown wrote "CANCELED" over the stage of the start made while its kill was in flight, so a
    # running environment said it was cancelled (the core's own teardown checked the job id; found by review).
    emu = pool_env()
    real_kill = hub.Sandbox._kill
    killing = threading.Event()

    def slow_kill(self):  # the host answers this kill late (busy, or a slow link)
        killing.set()
        time.sleep(1.5)
        return real_kill(self)

    p = provider(emu, proxy, pool="stage")
    p.wait_for_ready(p.start_container())
    monkeypatch.setattr(hub.Sandbox, "_kill", slow_kill)
    stopper, _ = support.in_thread(p.stop_container)
    assert killing.wait(TIMEOUT)  # the stop has let go of the sandbox and sent its kill
    monkeypatch.setattr(hub.Sandbox, "_kill", real_kill)
    p.wait_for_ready(p.start_container())  # started again meanwhile
    stopper.join(TIMEOUT)
    assert p.stage == "RUNNING" and p.phase == hsp.Phase.RUNNING  # before: CANCELED
    assert requests.get(p.base_url + "/health", timeout=TIMEOUT).status_code == 200
    p.stop_container()


def test_stopping_a_sandbox_whose_host_died_reports_the_hosts_stage_not_a_sandbox_left_running(
        pool_env, proxy, caplog):
    emu = pool_env()
    p = provider(emu, proxy, pool="host-dies")
    p.wait_for_ready(p.start_container())
    host_id = p._pooled.host_id
    emu.kill_job(host_id)  # the host's machine dies: its sandboxes go with it
    emu.wait_for_stage(host_id, ["ERROR"])
    caplog.clear()
    p.stop_container()  # the kill cannot reach the host; the host's own stage says the sandbox is gone
    assert p.stage == "ERROR"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "hf_sandbox" in r.name], [
        r.getMessage() for r in caplog.records]


@pytest.mark.slow  # boots two host jobs
@pytest.mark.parametrize("ended_url_status", [None, 502])
def test_a_host_killed_while_serving_fails_each_session_with_a_typed_error_and_a_restart_lands_on_a_new_host(
        pool_env, proxy, ended_url_status):
    emu = pool_env(ended_url_status=ended_url_status)
    providers = [provider(emu, proxy, pool="doomed") for _ in range(2)]
    for p in providers:
        p.wait_for_ready(p.start_container())
    host_id = providers[0]._pooled.host_id
    sessions = [EnvSession(p.base_url, timeout_s=20) for p in providers]
    try:
        for session in sessions:
            session.reset()
        emu.kill_job(host_id)
        emu.wait_for_stage(host_id, ["ERROR"])
        for session in sessions:
            with pytest.raises(SessionError):
                session.step({"message": "after the host died"})
    finally:
        for session in sessions:
            session.close()
    restarted = providers[0]
    restarted.stop_container()  # its sandbox went with the host: the kill fails, the host's stage says so
    restarted.wait_for_ready(restarted.start_container())
    assert restarted._pooled.host_id != host_id
    with EnvSession(restarted.base_url) as session:
        session.reset()
        assert session.step({"message": "again"})["observation"]["echoed_message"] == "again"
    for p in providers:
        p.stop_container()


@pytest.mark.parametrize("ended_url_status", [None, 404, 502, 503])
def test_a_start_after_the_pools_host_died_lands_on_a_new_host_whatever_the_dead_hosts_url_answers(
        pool_env, proxy, caplog, ended_url_status):
    # huggingface_hub keeps placing sandboxes on a host it booted until the pool closes. A dead host whose URL
    # refused connections was forgotten, but one whose URL answered an HTTP status (as a front serving many jobs'
    # names may; the Hub's answer is not known) failed every later start of the pool.
    emu = pool_env(ended_url_status=ended_url_status)
    p = provider(emu, proxy, pool="dies-answering")
    p.wait_for_ready(p.start_container())
    host_id = p._pooled.host_id
    emu.kill_job(host_id)
    emu.wait_for_stage(host_id, ["ERROR"])
    p.stop_container()
    caplog.clear()
    p.wait_for_ready(p.start_container())
    assert p._pooled.host_id != host_id
    with EnvSession(p.base_url) as session:
        session.reset()
        assert session.step({"message": "on the new host"})["observation"]["echoed_message"] == "on the new host"
    assert "host job %s has ended" % host_id in caplog.text
    p.stop_container()


@pytest.mark.slow  # boots four host jobs
def test_starts_made_at_once_after_two_hosts_died_land_on_new_hosts_and_each_death_is_reported_once(
        pool_env, proxy, caplog):
    emu = pool_env(sandbox_capacity=2, ended_url_status=502)
    providers = [provider(emu, proxy, pool="two-die") for _ in range(3)]
    for p in providers:
        p.wait_for_ready(p.start_container())
    dead = sorted({p._pooled.host_id for p in providers})
    assert len(dead) == 2
    for host_id in dead:
        emu.kill_job(host_id)
        emu.wait_for_stage(host_id, ["ERROR"])
    for p in providers:
        p.stop_container()
    caplog.clear()
    starts = [support.in_thread(lambda p=p: p.wait_for_ready(p.start_container())) for p in providers]
    for thread, outcome in starts:
        thread.join(TIMEOUT)
        assert outcome == [None], outcome
    assert not {p._pooled.host_id for p in providers} & set(dead)
    for host_id in dead:  # one question at a time for the pool: the creates that failed meanwhile take its answer
        assert caplog.text.count("host job %s has ended" % host_id) == 1, caplog.text
    for p in providers:
        p.stop_container()


@pytest.mark.parametrize("ended_url_status", [None, 404, 502])
def test_a_host_that_dies_before_the_server_answers_fails_readiness_with_the_hosts_stage(
        pool_env, proxy, ended_url_status):
    # A front answering 404 for the ended host must not read as the sandbox's eviction (stage DELETED).
    emu = pool_env(ended_url_status=ended_url_status)
    p = provider(emu, proxy, pool="dies-booting", command=[sys.executable, "-c", "import time; time.sleep(60)"])
    p.start_container()
    emu.kill_job(p._pooled.host_id)
    with pytest.raises(JobFailedError) as failed:
        p.wait_for_ready(timeout_s=30)
    assert failed.value.stage == "ERROR" and failed.value.job_id == p._pooled.host_id
    p.stop_container()


@pytest.mark.slow  # waits out a health probe's and a host check's timeouts
def test_a_readiness_wait_on_a_host_that_stalls_its_answers_ends_near_its_budget(pool_env, proxy):
    # The host check asked huggingface_hub's processes(), whose 60 s timeout outlasted a 3 s budget by a minute.
    emu = pool_env(network_faults=True)
    p = provider(emu, proxy, pool="stalls", command=[sys.executable, "-c", "import time; time.sleep(120)"])
    p.start_container()
    # The first /health probe and the first host check stall; the failed start's kill, the third answer, does
    # not (huggingface_hub's kill waits 60 s for a stalled host: docs/pool.md).
    emu.stall_next_responses(p._pooled.host_id, count=2, seconds=110)
    began = time.monotonic()
    with pytest.raises(JobStartTimeout):
        p.wait_for_ready(timeout_s=3)
    took = time.monotonic() - began
    assert took < 3 + 10 + 10 + 10, took  # the budget, a /health probe's and a host check's timeouts, slack
    assert emu.sandbox_hosts.host(p._pooled.host_id).sandbox_ids == []  # the failed start's teardown killed it
    p.stop_container()


def test_an_evicted_sandbox_fails_readiness_with_a_typed_error(pool_env, proxy):
    emu = pool_env()
    p = provider(emu, proxy, command=[sys.executable, "-c", "import time; time.sleep(60)"])  # never serves
    p.start_container()
    emu.sandbox_hosts.host(p._pooled.host_id).delete_sandbox(local_id(p))  # as the host's eviction does
    with pytest.raises(JobFailedError) as failed:
        p.wait_for_ready(timeout_s=30)
    assert failed.value.stage in ("DELETED", "ERROR")


@pytest.mark.slow  # the create is retried with backoff
@pytest.mark.parametrize("status", [429, 503])
def test_a_transient_error_on_sandbox_create_is_retried(pool_env, proxy, status):
    emu = pool_env()
    with provider(emu, proxy, pool="warm") as first:
        first.wait_for_ready(first.start_container())  # the host is up
        emu.sandbox_hosts.inject_create_errors(2, status)
        with provider(emu, proxy, pool="warm") as second:
            second.wait_for_ready(second.start_container())
            assert second._pooled.host_id == first._pooled.host_id


@pytest.mark.slow  # the create is retried with backoff
def test_a_create_error_that_persists_is_a_jobs_api_error_and_leaves_nothing(pool_env, proxy):
    emu = pool_env()
    with provider(emu, proxy, pool="failing") as first:
        first.wait_for_ready(first.start_container())
        emu.sandbox_hosts.inject_create_errors(hf_sandbox_pool.CREATE_RETRIES + 1, 503)
        second = provider(emu, proxy, pool="failing")
        with pytest.raises(JobsAPIError) as failed:
            second.start_container()
        assert failed.value.status_code == 503
        assert host_sandboxes(emu, first._pooled.host_id) == [local_id(first)]


@pytest.mark.slow  # a host job that crashes at boot
def test_a_host_that_crashes_at_boot_fails_the_start_with_its_log(pool_env, proxy):
    emu = pool_env(faults={"crash-at-boot": "sbx-server: cannot start (emulated crash)"})
    with pytest.raises(SandboxError, match="pool crashing could not start a host job") as failed:
        provider(emu, proxy, pool="crashing").start_container()
    # the stage seen by the job watcher (huggingface_hub's own checks are answered from it), the message, the log
    assert "status: ERROR" in str(failed.value) and "emulated crash" in str(failed.value)
    assert len(emu.jobs) == 1 and proxy._routes == {}
    assert emu.wait_for_stage(emu.jobs[0].id, ["ERROR", "CANCELED"]).stage in ("ERROR", "CANCELED")


# -- safety nets: a process that ends without stopping its environments -----------------------------

CHILD = r'''
import os, sys, time
sys.path[:0] = [os.environ["ROOT"], os.environ["TESTS"]]
import huggingface_hub.constants
huggingface_hub.constants.HF_HOME = os.environ["HF_HOME_DIR"]
import hf_jobs_emulator  # the TLS emulator's job names (*.jobs.localhost) resolve per process
hf_jobs_emulator._LoopbackNames.add(hf_jobs_emulator.TLS_HOST_SUFFIX)
import hf_sandbox_provider as hsp
kept = []
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):  # sandboxes on the pool's one host
    p = hsp.HFSandboxProvider("python:3.12", endpoint=os.environ["EMU_ENDPOINT"], token=os.environ["EMU_TOKEN"],
                              verify=os.environ["SSL_CERT_FILE"], command=os.environ["SERVER"].split("\x1f"),
                              pool="child", start_timeout_s=60, ready_timeout_s=60)
    p.wait_for_ready(p.start_container())
    kept.append(p)
if sys.argv[1] == "signal":
    hsp.install_signal_teardown()
    import hf_sandbox_pool
    hf_sandbox_pool.HOST_CLOSE_WAIT_S = 3.0  # what is tested is the order; the cancel may be slow on a loaded machine
print("READY", p.job_id, flush=True)
if sys.argv[1] == "signal":
    time.sleep(120)
sys.stdin.readline()  # "exit": ends when the test has looked at its sandbox
'''


@pytest.mark.slow  # a child interpreter that boots a host job
@pytest.mark.parametrize("ending, sandboxes", [("exit", 1), ("signal", 1), ("exit", 4), ("signal", 4)])
def test_a_process_that_exits_or_gets_sigterm_kills_its_sandboxes_and_cancels_the_hosts_it_booted(
        pool_env, tmp_path, ending, sandboxes):
    import signal
    import subprocess

    emu = pool_env()
    env = dict(os.environ, ROOT=os.path.dirname(HERE), TESTS=HERE, HF_HOME_DIR=str(tmp_path / "child-home"),
               EMU_ENDPOINT=emu.endpoint, EMU_TOKEN=emu.token, SERVER="\x1f".join(SERVER))
    child = subprocess.Popen([sys.executable, "-c", CHILD, ending, str(sandboxes)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("READY"), child.stderr.read()
        host_id = line.split()[1].split(".")[0]
        assert len(host_sandboxes(emu, host_id)) == sandboxes
        if ending == "signal":
            child.send_signal(signal.SIGTERM)
        child.stdin.close()  # "exit": the child's stdin ends, so does the child
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == (-signal.SIGTERM if ending == "signal" else 0)
    assert emu.wait_for_stage(host_id, ["CANCELED"]).stage == "CANCELED"
    with child.stdout, child.stderr:
        err = child.stderr.read()
    assert emu.token not in err
    # Each sandbox ended, with its host or by its own kill: no warning says otherwise (before: "could not kill
    # it" and huggingface_hub's "Failed to kill sandbox", when a kill met its host's cancel).
    assert "could not kill" not in err and "Failed to kill" not in err, err


@pytest.mark.slow  # a child interpreter given SIGTERM
def test_on_sigterm_the_sandboxes_of_a_host_the_pool_only_adopted_are_killed_before_its_close_releases_it(
        pool_env, proxy, tmp_path):
    import signal
    import subprocess

    emu = pool_env()
    ours = provider(emu, proxy, pool="child")  # this process boots the host; the child's pool of that name adopts it
    ours.wait_for_ready(ours.start_container())
    host_id = ours._pooled.host_id
    env = dict(os.environ, ROOT=os.path.dirname(HERE), TESTS=HERE, HF_HOME_DIR=str(tmp_path / "child-home"),
               EMU_ENDPOINT=emu.endpoint, EMU_TOKEN=emu.token, SERVER="\x1f".join(SERVER))
    child = subprocess.Popen([sys.executable, "-c", CHILD, "signal", "2"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("READY"), child.stderr.read()
        assert line.split()[1].split(".")[0] == host_id and len(host_sandboxes(emu, host_id)) == 3
        child.send_signal(signal.SIGTERM)
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    with child.stdout, child.stderr:
        err = child.stderr.read()
    # Before: the close released the host's client at once, so the kills failed and both sandboxes ran on.
    assert host_sandboxes(emu, host_id) == [local_id(ours)] and emu.job(host_id).stage == "RUNNING", err
    assert "could not kill" not in err and "Failed to kill" not in err and emu.token not in err, err
    assert requests.get(ours.base_url + "/health", timeout=TIMEOUT).status_code == 200  # ours serves on
    ours.stop_container()


def _age_pool_cache(pool: str, seconds: float) -> None:
    """Make every host huggingface_hub's pool cache holds for `pool` look `seconds` older, as if
    that long had passed since a process wrote it."""
    import glob
    import json

    paths = glob.glob(os.path.join(hub.constants.HF_HOME, "sandbox", "pools", "*", pool + ".json"))
    assert paths, "no pool cache for %s under %s" % (pool, hub.constants.HF_HOME)
    for path in paths:
        with open(path) as fh:
            cache = json.load(fh)
        for host in cache["hosts"]:
            host["updated_at"] -= seconds
        with open(path, "w") as fh:
            json.dump(cache, fh)


@pytest.mark.slow  # a child interpreter that boots a host job
@pytest.mark.parametrize("age", ["fresh", "past-its-trust-ttl"])
def test_a_start_after_a_killed_process_left_a_host_the_hub_then_forgot_lands_on_a_new_host(
        pool_env, proxy, tmp_path, age):
    import subprocess

    from huggingface_hub._sandbox_cache import HOST_TRUST_TTL

    emu = pool_env()
    env = dict(os.environ, ROOT=os.path.dirname(HERE), TESTS=HERE, EMU_ENDPOINT=emu.endpoint,
               HF_HOME_DIR=hub.constants.HF_HOME, EMU_TOKEN=emu.token, SERVER="\x1f".join(SERVER))
    child = subprocess.Popen([sys.executable, "-c", CHILD, "exit"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("READY"), child.stderr.read()
        host_id = line.split()[1].split(".")[0]
    finally:
        child.kill()  # a trainer killed outright: no teardown, its host stays in the cache file
        child.communicate()
    emu.forget_job(host_id)  # the Hub no longer knows the host job: JobNotFoundError
    if age != "fresh":
        _age_pool_cache("child", HOST_TRUST_TTL + 60)
    p = provider(emu, proxy, pool="child", start_timeout_s=30, ready_timeout_s=30)
    with p:
        p.wait_for_ready(p.start_container())
        assert p._pooled.host_id != host_id
        assert requests.post(p.base_url + "/reset", json={}, timeout=10).status_code == 200


def test_a_start_after_the_hub_forgot_a_host_of_this_processs_pool_lands_on_a_new_host(
        pool_env, proxy):
    emu = pool_env()
    with provider(emu, proxy, pool="forgotten") as first:
        first.wait_for_ready(first.start_container())
        host_id = first._pooled.host_id
    emu.forget_job(host_id)
    with provider(emu, proxy, pool="forgotten", start_timeout_s=30, ready_timeout_s=30) as second:
        second.wait_for_ready(second.start_container())
        assert second._pooled.host_id != host_id


@pytest.mark.slow  # waits out a 3 s job timeout
def test_job_timeout_bounds_a_pooled_server_so_nothing_bills_forever_after_a_lost_client(pool_env, proxy):
    emu = pool_env()
    with provider(emu, proxy, job_timeout=3) as p:
        p.wait_for_ready(p.start_container())
        sandbox = p._pooled.sandbox
        wait_until(lambda: not [proc for proc in sandbox.processes() if proc.running], "the server's deadline",
                   timeout_s=30)
        assert any("job_timeout of 3s reached" in line for line in p.logs())
        assert requests.get(p.base_url + "/health", timeout=10).status_code == 502


@pytest.mark.slow  # a CLI / example subprocess, like the other CLI and example tests
def test_smoke_local_pool_runs_every_stage_closes_the_pool_and_leaves_no_temporary_directory(tmp_path):
    import json
    import subprocess

    import tempfile

    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_ENDPOINT", "SSL_CERT_FILE")}
    # A TMPDIR of its own, to see that the run leaves nothing in it (a long one works too: see
    # test_emulator_sandbox's long-TMPDIR test)
    with tempfile.TemporaryDirectory() as tmp:
        env.update(PYTHONPATH=os.path.dirname(HERE), HF_HOME=str(tmp_path), TMPDIR=tmp)
        run = subprocess.run([sys.executable, "-m", "hf_sandbox_provider", "smoke", "--local", "--pool", "smoke",
                              "--json"], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
        report = json.loads(run.stdout)
        assert run.returncode == 0 and report["ok"], run.stderr
        assert "." in report["job_id"]  # <host job id>.<sandbox id>
        assert [s["ok"] for s in report["stages"] if s["name"].startswith("close pool")] == [True]
        # before: a hf-sandbox-smoke-* directory (huggingface_hub's pool cache home) per run
        assert [name for name in os.listdir(tmp) if name.startswith("hf-sandbox-smoke-")] == []


@pytest.mark.slow  # boots two host jobs
def test_sweep_pool_cancels_the_host_jobs_a_lost_process_left_of_that_pool_only(pool_env, proxy, monkeypatch, capsys):
    import hf_sandbox_cli

    emu = pool_env()
    kept = provider(emu, proxy, pool="other")
    kept.wait_for_ready(kept.start_container())
    lost = provider(emu, proxy, pool="lost")
    lost.wait_for_ready(lost.start_container())
    monkeypatch.setenv("HF_TOKEN", emu.token)
    monkeypatch.setenv("HF_ENDPOINT", emu.endpoint)
    assert hf_sandbox_cli.main(["sweep", "--pool", "lost"]) == 0
    assert "cancelled %s" % lost._pooled.host_id in capsys.readouterr().out
    assert emu.wait_for_stage(lost._pooled.host_id, ["CANCELED"]).stage == "CANCELED"
    assert emu.job(kept._pooled.host_id).stage == "RUNNING"
    kept.stop_container()
    lost.stop_container()


@pytest.mark.slow  # a CLI / example subprocess, like the other CLI and example tests
@pytest.mark.parametrize("example", ["legacy_http_client.py", "openenv_client.py"])
def test_an_example_runs_pooled_with_local_and_pool(tmp_path, example):
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_ENDPOINT", "SSL_CERT_FILE")}
    env.update(HF_HOME=str(tmp_path))
    run = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "examples", example), "--local",
                          "--pool", "example"], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 jobs run, 0 job processes left" in run.stdout, run.stdout


def test_a_training_sandbox_runs_pooled_and_stop_sandboxes_also_cancels_the_pools_host(pool_env):
    from hf_sandbox_training import Sandbox, stop_sandboxes

    emu = pool_env()
    sandbox = Sandbox(IMAGE, pool="training", endpoint=emu.endpoint, token=emu.token, verify=emu.ca_path,
                      command=SERVER, start_timeout_s=TIMEOUT, ready_timeout_s=TIMEOUT)
    try:
        with sandbox.session() as session:
            session.reset()
            assert session.step({"message": "pooled"})["observation"]["echoed_message"] == "pooled"
        host_id = sandbox.provider._pooled.host_id
    finally:
        stop_sandboxes()
    assert emu.wait_for_stage(host_id, ["CANCELED"]).stage == "CANCELED"


def _processes_running(needle: str) -> List[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat("/proc/%s" % pid).st_uid != os.getuid():  # this user's only
                continue
            with open("/proc/%s/cmdline" % pid, "rb") as handle:
                cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace")
            with open("/proc/%s/stat" % pid) as handle:
                zombie = handle.read().split(") ")[-1][:1] == "Z"
        except OSError:
            continue
        if needle in cmdline and not zombie:
            found.append(int(pid))
    return found


def test_the_job_timeout_watcher_ends_with_its_server_so_no_process_is_left(pool_env, proxy):
    emu = pool_env()
    marker = "--crash-after"
    limit = 3000 + secrets.randbelow(1000)  # names this test's watcher among this user's processes
    p = provider(emu, proxy, command=FAULTY_SERVER + [marker, "0"], job_timeout=limit)
    p.start_container()
    with pytest.raises(JobFailedError):
        p.wait_for_ready()
    wait_until(lambda: not _processes_running("sleep %d" % limit)
               and not _processes_running("job_timeout of %ds" % limit),
               "the deadline watcher to end with its server", timeout_s=10)


def test_a_pooled_environment_works_through_the_process_host_with_its_sandbox_headers_pushed(pool_env, log_guard):
    # The sandbox's headers (bearer and X-Sandbox-Token) are a callable read in this process and pushed to
    # the proxy's child (AuthProxy.spawn), which sends them with every request and WebSocket upgrade.
    emu = pool_env()
    with AuthProxy.spawn() as host:
        with provider(emu, host) as p:  # type: ignore[arg-type]
            base_url = p.start_container()
            watch_sandbox_token(p, log_guard)
            p.wait_for_ready()
            assert base_url.startswith(host.url + "/")
            step = requests.post(base_url + "/step", json={"action": {"message": "abc"}}, timeout=10).json()
            assert step["observation"]["echoed_message"] == "abc"
            with EnvSession(base_url) as session:
                session.reset()
                assert session.step({"message": "hello"})["observation"]["echoed_message"] == "hello"
        assert requests.get(base_url + "/health", timeout=10).status_code == 404  # unmounted in the child
    hf_sandbox_pool.close_pools()


@pytest.mark.parametrize("pool, message", [
    ("", "pool=''"), ("my pool", "pool='my pool'"), ("p" * 101, "1-100 letters"), ("pool\n", "pool='pool"),
    (42, "a huggingface_hub SandboxPool, not int"),
], ids=["empty", "space", "too-long", "trailing-newline", "int"])
def test_a_bad_pool_is_refused_at_construction_naming_the_value_and_the_rule(pool, message):
    with pytest.raises(SandboxConfigError, match=message):
        HFSandboxProvider("python:3.12", pool=pool)


# Run inside a vendored package (the core, proxy.py and the pool layer only) against the TLS emulator.
VENDORED_POOL = """
import json, socket, sys, requests
# The TLS emulator's hosts (*.jobs.localhost) are loopback (RFC 6761), which this resolver may not know: the
# emulator maps them in its own process, so this one does the same before anything connects.
resolve = socket.getaddrinfo
socket.getaddrinfo = lambda host, *args, **kwargs: resolve(
    "127.0.0.1" if str(host).endswith(".localhost") else host, *args, **kwargs)
from vendored.hf_sandbox_provider import HFSandboxProvider
endpoint, token, ca_path, command = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
with HFSandboxProvider("python:3.12", endpoint=endpoint, token=token, verify=ca_path, command=command,
                       pool="vendored-pool", start_timeout_s=60, ready_timeout_s=60) as provider:
    base_url = provider.start_container()
    provider.wait_for_ready()
    print("health", requests.get(base_url + "/health", timeout=30).status_code)
import vendored.hf_sandbox_pool as pool
pool.close_pools()
print("modules", sorted(m for m in sys.modules if m.startswith(("vendored.", "hf_", "proxy"))))
"""


@pytest.mark.slow  # a fresh interpreter, a host job and a sandbox
def test_the_core_vendored_with_the_pool_layer_runs_a_pooled_environment(pool_env, tmp_path):
    import json
    import subprocess

    emu = pool_env()
    support.vendored_package(str(tmp_path), "vendored", ["hf_sandbox_provider.py", "proxy.py", "hf_sandbox_pool.py"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON"))}
    env.update(PYTHONPATH=str(tmp_path), HF_HOME=str(tmp_path / "hf-home"), SSL_CERT_FILE=emu.ca_path)
    result = subprocess.run([sys.executable, "-c", VENDORED_POOL, emu.endpoint, emu.token, emu.ca_path,
                             json.dumps(SERVER)], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "health 200", "modules ['vendored.hf_sandbox_pool', 'vendored.hf_sandbox_provider', 'vendored.proxy']"]
    # The host it booted is cancelled: the child asked before it exited, and the emulator's supervisor
    # thread ends the job (stage CANCELED) a moment later: the cancel call only asks.
    assert all(job._stop_reason is not None or job.terminal for job in emu.jobs)
    wait_until(lambda: all(job.stage in ("CANCELED", "COMPLETED") for job in emu.jobs), "the host job to end")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("how", ["exit", "stop_sandboxes"])
def test_a_forked_childs_exit_or_stop_sandboxes_leaves_the_parents_pool_host_and_environment_serving(pool_env, how):
    # A fork worker inherited the named pools: its normal exit (the pool layer's exit hook) or its
    # stop_sandboxes() closed them, cancelling the parent's host job and every environment on it (found by review).
    from hf_sandbox_provider import stop_sandboxes

    emu = pool_env()
    with AuthProxy() as proxy:
        p = provider(emu, proxy, pool="forked")
        p.wait_for_ready(p.start_container())
        host = p._pooled.host_id
        pid = os.fork()
        if pid == 0:  # the child: whatever happens, it leaves through os._exit
            code = 1
            try:
                if how == "stop_sandboxes":
                    stop_sandboxes()
                else:  # the pool layer's exit hook (not every atexit hook of pytest's process: the emulator's)
                    hf_sandbox_pool._close_pools_at_exit()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.5)  # a cancel the child sent would have ended the host by now
        assert emu.job(host).stage == "RUNNING"
        assert requests.get(p.base_url + "/health", timeout=TIMEOUT).status_code == 200
        p.stop_container()


# -- interrupted boots, failed closes, top-ups and labels (review findings F1-F6, F12) ---------------


@contextlib.contextmanager
def _ctrl_c_when(condition: Callable[[], object]) -> Iterator[None]:
    """A terminal's Ctrl-C (SIGINT to the main thread, which wakes a blocked wait) once `condition()` holds,
    only while the block runs: one that ended otherwise (another error) must not see it land in pytest."""
    import signal

    main, done = threading.main_thread().ident, threading.Event()
    pressed = threading.Lock()  # held by the press and by the block's end: a press lands inside the block or never

    def watch() -> None:
        wait_until(lambda: done.is_set() or condition(), "the moment to press Ctrl-C", TIMEOUT)
        with pressed:
            if not done.is_set():
                signal.pthread_kill(main, signal.SIGINT)

    watcher = threading.Thread(target=watch, name="test-ctrl-c", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        with pressed:
            done.set()
        watcher.join(TIMEOUT)


def _boot_threads() -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ThreadPoolExecutor")]


@pytest.mark.slow  # a 3 s host boot interrupted, then the boot threads' end awaited
@pytest.mark.parametrize("boot", ["first-start", "prewarm-top-up", "on-demand"])
def test_ctrl_c_during_a_host_boot_cancels_the_host_job_it_was_booting(pool_env, proxy, boot):
    emu = pool_env(sandbox_host_boot_s=3.0, **({"sandbox_capacity": 1} if boot == "on-demand" else {}))
    first = provider(emu, proxy, pool="interrupted")
    if boot != "first-start":
        first.wait_for_ready(first.start_container())  # the pool exists, with one host serving `first`
    kept = {job.id for job in emu.jobs}
    threads_before = set(_boot_threads())
    with pytest.raises(KeyboardInterrupt), _ctrl_c_when(lambda: len(emu.jobs) > len(kept)):  # (being booted)
        if boot == "first-start":
            first.start_container()
        elif boot == "prewarm-top-up":
            hf_sandbox_pool.prewarm(first, hf_sandbox_pool.HOST_CAPACITY_ASSUMED + 1)  # start_many's top-up
        else:
            provider(emu, proxy, pool="interrupted").start_container()  # the only host is full: boots one
    (booting,) = [job.id for job in emu.jobs if job.id not in kept]
    # Cancelled without any close: before, nothing held it (no pool, or not in the pool), so nothing ever would.
    assert emu.wait_for_stage(booting, ["CANCELED"]).stage == "CANCELED"
    assert [emu.job(job_id).stage for job_id in kept] == ["RUNNING"] * len(kept)  # the live pool's host serves on
    first.stop_container()
    hf_sandbox_pool.close_pools()
    assert all(emu.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED" for job in emu.jobs)
    wait_until(lambda: not set(_boot_threads()) - threads_before, "huggingface_hub's boot threads to end")


def test_a_sandbox_whose_pool_close_has_not_cancelled_its_host_within_the_wait_is_killed_all_the_same(pool_env, proxy):
    # The signal teardown marks the named pools' hosts as closing, so their sandboxes' releases wait for the host
    # cancels instead of racing them. A close that does not cancel in time (it waits for creates in flight) must
    # not leave the sandboxes running: after HOST_CLOSE_WAIT_S each is killed, and its host can idle out.
    emu = pool_env()
    p = provider(emu, proxy, pool="slow-close")
    p.wait_for_ready(p.start_container())
    host_id = p._pooled.host_id
    began = time.monotonic()
    closes = hf_sandbox_pool._closes_first(4.0)  # as the teardown begins; these closes are not run here
    assert len(closes) == 1 and host_id in hf_sandbox_pool._closing_hosts
    p.stop_container()
    assert time.monotonic() - began >= hf_sandbox_pool.HOST_CLOSE_WAIT_S - 0.05  # it waited for the close first
    assert host_sandboxes(emu, host_id) == [] and emu.job(host_id).stage == "RUNNING"  # its own kill ended it
    assert hf_sandbox_pool.close_pools() == [] and hf_sandbox_pool._closing_hosts == {}  # the marks end with it
    assert emu.wait_for_stage(host_id, ["CANCELED"]).stage == "CANCELED"


def test_a_process_that_lives_on_after_the_signal_teardown_closed_its_pool_starts_a_new_pool_of_that_name(
        pool_env, proxy):
    emu = pool_env()
    first = provider(emu, proxy, pool="again")
    first.wait_for_ready(first.start_container())
    host_id = first._pooled.host_id
    hf_sandbox_training._teardown_process(4.0)  # what SIGTERM runs; a handler of the process's own lets it live on
    assert emu.wait_for_stage(host_id, ["CANCELED"]).stage == "CANCELED"
    first.stop_container()  # (its sandbox ended with the host: nothing to kill)
    with provider(emu, proxy, pool="again") as second:  # before: "This SandboxPool is closed", at every start
        second.wait_for_ready(second.start_container())
        assert second._pooled.host_id != host_id
    assert hf_sandbox_pool.close_pools() == []


def test_close_pools_returns_the_host_jobs_it_could_not_cancel(pool_env, proxy):
    emu = pool_env()
    p = provider(emu, proxy, pool="uncancellable")
    p.wait_for_ready(p.start_container())
    host_id = p._pooled.host_id
    emu.inject_server_errors(50, status=503, routes=["cancel"])
    try:
        assert hf_sandbox_pool.close_pools() == [host_id]  # before: None, whatever was left running
    finally:
        emu.inject_server_errors(0, routes=["cancel"])
    assert emu.job(host_id).stage == "RUNNING"
    p.stop_container()
    assert hf_sandbox_pool.close_pools() == []


def test_a_failed_top_up_of_an_existing_pool_is_this_librarys_error_naming_the_pool(pool_env, proxy):
    emu = pool_env()
    first = provider(emu, proxy, pool="topup")
    first.wait_for_ready(first.start_container())  # the pool exists, with one host
    emu.inject_server_errors(50, status=503, routes=["create"])  # the Hub refuses the next host's create
    try:
        # before: huggingface_hub's HfHubHTTPError
        with pytest.raises(SandboxError, match="pool topup could not start a host job: .*503"):
            HFSandboxProvider.start_many(hf_sandbox_pool.HOST_CAPACITY_ASSUMED + 1, IMAGE, progress=False,
                                         endpoint=emu.endpoint, token=emu.token, verify=emu.ca_path, proxy=proxy,
                                         command=SERVER, pool="topup", start_timeout_s=TIMEOUT,
                                         ready_timeout_s=TIMEOUT)
    finally:
        emu.inject_server_errors(0, routes=["create"])
    first.stop_container()


@pytest.mark.slow  # two host boots of 2 s
def test_a_start_after_start_manys_first_boot_failed_boots_one_host_not_the_failed_plan(pool_env, proxy, monkeypatch):
    monkeypatch.setattr(hf_sandbox_pool, "HOST_CAPACITY_ASSUMED", 2)  # 3 environments: plan 2 hosts
    emu = pool_env(sandbox_host_boot_s=2.0)
    common = dict(endpoint=emu.endpoint, token=emu.token, verify=emu.ca_path, proxy=proxy, command=SERVER,
                  pool="replanned", ready_timeout_s=TIMEOUT)
    with pytest.raises(hsp.StartManyError):  # the hosts take 2 s to boot, the start allows 1 s
        HFSandboxProvider.start_many(3, IMAGE, progress=False, start_timeout_s=1, **common)
    failed = {job.id for job in emu.jobs}
    assert len(failed) == 2
    with HFSandboxProvider(IMAGE, start_timeout_s=TIMEOUT, **common) as p:
        p.wait_for_ready(p.start_container())
        assert len([job for job in emu.jobs if job.id not in failed]) == 1  # before: 2, the failed plan's


def test_plain_sweep_finds_a_pools_host_jobs_and_huggingface_hubs_pool_still_adopts_them(
        pool_env, proxy, monkeypatch, capsys, tmp_path):
    import hf_sandbox_cli

    emu = pool_env()
    p = provider(emu, proxy, pool="labelled")
    p.wait_for_ready(p.start_container())
    host_id = p._pooled.host_id
    monkeypatch.setenv("HF_TOKEN", emu.token)
    monkeypatch.setenv("HF_ENDPOINT", emu.endpoint)
    assert hf_sandbox_cli.main(["sweep", "--dry-run"]) == 0
    assert "would cancel %s (RUNNING, cpu-basic, " % host_id in capsys.readouterr().out  # before: 0 leftover jobs
    assert hf_sandbox_cli.main(["sweep", "--pool", "labelled", "--dry-run"]) == 0
    assert "would cancel %s" % host_id in capsys.readouterr().out
    # huggingface_hub's own pool of that name (another process: no pool cache) finds the host by its labels.
    monkeypatch.setattr(hub.constants, "ENDPOINT", emu.endpoint)
    monkeypatch.setattr(hub.constants, "HF_HOME", str(tmp_path / "other-process"))
    with hub.SandboxPool(IMAGE, name="labelled", token=emu.token, namespace=emu.namespace,
                         start_timeout=TIMEOUT) as theirs:
        sandbox = theirs.create()
        assert sandbox.host_id == host_id and len(emu.jobs) == 1
        sandbox.kill()
    assert emu.job(host_id).stage == "RUNNING"  # adopted, so only released by their close
    p.stop_container()


def test_on_python_3_9_the_pooled_refusal_says_python_3_10_is_needed(monkeypatch):
    monkeypatch.setattr(hub, "__version__", "1.3.0")  # the newest huggingface_hub a 3.9 interpreter installs
    assert "pip install -U 'huggingface_hub>=2.1.1'" in (hf_sandbox_pool.hub_rejection() or "")  # 3.10+: upgrade
    monkeypatch.setattr(sys, "version_info", (3, 9, 18, "final", 0))
    reason = hf_sandbox_pool.hub_rejection() or ""
    assert "needs Python 3.10+" in reason and "Python 3.9.18" in reason, reason
    assert "pip install" not in reason  # before: advice pip cannot follow on 3.9


def test_smoke_pool_fails_its_close_stage_and_exits_1_when_a_host_could_not_be_cancelled(
        pool_env, monkeypatch, capsys):
    import json
    import shlex

    import hf_sandbox_cli

    emu = pool_env()
    monkeypatch.setenv("HF_TOKEN", emu.token)
    monkeypatch.setenv("HF_ENDPOINT", emu.endpoint)
    emu.inject_server_errors(1000, status=503, routes=["cancel"])  # the Hub refuses every job cancel
    try:
        status = hf_sandbox_cli.main(["smoke", "--pool", "closefail", "--command", shlex.join(SERVER), "--json"])
        report = json.loads(capsys.readouterr().out)
        (host,) = emu.jobs
        assert emu.job(host.id).stage == "RUNNING"  # still billing
    finally:
        emu.inject_server_errors(0, routes=["cancel"])
    (close,) = [s for s in report["stages"] if s["name"].startswith("close pool")]
    assert status == 1 and not report["ok"]  # before: 0, the close stage "ok (closed)"
    assert not close["ok"] and host.id in close["detail"] and "sweep --pool closefail" in close["detail"]
    assert [s["ok"] for s in report["stages"] if s["name"].startswith("stop_container")] == [True]
