"""hf_jobs_emulator.JobsEmulator: the HF Jobs REST API as huggingface_hub's own HfApi sees it, job
processes, errors, faults and teardown."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import List

import pytest
import requests

import hf_jobs_emulator
from hf_jobs_emulator import JobsEmulator, spawn_process

hub = pytest.importorskip("huggingface_hub")
from huggingface_hub import HfApi  # noqa: E402
from huggingface_hub.errors import HfHubHTTPError, JobNotFoundError  # noqa: E402
import support
from support import wait_until
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

TIMEOUT = 30  # generous: other work may load the 2 cores; passing tests never wait this long
PY = sys.executable


def py(code: str) -> list:
    return [PY, "-c", code]


SLEEP_FOREVER = py("import time\nprint('up', flush=True)\nwhile True: time.sleep(1)")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def emu():
    with JobsEmulator() as emulator:
        yield emulator
        pids = [job.pid for job in emulator.jobs if job.pid]
    assert not any(pid_alive(pid) for pid in pids), "a job process outlived the emulator"


@pytest.fixture
def api(emu):
    return HfApi(endpoint=emu.endpoint, token=emu.token)


def run(api: HfApi, emu: JobsEmulator, command: list, **kwargs):
    return api.run_job(image="python:3.12", command=command, namespace=emu.namespace, **kwargs)


def finished(api: HfApi, emu: JobsEmulator, job_id: str):
    return api.wait_for_job(job_id, timeout=TIMEOUT, poll_interval=0.05, namespace=emu.namespace)


def raw(emu: JobsEmulator, method: str, path: str, token: object = "default", **kwargs) -> requests.Response:
    headers = kwargs.pop("headers", {})
    token = emu.token if token == "default" else token
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return requests.request(method, emu.endpoint + path, headers=headers, timeout=TIMEOUT, **kwargs)


# -- conformance with HfApi ----------------------------------------------------------------------


def test_whoami_v2_names_the_tokens_user(emu, api):
    me = api.whoami()
    assert me["type"] == "user" and me["name"] == "local"


def test_run_inspect_and_finish_a_job_with_hfapi(emu, api):
    job = run(api, emu, py("print('hello from the job')"), env={"A": "1"}, labels={"team": "rl"}, timeout=600)
    assert job.status.stage in ("SCHEDULING", "RUNNING", "COMPLETED")
    assert len(job.id) == 24 and job.docker_image == "python:3.12" and job.space_id is None
    assert job.owner.name == "local" and job.owner.type == "user"
    assert job.initiator.name == "local" and job.flavor == "cpu-basic"
    assert job.environment == {"A": "1"} and job.labels["team"] == "rl"
    assert job.url == f"{emu.endpoint}/jobs/local/{job.id}"
    done = finished(api, emu, job.id)
    assert done.status.stage == "COMPLETED" and done.status.message is None
    assert done.started_at is not None and done.finished_at is not None and done.created_at is not None
    assert done.durations.total_secs is not None and done.durations.running_secs is not None
    assert api.inspect_job(job_id=job.id, namespace="local").status.stage == "COMPLETED"


def test_network_and_volumes_set_at_create_come_back_as_hfapi_parses_them(emu, api):
    from huggingface_hub import Volume

    volume = Volume(type="bucket", source="local/data", mount_path="/data", read_only=True)
    job = run(api, emu, SLEEP_FOREVER, network_group="rollouts", network_aliases=["env-1"],
              volumes=[volume])
    seen = api.inspect_job(job_id=job.id, namespace="local")
    assert (seen.network.group, seen.network.aliases) == ("rollouts", ["env-1"])
    assert [(v.type, v.source, v.mount_path, v.read_only) for v in seen.volumes] == [
        ("bucket", "local/data", "/data", True)]
    plain = run(api, emu, SLEEP_FOREVER, network_group="rollouts")
    answer = raw(emu, "GET", f"/api/jobs/local/{plain.id}").json()
    assert answer["network"] == {"group": "rollouts"}  # aliases omitted when none
    assert "volumes" not in answer
    assert api.inspect_job(job_id=plain.id, namespace="local").network.aliases == []


def test_space_image_is_sent_as_space_id(emu, api):
    job = api.run_job(image="hf.co/spaces/someone/env", command=py("pass"), namespace="local")
    assert job.space_id == "someone/env" and job.docker_image is None


def test_env_and_secrets_reach_the_process_but_secret_values_never_come_back(emu, api, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_parent_token_must_not_leak")
    code = "import os; print(os.environ['PLAIN'], os.environ['SECRET'], os.environ.get('HF_TOKEN'))"
    job = run(api, emu, py(code), env={"PLAIN": "p"}, secrets={"SECRET": "s3cr3t-value"})
    finished(api, emu, job.id)
    assert list(api.fetch_job_logs(job_id=job.id, namespace="local")) == ["p s3cr3t-value None"]
    assert job.secrets is not None and set(job.secrets) == {"SECRET"}
    for path in (f"/api/jobs/local/{job.id}", "/api/jobs/local"):
        assert "s3cr3t-value" not in raw(emu, "GET", path).text


def test_logs_replay_with_tail_and_follow_until_the_job_ends(emu, api):
    job = run(api, emu, py("import time\nfor i in range(5):\n    print('line', i)\n    time.sleep(0.05)"))
    followed = list(api.fetch_job_logs(job_id=job.id, namespace="local", follow=True))
    assert followed == [f"line {i}" for i in range(5)]
    assert list(api.fetch_job_logs(job_id=job.id, namespace="local", tail=2)) == ["line 3", "line 4"]


def test_logs_are_server_sent_events_with_timestamps(emu, api):
    job = run(api, emu, py("import sys; print('out'); print('err', file=sys.stderr)"))
    finished(api, emu, job.id)
    answer = raw(emu, "GET", f"/api/jobs/local/{job.id}/logs")
    assert answer.headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in answer.text.splitlines() if line.startswith("data: ")]
    assert events[0]["data"].startswith("===== Job started")
    assert [e["data"] for e in events[1:]] == ["out", "err"]
    assert all(e["timestamp"].endswith("Z") for e in events)


def test_list_filters_by_label_and_stage(emu, api):
    done = run(api, emu, py("pass"), labels={"kind": "done"})
    finished(api, emu, done.id)
    live = run(api, emu, SLEEP_FOREVER, labels={"kind": "live"})
    emu.wait_for_stage(live.id, ["RUNNING"])
    ids = lambda **kw: sorted(j.id for j in api.list_jobs(namespace="local", **kw))  # noqa: E731
    assert ids() == sorted([done.id, live.id])
    assert ids(labels={"kind": "live"}) == [live.id]
    assert ids(labels={"kind": "nope"}) == []
    assert ids(status="RUNNING") == [live.id]
    assert ids(status=["COMPLETED", "RUNNING"]) == sorted([done.id, live.id])
    api.cancel_job(job_id=live.id, namespace="local")


@pytest.mark.slow  # a job with a child interpreter, then its SIGTERM
def test_cancel_kills_the_whole_process_group_and_marks_canceled(emu, api):
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print('child', child.pid, flush=True)\n"
            "time.sleep(600)")
    job = run(api, emu, py(code))
    wait_until(lambda: any(line.startswith("child ") for _, line in emu.job(job.id).logs), "the child's pid")
    child_pid = int(next(line for _, line in emu.job(job.id).logs if line.startswith("child ")).split()[1])
    api.cancel_job(job_id=job.id, namespace="local")
    final = finished(api, emu, job.id)
    assert final.status.stage == "CANCELED"
    assert not pid_alive(emu.job(job.id).pid)
    wait_until(lambda: not pid_alive(child_pid), "the grandchild to die")


def test_a_failing_command_ends_in_error_naming_the_exit_code(emu, api):
    job = run(api, emu, py("import sys; sys.exit(3)"))
    final = finished(api, emu, job.id)
    assert final.status.stage == "ERROR" and "exit code: 3" in final.status.message


def test_a_missing_command_ends_in_error_naming_it(emu, api):
    job = run(api, emu, ["/nonexistent/binary-for-the-emulator-test"])
    final = finished(api, emu, job.id)
    assert final.status.stage == "ERROR" and "/nonexistent/binary-for-the-emulator-test" in final.status.message


@pytest.mark.slow  # waits out a 1 s job timeout
def test_timeout_seconds_ends_the_job_as_canceled(emu, api):
    job = run(api, emu, SLEEP_FOREVER, timeout=1)
    final = finished(api, emu, job.id)
    assert final.status.stage == "CANCELED" and "timed out" in final.status.message
    assert not pid_alive(emu.job(job.id).pid)


def test_job_without_command_runs_the_default_or_the_images_command():
    marker = py("print('image command ran')")
    with JobsEmulator(image_commands={"my/image:1": marker}) as emu:
        api = HfApi(endpoint=emu.endpoint, token=emu.token)
        job = api.run_job(image="my/image:1", command=[], namespace="local")
        finished(api, emu, job.id)
        assert list(api.fetch_job_logs(job_id=job.id, namespace="local")) == ["image command ran"]
    assert JobsEmulator().default_command == hf_jobs_emulator.echo_server_command()


def test_api_calls_are_counted_per_route(emu, api):
    job = run(api, emu, py("pass"))
    api.inspect_job(job_id=job.id, namespace="local")
    api.inspect_job(job_id=job.id, namespace="local")
    raw(emu, "GET", "/api/nothing-here")
    calls = emu.api_calls
    assert calls["create"] == 1 and calls["inspect"] == 2 and calls["unknown"] == 1
    assert "whoami" not in calls  # namespace given: HfApi never asked


# -- errors as the real API answers them ---------------------------------------------------------


def test_every_answer_carries_a_request_id_and_errors_an_error_message(emu):
    ok = raw(emu, "GET", "/api/whoami-v2")
    assert ok.status_code == 200 and ok.headers["X-Request-Id"]
    missing = raw(emu, "GET", "/api/jobs/local/0123456789abcdef01234567")
    assert missing.status_code == 404 and missing.headers["X-Request-Id"]
    assert missing.json()["error"] == missing.headers["X-Error-Message"]


@pytest.mark.parametrize("token", [None, "hf_wrong", ""])
def test_missing_or_wrong_token_is_401(emu, token):
    answer = raw(emu, "GET", "/api/jobs/local", token=token)
    assert answer.status_code == 401 and "Authorization" in answer.json()["error"]


def test_the_bearer_scheme_is_case_insensitive(emu):
    answer = raw(emu, "GET", "/api/whoami-v2", token=None, headers={"Authorization": f"bearer {emu.token}"})
    assert answer.status_code == 200


def test_hfapi_with_a_wrong_token_raises_its_http_error(emu):
    with pytest.raises(HfHubHTTPError) as caught:
        HfApi(endpoint=emu.endpoint, token="hf_wrong").list_jobs(namespace="local").__iter__().__next__()
    assert caught.value.response.status_code == 401


def test_hardware_is_listed_in_the_hubs_shape_and_is_not_a_namespace(emu, api):
    from huggingface_hub import JobHardware

    listed = api.list_jobs_hardware()
    assert [hw.name for hw in listed] == sorted(member.value for member in JobHardware)
    t4 = next(hw for hw in listed if hw.name == "t4-small")
    assert t4.accelerator.model == "T4" and t4.accelerator.quantity == "1" and t4.unit_label == "minute"
    assert next(hw for hw in listed if hw.name == "cpu-basic").accelerator is None
    refused = raw(emu, "POST", "/api/jobs/hardware", json={"dockerImage": "python:3.12"})
    assert refused.status_code == 405 and emu.jobs == []  # never a job in a namespace called "hardware"


def test_an_emulator_with_its_own_flavors_lists_and_accepts_only_those():
    with JobsEmulator(flavors=["cpu-basic", "b300x8"]) as emu:
        api = HfApi(endpoint=emu.endpoint, token=emu.token)
        assert [hw.name for hw in api.list_jobs_hardware()] == ["b300x8", "cpu-basic"]
        refused = raw(emu, "POST", "/api/jobs/local", json={"dockerImage": "python:3.12", "flavor": "t4-small"})
        assert refused.status_code == 400 and "b300x8, cpu-basic" in refused.json()["error"]


def test_unknown_route_is_404_and_wrong_method_405_naming_the_allowed_one(emu):
    assert raw(emu, "GET", "/api/spaces/x").status_code == 404
    wrong = raw(emu, "DELETE", "/api/jobs/local")
    assert wrong.status_code == 405 and "GET or POST" in wrong.json()["error"]


def test_unknown_job_is_404_for_inspect_cancel_and_logs(emu):
    for method, suffix in (("GET", ""), ("POST", "/cancel"), ("GET", "/logs")):
        assert raw(emu, method, f"/api/jobs/local/ffffffffffffffffffffffff{suffix}").status_code == 404


@pytest.mark.parametrize("body, field", [
    ({"command": ["x"]}, "dockerImage"),
    ({"dockerImage": "a", "spaceId": "b"}, "dockerImage"),
    ({"dockerImage": "a", "command": "echo hi"}, "command"),
    ({"dockerImage": "a", "environment": {"A": 1}}, "environment.A"),
    ({"dockerImage": "a", "flavor": "gpu-galore"}, "flavor"),
    ({"dockerImage": "a", "timeoutSeconds": -5}, "timeoutSeconds"),
    ({"dockerImage": "a", "expose": {"ports": [0]}}, "expose.ports"),
    ({"dockerImage": "a", "expose": {"ports": [8000], "portsPublic": [9000]}}, "portsPublic"),
    ({"dockerImage": "a", "labels": {"emulator-die-after-s": "soon"}}, "emulator-die-after-s"),
    ({"dockerImage": "a", "labels": {"emulator-teleport": "1"}}, "emulator-teleport"),
    ({"dockerImage": "a", "environment": {"HF_JOBS_EMULATOR_DIE_AFTER_S": "soon"}}, "HF_JOBS_EMULATOR_DIE_AFTER_S"),
    # an unknown one is named as sent, and the known ones in the same (variable) form
    ({"dockerImage": "a", "environment": {"HF_JOBS_EMULATOR_NOPE": "1"}},
     "HF_JOBS_EMULATOR_NOPE: unknown fault; known faults are HF_JOBS_EMULATOR_SCHEDULING_DELAY_S, "),
    ({"dockerImage": "a", "labels": {"emulator-nope": "1"}}, "known faults are emulator-scheduling-delay-s, "),
    ({"dockerImage": "a", "labels": {"model": "Qwen/Qwen3"}}, "label model='Qwen/Qwen3'"),
    ({"dockerImage": "a", "labels": {"a b": "1"}}, "label key 'a b'"),
    ({"dockerImage": "a", "network": {"aliases": ["x"]}}, "network"),
    ({"dockerImage": "a", "network": {"group": "g", "aliases": "x"}}, "network.aliases"),
    ({"dockerImage": "a", "volumes": [{"type": "bucket", "source": "a/b"}]}, "volumes[0]"),
    ([1, 2], "JSON object"),
])
def test_bad_create_bodies_are_400_naming_the_field(emu, body, field):
    answer = raw(emu, "POST", "/api/jobs/local", json=body)
    assert answer.status_code == 400 and field in answer.json()["error"]
    assert emu.jobs == []


def test_bad_list_filters_are_400_naming_them(emu):
    assert "key=value" in raw(emu, "GET", "/api/jobs/local?label=novalue").json()["error"]
    assert "RUNNING" in raw(emu, "GET", "/api/jobs/local?stage=SLEEPING").json()["error"]


def test_invalid_json_is_400(emu):
    answer = raw(emu, "POST", "/api/jobs/local", data=b"{oops", headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and "JSON" in answer.json()["error"]


def test_other_users_namespace_is_403_and_org_members_share_the_org_namespace():
    with JobsEmulator(extra_tokens={"hf_other": "other"}, orgs={"team": ["local", "other"]}) as emu:
        assert raw(emu, "GET", "/api/jobs/other").status_code == 403
        mine = HfApi(endpoint=emu.endpoint, token=emu.token)
        theirs = HfApi(endpoint=emu.endpoint, token="hf_other")
        assert [o["name"] for o in theirs.whoami()["orgs"]] == ["team"]
        job = theirs.run_job(image="python:3.12", command=py("pass"), namespace="team")
        seen = mine.inspect_job(job_id=job.id, namespace="team")
        assert seen.owner.name == "team" and seen.owner.type == "org" and seen.initiator.name == "other"
        assert raw(emu, "GET", f"/api/jobs/local/{job.id}").status_code == 404  # wrong namespace


@pytest.mark.parametrize("kwargs, word", [
    ({"host": "0.0.0.0"}, "loopback"),
    ({"namespace": "bad name"}, "namespace"),
    ({"scheduling_delay_s": -1}, "scheduling_delay_s"),
    ({"faults": {"explode": "1"}}, "explode"),
    ({"extra_tokens": {"hf_x": ""}}, "extra_tokens"),
    ({"rate_limit": (0, 300)}, "rate_limit"),
    ({"rate_limit": 1000}, "rate_limit"),
    ({"list_page_size": 0}, "list_page_size"),
])
def test_bad_constructor_arguments_are_refused_naming_them(kwargs, word):
    with pytest.raises(ValueError, match=word):
        JobsEmulator(**kwargs)


def test_repr_never_shows_the_token():
    emulator = JobsEmulator(token="hf_secret_token_value")
    assert "hf_secret_token_value" not in repr(emulator)


# -- faults --------------------------------------------------------------------------------------


def test_scheduling_delay_fault_keeps_the_job_scheduling_and_cancel_never_starts_it(emu, api):
    job = run(api, emu, SLEEP_FOREVER, labels={"emulator-scheduling-delay-s": "60"})
    assert api.inspect_job(job_id=job.id, namespace="local").status.stage == "SCHEDULING"
    api.cancel_job(job_id=job.id, namespace="local")
    final = finished(api, emu, job.id)
    assert final.status.stage == "CANCELED" and emu.job(job.id).pid is None


def test_emulator_wide_scheduling_delay_applies_to_every_job():
    with JobsEmulator(scheduling_delay_s=60) as emu:
        api = HfApi(endpoint=emu.endpoint, token=emu.token)
        job = run(api, emu, SLEEP_FOREVER)
        assert api.inspect_job(job_id=job.id, namespace="local").status.stage == "SCHEDULING"


def test_crash_at_boot_fault_ends_in_error_with_the_message_in_status_and_logs(emu, api):
    job = run(api, emu, SLEEP_FOREVER, labels={"emulator-crash-at-boot": "ImportError: no module named env"})
    final = finished(api, emu, job.id)
    assert final.status.stage == "ERROR" and final.status.message == "ImportError: no module named env"
    assert "ImportError: no module named env" in list(api.fetch_job_logs(job_id=job.id, namespace="local"))


def test_emulator_wide_crash_fault_applies_to_every_job():
    with JobsEmulator(faults={"crash-at-boot": "boom"}) as emu:
        api = HfApi(endpoint=emu.endpoint, token=emu.token)
        assert finished(api, emu, run(api, emu, SLEEP_FOREVER).id).status.message == "boom"


def test_die_after_fault_kills_a_running_job_into_error(emu, api):
    job = run(api, emu, SLEEP_FOREVER, labels={"emulator-die-after-s": "0.3"})
    final = finished(api, emu, job.id)
    assert final.status.stage == "ERROR" and "die-after-s" in final.status.message
    assert not pid_alive(emu.job(job.id).pid)


def test_kill_job_ends_a_running_job_in_error_and_refuses_other_stages(emu, api):
    job = run(api, emu, SLEEP_FOREVER)
    emu.wait_for_stage(job.id, ["RUNNING"])
    emu.kill_job(job.id)
    final = finished(api, emu, job.id)
    assert final.status.stage == "ERROR" and "kill_job" in final.status.message
    assert not pid_alive(emu.job(job.id).pid)
    with pytest.raises(ValueError, match="ERROR"):
        emu.kill_job(job.id)


def test_injected_rate_limit_answers_429_with_retry_after_then_recovers(emu, api):
    emu.inject_rate_limit(2, retry_after_s=7)
    for _ in range(2):
        limited = raw(emu, "GET", "/api/jobs/local")
        assert limited.status_code == 429 and limited.headers["Retry-After"] == "7"
        assert "rate limit" in limited.headers["X-Error-Message"]
    assert raw(emu, "GET", "/api/jobs/local").status_code == 200
    assert emu.api_calls["list"] == 3


def test_a_per_user_limit_sends_both_headers_on_every_answer_and_429_past_the_quota():
    from huggingface_hub.utils import parse_ratelimit_headers

    with JobsEmulator(rate_limit=(5, 300), extra_tokens={"hf_second": "local", "hf_bob": "bob"}) as emu:
        seen = []
        for token in (emu.token, "hf_second", emu.token, "hf_second", emu.token):  # one user, two tokens
            answer = raw(emu, "GET", "/api/jobs/local", token=token)
            info = parse_ratelimit_headers(answer.headers)
            seen.append((answer.status_code, info.remaining, info.limit, info.window_seconds, info.resource_type))
        assert seen == [(200, r, 5, 300, "api") for r in (4, 3, 2, 1, 0)]
        refused = raw(emu, "GET", "/api/jobs/local/000000000000000000000000", token="hf_second")
        info = parse_ratelimit_headers(refused.headers)
        assert refused.status_code == 429 and info.remaining == 0 and 0 < info.reset_in_seconds <= 300
        assert refused.headers["Retry-After"] == str(info.reset_in_seconds)
        assert "rate limit" in refused.json()["error"]
        assert raw(emu, "GET", "/api/jobs/bob", token="hf_bob").status_code == 200  # another user: own quota
        assert emu.window_peaks == {"local": 5, "bob": 1} and emu.rate_limited_calls == 1
        with pytest.raises(HfHubHTTPError) as caught:  # huggingface_hub reads the 429 as the Hub's
            HfApi(endpoint=emu.endpoint, token=emu.token).inspect_job(job_id="0" * 24, namespace="local")
        assert caught.value.response.status_code == 429


def test_whoami_is_limited_harder_than_the_rest():
    with JobsEmulator(rate_limit=(40, 300)) as emu:
        statuses = [raw(emu, "GET", "/api/whoami-v2").status_code for _ in range(3)]
        assert statuses == [200, 200, 429]  # 5% of 40
        assert raw(emu, "GET", "/api/jobs/local").status_code == 200  # the rest of the quota is still there
        assert 'q=2;' in raw(emu, "GET", "/api/whoami-v2").headers["RateLimit-Policy"]


def test_without_a_rate_limit_no_ratelimit_headers_are_sent(emu):
    assert "RateLimit" not in raw(emu, "GET", "/api/jobs/local").headers


def test_rate_limit_on_an_unknown_route_name_is_refused_naming_the_known_ones(emu):
    with pytest.raises(ValueError, match="inspect"):
        emu.inject_rate_limit(1, routes=["get_job"])


def test_rate_limit_can_target_one_route(emu, api):
    emu.inject_rate_limit(1, routes=["create"])
    assert raw(emu, "GET", "/api/jobs/local").status_code == 200
    with pytest.raises(HfHubHTTPError) as caught:
        run(api, emu, py("pass"))
    assert caught.value.response.status_code == 429
    assert emu.jobs == []  # a 429 create created nothing


def test_rate_limit_after_create_label_limits_the_calls_that_follow(emu, api):
    job = run(api, emu, py("pass"), labels={"emulator-rate-limit-after-create": "1"})
    assert raw(emu, "GET", f"/api/jobs/local/{job.id}").status_code == 429
    assert raw(emu, "GET", f"/api/jobs/local/{job.id}").status_code == 200


def test_lost_create_response_creates_the_job_but_drops_the_answer(emu):
    emu.lose_next_create_responses(1)
    body = {"dockerImage": "python:3.12", "command": SLEEP_FOREVER, "labels": {"create-id": "abc"}}
    with pytest.raises(requests.ConnectionError):
        raw(emu, "POST", "/api/jobs/local", json=body)
    found = raw(emu, "GET", "/api/jobs/local?label=create-id=abc").json()
    assert len(found) == 1 and found[0]["labels"] == {"create-id": "abc"}
    # only the next one was lost
    assert raw(emu, "POST", "/api/jobs/local", json=body).status_code == 200


def test_a_late_create_is_answered_504_at_once_and_its_job_appears_only_later(emu):
    emu.make_next_creates_late(1, after_s=0.5)
    body = {"dockerImage": "python:3.12", "command": SLEEP_FOREVER, "labels": {"create-id": "late"}}
    answer = raw(emu, "POST", "/api/jobs/local", json=body)
    assert answer.status_code == 504 and "Gateway Timeout" in answer.json()["error"]
    assert raw(emu, "GET", "/api/jobs/local?label=create-id=late").json() == []  # not yet
    wait_until(lambda: len(emu.jobs) == 1, "the late create's job")
    assert emu.jobs[0].spec["labels"] == {"create-id": "late"}
    assert raw(emu, "POST", "/api/jobs/local", json=body).status_code == 200  # only the next one was late


def test_lost_create_response_label_loses_that_jobs_answer(emu):
    body = {"dockerImage": "python:3.12", "command": py("pass"), "labels": {"emulator-lost-create-response": "true"}}
    with pytest.raises(requests.ConnectionError):
        raw(emu, "POST", "/api/jobs/local", json=body)
    assert len(emu.jobs) == 1


# -- teardown ------------------------------------------------------------------------------------


def test_stop_ends_every_job_process_and_marks_jobs_canceled():
    emu = JobsEmulator().start()
    api = HfApi(endpoint=emu.endpoint, token=emu.token)
    jobs = [run(api, emu, SLEEP_FOREVER) for _ in range(3)]
    for job in jobs:
        emu.wait_for_stage(job.id, ["RUNNING"])
    pids = emu.live_pids()
    assert len(pids) == 3
    emu.stop()
    assert not any(pid_alive(pid) for pid in pids)
    assert {emu.job(job.id).stage for job in jobs} == {"CANCELED"}
    assert emu.stop() == []  # twice is fine, and nothing was left to report


def test_a_job_that_ignores_sigterm_is_killed_after_the_grace():
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(600)"
    with JobsEmulator(kill_grace_s=0.2) as emu:
        api = HfApi(endpoint=emu.endpoint, token=emu.token)
        job = run(api, emu, py(code))
        wait_until(lambda: any(line == "up" for _, line in emu.job(job.id).logs), "the job to ignore SIGTERM")
        api.cancel_job(job_id=job.id, namespace="local")
        assert finished(api, emu, job.id).status.stage == "CANCELED"
        assert not pid_alive(emu.job(job.id).pid)


@contextlib.contextmanager
def serve_cli():
    """`python -m hf_jobs_emulator serve --json` as a subprocess: (process, its JSON, an HfApi)."""
    proc = subprocess.Popen([PY, hf_jobs_emulator.__file__, "serve", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        yield proc, info, HfApi(endpoint=info["endpoint"], token=info["token"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.slow  # the emulator CLI as a subprocess
def test_serve_cli_prints_endpoint_and_token_and_sigterm_stops_its_jobs():
    with serve_cli() as (proc, info, api):
        code = "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)"
        job = api.run_job(image="python:3.12", command=py(code), namespace=info["namespace"])
        lines = api.fetch_job_logs(job_id=job.id, namespace="local", follow=True)
        job_pid = int(next(iter(lines)))
        lines.close()
        assert pid_alive(job_pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
        wait_until(lambda: not pid_alive(job_pid), "the serve job to die")


@pytest.mark.slow  # the emulator CLI as a subprocess
def test_serve_logs_each_jobs_activity_and_its_gates_proxy_lines_with_the_job_id_and_time():
    import re

    with serve_cli() as (proc, info, api):
        logged: List[str] = []  # the emulator's log lines as they come (read while it runs)

        def read_log() -> None:
            for line in proc.stderr:
                logged.append(line)

        reader = threading.Thread(target=read_log, daemon=True)
        reader.start()
        echo = api.run_job(image="python:3.12", command=[], expose=[8000], namespace="local")
        (url,) = api.wait_for_job(echo.id, stages=["RUNNING"], timeout=TIMEOUT, poll_interval=0.05,
                                  namespace="local").status.expose_urls
        assert get_when_up(url + "/health", bearer(info["token"])).status_code == 200
        # "ready" is the emulator's own probe's finding, which may come after ours: cancel after it
        wait_until(lambda: any(f"job {echo.id} ready" in line for line in logged), "the emulator's probe", TIMEOUT)
        deaf = api.run_job(image="python:3.12", command=SLEEP_FOREVER, expose=[8000],
                           namespace="local")
        (deaf_url,) = api.wait_for_job(deaf.id, stages=["RUNNING"], timeout=TIMEOUT,
                                       poll_interval=0.05, namespace="local").status.expose_urls
        refused = requests.get(deaf_url + "/health", headers=bearer(info["token"]), timeout=TIMEOUT)
        assert refused.status_code == 502
        api.cancel_job(job_id=echo.id, namespace="local")
        api.wait_for_job(echo.id, timeout=TIMEOUT, poll_interval=0.05, namespace="local")
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)
        reader.join(TIMEOUT)  # the emulator's stderr ended with it
        err = "".join(logged)
    stamped = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
    lines = err.splitlines()
    for event in ("created", "running", "ready", "canceled"):
        assert any(stamped.match(line) and f"job {echo.id} {event}" in line
                   for line in lines), (event, err)
    proxy_lines = [line for line in lines if " proxy " in line and "upstream" in line]
    assert proxy_lines, err
    assert all(stamped.match(line) and f"job {deaf.id} port 8000" in line
               for line in proxy_lines), err
    assert info["token"] not in err


# -- exposed ports behind the token gate ---------------------------------------------------------

HEADER_ECHO = py(
    "import json, os, threading\n"
    "from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer\n"
    "def serve(port, name):\n"
    "    class H(BaseHTTPRequestHandler):\n"
    "        def do_GET(self):\n"
    "            body = json.dumps({'name': name, 'path': self.path, 'headers': dict(self.headers)}).encode()\n"
    "            self.send_response(200)\n"
    "            self.send_header('Content-Length', str(len(body)))\n"
    "            self.end_headers()\n"
    "            self.wfile.write(body)\n"
    "        def log_message(self, *a): pass\n"
    "    ThreadingHTTPServer(('127.0.0.1', int(port)), H).serve_forever()\n"
    "threading.Thread(target=serve, args=(os.environ['PORT_9000'], 'nine'), daemon=True).start()\n"
    "serve(os.environ['PORT'], 'eight')\n")


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def get_when_up(url: str, headers: dict) -> requests.Response:
    """GET through the gate, retrying while the job's server is still booting (the gate answers 502)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        answer = requests.get(url, headers=headers, timeout=TIMEOUT)
        if answer.status_code != 502 or time.monotonic() > deadline:
            return answer
        time.sleep(0.02)


def running_with_urls(api: HfApi, emu: JobsEmulator, **kwargs):
    job = run(api, emu, **kwargs)
    return api.wait_for_job(job.id, stages=["RUNNING"], timeout=TIMEOUT, poll_interval=0.05, namespace="local")


def test_labels_are_replaced_with_hfapi_and_checked_by_the_hubs_rule(emu, api):
    job = run(api, emu, SLEEP_FOREVER, labels={"team": "rl", "run": "1"})
    updated = api.update_job_labels(job_id=job.id, labels={"team": "eval"}, namespace="local")
    assert updated.labels == {"team": "eval"} and api.inspect_job(job_id=job.id, namespace="local").labels == {"team": "eval"}
    assert [j.id for j in api.list_jobs(namespace="local", labels={"team": "eval"})] == [job.id]
    refused = raw(emu, "PUT", f"/api/jobs/local/{job.id}/labels", json={"labels": {"team": "a/b"}})
    assert refused.status_code == 400 and "label team='a/b'" in refused.json()["error"]
    assert raw(emu, "PUT", f"/api/jobs/local/{job.id}/labels", json={"team": "x"}).status_code == 400
    api.cancel_job(job_id=job.id, namespace="local")


def test_exposed_ports_are_replaced_on_a_running_job_with_hfapi(emu, api):
    job = running_with_urls(api, emu, command=[], expose=[8000])  # default command: the echo server
    (url,) = job.status.expose_urls
    assert get_when_up(url + "/health", bearer(emu.token)).status_code == 200
    updated = api.update_job_expose(job_id=job.id, expose=[8000], expose_public=[9000], namespace="local")
    assert updated.expose == [8000, 9000] and updated.expose_public == [9000]
    assert updated.status.expose_urls[0] == url and len(updated.status.expose_urls) == 2  # the kept port keeps its URL
    assert requests.get(url + "/health", headers=bearer(emu.token), timeout=TIMEOUT).status_code == 200
    public_url = updated.status.expose_urls[1]
    assert requests.get(public_url + "/health", timeout=TIMEOUT).status_code != 401  # public: no token asked
    closed = api.update_job_expose(job_id=job.id, namespace="local")  # neither list: every port closed
    assert closed.expose == [] and closed.status.expose_urls is None
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", headers=bearer(emu.token), timeout=TIMEOUT)
    api.cancel_job(job_id=job.id, namespace="local")
    finished(api, emu, job.id)
    assert raw(emu, "PUT", f"/api/jobs/local/{job.id}/expose", json={"ports": [8000]}).status_code == 400


def test_metrics_stream_one_sample_a_second_while_running_and_406_after(emu, api):
    job = running_with_urls(api, emu, command=SLEEP_FOREVER)
    (sample,) = list(api.fetch_job_metrics(job_id=job.id, namespace="local"))
    assert set(sample) == {"cpu_usage_pct", "cpu_millicores", "memory_used_bytes", "memory_total_bytes", "rx_bps",
                           "tx_bps", "gpus", "replica"}
    assert sample["memory_used_bytes"] > 0 and sample["gpus"] == {}
    api.cancel_job(job_id=job.id, namespace="local")
    finished(api, emu, job.id)
    assert raw(emu, "GET", f"/api/jobs/local/{job.id}/metrics").status_code == 406
    assert list(api.fetch_job_metrics(job_id=job.id, namespace="local")) == []  # huggingface_hub tolerates it


def test_exposed_url_is_401_without_the_token_and_200_with_it(emu, api):
    job = running_with_urls(api, emu, command=[], expose=[8000])  # default command: the echo server
    (url,) = job.status.expose_urls
    assert url.startswith("http://127.0.0.1:")
    assert get_when_up(url + "/health", bearer(emu.token)).json() == {"status": "healthy"}
    for headers in ({}, bearer("hf_wrong"), {"Authorization": emu.token}):
        refused = requests.get(url + "/health", headers=headers, timeout=TIMEOUT)
        assert refused.status_code == 401 and "Authorization: Bearer" in refused.json()["message"]
        assert "X-Proxy-Error" not in refused.headers  # as on *.hf.jobs: the gate is not our proxy


@pytest.mark.parametrize("ending", ["kill", "cancel"])
@pytest.mark.parametrize("status", [None, 404, 502])
def test_an_ended_jobs_url_refuses_connections_or_with_ended_url_status_answers_it(status, ending):
    with JobsEmulator(ended_url_status=status) as emulator:
        api = HfApi(endpoint=emulator.endpoint, token=emulator.token)
        job = running_with_urls(api, emulator, command=[], expose=[8000])
        (url,) = job.status.expose_urls
        with requests.Session() as kept:  # a keep-alive connection made while the job ran
            assert get_when_up(url + "/health", bearer(emulator.token)).status_code == 200
            assert kept.get(url + "/health", headers=bearer(emulator.token), timeout=TIMEOUT).status_code == 200
            session = ws_connect("ws" + url[4:] + "/ws", additional_headers=bearer(emulator.token),
                                 open_timeout=TIMEOUT)
            if ending == "kill":
                emulator.kill_job(job.id)
            else:
                api.cancel_job(job_id=job.id, namespace="local")
            finished(api, emulator, job.id)
            with session, pytest.raises(ConnectionClosed):  # what was open to the job is cut
                session.recv(timeout=TIMEOUT)
            if status is None:
                with pytest.raises(requests.ConnectionError):
                    requests.get(url + "/health", headers=bearer(emulator.token), timeout=TIMEOUT)
                return
            upgrade = {**bearer(emulator.token), "Connection": "Upgrade", "Upgrade": "websocket",
                       "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
            for answer in (kept.get(url + "/health", headers=bearer(emulator.token), timeout=TIMEOUT),
                           requests.post(url + "/reset", json={}, timeout=TIMEOUT),  # no token: still that status
                           requests.get(url + "/ws", headers=upgrade, timeout=TIMEOUT)):
                assert answer.status_code == status and job.id in answer.json()["message"]
                assert "X-Proxy-Error" not in answer.headers


def test_ended_url_status_must_be_an_http_error_status():
    for bad in (200, 302, 600, "502", True):
        with pytest.raises(ValueError, match="ended_url_status must be an HTTP error status"):
            JobsEmulator(ended_url_status=bad)


def test_the_gate_consumes_authorization_and_forwards_path_query_and_headers(emu, api):
    job = running_with_urls(api, emu, command=HEADER_ECHO, expose=[8000, 9000])
    url8000, url9000 = job.status.expose_urls
    seen = get_when_up(url8000 + "/some/path?q=1", {**bearer(emu.token), "X-Trace": "t-1"}).json()
    assert seen["name"] == "eight" and seen["path"] == "/some/path?q=1"
    assert seen["headers"]["X-Trace"] == "t-1"
    assert "Authorization" not in seen["headers"]
    assert get_when_up(url9000 + "/", bearer(emu.token)).json()["name"] == "nine"


def test_public_ports_need_no_token(emu, api):
    job = running_with_urls(api, emu, command=HEADER_ECHO, expose=[8000], expose_public=[9000])
    url8000, url9000 = job.status.expose_urls
    assert get_when_up(url9000 + "/", {}).json()["name"] == "nine"
    assert requests.get(url8000 + "/", timeout=TIMEOUT).status_code == 401


def test_org_members_tokens_open_the_gate_and_outsiders_do_not():
    with JobsEmulator(extra_tokens={"hf_member": "member", "hf_outsider": "outsider"},
                      orgs={"local": ["member"]}) as emu:
        api = HfApi(endpoint=emu.endpoint, token=emu.token)
        (url,) = running_with_urls(api, emu, command=[], expose=[8000]).status.expose_urls
        assert get_when_up(url + "/health", bearer("hf_member")).status_code == 200
        assert requests.get(url + "/health", headers=bearer("hf_outsider"), timeout=TIMEOUT).status_code == 401


def test_websocket_goes_through_the_gate_with_the_token_only(emu, api):
    ws_sync = pytest.importorskip("websockets.sync.client")
    from websockets.exceptions import InvalidStatus
    (url,) = running_with_urls(api, emu, command=[], expose=[8000]).status.expose_urls
    get_when_up(url + "/health", bearer(emu.token))
    ws_url = url.replace("http://", "ws://") + "/ws"
    with ws_sync.connect(ws_url, additional_headers=bearer(emu.token), open_timeout=TIMEOUT) as ws:
        ws.send(json.dumps({"type": "step", "data": {"message": "through the gate"}}))
        assert json.loads(ws.recv(timeout=TIMEOUT))["data"]["observation"]["echoed_message"] == "through the gate"
    with pytest.raises(InvalidStatus) as refused:
        ws_sync.connect(ws_url, open_timeout=TIMEOUT)
    assert refused.value.response.status_code == 401


# OpenEnv's default server command: the provider's (with `exec`), and its Dockerfile template's CMD.
OPENENV_COMMANDS = [
    ["sh", "-c", "cd /app/env && exec uvicorn server.app:app --host 0.0.0.0 --port 8000"],
    ["/bin/sh", "-c", "cd /app/env && uvicorn server.app:app --host 0.0.0.0 --port 8000"]]


@pytest.mark.parametrize("command", OPENENV_COMMANDS, ids=["provider", "dockerfile"])
def test_a_job_running_openenvs_default_server_command_serves_the_echo_environment(
        emu, api, command):
    ws_sync = pytest.importorskip("websockets.sync.client")
    (url,) = running_with_urls(api, emu, command=command, expose=[8000]).status.expose_urls
    assert get_when_up(url + "/health", bearer(emu.token)).json() == {"status": "healthy"}
    step = requests.post(url + "/step", json={"action": {"message": "image"}},
                         headers=bearer(emu.token), timeout=TIMEOUT)
    assert step.json()["observation"]["echoed_message"] == "image"
    with ws_sync.connect(url.replace("http://", "ws://") + "/ws",
                         additional_headers=bearer(emu.token), open_timeout=TIMEOUT) as ws:
        ws.send(json.dumps({"type": "step", "data": {"message": "ws"}}))
        assert json.loads(ws.recv(timeout=TIMEOUT))["data"]["observation"]["echoed_message"] == "ws"


@pytest.mark.parametrize("port", [8000, 9000])
def test_the_providers_default_command_starts_the_echo_environment_on_its_port(emu, port):
    from hf_sandbox_provider import EnvSession, HFSandboxProvider

    with HFSandboxProvider("registry.hf.space/openenv-echo-env:latest", endpoint=emu.endpoint,
                           token=emu.token, port=port, start_timeout_s=TIMEOUT,
                           ready_timeout_s=TIMEOUT) as provider:
        provider.wait_for_ready(provider.start_container())
        with EnvSession(provider.base_url) as session:
            session.reset()
            answer = session.step({"message": "default"})
        assert answer["observation"]["echoed_message"] == "default"
        assert emu.job(provider.job_id).spec["command"][2].startswith("cd /app/env && exec uvicorn")


def test_first_healthy_moment_is_recorded_after_running(emu, api):
    job = running_with_urls(api, emu, command=[], expose=[8000])
    get_when_up(job.status.expose_urls[0] + "/health", bearer(emu.token))
    record = emu.job(job.id)
    wait_until(lambda: record.first_health_ok_mono is not None, "the health probe")
    assert record.created_mono <= record.started_mono <= record.first_health_ok_mono


def test_the_gate_closes_when_the_job_ends(emu, api):
    job = running_with_urls(api, emu, command=[], expose=[8000])
    (url,) = job.status.expose_urls
    get_when_up(url + "/health", bearer(emu.token))
    api.cancel_job(job_id=job.id, namespace="local")
    finished(api, emu, job.id)
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", headers=bearer(emu.token), timeout=TIMEOUT)


def test_vendored_copy_inside_a_package_uses_its_sibling_proxy_and_core(tmp_path):
    # the core comes too: the Jobs facts live there
    support.vendored_package(str(tmp_path), "vendored_sandbox", ["hf_jobs_emulator.py", "proxy.py", "hf_sandbox_provider.py"])
    code = ("import vendored_sandbox.hf_jobs_emulator as e, vendored_sandbox.proxy as p\n"
            "assert issubclass(e._JobGate, p.AuthProxy)\n"
            "assert e._jobs_facts().__name__ == 'vendored_sandbox.hf_sandbox_provider'\n"
            "with e.JobsEmulator() as emu: print(emu.endpoint)\n")
    done = subprocess.run([PY, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("http://127.0.0.1:")


WHO_AM_I = py(
    "import os\n"
    "from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer\n"
    "class H(BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = os.environ['WHO'].encode()\n"
    "        self.send_response(200)\n"
    "        self.send_header('Content-Length', str(len(body)))\n"
    "        self.end_headers()\n"
    "        self.wfile.write(body)\n"
    "    def log_message(self, *a): pass\n"
    "ThreadingHTTPServer(('127.0.0.1', int(os.environ['PORT'])), H).serve_forever()\n")


@pytest.mark.slow  # twelve jobs
def test_parallel_jobs_each_get_their_own_port_and_gate(emu, api):
    """Job ports come from below the ephemeral range, so a gate or client socket opened meanwhile can
    never take a job's port and receive another job's traffic."""
    count = 12
    jobs = [run(api, emu, WHO_AM_I, env={"WHO": f"job-{i}"}, expose=[8000]) for i in range(count)]
    infos = [api.wait_for_job(j.id, stages=["RUNNING"], timeout=TIMEOUT, poll_interval=0.05, namespace="local")
             for j in jobs]
    ports = [emu.job(j.id).port for j in jobs]
    assert len(set(ports)) == count
    assert all(hf_jobs_emulator.JOB_PORT_RANGE[0] <= p <= hf_jobs_emulator.JOB_PORT_RANGE[1] for p in ports)
    for i, info in enumerate(infos):
        assert get_when_up(info.status.expose_urls[0] + "/", bearer(emu.token)).text == f"job-{i}"


def test_stop_names_what_it_could_not_clean_up_instead_of_raising():
    class StubbornGate:
        def __init__(self, gate):
            self.gate, self.url, self.port = gate, gate.url, gate.port

        def stop(self):
            self.gate.stop()  # really stopped, but reports a failure
            raise RuntimeError("gate refused to stop")

    class Emulator(JobsEmulator):
        def make_gate(self, job, exposed_port, public=False):
            return StubbornGate(super().make_gate(job, exposed_port, public))

    emu = Emulator().start()
    try:
        api = HfApi(endpoint=emu.endpoint, token=emu.token)
        job = run(api, emu, SLEEP_FOREVER, expose=[8000])
        emu.wait_for_stage(job.id, ["RUNNING"])
    finally:
        problems = emu.stop()
    assert problems == [f"job {job.id} gate on port {emu.job(job.id)._gates[0].port}"]
    assert emu.live_pids() == []


def test_serve_cli_refuses_an_unknown_fault_naming_it():
    done = subprocess.run([PY, hf_jobs_emulator.__file__, "serve", "--fault", "explode=1"],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 2 and "explode" in done.stderr and "crash-at-boot" in done.stderr


CHATTY = py("import time\nwhile True:\n    print('line', flush=True)\n    time.sleep(0.002)")


def test_metrics_stream_keeps_one_sample_per_interval_while_another_job_logs_hundreds_of_lines(emu, api):
    job = running_with_urls(api, emu, command=SLEEP_FOREVER)
    run(api, emu, CHATTY)  # every log line notifies the emulator's condition
    samples, until = 0, time.monotonic() + 2.5
    with raw(emu, "GET", f"/api/jobs/local/{job.id}/metrics", stream=True) as answer:
        for line in answer.iter_lines():
            samples += line == b"event: metric"
            if time.monotonic() >= until:
                break
    assert 1 <= samples <= 4, samples  # before: several hundred, each over a few ms of CPU


def test_an_injected_429_describes_the_real_window_and_uses_none_of_it():
    with JobsEmulator(rate_limit=(40, 60)) as emu:
        first = raw(emu, "GET", "/api/jobs/local")
        emu.inject_rate_limit(1, retry_after_s=2, routes=["list"])
        refused = raw(emu, "GET", "/api/jobs/local")
        after = raw(emu, "GET", "/api/jobs/local")
    assert refused.status_code == 429 and refused.headers["RateLimit"] == '"api";r=0;t=2'
    assert refused.headers["RateLimit-Policy"] == first.headers["RateLimit-Policy"] == '"fixed window";"api";q=40;w=60'
    assert first.headers["RateLimit"].startswith('"api";r=39;') and after.headers["RateLimit"].startswith('"api";r=38;')


MALFORMED_FRAMING = [
    (b"Content-Length: abc\r\n", "Content-Length"),
    (b"Content-Length: 1_0\r\n", "Content-Length"),  # int() would take these three; HTTP/1.1 does not
    (b"Content-Length: +5\r\n", "Content-Length"),
    (b"Transfer-Encoding: chunked\r\n\r\n0x5\r\n", "chunk size"),
    (b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
]


@pytest.mark.parametrize("framing,named", MALFORMED_FRAMING)
def test_malformed_content_length_or_chunk_size_is_a_400_naming_it_and_the_connection_closes(emu, framing, named):
    head = b"POST /api/jobs/local HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n" % emu.token.encode()
    request = head + framing + (b"" if b"chunked" in framing else b"\r\n")
    answer = support.raw_request(emu.port, request + b"hello", timeout=TIMEOUT)  # read until the server closes
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400 ") and b"Connection: close" in status, answer[:300]
    assert f"malformed {named}".encode() in body and b"emulator error" not in body, body
    assert answer.count(b"HTTP/1.1 ") == 1  # the bytes after it were not read as another request


def test_a_client_resetting_its_connection_prints_no_traceback_and_logs_no_error(emu, capfd, caplog):
    for _ in range(3):  # a request whose body never comes, then a reset (RST, unread data)
        with socket.create_connection((emu.host, emu.port)) as client:
            client.sendall(b"POST /api/jobs/local HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    for _ in range(3):  # keep-alive requests sent back to back, then a reset before the answers are read
        with socket.create_connection((emu.host, emu.port)) as client:
            client.sendall(b"GET /api/whoami-v2 HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    time.sleep(0.5)
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.name == "hf_jobs_emulator" and r.levelno >= logging.ERROR]
    assert raw(emu, "GET", "/api/whoami-v2").status_code == 200  # and it still serves


def test_an_error_other_than_a_dropped_connection_is_still_logged_with_its_traceback(emu, caplog):
    try:
        raise RuntimeError("a bug in a handler")
    except RuntimeError:
        emu._server.handle_error(None, ("127.0.0.1", 1))
    errors = [r for r in caplog.records if r.name == "hf_jobs_emulator" and r.levelno == logging.ERROR]
    assert errors and errors[0].exc_info[0] is RuntimeError


ECHO_ENV_AND_SECRET = py("import os\nprint('env', os.environ['A'], 'secret', os.environ['S'], flush=True)\n"
                         "import time\nwhile True: time.sleep(1)")


def test_rerun_job_with_hfapi_starts_a_new_job_from_the_stored_spec_secrets_included(emu, api):
    job = run(api, emu, ECHO_ENV_AND_SECRET, env={"A": "1"}, secrets={"S": "s3cret"}, labels={"team": "rl"},
              timeout=600, expose=[8000])
    api.update_job_labels(job_id=job.id, namespace="local", labels={"team": "rl", "round": "2"})
    again = api.rerun_job(job_id=job.id, namespace="local")
    assert again.id != job.id and again.status.stage in ("SCHEDULING", "RUNNING")
    assert (again.docker_image, again.command, again.environment, again.flavor) == (
        job.docker_image, job.command, job.environment, job.flavor)
    assert again.labels == {"team": "rl", "round": "2"}  # the spec as it is now
    assert again.secrets == {"S": None} and again.initiator.name == "local"
    assert raw(emu, "GET", f"/api/jobs/local/{again.id}").json()["expose"]["ports"] == [8000]
    wait_until(lambda: ("env 1 secret s3cret" in [line for _, line in emu.job(again.id).logs]),
               "the rerun's process to get the env and the secret", TIMEOUT)
    assert emu.api_calls["duplicate"] == 1 and api.inspect_job(job_id=job.id, namespace="local").id == job.id
    with pytest.raises(JobNotFoundError):  # a job that does not exist is still not found
        api.rerun_job(job_id="0123456789abcdef01234567", namespace="local")
    for one in (job, again):
        api.cancel_job(job_id=one.id, namespace="local")


def test_scheduled_job_routes_answer_501_naming_what_is_not_emulated_not_a_misleading_job_not_found(emu, api):
    with pytest.raises(HfHubHTTPError) as info:
        api.inspect_scheduled_job(scheduled_job_id="0123456789abcdef01234567", namespace="local")
    assert not isinstance(info.value, JobNotFoundError)
    assert info.value.response.status_code == 501 and "scheduled" in str(info.value)


# A job that ignores SIGTERM (its shell and the sleep it runs), in a process that starts an emulator and then
# either leaves without stop() or is interrupted (SIGINT: a terminal's Ctrl-C) while stop() waits out the grace.
ORPHAN_SCRIPT = r"""
import os, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from hf_jobs_emulator import JobsEmulator
from huggingface_hub import HfApi
emu = JobsEmulator(kill_grace_s=60).start()
api = HfApi(endpoint=emu.endpoint, token=emu.token)
job = api.run_job(image="python:3.12", command=["sh", "-c", "trap '' TERM; echo up; sleep 300"], namespace="local")
deadline = time.monotonic() + 30
while not any(line == "up" for _, line in emu.job(job.id).logs) and time.monotonic() < deadline:
    time.sleep(0.02)
print("pgid", os.getpgid(emu.job(job.id).pid), flush=True)
if sys.argv[2] == "interrupt":
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    try:
        emu.stop()
    except KeyboardInterrupt:
        print("interrupted after %.1f s" % (time.monotonic() - started), flush=True)
        os._exit(0)  # no atexit hook: what stop() itself left behind is what the test sees
    print("stop returned", flush=True)
"""


def group_members(pgid: int) -> List[int]:
    return support.processes(lambda stat: stat[2] == pgid)


@pytest.mark.parametrize("how", ["exit", "interrupt"])
def test_a_job_ignoring_sigterm_is_killed_when_its_process_exits_without_stop_or_is_interrupted_in_it(how):
    root = os.path.dirname(os.path.abspath(hf_jobs_emulator.__file__))
    # spawn_process: the child gets the default SIGINT (so Python's KeyboardInterrupt) even when the suite runs
    # with it ignored (nohup, a script's background job), as Python installs no handler for an ignored SIGINT.
    with spawn_process([PY, "-c", ORPHAN_SCRIPT, root, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True) as proc:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    lines = done.stdout.splitlines()
    pgid = int(next(line for line in lines if line.startswith("pgid ")).split()[1])
    assert pgid != os.getpgrp(), "the job shares pytest's process group"  # (the kill below would end pytest)
    try:
        assert done.returncode == 0, done.stderr[-2000:]
        if how == "interrupt":  # the interrupt cut the 60 s grace short and reached the caller
            assert any(line.startswith("interrupted after ") and float(line.split()[2]) < 10 for line in lines), lines
        wait_until(lambda: not group_members(pgid), "the job's process group to be killed", 10)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)  # a failing test leaves nothing behind either
