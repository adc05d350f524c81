"""README promises that had no guard of their own, each proved through the library's own path against the
emulator (section names are README's): a malformed HF_SANDBOX_RATE_LIMIT is refused before any call and a
well-formed one paces the library's calls while cancels still go through (Errors, Many environments);
a stop that cannot wait for a start to end warns naming what to look for, and the job is still
cancelled (Cost safety); start_many keeps at most `max_parallel` starts in flight (Many environments).

The audit of those sections (docs/promises.md maps every promise to its guard) added: the error classes
are what the Errors table says, so `except ValueError` / `except SandboxError` catch what it promises;
signal teardown stays opt-in (a start installs no handler); a provider still running when its interpreter
exits normally has its job cancelled; every provider of the process shares one
proxy bound to loopback and no URL carries the token; start_many's documented defaults; stop_all stops
providers in parallel; route ids carry 192 random bits and a client's own Authorization never reaches the
job, whichever way the proxy parses the request (Security); response heads are refused above 256 KiB,
not at some other size (Limits)."""

from __future__ import annotations

import base64
import contextlib
import inspect
import json
import logging
import signal
import subprocess
import sys
import textwrap
import threading

import os
from urllib.parse import urlsplit

import pytest
import requests

import hf_sandbox_provider as hsp
from hf_jobs_emulator import echo_server_command
from support import TEST_TOKEN, in_thread, wait_until
from upstreams.scripted import ScriptedUpstream, serve_by_path

IMAGE = "registry.hf.space/openenv-echo-env:latest"
HELD_WINDOW_S = 2.0  # how long a start held by the API budget is watched for calls it should not make


def _provider(emu, proxy, **kwargs) -> hsp.HFSandboxProvider:
    options = dict(endpoint=emu.endpoint, token=emu.token, proxy=proxy, command=echo_server_command(),
                   poll_interval_s=0.05, start_timeout_s=60, ready_timeout_s=60)
    options.update(kwargs)
    return hsp.HFSandboxProvider(IMAGE, **options)


# -- Errors: the classes of the table ------------------------------------------------------------------


@pytest.mark.parametrize("error, bases", [
    (hsp.SandboxConfigError, (hsp.SandboxError, ValueError)),
    (hsp.InsecureURLError, (ValueError,)),
    (hsp.JobsAPIError, (hsp.SandboxError,)),
    (hsp.JobFailedError, (hsp.SandboxError,)),
    (hsp.JobStartTimeout, (hsp.SandboxError, TimeoutError)),
    (hsp.StartManyError, (hsp.SandboxError,)),
    (hsp.ReplicaStartError, (hsp.SandboxError,)),
], ids=lambda value: getattr(value, "__name__", None))
def test_each_error_is_catchable_as_the_classes_the_errors_table_names(error, bases):
    assert all(issubclass(error, base) for base in bases), error.__mro__


def test_a_config_error_from_a_start_is_caught_by_except_value_error(make_emu, proxy):
    emu = make_emu()
    with pytest.raises(ValueError, match="port 70000"):
        _provider(emu, proxy).start_container(port=70000)
    assert emu.api_calls == {}


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
    assert hsp.STOP_WAIT_S == 30  # README's number; the rule, not its length, is what runs below
    monkeypatch.setattr(hsp, "STOP_WAIT_S", 0.5)
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
    assert warning[0] == (
        "stop_container(): the start of this provider has not ended after 0.5s; it cancels its job when its "
        "create answers, but if this process exits first cancel it with `python -m hf_sandbox_provider sweep "
        "--label %s=%s`" % (hsp.START_LABEL_KEY, label))
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


# -- Cost safety: signal teardown is opt-in ---------------------------------------------------------------


def test_a_start_and_a_stop_install_no_signal_handler_until_asked(make_emu, proxy):
    import hf_sandbox_training  # the layer that holds the handler, loaded as a trainer would

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)}
    emu = make_emu()
    with _provider(emu, proxy) as provider:
        provider.wait_for_ready(provider.start_container())
        during = {signum: signal.getsignal(signum) for signum in before}
    assert during == before and hf_sandbox_training._on_teardown_signal not in during.values()
    assert {signum: signal.getsignal(signum) for signum in before} == before


# -- Cost safety: every provider still running at interpreter exit ---------------------------------------


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEFT_RUNNING = textwrap.dedent("""
    import json, sys
    import hf_sandbox_provider as hsp
    provider = hsp.HFSandboxProvider(sys.argv[1], **json.loads(sys.argv[2]))
    provider.start_container()
    print(provider.job_id, flush=True)
    # the script ends here with its job running: no stop, no close, no with-block
""")


@pytest.mark.slow  # a fresh interpreter that imports the library and starts a job
def test_a_provider_still_running_when_the_interpreter_exits_has_its_job_cancelled(make_emu):
    emu = make_emu()
    settings = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command(), poll_interval_s=0.05)
    child = subprocess.run([sys.executable, "-c", LEFT_RUNNING, IMAGE, json.dumps(settings)], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    (job,) = emu.jobs
    assert child.stdout.strip() == job.id and "still running at exit" in child.stderr
    assert emu.api_calls.get("cancel") == 1  # sent by the child, which is gone
    assert emu.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED"
    assert emu.token not in child.stdout + child.stderr


# -- Many environments and Security: one loopback proxy for every provider ------------------------------


def _listening_addresses(port: int) -> list:
    """Local addresses (hex, as /proc/net/tcp{,6} spell them) of this process's sockets listening on `port`
    (another process of the machine may listen on the same port at another address)."""
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            ours.add(os.readlink("/proc/self/fd/" + fd))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                address, port_hex = fields[1].rsplit(":", 1)
                if fields[3] == "0A" and int(port_hex, 16) == port and "socket:[%s]" % fields[9] in ours:  # LISTEN
                    found.append(address)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the listening sockets from /proc")
def test_providers_given_no_proxy_share_one_proxy_that_listens_on_loopback_only(make_emu):
    emu = make_emu()
    first, second = (_provider(emu, None) for _ in range(2))
    try:
        urls = [first.start_container(), second.start_container()]
        origins = {urlsplit(url)[:2] for url in urls}
        assert len(origins) == 1 and urlsplit(urls[0]).hostname == "127.0.0.1", urls
        assert _listening_addresses(urlsplit(urls[0]).port) == ["0100007F"]  # 127.0.0.1, nothing else
        for url in urls + [first.upstream_url, first.job_url, repr(first)]:
            assert emu.token not in url
    finally:
        hsp.stop_all([first, second])


# -- Many environments: start_many's defaults; stop_all in parallel --------------------------------------


def test_start_many_defaults_are_the_documented_ones():
    defaults = {name: parameter.default for name, parameter
                in inspect.signature(hsp.HFSandboxProvider.start_many).parameters.items()
                if parameter.default is not inspect.Parameter.empty}
    assert defaults == {"image": None, "max_parallel": 64, "all_or_nothing": True, "progress": True}


class _MeetsTheOthersBeforeStopping(hsp.HFSandboxProvider):
    """Each stop waits, before cancelling, until every provider of the group is inside its own stop: only
    stops running at the same time get through."""

    group: "threading.Barrier"
    met: list = []

    def stop_container(self) -> None:
        try:
            self.group.wait()
            self.met.append(self.job_id)
        finally:
            super().stop_container()


def test_stop_all_stops_the_providers_in_parallel_and_cancels_every_job(make_emu, proxy):
    emu = make_emu()
    providers = _MeetsTheOthersBeforeStopping.start_many(
        3, IMAGE, progress=False, endpoint=emu.endpoint, token=emu.token, proxy=proxy,
        command=echo_server_command(), poll_interval_s=0.05)
    _MeetsTheOthersBeforeStopping.group = threading.Barrier(3, timeout=20)
    _MeetsTheOthersBeforeStopping.met = []
    hsp.stop_all(providers)
    assert sorted(_MeetsTheOthersBeforeStopping.met) == sorted(p.job_id for p in providers)
    assert {emu.wait_for_stage(job.id, ["CANCELED"]).stage for job in emu.jobs} == {"CANCELED"}


# -- Security: route ids ---------------------------------------------------------------------------------


def test_each_route_id_is_192_random_bits(proxy, upstream):
    ids = [proxy.mount(upstream.url, "hf_" + "r" * 30).rsplit("/", 1)[1] for _ in range(64)]
    decoded = [base64.urlsafe_b64decode(route_id + "=" * (-len(route_id) % 4)) for route_id in ids]
    assert {len(raw) for raw in decoded} == {24} and len(set(ids)) == 64
    # 32 hex digits would decode to 24 bytes too, with 128 bits: a urlsafe id uses the whole alphabet.
    assert set("".join(ids)) - set("0123456789abcdef")


# -- Security: a client's own Authorization never reaches the job --------------------------------------


# Today's proxy parses a plain request on a fast path and one with a hop-by-hop header it must act on
# (chunked framing, a header the Connection header names) the strict way: the rule holds on both.
@pytest.mark.parametrize("method, extra, body", [
    ("GET", {}, None),
    ("POST", {"Content-Type": "application/json", "Connection": "close"}, b"{}"),
    ("POST", {}, iter([b"{", b"}"])),  # chunked
    ("GET", {"Connection": "keep-alive, X-Hop", "X-Hop": "dropped"}, None),
], ids=["get", "post-with-body", "post-chunked", "connection-names-a-header"])
def test_a_clients_own_authorization_is_replaced_by_the_route_token(upstream, proxy, method, extra, body):
    base = proxy.mount(upstream.url, TEST_TOKEN)  # the upstream answers 401 to anything else
    headers = dict(extra, Authorization="Bearer client-own")
    answer = requests.request(method, base + "/x", headers=headers, data=body, timeout=30)
    (seen,) = upstream.requests
    sent = [value for name, value in seen.headers if name.lower() == "authorization"]
    assert sent == ["Bearer " + TEST_TOKEN]
    assert answer.status_code == 200


# -- Limits: response heads over 256 KiB ------------------------------------------------------------------


HEAD_LIMIT = 256 * 1024  # README's number, not the module's constant: the promise is the number
HEAD_LINE = b"X-Pad-%d: " + b"p" * 63000 + b"\r\n"  # under http.client's 64 KiB per line


@pytest.mark.parametrize("pad_lines, extra, relayed", [
    (4, b"", True),  # a head of ~252 KB: under the limit
    (4, b"X-Tail: " + b"q" * 12000 + b"\r\n", False),  # ~264 KB: over it
], ids=["under-256KiB", "over-256KiB"])
def test_a_response_head_is_relayed_up_to_256_kib_and_refused_past_it(proxy, pad_lines, extra, relayed):
    head = b"".join(HEAD_LINE % i for i in range(pad_lines)) + extra
    assert (len(head) < HEAD_LIMIT - 1024) if relayed else (len(head) > HEAD_LIMIT + 1024)
    script = serve_by_path({"/big-head": b"HTTP/1.1 200 OK\r\n" + head + b"Content-Length: 4\r\n\r\nbody"},
                           b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nsmall")
    with ScriptedUpstream(script) as up:
        answer = requests.get(proxy.mount(up.url, None) + "/big-head", timeout=30)
    if relayed:
        assert (answer.status_code, answer.content) == (200, b"body")
    else:
        assert (answer.status_code, answer.headers["X-Proxy-Error"]) == (502, "upstream-head-too-large")
