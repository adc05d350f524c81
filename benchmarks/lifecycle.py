"""The lifecycle benchmark: start N environments at once, run an episode on each, stop them all.

For each concurrency level it measures, side by side in one run: scheduling and running->ready times,
total submit->stopped time, the provider's own overhead (from the emulator's first healthy moment to
the provider seeing it), Jobs API calls per environment, peak RSS and threads of this process, and
with --hold the memory per idle provider and per open session. Results go to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/lifecycle.py --local                       # the emulator, no token
    .venv/bin/python benchmarks/lifecycle.py --local --emulator-process --hold
    .venv/bin/python -m hf_sandbox_provider bench --local                  # the same, through the CLI

Lives outside the library on purpose (issue 11): a vendored hf_sandbox_provider.py carries none of it.
API calls are counted from outside the library: the in-process emulator's own per-route counters, or,
with the emulator in another process or on the Hub, a response hook on the provider's documented
`_new_session()` hook (every Jobs API answer this process receives, the job watcher's included).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import requests  # noqa: E402

import hf_sandbox_provider as hsp  # noqa: E402
from hf_sandbox_provider import (  # noqa: E402
    DEFAULT_FLAVOR, DEFAULT_POLL_INTERVAL_S, EXIT_FAILED, EXIT_OK, EXIT_USAGE, SMOKE_DEFAULT_ACTION,
    SMOKE_DEFAULT_IMAGE, SMOKE_REQUEST_TIMEOUT_S, HFSandboxProvider, SandboxConfigError, SandboxError, stop_all)


# Concurrency grid of `bench` (issue 5): doubling up to what one trainer commonly launches together.
BENCH_DEFAULT_GRID = (1, 2, 4, 8, 16, 32, 64)
# HF's CPU cold start is 4-6 s (the upstream PR's table: scheduling p50 4.0-5.0 s); the emulator
# waits this long in SCHEDULING so --local timings have the real shape.
BENCH_DEFAULT_SCHEDULING_DELAY_S = 5.0
# --local: each job waits up to one watcher interval more in SCHEDULING, drawn at random, so the moment it
# turns RUNNING falls anywhere in the watcher's cycle, as on the Hub. A fixed delay that is a multiple of the
# interval fixes that phase for every job of a run, and the provider's overhead reads ~0 or a whole interval.
BENCH_DEFAULT_SEED = 1
# Steps per episode after the reset: enough to exercise a session, short next to the lifecycle.
BENCH_DEFAULT_STEPS = 5
# RSS and thread count are sampled this often while a concurrency level runs (peak per level).
BENCH_SAMPLE_S = 0.05
# Budget for one concurrency level on top of the providers' own timeouts (joins never hang).
BENCH_LEVEL_TIMEOUT_S = 900.0
# --emulator-process: how long the child may take to print its endpoint, and to stop its jobs.
BENCH_EMULATOR_START_S = 30.0
BENCH_EMULATOR_STOP_S = 30.0


class _ApiAnswers:
    """Counts the Jobs API answers this process receives: a requests response hook, installed through
    the provider's documented `_new_session()` hook, so the library itself keeps no counter for us."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def hook(self, response: requests.Response, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            self.count += 1


_API_ANSWERS = _ApiAnswers()


class _CountedProvider(HFSandboxProvider):
    """A provider whose Jobs API sessions (its own and the job watcher's) report to `_API_ANSWERS`."""

    def _new_session(self) -> requests.Session:
        session = super()._new_session()
        session.hooks["response"].append(_API_ANSWERS.hook)
        return session


def _percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in 0..100) of `values`, or None when empty."""
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return None
    rank = max(1, int(-(-q * len(ordered) // 100)))  # ceil(q/100 * n)
    return ordered[min(rank, len(ordered)) - 1]


def _process_sample() -> Tuple[Optional[int], int]:
    """(resident set size in bytes or None, OS thread count) of this process."""
    rss, threads = None, threading.active_count()
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
    except OSError:  # not Linux: ru_maxrss (KiB on Linux, bytes on macOS) is the best we have
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss = peak if sys.platform == "darwin" else peak * 1024
    return rss, threads


class _Sampler:
    """Peak RSS and thread count of this process while a level runs (a background sampling thread)."""

    def __init__(self) -> None:
        self.peak_rss, self.peak_threads = _process_sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def __enter__(self) -> "_Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(BENCH_SAMPLE_S):
            rss, threads = _process_sample()
            self.peak_rss = max(self.peak_rss or 0, rss or 0) or None
            self.peak_threads = max(self.peak_threads, threads)


def _run_episode(base_url: str, steps: int, http: bool, action: Mapping[str, Any],
                 after_reset: Callable[[], None] = lambda: None) -> None:
    """reset + `steps` steps over one WebSocket session (or the legacy HTTP endpoints).

    `after_reset` runs with the session open (bench --hold measures memory there)."""
    if http:
        with requests.Session() as session:
            session.trust_env = False
            session.post(base_url + "/reset", json={}, timeout=SMOKE_REQUEST_TIMEOUT_S).raise_for_status()
            after_reset()
            for _ in range(steps):
                session.post(base_url + "/step", json={"action": dict(action)},
                             timeout=SMOKE_REQUEST_TIMEOUT_S).raise_for_status()
        return
    with hsp.EnvSession(base_url, timeout_s=SMOKE_REQUEST_TIMEOUT_S) as ws:
        answers = [ws.exchange({"type": "reset", "data": {}})]
        after_reset()
        answers += [ws.exchange({"type": "step", "data": dict(action)}) for _ in range(steps)]
    bad = [a for a in answers if a.get("type") != "observation"]
    if bad:
        raise SandboxError("episode: server answered %s" % json.dumps(bad[0])[:300])


class _BenchRun:
    """One environment of one concurrency level: its provider and what happened to it."""

    def __init__(self, provider: HFSandboxProvider) -> None:
        self.provider = provider
        self.error: Optional[str] = None
        self.total: Optional[float] = None
        self.episode: Optional[float] = None
        self.timings: Dict[str, float] = {}
        self.job_id: Optional[str] = None
        self.ready_mono: Optional[float] = None


class _Hold:
    """bench --hold: every environment pauses when ready, and again with its session open, so the
    main thread can sample this process's memory with all providers idle, then with all sessions open."""

    def __init__(self, parties: int) -> None:
        self.barriers = [threading.Barrier(parties + 1) for _ in range(4)]

    def meet(self, index: int) -> None:
        self.barriers[index].wait(BENCH_LEVEL_TIMEOUT_S)

    def abort(self) -> None:
        for barrier in self.barriers:
            barrier.abort()


def _bench_one(run: _BenchRun, args: argparse.Namespace, on_done: Callable[[_BenchRun], None],
               hold: Optional[_Hold] = None) -> None:
    provider = run.provider
    began = time.monotonic()

    def sessions_open() -> None:
        if hold is not None:
            hold.meet(2)  # every session open: the main thread samples
            hold.meet(3)

    try:
        provider.wait_for_ready(provider.start_container())
        run.ready_mono = time.monotonic()
        run.job_id = provider.job_id
        if hold is not None:
            hold.meet(0)  # every provider ready and idle: the main thread samples
            hold.meet(1)
        if args.steps >= 0 and not args.no_episode:
            episode_began = time.monotonic()
            _run_episode(provider.base_url or "", args.steps, args.http, SMOKE_DEFAULT_ACTION, sessions_open)
            run.episode = time.monotonic() - episode_began
    except Exception as exc:
        if hold is not None:
            hold.abort()  # the others must not wait for this one
        run.error = "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    finally:
        run.job_id = provider.job_id or run.job_id
        run.timings = dict(provider.timings)
        provider.stop_container()
        run.total = time.monotonic() - began
        on_done(run)


def _bench_level(concurrency: int, args: argparse.Namespace, settings: Mapping[str, Any], emulator: Any,
                 say: Callable[[str], None]) -> Dict[str, Any]:
    """Start `concurrency` providers at once from threads, each: ready, episode, stop; summarise."""
    runs = [_BenchRun(_CountedProvider(args.image, **_with_jitter(settings, args))) for _ in range(concurrency)]
    calls_before = dict(emulator.api_calls) if emulator is not None else {}
    answers_before = _API_ANSWERS.count
    finished: List[_BenchRun] = []
    lock = threading.Lock()
    began = time.monotonic()

    def on_done(run: _BenchRun) -> None:
        with lock:
            finished.append(run)
            count = len(finished)
        say("  c=%-4d %3d/%d %s %s%s" % (
            concurrency, count, concurrency, "ok  " if run.error is None else "FAIL", run.job_id or "-",
            "  ready %.2fs" % run.timings["ready"] if "ready" in run.timings else "  " + (run.error or "")))

    hold = _Hold(concurrency) if args.hold else None
    memory: Dict[str, Any] = {}
    threads = [threading.Thread(target=_bench_one, args=(run, args, on_done, hold), name="bench-env", daemon=True)
               for run in runs]
    baseline_rss, baseline_threads = _process_sample()
    with _Sampler() as sampler:
        try:
            for thread in threads:
                thread.start()
            if hold is not None:
                memory = _hold_samples(hold, concurrency, baseline_rss, baseline_threads, not args.no_episode)
            deadline = began + BENCH_LEVEL_TIMEOUT_S
            for thread in threads:
                while thread.is_alive() and time.monotonic() < deadline:
                    thread.join(min(0.5, max(0.0, deadline - time.monotonic())))  # Ctrl-C reaches us
        except BaseException:  # Ctrl-C: stop every environment of this level before leaving
            if hold is not None:
                hold.abort()
            stop_all(run.provider for run in runs)
            raise
    wall = time.monotonic() - began
    stuck = sum(thread.is_alive() for thread in threads)
    if stuck:
        stop_all(run.provider for run in runs)
    ok = [run for run in runs if run.error is None and run.total is not None]
    scheduling = [run.timings["running"] for run in ok if "running" in run.timings]
    to_ready = [run.timings["ready"] - run.timings["running"] for run in ok
                if "ready" in run.timings and "running" in run.timings]
    overhead: List[float] = []
    unrecorded = 0  # the provider's own /health came first, and the job ended before the emulator's probe
    if emulator is not None:
        for run in ok:
            job = emulator.job(run.job_id) if run.job_id else None
            if job is not None and job.first_health_ok_mono is not None and run.ready_mono is not None:
                overhead.append(run.ready_mono - job.first_health_ok_mono)
            else:
                unrecorded += 1
    if emulator is not None:
        after = emulator.api_calls
        calls = {route: after.get(route, 0) - calls_before.get(route, 0) for route in after}
        calls = {route: n for route, n in calls.items() if n}
    else:  # the Hub (or an emulator in another process): count this process's own calls
        calls = {"all": _API_ANSWERS.count - answers_before}
    total_calls = sum(calls.values())
    waiting_calls = calls.get("list", 0) + calls.get("inspect", 0) if emulator is not None else None

    def pair(values: Sequence[float]) -> List[Optional[float]]:
        return [_round(_percentile(values, 50)), _round(_percentile(values, 95))]

    return {
        "concurrency": concurrency, "success": len(ok), "failed": concurrency - len(ok),
        "errors": sorted({run.error for run in runs if run.error})[:5] + (["%d runs still alive" % stuck] if stuck else []),
        "wall_s": _round(wall),
        "scheduling_s": pair(scheduling), "running_to_ready_s": pair(to_ready),
        "total_s": pair([run.total for run in ok if run.total is not None]),
        "episode_s": pair([run.episode for run in ok if run.episode is not None]),
        "overhead_s": pair(overhead) if emulator is not None else None,
        "overhead_unrecorded": unrecorded,
        "throughput_env_per_min": _round(len(ok) / wall * 60.0) if wall > 0 else None,
        "api_calls": calls, "api_calls_per_env": _round(total_calls / concurrency),
        "waiting_calls": waiting_calls,
        "peak_rss_mib": _round((sampler.peak_rss or 0) / 2 ** 20), "peak_threads": sampler.peak_threads,
        "memory": memory or None,
    }


def _hold_samples(hold: _Hold, concurrency: int, baseline_rss: Optional[int], baseline_threads: int,
                  sessions: bool) -> Dict[str, Any]:
    """With --hold: this process's RSS and threads per idle provider and per open session."""
    result: Dict[str, Any] = {}
    try:
        hold.meet(0)
        gc_rss, gc_threads = _process_sample()
        result["rss_per_idle_provider_kib"] = _round(((gc_rss or 0) - (baseline_rss or 0)) / 1024 / concurrency, 1)
        result["threads_per_idle_provider"] = _round((gc_threads - baseline_threads) / concurrency)
        hold.meet(1)
        if sessions:
            hold.meet(2)
            rss, threads = _process_sample()
            result["rss_per_session_kib"] = _round(((rss or 0) - (gc_rss or 0)) / 1024 / concurrency, 1)
            result["threads_per_session"] = _round((threads - gc_threads) / concurrency)
            hold.meet(3)
    except threading.BrokenBarrierError:
        result["error"] = "an environment failed, so not all were held at once"
    return result


def _with_jitter(settings: Mapping[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """One environment's settings: with --local (unless --no-jitter) its job gets a random extra scheduling delay
    of up to one watcher interval (the emulator's per-job fault, an environment variable of the job)."""
    if not args.local or args.no_jitter:
        return dict(settings)
    extra = _JITTER.uniform(0.0, args.poll_interval_s)
    return dict(settings, env_vars={"HF_JOBS_EMULATOR_SCHEDULING_DELAY_S": "%.3f" % extra})


_JITTER = random.Random(BENCH_DEFAULT_SEED)  # reseeded by --seed


def _round(value: Optional[float], digits: int = 2) -> Optional[float]:
    return None if value is None else round(value, digits)


def _fmt_pair(values: Optional[Sequence[Optional[float]]], unrecorded: int = 0) -> str:
    shown = "n/a" if not values or values[0] is None else "%.2fs/%.2fs" % (values[0], values[1])
    return shown + (" (%d n/r)" % unrecorded if unrecorded else "")


def _bench_markdown(report: Mapping[str, Any]) -> str:
    """The results as a markdown table (the upstream PR's HF Jobs benchmark shape, plus ours)."""
    lines = [
        "| concurrency | success | wall | scheduling p50/p95 | running->ready p50/p95 | total p50/p95 "
        "| throughput | provider overhead p50/p95 | Jobs API calls/env | peak RSS | peak threads |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["rows"]:
        lines.append("| %d | %d/%d | %.1fs | %s | %s | %s | %.1f env/min | %s | %.2f | %.1f MiB | %d |" % (
            row["concurrency"], row["success"], row["concurrency"], row["wall_s"], _fmt_pair(row["scheduling_s"]),
            _fmt_pair(row["running_to_ready_s"]), _fmt_pair(row["total_s"]), row["throughput_env_per_min"] or 0,
            _fmt_pair(row["overhead_s"], row.get("overhead_unrecorded", 0)), row["api_calls_per_env"],
            row["peak_rss_mib"], row["peak_threads"]))
    held = [row for row in report["rows"] if row.get("memory")]
    if held:
        lines += ["", "| concurrency | RSS per idle provider | threads per idle provider | RSS per open session "
                      "| threads per open session |", "| --- | --- | --- | --- | --- |"]
        for row in held:
            memory = row["memory"]
            lines.append("| %d | %s KiB | %s | %s KiB | %s |" % (
                row["concurrency"], memory.get("rss_per_idle_provider_kib", "n/a"),
                memory.get("threads_per_idle_provider", "n/a"), memory.get("rss_per_session_kib", "n/a"),
                memory.get("threads_per_session", "n/a")))
    return "\n".join(lines)


def _bench_plot(report: Mapping[str, Any], path: str) -> Optional[str]:
    """Stage times against concurrency as a PNG; returns why it was skipped, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'hf-sandbox-provider[bench]'); no plot written"
    rows = [row for row in report["rows"] if row["success"]]
    if not rows:
        return "no successful level to plot"
    xs = [row["concurrency"] for row in rows]
    figure, axis = plt.subplots(figsize=(8, 5))
    series = (("scheduling_s", "scheduling"), ("running_to_ready_s", "running -> ready"),
              ("total_s", "total (submit -> stopped)"), ("overhead_s", "provider overhead"))
    for number, (key, label) in enumerate(series):
        for index, style in ((0, "-o"), (1, ":x")):  # one colour per measure: solid p50, dotted p95
            ys = [(row[key] or [None, None])[index] for row in rows]
            if any(y is not None for y in ys):
                axis.plot(xs, [y if y is not None else float("nan") for y in ys], style, color="C%d" % number,
                          label="%s %s" % (label, "p50" if index == 0 else "p95"))
    axis.set_xscale("log", base=2)
    axis.set_xticks(xs)
    axis.set_xticklabels([str(x) for x in xs])
    axis.set_xlabel("environments started together")
    axis.set_ylabel("seconds")
    axis.set_title("Environment lifecycle (%s)" % report["mode_description"])
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


class _EmulatorProcess:
    """The emulator in a child process (`hf_jobs_emulator serve --json`), so that this process's RSS
    and threads are the trainer side's alone. Its jobs' health times are not visible from here, so
    the provider overhead is then reported as n/a."""

    def __init__(self, module: Any, scheduling_delay_s: float) -> None:
        import tempfile

        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, module.__file__, "serve", "--json", "--scheduling-delay-s", str(scheduling_delay_s)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        try:
            line = self._first_line(BENCH_EMULATOR_START_S)
            info = json.loads(line)
            self.endpoint, self.token = str(info["endpoint"]), str(info["token"])
        except BaseException:
            self.stop()
            raise

    def _first_line(self, timeout_s: float) -> str:
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
            if not selector.select(timeout_s):
                raise SandboxError("the emulator process printed no endpoint within %gs" % timeout_s)
        return self.proc.stdout.readline()  # type: ignore[union-attr]

    def stop(self) -> List[str]:
        """Stop it like Ctrl-C would (it ends every job it runs); what it could not clean up."""
        problems: List[str] = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(BENCH_EMULATOR_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(BENCH_EMULATOR_STOP_S)
                problems.append("the emulator process had to be killed (its jobs may be left running)")
        self._stderr.seek(0)
        problems += [line.strip() for line in self._stderr if "could not clean up" in line]
        self._stderr.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return problems


def _grid_rejection(text: str) -> Optional[str]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        return "--concurrency %r must be a comma-separated list of positive integers, e.g. 1,2,4,8" % text
    return None


def _run_bench(args: argparse.Namespace) -> int:
    out = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    reason = (_grid_rejection(args.concurrency) or hsp._positive_number_rejection("--poll-interval-s", args.poll_interval_s)
              or (None if args.steps >= 0 else "--steps must be 0 or more"))
    if args.scheduling_delay_s < 0:
        reason = reason or "--scheduling-delay-s must be 0 or more"
    if reason:
        print("error: %s" % reason, file=sys.stderr)
        return EXIT_USAGE
    grid = [int(part) for part in args.concurrency.split(",") if part.strip()]
    emulator = None
    settings: Dict[str, Any] = dict(flavor=args.flavor, poll_interval_s=args.poll_interval_s)
    if args.timeout:
        settings.update(start_timeout_s=args.timeout, ready_timeout_s=args.timeout)
    emulator_process: Optional[_EmulatorProcess] = None
    if args.local:
        import hf_jobs_emulator as _emulator
        if args.emulator_process:
            try:
                emulator_process = _EmulatorProcess(_emulator, args.scheduling_delay_s)
            except (SandboxError, OSError, ValueError, KeyError) as exc:
                print("error: could not start the emulator process: %s" % exc, file=sys.stderr)
                return EXIT_FAILED
            endpoint, token = emulator_process.endpoint, emulator_process.token
        else:
            emulator = _emulator.JobsEmulator(scheduling_delay_s=args.scheduling_delay_s).start()
            endpoint, token = emulator.endpoint, emulator.token
        settings.update(endpoint=endpoint, token=token, command=args.command or _emulator.echo_server_command())
        args.image = args.image or SMOKE_DEFAULT_IMAGE
        description = "local emulator%s, scheduling delay %gs%s" % (
            " in its own process" if args.emulator_process else "", args.scheduling_delay_s,
            "" if args.no_jitter else " + 0-%gs at random (seed %d)" % (args.poll_interval_s, args.seed))
    else:
        token = hsp._discover_token()
        if not token:
            print("error: no Hugging Face token found: set HF_TOKEN or run `hf auth login` "
                  "(or use --local)", file=sys.stderr)
            return EXIT_USAGE
        settings.update(endpoint=hsp._resolve_endpoint(None), token=token)
        if args.command:
            settings.update(command=args.command)
        args.image = args.image or os.environ.get("HF_SANDBOX_IMAGE") or SMOKE_DEFAULT_IMAGE
        description = "HF Jobs, %s" % args.flavor
    try:
        _CountedProvider(args.image, **settings)  # bad settings fail here, before any job
    except SandboxConfigError as exc:
        print("error: %s" % exc, file=sys.stderr)
        if emulator is not None:
            emulator.stop()
        if emulator_process is not None:
            emulator_process.stop()
        return EXIT_USAGE
    report: Dict[str, Any] = {
        "mode": "local" if args.local else "hub", "mode_description": description, "image": args.image,
        "episode": "none" if args.no_episode else "reset + %d steps over %s" % (args.steps, "HTTP" if args.http else "WebSocket"),
        "poll_interval_s": args.poll_interval_s, "rows": [],
    }
    say("bench: %s; image %s; episode: %s; grid %s" % (description, args.image, report["episode"], grid))
    leftovers: List[str] = []
    try:
        for concurrency in grid:
            row = _bench_level(concurrency, args, settings, emulator, say)
            report["rows"].append(row)
            say("c=%d: %d/%d ok, wall %.1fs, overhead p50 %s, API calls/env %.2f, peak RSS %.0f MiB, "
                "peak threads %d" % (concurrency, row["success"], concurrency, row["wall_s"],
                                     _fmt_pair(row["overhead_s"], row["overhead_unrecorded"]),
                                     row["api_calls_per_env"], row["peak_rss_mib"],
                                     row["peak_threads"]))
            if row["memory"]:
                say("c=%d held: %s" % (concurrency, ", ".join("%s %s" % kv for kv in row["memory"].items())))
            for error in row["errors"]:
                say("    error: %s" % error)
    except KeyboardInterrupt:
        say("bench: interrupted")
    finally:
        if emulator is not None:
            leftovers = emulator.stop()
            leftovers += ["job process %d" % pid for pid in emulator.live_pids()]
        if emulator_process is not None:
            leftovers = emulator_process.stop()
    report["leftovers"] = leftovers
    markdown = _bench_markdown(report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        say("\n" + markdown)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(markdown + "\n")
        say("table written to %s" % args.out)
    if args.plot:
        skipped = _bench_plot(report, args.plot)
        say("plot: %s" % (skipped or "written to %s" % args.plot))
    if leftovers:
        say("error: left behind: %s" % ", ".join(leftovers))
    complete = len(report["rows"]) == len(grid)
    return EXIT_OK if complete and not leftovers and all(not r["failed"] for r in report["rows"]) else EXIT_FAILED


def _parser() -> argparse.ArgumentParser:
    bench = argparse.ArgumentParser(prog="python benchmarks/lifecycle.py",
                                    description="Lifecycle benchmark: start N environments at once, episode, stop.")
    bench.add_argument("--local", action="store_true", help="use the local HF Jobs emulator (no token, no network)")
    bench.add_argument("--concurrency", default=",".join(str(c) for c in BENCH_DEFAULT_GRID),
                       help="comma-separated environments started together per level (default %(default)s)")
    bench.add_argument("--steps", type=int, default=BENCH_DEFAULT_STEPS, help="steps per episode (default %(default)s)")
    bench.add_argument("--http", action="store_true", help="run the episode over HTTP /reset + /step, not /ws")
    bench.add_argument("--no-episode", action="store_true", help="only start, wait ready and stop")
    bench.add_argument("--scheduling-delay-s", type=float, default=BENCH_DEFAULT_SCHEDULING_DELAY_S,
                       help="--local: seconds each job stays SCHEDULING (default %(default)s, HF's cold start)")
    bench.add_argument("--emulator-process", action="store_true",
                       help="--local: run the emulator in its own process, so RSS and threads are the trainer "
                            "side's alone (the provider overhead is then n/a)")
    bench.add_argument("--hold", action="store_true",
                       help="hold every environment when ready and with its session open, to measure RSS and "
                            "threads per idle provider and per open session")
    bench.add_argument("--no-jitter", action="store_true",
                       help="--local: every job waits exactly --scheduling-delay-s (by default each waits up to one "
                            "--poll-interval-s more, at random, so its RUNNING moment falls anywhere in the "
                            "watcher's cycle, as on the Hub)")
    bench.add_argument("--seed", type=int, default=BENCH_DEFAULT_SEED,
                       help="seed of those random delays (default %(default)s)")
    bench.add_argument("--poll-interval-s", type=float, default=DEFAULT_POLL_INTERVAL_S,
                       help="job watcher interval (default %(default)s)")
    bench.add_argument("--image", help="image to run (default: $HF_SANDBOX_IMAGE or %s)" % SMOKE_DEFAULT_IMAGE)
    bench.add_argument("--command", help="server command in the job")
    bench.add_argument("--flavor", default=DEFAULT_FLAVOR, help="hardware flavor (default %(default)s)")
    bench.add_argument("--timeout", type=float, help="seconds allowed for each start and for readiness")
    bench.add_argument("--json", action="store_true", help="print the JSON report on stdout (progress on stderr)")
    bench.add_argument("--out", help="also write the markdown table to this file")
    bench.add_argument("--plot", help="write a PNG of stage times against concurrency (needs matplotlib)")
    bench.add_argument("-v", "--verbose", action="count", default=0)
    return bench


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """Run the benchmark; returns the exit status (`python -m hf_sandbox_provider bench` calls this too)."""
    parser = _parser()
    if prog:
        parser.prog = prog
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    else:  # every readiness probe before the server listens is a 502 the proxy warns about
        logging.getLogger("proxy").setLevel(logging.ERROR)
    _JITTER.seed(args.seed)
    return _run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
