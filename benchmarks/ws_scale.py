"""WebSocket sessions at scale: direct to an environment server versus through one AuthProxy.

The method of OpenEnv's scaling tutorial, run twice side by side in one invocation. For each batch
size, N OpenEnv WebSocket sessions are opened at once; each connects, sends `reset`, K `step`s (the
server waits a fixed time per step) and `close`. The same batch runs first straight against the
upstream, then through one `proxy.AuthProxy`, and we report success rate, connect/reset/step p50,
total p99, sessions per second, the largest batch at 100% and at >= 95% success, the proxy
process's resident memory and thread count at peak, and the per-session increments.

Every party runs in its own process so none starves another and the proxy can be measured from
/proc: the load generator (benchmarks/_loadgen.py, one non-blocking selectors loop), the upstream
(benchmarks/_ws_upstream.py, or the emulator's echo server with --upstream echo) and the proxy
(benchmarks/_proxy_host.py). Everything is on loopback, every wait is bounded, and the run stops by
itself. Results go to the `## WebSocket sessions at scale` section of benchmarks/RESULTS.md (other
sections untouched) and a PNG plot when matplotlib is installed (the optional `bench` extra).

    python benchmarks/ws_scale.py                 # full grid, 3 reps: about 5-10 minutes on 2 cores
    python benchmarks/ws_scale.py --quick         # a short run: small batches, short step
    python benchmarks/ws_scale.py --label lockstep --lockstep --steps 5 --batches 512,2048,4096
                                                  # trainer-style batched steps, own section

Diagnostics: `--modes direct` checks an upstream alone, `--upstream echo` uses the emulator's echo
server, `--profile-proxy FILE` writes a per-thread CPU profile of the proxy (numbers not published).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any, Dict, IO, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _loadgen import raise_nofile_limit  # noqa: E402  (needs HERE on sys.path)
from _results import replace_marked_section  # noqa: E402

# The tutorial's grid up to 8192, plus 1024 to locate a break between 512 and 2048; larger batches
# run only while the previous one held (see SUCCESS_FLOOR).
DEFAULT_BATCHES = (32, 128, 512, 1024, 2048, 4096, 8192)
QUICK_BATCHES = (32, 128, 512)
# The tutorial's latency breakdown uses a 1.0 s step; --quick shortens it to keep the run brief.
DEFAULT_STEP_DELAY_S = 1.0
QUICK_STEP_DELAY_S = 0.2
DEFAULT_STEPS = 1
# The tutorial repeats each configuration 3 times and requires >= 95% success in every repetition.
DEFAULT_REPS = 3
QUICK_REPS = 1
# The tutorial's "max batch" is the largest batch with >= 95% success; a mode that falls below it
# is not run at larger batches (it would only fail harder and cost minutes).
SUCCESS_FLOOR = 0.95
# How often the proxy's /proc/<pid>/status is sampled during a batch to catch its peak.
SAMPLE_INTERVAL_S = 0.02
# After a batch the proxy's threads must drain back to the idle count; wait at most this long (a
# tunnel's teardown and a parked worker's PROXY_WORKER_IDLE_S take well under a second when quiet: 20 s
# leaves room for a machine loaded by others).
SETTLE_TIMEOUT_S = 20.0
# When they did not drain, the proxy host names its threads (SIGUSR1, one stdout line): wait this long.
THREAD_DUMP_TIMEOUT_S = 10.0
# Innermost frames of each leftover thread's stack kept in the row and report: where it is stuck.
THREAD_DUMP_FRAMES = 4
# Quiet time between runs so one run's teardown does not overlap the next one's connects.
PAUSE_BETWEEN_RUNS_S = 1.0
# Generator deadline per batch = this + (steps + 1) x step delay x 3: a run that cannot finish in
# that time has failed, and unfinished sessions are counted as timeouts. 60 s outlasts the kernel's
# SYN retries (1+2+4+8+16 s) when a listen queue overflows, so those show as slow, not as lost.
RUN_DEADLINE_BASE_S = 60.0
# Before each run, wait (at most QUIET_WAIT_S) until the rest of the machine uses less than
# QUIET_CORES of CPU, measured over QUIET_SAMPLE_S: on a shared 2-core box a neighbour's test suite
# would otherwise end up in the numbers. Runs that start noisy say so in the table.
QUIET_CORES = 0.3
QUIET_SAMPLE_S = 0.5
QUIET_WAIT_S = 15.0
# A repetition during which other processes used more than NOISY_CORES on average is redone, at
# most NOISY_RETRIES times (then kept, and counted as noisy in the report).
NOISY_CORES = 0.5
NOISY_RETRIES = 2
# Time allowed for a helper process (upstream, proxy, generator) to start and say it is ready.
CHILD_START_TIMEOUT_S = 30.0
# File descriptors a process needs besides one per socket (stdio, selector, imports, listener).
FD_HEADROOM = 64
# Threads the proxy may need per tunnelled session (today two: the handler pumps one direction, a
# second thread the other; 3 leaves headroom). Used only to skip a batch the machine's pid/thread
# limits cannot hold, instead of crashing it.
PROXY_THREADS_PER_SESSION_BOUND = 3
# The proxy's parked worker threads end after this long idle (the library default is 60 s), so that
# `threads after` can still prove no thread leaked: it waits for the count to fall back to idle. Each
# batch therefore starts with a cold pool (benchmarks/vs_nginx.py measures the warm case).
PROXY_WORKER_IDLE_S = 0.5
DEFAULT_RESULTS = os.path.join(HERE, "RESULTS.md")
DEFAULT_PLOT = os.path.join(HERE, "ws_scale.png")
SECTION_TITLE = "## WebSocket sessions at scale"
# The target: this many sessions through one proxy, 100% success, p99 within 1.5x direct.
TARGET_BATCH = 2048
TARGET_P99_RATIO = 1.5
MODES = ("direct", "proxy")
# Upstreams: "mini" is benchmarks/_ws_upstream.py (one selectors loop, a timer per step); "echo" is
# the emulator's echo server (a thread per session sleeping through each step).
UPSTREAMS = ("mini", "echo")


def run_benchmark(batches: Sequence[int], steps: int = DEFAULT_STEPS,
                  step_delay_s: float = DEFAULT_STEP_DELAY_S, upstream: str = "mini",
                  generators: int = 1, modes: Sequence[str] = MODES, reps: int = 1,
                  progress: Optional[IO[str]] = None,
                  profile_proxy: Optional[str] = None,
                  quiet_wait_s: float = QUIET_WAIT_S,
                  lockstep: bool = False, noisy_retries: int = NOISY_RETRIES) -> Dict[str, Any]:
    """Run every batch size in each mode and return the raw summary (see `summarize_run`)."""
    nofile = raise_nofile_limit()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    up_proc, up_port, up_pid = _start_upstream(upstream, step_delay_s, env)
    proxy_proc, proxy_pid = None, None
    try:
        targets = {"direct": (up_port, "/ws")}
        if "proxy" in modes:
            proxy_proc, base_url, proxy_pid = _start_proxy("http://127.0.0.1:%d" % up_port, env,
                                                           profile_proxy)
            host_port, route_path = base_url.split("://", 1)[1].split("/", 1)
            targets["proxy"] = (int(host_port.rsplit(":", 1)[1]), "/%s/ws" % route_path)
        # The host prints its ready line once every thread of the idle proxy has started.
        proxy_idle = _proc_status(proxy_pid)
        rows: List[Dict[str, Any]] = []
        stopped: Dict[str, str] = {}
        for n in batches:
            for mode in modes:
                if mode in stopped:
                    continue
                skip = _batch_rejection(n, mode, nofile, generators)
                if skip is not None:
                    stopped[mode] = "%d: %s" % (n, skip)
                    _say(progress, "%-6s N=%-5d skipped: %s" % (mode, n, skip))
                    continue
                row = _run_one(mode, n, targets[mode], steps, step_delay_s, generators,
                               proxy_proc, up_pid, env, reps, quiet_wait_s, lockstep,
                               noisy_retries)
                rows.append(row)
                _say(progress, _progress_line(row))
                if row["success_min"] < SUCCESS_FLOOR:
                    stopped[mode] = "%d: success %.1f%% < %.0f%%" % (
                        n, 100 * row["success_min"], 100 * SUCCESS_FLOOR)
                time.sleep(PAUSE_BETWEEN_RUNS_S)
        return summarize_run(rows, {
            "batches": list(batches), "steps": steps, "step_delay_s": step_delay_s,
            "upstream": upstream, "generators": generators, "stopped": stopped,
            "modes": list(modes), "reps": reps, "quiet_wait_s": quiet_wait_s,
            "lockstep": lockstep, "noisy_retries": noisy_retries,
            "proxy_idle": proxy_idle, "nofile": nofile})
    finally:
        for name, proc in (("proxy", proxy_proc), ("upstream", up_proc)):
            leftover = _stop_child(proc, terminate_first=(name == "upstream" and upstream == "echo"))
            if leftover:
                _say(progress, "warning: %s process %s" % (name, leftover))


def summarize_run(rows: List[Dict[str, Any]], config: Dict[str, Any]) -> Dict[str, Any]:
    """Add the per-mode verdicts (largest batch at 100% / >= 95%) and proxy/direct p99 ratios."""
    verdict: Dict[str, Dict[str, Optional[int]]] = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        verdict[mode] = {
            "max_batch_100": max((r["n"] for r in mine if r["success_min"] >= 1.0),
                                 default=None),
            "max_batch_95": max((r["n"] for r in mine if r["success_min"] >= SUCCESS_FLOOR),
                                default=None),
        }
    direct = {r["n"]: r for r in rows if r["mode"] == "direct"}
    for r in rows:
        d = direct.get(r["n"])
        if r["mode"] == "proxy" and d and d["total_p99"] and r["total_p99"]:
            r["p99_ratio"] = r["total_p99"] / d["total_p99"]
    return {"config": config, "rows": rows, "verdict": verdict, "machine": machine_info()}


def render_markdown(result: Dict[str, Any], command: str, title: str = SECTION_TITLE) -> str:
    """The RESULTS.md section: command, machine, method, one table per mode, proxy costs, checks."""
    cfg, rows, verdict = result["config"], result["rows"], result["verdict"]
    m = result["machine"]
    out = [title, "",
           "Command: `%s`  " % command,
           "Machine: %s, %d cores, %s RAM, %s, Python %s. proxy.py at %s. Run finished %s." % (
               m["cpu"], m["cores"], m["mem"], m["kernel"], m["python"],
               m.get("proxy_version", "?"), m["when"]),
           "",
           "Method (OpenEnv scaling tutorial): N WebSocket sessions opened at once, each `connect` "
           "(TCP + upgrade) -> `reset` -> %d x `step` (server waits %.2f s per step) -> `close`%s, "
           "%d repetition(s) per batch and mode, sessions pooled; `worst rep` is the lowest "
           "success of one repetition, which the largest-batch verdicts use. "
           "Each batch runs straight against the upstream (`direct`), then through one "
           "`AuthProxy` in its own process (`proxy`). Upstream: %s. Load generator: %d process(es), "
           "one non-blocking selectors+wsproto loop each. Total = connect to close done. "
           "Percentiles are nearest-rank over successful sessions. sessions/s = successful "
           "sessions / batch wall time (the tutorial's RPS, one request = one whole session)." % (
               cfg["steps"], cfg["step_delay_s"],
               " (lockstep: every step waits until all sessions have their previous reply, then "
               "all send at once, as a trainer's batched `env.step` does)" if cfg["lockstep"] else "",
               cfg["reps"], _upstream_label(cfg["upstream"]),
               cfg["generators"]),
           ""]
    for mode in cfg["modes"]:
        out += ["### %s" % mode, "",
                "| batch | success | worst rep | connect p50 | reset p50 | step p50 | total p50 "
                "| total p99 | sessions/s | connects/s | failures |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in (r for r in rows if r["mode"] == mode):
            out.append("| %d | %s | %s | %s | %s | %s | %s | %s | %.0f | %s | %s |" % (
                r["n"], _pct(r["success"]), _pct(r["success_min"]), _s(r["connect_p50"]),
                _s(r["reset_p50"]),
                _s(r["step_p50"]), _s(r["total_p50"]), _s(r["total_p99"]),
                r["sessions_per_s"], _num(r["connects_per_s"], "%.0f"), _errors(r["errors"])))
        v = verdict[mode]
        out += ["", "Largest batch at 100%% success: **%s**; at >= 95%%: **%s**." % (
            v["max_batch_100"] or "none", v["max_batch_95"] or "none")]
        if mode in cfg["stopped"]:
            out.append("Larger batches not run after N=%s." % cfg["stopped"][mode])
        out.append("")
    idle = cfg["proxy_idle"]
    out += ["### proxy cost and bottleneck checks", "",
            "Proxy idle: %.1f MiB RSS, %d threads. Peak values sampled every %d ms from "
            "/proc/<pid>/status during the proxy run; increments are (peak - before) / N and, "
            "more telling, / the peak number of sessions open at once (`open`: 101 received, "
            "close not yet done; below N when set-up is slower than the step). "
            "`threads after` is the proxy's count once the batch ended (should return to idle). "
            "CPU columns: CPU seconds each process used during the run / run wall time "
            "(100%% = one core; the machine has %d); `other processes` is everything else "
            "the machine ran meanwhile (from /proc/stat), i.e. how noisy the run was." % (
                idle["rss_kib"] / 1024.0, idle["threads"], int(SAMPLE_INTERVAL_S * 1000),
                m["cores"]),
            "",
            "| batch | p99 proxy/direct | open at peak | proxy RSS peak | RSS / N, / open "
            "| proxy threads peak | threads / N, / open | threads after | proxy CPU (kernel) "
            "| upstream CPU (direct/proxy) | generator CPU (direct/proxy) "
            "| other processes' CPU (direct/proxy) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    direct = {r["n"]: r for r in rows if r["mode"] == "direct"}
    for r in (r for r in rows if r["mode"] == "proxy"):
        d = direct.get(r["n"], {})
        out.append("| %d | %s | %d | %.1f MiB | %.1f / %s KiB | %d | %.2f / %s | %s | %s "
                   "| %s / %s | %s / %s | %s / %s |" % (
            r["n"], "%.2fx" % r["p99_ratio"] if r.get("p99_ratio") else "n/a", r["peak_open"],
            r["proxy_rss_peak_kib"] / 1024.0, r["rss_kib_per_session"],
            _num(r["rss_kib_per_open"], "%.1f"), r["proxy_threads_peak"],
            r["threads_per_session"], _num(r["threads_per_open"], "%.2f"),
            r["proxy_threads_after"], "%s (%s)" % (_pct(r["proxy_cpu"]),
                                                   _pct(r["proxy_cpu_kernel"])),
            _pct(d.get("upstream_cpu")), _pct(r["upstream_cpu"]),
            _pct(d.get("generator_cpu")), _pct(r["generator_cpu"]),
            _pct(d.get("other_cpu")), _pct(r["other_cpu"])))
    for r in (r for r in rows if r.get("proxy_threads_left")):
        out += ["", "Proxy threads still alive %.0f s after the N=%d batch (name: innermost frames): %s." % (
            SETTLE_TIMEOUT_S, r["n"], "; ".join("`%s`" % t for t in r["proxy_threads_left"]))]
    noisy = sum(r["noisy_starts"] for r in rows)
    out += ["", "The machine is shared: each run waited up to %.0f s for the rest of it to drop "
            "below %.0f%% of one core (%d runs started without that quiet), and a run during which "
            "other processes used more than %.0f%% of a core was redone, up to %d times "
            "(%d runs discarded)." % (
                cfg["quiet_wait_s"], 100 * QUIET_CORES, noisy, 100 * NOISY_CORES,
                cfg["noisy_retries"],
                sum(r["discarded_noisy"] for r in rows))]
    out += [""] + _bottleneck_lines(result)
    out += ["", "### against the targets", ""] + _target_lines(result) + [""]
    return "\n".join(out)


def section_markers(title: str = SECTION_TITLE) -> Tuple[str, str]:
    """The HTML comments around the section titled `title` in RESULTS.md: `ws_scale` for the main run,
    `ws_scale:<label>` for a labelled variant (`SECTION_TITLE (label)`), so each is rewritten alone."""
    label = title[len(SECTION_TITLE):].strip(" ()") if title.startswith(SECTION_TITLE) else title
    name = "ws_scale" + (":" + re.sub(r"[^A-Za-z0-9_.-]+", "-", label) if label else "")
    return "<!-- %s:start -->" % name, "<!-- %s:end -->" % name


def write_results_section(path: str, section: str, title: str = SECTION_TITLE) -> None:
    """Replace our marked section of RESULTS.md (see `section_markers`) or append it; the rest of the
    file is left as it is."""
    start, end = section_markers(title)
    replace_marked_section(path, start, end, "%s\n%s\n%s\n" % (start, section.rstrip("\n"), end))


def plot(result: Dict[str, Any], path: str) -> Optional[str]:
    """Success rate and total p99 against batch size for both modes; None, or why it was skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in zip(MODES, ("o", "s")):
        mine = [r for r in result["rows"] if r["mode"] == mode]
        ns = [r["n"] for r in mine]
        ax1.plot(ns, [100 * r["success"] for r in mine], marker=marker, label=mode)
        ok = [r for r in mine if r["total_p99"] is not None]
        ax2.plot([r["n"] for r in ok], [r["total_p99"] for r in ok], marker=marker, label=mode)
    cfg = result["config"]
    for ax, title, ylabel in ((ax1, "success rate", "% sessions"),
                              (ax2, "total p99 (connect to close)", "seconds")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent WebSocket sessions")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ns = sorted({r["n"] for r in result["rows"]})
    for ax in (ax1, ax2):
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns], rotation=45)
        ax.minorticks_off()
    ax1.set_ylim(0, 105)
    ax2.set_ylim(bottom=0)
    fig.suptitle("ws_scale: %d x %.2f s step%s, direct vs one AuthProxy, %d cores" % (
        cfg["steps"], cfg["step_delay_s"], " (lockstep)" if cfg.get("lockstep") else "",
        result["machine"]["cores"]))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# -- one run ------------------------------------------------------------------------------------

def _run_one(mode: str, n: int, target: Tuple[int, str], steps: int, step_delay_s: float,
             generators: int, proxy_proc: Optional[subprocess.Popen], up_pid: int, env: Dict[str, str],
             reps: int = 1, quiet_wait_s: float = QUIET_WAIT_S,
             lockstep: bool = False, noisy_retries: int = NOISY_RETRIES) -> Dict[str, Any]:
    """Run one batch size in one mode `reps` times, sampling the proxy and timing each process's
    CPU use; sessions of all repetitions are pooled, peaks are the worst repetition's. A
    repetition during which other processes kept the machine busy is discarded and redone (at
    most `noisy_retries` times per repetition; the last attempt is kept whatever happened)."""
    deadline = RUN_DEADLINE_BASE_S + (steps + 1) * step_delay_s * 3
    runs: List[Dict[str, Any]] = []
    noisy_starts = discarded = 0
    for rep in range(reps):
        for attempt in range(noisy_retries + 1):
            if rep or attempt:
                time.sleep(PAUSE_BETWEEN_RUNS_S)
            noisy_starts += 0 if _wait_for_quiet(quiet_wait_s) else 1
            run = _measure_once(mode, target, n, steps, deadline, generators, proxy_proc, up_pid,
                                env, lockstep)
            if run["other_cpu"] / run["wall"] <= NOISY_CORES or attempt == noisy_retries:
                break
            discarded += 1
        runs.append(run)
    sessions = [s for run in runs for s in run["sessions"]]
    wall = sum(run["wall"] for run in runs)
    run_wall = sum(run["run_wall"] for run in runs)
    gen_cpu = sum(run["gen_cpu"] for run in runs)
    up_cpu = sum(run["up_cpu"] for run in runs)
    proxy_cpu = sum(run["proxy_cpu"] for run in runs)
    proxy_sys = sum(run["proxy_sys"] for run in runs)
    other_cpu = sum(run["other_cpu"] for run in runs)
    before = {k: min(run["before"][k] for run in runs) for k in ("rss_kib", "threads")}
    peak = {k: max(run["peak"][k] for run in runs) for k in ("rss_kib", "threads")}
    after_threads = max(run["after_threads"] for run in runs)
    threads_left = next((run["threads_left"] for run in runs if run["threads_left"]), [])
    rep_success = [run["success"] for run in runs]
    connected = sum(run["connected"] for run in runs)
    connect_s = sum(run["connect_s"] for run in runs)
    row = summarize_sessions(sessions)  # reps are disjoint in time, so peak_open is the max rep's
    grown_rss = max(0, peak["rss_kib"] - before["rss_kib"])
    grown_threads = max(0, peak["threads"] - before["threads"])
    row.update({
        "mode": mode, "n": n, "reps": reps,
        "success_min": min(rep_success),
        "connects_per_s": connected / connect_s if connect_s > 0 else None,
        "wall_s": run_wall,
        "sessions_per_s": row["ok"] / run_wall if run_wall > 0 else 0.0,
        "generator_cpu": gen_cpu / run_wall if run_wall > 0 else None,
        "upstream_cpu": up_cpu / wall,
        "proxy_cpu": proxy_cpu / wall,
        "proxy_cpu_kernel": proxy_sys / wall,
        "other_cpu": other_cpu / wall,
        "noisy_starts": noisy_starts,
        "discarded_noisy": discarded,
        "proxy_rss_before_kib": before["rss_kib"],
        "proxy_rss_peak_kib": peak["rss_kib"],
        "proxy_threads_before": before["threads"],
        "proxy_threads_peak": peak["threads"],
        "proxy_threads_after": after_threads,
        "proxy_threads_left": threads_left,
        "rss_kib_per_session": grown_rss / n,
        "threads_per_session": grown_threads / n,
        "rss_kib_per_open": grown_rss / row["peak_open"] if row["peak_open"] else None,
        "threads_per_open": grown_threads / row["peak_open"] if row["peak_open"] else None,
    })
    return row


def _measure_once(mode: str, target: Tuple[int, str], n: int, steps: int, deadline: float,
                  generators: int, proxy_proc: Optional[subprocess.Popen], up_pid: int,
                  env: Dict[str, str], lockstep: bool) -> Dict[str, Any]:
    """One repetition: run the generators, sample the proxy, account every process's CPU."""
    port, path = target
    proxy_pid = proxy_proc.pid if proxy_proc is not None else None
    before = _proc_status(proxy_pid)
    cpu0 = (_cpu_seconds(proxy_pid), _cpu_seconds(proxy_pid, kernel_only=True),
            _cpu_seconds(up_pid), _machine_busy_seconds())
    sampler = _PeakSampler(proxy_pid)
    sampler.start()
    t0 = time.monotonic()
    try:
        outputs = _run_generators(port, path, n, steps, deadline, generators, env, lockstep)
    finally:
        sampler.stop()
    wall = time.monotonic() - t0
    proxy_cpu = _cpu_seconds(proxy_pid) - cpu0[0]
    proxy_sys = _cpu_seconds(proxy_pid, kernel_only=True) - cpu0[1]  # before settling, like the rest
    up_cpu = _cpu_seconds(up_pid) - cpu0[2]
    gen_cpu = sum(out["cpu_s"] for out in outputs)
    busy = _machine_busy_seconds() - cpu0[3]
    settled = _settle(proxy_proc, before["threads"]) if mode == "proxy" else _proc_status(proxy_pid)
    sessions = [s for out in outputs for s in out["sessions"]]
    connected, connect_s = connect_span(sessions)
    return {
        "sessions": sessions, "wall": wall,
        "run_wall": (max(out["t0"] + out["wall_s"] for out in outputs)
                     - min(out["t0"] for out in outputs)),
        "gen_cpu": gen_cpu, "up_cpu": up_cpu, "proxy_cpu": proxy_cpu,
        "proxy_sys": proxy_sys,
        "other_cpu": max(0.0, busy - proxy_cpu - up_cpu - gen_cpu),
        "before": before, "peak": {"rss_kib": sampler.peak_rss_kib,
                                   "threads": sampler.peak_threads},
        "after_threads": settled["threads"],
        "threads_left": settled.get("left", []),
        "success": sum(1 for s in sessions if s["ok"]) / float(len(sessions)),
        "connected": connected, "connect_s": connect_s,
    }


def summarize_sessions(sessions: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Success rate, phase percentiles over successful sessions, and failure kinds by count."""
    ok = [s for s in sessions if s["ok"]]
    steps = [t for s in ok for t in s["steps"]]
    totals = [s["total"] for s in ok]
    return {
        "sessions": len(sessions), "ok": len(ok),
        "success": len(ok) / len(sessions) if sessions else 0.0,
        "connect_p50": percentile([s["connect"] for s in ok], 50),
        "reset_p50": percentile([s["reset"] for s in ok], 50),
        "step_p50": percentile(steps, 50),
        "total_p50": percentile(totals, 50),
        "total_p99": percentile(totals, 99),
        "total_max": max(totals) if totals else None,
        "peak_open": peak_open_sessions(sessions),
        "errors": dict(Counter(s["error"] for s in sessions if not s["ok"]).most_common()),
    }


def peak_open_sessions(sessions: List[Dict[str, Any]]) -> int:
    """Most sessions open at one moment, counting a session from its 101 to its close. With a slow
    server not all N overlap, so this (not N) is what the proxy's threads and memory scale with."""
    edges = []
    for s in sessions:
        if s["connect"] is not None and s["total"] is not None:
            edges.append((s["start"] + s["connect"], 1))
            edges.append((s["start"] + s["total"], -1))
    edges.sort(key=lambda e: (e[0], e[1]))  # a close at the same instant counts before an open
    open_now = peak = 0
    for _, delta in edges:
        open_now += delta
        peak = max(peak, open_now)
    return peak


def connect_span(sessions: List[Dict[str, Any]]) -> Tuple[int, float]:
    """(upgrades completed, seconds from the first session's start to the last 101) for one run:
    their ratio is the set-up capacity of whatever accepts the connections (server or proxy)."""
    done = [s for s in sessions if s["connect"] is not None]
    if not done:
        return 0, 0.0
    return len(done), (max(s["start"] + s["connect"] for s in done)
                       - min(s["start"] for s in done))


def percentile(values: Sequence[float], p: float) -> Optional[float]:
    """Nearest-rank percentile (a value that was actually observed); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, int(math.ceil(p / 100.0 * len(ordered))))
    return ordered[rank - 1]


def _run_generators(port: int, path: str, n: int, steps: int, deadline_s: float,
                    generators: int, env: Dict[str, str],
                    lockstep: bool = False) -> List[Dict[str, Any]]:
    """Start the generator processes, let them all load, say go at once, collect their JSON."""
    shares = [n // generators + (1 if i < n % generators else 0) for i in range(generators)]
    procs = []
    try:
        for share in (s for s in shares if s > 0):
            cmd = [sys.executable, os.path.join(HERE, "_loadgen.py"), "--port", str(port),
                   "--path", path, "--sessions", str(share), "--steps", str(steps),
                   "--deadline-s", str(deadline_s), "--wait-go"] + (
                       ["--lockstep"] if lockstep else [])
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)
            procs.append(proc)
            line = _read_line(proc, CHILD_START_TIMEOUT_S)
            if line.strip() != "ready":
                raise RuntimeError("load generator did not start: %s%s" % (
                    line.strip(), _stderr_tail(proc)))
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = []
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=deadline_s + CHILD_START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError("load generator overran its own %.0f s deadline" % deadline_s)
            if proc.returncode != 0:
                raise RuntimeError("load generator failed (exit %s): %s" % (
                    proc.returncode, err.strip()[-500:]))
            outputs.append(json.loads(out))
        return outputs
    finally:
        for proc in procs:
            _stop_child(proc)


# -- helper processes ---------------------------------------------------------------------------

def _start_upstream(kind: str, step_delay_s: float,
                    env: Dict[str, str]) -> Tuple[subprocess.Popen, int, int]:
    """Start the upstream environment server; return (process, port, pid to measure)."""
    if kind not in UPSTREAMS:
        raise ValueError("unknown upstream %r: use one of %s" % (kind, ", ".join(UPSTREAMS)))
    if kind == "mini":
        cmd = [sys.executable, os.path.join(HERE, "_ws_upstream.py"), "--port", "0",
               "--step-delay-s", str(step_delay_s)]
    else:
        cmd = [sys.executable, "-m", "hf_jobs_emulator", "echo-server", "--port", "0",
               "--step-delay-s", str(step_delay_s)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = _read_line(proc, CHILD_START_TIMEOUT_S)
    port = _upstream_port(kind, line)
    if port is None:
        _stop_child(proc)
        raise RuntimeError("upstream %r did not start: %r%s" % (kind, line, _stderr_tail(proc)))
    return proc, port, proc.pid


def _upstream_port(kind: str, line: str) -> Optional[int]:
    """The port from an upstream's first stdout line: JSON for mini, a URL for the echo server."""
    if kind == "mini":
        try:
            return int(json.loads(line)["port"])
        except (ValueError, KeyError, TypeError):
            return None
    match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    return int(match.group(1)) if match else None


def _start_proxy(upstream_url: str, env: Dict[str, str],
                 profile: Optional[str] = None) -> Tuple[subprocess.Popen, str, int]:
    """Start benchmarks/_proxy_host.py; return (process, base_url, pid)."""
    cmd = [sys.executable, os.path.join(HERE, "_proxy_host.py"), upstream_url,
           "--worker-idle-s", str(PROXY_WORKER_IDLE_S)]
    if profile:
        cmd += ["--profile", profile]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    line = _read_line(proc, CHILD_START_TIMEOUT_S)
    try:
        info = json.loads(line)
        return proc, str(info["base_url"]), int(info["pid"])
    except (ValueError, KeyError, TypeError):
        _stop_child(proc)
        raise RuntimeError("proxy did not start: %r%s" % (line, _stderr_tail(proc)))


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """One stdout line from a child, or '' after `timeout_s` (readline itself cannot time out)."""
    box: List[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0] if box else ""


def _stop_child(proc: Optional[subprocess.Popen], terminate_first: bool = False) -> Optional[str]:
    """Close the child's stdin (our children's stop signal), then SIGTERM, then SIGKILL; return
    what could not be stopped instead of raising. `terminate_first` for children that ignore stdin."""
    if proc is None or proc.poll() is not None:
        return None
    try:
        proc.stdin.close()
    except OSError:
        pass
    steps = ((proc.terminate, 5.0), (proc.kill, 5.0))
    for action, wait_s in (steps if terminate_first else ((None, 5.0),) + steps):
        if action is not None:
            action()
        try:
            proc.wait(wait_s)
            return None
        except subprocess.TimeoutExpired:
            continue
    return "pid %d did not exit after SIGKILL" % proc.pid


def _stderr_tail(proc: subprocess.Popen) -> str:
    try:
        _, err = proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return ""
    return (": " + err.strip()[-800:]) if err and err.strip() else ""


# -- measuring the proxy process ----------------------------------------------------------------

def _proc_status(pid: Optional[int]) -> Dict[str, int]:
    """Resident memory (KiB) and thread count from /proc/<pid>/status; zeros if it is gone."""
    rss = threads = 0
    if pid is None:
        return {"rss_kib": 0, "threads": 0}
    try:
        with open("/proc/%d/status" % pid) as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
    except OSError:
        pass
    return {"rss_kib": rss, "threads": threads}


def _cpu_seconds(pid: Optional[int], kernel_only: bool = False) -> float:
    """User + system (or only system) CPU seconds a process has used so far (/proc/<pid>/stat
    fields 14 and 15). Kernel time is worth its own number: thousands of threads contending for
    the GIL show up there, as futex and scheduler work, not as Python work."""
    user_s, kernel_s = _cpu_split(pid)
    return kernel_s if kernel_only else user_s + kernel_s


def _cpu_split(pid: Optional[int]) -> Tuple[float, float]:
    """(user, system) CPU seconds of a process from one read of /proc/<pid>/stat. One read, so the
    two agree; user time is never total minus system, whose float rounding can come out below the
    last reading's by 1e-14 s when the process used no user time in between."""
    if pid is None:
        return 0.0, 0.0
    try:
        with open("/proc/%d/stat" % pid) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = float(os.sysconf("SC_CLK_TCK"))
    return int(fields[11]) / tick, int(fields[12]) / tick


class _PeakSampler:
    """Background thread recording the highest RSS and thread count of one process."""

    def __init__(self, pid: Optional[int]) -> None:
        self.pid = pid
        self.peak_rss_kib = 0
        self.peak_threads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ws-scale-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sample()

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self._sample()

    def _sample(self) -> None:
        st = _proc_status(self.pid)
        self.peak_rss_kib = max(self.peak_rss_kib, st["rss_kib"])
        self.peak_threads = max(self.peak_threads, st["threads"])


def _wait_for_quiet(max_wait_s: float) -> bool:
    """Wait (bounded) until the machine is nearly idle apart from us; False if it never was."""
    if max_wait_s <= 0:
        return False
    end = time.monotonic() + max_wait_s
    while True:
        busy0 = _machine_busy_seconds()
        time.sleep(QUIET_SAMPLE_S)
        if (_machine_busy_seconds() - busy0) / QUIET_SAMPLE_S < QUIET_CORES:
            return True
        if time.monotonic() >= end:
            return False


def _machine_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat), to see what else was running:
    this machine is shared, and a benchmark is only as quiet as its neighbours."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user/nice
    return (sum(fields) - idle - guest) / float(os.sysconf("SC_CLK_TCK"))


def _settle(proc: subprocess.Popen, idle_threads: int) -> Dict[str, Any]:
    """Wait (bounded) for the proxy host's threads to drain back to `idle_threads`; return the last
    status, with `left` (see `_thread_dump`) naming its threads when they did not drain."""
    end = time.monotonic() + SETTLE_TIMEOUT_S
    st: Dict[str, Any] = _proc_status(proc.pid)
    while st["threads"] > idle_threads and time.monotonic() < end:
        time.sleep(0.1)
        st = _proc_status(proc.pid)
    if st["threads"] > idle_threads:
        st["left"] = _thread_dump(proc)
    return st


def _thread_dump(proc: subprocess.Popen) -> List[str]:
    """Every live thread of the proxy host as 'name: innermost frames' (it answers SIGUSR1 with one
    JSON line on stdout), or one line saying why it could not be had."""
    try:
        proc.send_signal(signal.SIGUSR1)
    except OSError as exc:
        return ["no thread dump: %s" % exc]
    line = _read_line(proc, THREAD_DUMP_TIMEOUT_S)
    try:
        threads = json.loads(line)["threads"]
    except (ValueError, KeyError, TypeError):
        return ["no thread dump: the proxy host answered %r" % line[:200]]
    return ["%s: %s" % (t["name"], " <- ".join(_frame_summary(f) for f in reversed(t["stack"][-THREAD_DUMP_FRAMES:])))
            for t in threads]


def _frame_summary(frame: str) -> str:
    """'file.py:LINE in func' from one traceback.format_stack() entry."""
    match = re.match(r'\s*File "([^"]+)", line (\d+), in (\S+)', frame)
    return "%s:%s in %s" % (os.path.basename(match.group(1)), match.group(2), match.group(3)) if match else frame.strip()


# -- limits, reporting --------------------------------------------------------------------------

def _batch_rejection(n: int, mode: str, nofile: int, generators: int) -> Optional[str]:
    """Why this machine cannot run a batch of n sessions in `mode` (or None when it can)."""
    per_generator = int(math.ceil(n / float(generators)))
    needed = max(per_generator, 2 * n if mode == "proxy" else n) + FD_HEADROOM
    if needed > nofile:
        return ("needs %d open files per process, RLIMIT_NOFILE is %d (raise `ulimit -Hn`)"
                % (needed, nofile))
    if mode == "proxy":
        limit = _thread_limit()
        if limit is not None and PROXY_THREADS_PER_SESSION_BOUND * n + FD_HEADROOM > limit:
            return "up to %d proxy threads needed, the machine allows about %d" % (
                PROXY_THREADS_PER_SESSION_BOUND * n, limit)
    return None


def _thread_limit() -> Optional[int]:
    """The smallest of the kernel's pid_max / threads-max and the cgroup's pids.max, if readable."""
    limits = []
    for path in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max",
                 "/sys/fs/cgroup/pids.max"):
        try:
            with open(path) as fh:
                value = fh.read().strip()
            if value.isdigit():
                limits.append(int(value))
        except OSError:
            pass
    return min(limits) if limits else None


def machine_info() -> Dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = "?"
    try:
        with open("/proc/meminfo") as fh:
            kib = int(fh.readline().split()[1])
        mem = "%.0f GiB" % (kib / 1024.0 / 1024.0)
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count() or 0, "mem": mem,
            "kernel": "Linux " + platform.release(), "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "proxy_version": _proxy_version()}


def _proxy_version() -> str:
    """Which proxy.py was measured: its last commit, and whether the file had local edits."""
    try:
        commit = subprocess.run(["git", "log", "-1", "--format=%h", "--", "proxy.py"], cwd=REPO,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "--", "proxy.py"], cwd=REPO,
                               capture_output=True, timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return (commit or "uncommitted") + (" with uncommitted edits" if dirty else "")


def _target_lines(result: Dict[str, Any]) -> List[str]:
    """State plainly whether TARGET_BATCH sessions through one proxy held at 100% success with a
    total p99 within TARGET_P99_RATIO of direct, and how many of them were really open at once."""
    rows = {(r["mode"], r["n"]): r for r in result["rows"]}
    p, d = rows.get(("proxy", TARGET_BATCH)), rows.get(("direct", TARGET_BATCH))
    step = result["config"]["step_delay_s"]
    if p is None or d is None:
        return ["- %d sessions through one proxy: not run in this invocation (batches %s, "
                "step %.2f s)." % (TARGET_BATCH, result["config"]["batches"], step)]
    lines = ["- %d sessions through one proxy at 100%% success: **%s** (%s in the worst "
             "repetition, %d of %d sessions overall). At most %d of them were open at the same "
             "moment: the rest had finished or not yet been set up." % (
                 TARGET_BATCH, "reached" if p["success_min"] >= 1.0 else "NOT reached",
                 _pct(p["success_min"]), p["ok"], p["sessions"], p["peak_open"])]
    if p.get("p99_ratio"):
        lines.append("- total p99 within %.1fx of direct at %d: **%s** (%.2fx: proxy %s vs "
                     "direct %s)." % (
                         TARGET_P99_RATIO, TARGET_BATCH,
                         "reached" if p["p99_ratio"] <= TARGET_P99_RATIO else "NOT reached",
                         p["p99_ratio"], _s(p["total_p99"]), _s(d["total_p99"])))
    if step != 1.0 or result["config"]["steps"] != 1:
        lines.append("- note: this run used %d x %.2f s steps; the target is stated for one "
                     "1.0 s step." % (result["config"]["steps"], step))
    return lines


def _bottleneck_lines(result: Dict[str, Any]) -> List[str]:
    """Evidence, from this run's own numbers, that the generator and upstream were not the limit,
    and where the proxy's added time goes (set-up versus relaying messages)."""
    rows = result["rows"]
    direct = [r for r in rows if r["mode"] == "direct"]
    proxy = [r for r in rows if r["mode"] == "proxy"]
    lines = []
    if direct:
        top = max(direct, key=lambda r: r["n"])
        wait = result["config"]["step_delay_s"]
        lines.append(
            "- Generator and upstream: without the proxy the same generator and upstream complete "
            "up to %.0f upgrades/s and, at N=%d, step p50 %s for a %.2f s server wait; the "
            "generator used at most %s of one core and the upstream at most %s (per-run "
            "averages)." % (
                max(r["connects_per_s"] or 0 for r in direct), top["n"], _s(top["step_p50"]),
                wait, _pct(max(r["generator_cpu"] or 0 for r in rows)),
                _pct(max(r["upstream_cpu"] for r in rows))))
    if proxy:
        lines.append(
            "- Through the proxy the set-up rate tops out at %.0f upgrades/s, below what the "
            "generator and upstream sustain together: the set-up limit measured here is the "
            "proxy's." % max(r["connects_per_s"] or 0 for r in proxy))
        by_n = {r["n"]: r for r in direct}
        pairs = [(p, by_n[p["n"]]) for p in proxy if p["n"] in by_n and p["ok"] and by_n[p["n"]]["ok"]]
        if pairs:
            p, d = next((pd for pd in pairs if pd[0]["n"] == TARGET_BATCH),
                        max(pairs, key=lambda pd: pd[0]["n"]))
            lines.append(
                "- Where the proxy's time goes at N=%d: connect p50 %+.3f s (accept, a thread, the "
                "upgrade replayed upstream), reset p50 %+.3f s and step p50 %+.3f s (relaying "
                "frames) against direct." % (
                    p["n"], p["connect_p50"] - d["connect_p50"], p["reset_p50"] - d["reset_p50"],
                    p["step_p50"] - d["step_p50"]))
    return lines


def _progress_line(r: Dict[str, Any]) -> str:
    proxy = ("  proxy peak %.0f MiB / %d threads for %d open (after: %d)" % (
        r["proxy_rss_peak_kib"] / 1024.0, r["proxy_threads_peak"], r["peak_open"],
        r["proxy_threads_after"])
        if r["mode"] == "proxy" else "")
    if r.get("proxy_threads_left"):
        proxy += "  threads left: " + "; ".join(r["proxy_threads_left"])
    return ("%-6s N=%-5d success %6s  connect p50 %s  step p50 %s  total p99 %s  %5.0f sess/s  "
            "%s conn/s  CPU gen/up/proxy(kernel) %s/%s/%s(%s)%s%s" % (
                r["mode"], r["n"], _pct(r["success"]), _s(r["connect_p50"]), _s(r["step_p50"]),
                _s(r["total_p99"]), r["sessions_per_s"], _num(r["connects_per_s"], "%.0f"),
                _pct(r["generator_cpu"]),
                _pct(r["upstream_cpu"]), _pct(r["proxy_cpu"]), _pct(r["proxy_cpu_kernel"]), proxy,
                ("  failures: " + _errors(r["errors"])) if r["errors"] else ""))


def _upstream_label(kind: str) -> str:
    return {"mini": "benchmarks/_ws_upstream.py (one selectors loop, a timer per step)",
            "echo": "`python -m hf_jobs_emulator echo-server` (a thread per session)"}.get(kind, kind)


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else fmt % x


def _s(x: Optional[float]) -> str:
    return "-" if x is None else "%.3f s" % x


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else "%.1f%%" % (100 * x)


def _errors(errors: Dict[str, int], limit: int = 3) -> str:
    items = list(errors.items())
    text = ", ".join("%s x%d" % (k, v) for k, v in items[:limit])
    return text + (", ..." if len(items) > limit else "") if items else ""


def _say(stream: Optional[IO[str]], text: str) -> None:
    if stream is not None:
        stream.write(text + "\n")
        stream.flush()


# -- CLI ----------------------------------------------------------------------------------------

def _batches_arg(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            "expected a comma-separated list of positive session counts, e.g. 32,128,512")
    return values


def _modes_arg(text: str) -> List[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values or any(v not in MODES for v in values):
        raise argparse.ArgumentTypeError("expected modes from %s, comma-separated" % ", ".join(MODES))
    return [m for m in MODES if m in values]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="WebSocket sessions at scale, direct vs through one AuthProxy.")
    parser.add_argument("--quick", action="store_true",
                        help="short run: batches %s, %.1f s step" % (
                            ",".join(map(str, QUICK_BATCHES)), QUICK_STEP_DELAY_S))
    parser.add_argument("--batches", type=_batches_arg, default=None,
                        help="comma-separated batch sizes (default %s)" % ",".join(
                            map(str, DEFAULT_BATCHES)))
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per session")
    parser.add_argument("--step-delay-s", type=float, default=None,
                        help="server-side wait per step (default %.1f)" % DEFAULT_STEP_DELAY_S)
    parser.add_argument("--upstream", choices=UPSTREAMS, default="mini",
                        help="environment server to benchmark against (default %(default)s)")
    parser.add_argument("--modes", type=_modes_arg, default=list(MODES),
                        help="which runs to do, comma-separated (default direct,proxy)")
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions per batch and mode, sessions pooled (default %d, "
                             "--quick %d)" % (DEFAULT_REPS, QUICK_REPS))
    parser.add_argument("--label", default=None,
                        help="a variant's name: its results go to their own section "
                             "'%s (LABEL)' and plot ws_scale_LABEL.png" % SECTION_TITLE[3:])
    parser.add_argument("--lockstep", action="store_true",
                        help="sessions step together, like a trainer's batched env.step: each "
                             "step waits until every session has its previous reply")
    parser.add_argument("--quiet-wait-s", type=float, default=QUIET_WAIT_S,
                        help="before each run, wait up to this long for the machine to go quiet "
                             "(0: do not wait; default %(default)s)")
    parser.add_argument("--noisy-retries", type=int, default=NOISY_RETRIES,
                        help="redo a run at most this many times when other processes kept the "
                             "machine busy during it (default %(default)s)")
    parser.add_argument("--generators", type=int, default=1,
                        help="load generator processes per batch (default 1)")
    parser.add_argument("--results", default=DEFAULT_RESULTS,
                        help="markdown file whose ws_scale section is written (default %(default)s)")
    parser.add_argument("--plot", default=DEFAULT_PLOT, help="PNG path (default %(default)s)")
    parser.add_argument("--json", default=None, help="also write the raw summary as JSON here")
    parser.add_argument("--profile-proxy", metavar="FILE", default=None,
                        help="diagnostic: cProfile the proxy's threads into FILE (slows it; "
                             "implies --no-write so profiled numbers are never published)")
    parser.add_argument("--no-write", action="store_true",
                        help="print the markdown instead of writing RESULTS.md and the plot")
    args = parser.parse_args(argv)
    batches = args.batches or list(QUICK_BATCHES if args.quick else DEFAULT_BATCHES)
    delay = args.step_delay_s if args.step_delay_s is not None else (
        QUICK_STEP_DELAY_S if args.quick else DEFAULT_STEP_DELAY_S)
    reps = args.reps if args.reps is not None else (QUICK_REPS if args.quick else DEFAULT_REPS)
    if (args.steps < 1 or delay < 0 or args.generators < 1 or reps < 1
            or args.noisy_retries < 0 or args.quiet_wait_s < 0):
        parser.error("--steps, --reps and --generators must be >= 1; --step-delay-s, "
                     "--noisy-retries and --quiet-wait-s >= 0")
    if args.label is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,40}$", args.label):
        parser.error("--label must be 1-41 letters, digits, spaces, '.', '_' or '-', e.g. "
                     "'held-open'")
    title = SECTION_TITLE + (" (%s)" % args.label if args.label else "")
    plot_path = args.plot
    if args.label and plot_path == DEFAULT_PLOT:
        plot_path = os.path.join(HERE, "ws_scale_%s.png" % re.sub(r"[^A-Za-z0-9_-]", "-",
                                                                  args.label))
    if not sys.platform.startswith("linux"):
        parser.error("ws_scale reads /proc to measure the proxy: it runs on Linux only")
    command = "python benchmarks/ws_scale.py" + (
        " " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        if (sys.argv[1:] if argv is None else argv) else "")
    print("ws_scale: batches %s, %d x %.2f s step, %d rep(s), upstream %s, %d generator "
          "process(es)" % (",".join(map(str, batches)), args.steps, delay, reps, args.upstream,
                           args.generators), flush=True)
    result = run_benchmark(batches, args.steps, delay, args.upstream, args.generators,
                           modes=args.modes, reps=reps, progress=sys.stdout,
                           profile_proxy=args.profile_proxy, quiet_wait_s=args.quiet_wait_s,
                           lockstep=args.lockstep, noisy_retries=args.noisy_retries)
    section = render_markdown(result, command, title)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    if args.no_write or args.profile_proxy:
        print(section)
        return 0
    write_results_section(args.results, section, title)
    print("wrote the %r section of %s" % (title[3:], args.results))
    skipped = plot(result, plot_path)
    print("plot skipped: %s" % skipped if skipped else "wrote %s" % plot_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
