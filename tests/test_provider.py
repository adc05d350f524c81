"""HFSandboxProvider's lifecycle: what it sends, how it fails fast, and that no failure leaks a job.

The Jobs REST API is mocked with `responses`; the auth proxy is the real `proxy.AuthProxy`, and the
readiness tests put a real loopback HTTP server behind it. "No live job" is proven by the cancel
endpoint having been called; "no route" by the proxy answering 404 for the old base URL.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import responses

import hf_sandbox_provider as hsp
from proxy import AuthProxy
from support import in_thread, wait_until

ENDPOINT = "https://hub.test"
LOOPBACK_ENDPOINT = "http://127.0.0.1:9"  # never contacted: `responses` answers for it
IMAGE = "registry.hf.space/openenv-echo-env:latest"
FAST = dict(poll_interval_s=0.01, start_timeout_s=5.0, ready_timeout_s=5.0)


def fresh_token() -> str:
    return "hf_test_" + uuid.uuid4().hex


def job_json(job_id="job1", stage="SCHEDULING", urls=None, message=None):
    return {"id": job_id, "owner": {"id": "u1", "name": "alice", "type": "user"},
            "status": {"stage": stage, "message": message, "exposeUrls": urls}}


def calls_to(mock, method, path):
    return [c for c in mock.calls
            if c.request.method == method and requests.utils.urlparse(c.request.url).path == path]


@pytest.fixture
def api(proxy):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.add_passthru("http://127.0.0.1:%d" % proxy.port)
        yield mock


def add_job_api(mock, endpoint=ENDPOINT, job_id="job1", stages=(), cancel_status=200):
    """whoami, create, a scripted sequence of inspect answers, cancel and an empty log stream."""
    mock.add(responses.GET, endpoint + "/api/whoami-v2", json={"name": "alice", "type": "user"})
    # Answered, when not cached yet: responses keeps the traceback of a request it has no answer for, and its frames
    # would hold the provider (a test that drops one would pass or fail by the tests that ran before it).
    mock.add(responses.GET, endpoint + "/api/jobs/hardware", status=404)
    mock.add(responses.POST, endpoint + "/api/jobs/alice", json=job_json(job_id))
    for answer in stages:
        mock.add(responses.GET, endpoint + "/api/jobs/alice/" + job_id, json=answer)
    mock.add(responses.POST, endpoint + "/api/jobs/alice/%s/cancel" % job_id, status=cancel_status)
    mock.add(responses.GET, endpoint + "/api/jobs/alice/%s/logs" % job_id, body="",
             content_type="text/event-stream")


def running(job_id="job1", url=None):
    return job_json(job_id, "RUNNING", [url or "https://%s--8000.hf.jobs" % job_id])


def cancels(mock, job_id="job1"):
    return len(calls_to(mock, "POST", "/api/jobs/alice/%s/cancel" % job_id))


def route_is_gone(base_url):
    with requests.Session() as session:
        session.trust_env = False
        return session.get(base_url + "/health", timeout=5).status_code == 404


# -- a real loopback environment server -------------------------------------------------------------


class Upstream:
    """A loopback HTTP server answering /health from a script of statuses (the last one repeats)."""

    def __init__(self, statuses):
        self.statuses = list(statuses)
        self.seen_auth = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                upstream.seen_auth.append(self.headers.get("Authorization"))
                status = upstream.statuses.pop(0) if len(upstream.statuses) > 1 else upstream.statuses[0]
                body = json.dumps({"status": "healthy" if status == 200 else "booting"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def upstream_factory():
    made = []

    def make(statuses):
        made.append(Upstream(statuses))
        return made[-1]

    yield make
    for upstream in made:
        upstream.close()


# -- what is sent -----------------------------------------------------------------------------------


def test_start_sends_the_documented_create_body_and_returns_the_proxy_base_url(api, proxy, caplog):
    token = fresh_token()
    add_job_api(api, stages=[job_json(), running()])
    caplog.set_level(logging.DEBUG, logger="hf_sandbox_provider")
    provider = hsp.HFSandboxProvider(IMAGE, token=token, endpoint=ENDPOINT, proxy=proxy, **FAST)
    base_url = provider.start_container()
    try:
        body = json.loads(calls_to(api, "POST", "/api/jobs/alice")[0].request.body)
        assert body["dockerImage"] == IMAGE and "spaceId" not in body
        assert body["command"] == ["sh", "-c",
                                   "cd /app/env && exec uvicorn server.app:app --host 0.0.0.0 --port 8000"]
        assert body["flavor"] == "cpu-basic"
        assert body["timeoutSeconds"] == 3600
        assert body["expose"] == {"ports": [8000], "portsPublic": []}
        assert body["labels"]["hf-sandbox-provider"] == "1"
        assert len(body["labels"]["hf-sandbox-start"]) == 32
        assert all(c.request.headers["Authorization"] == "Bearer " + token for c in api.calls
                   if "hub.test" in c.request.url)
        assert base_url.startswith("http://127.0.0.1:%d/" % proxy.port)
        assert provider.base_url == base_url
        assert provider.upstream_url == "https://job1--8000.hf.jobs"
        assert provider.job_id == "job1" and provider.stage == "RUNNING"
        assert provider.job_url == "https://hub.test/jobs/alice/job1"
        assert {"created", "running", "url"} <= set(provider.timings)
        assert "job1" in caplog.text and "SCHEDULING -> RUNNING" in caplog.text
    finally:
        provider.stop_container()
    assert cancels(api) == 1
    assert provider.base_url is None and route_is_gone(base_url)
    provider.stop_container()
    provider.close()
    assert cancels(api) == 1  # idempotent
    assert token not in caplog.text and token not in repr(provider)


def test_space_image_and_per_call_overrides_reach_the_create_body(api, proxy, caplog):
    add_job_api(api, stages=[running(url="https://job1--7860.hf.jobs")])
    caplog.set_level(logging.DEBUG, logger="hf_sandbox_provider")
    with hsp.HFSandboxProvider(token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, env_vars={"A": "1"},
                               labels={"team": "rl"}, **FAST) as provider:
        provider.start_container("hf.co/spaces/openenv/echo_env", port=7860, env_vars={"B": 2},
                                 flavor="t4-small", job_timeout="30m", command="python -m server --x 'a b'",
                                 secrets={"API_KEY": "s3cret"}, wait_timeout=30.0, workers=4)
        body = json.loads(calls_to(api, "POST", "/api/jobs/alice")[0].request.body)
    assert body["spaceId"] == "openenv/echo_env" and "dockerImage" not in body
    assert body["flavor"] == "t4-small" and body["timeoutSeconds"] == 1800
    assert body["command"] == ["python", "-m", "server", "--x", "a b"]
    assert body["environment"] == {"A": "1", "B": "2"}
    assert body["secrets"] == {"API_KEY": "s3cret"}
    assert body["expose"]["ports"] == [7860]
    assert body["labels"]["team"] == "rl"
    assert "wait_timeout" in caplog.text  # ignored with a debug line, not a TypeError
    assert "s3cret" not in caplog.text
    assert cancels(api) == 1


def test_namespace_given_explicitly_skips_whoami(api, proxy):
    add_job_api(api, stages=[running()])
    with hsp.HFSandboxProvider(IMAGE, namespace="alice", token=fresh_token(), endpoint=ENDPOINT,
                               proxy=proxy, **FAST) as provider:
        provider.start_container()
    assert len(calls_to(api, "GET", "/api/whoami-v2")) == 0
    assert cancels(api) == 1


# -- validation before any network call -------------------------------------------------------------


@pytest.fixture
def no_token_anywhere(monkeypatch, tmp_path):
    import huggingface_hub.constants as hub_constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "token"))


def test_missing_token_fails_before_any_network_call(api, proxy, no_token_anywhere):
    provider = hsp.HFSandboxProvider(IMAGE, endpoint=ENDPOINT, proxy=proxy)
    with pytest.raises(hsp.SandboxConfigError, match="no Hugging Face token.*--local"):
        provider.start_container()
    assert len(api.calls) == 0


def test_a_missing_token_is_refused_in_words_naming_every_way_to_give_one(api, proxy, no_token_anywhere):
    with pytest.raises(hsp.SandboxConfigError) as refused:
        hsp.HFSandboxProvider(IMAGE, endpoint=ENDPOINT, proxy=proxy).start_container()
    assert str(refused.value) == (
        "no Hugging Face token found: pass token=..., set HF_TOKEN, or run `hf auth login` (the token needs "
        "permission to run Jobs); to try everything offline use `python -m hf_sandbox_provider smoke --local`")


@pytest.mark.parametrize("token", ["hf_a b", "hf_ab\n", "\thf_ab", b"hf_ab", 12345, "hf_pasted\u201d",
                                   "hf_\u00e9t\u00e9"],
                         ids=["space", "newline", "tab", "bytes", "int", "curly-quote", "latin-1"])
def test_a_token_with_whitespace_or_not_printable_ascii_is_refused_before_it_is_sent(api, proxy, token):
    # A pasted quote once failed deep in http.client, in an error whose `.object` held "Bearer <token>".
    with pytest.raises(hsp.SandboxConfigError) as refused:
        hsp.HFSandboxProvider(IMAGE, token=token, endpoint=ENDPOINT, proxy=proxy).start_container()
    assert str(refused.value) == ("the Hugging Face token must be a string of printable ASCII without whitespace "
                                  "(a pasted token may carry a quote or space)")
    assert len(api.calls) == 0


def test_token_is_discovered_from_hf_token_env(api, proxy, no_token_anywhere, monkeypatch):
    token = fresh_token()
    monkeypatch.setenv("HF_TOKEN", token)
    add_job_api(api, stages=[running()])
    with hsp.HFSandboxProvider(IMAGE, endpoint=ENDPOINT, proxy=proxy, **FAST) as provider:
        provider.start_container()
    assert api.calls[0].request.headers["Authorization"] == "Bearer " + token


@pytest.mark.parametrize("kwargs, message", [
    (dict(flavor="cpu-huge"), "unknown flavor 'cpu-huge'"),
    (dict(port=70000), "port 70000"),
    (dict(image="Not An Image"), "not a valid Docker image"),
    (dict(job_timeout="forever"), "job_timeout"),
    (dict(env_vars={"1BAD": "x"}), "env_vars"),
    (dict(labels={"hf-sandbox-start": "x"}), "reserved"),
    (dict(labels={"hf-sandbox-process": "x"}), "reserved"),
    (dict(labels={"hf-sandbox-pool": "x"}), "keys starting with 'hf-sandbox-' are the library's own"),  # sweep --pool
    (dict(labels={"hf-sandbox-x": "1", "run": "a"}), r"labels \['hf-sandbox-x'\] are reserved"),
    (dict(command=[]), "command"),
    (dict(labels={"run id": "1"}), "label key 'run id' must be 1 to 100 characters of letters, digits"),
    (dict(labels={"k" * 101: "1"}), "label key 'k{101}' must be 1 to 100"),
    (dict(labels={"model": "Qwen/Qwen3-0.6B"}), r"label model='Qwen/Qwen3-0.6B': the value must be at most 100"),
    (dict(labels={"step": "v" * 101}), "label step='v{101}'"),
    # the emulator's fault labels get no exemption: the core holds every label to the Hub's rule
    (dict(labels={"emulator-crash-at-boot": "boom: at boot"}), "label emulator-crash-at-boot='boom: at boot'"),
    # Each of these once raised a raw TypeError/ValueError/OverflowError, or (the command) only after Hub calls.
    (dict(job_timeout=float("inf")), "job_timeout"),
    (dict(job_timeout="9" * 400), "job_timeout"),
    (dict(poll_interval_s=float("inf")), r"poll_interval_s=inf must be a positive number of seconds, at most 1e\+09"),
    (dict(start_timeout_s=1e12), "start_timeout_s"),
    (dict(env_vars="A=1"), "env_vars must be a dict of name -> string value, not str"),
    (dict(env_vars=5), "env_vars must be a dict of name -> string value, not int"),
    (dict(labels=7), "labels must be a dict"),
    (dict(secrets=["TOKEN"]), "secrets must be a dict of name -> string value, not list"),
    (dict(command='python -c "print(1)'), r"cannot be split like a shell line \(No closing quotation\)"),
])
def test_bad_start_arguments_fail_before_any_network_call(api, proxy, kwargs, message):
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy)
    with pytest.raises(hsp.SandboxConfigError, match=message):
        provider.start_container(**kwargs)
    with pytest.raises(hsp.SandboxConfigError, match=message):  # the constructor says the same
        hsp.HFSandboxProvider(**{"image": IMAGE, "token": fresh_token(), "endpoint": ENDPOINT, "proxy": proxy,
                                 **kwargs})
    assert len(api.calls) == 0


@pytest.mark.parametrize("endpoint", ["https://[::1", "http://localhost:99999"])
def test_a_malformed_endpoint_is_refused_with_an_error_naming_it(endpoint):
    with pytest.raises(hsp.InsecureURLError, match=r"Jobs endpoint '%s' is not a valid URL" % re.escape(endpoint)):
        hsp.HFSandboxProvider(IMAGE, endpoint=endpoint)


def test_wait_for_ready_given_something_other_than_a_url_is_refused_without_touching_the_job(api, proxy):
    add_job_api(api, stages=[running()])
    with hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST) as provider:
        provider.start_container()
        with pytest.raises(hsp.SandboxConfigError, match="takes the base URL start_container\\(\\) returned, not int"):
            provider.wait_for_ready(123)  # type: ignore[arg-type]
        assert provider.phase is hsp.Phase.RUNNING


def test_an_unstarted_auth_proxy_is_refused_before_a_job_is_created(api):
    idle = AuthProxy()  # never started
    with pytest.raises(hsp.SandboxConfigError, match="is not serving: start\\(\\) it first, or pass proxy=None"):
        hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=idle).start_container()
    assert len(api.calls) == 0


@pytest.mark.parametrize("kwargs", [
    dict(image="python:3.12\n"), dict(image="hf.co/spaces/owner/name\n"), dict(namespace="me\n"),
    dict(env_vars={"NAME\n": "x"}), dict(labels={"run\n": "1"}), dict(labels={"run": "1\n"}),
], ids=["image", "space", "namespace", "env-name", "label-key", "label-value"])
def test_a_value_that_passes_only_before_a_trailing_newline_is_refused_before_any_call(api, proxy, kwargs):
    # Each check once anchored with `$`, which also matches before a final newline: "me\n" went into a URL path.
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy)
    with pytest.raises(hsp.SandboxConfigError):
        provider.start_container(**kwargs)
    assert len(api.calls) == 0


def test_labels_within_the_hubs_rule_and_this_librarys_own_labels_pass():
    settings = hsp.HFSandboxProvider(IMAGE, labels={"run-id": "a" * 100, "b_2": "", "n": 7})._settings({})
    body = hsp._job_body(settings, uuid.uuid4().hex)
    assert hsp._label_rule_rejection(body["labels"]) is None  # the reserved ones comply too
    assert set(body["labels"]) >= {hsp.PROVIDER_LABEL_KEY, hsp.START_LABEL_KEY, hsp.PROCESS_LABEL_KEY}


def test_credential_like_env_vars_get_one_warning_naming_each_and_pointing_at_secrets(caplog):
    name = "MY_%s_TOKEN" % uuid.uuid4().hex[:8].upper()  # unique: the warning is once per process
    env = {name: "x", "TOKENIZERS_PARALLELISM": "false", "MAX_NEW_TOKENS": "8",
           "MONKEY": "1"}
    with caplog.at_level(logging.WARNING, logger="hf_sandbox_provider"):
        for _ in range(3):
            hsp.HFSandboxProvider(IMAGE, env_vars=env)
    warned = [r.getMessage() for r in caplog.records if "looks like a credential" in r.getMessage()]
    assert len(warned) == 1 and name in warned[0] and "secrets=" in warned[0]
    assert hsp._credential_env_names(env) == [name]
    assert hsp._credential_env_names({"AWS_SECRET_ACCESS_KEY": 1, "OPENAI_API_KEY": 1, "DB_PASSWORD": 1,
                                      "hf_token": 1}) == ["AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY",
                                                          "DB_PASSWORD", "hf_token"]


def test_the_credential_warning_is_turned_off_by_its_keyword(api, proxy, caplog, no_token_anywhere):
    name = "X_%s_SECRET" % uuid.uuid4().hex[:8].upper()
    with caplog.at_level(logging.WARNING, logger="hf_sandbox_provider"):
        provider = hsp.HFSandboxProvider(IMAGE, env_vars={name: "1"}, warn_env_credentials=False)
        with pytest.raises(hsp.SandboxConfigError, match="no Hugging Face token"):  # after the warning would be
            provider.start_container(env_vars={"DB_" + name: "1"})
    assert "looks like a credential" not in caplog.text
    assert pickle.loads(pickle.dumps(provider)).warn_env_credentials is False


def test_bad_constructor_arguments_are_refused_at_construction():
    with pytest.raises(hsp.SandboxConfigError, match="unknown flavor"):
        hsp.HFSandboxProvider(IMAGE, flavor="gpu-please")
    with pytest.raises(hsp.SandboxConfigError, match="poll_interval_s"):
        hsp.HFSandboxProvider(IMAGE, poll_interval_s=0)


def test_start_without_any_image_names_both_places_to_give_one(api, proxy):
    with pytest.raises(hsp.SandboxConfigError, match="start_container"):
        hsp.HFSandboxProvider(token=fresh_token(), endpoint=ENDPOINT, proxy=proxy).start_container()


# -- fail fast, and never leave a job behind --------------------------------------------------------


@pytest.mark.parametrize("stages", [
    [job_json(stage="ERROR", message="image pull failed")],
    [job_json(), job_json(stage="ERROR", message="image pull failed")],
    [job_json(), job_json(stage="RUNNING"), job_json(stage="COMPLETED", message="image pull failed")],
])
def test_terminal_stage_before_the_url_raises_job_failed_with_log_tail_and_cancels(api, proxy, stages):
    add_job_api(api, stages=stages)
    api.replace(responses.GET, ENDPOINT + "/api/jobs/alice/job1/logs",
                body="".join("data: %s\n\n" % json.dumps({"data": "Traceback line %d" % i}) for i in range(3)),
                content_type="text/event-stream")
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    with pytest.raises(hsp.JobFailedError) as info:
        provider.start_container()
    err = info.value
    assert err.job_id == "job1" and err.stage == stages[-1]["status"]["stage"]
    assert err.message == "image pull failed"
    assert err.log_tail == ["Traceback line 0", "Traceback line 1", "Traceback line 2"]
    assert "image pull failed" in str(err) and "Traceback line 2" in str(err)
    assert cancels(api) == 1 and provider.base_url is None


def test_no_url_by_start_timeout_raises_timeout_error_and_cancels(api, proxy):
    add_job_api(api, stages=[job_json()])
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy,
                                     poll_interval_s=0.01, start_timeout_s=0.2)
    with pytest.raises(hsp.JobStartTimeout, match="start_timeout_s") as info:
        provider.start_container()
    assert isinstance(info.value, TimeoutError) and info.value.job_id == "job1"
    assert "slow flavors" in str(info.value) and hsp.RATE_LIMIT_ENV not in str(info.value)
    assert cancels(api) == 1


def test_a_start_the_api_budget_held_past_start_timeout_names_the_rate_limit_not_the_flavor(
        api, proxy, monkeypatch):
    # 7 calls per window keep a reserve of 5 for cancels: the hardware list and the create use the
    # other 2, so the budget then holds every watcher refresh until the window resets (300 s).
    monkeypatch.setenv(hsp.RATE_LIMIT_ENV, "7/300")
    endpoint = "https://budget-%s.hub.test" % uuid.uuid4().hex  # its own (uncached) hardware list
    add_job_api(api, endpoint=endpoint, stages=[job_json()])
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=endpoint, proxy=proxy,
                                     namespace="alice", poll_interval_s=0.01, start_timeout_s=0.5)
    with pytest.raises(hsp.JobStartTimeout, match="rate limit") as info:
        provider.start_container()
    assert hsp.RATE_LIMIT_ENV in str(info.value) and "slow flavors" not in str(info.value)
    assert not calls_to(api, "GET", "/api/jobs/alice/job1")  # no refresh got through the budget
    assert cancels(api) == 1  # the cancel goes through on the reserve


def test_a_start_whose_create_the_budget_held_names_the_rate_limit_even_once_the_budget_is_free(api, proxy):
    # Another call with this token was answered 429 (a 1.5 s pause), which the start's hardware list waits
    # out before the submit; then the create is answered 429 (1 s more), and its retry waits that out in the
    # budget after the submit. At start_timeout_s nothing is held any more, but the create was: the advice is
    # the rate limit's, not the flavor's.
    endpoint = "https://budget-%s.hub.test" % uuid.uuid4().hex  # its own (uncached) hardware list
    token = fresh_token()
    api.add(responses.GET, endpoint + "/api/jobs/alice/other", status=429, headers={"Retry-After": "0.5"})
    api.add(responses.GET, endpoint + "/api/jobs/hardware", status=404)  # the static flavor list then
    api.add(responses.POST, endpoint + "/api/jobs/alice", status=429, headers={"Retry-After": "0"})
    add_job_api(api, endpoint=endpoint, stages=[job_json()])
    with pytest.raises(hsp.JobsAPIError):
        hsp._JobsClient(endpoint, token).get_job("alice", "other", retries=0)
    provider = hsp.HFSandboxProvider(IMAGE, token=token, endpoint=endpoint, proxy=proxy, namespace="alice",
                                     poll_interval_s=0.01, start_timeout_s=0.5)
    with pytest.raises(hsp.JobStartTimeout) as info:
        provider.start_container()
    assert hsp.RATE_LIMIT_ENV in str(info.value) and "slow flavors" not in str(info.value)
    assert len(calls_to(api, "POST", "/api/jobs/alice")) == 2 and cancels(api) == 1


@pytest.mark.parametrize("url", ["https://evil.example", "http://job1--8000.hf.jobs",
                                 "https://job2--8000.hf.jobs"])
def test_url_failing_the_rule_raises_insecure_url_error_before_the_token_goes_anywhere(api, proxy, url):
    add_job_api(api, stages=[running(url=url)])
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    with pytest.raises(hsp.InsecureURLError, match="refusing"):
        provider.start_container()
    assert all("hub.test" in c.request.url for c in api.calls)  # nothing went to the foreign host
    assert provider.base_url is None and cancels(api) == 1


def test_loopback_url_from_a_remote_endpoint_is_refused(api, proxy):
    add_job_api(api, stages=[running(url="http://127.0.0.1:8000")])
    with pytest.raises(hsp.InsecureURLError):
        hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy,
                              **FAST).start_container()
    assert cancels(api) == 1


def test_a_cancel_answered_404_is_done_and_a_refused_one_asks_the_jobs_stage_once(api, proxy, caplog):
    add_job_api(api, stages=[running()], cancel_status=404)  # the job no longer exists: nothing bills
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    provider.start_container()
    provider.stop_container()
    assert cancels(api) == 1 and provider.stage == "CANCELED"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    api.reset()
    add_job_api(api, stages=[running()], cancel_status=400)  # refused: is the job over anyway?
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice/job1", status=503)  # ... the Hub cannot say
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    provider.start_container()
    inspected = len(calls_to(api, "GET", "/api/jobs/alice/job1"))
    provider.stop_container()
    # one look per refused attempt, never retried (a teardown must stay brief); not CANCELED
    assert len(calls_to(api, "GET", "/api/jobs/alice/job1")) - inspected == hsp.CANCEL_ATTEMPTS
    assert cancels(api) == hsp.CANCEL_ATTEMPTS and provider.stage != "CANCELED"


def test_a_refused_cancel_warns_naming_the_job_its_hub_page_and_sweep(api, proxy, caplog):
    add_job_api(api, stages=[running()], cancel_status=403)  # refused; the job still runs
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    provider.start_container()
    page = provider.job_url
    provider.stop_container()  # must not raise
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING][-1]
    assert page.endswith("/jobs/alice/job1") and cancels(api) == hsp.CANCEL_ATTEMPTS
    assert re.fullmatch(r"HF job job1: could not cancel it \(cancelling job job1 failed: HTTP 403.*\)\. "
                        r"Unless it has ended, it runs \(and bills\) until its timeout; cancel it at %s or run "
                        r"`python -m hf_sandbox_provider sweep`" % re.escape(page), warning), warning


@pytest.mark.slow  # the cancel is retried with backoff
def test_failed_cancel_is_retried_then_logged_with_job_id_and_sweep_hint_without_raising(api, proxy, caplog):
    add_job_api(api, stages=[running()], cancel_status=500)
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    base_url = provider.start_container()
    page = provider.job_url
    provider.stop_container()  # must not raise
    assert cancels(api) == hsp.CANCEL_ATTEMPTS * 3  # each attempt is one call plus two quick retries
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "job1" in warnings[-1] and "sweep" in warnings[-1]
    assert page and page.endswith("/jobs/alice/job1") and page in warnings[-1]  # README: its Hub page
    assert route_is_gone(base_url)


def test_cancel_refused_because_the_job_already_finished_counts_as_done(api, proxy, caplog):
    add_job_api(api, stages=[running()], cancel_status=400)
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    provider.start_container()
    api.replace(responses.GET, ENDPOINT + "/api/jobs/alice/job1", json=job_json(stage="COMPLETED"))
    provider.stop_container()
    assert cancels(api) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_create_that_keeps_failing_reports_the_error_and_leaves_no_job(api, proxy):
    api.add(responses.GET, ENDPOINT + "/api/whoami-v2", json={"name": "alice"})
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", status=503, headers={"Retry-After": "0"})
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", json=[])
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    with pytest.raises(hsp.JobsAPIError) as info:
        provider.start_container()
    assert info.value.status_code == 503
    assert len(calls_to(api, "POST", "/api/jobs/alice")) == hsp.API_MAX_RETRIES + 1
    assert provider.job_id is None and provider.base_url is None


def test_a_failed_create_whose_job_cannot_be_looked_up_warns_with_the_start_label_and_sweep(api, proxy, caplog):
    api.add(responses.GET, ENDPOINT + "/api/whoami-v2", json={"name": "alice"})
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", status=503, headers={"Retry-After": "0"})
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", status=503, headers={"Retry-After": "0"})
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    with pytest.raises(hsp.JobsAPIError):
        provider.start_container()
    listed = calls_to(api, "GET", "/api/jobs/alice")
    label = requests.utils.unquote(listed[-1].request.url.split("label=", 1)[1]).split("&")[0]
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING][-1]
    assert label.startswith(hsp.START_LABEL_KEY + "=") and warning == (
        "could not check whether the failed create made a job anyway (JobsAPIError); if it did, it runs "
        "until its timeout: run `python -m hf_sandbox_provider sweep --label %s`" % label)


def test_a_failed_create_whose_job_is_not_listed_yet_warns_that_the_hub_may_still_make_it(api, proxy, caplog):
    api.add(responses.GET, ENDPOINT + "/api/whoami-v2", json={"name": "alice"})
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", status=504, headers={"Retry-After": "0"})
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", json=[])  # a gateway gave up; the job may come later
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    with pytest.raises(hsp.JobsAPIError):
        provider.start_container()
    label = requests.utils.unquote(calls_to(api, "GET", "/api/jobs/alice")[-1].request.url.split("label=", 1)[1])
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING][-1]
    assert warning == ("no job of the failed create is listed yet (its answer was lost or interrupted); if the Hub "
                       "makes one later, it runs until its timeout: run `python -m hf_sandbox_provider sweep "
                       "--label %s`" % label.split("&")[0])


@pytest.mark.parametrize("cancel_status", [200, 403])
def test_a_job_made_by_a_failed_create_is_cancelled_or_named_with_sweep(api, proxy, caplog, cancel_status):
    caplog.set_level(logging.INFO, logger="hf_sandbox_provider")
    api.add(responses.GET, ENDPOINT + "/api/whoami-v2", json={"name": "alice"})
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", json={"status": {"stage": "SCHEDULING"}})
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", json=[job_json("ghost")])
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice/ghost/cancel", status=cancel_status)
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice/ghost", json=job_json("ghost", "RUNNING"))
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    with pytest.raises(hsp.JobsAPIError) as failed:
        provider.start_container()
    assert str(failed.value).startswith("creating the job in namespace 'alice' failed: HTTP 200: the answer names no job id")
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "ghost" in r.getMessage()]
    assert said[0] == (logging.INFO, "the failed create made HF job ghost anyway: cancelling it")
    assert not [r for r in caplog.records if "listed yet" in r.getMessage()]  # it was listed, and handled
    if cancel_status == 200:
        assert said[1:] == [(logging.INFO, "HF job ghost cancelled")]
    else:
        sweep = "cancel it at the Hub or run `python -m hf_sandbox_provider sweep`"
        assert [m for level, m in said if level == logging.WARNING and m.startswith(
            "HF job ghost: could not cancel it (") and "HTTP 403" in m and m.endswith(sweep)], said


def interrupt(request):
    """A Ctrl-C arriving while the call is in flight."""
    raise KeyboardInterrupt


def test_interrupted_create_cancels_the_job_it_made_anyway(api, proxy):
    api.add(responses.GET, ENDPOINT + "/api/whoami-v2", json={"name": "alice"})
    api.add_callback(responses.POST, ENDPOINT + "/api/jobs/alice", callback=interrupt)
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", json=[job_json("ghost")])
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice/ghost/cancel", status=200)
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    with pytest.raises(KeyboardInterrupt):
        provider.start_container()
    assert cancels(api, "ghost") == 1
    listing = calls_to(api, "GET", "/api/jobs/alice")[0].request.url
    assert "label=hf-sandbox-start%3D" in listing


def test_keyboard_interrupt_while_waiting_for_the_url_cancels_the_job(api, proxy):
    add_job_api(api, stages=[job_json()])
    api.add_callback(responses.GET, ENDPOINT + "/api/jobs/alice/job1", callback=interrupt)
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    with pytest.raises(KeyboardInterrupt):
        provider.start_container()
    assert cancels(api) == 1


def test_stop_from_another_thread_aborts_a_start_in_progress_and_cancels(api, proxy):
    add_job_api(api, stages=[job_json()])
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy,
                                     poll_interval_s=0.05, start_timeout_s=30)
    thread, outcome = in_thread(provider.start_container)
    wait_until(lambda: calls_to(api, "GET", "/api/jobs/alice/job1"), "the start to poll its job")
    provider.stop_container()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert isinstance(outcome[0], hsp.SandboxError) and "stop_container" in str(outcome[0])
    assert cancels(api) == 1


def test_second_start_while_running_is_refused(api, proxy):
    add_job_api(api, stages=[running()])
    with hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST) as provider:
        provider.start_container()
        with pytest.raises(hsp.SandboxError, match="already runs job job1"):
            provider.start_container()
        assert len(calls_to(api, "POST", "/api/jobs/alice")) == 1
    assert cancels(api) == 1


def test_provider_collected_while_running_cancels_its_job(api, proxy, caplog):
    caplog.set_level(logging.INFO, logger="hf_sandbox_provider")
    add_job_api(api, stages=[running()])
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    base_url = provider.start_container()
    del provider
    gc.collect()  # the release goes to the reaper thread: the collecting thread may hold a lock it takes
    wait_until(lambda: cancels(api) == 1, "the reaper to cancel the job")
    assert route_is_gone(base_url)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.WARNING, "HF job job1 is still running at exit (or its provider was garbage-collected): "
                             "cancelling it") in said
    assert (logging.INFO, "HF job job1 cancelled") in said


def test_exit_hook_cancels_jobs_still_running(api, proxy, caplog):
    add_job_api(api, stages=[running()])
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    provider.start_container()
    hsp._stop_everything_at_exit()
    assert cancels(api) == 1
    if not hsp._live_finalizers:  # the reaper thread ends with the last net, run by the hook too (review)
        wait_until(lambda: not [t for t in threading.enumerate() if t.name == "hf-sandbox-reaper"], "the reaper to end")
    provider.stop_container()  # the provider itself learns nothing more needs cancelling
    assert cancels(api) == 1
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]  # nor fails to stop



def test_a_provider_collected_after_a_test_ran_the_exit_hook_in_process_still_has_its_job_cancelled(api, proxy):
    # The hook hands the reaper's work to itself while it runs; left so, a later collected provider's release
    # waited in the queue for the real exit (review).
    hsp._stop_everything_at_exit()
    add_job_api(api, stages=[running()])
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    base_url = provider.start_container()
    del provider
    gc.collect()
    wait_until(lambda: cancels(api) == 1, "the reaper to cancel the job")
    assert route_is_gone(base_url)


def test_a_provider_whose_start_logged_a_failure_is_not_kept_alive_by_a_handler_that_keeps_records(api, proxy):
    # The hardware list's failure was logged with the exception as an argument: a handler keeping its records
    # (pytest's, a MemoryHandler) kept its traceback, whose frames held the provider, and the job ran on.
    import logging.handlers

    endpoint = "https://records-%s.hub.test" % uuid.uuid4().hex  # its own (uncached) hardware list
    add_job_api(api, endpoint=endpoint, stages=[running()])
    keeper = logging.handlers.MemoryHandler(capacity=100000, flushLevel=logging.CRITICAL + 1)
    library = logging.getLogger("hf_sandbox_provider")
    level = library.level
    library.addHandler(keeper)
    library.setLevel(logging.DEBUG)
    try:
        provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=endpoint, proxy=proxy, **FAST)
        provider.start_container()
        assert any("hardware list is not available" in record.getMessage() for record in keeper.buffer)
        del provider
        gc.collect()
        wait_until(lambda: cancels(api) == 1, "the collected provider's job to be cancelled")
    finally:
        library.removeHandler(keeper)
        library.setLevel(level)
        keeper.close()


def test_a_stopped_provider_leaves_no_safety_net_for_the_exit_hook(api, proxy):
    # Hours of start/stop cycles must not pile up exit hooks: a stop retires its provider's own.
    add_job_api(api, stages=[running()])
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    provider.start_container()
    net = provider._finalizer
    assert net in hsp._live_finalizers
    provider.stop_container()
    assert net not in hsp._live_finalizers and not net.alive and cancels(api) == 1
    if not hsp._live_finalizers:  # (another test's provider may still hold a net) the reaper thread ends with the last
        wait_until(lambda: not [t for t in threading.enumerate() if t.name == "hf-sandbox-reaper"], "the reaper to end")


# -- readiness through the real proxy ---------------------------------------------------------------


def start_on_loopback(api, proxy, upstream, stages_after_url=(), **kwargs):
    add_job_api(api, endpoint=LOOPBACK_ENDPOINT,
                stages=[running(url=upstream.url)] + list(stages_after_url))
    api.add_passthru(upstream.url)
    token = fresh_token()
    settings = dict(FAST, **kwargs)
    provider = hsp.HFSandboxProvider(IMAGE, token=token, endpoint=LOOPBACK_ENDPOINT, proxy=proxy, **settings)
    return provider, provider.start_container(), token


def test_wait_for_ready_retries_through_503_and_502_until_health_answers(no_leaks, api, proxy, upstream_factory):
    upstream = upstream_factory([503, 502, 504, 200])
    provider, base_url, token = start_on_loopback(api, proxy, upstream)
    try:
        provider.wait_for_ready(base_url)
        assert "ready" in provider.timings
        assert upstream.seen_auth[-1] == "Bearer " + token  # the proxy added the token
        assert len(upstream.seen_auth) == 4
    finally:
        provider.close()
    assert cancels(api) == 1 and route_is_gone(base_url)


def test_job_crash_during_boot_fails_wait_for_ready_fast_and_tears_down(no_leaks, api, proxy, upstream_factory):
    upstream = upstream_factory([503])
    provider, base_url, _ = start_on_loopback(
        api, proxy, upstream, stages_after_url=[job_json(stage="ERROR", message="exit code 1")],
        ready_timeout_s=60)
    with pytest.raises(hsp.JobFailedError, match="exit code 1"):
        provider.wait_for_ready(base_url)
    assert cancels(api) == 1 and route_is_gone(base_url)
    assert provider.base_url is None


def test_wait_for_ready_deadline_raises_timeout_error_and_tears_down(api, proxy, upstream_factory):
    upstream = upstream_factory([503])
    provider, base_url, _ = start_on_loopback(api, proxy, upstream)
    with pytest.raises(hsp.JobStartTimeout, match="HTTP 503") as info:
        provider.wait_for_ready(timeout_s=0.3)
    assert isinstance(info.value, TimeoutError)
    assert cancels(api) == 1 and route_is_gone(base_url)


def test_per_call_ready_timeout_becomes_wait_for_readys_default(api, proxy, upstream_factory):
    upstream = upstream_factory([503])
    provider, base_url, _ = start_on_loopback(api, proxy, upstream, ready_timeout_s=60)
    provider.stop_container()
    api.reset()
    add_job_api(api, endpoint=LOOPBACK_ENDPOINT, stages=[running(url=upstream.url)])
    provider.start_container(ready_timeout_s=0.25)
    with pytest.raises(hsp.JobStartTimeout, match="within 0.25s"):
        provider.wait_for_ready()
    assert cancels(api) == 1


def test_unreachable_upstream_counts_as_not_yet(api, proxy, upstream_factory):
    upstream = upstream_factory([200])
    upstream.close()  # nothing listens there any more: the proxy answers 502
    provider, base_url, _ = start_on_loopback(api, proxy, upstream)
    with pytest.raises(hsp.JobStartTimeout):
        provider.wait_for_ready(timeout_s=0.3)
    assert cancels(api) == 1


def test_token_refused_by_the_job_fails_fast(api, proxy, upstream_factory):
    upstream = upstream_factory([401])
    provider, base_url, _ = start_on_loopback(api, proxy, upstream, ready_timeout_s=60)
    with pytest.raises(hsp.SandboxError, match="401"):
        provider.wait_for_ready()
    assert cancels(api) == 1


def test_wait_for_ready_before_start_says_what_to_do():
    with pytest.raises(hsp.SandboxError, match="start_container"):
        hsp.HFSandboxProvider(IMAGE).wait_for_ready()


# -- pickling, repr, OpenEnv contract ---------------------------------------------------------------


def test_unstarted_provider_pickles_with_its_settings():
    provider = hsp.HFSandboxProvider(IMAGE, flavor="t4-small", env_vars={"A": "1"}, job_timeout="2h")
    clone = pickle.loads(pickle.dumps(provider))
    assert (clone.image, clone.flavor, clone.env_vars, clone.job_timeout) == (IMAGE, "t4-small", {"A": "1"}, "2h")
    assert clone.job_id is None
    clone.stop_container()  # usable: nothing to stop, no error


def test_running_provider_refuses_to_pickle_with_a_clear_type_error(api, proxy):
    add_job_api(api, stages=[running()])
    with hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST) as provider:
        provider.start_container()
        with pytest.raises(TypeError, match="before start_container"):
            pickle.dumps(provider)
    pickle.dumps(provider)  # stopped again: fine


def test_provider_is_an_openenv_container_provider_when_openenv_is_installed():
    providers = pytest.importorskip("openenv.core.containers.runtime.providers")
    assert isinstance(hsp.HFSandboxProvider(IMAGE), providers.ContainerProvider)


def test_logs_returns_the_job_tail_while_it_runs_and_after_its_stop(api, proxy):
    add_job_api(api, stages=[running()])
    api.replace(responses.GET, ENDPOINT + "/api/jobs/alice/job1/logs",
                body="data: %s\n\n" % json.dumps({"data": "Uvicorn running"}), content_type="text/event-stream")
    with hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST) as provider:
        provider.start_container()
        assert provider.logs(tail=5) == ["Uvicorn running"]
    # After the stop the job's own client is closed: logs() makes one for the call, twice in a row.
    assert provider.job_id == "job1" and provider.logs(tail=5) == ["Uvicorn running"]
    assert provider.logs(tail=5) == ["Uvicorn running"]


# -- TLS to the job: `verify` reaches the proxy -----------------------------------------------------


def test_verify_with_the_jobs_ca_reaches_a_tls_job_and_default_verification_refuses_it(api, proxy, tls_upstream,
                                                                                       test_ca):
    import support

    api.add_passthru("https://localhost:%d" % tls_upstream.port)
    add_job_api(api, endpoint=LOOPBACK_ENDPOINT, stages=[running(url=tls_upstream.url)])
    trusted = hsp.HFSandboxProvider(IMAGE, token=support.TEST_TOKEN, endpoint=LOOPBACK_ENDPOINT, proxy=proxy,
                                    verify=test_ca.ca_path, **FAST)
    with trusted:
        trusted.wait_for_ready(trusted.start_container())
        assert "ready" in trusted.timings
    untrusted = hsp.HFSandboxProvider(IMAGE, token=support.TEST_TOKEN, endpoint=LOOPBACK_ENDPOINT,
                                      proxy=proxy, **FAST)
    untrusted.start_container()
    # a TLS failure is "not yet" (handshakes can fail while a job boots), and the timeout says why
    with pytest.raises(hsp.JobStartTimeout, match="HTTP 502 upstream-tls: TLS with the upstream"):
        untrusted.wait_for_ready(timeout_s=0.5)
    assert cancels(api) == 2


def test_stop_landing_while_the_route_is_mounted_leaves_no_route(api):
    """A stop_container() from another thread that runs while mount() is in flight (after the start's
    last stop check) must not leave the freshly mounted route behind."""
    add_job_api(api, stages=[running()])
    mounted, stoppers = [], []

    class StopDuringMount(hsp._proxy.AuthProxy):
        def mount(self, upstream, token, *, verify=True):
            mounted.append(super().mount(upstream, token, verify=verify))
            stopper = threading.Thread(target=provider.stop_container)
            stoppers.append(stopper)
            stopper.start()
            # The stop cancels the job, then waits for this start to end: once it has cancelled, it has
            # done all it can while mount() is in flight (joining it would wait out its bounded wait).
            deadline = time.monotonic() + 10
            while cancels(api) < 1 and stopper.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            return mounted[-1]

    with StopDuringMount() as racing_proxy:
        api.add_passthru("http://127.0.0.1:%d" % racing_proxy.port)
        provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=racing_proxy, **FAST)
        with pytest.raises(hsp.SandboxError, match="stop_container"):
            provider.start_container()
        assert mounted and route_is_gone(mounted[0])  # the failed start took its route down itself
        assert provider.base_url is None
        provider.stop_container()
        stoppers[0].join(timeout=10)
        assert not stoppers[0].is_alive()  # its wait ended with the start, not by timing out
    assert cancels(api) == 1


def test_create_answer_without_a_job_id_cancels_the_job_found_by_its_start_label(api, proxy):
    api.add(responses.GET, ENDPOINT + "/api/whoami-v2", json={"name": "alice"})
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", json={"status": {"stage": "SCHEDULING"}})
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", json=[job_json("ghost")])
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice/ghost/cancel", status=200)
    provider = hsp.HFSandboxProvider(IMAGE, token=fresh_token(), endpoint=ENDPOINT, proxy=proxy, **FAST)
    with pytest.raises(hsp.JobsAPIError, match="names no job id") as failed:
        provider.start_container()
    assert failed.value.status_code == 200 and cancels(api, "ghost") == 1
    assert "label=hf-sandbox-start%3D" in calls_to(api, "GET", "/api/jobs/alice")[0].request.url


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_start_looks_up_the_namespace_gets_free_locks(no_token_anywhere):
    # A DataLoader worker forked while another thread held a process-wide lock (the namespace
    # lookup holds one during a Hub call) must not inherit it held: its first start would hang.
    endpoint, key = "https://huggingface.co", hsp._token_key("https://huggingface.co", "hf_forked")
    namespace_lock = hsp._namespace_locks.setdefault(key, threading.Lock())
    with namespace_lock, hsp._budgets_lock, hsp._hardware_locks.setdefault(endpoint, threading.Lock()):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                free = all(lock.acquire(timeout=2) for lock in (
                    hsp._namespace_locks.setdefault(key, threading.Lock()), hsp._budgets_lock,
                    hsp._hardware_locks.setdefault(endpoint, threading.Lock())))
                os.write(write_end, b"free" if free else b"held")
            finally:
                os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as report:
        answer = report.read()
    os.waitpid(pid, 0)
    assert answer == b"free"
