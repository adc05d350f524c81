"""Pooled vs dedicated placement, side by side in one run against the emulator with upstream-like delays
(a cold host or job 13 s, a sandbox on a warm host 0.3 s): time until N environments are all ready and
on how many host jobs, restarting one environment on a warm host (through start_container), Jobs API
calls, per-step latency added by the host hop, and the VM-hours table. Results go to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/pool.py                # 64 environments, 20 restarts, 200 steps each
    .venv/bin/python benchmarks/pool.py --envs 8 --cold-s 2 --no-write   # a quick look

Every environment server is OpenEnv's echo environment, so the placements differ only in where it runs.
Dedicated: the emulator's echo-server job, forked from its pre-imported zygote (no interpreter start-up).
Pooled: a new interpreter in each sandbox, as on a host, bound to the sandbox's unix socket: the lean
stand-in (tests/upstreams/uds_echo_lean.py, standard library only, `-I -S`) for the target's figure, and
the emulator's echo server (tests/upstreams/uds_echo_env.py, its modules byte-compiled once first, as an
image build leaves them) in a second pooled run. Here all 64 servers start on this machine's 2 cores,
beside the emulator and the client; on the Hub each host's own vCPUs start its servers. The start-up CPU
of one server (both stand-ins, and a real OpenEnv server) is measured too. Everything runs on this
machine: the host hop measured here is the emulated one (a TLS relay and a unix socket in Python), not
the Hub's network path.
"""
from __future__ import annotations

import argparse
import compileall
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, os.path.join(ROOT, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

import hf_sandbox_pool  # noqa: E402
from _results import replace_marked_section  # noqa: E402
from hf_jobs_emulator import JobsEmulator, echo_server_command  # noqa: E402
from hf_sandbox_provider import EnvSession, HFSandboxProvider  # noqa: E402

SERVER = [sys.executable, os.path.join(ROOT, "tests", "upstreams", "uds_echo_env.py"), "{socket}"]
# The pooled servers of the target's figure: the echo environment in the standard library only, started without
# site-packages (-I -S). All 64 start on this machine's 2 cores at once (on the Hub, on each host's own).
LEAN_SERVER = [sys.executable, "-I", "-S", os.path.join(ROOT, "tests", "upstreams", "uds_echo_lean.py"), "{socket}"]
IMAGE = "python:3.12"
# Upstream figures (issue 20): ~13 s for a cold host (or a dedicated job) to run, 0.27 s for a sandbox.
COLD_S = 13.0
WARM_S = 0.3
SANDBOXES_PER_HOST = 50  # huggingface_hub's default density, used for the VM-hours table
TIMEOUT_S = 300.0
# A real OpenEnv server (openenv-core's create_app, served by uvicorn on a unix socket), for its start-up cost.
OPENENV_SERVER = """
import os
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
import uvicorn

class MessageAction(Action):
    message: str

class MessageObservation(Observation):
    echoed_message: str = ""

class Echo(Environment):
    def __init__(self):
        super().__init__()
        self._state = State(episode_id="e", step_count=0)
    def reset(self, seed=None, episode_id=None, **kwargs):
        return MessageObservation(echoed_message="ready")
    def step(self, action, timeout_s=None, **kwargs):
        return MessageObservation(echoed_message=action.message)
    @property
    def state(self):
        return self._state

uvicorn.run(create_app(Echo, MessageAction, MessageObservation, env_name="echo"), uds=os.environ["HF_SANDBOX_SOCKET"],
            log_level="warning")
"""
STARTUP_RUNS = 3  # start-up CPU: the median of this many starts of one server, alone
START = "<!-- pool:start -->"
END = "<!-- pool:end -->"


def _emulator(dedicated: bool, cold_s: float) -> JobsEmulator:
    """Dedicated jobs wait `cold_s` scheduling; pooled hosts take `cold_s` to boot (and schedule at once)."""
    return JobsEmulator(tls=True, scheduling_delay_s=cold_s if dedicated else 0.0, sandbox_host_boot_s=cold_s,
                        sandbox_host_ready_s=0.0, sandbox_create_s=WARM_S).start()


def _providers(emu: JobsEmulator, n: int, pooled_server: Optional[List[str]]) -> List[HFSandboxProvider]:
    """n environments at once: pooled (running `pooled_server` in each sandbox), or dedicated jobs if None."""
    options: Dict[str, Any] = dict(endpoint=emu.endpoint, token=emu.token, verify=emu.ca_path, progress=False,
                                   start_timeout_s=TIMEOUT_S, ready_timeout_s=TIMEOUT_S, max_parallel=n)
    if pooled_server:
        options.update(pool="bench", command=pooled_server)
    else:
        options.update(command=echo_server_command())
    return HFSandboxProvider.start_many(n, IMAGE, **options)  # type: ignore[return-value]


def _step_latency_ms(base_url: str, steps: int) -> List[float]:
    with EnvSession(base_url) as session:
        session.reset()
        for _ in range(20):  # warm the connection and the server
            session.step({"message": "warm-up"})
        out = []
        for _ in range(steps):
            began = time.perf_counter()
            session.step({"message": "a step of the benchmark"})
            out.append((time.perf_counter() - began) * 1000)
    return out


def _serving_at(emu: JobsEmulator, p: HFSandboxProvider) -> float:
    """When the pooled server began serving (wall clock): its log file's last write, the echo server's
    "serving on" line (the emulated sandbox's home is a local directory)."""
    host = emu.sandbox_hosts.host(p._pooled.host_id)
    home = os.path.join(host._state_dir, (p.job_id or "").split(".", 1)[1], "home")
    return os.path.getmtime(os.path.join(home, ".hf-sandbox-server-%d.log" % p.port))


def _first_median_last(values: List[float]) -> Any:
    ordered = sorted(values)
    return ordered[0], statistics.median(ordered), ordered[-1]


def _percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _byte_compiled_echo_server() -> List[str]:
    """The pooled servers' command: the echo environment run from a copy of its modules byte-compiled once,
    as an image build leaves its code (pip, a Dockerfile's compileall). This machine runs with
    PYTHONDONTWRITEBYTECODE=1, so run from the repository each server would compile the ~7,000 lines of
    hf_jobs_emulator and proxy at its start; a copy keeps the repository free of __pycache__ directories."""
    root = tempfile.mkdtemp(prefix="pool-bench-echo-")
    for module in ("hf_jobs_emulator.py", "proxy.py", "hf_sbx_emulator.py", os.path.join("tests", "upstreams",
                                                                                        "uds_echo_env.py")):
        os.makedirs(os.path.dirname(os.path.join(root, module)), exist_ok=True)
        shutil.copyfile(os.path.join(ROOT, module), os.path.join(root, module))
    compileall.compile_dir(root, quiet=1)
    return [sys.executable, os.path.join(root, "tests", "upstreams", "uds_echo_env.py"), "{socket}"]


def _startup_cpu_s(argv: List[str], env: Dict[str, str]) -> float:
    """CPU seconds (user + system) one server takes from exec until its /health answers 200 on its unix
    socket: the median of STARTUP_RUNS starts, each alone."""
    samples = []
    for _ in range(STARTUP_RUNS):
        path = os.path.join(tempfile.mkdtemp(prefix="pool-bench-sock-"), "8000.sock")
        proc = subprocess.Popen(argv, env={**env, "HF_SANDBOX_SOCKET": path}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.connect(path)
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: env\r\nConnection: close\r\n\r\n")
                    if sock.recv(64).startswith(b"HTTP/1.1 200"):
                        break
            except OSError:
                pass
            time.sleep(0.005)
        proc.terminate()
        usage = os.wait4(proc.pid, 0)[2]
        proc.returncode = 0  # reaped here
        samples.append(usage.ru_utime + usage.ru_stime)
    return statistics.median(samples)


def _startup_costs(server: List[str]) -> Dict[str, float]:
    """Start-up CPU of the lean stand-in, of one echo server as the benchmark runs it (`server`), and compiling its modules at
    start (run from the repository, as this machine's PYTHONDONTWRITEBYTECODE=1 makes it), and of a real
    OpenEnv server (its packages installed, so byte-compiled, as in an image)."""
    costs = {"lean": _startup_cpu_s(LEAN_SERVER[:-1], dict(os.environ)),
             "echo": _startup_cpu_s(server[:2], dict(os.environ)),
             "echo_uncompiled": _startup_cpu_s(SERVER[:2], {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})}
    try:
        import openenv.core.env_server.http_server  # noqa: F401 - only whether it is installed
    except ImportError:
        return costs
    script = os.path.join(tempfile.mkdtemp(prefix="pool-bench-openenv-"), "server.py")
    with open(script, "w") as handle:
        handle.write(OPENENV_SERVER)
    costs["openenv"] = _startup_cpu_s([sys.executable, script], dict(os.environ))
    return costs


def _pooled(args: argparse.Namespace, server: List[str], restarts: bool) -> Dict[str, Any]:
    """One pooled start of args.envs environments running `server`, each stage's first / median / last
    time, CPU and Jobs API calls; with `restarts`, also the warm restarts and the step latency."""
    r: Dict[str, Any] = {}
    emu = _emulator(False, args.cold_s)
    os.environ["SSL_CERT_FILE"] = emu.ca_path  # huggingface_hub's own clients trust the emulator's CA
    try:
        began, began_wall = time.monotonic(), time.time()
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        load_before = os.getloadavg()[0]
        providers = _providers(emu, args.envs, server)
        r["all_ready_s"] = time.monotonic() - began
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        r["own_cpu_s"] = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
        r["servers_cpu_s"] = _group_cpu_s(emu.sandbox_hosts.live_pids())
        r["load"] = (load_before, os.getloadavg()[0])
        for stage in ("created", "url", "ready"):  # sandbox created, server started and mounted, /health 200
            r["%s_s" % stage] = _first_median_last([p._submitted_at + p.timings[stage] - began for p in providers])
        serving = [_serving_at(emu, p) - began_wall for p in providers]
        r["serving_s"] = _first_median_last(serving)
        lags = sorted(p._submitted_at + p.timings["ready"] - began - at for p, at in zip(providers, serving))
        r["probe_lag_s"] = (statistics.median(lags), _percentile(lags, 0.9), lags[-1])
        r["running_s"] = sorted(job.started_mono - began for job in emu.jobs if job.started_mono is not None)
        r["api_by_route"] = dict(emu.api_calls)
        r["hosts"] = len({p._pooled.host_id for p in providers})
        r["host_jobs"] = len(emu.jobs)
        r["api_calls"] = sum(emu.api_calls.values())
        if restarts:
            times = []
            for i in range(args.restarts):
                p = providers[i % len(providers)]
                p.stop_container()
                began = time.monotonic()
                p.wait_for_ready(p.start_container())
                times.append(time.monotonic() - began)
            r["restart_p50_s"] = statistics.median(times)
            r["restart_p90_s"] = _percentile(times, 0.9)
            r["step_ms"] = _step_latency_ms(providers[0].base_url, args.steps)
        for p in providers:
            p.stop_container()
    finally:
        hf_sandbox_pool.close_pools()
        emu.stop()
    return r


def _group_cpu_s(leaders: List[int]) -> float:
    """CPU seconds (user + system, with reaped children) of every process in the process groups led by
    `leaders` (each sandbox process is a group: the shell, the deadline watcher, the server)."""
    groups, total = set(leaders), 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in groups:  # fields[2] is the pgrp; utime, stime, cutime, cstime follow at 11-14
            total += sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import huggingface_hub.constants
    huggingface_hub.constants.HF_HOME = tempfile.mkdtemp(prefix="pool-bench-")  # its pool cache: not the user's
    result: Dict[str, Any] = {"envs": args.envs, "cold_s": args.cold_s, "warm_s": WARM_S}
    echo = _byte_compiled_echo_server()
    result["startup_cpu_s"] = _startup_costs(echo)
    # Pooled: the lean stand-in (the target's figure, with restarts and steps), then the echo server.
    result["pooled"] = _pooled(args, LEAN_SERVER, restarts=True)
    result["pooled_echo"] = _pooled(args, echo, restarts=False)
    # Dedicated.
    emu = _emulator(True, args.cold_s)
    try:
        began = time.monotonic()
        providers = _providers(emu, args.envs, None)
        result["dedicated_all_ready_s"] = time.monotonic() - began
        result["dedicated_jobs"] = len(emu.jobs)
        result["dedicated_api_calls"] = sum(emu.api_calls.values())
        result["dedicated_api_by_route"] = dict(emu.api_calls)
        result["dedicated_step_ms"] = _step_latency_ms(providers[0].base_url, args.steps)
        for p in providers:
            p.stop_container()
    finally:
        emu.stop()
    result["load_average_end"] = os.getloadavg()[0]
    return result


def report(r: Dict[str, Any]) -> str:
    lean, echo, costs = r["pooled"], r["pooled_echo"], r["startup_cpu_s"]
    pooled_p50 = statistics.median(lean["step_ms"])
    dedicated_p50 = statistics.median(r["dedicated_step_ms"])
    cores = os.cpu_count() or 1
    lines = [
        START,
        "## Pooled vs dedicated placement (benchmarks/pool.py)",
        "",
        "Machine: %s, Python %s, %d CPUs; %s UTC; load average at the end %.1f (the machine is shared). "
        "Emulator over TLS: a cold host or dedicated job %.0f s, a sandbox on a warm host %.1f s. Servers: "
        "dedicated, the emulator's echo environment forked from its pre-imported zygote (no interpreter start-up); "
        "pooled, a new interpreter in each sandbox, as on a host: the lean echo stand-in "
        "(tests/upstreams/uds_echo_lean.py, standard library only, `python -I -S`) for the figures below, and the "
        "emulator's echo server (tests/upstreams/uds_echo_env.py, byte-compiled) in its own row. "
        "huggingface_hub %s." % (
            os.uname().machine, sys.version.split()[0], cores, time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            r["load_average_end"], r["cold_s"], r["warm_s"], __import__("huggingface_hub").__version__),
        "",
        "| %d environments | dedicated | pooled | pooled / dedicated |" % r["envs"],
        "|---|---|---|---|",
        "| all ready (s, from start_many) | %.1f | %.1f | %.2f |" % (
            r["dedicated_all_ready_s"], lean["all_ready_s"], lean["all_ready_s"] / r["dedicated_all_ready_s"]),
        "| all ready, pooled servers = the emulator's echo server (s) | | %.1f | %.2f |" % (
            echo["all_ready_s"], echo["all_ready_s"] / r["dedicated_all_ready_s"]),
        "| host jobs | %d | %d | %.3f |" % (r["dedicated_jobs"], lean["host_jobs"], lean["host_jobs"] / r["dedicated_jobs"]),
        "| Jobs API calls | %d | %d | %.3f |" % (r["dedicated_api_calls"], lean["api_calls"],
                                                 lean["api_calls"] / r["dedicated_api_calls"]),
        "| WebSocket step latency p50 / p99 (ms) | %.2f / %.2f | %.2f / %.2f | %.2f (p50) |" % (
            dedicated_p50, _percentile(r["dedicated_step_ms"], 0.99), pooled_p50,
            _percentile(lean["step_ms"], 0.99), pooled_p50 / dedicated_p50),
        "",
        "- All %d pooled environments ready %.1f s after start_many began: one cold host start (%.0f s) + %.1f s "
        "(target: + 3 s), on %d host jobs (target: at most 2). With the emulator's echo server in every sandbox "
        "instead: + %.1f s (its start-up costs %.1fx the lean one's CPU, all of it on this machine's %d cores)." % (
            r["envs"], lean["all_ready_s"], r["cold_s"], lean["all_ready_s"] - r["cold_s"], lean["hosts"],
            echo["all_ready_s"] - r["cold_s"], costs["echo"] / costs["lean"], cores),
    ]
    for label, run_ in (("lean stand-in", lean), ("echo server", echo)):
        lines.append(
            "- Where the pooled time goes, %s (seconds from start_many, first / median / last environment): host "
            "jobs RUNNING %s, sandbox created %s, server process started and mounted %s, server serving %s, /health 200 through the proxy %s "
            "(from serving to that 200, the readiness probe's lag: median %.2f s, p90 %.2f s, max %.2f s); CPU over "
            "the whole start: the %d servers (with their shells) %.1f CPU-seconds, this process (emulator, proxy, "
            "huggingface_hub's clients, the providers) %.1f; load average %.1f before, %.1f after." % tuple(
                [label, " and ".join("%.1f" % t for t in run_["running_s"])]
                + ["%.1f / %.1f / %.1f" % run_["%s_s" % stage] for stage in ("created", "url", "serving", "ready")]
                + list(run_["probe_lag_s"]) + [r["envs"], run_["servers_cpu_s"], run_["own_cpu_s"]] + list(run_["load"])))
    lines += [
        "- Everything here runs on this one machine: the emulator, both hosts' TLS fronts, every sandbox and all "
        "%d servers' start-up. On the Hub each host's own vCPUs start its (at most 50) servers, and the client's "
        "machine runs only the client." % r["envs"],
        "- Start-up CPU of one server until /health answers (alone, median of %d): the lean stand-in %.3f s, the "
        "emulator's echo server %.3f s (%.3f s with its modules compiled at every start, as this machine's "
        "PYTHONDONTWRITEBYTECODE=1 would do without the benchmark's byte-compiled copy)%s." % (
            STARTUP_RUNS, costs["lean"], costs["echo"], costs["echo_uncompiled"],
            "; a real OpenEnv server (openenv-core's create_app under uvicorn) %.2f s, so one cpu-basic host "
            "(2 vCPU) starting 50 of them spends about %.0f s on it" % (costs["openenv"], 50 * costs["openenv"] / 2)
            if "openenv" in costs else ""),
        "- Jobs API calls by route, dedicated %s; pooled %s (huggingface_hub's 2 s stage checks of the booting "
        "hosts are answered by the process's job watcher: one list per %.0f s for both hosts)." % (
            _routes(r["dedicated_api_by_route"]), _routes(lean["api_by_route"]), hf_sandbox_pool.HOST_WATCH_INTERVAL_S),
        "- Restarting one environment on a warm host, start_container + wait_for_ready: p50 %.2f s, p90 %.2f s "
        "(target: p50 under 1 s)." % (lean["restart_p50_s"], lean["restart_p90_s"]),
        "- The host hop adds %+.2f ms per step at p50 here (the emulated hop: a TLS relay and a unix socket, "
        "both in Python on this machine; on the Hub it is the host's own relay inside the VM)." % (
            pooled_p50 - dedicated_p50),
        "",
        "VM-hours for one hour of N environments (cpu-basic; pooled at %d sandboxes per host):" % SANDBOXES_PER_HOST,
        "",
        "| environments | dedicated | pooled | pooled / dedicated |",
        "|---|---|---|---|",
    ]
    for n in (64, 512):
        hosts = -(-n // SANDBOXES_PER_HOST)
        lines.append("| %d | %d | %d | %.3f |" % (n, n, hosts, hosts / n))
    lines += ["", END, ""]
    return "\n".join(lines)


def _routes(counts: Dict[str, int]) -> str:
    return ", ".join("%s %d" % (route, n) for route, n in sorted(counts.items()) if n)


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cold-s", type=float, default=COLD_S)
    parser.add_argument("--no-write", action="store_true", help="print the section instead of updating RESULTS.md")
    args = parser.parse_args(argv)
    section = report(run(args))
    print(section)
    if not args.no_write:
        replace_marked_section(os.path.join(HERE, "RESULTS.md"), START, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
