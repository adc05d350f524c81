"""The soak-and-chaos run (benchmarks/soak.py): its rules as fast unit tests, and the CI variant (60 s,
64 environments under chaos, in its own process) asserting every invariant."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import soak  # noqa: E402

CI_DURATION_S = 60
CI_ENVS = 64


# -- the chaos schedule ---------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    assert soak.chaos_schedule(3, 120) == soak.chaos_schedule(3, 120)
    assert soak.chaos_schedule(3, 120) != soak.chaos_schedule(4, 120)


def test_the_schedule_stays_inside_the_run_in_time_order_and_reaches_every_fault_kind():
    events = soak.chaos_schedule(14, 600)
    times = [t for t, _, _ in events]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 600
    assert {kind for _, kind, _ in events} == {kind for kind, _ in soak.CHAOS_KINDS}
    assert all(0 <= pick < 1 for _, _, pick in events)
    # about one fault per interval on average: a schedule that injects nothing proves nothing
    assert 600 / soak.DEFAULT_CHAOS_INTERVAL_S * 0.7 < len(events) < 600 / soak.DEFAULT_CHAOS_INTERVAL_S * 1.3


# -- the invariant checks ----------------------------------------------------------------------------------


def test_an_observation_must_echo_exactly_what_this_environment_was_sent():
    sent = "soak-3-ab:1:ff"
    good = {"observation": {"echoed_message": sent, "message_length": len(sent)}, "reward": 1.4}
    assert soak.answer_rejection(sent, good) is None
    other = {"observation": {"echoed_message": "soak-4-cd:1:ee", "message_length": len(sent)}}
    assert "was sent" in soak.answer_rejection(sent, other)
    assert "message_length" in soak.answer_rejection(sent, {"observation": {"echoed_message": sent,
                                                                             "message_length": 3}})
    assert "no observation" in soak.answer_rejection(sent, {"detail": "x"})
    assert "no observation" in soak.answer_rejection(sent, ["not", "a", "dict"])


def test_the_step_count_must_lie_between_the_answered_steps_and_all_sent():
    for answered in range(12):  # the whole small domain, not hand-picked points
        for unknown in range(4):
            for counted in range(18):
                reason = soak.step_count_rejection(answered, unknown, counted)
                assert (reason is None) == (answered <= counted <= answered + unknown)
                if counted > answered + unknown:
                    assert "ran twice" in reason
                if counted < answered:
                    assert "did not come from this episode" in reason


@pytest.mark.parametrize("kind, stopped, documented", [
    ("sandbox:JobStartTimeout", False, True),
    ("sandbox:JobsAPIError", False, True),
    ("HTTP 502 upstream-unreachable", False, True),
    ("HTTP 502 upstream-protocol", False, True),
    ("HTTP 504 upstream-timeout", False, True),
    ("HTTP 404 unknown-route", True, True),       # the environment was stopped under the trainer
    ("HTTP 404 unknown-route", False, False),     # a route vanished by itself
    ("HTTP 502 -", False, False),                 # a 502 without a kind could be the environment's own
    ("HTTP 504 upstream-unreachable", False, False),
    ("HTTP 500 -", False, False),
    ("closed", False, True),
    ("client-timeout", False, False),             # the proxy must answer 504 before the client gives up
    ("untyped:KeyError", False, False),
])
def test_only_documented_errors_pass(kind, stopped, documented):
    assert (soak.error_kind_rejection(kind, stopped) is None) == documented


def test_slope_per_hour_is_the_least_squares_slope():
    assert soak.slope_per_hour([(0, 10.0), (1800, 11.0), (3600, 12.0)]) == pytest.approx(2.0)
    assert soak.slope_per_hour([(0, 5.0), (10, 5.0), (20, 5.0)]) == 0.0
    assert soak.slope_per_hour([(0, 1.0)]) == 0.0
    # noise around a flat line stays near zero; a leak of 1 MiB a minute shows as 60 MiB/h
    assert abs(soak.slope_per_hour([(t, 100.0 + (1 if t % 2 else -1)) for t in range(600)])) < 1.0
    assert soak.slope_per_hour([(t, 100.0 + t / 60.0) for t in range(600)]) == pytest.approx(60.0)


def test_the_heap_is_judged_on_its_live_samples_so_cyclic_garbage_is_no_leak_but_a_slow_leak_is():
    ran_s = 60.0
    # per-second samples climbing 3% between full collections (the saw-tooth) while the live heap
    # after each collection stays at 200k: flat
    sawtooth = [(t, 200_000 + 6_000 * (t % 20) / 20) for t in range(61)]
    live = [(t, 200_000.0) for t in range(5, 61, 5)]
    assert soak.growth_pct(sawtooth[12:19], 6) > 0.5  # (what the old check read as growth)
    assert soak.live_heap_rejection(live, ran_s) is None
    # a live heap growing 100 blocks a second (2.2% from 15 s to 60 s, its samples after warm-up) is a leak
    leaking = [(t, 200_000.0 + 100 * t) for t in range(5, 61, 5)]
    assert "grew 2.21%" in soak.live_heap_rejection(leaking, ran_s)
    # warm-up growth before 20% of the run is left out
    warming = [(t, 190_000.0 if t < 12 else 200_000.0) for t in range(5, 61, 5)]
    assert soak.live_heap_rejection(warming, ran_s) is None
    # too few collections after warm-up to judge cannot pass
    assert "too few" in soak.live_heap_rejection([(0.9, 200_000.0), (30.0, 200_000.0), (59.0, 200_000.0)], ran_s)


def test_max_calls_in_window_finds_the_busiest_window_of_cumulative_samples():
    samples = [(0, 0), (100, 50), (200, 400), (300, 450), (400, 460), (700, 470)]
    assert soak.max_calls_in_window(samples, 100) == 350
    assert soak.max_calls_in_window(samples, 300) == 450
    assert soak.max_calls_in_window([], 300) == 0


def test_the_token_watch_finds_the_token_in_logs_and_across_split_stream_writes():
    import io
    import logging

    token = "hf_" + "q" * 34
    watch = soak.TokenWatch(token)
    logger = logging.getLogger("soak-test-token-watch")
    logger.propagate = False
    logger.addHandler(watch)
    logger.warning("calling with %s", "no secret")
    assert watch.leaks == []
    logger.warning("oops %s", token)
    assert watch.leaks == ["log record of soak-test-token-watch"]
    sink = io.StringIO()
    tee = watch.stream("stdout", sink)
    tee.write("the token is " + token[:10])
    tee.write(token[10:] + " and more\n")
    assert sink.getvalue().count(token) == 1 and watch.leaks[-1] == "stdout"


# -- the CI variant ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(CI_DURATION_S + 300)
def test_a_minute_of_training_under_chaos_loses_nothing_and_leaks_nothing():
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--duration", str(CI_DURATION_S),
               "--envs", str(CI_ENVS), "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=CI_DURATION_S + 280)
    report = json.loads(done.stdout)
    assert report["violations"] == [], "\n".join(report["violations"][:20])
    assert report["checks"] == {name: True for name in report["checks"]}, (report["checks"], report["slopes_per_hour"])
    assert all(v == 0 for k, v in report["leaks"].items() if not k.endswith(" left")), report["leaks"]
    assert report["token_scan"]["leaks"] == [] and report["token_scan"]["lines"] > 1000
    assert report["emulator_problems"] == []
    # every unexplained error is counted, and the first ones are kept in full to say what was behind them
    assert len(report["unexplained_details"]) == min(sum(report["unexplained_errors"].values()), 20)
    # the run did what it claims: both transports ran episodes, and most fault kinds hit a target
    assert report["episodes"] > CI_ENVS and report["steps"] > 10 * CI_ENVS
    assert len([k for k in report["faults"] if not k.endswith("environments")]) >= 6, report["faults"]
    assert report["api"]["busiest_5_min"] <= report["api"]["limit_5_min"]
    assert report["passed"] and done.returncode == 0, done.stderr[-2000:]
