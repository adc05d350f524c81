"""The Jobs REST client and the pure protocol rules under it (retry timing, URL rule, validation).

The Jobs API is mocked with `responses` (the only mocked boundary); everything else runs for real.
"""

from __future__ import annotations

import contextlib
import email.utils
import socket
import json
import random
import re
import threading
import time
import uuid

import pytest
import requests
import responses

import hf_sandbox_provider as hsp

ENDPOINT = "https://hub.test"


def fresh_token() -> str:
    """A token unique to the test, so the per-process namespace cache never leaks between tests."""
    return "hf_test_" + uuid.uuid4().hex


def job_json(job_id="job1", stage="SCHEDULING", urls=None, message=None):
    return {"id": job_id, "owner": {"id": "u1", "name": "alice", "type": "user"},
            "status": {"stage": stage, "message": message, "exposeUrls": urls}}


@pytest.fixture
def api():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield mock


def calls_to(mock, method, path):
    return [c for c in mock.calls
            if c.request.method == method and requests.utils.urlparse(c.request.url).path == path]


# -- Retry-After and backoff ------------------------------------------------------------------------


def test_retry_after_in_seconds_is_honoured():
    assert hsp._retry_after_seconds("7") == 7.0
    assert hsp._retry_delay(0, hsp._retry_after_seconds("7")) == 7.0


def test_retry_after_as_http_date_counts_from_now():
    now = 1_700_000_000.0
    header = email.utils.formatdate(now + 30, usegmt=True)
    assert hsp._retry_after_seconds(header, now=now) == pytest.approx(30.0)


def test_retry_after_zero_means_at_once_and_a_date_counts_from_the_clock_by_default():
    assert hsp._retry_after_seconds("0") == 0.0 and hsp._retry_after_seconds(" 2.5 ") == 2.5
    ahead = hsp._retry_after_seconds(email.utils.formatdate(time.time() + 60, usegmt=True))
    assert 55.0 <= ahead <= 60.0


def test_retry_after_in_the_past_or_garbage_means_no_wait_or_no_hint():
    assert hsp._retry_after_seconds(email.utils.formatdate(0, usegmt=True), now=1e9) == 0.0
    assert hsp._retry_after_seconds("soon") is None
    assert hsp._retry_after_seconds(None) is None


def test_huge_retry_after_is_capped():
    assert hsp._retry_delay(0, 10_000.0) == hsp.RETRY_AFTER_CAP_S


def test_backoff_without_retry_after_is_full_jitter_bounded_by_cap():
    seen = []

    def rng(low, high):
        seen.append((low, high))
        return high

    assert hsp._retry_delay(0, None, base=0.5, cap=20.0, rng=rng) == 0.5
    assert hsp._retry_delay(3, None, base=0.5, cap=20.0, rng=rng) == 4.0
    assert hsp._retry_delay(30, None, base=0.5, cap=20.0, rng=rng) == 20.0
    assert all(low == 0.0 for low, _ in seen)


# -- the exposed-URL rule ---------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["https://abc123--8000.hf.jobs", "https://ABC123--8000.hf.jobs/"])
def test_job_url_matching_job_id_and_port_is_accepted(url):
    assert hsp._exposed_url_rejection(url.rstrip("/"), "abc123", 8000, "https://huggingface.co") is None


@pytest.mark.parametrize("url, why", [
    ("http://abc123--8000.hf.jobs", "not https"),
    ("https://other--8000.hf.jobs", "does not belong"),
    ("https://abc123--9000.hf.jobs", "does not belong"),
    ("https://evil.example/abc123--8000.hf.jobs", "does not belong"),
    ("https://abc123--8000.", "does not belong"),
    ("https://user:pw@abc123--8000.hf.jobs", "credentials"),
    ("http://127.0.0.1:8000", "not https"),
])
def test_job_url_failing_the_rule_is_refused_with_the_reason(url, why):
    reason = hsp._exposed_url_rejection(url, "abc123", 8000, "https://huggingface.co")
    assert reason is not None and why in reason


def test_an_exposed_url_off_https_or_of_another_job_is_refused_in_words_naming_it():
    url = "http://abc123--8000.hf.jobs"
    assert hsp._exposed_url_rejection(url, "abc123", 8000, "https://huggingface.co") == (
        "the job's exposed URL %r is not https; refusing to send the token in clear text" % url)
    url = "https://other--8000.hf.jobs"
    assert hsp._exposed_url_rejection(url, "abc123", 8000, "https://huggingface.co") == (
        "the job's exposed URL %r does not belong to job abc123 port 8000 (expected host abc123--8000.<domain>); "
        "refusing to send the token to it" % url)


@pytest.mark.parametrize("url, what", [
    ("https://abc123--8000.hf.jobs:port", "is malformed"),
    ("https://user@abc123--8000.hf.jobs", "carries credentials"),  # a user name alone is one too
    ("https://:pw@abc123--8000.hf.jobs", "carries credentials"),
])
def test_a_malformed_or_credentialed_job_url_is_refused_in_words_naming_it(url, what):
    reason = hsp._exposed_url_rejection(url, "abc123", 8000, "https://huggingface.co")
    assert reason == "the job's exposed URL %r %s; not sending the token to it" % (url, what)


def test_a_next_link_on_an_endpoint_with_a_path_is_followed_only_under_that_path():
    endpoint = "https://hub.test/mirror"
    assert hsp._next_link_rejection(endpoint + "/api/jobs/alice?cursor=2", endpoint) is None
    link = "https://hub.test/api/jobs/alice?cursor=2"
    assert hsp._next_link_rejection(link, endpoint) == (
        "the API's next-page link %r is not under %s/api/jobs/ (nor the same Hub under another name); "
        "not following it, since the token would go with it" % (link, endpoint))


def test_loopback_job_url_is_accepted_only_when_the_endpoint_is_loopback():
    assert hsp._exposed_url_rejection("http://127.0.0.1:4321", "j", 8000, "http://127.0.0.1:9999") is None
    assert hsp._exposed_url_rejection("http://[::1]:4321", "j", 8000, "http://localhost:9999") is None
    assert hsp._exposed_url_rejection("http://10.0.0.5:4321", "j", 8000, "http://127.0.0.1:9999")


def test_plain_http_endpoint_off_loopback_is_refused_before_any_call():
    with pytest.raises(hsp.InsecureURLError, match="must be https"):
        hsp.HFSandboxProvider("python:3.12", endpoint="http://hub.example", token=fresh_token())
    assert issubclass(hsp.InsecureURLError, ValueError)



@pytest.mark.parametrize("endpoint", ["http://hub.example", "http://10.0.0.1:9", "https://:443", "ftp://127.0.0.1"])
def test_an_endpoint_the_token_must_not_go_to_is_refused_in_words_naming_it(endpoint):
    with pytest.raises(hsp.InsecureURLError) as refused:
        hsp.HFSandboxProvider("python:3.12", endpoint=endpoint, token=fresh_token())
    assert str(refused.value) == (
        "Jobs endpoint %r must be https (http only for a loopback host such as the local emulator): the token "
        "is sent to it" % endpoint)


# -- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("image", [
    "python:3.12", "registry.hf.space/openenv-echo-env:latest", "localhost:5000/a/b:1",
    "ghcr.io/astral-sh/uv:python3.12-bookworm", "hf.co/spaces/openenv/echo_env",
    "python@sha256:" + "a" * 64,
])
def test_valid_image_references_pass(image):
    assert hsp._image_rejection(image) is None


@pytest.mark.parametrize("image", ["", "  ", "Python:3.12", "a b", "-rm", "hf.co/spaces/onlyowner",
                                   "python:", None, 3])
def test_malformed_image_references_are_refused(image):
    assert hsp._image_rejection(image)


@pytest.mark.parametrize("value, seconds", [(3600, 3600), (90.5, 90), ("45", 45), ("30m", 1800),
                                            ("2h", 7200), ("1.5h", 5400), ("1d", 86400)])
def test_job_timeout_accepts_numbers_and_unit_strings(value, seconds):
    assert hsp._parse_duration(value) == seconds


@pytest.mark.parametrize("value", [0, -5, "0m", "2w", "", "h", True, None, float("nan")])
def test_job_timeout_refuses_non_positive_or_unparseable_values(value):
    assert hsp._parse_duration(value) is None


def test_flavor_list_includes_huggingface_hub_job_hardware():
    from huggingface_hub import JobHardware

    for member in JobHardware:
        assert hsp._flavor_rejection(member.value) is None
    assert "cpu-basic" in hsp._flavor_rejection("cpu-huge")


def test_the_static_flavor_copy_is_huggingface_hubs_job_hardware_without_spaces_names():
    from huggingface_hub import JobHardware

    assert hsp.KNOWN_FLAVORS == {member.value for member in JobHardware}  # update KNOWN_FLAVORS if not
    for spaces_name in ("h100", "h100x8"):
        assert "valid Jobs flavors: a100-large" in hsp._flavor_rejection(spaces_name)


def hardware_entry(name):
    return {"name": name, "prettyName": name, "cpu": "2 vCPU", "ram": "16 GB", "accelerator": None,
            "unitCostMicroUSD": 167, "unitCostUSD": 0.000167, "unitLabel": "minute"}


def test_a_flavor_missing_from_the_hubs_live_hardware_list_is_refused_before_the_create(api):
    endpoint = "https://hw-%s.test" % uuid.uuid4().hex[:8]  # the live list is fetched once per endpoint
    api.add(responses.GET, endpoint + "/api/jobs/hardware", json=[hardware_entry("cpu-basic"),
                                                                 hardware_entry("cpu-upgrade")])
    provider = hsp.HFSandboxProvider("python:3.12", endpoint=endpoint, token=fresh_token(), flavor="t4-small",
                                     namespace="alice")
    for _ in range(2):
        with pytest.raises(hsp.SandboxConfigError, match="unknown flavor 't4-small'; valid Jobs flavors: "
                                                         "cpu-basic, cpu-upgrade"):
            provider.start_container()
    assert [c.request.url for c in api.calls] == [endpoint + "/api/jobs/hardware"]  # once, and no create


def test_a_provider_is_made_at_once_while_another_start_waits_for_a_slow_hardware_list(api):
    endpoint = "https://hw-%s.test" % uuid.uuid4().hex[:8]
    release = threading.Event()

    def slow_hub(request):  # the first start's fetch: held until the test lets it answer
        release.wait(30)
        return 200, {}, json.dumps([hardware_entry("cpu-basic")])
    api.add_callback(responses.GET, endpoint + "/api/jobs/hardware", callback=slow_hub)
    fetch = threading.Thread(target=hsp._live_flavor_rejection, args=(hsp._JobsClient(endpoint, fresh_token()),
                                                                      "cpu-basic"))
    fetch.start()
    made: list = []
    try:
        deadline = time.monotonic() + 10
        while not hsp._hardware_locks.get(endpoint, threading.Lock()).locked() and time.monotonic() < deadline:
            time.sleep(0.01)
        maker = threading.Thread(target=lambda: made.append(hsp.HFSandboxProvider(
            "python:3.12", endpoint=endpoint, token=fresh_token(), flavor="cpu-upgrade")))
        maker.start()
        maker.join(5)  # (a constructor checks the flavor against the lists known so far, never waits for one)
        waited = maker.is_alive()
    finally:
        release.set()
        fetch.join(10)
    maker.join(10)
    assert not waited and len(made) == 1


def test_a_hub_without_the_hardware_list_leaves_the_static_check(api):
    endpoint = "https://hw-%s.test" % uuid.uuid4().hex[:8]
    api.add(responses.GET, endpoint + "/api/jobs/hardware", status=404)
    client = hsp._JobsClient(endpoint, fresh_token())
    assert hsp._live_flavor_rejection(client, "t4-small") is None
    assert hsp._live_flavor_rejection(client, "t4-small") is None
    assert len(api.calls) == 1  # asked once per process, never retried


# -- the rate limit: the server's RateLimit headers drive the budget -----------------------------------


class FakeTime:
    """A clock and a sleep for one budget: sleeping advances the clock and is recorded."""

    def __init__(self):
        self.now, self.waits = 1000.0, []

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.waits.append(seconds)
        self.now += seconds

    def on(self, budget):
        budget.clock, budget.sleep = self.clock, self.sleep
        return budget


def limit_headers(remaining, reset_s, quota=1000, window=300):
    return {"RateLimit": '"api";r=%d;t=%d' % (remaining, reset_s),
            "RateLimit-Policy": '"fixed window";"api";q=%d;w=%d' % (quota, window)}


def test_ratelimit_headers_are_read_as_huggingface_hub_reads_them():
    from huggingface_hub.utils import parse_ratelimit_headers

    for headers in (limit_headers(0, 55, 500, 300), {"ratelimit": '"api";r=12;t=3'}, {"RateLimit": "garbage"}, {}):
        theirs = parse_ratelimit_headers(headers)
        expected = None if theirs is None else (theirs.remaining, theirs.reset_in_seconds, theirs.limit,
                                                theirs.window_seconds, theirs.resource_type)
        assert hsp._ratelimit_info(headers) == expected
        assert hsp._parse_ratelimit(headers) == expected  # the copy for a huggingface_hub older than 1.2


def test_the_quota_and_window_come_from_the_server_when_it_says_else_the_setting(monkeypatch):
    budget = hsp._ApiBudget(*hsp._configured_rate_limit())
    assert (budget.calls, budget.window_s) == (1000, 300.0)  # the free tier
    budget.observe(limit_headers(2400, 250, 2500, 300), budget.acquire())
    assert (budget.calls, budget.window_s, budget.remaining) == (2500, 300.0, 2400)
    monkeypatch.setenv(hsp.RATE_LIMIT_ENV, "3000/300")
    assert hsp._configured_rate_limit() == (3000, 300.0)
    monkeypatch.setenv(hsp.RATE_LIMIT_ENV, "lots")
    with pytest.raises(hsp.SandboxConfigError, match="HF_SANDBOX_RATE_LIMIT='lots' must be <calls>/<seconds>"):
        hsp._configured_rate_limit()


@pytest.mark.parametrize("setting, expected", [(" 2500 ", (2500, 300.0)), ("1/0.5", (1, 0.5))])
def test_a_rate_limit_setting_down_to_one_call_is_taken_as_given_and_without_a_window_per_five_minutes(
        monkeypatch, setting, expected):
    monkeypatch.setenv(hsp.RATE_LIMIT_ENV, setting)
    assert hsp._configured_rate_limit() == expected and hsp.RATE_LIMIT_WINDOW_S == 300.0


@pytest.mark.parametrize("setting", ["1/300", "5/300"])
def test_a_rate_limit_at_or_under_the_cancel_reserve_still_lets_ordinary_calls_through(monkeypatch, setting):
    # The reserve for cancels never takes the whole quota (mutation run 4 found every ordinary call
    # held for good at 5 calls or fewer).
    monkeypatch.setenv(hsp.RATE_LIMIT_ENV, setting)
    budget = hsp._ApiBudget(*hsp._configured_rate_limit())
    assert budget.reserve < budget.calls
    fake = FakeTime()
    fake.on(budget)

    def sleep(seconds):
        fake.sleep(seconds)
        assert fake.now - 1000.0 <= 3 * 300.0, "an ordinary call still held after three windows"
    budget.sleep = sleep
    budget.acquire()
    assert budget.sent == 1


def test_a_malformed_rate_limit_setting_is_refused_in_words_giving_the_form_and_an_example(monkeypatch):
    monkeypatch.setenv(hsp.RATE_LIMIT_ENV, "2500/300/x")
    with pytest.raises(hsp.SandboxConfigError) as refused:
        hsp._configured_rate_limit()
    assert str(refused.value) == (
        "HF_SANDBOX_RATE_LIMIT='2500/300/x' must be <calls>/<seconds>, e.g. 2500/300 for a PRO account")


def test_an_answer_about_another_bucket_is_not_taken_for_the_api_quota():
    budget = hsp._ApiBudget()
    budget.observe({"RateLimit": '"whoami";r=1;t=200', "RateLimit-Policy": '"fixed window";"whoami";q=2;w=300'},
                   budget.acquire())
    assert (budget.calls, budget.remaining, budget.server_told) == (1000, None, False)
    assert budget.wait_s() == 0


def test_with_plenty_left_calls_go_at_once():
    fake = FakeTime()
    budget = fake.on(hsp._ApiBudget())
    budget.observe(limit_headers(900, 200), budget.acquire())
    for _ in range(100):
        budget.acquire()
    assert fake.waits == []


def test_when_little_is_left_the_remaining_calls_are_spread_over_the_time_to_the_reset():
    fake = FakeTime()
    budget = fake.on(hsp._ApiBudget())
    budget.observe(limit_headers(150, 100), budget.sent)  # under a quarter of 1000 left, 100 s to go
    sent_at = []
    for _ in range(5):
        budget.acquire()
        sent_at.append(fake.now)
    gaps = [later - earlier for earlier, later in zip(sent_at, sent_at[1:])]
    assert all(0.9 < gap < 1.2 for gap in gaps), gaps  # ~100 s / (150 - 50 reserved) apart: not all at once
    assert sent_at[0] == 1000.0  # the first one went at once


def test_at_the_reserve_ordinary_calls_wait_for_the_reset_and_teardown_does_not():
    fake = FakeTime()
    budget = fake.on(hsp._ApiBudget())
    budget.observe(limit_headers(budget.reserve, 40), budget.sent)
    budget.acquire(teardown=True)
    assert fake.waits == [] and budget.teardown_sent == 1
    assert budget.wait_s() == pytest.approx(40.0)
    budget.acquire()
    assert sum(fake.waits) == pytest.approx(40.0)  # then a fresh window


def test_pacing_ends_once_the_server_says_a_quarter_is_left_again():
    fake = FakeTime()
    budget = fake.on(hsp._ApiBudget())
    budget.observe(limit_headers(240, 100), budget.sent)  # under a quarter left: calls are spread out
    budget.acquire()
    budget.acquire()
    assert fake.waits
    budget.observe(limit_headers(250, 100), budget.sent)  # a quarter of the free tier's 1,000
    paced = len(fake.waits)
    budget.acquire()
    assert len(fake.waits) == paced, fake.waits[paced:]


@pytest.mark.parametrize("remaining, paced", [(260, False), (240, True)])
def test_pacing_starts_below_a_quarter_of_the_quota_left(remaining, paced):
    # README, Many environments: "below a quarter left, calls are spread over the time to the reset"
    fake = FakeTime()
    budget = fake.on(hsp._ApiBudget())
    budget.observe(limit_headers(remaining, 100), budget.sent)
    for _ in range(3):
        budget.acquire()
    assert bool(fake.waits) is paced, fake.waits


def test_a_call_at_a_quarter_left_sets_no_pace_and_the_first_below_it_goes_at_once():
    # Exactly a quarter left is not "below a quarter": neither that call nor the first one below it
    # waits; from then on each waits (time to reset) / (left - reserve) after the one before.
    fake = FakeTime()
    budget = fake.on(hsp._ApiBudget())
    budget.observe(limit_headers(250, 100), budget.sent)
    budget.acquire()  # 250 left: a quarter of the free tier's 1,000
    budget.acquire()  # 249 left: the first call below a quarter
    assert fake.waits == []
    budget.acquire()
    assert fake.waits == [pytest.approx(100.0 / (249 - budget.reserve))]


def test_every_call_sent_counts_against_the_servers_count_down_to_the_reserve():
    # The server said 3 calls above the reserve are left: three ordinary calls go within its window
    # (spread over it), and the fourth waits for the reset, without another answer in between.
    fake = FakeTime()
    budget = fake.on(hsp._ApiBudget())
    reset_at = fake.now + 100.0
    budget.observe(limit_headers(budget.reserve + 3, 100), budget.sent)
    for _ in range(3):
        budget.acquire()
    assert fake.now < reset_at
    budget.acquire()
    assert fake.now >= reset_at


def test_a_call_held_for_the_reset_logs_once_what_is_left_and_how_long_and_paced_calls_log_nothing(caplog):
    fake = FakeTime()
    budget = fake.on(hsp._ApiBudget())
    with caplog.at_level("INFO", logger="hf_sandbox_provider"):
        budget.observe(limit_headers(150, 100), budget.sent)
        for _ in range(3):
            budget.acquire()  # paced about 1 s apart: a line per call would flood a long run's log
        assert fake.waits and not caplog.records
        paced = len(fake.waits)
        budget.observe(limit_headers(budget.reserve, 40), budget.sent)
        for _ in range(budget.reserve + 1):
            budget.acquire(teardown=True)  # cancels spend the reserve (the server 429s the one past it)
        budget.acquire()  # held 40 s, rechecking every 2 s
    assert sum(fake.waits[paced:]) == pytest.approx(40.0)
    assert [record.getMessage() for record in caplog.records] == [
        "Jobs API budget: about 0 of 1000 calls left for 40s; pacing this call 40.0s"]


def test_the_free_tiers_last_five_percent_is_kept_for_cancels():
    # README, Many environments: the free tier (1,000 calls a 5-minute window) until a server says
    # otherwise, and "the last 5% is kept for cancels, which never wait".
    fake = FakeTime()
    budget = fake.on(hsp._ApiBudget(*hsp._configured_rate_limit()))
    start = fake.now
    for _ in range(950):
        budget.acquire()  # paced once under a quarter is left, but all within the window
    assert fake.now - start < 300.0
    waited = len(fake.waits)
    budget.acquire(teardown=True)
    assert len(fake.waits) == waited
    budget.acquire()  # the 951st ordinary call waits for the window to pass
    assert fake.now - start >= 300.0


def test_calls_sent_after_a_request_are_discounted_from_its_answers_count():
    budget = hsp._ApiBudget()
    ticket = budget.acquire()
    for _ in range(30):
        budget.acquire()  # in flight while the first answer comes back
    budget.observe(limit_headers(500, 100), ticket)
    assert budget.remaining == 470


@pytest.mark.parametrize("headers, pause", [
    (dict(limit_headers(0, 55), **{"Retry-After": "7"}), 56.0),  # RateLimit's t first (+1 s, as huggingface_hub)
    ({"Retry-After": "7"}, 8.0),  # then Retry-After
    ({"RateLimit": '"api";r=600;t=55', "Retry-After": "9"}, 10.0),  # r > 0: the limit was not the reason
    ({"Retry-After": "2"}, 3.0),  # a pause that is not a whole number of the budget's 2 s looks
])
def test_a_429_pauses_until_the_servers_reset_then_retry_after(api, headers, pause):
    url = ENDPOINT + "/api/jobs/alice/j1"
    api.add(responses.GET, url, status=429, headers=headers)
    api.add(responses.GET, url, json=job_json("j1", "RUNNING"))
    client = hsp._JobsClient(ENDPOINT, fresh_token())
    fake = FakeTime()
    fake.on(client._budget)
    assert client.get_job("alice", "j1")["status"]["stage"] == "RUNNING"
    assert sum(fake.waits) == pytest.approx(pause) and client._budget.rate_limited_count == 1


@pytest.mark.parametrize("seed", range(5))
def test_a_429_with_neither_reset_nor_retry_after_pauses_within_the_backoff_bound_then_succeeds(api, seed):
    # Nothing says when the window resets: each refusal pauses the budget for a full-jitter backoff on the
    # count of refusals so far (never beyond one window), and the call goes through once a pause ends.
    random.seed(seed)
    url = ENDPOINT + "/api/jobs/alice/j1"
    for _ in range(3):
        api.add(responses.GET, url, status=429)
    api.add(responses.GET, url, json=job_json("j1", "RUNNING"))
    client = hsp._JobsClient(ENDPOINT, fresh_token())
    fake = FakeTime()
    fake.on(client._budget)
    began = fake.now
    assert client.get_job("alice", "j1")["status"]["stage"] == "RUNNING"
    assert client._budget.rate_limited_count == 3 and len(api.calls) == 4
    bound = sum(min(hsp.API_BACKOFF_CAP_S, hsp.API_BACKOFF_BASE_S * 2 ** n) for n in (1, 2, 3))
    assert 0 < fake.now - began <= bound + 3 * hsp.RATE_LIMIT_RESET_MARGIN_S
    assert client._budget.paused_until <= fake.now  # the last pause was waited out before the call that passed


def test_a_cancel_answered_429_waits_for_the_reset_and_retries_instead_of_giving_up(api, caplog):
    # The window resets now: the cancel really waits out the pause the 429 set (the reset plus its margin,
    # 1 s), and its retry goes only once that pause is over.
    url = ENDPOINT + "/api/jobs/alice/j1/cancel"
    client = hsp._JobsClient(ENDPOINT, fresh_token())
    retried_at = []

    def retried(request):
        retried_at.append(client._budget.clock())
        return 200, {}, ""

    api.add(responses.POST, url, status=429, headers=limit_headers(0, 0))
    api.add_callback(responses.POST, url, callback=retried)
    with caplog.at_level("INFO", logger="hf_sandbox_provider"):
        client.cancel_job("alice", "j1")
    assert len(api.calls) == 2 and retried_at[0] >= client._budget.paused_until > 0
    assert "retry 1 of 2 in %.1fs" % hsp.RATE_LIMIT_RESET_MARGIN_S in caplog.text


# -- errors -----------------------------------------------------------------------------------------


def test_a_success_answer_that_is_not_json_is_an_error_naming_the_call_and_its_request_id(api):
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice/j1", body="<html>maintenance</html>",
            headers={"X-Request-Id": "req-7"})
    with pytest.raises(hsp.JobsAPIError) as info:
        hsp._JobsClient(ENDPOINT, fresh_token()).get_job("alice", "j1")
    assert str(info.value) == "inspecting job j1 failed: HTTP 200: the answer is not JSON (request id req-7)"
    assert len(api.calls) == 1  # an answer, however odd, is not retried


def test_error_answer_maps_to_jobs_api_error_with_status_request_id_and_header_message(api):
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice/j1", status=404,
            headers={"X-Request-Id": "req-42", "X-Error-Message": "Job not found"})
    client = hsp._JobsClient(ENDPOINT, fresh_token())
    with pytest.raises(hsp.JobsAPIError) as info:
        client.get_job("alice", "j1")
    err = info.value
    assert (err.status_code, err.request_id, err.server_message) == (404, "req-42", "Job not found")
    assert "req-42" in str(err) and "Job not found" in str(err)
    assert len(api.calls) == 1  # a 404 is not retried


def test_json_error_body_is_used_when_no_error_header(api):
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice/j1", status=403, json={"error": "no jobs scope"})
    token = fresh_token()
    client = hsp._JobsClient(ENDPOINT, token)
    with pytest.raises(hsp.JobsAPIError) as info:
        client.get_job("alice", "j1")
    assert info.value.server_message == "no jobs scope"
    assert "permission" in str(info.value)
    assert token not in str(info.value) and token not in repr(client)


def test_every_call_carries_the_bearer_token_and_user_agent(api):
    token = fresh_token()
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice/j1", json=job_json("j1"))
    hsp._JobsClient(ENDPOINT, token).get_job("alice", "j1")
    sent = api.calls[0].request.headers
    assert sent["Authorization"] == "Bearer " + token
    assert sent["User-Agent"].startswith("hf-sandbox-provider/")


# -- retries ----------------------------------------------------------------------------------------


@pytest.mark.slow  # retried with backoff
def test_429_with_retry_after_is_retried_then_succeeds(api):
    url = ENDPOINT + "/api/jobs/alice/j1"
    api.add(responses.GET, url, status=429, headers={"Retry-After": "0"})
    api.add(responses.GET, url, status=503)
    api.add(responses.GET, url, json=job_json("j1", "RUNNING"))
    job = hsp._JobsClient(ENDPOINT, fresh_token()).get_job("alice", "j1")
    assert job["status"]["stage"] == "RUNNING"
    assert len(api.calls) == 3


@pytest.mark.slow  # retried with backoff
def test_retries_are_bounded_and_end_with_the_last_error(api):
    url = ENDPOINT + "/api/jobs/alice/j1"
    api.add(responses.GET, url, status=429, headers={"Retry-After": "0", "X-Error-Message": "slow down"})
    with pytest.raises(hsp.JobsAPIError) as info:
        hsp._JobsClient(ENDPOINT, fresh_token()).get_job("alice", "j1", retries=2)
    assert info.value.status_code == 429 and "slow down" in str(info.value)
    assert len(api.calls) == 3


def test_unreachable_api_raises_jobs_api_error_naming_the_endpoint(api):
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice/j1", body=requests.ConnectionError("refused"))
    with pytest.raises(hsp.JobsAPIError, match="hub.test") as info:
        hsp._JobsClient(ENDPOINT, fresh_token()).get_job("alice", "j1", retries=0)
    assert info.value.status_code is None


# -- create: never two jobs for one start -----------------------------------------------------------

BODY = {"dockerImage": "python:3.12", "labels": {"hf-sandbox-start": "s1"}}
LABEL = {"hf-sandbox-start": "s1"}


def test_create_posts_the_body_once_on_success(api):
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", json=job_json("j9"))
    job = hsp._JobsClient(ENDPOINT, fresh_token()).create_job("alice", BODY, LABEL)
    assert job["id"] == "j9"
    assert json.loads(api.calls[0].request.body) == BODY


def test_lost_create_response_adopts_the_job_found_by_its_start_label(api):
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", body=requests.ConnectionError("reset by peer"))
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", json=[job_json("j-made")])
    job = hsp._JobsClient(ENDPOINT, fresh_token()).create_job("alice", BODY, LABEL)
    assert job["id"] == "j-made"
    assert len(calls_to(api, "POST", "/api/jobs/alice")) == 1  # never re-posted
    listing = calls_to(api, "GET", "/api/jobs/alice")[0].request.url
    assert "label=hf-sandbox-start%3Ds1" in listing


def test_a_lost_create_never_adopts_a_listed_job_without_its_start_label(api):
    # A listing that ignored the label filter handed the lookup another user's job, which the provider adopted
    # (and later cancelled) while its own job ran on unseen (found by review).
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", body=requests.ConnectionError("reset by peer"))
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", json=job_json("j-mine"))
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice",
            json=[dict(job_json("j-bobs"), labels={"hf-sandbox-start": "another"}), dict(job_json("j-x"), labels=None)])
    job = hsp._JobsClient(ENDPOINT, fresh_token()).create_job("alice", BODY, LABEL)
    assert job["id"] == "j-mine"  # none listed carried its label: sent again, as for an empty listing
    assert len(calls_to(api, "POST", "/api/jobs/alice")) == 2


def test_5xx_on_create_looks_up_the_label_then_reposts_when_no_job_exists(api):
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", status=502)
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", json=job_json("j2"))
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", json=[])
    job = hsp._JobsClient(ENDPOINT, fresh_token()).create_job("alice", BODY, LABEL)
    assert job["id"] == "j2"
    posts = calls_to(api, "POST", "/api/jobs/alice")
    assert len(posts) == 2
    assert all(json.loads(p.request.body)["labels"] == BODY["labels"] for p in posts)
    assert len(calls_to(api, "GET", "/api/jobs/alice")) == 1  # looked up before the second POST


@pytest.mark.slow  # retried with backoff
def test_429_on_create_is_retried_without_a_lookup(api):
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", status=429, headers={"Retry-After": "0"})
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", json=job_json("j3"))
    job = hsp._JobsClient(ENDPOINT, fresh_token()).create_job("alice", BODY, LABEL)
    assert job["id"] == "j3"
    assert calls_to(api, "GET", "/api/jobs/alice") == []


def test_4xx_on_create_is_not_retried(api):
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", status=400,
            headers={"X-Error-Message": "Invalid flavor"})
    with pytest.raises(hsp.JobsAPIError, match="Invalid flavor"):
        hsp._JobsClient(ENDPOINT, fresh_token()).create_job("alice", BODY, LABEL)
    assert len(api.calls) == 1


# -- whoami, list, logs -----------------------------------------------------------------------------


def test_namespace_is_looked_up_once_per_token_across_threads(api):
    api.add(responses.GET, ENDPOINT + "/api/whoami-v2", json={"name": "alice", "type": "user"})
    token = fresh_token()
    names = []

    def lookup():
        names.append(hsp._JobsClient(ENDPOINT, token).whoami_namespace())

    threads = [threading.Thread(target=lookup) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert names == ["alice"] * 8
    assert len(api.calls) == 1
    hsp._JobsClient(ENDPOINT, fresh_token()).whoami_namespace()  # another token: its own lookup
    assert len(api.calls) == 2


def test_list_sends_label_and_stage_filters(api):
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", json=[job_json("a"), job_json("b")])
    jobs = hsp._JobsClient(ENDPOINT, fresh_token()).list_jobs(
        "alice", labels={"hf-sandbox-provider": "1"}, stages=["RUNNING", "SCHEDULING"])
    assert [j["id"] for j in jobs] == ["a", "b"]
    url = api.calls[0].request.url
    assert "label=hf-sandbox-provider%3D1" in url and "stage=RUNNING" in url and "stage=SCHEDULING" in url


def test_logs_are_parsed_from_server_sent_events_and_bounded_to_tail(api):
    events = ["data: " + json.dumps({"data": "===== Job started at x =====", "timestamp": "t"})]
    events += ["data: " + json.dumps({"data": "line %d" % i, "timestamp": "t"}) for i in range(10)]
    events += [": keep-alive"]
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice/j1/logs", body="\n\n".join(events) + "\n\n",
            content_type="text/event-stream")
    lines = hsp._JobsClient(ENDPOINT, fresh_token()).job_logs("alice", "j1", tail=3)
    assert lines == ["line 7", "line 8", "line 9"]
    assert "tail=3" in api.calls[0].request.url


def test_logs_never_raise_when_the_stream_fails(api):
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice/j1/logs", status=500)
    assert hsp._JobsClient(ENDPOINT, fresh_token()).job_logs("alice", "j1") == []


def test_list_follows_next_page_links_on_the_endpoint(api):
    page2 = ENDPOINT + "/api/jobs/alice?label=a%3Db&cursor=abc"
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", json=[job_json("j1"), job_json("j2")],
            headers={"Link": '<%s>; rel="next"' % page2}, match=[responses.matchers.query_param_matcher({"label": "a=b"})])
    api.add(responses.GET, page2, json=[job_json("j3")])
    jobs = hsp._JobsClient(ENDPOINT, fresh_token()).list_jobs("alice", labels={"a": "b"})
    assert [job["id"] for job in jobs] == ["j1", "j2", "j3"]
    assert len(calls_to(api, "GET", "/api/jobs/alice")) == 2


@pytest.mark.parametrize("link", ["https://evil.example/api/jobs/alice?page=2", "http://huggingface.co/api/jobs/alice",
                                  "https://huggingface.co.evil.example/api/jobs/alice", "https://hf.co:8443/api/jobs/x",
                                  "https://hf.co/api/models?page=2", "https://u:p@hf.co/api/jobs/alice"])
def test_list_refuses_a_next_link_off_the_hub_loudly_and_sends_the_token_nowhere_else(api, link):
    endpoint = "https://huggingface.co"
    api.add(responses.GET, endpoint + "/api/jobs/alice", json=[job_json("j1")], headers={"Link": '<%s>; rel="next"' % link})
    with pytest.raises(hsp.JobsAPIError, match="listing jobs failed.*next-page link.*not following it.*after 1 jobs"):
        hsp._JobsClient(endpoint, fresh_token()).list_jobs("alice")
    assert [c.request.url for c in api.calls] == [endpoint + "/api/jobs/alice"]  # the token went nowhere else


@pytest.mark.parametrize("endpoint, link_base", [("https://huggingface.co", "https://hf.co"),
                                                 ("https://hf.co", "https://huggingface.co"),
                                                 ("https://huggingface.co", "https://HuggingFace.co")])
def test_list_follows_a_next_link_to_the_same_hub_under_another_name_on_the_configured_host(api, endpoint, link_base):
    page2 = link_base + "/api/jobs/alice?label=a%3Db&cursor=abc"
    api.add(responses.GET, endpoint + "/api/jobs/alice", json=[job_json("j1")], headers={"Link": '<%s>; rel="next"' % page2},
            match=[responses.matchers.query_param_matcher({"label": "a=b"})])
    api.add(responses.GET, endpoint + "/api/jobs/alice?label=a%3Db&cursor=abc", json=[job_json("j2")])
    jobs = hsp._JobsClient(endpoint, fresh_token()).list_jobs("alice", labels={"a": "b"})
    assert [job["id"] for job in jobs] == ["j1", "j2"]
    assert all(c.request.url.startswith(endpoint + "/") for c in api.calls)


def test_a_listing_longer_than_the_page_bound_fails_naming_it(api):
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", json=[job_json("j1")],
            headers={"Link": '<%s/api/jobs/alice>; rel="next"' % ENDPOINT})  # a link that loops
    with pytest.raises(hsp.JobsAPIError, match="more than %d pages" % hsp.LIST_MAX_PAGES):
        hsp._JobsClient(ENDPOINT, fresh_token()).list_jobs("alice")


# -- create against a network that fails for real (loopback sockets, not mocks) ----------------------


def refused_endpoint() -> str:
    """A loopback endpoint whose port refuses connections (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return "http://127.0.0.1:%d" % probe.getsockname()[1]


class HangUpServer:
    """A loopback "API" that reads each request and hangs up without answering: every call is ambiguous
    (the request was sent, no answer came). Records each request line."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = "http://127.0.0.1:%d" % self.listener.getsockname()[1]
        self.request_lines: list = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if data:
                    self.request_lines.append(data.split(b"\r\n", 1)[0].decode("latin-1"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept: a close alone leaves it blocked
        self.listener.close()
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.mark.slow  # the create is retried with backoff (about 8 s)
def test_a_refused_create_is_retried_and_reported_as_the_create_with_the_reason():
    # A refused connection sent nothing, so no job can exist: no lookup, and the error is the create's own.
    with pytest.raises(hsp.JobsAPIError) as info:
        hsp._JobsClient(refused_endpoint(), fresh_token()).create_job("alice", BODY, LABEL)
    message = str(info.value)
    assert info.value.action.startswith("creating the job") and info.value.status_code is None
    assert "refused" in message.lower(), message


@pytest.mark.slow  # the label lookup is retried with backoff (about 8 s)
def test_an_unanswered_create_whose_lookup_also_fails_is_reported_as_the_create_and_never_reposted():
    server = HangUpServer()
    try:
        with pytest.raises(hsp.JobsAPIError) as info:
            hsp._JobsClient(server.endpoint, fresh_token()).create_job("alice", BODY, LABEL)
    finally:
        server.close()
    message = str(info.value)
    assert info.value.action.startswith("creating the job"), message
    assert "could not be checked" in message, message
    assert [line for line in server.request_lines if line.startswith("POST")] == ["POST /api/jobs/alice HTTP/1.1"]
    assert any(line.startswith("GET /api/jobs/alice?label=") for line in server.request_lines)


def test_a_call_refused_at_connect_says_it_cannot_have_acted():
    # What a failed create's caller relies on to know it made no job (the start's own test is slow).
    endpoint = refused_endpoint()
    with pytest.raises(hsp.JobsAPIError) as info:
        hsp._JobsClient(endpoint, fresh_token()).get_job("alice", "j1", retries=0)
    assert info.value.may_have_acted is False
    assert str(info.value) == ("inspecting job j1 failed: no answer: ConnectionError (Connection refused). "
                               "check the network and HF_ENDPOINT (%s)" % endpoint)


def test_a_jobs_api_that_takes_a_call_but_never_answers_fails_it_at_the_read_timeout(monkeypatch):
    # The request is accepted into a listening socket's backlog and never answered: without a read timeout
    # the call (and the start, or the cancel, waiting on it) would hang for good.
    monkeypatch.setattr(hsp, "API_TIMEOUT_S", (5.0, 0.5))  # the real read timeout is 30 s
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        endpoint = "http://127.0.0.1:%d" % silent.getsockname()[1]
        with pytest.raises(hsp.JobsAPIError, match="no answer: ReadTimeout") as info:
            hsp._JobsClient(endpoint, fresh_token()).get_job("alice", "j1", retries=0)
    assert info.value.may_have_acted is True  # sent, unanswered: it may have acted


@pytest.mark.parametrize("status", [500, 599])  # the first and the last 5xx
def test_a_call_answered_500_is_retried_like_any_5xx_and_succeeds(api, status):
    url = ENDPOINT + "/api/jobs/alice/j1"
    api.add(responses.GET, url, status=status)
    api.add(responses.GET, url, json=job_json("j1", "RUNNING"))
    assert hsp._JobsClient(ENDPOINT, fresh_token()).get_job("alice", "j1")["status"]["stage"] == "RUNNING"
    assert len(api.calls) == 2


def test_a_cancel_answered_503_is_retried_and_succeeds(api):
    url = ENDPOINT + "/api/jobs/alice/j1/cancel"
    api.add(responses.POST, url, status=503)
    api.add(responses.POST, url, status=200)
    hsp._JobsClient(ENDPOINT, fresh_token()).cancel_job("alice", "j1")
    assert len(api.calls) == 2


def test_a_call_answered_5xx_every_time_is_sent_six_times_each_retry_logged_and_waits_retry_after(
        api, caplog):
    # Retry-After: 0 is honoured (no backoff between the tries); the log names each retry and its wait.
    url = ENDPOINT + "/api/jobs/alice/j1"
    api.add(responses.GET, url, status=503, json={"error": "overloaded"}, headers={"Retry-After": "0"})
    with caplog.at_level("INFO", logger="hf_sandbox_provider"):
        with pytest.raises(hsp.JobsAPIError) as info:
            hsp._JobsClient(ENDPOINT, fresh_token()).get_job("alice", "j1")
    assert len(api.calls) == 1 + hsp.API_MAX_RETRIES == 6
    assert (info.value.action, info.value.status_code, info.value.server_message) == (
        "inspecting job j1", 503, "overloaded")
    assert [record.getMessage() for record in caplog.records] == [
        "inspecting job j1: HTTP 503 from https://hub.test; retry %d of 5 in 0.0s" % n for n in range(1, 6)]


@pytest.mark.parametrize("answer, failure, status", [
    (dict(status=503), "HTTP 503: HTTP 503", 503),
    (dict(body=requests.ConnectionError(ConnectionResetError(104, "Connection reset by peer"))),
     "no answer: ConnectionError (Connection reset by peer)", None),
])
def test_a_create_that_may_have_made_a_job_whose_lookup_is_refused_is_reported_as_the_create_not_reposted(
        api, answer, failure, status):
    # A 5xx, or a connection lost after sending, may hide a job the create made: the start label's lookup is
    # refused (403), so the error says the create failed, that nobody could check whether it made a job,
    # and how to clean up.
    api.add(responses.POST, ENDPOINT + "/api/jobs/alice", **answer)
    api.add(responses.GET, ENDPOINT + "/api/jobs/alice", status=403, json={"error": "no access"})
    with pytest.raises(hsp.JobsAPIError) as info:
        hsp._JobsClient(ENDPOINT, fresh_token()).create_job("alice", BODY, LABEL)
    message = str(info.value)
    assert message.startswith(
        "creating the job in namespace 'alice' failed: %s; whether it made a job anyway could not be checked "
        "(listing jobs failed: HTTP 403: no access" % failure), message
    assert message.endswith("). run `python -m hf_sandbox_provider sweep` once https://hub.test answers"), message
    assert (info.value.action, info.value.status_code) == ("creating the job in namespace 'alice'", status)
    assert len(calls_to(api, "POST", "/api/jobs/alice")) == 1


@pytest.mark.slow  # the create is retried with backoff (about 8 s)
def test_a_start_whose_create_was_refused_raises_the_create_error_and_looks_for_no_lost_job(caplog):
    endpoint = refused_endpoint()
    provider = hsp.HFSandboxProvider("python:3.12", token=fresh_token(), endpoint=endpoint, namespace="alice")
    with caplog.at_level("INFO", logger="hf_sandbox_provider"):
        with pytest.raises(hsp.JobsAPIError, match="creating the job") as info:
            provider.start_container()
    assert info.value.may_have_acted is False
    assert "made a job anyway" not in caplog.text  # nothing was sent: no lookup, no warning about a lost job
    assert provider.phase is hsp.Phase.IDLE


@pytest.mark.parametrize("answers, looked_up", [([422], False), ([503, 422], True)])
def test_a_create_refused_with_a_4xx_is_looked_for_only_if_an_earlier_attempt_went_unanswered(api, answers, looked_up):
    endpoint = "https://hw-%s.test" % uuid.uuid4().hex[:8]
    api.add(responses.GET, endpoint + "/api/jobs/hardware", json=[hardware_entry("cpu-basic")])
    api.add(responses.GET, endpoint + "/api/jobs/alice", json=[])
    for status in answers:
        api.add(responses.POST, endpoint + "/api/jobs/alice", status=status, json={"error": "bad secret name"})
    provider = hsp.HFSandboxProvider("python:3.12", endpoint=endpoint, token=fresh_token(), namespace="alice")
    with pytest.raises(hsp.JobsAPIError, match="bad secret name") as info:
        provider.start_container()
    assert info.value.status_code == 422 and info.value.may_have_acted is looked_up
    lookups = len(calls_to(api, "GET", "/api/jobs/alice"))  # a 503'd create is looked for before its resend too
    assert lookups == (2 if looked_up else 0) and len(calls_to(api, "POST", "/api/jobs/alice")) == len(answers)
    assert provider.phase is hsp.Phase.IDLE


@pytest.mark.parametrize("server_counts", [True, False])
def test_the_budget_keeps_at_most_one_windows_send_times_over_a_long_run(server_counts):
    """Hours of calls must not grow the budget: once the server counts (RateLimit headers) the process's
    own send times are not needed at all, and without it only the current window's are (a 60-minute soak
    grew its heap by one float per Jobs API call before this)."""
    fake = FakeTime()
    budget = fake.on(hsp._ApiBudget())
    for call in range(3000):  # one call a second for 50 minutes: ten 300 s windows
        ticket = budget.acquire()
        if server_counts:
            budget.observe(limit_headers(900, 200), ticket)
        fake.now += 1.0
    kept = len(budget._sent)
    assert kept == 0 if server_counts else kept <= 300, kept


def test_a_call_with_no_answer_is_described_by_its_exception_types_not_its_text():
    """_transport_failure reads the exceptions requests wraps (urllib3's reason, chained causes): the OS's or
    http.client's words for the message, and whether the request may have reached the server."""
    server = HangUpServer()
    try:
        for url, expected in ((refused_endpoint(), ("ConnectionError (Connection refused)", False)),
                              (server.endpoint, ("ConnectionError (Remote end closed connection without response)",
                                                 True))):
            with pytest.raises(requests.RequestException) as info:
                requests.get(url + "/api/whoami-v2", timeout=5)
            assert hsp._transport_failure(info.value) == expected
    finally:
        server.close()
    timeout = requests.ReadTimeout("read timed out")
    assert hsp._transport_failure(timeout) == ("ReadTimeout", True)  # sent: the server may have acted
    assert hsp._transport_failure(requests.ConnectTimeout("connect timed out")) == ("ConnectTimeout", False)


def test_an_unreachable_endpoint_is_logged_at_the_first_retry_with_its_reason_and_wait(caplog):
    endpoint = refused_endpoint()
    with caplog.at_level("INFO", logger="hf_sandbox_provider"):
        with pytest.raises(hsp.JobsAPIError, match="no answer"):
            hsp._JobsClient(endpoint, fresh_token()).get_job("alice", "j1", retries=1)
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 1 and retries[0].levelname == "INFO"  # a library's default logging stays quiet
    assert re.search(r"inspecting job j1: ConnectionError \(Connection refused\) from %s; retry 1 of 1 in "
                     r"[0-9.]+s" % re.escape(endpoint), retries[0].getMessage()), retries[0].getMessage()


@pytest.mark.parametrize("answer", ["null", "[]", '"RUNNING"'])
def test_a_job_answer_that_is_no_json_object_is_retried_and_never_ends_the_watcher_thread(api, answer):
    from support import wait_until

    url = ENDPOINT + "/api/jobs/alice/j1"
    api.add(responses.GET, url, body=answer, content_type="application/json")
    api.add(responses.GET, url, json=job_json("j1", "RUNNING"))
    watcher, wake = hsp._JobWatcher(), threading.Event()
    watch = watcher.register(ENDPOINT, fresh_token(), requests.Session, "alice", "j1", 0.05, wake)
    try:  # before: the first answer ended the thread, and no later start of the process saw a stage
        wait_until(lambda: watch.job is not None or watch.error is not None, "the watcher's next answer", 20)
        assert watch.error is None and watch.job["status"]["stage"] == "RUNNING" and wake.is_set()
        (group,) = watcher._groups.values()
        assert group.thread is not None and group.thread.is_alive()
    finally:
        watcher.unregister(watch)
