"""Dozens of sandboxes at once: start them in parallel, run one episode per thread, fail loudly.

`HFSandboxProvider.start_many(n, image, ...)` brings n environments up in parallel (one process-wide
proxy and job watcher serve them all) and is all-or-nothing: if one fails to start, every job it
started is cancelled and one `StartManyError` names each failure. Each episode then runs from its
own thread over its own WebSocket session. Any failed episode makes the run exit 1 naming the
environment, its job and the reason; every job is cancelled whatever happens.

    python examples/many_envs.py --local                        # 24 environments on the local emulator
    python examples/many_envs.py --n 8                          # 8 real HF Jobs
    python examples/many_envs.py --local --fault crash-at-boot=boom   # every job crashes at boot: exit 1
    python examples/many_envs.py --local --kill-env 3           # environment 3's job dies mid-run: exit 1

With `--pool NAME` the faults hit the pool's host jobs: `--kill-env I` kills the host job environment I's
sandbox runs on, so every environment on that host fails.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import _common
from hf_sandbox_provider import EnvSession, HFSandboxProvider, stop_all

# Stages after which a job is no longer billed.
ENDED = {"COMPLETED", "CANCELED", "ERROR", "DELETED"}
# An episode still running after this long is reported as failed (each socket read is bounded too).
EPISODE_TIMEOUT_S = 300.0


def episode(index: int, base_url: str, steps: int) -> float:
    """Reset, then `steps` echo steps, each checked; returns the episode's total reward."""
    with EnvSession(base_url) as session:  # one blocking WebSocket session, no event loop
        session.reset()
        total = 0.0
        for step in range(steps):
            message = "env %d step %d" % (index, step)
            result = session.step({"message": message})
            if result["observation"]["echoed_message"] != message:
                raise RuntimeError("step %d: echoed %r" % (step, result["observation"]["echoed_message"]))
            total += result.get("reward") or 0.0
        return total


def run_episodes(providers: List[HFSandboxProvider], steps: int) -> Dict[int, Any]:
    """One thread per environment; returns {index: seconds taken, or the exception it failed with}."""
    outcomes: Dict[int, Any] = {}
    lock = threading.Lock()

    def work(index: int, base_url: str) -> None:
        began = time.monotonic()
        try:
            episode(index, base_url, steps)
            outcome: Any = time.monotonic() - began
        except BaseException as exc:  # reported by the caller, never lost
            outcome = exc
        with lock:
            outcomes[index] = outcome

    threads = [threading.Thread(target=work, args=(i, p.base_url), name="episode-%d" % i, daemon=True)
               for i, p in enumerate(providers)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + EPISODE_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        for i in range(len(providers)):
            outcomes.setdefault(i, TimeoutError("episode still running after %gs" % EPISODE_TIMEOUT_S))
        return dict(outcomes)


def spread(values: Sequence[float]) -> str:
    ordered = sorted(values)
    return "p50 %.2fs, max %.2fs" % (ordered[len(ordered) // 2], ordered[-1]) if ordered else "none"


def run(args: Any, backend: _common.Backend) -> int:
    began = time.monotonic()
    try:
        providers = HFSandboxProvider.start_many(args.n, args.image, **backend.settings)
    except Exception as exc:  # StartManyError: every job it started is cancelled already
        return _common.failure_exit(exc)
    print("%d environments ready in %.1fs (job ready times %s)" % (
        len(providers), time.monotonic() - began, spread([p.timings["ready"] for p in providers])))
    outcomes: Dict[int, Any] = {}
    try:
        if args.kill_env is not None:
            # pooled, an environment's job_id is "<host job id>.<sandbox id>": its host is the job that can die
            victim = str(providers[args.kill_env].job_id).split(".")[0]
            backend.emulator.kill_job(victim)
            backend.emulator.wait_for_stage(victim, ["ERROR"])
            print("killed environment %d's %s %s (a machine dying mid-run)" % (
                args.kill_env, "host job" if args.pool else "job", victim))
        began = time.monotonic()
        outcomes = run_episodes(providers, args.steps)
        durations = [v for v in outcomes.values() if isinstance(v, float)]
        print("%d of %d episodes x %d steps done in %.1fs (%s per episode)" % (
            len(durations), len(providers), args.steps, time.monotonic() - began, spread(durations)))
    finally:
        began = time.monotonic()
        stop_all(providers)
        running = [p.job_id for p in providers if p.stage not in ENDED]
        print("stopped %d jobs in %.1fs; still running: %s" % (
            len(providers), time.monotonic() - began, ", ".join(running) or "none"))
    failures = {i: v for i, v in sorted(outcomes.items()) if not isinstance(v, float)}
    for index, exc in failures.items():
        print("FAILED environment %d (job %s): %s: %s" % (index, providers[index].job_id, type(exc).__name__, exc),
              file=sys.stderr)
    return _common.EXIT_FAILED if failures or running else _common.EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _common.parser(__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, help="how many environments (default: 24 with --local, 8 on the Hub)")
    parser.add_argument("--steps", type=int, default=5, help="steps per episode (default: %(default)s)")
    parser.add_argument("--fault", metavar="KEY=VALUE", help="--local only: emulator fault on every job (with "
                        "--pool: every host job), e.g. crash-at-boot=boom or scheduling-delay-s=3")
    parser.add_argument("--kill-env", type=int, metavar="I", help="--local only: kill environment I's job "
                        "once all are ready, to see a mid-run failure reported")
    args = parser.parse_args(argv)
    args.n = args.n if args.n is not None else (24 if args.local else 8)
    if args.n < 1 or args.steps < 1:
        parser.error("--n and --steps must be at least 1")
    if (args.fault or args.kill_env is not None) and not args.local:
        parser.error("--fault and --kill-env inject failures into the local emulator: add --local")
    if args.fault and "=" not in args.fault:
        parser.error("--fault takes KEY=VALUE, e.g. crash-at-boot=boom")
    if args.kill_env is not None and not 0 <= args.kill_env < args.n:
        parser.error("--kill-env must be between 0 and %d" % (args.n - 1))
    faults = dict([args.fault.split("=", 1)]) if args.fault else None
    with _common.Backend(args, faults=faults) as backend:
        code = run(args, backend)
    return _common.leftover_exit(code, backend)


if __name__ == "__main__":
    sys.exit(main())
