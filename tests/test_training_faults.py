"""Rollout slots (`Sandbox.session()`) and `EnvSession` under faults of the path to the job, against the
emulator with real job processes and the real proxy child of `proxy="process"`: a connection reset during the
WebSocket upgrade is a `SessionError`; a dead proxy child is named as such (not "is the provider still
running?"); a frozen job costs one `timeout_s`-bounded reset and is replaced (review_chaos F2, F3, F4)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from typing import Iterator

import pytest

import hf_sandbox_provider as hsp
from hf_jobs_emulator import JobsEmulator, echo_server_command
from hf_sandbox_provider import EnvSession, EpisodeLost, Sandbox, SessionError, SessionTimeout, stop_sandboxes
import support
from support import WhenLogged, in_thread, own_process_proxy, wait_until

TIMEOUT = 30.0


@pytest.fixture
def emu(make_emu) -> Iterator[JobsEmulator]:
    emulator = make_emu(scheduling_delay_s=0.3)
    emulator.settings = dict(endpoint=emulator.endpoint, token=emulator.token, command=echo_server_command(),
                             poll_interval_s=0.1, job_timeout=600)
    yield emulator
    stop_sandboxes()


@pytest.fixture
def process_proxy() -> Iterator[None]:
    """The core's shared proxy host child, started fresh by the test (its Sandbox's mount) and stopped after."""
    with own_process_proxy():
        yield
        stop_sandboxes()


def all_ended(emu: JobsEmulator) -> None:
    for job in emu.jobs:
        assert emu.wait_for_stage(job.id, ["CANCELED", "ERROR", "COMPLETED"]).terminal, job


def _accept_queue(port: int) -> int:
    """Connections waiting in the accept queue of the socket listening on loopback `port` (Linux: a listening
    socket's rx_queue in /proc/net/tcp{,6})."""
    waiting = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for fields in (line.split() for line in list(lines)[1:]):
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    waiting += int(fields[4].split(":")[1], 16)
    return waiting


def _upgrade_cut_by_the_dying_proxy_child(host, action) -> list:
    """Run `action` while the proxy child is frozen, so its WebSocket upgrade waits in the listen backlog,
    then SIGKILL the child: the kernel resets the connections it never accepted. Returns [outcome]."""
    support.stop_process(host.pid)
    try:
        thread, outcome = in_thread(action)
        # (not a fixed pause: on a loaded machine the action may not have connected yet, and would be refused)
        wait_until(lambda: _accept_queue(host.port) or not thread.is_alive(), "the upgrade in the listen backlog")
        assert thread.is_alive(), outcome  # waiting for the answer to its upgrade
    finally:
        os.kill(host.pid, signal.SIGKILL)
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    return outcome


def test_an_env_session_whose_upgrade_the_dying_proxy_child_resets_raises_a_session_error(emu, process_proxy):
    # A raw ConnectionResetError escaped a slot session's reset() when the proxy child died mid-upgrade (F2).
    box = Sandbox("img:tag", proxy="process", **emu.settings)
    url = box.wait(TIMEOUT)
    host = hsp._shared_proxies["process"]
    (error,) = _upgrade_cut_by_the_dying_proxy_child(host, lambda: EnvSession(url, timeout_s=TIMEOUT))
    assert isinstance(error, SessionError) and not isinstance(error, SessionTimeout), repr(error)
    assert "broke during the WebSocket upgrade" in str(error) and host.url.replace("http", "ws") in str(error)
    assert url.rsplit("/", 1)[1] not in str(error)  # no route id
    assert isinstance(error.__cause__, OSError)
    stop_sandboxes()
    all_ended(emu)


def test_a_slot_reset_whose_upgrade_the_dying_proxy_child_resets_runs_on_its_replacement(emu, process_proxy):
    # Found by real TRL (test_trl_training.py): the reset raised "broke during the WebSocket upgrade: Connection
    # reset by peer" to the trainer, which ended training, while the child was being replaced on the same port.
    box = Sandbox("img:tag", proxy="process", **emu.settings)
    box.wait(TIMEOUT)
    host = hsp._shared_proxies["process"]
    pid = host.pid
    with box.session(timeout_s=TIMEOUT) as session:
        (answer,) = _upgrade_cut_by_the_dying_proxy_child(host, session.reset)
        assert isinstance(answer, dict), answer
        assert session.step({"message": "after"})["observation"]["echoed_message"] == "after"
    assert host.pid != pid and host.running and len(box.job_ids) == 1
    stop_sandboxes()
    all_ended(emu)


def test_after_the_proxy_child_ended_resets_and_sessions_say_so_instead_of_asking_if_the_provider_runs(
        emu, process_proxy) -> None:
    # Every reset said "Connection refused (is the provider still running?)" while the provider ran (F3).
    box = Sandbox("img:tag", proxy="process", **emu.settings)
    url = box.wait(TIMEOUT)
    with box.session(timeout_s=TIMEOUT) as session:
        assert session.step({"message": "before"})["observation"]["echoed_message"] == "before"
        host = hsp._shared_proxies["process"]
        pid = host.pid
        os.kill(pid, signal.SIGTERM)  # ended for good (a killed child is replaced: see the next test)
        wait_until(lambda: not host.running, "the proxy child's end to be noticed", 10)
        said = r"proxy process \(pid %d\) serving this URL ended: its routes are gone.*until the providers are " \
               r"restarted" % pid
        for _ in range(2):  # the kept connection is found closed, then the new one is refused
            with pytest.raises(SessionError, match=said) as caught:
                session.reset()
            assert "still running" not in str(caught.value)
        with pytest.raises(SessionError, match=said):
            EnvSession(url, timeout_s=TIMEOUT)
    stop_sandboxes()
    all_ended(emu)


def test_after_the_proxy_child_was_killed_and_replaced_the_next_reset_runs_on_the_same_job(emu, process_proxy) -> None:
    box = Sandbox("img:tag", proxy="process", **emu.settings)
    url = box.wait(TIMEOUT)
    with box.session(timeout_s=TIMEOUT) as session:
        session.reset()
        assert session.step({"message": "before"})["observation"]["echoed_message"] == "before"
        host, job = hsp._shared_proxies["process"], box.job_ids[0]
        pid = host.pid
        os.kill(pid, signal.SIGKILL)  # as the OOM killer would
        wait_until(lambda: host.pid != pid and host._revival is None, "the proxy child to be replaced", 30)
        with pytest.raises(EpisodeLost):  # the episode's connection died with the child
            session.step({"message": "during"})
        session.reset()  # a new connection, at the same URL, to the same job
        assert session.step({"message": "after"})["observation"]["echoed_message"] == "after"
        assert box.job_ids == [job] and box.provider.base_url == url and host.running
    stop_sandboxes()
    all_ended(emu)


def test_a_reset_made_while_the_proxy_child_is_replaced_waits_for_it_instead_of_failing(emu, process_proxy) -> None:
    box = Sandbox("img:tag", proxy="process", **emu.settings)
    box.wait(TIMEOUT)
    proxy_log = logging.getLogger("proxy")
    with box.session(timeout_s=TIMEOUT) as session:
        session.reset()
        host = hsp._shared_proxies["process"]
        # the reset begins once the replacement does, before the new child listens on the proxy's port
        resetter = WhenLogged("starting another", session.reset)
        proxy_log.addHandler(resetter)
        try:
            os.kill(host.pid, signal.SIGKILL)
            wait_until(lambda: resetter.thread is not None, "the replacement to begin", 10)
            resetter.thread.join(TIMEOUT)
        finally:
            proxy_log.removeHandler(resetter)
        # before: SessionError "could not connect ...: Connection refused (is the provider still running?)"
        assert isinstance(resetter.outcome[0], dict), resetter.outcome
        assert session.step({"message": "after"})["observation"]["echoed_message"] == "after"
        assert len(box.job_ids) == 1 and host.running
    stop_sandboxes()
    all_ended(emu)


def _refused_before_the_death_is_noticed(host, action) -> list:
    """Kill the proxy child while the handle cannot record it (its lock held), and run `action` once the port
    refuses connections: the refusals meet a handle that still says it runs and replaces nothing yet. Then let
    the handle notice; returns [what `action` returned or raised]."""
    port = host.port
    thread = None
    with host._lock:
        os.kill(host.pid, signal.SIGKILL)
        wait_until(lambda: _refuses(port), "the dead child's port to refuse connections", 10)
        thread, outcome = in_thread(action)
        time.sleep(0.5)
        assert thread.is_alive(), outcome  # before: failed at once, every attempt refused
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    return outcome


def _refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # e.g. reset: queued on the listener as the killed child's exit closed it (seen under load)
        return False
    return False


def test_a_reset_refused_before_the_proxy_childs_death_is_noticed_waits_for_its_replacement(emu, process_proxy):
    box = Sandbox("img:tag", proxy="process", **emu.settings)
    box.wait(TIMEOUT)
    with box.session(timeout_s=TIMEOUT) as session:
        session.reset()
        host = hsp._shared_proxies["process"]
        outcome = _refused_before_the_death_is_noticed(host, session.reset)
        assert isinstance(outcome[0], dict), outcome
        assert session.step({"message": "after"})["observation"]["echoed_message"] == "after"
        assert len(box.job_ids) == 1 and host.running
    stop_sandboxes()
    all_ended(emu)


def test_an_env_session_opened_while_the_proxy_child_is_replaced_connects_to_the_new_child(emu, process_proxy):
    box = Sandbox("img:tag", proxy="process", **emu.settings)
    url = box.wait(TIMEOUT)
    host = hsp._shared_proxies["process"]
    pid = host.pid
    # before: SessionError "could not connect ...: Connection refused (is the provider still running?)"
    (session,) = _refused_before_the_death_is_noticed(host, lambda: EnvSession(url, timeout_s=TIMEOUT))
    with session:
        assert session.step({"message": "after"})["observation"]["echoed_message"] == "after"
    assert host.pid != pid and host.running
    stop_sandboxes()
    all_ended(emu)


# A job whose gateway goes down as a session's upgrade arrives, as the emulator's does when its job is killed:
# the first instance answers the upgrade 503 with `X-Proxy-Error: proxy-stopping` and /health 503 from then on;
# an instance started after it (the marker file exists) is the echo server.
GATEWAY_GOING_DOWN = """
import os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
marker, echo = sys.argv[1], sys.argv[2:]
if os.path.exists(marker):
    os.execv(echo[0], echo)
open(marker, "w").close()
down = []

class Gateway(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            down.append(True)
        status = 503 if down else 200
        self.send_response(status)
        if status == 503:
            self.send_header("X-Proxy-Error", "proxy-stopping")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Gateway).serve_forever()
"""


def test_a_proxy_stopping_refusal_relayed_from_a_dying_job_replaces_it_while_our_proxy_runs(emu, tmp_path) -> None:
    # The slot took the relayed refusal for its own proxy stopping and raised it from reset() (seen once in CI).
    command = [sys.executable, "-c", GATEWAY_GOING_DOWN, str(tmp_path / "first-started")] + echo_server_command()
    box = Sandbox("img:tag", **dict(emu.settings, command=command))
    first = box.wait(TIMEOUT) and box.job_ids[0]
    with box.session(timeout_s=TIMEOUT) as session:
        session.reset()  # before: SessionRefusedError "HTTP 503 from the proxy (proxy-stopping)"
        assert session.step({"message": "after"})["observation"]["echoed_message"] == "after"
        assert box.job_ids != [first]
    stop_sandboxes()
    all_ended(emu)


@pytest.mark.slow  # a frozen job, a timeout and a replacement's cold start: ~5 s
def test_a_frozen_job_costs_one_reset_bounded_by_timeout_s_and_is_replaced(emu) -> None:
    # Each reset on a frozen (SIGSTOPped) job waited connect_timeout_s=30 whatever timeout_s, and the slot
    # stayed on that job until its renewal (F4).
    box = Sandbox("img:tag", **emu.settings)
    with box.session(timeout_s=2) as session:
        session.reset()
        frozen = box.job_ids[0]
        pid = emu.job(frozen).pid
        support.stop_process(pid, group=True)
        try:
            with pytest.raises(EpisodeLost):
                session.step({"message": "frozen"})
            began = time.monotonic()
            session.reset()  # the upgrade waits 2 s, /health 2 s more: the job is replaced and the reset runs there
            took = time.monotonic() - began
            assert took < 15, "the reset took %.1fs" % took
            assert session.step({"message": "after"})["observation"]["echoed_message"] == "after"
            assert box.job_ids and box.job_ids != [frozen]
            assert len(emu.jobs) == 2
        finally:
            try:
                os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:  # cancelled (killed) already
                pass
    stop_sandboxes()
    all_ended(emu)


def test_a_health_probe_made_while_the_proxy_child_is_replaced_asks_the_new_child_instead_of_saying_no(
        emu, process_proxy):
    # The slot asks /health whether to replace a job (after a 5xx upgrade or a timeout, and before joining a
    # shared group): a probe refused by the port of a child being replaced said "no", and a healthy job went.
    from hf_sandbox_training import _answers_health

    box = Sandbox("img:tag", proxy="process", **emu.settings)
    url = box.wait(TIMEOUT)
    host = hsp._shared_proxies["process"]
    (answer,) = _refused_before_the_death_is_noticed(host, lambda: _answers_health(url))
    assert answer is True
    stop_sandboxes()
    all_ended(emu)
