"""How long TRL's first GRPO step waits for its sandboxes: serial starts vs background starts vs shared jobs.

A real `GRPOTrainer` (TRL 1.16, CPU) trains the offline tiny model of tests/tiny_trl.py for one step
with the TRL example's `EchoSandboxEnv` against the local emulator (scheduling delay = one cold start).
Three ways to get the slots' sandboxes, measured side by side in one run:

- `serial`: each environment starts its job in its first `reset()` (`begin=False`, the old example):
  TRL resets slot after slot, so the first step waits about N cold starts;
- `background`: each environment begins its job when TRL builds it (`Sandbox`, the default);
- `shared K`: every slot opens its own session on K shared jobs (`shared=..., replicas=K`);
- baseline: `background` with no cold start at all, i.e. what the step costs without waiting for jobs.

Reported per mode: first-step time (trainer construction to the end of step 1, as a user waits for it),
its ratio to one cold start and to `serial`, and the jobs used. Also SIGTERM: a trainer-like child
process with N sandboxes mid cold start gets SIGTERM; time to exit and jobs left running.

    python benchmarks/trl_first_step.py                       # 8 slots, 3 s cold start
    python benchmarks/trl_first_step.py --slots 8 --delay 3 --shared 2 --json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for folder in (ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "tests")):
    if folder not in sys.path:
        sys.path.insert(0, folder)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_jobs_emulator import JobsEmulator, echo_server_command  # noqa: E402

# The trainer-like child of the SIGTERM measurement: N sandboxes begun, then it waits to be killed.
SIGTERM_CHILD = """
import json, sys, time
from hf_sandbox_provider import Sandbox, install_signal_teardown
settings, slots = json.loads(sys.argv[1]), int(sys.argv[2])
install_signal_teardown()
boxes = [Sandbox("img:tag", **settings) for _ in range(slots)]
print("began", flush=True)
time.sleep(600)
"""


def first_step(mode: str, slots: int, delay: float, shared: int) -> Dict[str, Any]:
    """One GRPO step with `slots` environments; the time from trainer construction to step 1's end."""
    import tiny_trl
    import trl_environment_factory as example
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    marks: Dict[str, float] = {}

    class StepClock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.setdefault("step1", time.monotonic())

    with JobsEmulator(scheduling_delay_s=delay) as emu:
        settings: Dict[str, Any] = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command(),
                                        poll_interval_s=0.1)
        if mode == "serial":
            settings["begin"] = False
        elif mode == "shared":
            settings.update(shared="bench", replicas=shared, env_vars={"MAX_CONCURRENT_ENVS": str(slots)})
        tokenizer = tiny_trl.build_tokenizer()
        model = tiny_trl.build_model(tokenizer)
        prompts = [[{"role": "user", "content": "Echo it."}]] * slots
        config = GRPOConfig(output_dir="/tmp/trl-first-step", max_steps=1, per_device_train_batch_size=slots,
                            num_generations=slots, max_completion_length=64, max_tool_calling_iterations=1,
                            logging_steps=1, use_cpu=True, bf16=False, report_to="none", save_strategy="no")
        began = time.monotonic()
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[], args=config,
                              train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[StepClock()],
                              environment_factory=functools.partial(example.EchoSandboxEnv, "img:tag", **settings))
        try:
            trainer.train()
        finally:
            example.EchoSandboxEnv.close_all()
        reward = [e for e in trainer.state.log_history if "reward" in e][0]["reward"]
        return {"mode": mode if mode != "shared" else "shared %d" % shared, "slots": slots, "delay": delay,
                "first_step_s": marks["step1"] - began, "jobs": len(emu.jobs), "reward": reward}


def sigterm_run(slots: int, delay: float) -> Dict[str, Any]:
    """A child with `slots` sandboxes mid cold start gets SIGTERM: exit time and jobs left running."""
    with JobsEmulator(scheduling_delay_s=delay) as emu:
        settings = dict(endpoint=emu.endpoint, token=emu.token, command=echo_server_command(), poll_interval_s=0.1)
        child = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, json.dumps(settings), str(slots)],
                                 cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "began"
        while len(emu.jobs) < slots:
            time.sleep(0.01)
        stages_before = sorted({job.stage for job in emu.jobs})
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        child.wait(60)
        exit_s = time.monotonic() - sent
        for job in emu.jobs:
            emu.wait_for_stage(job.id, ["CANCELED"], timeout_s=30)
        return {"slots": slots, "stages_at_signal": stages_before, "exit_code": child.returncode,
                "exit_s": exit_s, "jobs": len(emu.jobs),
                "left_running": [job.id for job in emu.jobs if not job.terminal]}


def markdown(rows: List[Dict[str, Any]], sig: Dict[str, Any], delay: float, load: str) -> str:
    serial = next(r["first_step_s"] for r in rows if r["mode"] == "serial")
    lines = ["## TRL first step: serial vs background starts vs shared jobs (benchmarks/trl_first_step.py)", "",
             "Command: `%s`  " % " ".join(["python benchmarks/trl_first_step.py"] + sys.argv[1:]),
             "Machine: %s, Python %s, %d CPUs; %s UTC; load average before/after %s. Real TRL GRPOTrainer "
             "(CPU, tiny offline model that calls the echo tool once per rollout), one step, emulator cold start "
             "%g s; first step = trainer construction to the end of step 1." % (
                 platform.platform(), platform.python_version(), os.cpu_count() or 0,
                 time.strftime("%Y-%m-%d %H:%M", time.gmtime()), load, delay),
             "",
             "| sandboxes | slots | cold start | first step | minus baseline | / serial | jobs | jobs per slot | reward |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    baseline = rows[-1]["first_step_s"]
    for r in rows:
        lines.append("| %s | %d | %g s | %.2f s | %.2f s | %.2fx | %d | %.2f | %.2f |" % (
            r["mode"], r["slots"], r["delay"], r["first_step_s"], r["first_step_s"] - baseline,
            r["first_step_s"] / serial, r["jobs"], r["jobs"] / r["slots"], r["reward"]))
    lines += ["", "`minus baseline` is the time spent waiting for sandboxes: about N cold starts when serial, "
              "about one with background starts."]
    lines += ["", "SIGTERM with `install_signal_teardown()`: a child with %d sandboxes (jobs %s) got SIGTERM; it "
              "exited in %.2f s with code %d (killed by the signal, as by default); jobs left running: %d of %d."
              % (sig["slots"], "/".join(sig["stages_at_signal"]), sig["exit_s"], sig["exit_code"],
                 len(sig["left_running"]), sig["jobs"]), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8, help="rollout slots (default: %(default)s)")
    parser.add_argument("--delay", type=float, default=3.0, help="emulator cold start, s (default: %(default)s)")
    parser.add_argument("--shared", type=int, default=2, help="jobs for the shared mode (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = parser.parse_args()
    load_before = "%.1f" % os.getloadavg()[0]
    rows = [first_step(mode, args.slots, args.delay, args.shared) for mode in ("serial", "background", "shared")]
    baseline = first_step("background", args.slots, 0.0, args.shared)  # the step itself, jobs ready at once
    rows.append(dict(baseline, mode="background, no cold start (baseline)"))
    sig = sigterm_run(args.slots, args.delay)
    load = "%s/%.1f" % (load_before, os.getloadavg()[0])
    print(json.dumps({"rows": rows, "sigterm": sig}, indent=1) if args.json else markdown(rows, sig, args.delay, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
