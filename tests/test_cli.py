"""`python -m hf_sandbox_provider ...` run as real subprocesses against the local Jobs emulator."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest
import hf_sandbox_provider as hsp
from hf_jobs_emulator import JobsEmulator, spawn_process
import support
from support import wait_until

# Every test here runs the CLI or a script as a subprocess (seconds each): the slow tier.
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TIMEOUT_S = 90


def clean_env(tmp_path, **extra):
    """An environment with no Hugging Face token anywhere, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT")}
    env.update(HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf"), PYTHONPATH=REPO)
    env.update(extra)
    return env


def run(args, env, timeout=RUN_TIMEOUT_S):
    return subprocess.run([sys.executable, "-m", "hf_sandbox_provider"] + list(args), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_smoke_local_json_passes_every_stage_and_leaves_nothing_running(tmp_path):
    result = run(["smoke", "--local", "--json"], clean_env(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["mode"] == "local" and report["error"] is None
    names = [stage["name"] for stage in report["stages"]]
    for expected in ("start_container", "wait_for_ready", "GET /health", "HTTP POST /reset",
                     "HTTP POST /step", "WebSocket /ws", "stop_container", "stop local Jobs emulator"):
        assert any(name.startswith(expected) for name in names), (expected, names)
    assert all(stage["ok"] for stage in report["stages"])
    assert {"created", "running", "url", "ready"} <= set(report["timings"])
    assert report["stages"][-1]["detail"] == "no job process left"
    assert "CANCELED" in next(s["detail"] for s in report["stages"] if s["name"].startswith("stop_container"))
    assert "start_container" in result.stderr  # progress lines go to stderr with --json


def test_smoke_local_prints_a_line_per_stage_and_a_summary_table(tmp_path):
    result = run(["smoke", "--local"], clean_env(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.strip().startswith("ok") and "WebSocket /ws" in line for line in lines)
    assert any(line.startswith("total") and " ok " in line for line in lines)
    # a start speaks while it waits: the job's id and Hub page as soon as the create answers, before
    # the start's own result line
    created = next(i for i, line in enumerate(lines) if " created (" in line)
    started = next(i for i, line in enumerate(lines) if line.strip().startswith("ok") and "start_container" in line)
    assert created < started and "/jobs/local/" in lines[created], lines


def test_smoke_with_a_crashing_job_exits_non_zero_with_the_job_reason(tmp_path):
    crash = "%s -c \"import sys; print('boom-at-boot', file=sys.stderr); sys.exit(3)\"" % sys.executable
    result = run(["smoke", "--local", "--json", "--command", crash], clean_env(tmp_path))
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert "JobFailedError" in report["error"] and "ERROR" in report["error"]
    assert "boom-at-boot" in report["error"]  # the log tail travels with the failure
    assert "exit code: 3" in report["error"]
    assert report["stages"][-1]["detail"] == "no job process left"


def test_smoke_without_a_token_points_at_local_and_exits_non_zero(tmp_path):
    result = run(["smoke"], clean_env(tmp_path, HF_ENDPOINT="http://127.0.0.1:9"))
    assert result.returncode == 2
    assert "no Hugging Face token" in result.stderr and "--local" in result.stderr


def test_smoke_rejects_a_non_object_action(tmp_path):
    result = run(["smoke", "--local", "--action", "[1]"], clean_env(tmp_path))
    assert result.returncode == 2 and "--action" in result.stderr


@pytest.mark.parametrize("flag", [["--command", ""], ["--image", ""], ["--action", ""],
                                  ["--timeout", "0"], ["--flavor", "cpu-basci"],
                                  ["--pool", "bad/name"]],
                         ids=lambda flag: flag[0] + "=" + flag[1])
def test_smoke_refuses_a_bad_flag_with_exit_2_and_the_same_words_with_and_without_local(
        tmp_path, flag):
    # With a token and an endpoint nothing listens on: a usage error must come before any call.
    env = clean_env(tmp_path, HF_TOKEN="hf_" + "x" * 34, HF_ENDPOINT="http://127.0.0.1:9")
    hub, local = run(["smoke"] + flag, env), run(["smoke", "--local"] + flag, env)
    assert (hub.returncode, local.returncode) == (2, 2), (hub.stdout + hub.stderr,
                                                          local.stdout + local.stderr)
    assert hub.stderr == local.stderr and hub.stderr.startswith("error: ")
    assert len(hub.stderr.splitlines()) == 1
    assert hub.stdout == local.stdout == ""  # nothing started: no stage, no emulator


# Runs a module or script with `cryptography` unimportable, as in an install without the test extra.
WITHOUT_CRYPTOGRAPHY = ("import os, runpy, sys; sys.modules['cryptography'] = None\n"
                        "target = sys.argv.pop(1)\n"
                        "if target.endswith('.py'):\n"
                        "    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))\n"
                        "    runpy.run_path(target, run_name='__main__')\n"
                        "else:\n"
                        "    runpy.run_module(target, run_name='__main__', alter_sys=True)")


@pytest.mark.parametrize("target", ["hf_sandbox_provider", "examples/legacy_http_client.py",
                                    "examples/many_envs.py"])
def test_local_pool_without_cryptography_fails_in_one_line_naming_the_package_to_install(
        tmp_path, target):
    args = (["smoke"] if target == "hf_sandbox_provider" else []) + ["--local", "--pool", "p1"]
    result = subprocess.run([sys.executable, "-c", WITHOUT_CRYPTOGRAPHY, target] + args, cwd=REPO,
                            env=clean_env(tmp_path), capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "pip install cryptography" in result.stderr


def test_smoke_on_a_terminal_shows_one_line_per_stage(tmp_path):
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "hf_sandbox_provider", "smoke", "--local"],
                            cwd=REPO, env=clean_env(tmp_path), stdout=follower,
                            stderr=subprocess.PIPE)
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(leader)
        assert proc.wait(RUN_TIMEOUT_S) == 0, proc.stderr.read()
        proc.stderr.close()
    # What the terminal shows: each line as its last carriage return and erase-line left it.
    shown = [line.rsplit("\r", 1)[-1].replace("\x1b[K", "")
             for line in b"".join(chunks).decode().replace("\r\n", "\n").split("\n")]
    stage_lines = [line for line in shown if line.startswith(("  ok", "  FAIL", "  ..."))]
    assert stage_lines and all(line.startswith("  ok") for line in stage_lines), shown
    assert len([line for line in stage_lines if "WebSocket /ws" in line]) == 1


def test_no_subcommand_prints_usage_and_exits_2(tmp_path):
    result = run([], clean_env(tmp_path))
    assert result.returncode == 2 and "smoke" in result.stderr


def test_sweep_cancels_only_this_librarys_running_jobs(tmp_path):
    with JobsEmulator() as emulator:
        ours = hsp.HFSandboxProvider("python:3.12", endpoint=emulator.endpoint, token=emulator.token,
                                     command=[sys.executable, "-c", "import time; time.sleep(60)"],
                                     poll_interval_s=0.05)
        try:
            ours.start_container()
            env = clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token)
            dry = run(["sweep", "--dry-run"], env)
            assert dry.returncode == 0 and "would cancel %s" % ours.job_id in dry.stdout
            assert emulator.job(ours.job_id).stage == "RUNNING"
            swept = run(["sweep"], env)
            assert swept.returncode == 0, swept.stderr
            assert "cancelled %s" % ours.job_id in swept.stdout
            assert emulator.wait_for_stage(ours.job_id, ["CANCELED"]).stage == "CANCELED"
        finally:
            ours.stop_container()


def test_job_of_a_process_that_exits_without_stopping_is_cancelled_at_exit(tmp_path):
    script = textwrap.dedent("""
        import sys, hf_sandbox_provider as hsp
        provider = hsp.HFSandboxProvider("python:3.12", endpoint=sys.argv[1], token=sys.argv[2],
                                         command=[sys.executable, "-c", "import time; time.sleep(60)"],
                                         poll_interval_s=0.05)
        provider.start_container()
        print(provider.job_id, flush=True)
        # no stop_container(): the exit hook must cancel the job
    """)
    with JobsEmulator() as emulator:
        result = subprocess.run([sys.executable, "-c", script, emulator.endpoint, emulator.token], cwd=REPO,
                                env=clean_env(tmp_path), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert result.returncode == 0, result.stderr
        job_id = result.stdout.strip()
        # the exit hook's cancel was accepted before the process ended; the stage follows it shortly
        wait_until(lambda: emulator.job(job_id).stage == "CANCELED", "the job to be CANCELED")
        assert "still running at exit" in result.stderr and job_id in result.stderr
        assert emulator.token not in result.stderr + result.stdout


def test_module_works_vendored_inside_a_package(tmp_path):
    support.vendored_package(str(tmp_path), "vendored", ["hf_sandbox_provider.py", "proxy.py"])
    script = ("import vendored.hf_sandbox_provider as h, vendored.proxy as p, sys; "
              "assert h.InsecureURLError is p.InsecureURLError; "
              "assert 'proxy' not in sys.modules; print('ok')")
    env = clean_env(tmp_path)
    env["PYTHONPATH"] = str(tmp_path)
    result = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=env,
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_insecure_url_error_is_the_proxy_modules_class():
    import proxy

    assert hsp.InsecureURLError is proxy.InsecureURLError


def test_sweep_in_an_org_cancels_only_jobs_the_current_user_started(tmp_path):
    other_token = "hf_other_" + "b" * 24
    with JobsEmulator(extra_tokens={other_token: "bob"}, orgs={"team": ["local", "bob"]}) as emulator:
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        mine = hsp.HFSandboxProvider("python:3.12", endpoint=emulator.endpoint, token=emulator.token,
                                     namespace="team", command=sleeper, poll_interval_s=0.05)
        bobs = hsp.HFSandboxProvider("python:3.12", endpoint=emulator.endpoint, token=other_token,
                                     namespace="team", command=sleeper, poll_interval_s=0.05)
        try:
            mine.start_container()
            bobs.start_container()
            env = clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token)
            swept = run(["sweep", "--namespace", "team"], env)
            assert swept.returncode == 0, swept.stderr
            assert "cancelled %s" % mine.job_id in swept.stdout
            assert "skipped %s" % bobs.job_id in swept.stdout and "started by bob" in swept.stdout
            assert emulator.wait_for_stage(mine.job_id, ["CANCELED"]).stage == "CANCELED"
            assert emulator.job(bobs.job_id).stage == "RUNNING"
        finally:
            mine.stop_container()
            bobs.stop_container()


def test_readmes_first_command_installs_only_the_library_and_its_test_command_is_what_ci_runs():
    with open(os.path.join(REPO, "README.md")) as fh:
        block = fh.read().split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, commands
    assert "pip install -e . &&" in commands[0]
    assert commands[0].endswith("hf_sandbox_provider smoke --local")
    test_command = commands[1].split(" && ")[-1]
    with open(os.path.join(REPO, ".ci", "run")) as fh:
        ci = [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == test_command  # CI runs exactly README's test command
    assert any("pip install" in line and "-e '.[test,trl]'" in line for line in ci)


def test_smoke_shows_an_http_stage_failure_in_the_servers_words_and_never_the_route_id(tmp_path):
    result = run(["smoke", "--local", "--action", '{"no_such_field": 1}'], clean_env(tmp_path))
    assert result.returncode == 1
    assert "HTTP 422 from POST /step: {" in result.stdout, result.stdout  # the server's validation detail
    assert not re.search(r":[0-9]+/[A-Za-z0-9_-]{32}", result.stdout + result.stderr)  # no proxy route id


@pytest.mark.parametrize("args, words", [
    (["--pool", "bad/name"], "--pool 'bad/name' is not a pool name"),
    (["--pool", ""], "--pool '' is not a pool name"),  # before: the empty name swept every job of the library
    (["--older-than", "0"], "--older-than '0' is not a duration of at least 1 second"),
])
def test_sweep_refuses_a_pool_name_or_duration_no_job_can_match_before_any_call(tmp_path, args, words):
    with JobsEmulator() as emu:
        result = run(["sweep"] + args, clean_env(tmp_path, HF_ENDPOINT=emu.endpoint, HF_TOKEN=emu.token))
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert emu.api_calls == {}


def test_smoke_names_hf_endpoint_as_the_source_of_a_refused_endpoint(tmp_path):
    result = run(["smoke"], clean_env(tmp_path, HF_ENDPOINT="http://example.invalid", HF_TOKEN="hf_unused"))
    assert result.returncode == 2
    assert "Jobs endpoint 'http://example.invalid' must be https" in result.stderr
    assert result.stderr.rstrip().endswith("(from $HF_ENDPOINT)"), result.stderr


STUBBORN = "sh -c 'trap \"\" TERM; %s -m hf_jobs_emulator echo-server; sleep 30'" % sys.executable


def test_ctrl_c_during_smokes_teardown_finishes_the_cleanup_reports_and_leaves_no_process(tmp_path):
    marker = "SMOKE_TEST_MARK_" + uuid.uuid4().hex
    # spawn_process: the child gets the default SIGINT/SIGHUP even when the suite runs with them ignored
    # (nohup, a script's background job), as the CLI keeps an ignored disposition by design.
    proc = spawn_process([sys.executable, "-m", "hf_sandbox_provider", "smoke", "--local", "--command", STUBBORN],
                         cwd=REPO, env=clean_env(tmp_path, **{marker: "1"}), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:  # a pipe: each stage prints its `...` line as it begins
            lines.append(line)
            if "...   stop local Jobs emulator" in line:  # its job ignores SIGTERM: a 3 s kill grace
                os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does
                break
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + out
    assert proc.returncode == 1 and "Traceback" not in err, err  # before: a KeyboardInterrupt traceback
    assert "\ntotal " in out and "stop local Jobs emulator" in out.split("\ntotal ")[0], out  # the table
    try:
        wait_until(lambda: not processes_carrying(marker), "the job's processes to end", 10)  # before: 2 left
    finally:
        for pid in processes_carrying(marker):  # whatever a failure left, so no later test meets it
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def processes_carrying(variable):
    """Pids of this user's processes whose environment sets `variable` (what a process passes to its children;
    a random name, matched as a whole entry, so the kills it leads to reach only this test's processes)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat("/proc/%s" % pid).st_uid != os.getuid():
                continue
            with open("/proc/%s/environ" % pid, "rb") as environ:
                if (b"\0" + environ.read()).find(b"\0" + variable.encode() + b"=") >= 0:
                    found.append(int(pid))
        except OSError:  # ended meanwhile, or not ours to read
            pass
    return found


# -- teardown that holds when the cancel fails, on SIGTERM/SIGHUP, with a closed stdout (review F2, F3, F7-F10) --


def hub_env(tmp_path, emulator, **extra):
    """The CLI pointed at `emulator` as if it were the Hub (no --local)."""
    return clean_env(tmp_path, HF_ENDPOINT=emulator.endpoint, HF_TOKEN=emulator.token, **extra)


def test_smoke_fails_its_stop_stage_and_exits_1_when_the_job_could_not_be_cancelled(tmp_path):
    with JobsEmulator() as emulator:
        emulator.inject_server_errors(1000, 503, routes=["cancel"])  # every cancel fails: the job bills on
        result = run(["smoke", "--json"], hub_env(tmp_path, emulator))
        emulator.inject_server_errors(0, 503, routes=["cancel"])
        report = json.loads(result.stdout)
        assert result.returncode == 1, result.stderr  # before: 0, "ok" and "total ok"
        (stop,) = [s for s in report["stages"] if s["name"].startswith("stop_container")]
        assert not stop["ok"] and "is still RUNNING after stop_container()" in stop["detail"]
        assert emulator.job(report["job_id"]).stage == "RUNNING"


NEVER_READY = "%s -c 'import time; time.sleep(120)'" % sys.executable


def test_a_signal_landing_just_after_a_stage_line_fails_that_stage_and_one_between_stages_fails_the_total():
    import io
    import hf_sandbox_cli as cli

    class SignalAfterTheLine(io.StringIO):  # the handler raises at the next bytecode: here, inside the flush
        def flush(self):
            if self.getvalue().endswith("...   wait_for_ready\n") and not hasattr(self, "fired"):
                self.fired = True
                raise cli._Terminated("SIGHUP")

    smoke = cli._Smoke(SignalAfterTheLine())
    assert smoke.stage("start_container", lambda: "job 1")
    with pytest.raises(cli._Terminated):
        smoke.stage("wait_for_ready", lambda: "never reached")
    assert [(s["name"], s["ok"], s["detail"]) for s in smoke.stages][1] == (
        "wait_for_ready", False, "interrupted (SIGHUP)")  # before: not recorded, and the total said ok
    assert smoke.table("interrupted by SIGHUP").splitlines()[-1].startswith("total ")
    between = cli._Smoke(io.StringIO())
    between.stage("start_container", lambda: "job 1")
    table = between.table("interrupted by SIGTERM").splitlines()
    assert re.match(r"total +FAIL", table[-2]) and table[-1] == "interrupted by SIGTERM between stages", table


@pytest.mark.parametrize("mode, signum", [("hub", signal.SIGTERM), ("local", signal.SIGHUP)], ids=["hub-SIGTERM",
                                                                                                     "local-SIGHUP"])
def test_smoke_tears_down_and_prints_its_table_on_sigterm_or_sighup(tmp_path, mode, signum):
    marker = "SMOKE_SIGNAL_MARK_" + uuid.uuid4().hex
    with JobsEmulator() as emulator:
        env = hub_env(tmp_path, emulator, **{marker: "1"})
        args = ["smoke", "--command", NEVER_READY, "--timeout", "60"] + (["--local"] if mode == "local" else [])
        proc = spawn_process([sys.executable, "-m", "hf_sandbox_provider"] + args, cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "...   wait_for_ready" in line:  # the job runs; its server never answers
                    proc.send_signal(signum)  # as `timeout`, a CI cancel or a closed terminal does
                    break
            out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out = "".join(lines) + out
        assert proc.returncode == 1 and "Traceback" not in err, err  # before: killed by the signal
        assert "interrupted (%s)" % signal.Signals(signum).name in out
        assert "\ntotal " in out and "stop_container" in out.split("\ntotal ")[0], out  # the teardown and table
        if mode == "hub":
            (job,) = emulator.jobs
            assert emulator.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED"  # before: RUNNING
    try:
        wait_until(lambda: not processes_carrying(marker), "the job's processes to end", 10)
    finally:
        for pid in processes_carrying(marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# Runs the CLI with huggingface_hub's version set to one too old for pooled placement.
WITH_OLD_HUB = ("import runpy, sys, huggingface_hub; huggingface_hub.__version__ = '2.0.0'\n"
                "runpy.run_module('hf_sandbox_provider', run_name='__main__', alter_sys=True)")


def test_smoke_pool_with_a_too_old_huggingface_hub_exits_2_in_one_line_with_and_without_local(tmp_path):
    env = clean_env(tmp_path, HF_TOKEN="hf_" + "x" * 34, HF_ENDPOINT="http://127.0.0.1:9")
    results = [subprocess.run([sys.executable, "-c", WITH_OLD_HUB, "smoke", "--pool", "p"] + local, cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
               for local in ([], ["--local"])]
    for result in results:  # before: without --local, stages ran and it exited 1
        assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
        assert len(result.stderr.splitlines()) == 1 and "huggingface_hub >= 2.1.1" in result.stderr
    assert results[0].stderr == results[1].stderr


def test_smoke_with_its_stdout_closed_early_still_tears_down_without_a_traceback(tmp_path):
    with JobsEmulator() as emulator:
        proc = subprocess.Popen([sys.executable, "-m", "hf_sandbox_provider", "smoke"], cwd=REPO,
                                env=hub_env(tmp_path, emulator), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            for _, line in zip(range(4), proc.stdout):
                pass
            proc.stdout.close()  # the reader goes away, as `| head -n 4` does
            err = proc.stderr.read()
            proc.wait(RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr.close()
        assert "Traceback" not in err and "Broken pipe" not in err, err  # before: BrokenPipeError tracebacks
        assert "still running at exit" not in err, err  # the CLI's teardown cancelled it, not the exit safety net
        assert proc.returncode == 0, err
        (job,) = emulator.jobs
        assert emulator.wait_for_stage(job.id, ["CANCELED"]).stage == "CANCELED"


def test_ctrl_c_during_sweep_prints_one_line_and_exits_1(tmp_path):
    import socket

    with socket.socket() as silent:  # a Hub that accepts and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        silent.settimeout(RUN_TIMEOUT_S)
        env = clean_env(tmp_path, HF_TOKEN="hf_sweep_ctrl_c_" + "d" * 20)
        proc = spawn_process([sys.executable, "-m", "hf_sandbox_provider", "sweep", "--endpoint",
                              "http://127.0.0.1:%d" % silent.getsockname()[1]], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            connection, _ = silent.accept()  # sweep is waiting for its first answer
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
            connection.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 1 and "Traceback" not in err, err  # before: a KeyboardInterrupt traceback, -2
    assert err == "interrupted: no job cancelled\n"


@pytest.mark.parametrize("args", [["--endpoint", "https://[::1"], ["--older-than", "9" * 400]],
                         ids=["malformed-endpoint", "huge-older-than"])
def test_sweep_refuses_a_malformed_endpoint_or_a_huge_duration_in_one_line(tmp_path, args):
    # F9: the core's _resolve_endpoint/_parse_duration (the lead's change) make these usage errors
    result = run(["sweep"] + args, clean_env(tmp_path, HF_TOKEN="hf_unused", HF_ENDPOINT="http://127.0.0.1:9"))
    assert result.returncode == 2 and result.stderr.startswith("error: "), result.stderr
    assert len(result.stderr.splitlines()) == 1
