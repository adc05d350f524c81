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


def test_sweep_says_when_it_waits_out_the_hubs_rate_limit_instead_of_looking_hung(tmp_path):
    # Without -v a sweep waiting for a spent quota's reset (up to 5 minutes on the Hub) printed nothing at all
    # until the end (found by review).
    with JobsEmulator() as emulator:
        young = start_sleeper(emulator)
        try:
            emulator.inject_rate_limit(1, retry_after_s=1, routes=["list"])
            swept = run(["sweep"], clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token))
            assert swept.returncode == 0 and "cancelled %s" % young.job_id in swept.stdout
            assert "waiting: Jobs API answered 429" in swept.stderr and "pause" in swept.stderr, swept.stderr
            assert emulator.token not in swept.stderr
        finally:
            young.stop_container()


def test_a_sweep_whose_cancel_fails_exits_1_saying_the_job_bills_on_and_to_sweep_again(tmp_path):
    # The summary counted the job as a leftover like the others, and nothing said to run the sweep again.
    with JobsEmulator() as emulator:
        stuck = start_sleeper(emulator)
        try:
            emulator.inject_server_errors(20, routes=["cancel"])  # more than the brief retries
            swept = run(["sweep"], clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token))
            assert swept.returncode == 1 and "FAILED to cancel %s" % stuck.job_id in swept.stdout
            assert "1 of them could not be cancelled (see above): they run and bill on; run this sweep again" in (
                swept.stderr), swept.stderr
            assert emulator.job(stuck.job_id).stage == "RUNNING"
        finally:
            stuck.stop_container()


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


def start_labelled(emulator, **labels):
    provider = hsp.HFSandboxProvider("python:3.12", endpoint=emulator.endpoint, token=emulator.token,
                                     command=SLEEPER, poll_interval_s=0.05, labels=labels)
    provider.start_container()
    return provider


def start_label(emulator, provider):
    """The hf-sandbox-start label of the provider's job: the one a warning names after a lost create."""
    return "%s=%s" % (hsp.START_LABEL_KEY, emulator.job(provider.job_id).spec["labels"][hsp.START_LABEL_KEY])


def test_sweep_with_label_cancels_the_labelled_job_and_leaves_the_librarys_other_running_jobs_running(tmp_path):
    with JobsEmulator() as emulator:
        stray, healthy = start_sleeper(emulator), start_sleeper(emulator)
        try:
            label = start_label(emulator, stray)
            env = clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token)
            swept = run(["sweep", "--label", label], env)
            assert swept.returncode == 0, swept.stderr
            assert "cancelled %s" % stray.job_id in swept.stdout
            assert healthy.job_id not in swept.stdout
            assert "1 leftover job(s) of local in local labelled %s\n" % label in swept.stdout
            assert emulator.wait_for_stage(stray.job_id, ["CANCELED"]).stage == "CANCELED"
            assert emulator.job(healthy.job_id).stage == "RUNNING"
        finally:
            hsp.stop_all([stray, healthy])


def test_sweep_dry_run_with_label_lists_only_the_matching_jobs_and_cancels_none(tmp_path):
    with JobsEmulator() as emulator:
        match, other = start_labelled(emulator, run="exp1"), start_labelled(emulator, run="exp2")
        try:
            env = clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token)
            dry = run(["sweep", "--dry-run", "--label", "run=exp1"], env)
            assert dry.returncode == 0, dry.stderr
            assert "would cancel %s (RUNNING" % match.job_id in dry.stdout
            assert other.job_id not in dry.stdout
            assert "1 leftover job(s) of local in local labelled run=exp1 (dry run)" in dry.stdout
            assert [emulator.job(p.job_id).stage for p in (match, other)] == ["RUNNING", "RUNNING"]
        finally:
            hsp.stop_all([match, other])


def test_sweep_with_repeated_labels_cancels_only_jobs_carrying_all_of_them_and_older_than_still_applies(tmp_path):
    with JobsEmulator() as emulator:
        both, young = start_labelled(emulator, run="exp1", shard="0"), start_labelled(emulator, run="exp1", shard="0")
        other_shard = start_labelled(emulator, run="exp1", shard="1")
        other_run = start_labelled(emulator, run="exp2", shard="0")
        providers = [both, young, other_shard, other_run]
        try:
            for provider in (both, other_shard, other_run):  # all but `young` as if left two hours ago
                emulator.job(provider.job_id).created_at -= datetime.timedelta(hours=2)
            env = clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token)
            swept = run(["sweep", "--label", "run=exp1", "--label", "shard=0", "--older-than", "1h"], env)
            assert swept.returncode == 0, swept.stderr
            assert "cancelled %s" % both.job_id in swept.stdout
            assert "skipped %s" % young.job_id in swept.stdout and "younger than 1h" in swept.stdout
            assert other_shard.job_id not in swept.stdout and other_run.job_id not in swept.stdout
            assert "1 leftover job(s) of local in local labelled run=exp1, shard=0\n" in swept.stdout
            assert emulator.wait_for_stage(both.job_id, ["CANCELED"]).stage == "CANCELED"
            assert [emulator.job(p.job_id).stage for p in providers[1:]] == ["RUNNING"] * 3
        finally:
            hsp.stop_all(providers)


def test_sweep_pool_with_label_cancels_only_that_pools_host_jobs_carrying_the_label(tmp_path):
    from huggingface_hub import HfApi

    with JobsEmulator() as emulator:
        api = HfApi(endpoint=emulator.endpoint, token=emulator.token)
        pool_labels = {"hf-sandbox-mode": "pool", "hf-sandbox-pool": "p"}
        hosts = [api.run_job(image="python:3.12", command=SLEEPER, namespace=emulator.namespace,
                             labels={**pool_labels, hsp.PROCESS_LABEL_KEY: process}) for process in ("a", "b")]
        try:
            for host in hosts:
                emulator.wait_for_stage(host.id, ["RUNNING"])
            env = clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token)
            swept = run(["sweep", "--pool", "p", "--label", "%s=a" % hsp.PROCESS_LABEL_KEY], env)
            assert swept.returncode == 0, swept.stderr
            assert "cancelled %s" % hosts[0].id in swept.stdout and hosts[1].id not in swept.stdout
            assert emulator.wait_for_stage(hosts[0].id, ["CANCELED"]).stage == "CANCELED"
            assert emulator.job(hosts[1].id).stage == "RUNNING"
        finally:
            for host in hosts:
                api.cancel_job(job_id=host.id, namespace=emulator.namespace)


@pytest.mark.parametrize("args, words", [
    (["--label", "run"], ["--label 'run' has no '='", "KEY=VALUE", "--label hf-sandbox-start="]),
    (["--label", "=exp1"], ["--label '=exp1' has an empty key", "KEY=VALUE"]),
    (["--label", "run=exp 1"], ["--label 'run=exp 1'", "letters, digits, '-' and '_'", "--label run=exp1"]),
    (["--label", "a.b=1"], ["label key 'a.b'", "letters, digits"]),
    (["--label", "run=a=b"], ["--label 'run=a=b'", "the value must be"]),
    (["--label", "run=exp1", "--label", "run=exp2"], ["--label run is given twice", "keep one"]),
    (["--label", "hf-sandbox-provider=0"], ["contradicts sweep's own filter hf-sandbox-provider=1", "drop it"]),
    (["--pool", "p", "--label", "hf-sandbox-pool=q"], ["contradicts sweep's own filter hf-sandbox-pool=p"]),
])
def test_a_malformed_label_is_refused_naming_what_to_type_before_any_network_call(args, words, monkeypatch, capsys):
    with JobsEmulator() as emulator:
        monkeypatch.setenv("HF_TOKEN", emulator.token)
        monkeypatch.setenv("HF_ENDPOINT", emulator.endpoint)
        assert cli.main(["sweep", "--dry-run"] + args) == cli.EXIT_USAGE
        error = capsys.readouterr().err
        assert error.startswith("error: --label") and all(word in error for word in words), error
        assert sum(emulator.api_calls.values()) == 0


@pytest.mark.parametrize("where", ["first-page", "next-page-link-without-the-filter"])
def test_sweep_never_cancels_a_listed_job_that_is_not_this_librarys(monkeypatch, capsys, where):
    # A listing that ignored the library's own label (or whose next link dropped the query) handed sweep another
    # team's GPU job, which it cancelled: only --label was checked again (found by review).
    import responses

    endpoint, now = "https://hub.example", datetime.datetime.now(datetime.timezone.utc).isoformat()

    def job(job_id, labels):
        return {"id": job_id, "status": {"stage": "RUNNING"}, "initiator": {"name": "alice"}, "flavor": "a100-large",
                "createdAt": now, "labels": labels}

    ours = job("ours", {hsp.PROVIDER_LABEL_KEY: hsp.PROVIDER_LABEL_VALUE})
    theirs = [job("research", {"team": "research"}), job("unlabelled", None)]
    monkeypatch.setenv("HF_TOKEN", "hf_sweep_base_" + "d" * 20)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with responses.RequestsMock(assert_all_requests_are_fired=False) as hub:  # (whoami's answer may be cached)
        hub.add(responses.GET, endpoint + "/api/whoami-v2", json={"name": "alice", "type": "user"})
        if where == "first-page":
            hub.add(responses.GET, endpoint + "/api/jobs/alice", json=[ours] + theirs)
        else:
            page2 = endpoint + "/api/jobs/alice?cursor=2"
            hub.add(responses.GET, endpoint + "/api/jobs/alice", json=[ours],
                    headers={"Link": '<%s>; rel="next"' % page2},
                    match=[responses.matchers.query_param_matcher({"label": "%s=%s" % (
                        hsp.PROVIDER_LABEL_KEY, hsp.PROVIDER_LABEL_VALUE), "stage": ["SCHEDULING", "RUNNING"]})])
            hub.add(responses.GET, page2, json=theirs)
        cancel = hub.add(responses.POST, endpoint + "/api/jobs/alice/ours/cancel", json={})
        assert cli.main(["sweep"]) == cli.EXIT_OK  # (any other cancel would be a request the mock refuses)
    out = capsys.readouterr().out
    assert cancel.call_count == 1 and "cancelled ours" in out
    assert "research" not in out and "unlabelled" not in out and "1 leftover job(s)" in out


def test_sweep_with_label_never_cancels_a_listed_job_lacking_it_even_if_the_hub_ignored_the_filter(monkeypatch,
                                                                                                   capsys):
    import responses

    endpoint, now = "https://hub.example", datetime.datetime.now(datetime.timezone.utc).isoformat()

    def job(job_id, **labels):
        return {"id": job_id, "status": {"stage": "RUNNING"}, "initiator": {"name": "alice"}, "flavor": "cpu-basic",
                "createdAt": now, "labels": {hsp.PROVIDER_LABEL_KEY: hsp.PROVIDER_LABEL_VALUE, **labels}}

    monkeypatch.setenv("HF_TOKEN", "hf_sweep_label_" + "c" * 20)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with responses.RequestsMock() as hub:  # a Hub answering the listing as if it had no label filter
        hub.add(responses.GET, endpoint + "/api/whoami-v2", json={"name": "alice", "type": "user"})
        listing = hub.add(responses.GET, endpoint + "/api/jobs/alice",
                          json=[job("stray", run="exp1"), job("healthy", run="exp2"), job("unlabelled")])
        cancel = hub.add(responses.POST, endpoint + "/api/jobs/alice/stray/cancel", json={})
        assert cli.main(["sweep", "--label", "run=exp1"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "label=run%3Dexp1" in listing.calls[0].request.url  # the filter is sent to the Hub ...
    assert "label=%s%%3D%s" % (hsp.PROVIDER_LABEL_KEY, hsp.PROVIDER_LABEL_VALUE) in listing.calls[0].request.url
    assert cancel.call_count == 1 and "cancelled stray" in out  # ... and checked again on what it lists
    assert "healthy" not in out and "unlabelled" not in out  # not this sweep's: never cancelled, nor listed
    assert "1 leftover job(s) of alice in alice labelled run=exp1" in out
