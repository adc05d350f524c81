"""Many trainer processes on one Hub account: P processes x N environments started at once, one user.

`accelerate launch` on an 8-GPU node runs 8 processes, each with its own providers, all with the same token:
the Hub's rate limit (per user, fixed windows) is shared by all of them, and they do not talk to each other.
This starts P worker processes against ONE local emulator limiting that user to Q calls per W seconds, each
starting N environments with `HFSandboxProvider.start_many` at the same moment, and reports: environments
ready, errors (a 429 surfacing as one counts), calls admitted per window against the quota, 429s answered,
time to all-ready, the workers' time waiting for budget and CPU time (pacing sleeps: a spinning process would
show CPU), and the time to stop. Bounded: each run is given up after --timeout-s.

    python benchmarks/multiproc.py                       # 8 x 32, windows of 1000 then 300 calls per 300 s
    python benchmarks/multiproc.py --processes 2 --envs 2 --quotas 40 --window-s 20   # a quick look
    python benchmarks/multiproc.py --write                # also rewrites its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_sandbox_provider as hsp  # noqa: E402
from hf_jobs_emulator import JobsEmulator, echo_server_command  # noqa: E402
from _results import replace_marked_section  # noqa: E402

IMAGE = "registry.hf.space/openenv-echo-env:latest"
SECTION_START, SECTION_END = "<!-- multiproc:start -->", "<!-- multiproc:end -->"
# Workers wait for this moment (written to their stdin) so that all P start within milliseconds.
START_DELAY_S = 2.0
# A worker that has not reported this long after the run's deadline is killed.
KILL_GRACE_S = 30.0


# -- the worker: one trainer process -----------------------------------------------------------------


def _worker(endpoint: str, token: str, envs: int, ready_timeout_s: float) -> int:
    """Start `envs` environments at the moment read from stdin, report one JSON line, stop them."""
    go = float(sys.stdin.readline())
    time.sleep(max(0.0, go - time.time()))
    began = time.monotonic()
    report: Dict[str, Any] = {"pid": os.getpid(), "ready": 0, "errors": []}
    providers: List[hsp.HFSandboxProvider] = []
    try:
        providers, failures = hsp.HFSandboxProvider.start_many(
            envs, IMAGE, endpoint=endpoint, token=token, command=echo_server_command(), progress=False,
            all_or_nothing=False, start_timeout_s=ready_timeout_s, ready_timeout_s=ready_timeout_s)
        report["errors"] = ["%s: %s" % (type(exc).__name__, hsp._first_line(exc)) for _, exc in failures]
    except Exception as exc:  # reported, never lost
        report["errors"].append("%s: %s" % (type(exc).__name__, hsp._first_line(exc)))
    report["ready"] = len(providers)
    report["ready_s"] = time.monotonic() - began
    stopping = time.monotonic()
    hsp.stop_all(providers)
    report["stop_s"] = time.monotonic() - stopping
    budget = hsp._api_budget(hsp._resolve_endpoint(endpoint), token)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report.update(calls=budget.sent, teardown_calls=budget.teardown_sent, budget_wait_s=budget.waited_s,
                  rate_limited=budget.rate_limited_count, server_told=budget.server_told,
                  quota_seen=budget.calls, cpu_s=usage.ru_utime + usage.ru_stime)
    print(json.dumps(report), flush=True)
    return 0


# -- the coordinator -----------------------------------------------------------------------------------


def _run(processes: int, envs: int, quota: int, window_s: float, timeout_s: float, say: Any) -> Dict[str, Any]:
    """One run: an emulator limiting the user to `quota` calls per `window_s`, P workers started at once."""
    with JobsEmulator(rate_limit=(quota, window_s)) as emu:
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("HF_TOKEN", None)
        stderrs = [tempfile.TemporaryFile(mode="w+") for _ in range(processes)]
        workers = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", emu.endpoint, emu.token,
                                     str(envs), str(timeout_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=stderr, text=True, env=env)
                   for stderr in stderrs]
        go = time.time() + START_DELAY_S
        for worker in workers:
            worker.stdin.write("%r\n" % go)  # type: ignore[union-attr]
            worker.stdin.flush()  # type: ignore[union-attr]
        deadline = time.monotonic() + START_DELAY_S + timeout_s + KILL_GRACE_S
        reports, problems = [], []
        for worker, stderr in zip(workers, stderrs):
            try:
                out, _ = worker.communicate(timeout=max(1.0, deadline - time.monotonic()))
                reports.append(json.loads(out.strip().splitlines()[-1]))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.communicate()
                problems.append("worker %d killed at the deadline" % worker.pid)
            except (ValueError, IndexError):
                stderr.seek(0)
                problems.append("worker %d reported nothing: %s" % (worker.pid, stderr.read()[-500:]))
        calls = dict(emu.api_calls)
        row = {
            "processes": processes, "envs": envs, "quota": quota, "window_s": window_s,
            "ready": sum(r["ready"] for r in reports), "wanted": processes * envs,
            "errors": [e for r in reports for e in r["errors"]] + problems,
            "all_ready_s": max((r["ready_s"] for r in reports), default=None),
            "stop_s_max": max((r["stop_s"] for r in reports), default=None),
            "api_calls": calls, "api_calls_total": sum(calls.values()),
            "window_peak": emu.window_peaks.get(emu.namespace, 0), "answered_429": emu.rate_limited_calls,
            "client_429s": sum(r["rate_limited"] for r in reports),
            "budget_wait_s_max": max((r["budget_wait_s"] for r in reports), default=None),
            "cpu_s_max": max((r["cpu_s"] for r in reports), default=None),
            "teardown_calls": sum(r["teardown_calls"] for r in reports),
            "server_told": all(r["server_told"] for r in reports),
        }
    row["leftovers"] = emu.live_pids()
    say("quota %d/%gs: %d/%d ready in %.1fs, %d API calls (peak %d in one window), %d answered 429, errors %d"
        % (quota, window_s, row["ready"], row["wanted"], row["all_ready_s"] or -1, row["api_calls_total"],
           row["window_peak"], row["answered_429"], len(row["errors"])))
    return row


def _teardown_probe(say: Any) -> Dict[str, Any]:
    """A process whose window is spent down to the reserve stops a 2-replica provider: how long the stop
    takes, beside how long an ordinary call (a status check; before, the cancels too) then waits for budget."""
    import threading

    import requests

    with JobsEmulator(rate_limit=(60, 300)) as emu:
        provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, replicas=2, namespace="local",
                                         command=echo_server_command())
        provider.wait_for_ready(provider.start_container())
        budget = hsp._api_budget(emu.endpoint, emu.token)
        auth = {"Authorization": "Bearer " + emu.token}
        while hsp._ratelimit_info(requests.get(emu.endpoint + "/api/jobs/local", headers=auth).headers)[0] > 6:
            pass  # the user's window, spent down to the reserve
        spender = hsp._JobsClient(emu.endpoint, emu.token)
        spender.list_jobs("local", retries=0)  # this process learns it
        spender.close()
        ordinary_wait = budget.wait_s()
        held = threading.Thread(target=provider.replica_status, kwargs={"refresh": True}, daemon=True)
        held.start()
        began = time.monotonic()
        provider.stop_container()
        row = {"stop_s": time.monotonic() - began, "ordinary_wait_s": ordinary_wait, "stage": provider.stage}
        with budget._lock:  # let the held status call go
            budget.remaining, budget.reset_at = float(budget.calls), budget.clock() + 300
        held.join(30)
    say("teardown with a spent window: stop %.3fs (%s); an ordinary call would wait %.0fs"
        % (row["stop_s"], row["stage"], row["ordinary_wait_s"]))
    return row


def _markdown(rows: Sequence[Dict[str, Any]], command: str, load: Sequence[float], started: str,
              probe: Optional[Dict[str, Any]] = None) -> str:
    lines = [SECTION_START, "## Many trainer processes on one account (benchmarks/multiproc.py)", "",
             "Command: `%s`  " % command,
             "Machine: %s, Python %s, %d CPUs, shared with other work (load average %.1f / %.1f / %.1f at the end); "
             "%s. One emulator in the coordinator process limits its one user per fixed window (RateLimit headers on "
             "every answer, 429 past the quota); each worker process has its own providers, watcher and budget, the "
             "same token, and starts its environments with start_many at the same moment as the others."
             % (platform.platform(), platform.python_version(), os.cpu_count() or 0, load[0], load[1], load[2], started),
             "", "| processes x envs | quota / window | ready | errors | time to all ready | API calls | most in one window "
             "| answered 429 | budget waits (one process, its threads summed) | most CPU (one process) | slowest stop |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append("| %d x %d | %d / %gs | %d/%d | %d | %s | %d | %d | %d | %s | %s | %s |" % (
            row["processes"], row["envs"], row["quota"], row["window_s"], row["ready"], row["wanted"],
            len(row["errors"]), _seconds(row["all_ready_s"]), row["api_calls_total"], row["window_peak"],
            row["answered_429"], _seconds(row["budget_wait_s_max"]), _seconds(row["cpu_s_max"]), _seconds(row["stop_s_max"])))
    lines += ["", "Ready and stop times are the slowest process's, from the common start. A 429 is waited out (the "
              "server's reset), never surfaced: `errors` counts environments that failed. Cancels never wait for the "
              "budget; past the quota the server answers them 429 and they wait for the reset.",
              "", "Calls by route: " + "; ".join(
        "%d/%gs: %s" % (row["quota"], row["window_s"], ", ".join("%s %d" % kv for kv in sorted(row["api_calls"].items())))
        for row in rows)]
    for row in rows:
        for error in row["errors"][:5]:
            lines.append("- %d/%gs error: %s" % (row["quota"], row["window_s"], error))
    if probe is not None:
        lines += ["", "Teardown with the window spent down to the reserve (quota 60 per 300 s, one process, a 2-replica "
                  "provider, a `replica_status(refresh=True)` held by the budget): `stop_container()` took %.3f s (jobs %s), "
                  "while an ordinary call then waited %.0f s for budget, which is what the cancels waited when they "
                  "queued behind the budget (about 240 s before this change)." % (probe["stop_s"], probe["stage"],
                                                                                   probe["ordinary_wait_s"])]
    lines.append(SECTION_END)
    return "\n".join(lines) + "\n"


def _seconds(value: Optional[float]) -> str:
    return "n/a" if value is None else "%.1f s" % value


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return _worker(argv[1], argv[2], int(argv[3]), float(argv[4]))
    parser = argparse.ArgumentParser(prog="python benchmarks/multiproc.py", description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=8, help="trainer processes (default %(default)s)")
    parser.add_argument("--envs", type=int, default=32, help="environments per process (default %(default)s)")
    parser.add_argument("--quotas", default="1000,300", help="calls per window, one run each (default %(default)s)")
    parser.add_argument("--window-s", type=float, default=300.0, help="the fixed window (default %(default)s, the Hub's)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="each run's bound (default %(default)s)")
    parser.add_argument("--no-teardown-probe", action="store_true",
                        help="skip the stop-with-a-spent-window measurement (a few seconds)")
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    parser.add_argument("--results", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    try:
        quotas = [int(part) for part in args.quotas.split(",") if part.strip()]
    except ValueError:
        quotas = []
    if not quotas or min(quotas) < 1 or args.processes < 1 or args.envs < 1 or not args.window_s > 0:
        parser.error("--processes, --envs and every --quotas value must be positive integers, --window-s > 0")
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    def say(line: str) -> None:
        print("multiproc: " + line, flush=True)

    rows = [_run(args.processes, args.envs, quota, args.window_s, args.timeout_s, say) for quota in quotas]
    probe = None if args.no_teardown_probe else _teardown_probe(say)
    command = "python benchmarks/multiproc.py " + " ".join(argv)
    markdown = _markdown(rows, command.strip(), os.getloadavg(), started, probe)
    print(markdown)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    if args.write:
        replace_marked_section(args.results, SECTION_START, SECTION_END, markdown)
    ok = all(row["ready"] == row["wanted"] and not row["errors"] and row["window_peak"] <= row["quota"]
             and not row["leftovers"] for row in rows) and (probe is None or probe["stage"] == "CANCELED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
