"""`python -m hf_sandbox_provider bench`: the lifecycle benchmark, run for real (a subprocess against
the local Jobs emulator), plus its pure helpers. No timing assertions: only shapes and accounting."""

from __future__ import annotations

import json
import os

import sys

import pytest

from test_cli import REPO, clean_env, run

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import lifecycle as bench  # noqa: E402  (benchmarks/ is not a package)

# Every test here runs the CLI or a script as a subprocess (seconds each): the slow tier.
pytestmark = pytest.mark.slow

COLUMNS = ("concurrency", "success", "wall", "scheduling p50/p95", "running->ready p50/p95", "total p50/p95",
           "throughput", "provider overhead p50/p95", "Jobs API calls/env", "peak RSS", "peak threads")


def test_bench_local_reports_every_level_with_overhead_api_calls_and_leaves_nothing(tmp_path):
    out = tmp_path / "table.md"
    result = run(["bench", "--local", "--concurrency", "1,3", "--scheduling-delay-s", "0.2", "--steps", "2",
                  "--json", "--out", str(out)], clean_env(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["mode"] == "local" and report["leftovers"] == []
    assert report["episode"] == "reset + 2 steps over WebSocket"
    assert [row["concurrency"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["success"] == row["concurrency"] and row["failed"] == 0 and row["errors"] == []
        for key in ("scheduling_s", "running_to_ready_s", "total_s", "episode_s", "overhead_s"):
            p50, p95 = row[key]
            assert p50 is not None and p95 is not None and p50 <= p95, key
        assert row["api_calls"]["create"] == row["concurrency"] and row["api_calls"]["cancel"] == row["concurrency"]
        assert row["api_calls_per_env"] >= 2  # at least a create and a cancel each
        assert row["peak_rss_mib"] > 0 and row["peak_threads"] > row["concurrency"]
    # progress: one line per environment as it finishes, then a summary per level
    assert result.stderr.count("c=3 ") >= 3 and "c=3: 3/3 ok" in result.stderr
    table = out.read_text()
    assert all(column in table for column in COLUMNS)
    assert table.count("\n") == 4  # header, rule, two rows


def test_bench_with_the_emulator_in_its_own_process_holds_and_reports_memory_per_provider_and_session(tmp_path):
    result = run(["bench", "--local", "--emulator-process", "--hold", "--concurrency", "3", "--scheduling-delay-s",
                  "0", "--steps", "1", "--http", "--json"], clean_env(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["episode"] == "reset + 1 steps over HTTP" and report["leftovers"] == []
    row = report["rows"][0]
    assert row["success"] == 3 and row["overhead_s"] is None  # not visible across processes: n/a
    assert row["api_calls"]["all"] >= 6  # counted by this process's own client: creates and cancels at least
    assert set(row["memory"]) == {"rss_per_idle_provider_kib", "threads_per_idle_provider",
                                  "rss_per_session_kib", "threads_per_session"}
    assert "in its own process" in report["mode_description"]


def test_bench_writes_a_plot_or_says_why_not(tmp_path):
    plot = tmp_path / "lifecycle.png"
    result = run(["bench", "--local", "--concurrency", "1", "--scheduling-delay-s", "0", "--no-episode",
                  "--plot", str(plot)], clean_env(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in result.stdout and not plot.exists()
    else:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 1 | 1/1 |" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "1,x"], "--concurrency"),
    (["--concurrency", "0"], "--concurrency"),
    (["--steps", "-1"], "--steps"),
    (["--poll-interval-s", "0"], "--poll-interval-s"),
    (["--scheduling-delay-s", "-1"], "--scheduling-delay-s"),
    (["--seed", "x"], "--seed"),
])
def test_bench_refuses_bad_arguments_with_exit_2(tmp_path, args, message):
    result = run(["bench", "--local"] + args, clean_env(tmp_path))
    assert result.returncode == 2 and message in result.stderr


def test_bench_on_the_hub_without_a_token_points_at_local(tmp_path):
    result = run(["bench"], clean_env(tmp_path, HF_ENDPOINT="http://127.0.0.1:9"))
    assert result.returncode == 2 and "no Hugging Face token" in result.stderr and "--local" in result.stderr


def test_percentile_is_nearest_rank():
    assert bench._percentile([], 50) is None
    assert bench._percentile([3.0], 95) == 3.0
    values = [float(v) for v in range(1, 21)]  # 1..20
    assert bench._percentile(values, 50) == 10.0 and bench._percentile(values, 95) == 19.0
    assert bench._percentile(list(reversed(values)), 100) == 20.0


def test_markdown_table_says_n_a_where_a_measure_is_unavailable():
    row = {"concurrency": 2, "success": 2, "wall_s": 7.5, "scheduling_s": [4.0, 5.0],
           "running_to_ready_s": [1.0, 1.5], "total_s": [6.0, 7.0], "throughput_env_per_min": 16.0,
           "overhead_s": None, "api_calls_per_env": 3.5, "peak_rss_mib": 80.0, "peak_threads": 20}
    table = bench._bench_markdown({"rows": [row]})
    assert table.splitlines()[2] == ("| 2 | 2/2 | 7.5s | 4.00s/5.00s | 1.00s/1.50s | 6.00s/7.00s | 16.0 env/min "
                                     "| n/a | 3.50 | 80.0 MiB | 20 |")


def test_each_local_job_waits_a_random_part_of_a_watcher_interval_more_unless_no_jitter():
    args = bench._parser().parse_args(["--local", "--poll-interval-s", "0.5"])
    key = "HF_JOBS_EMULATOR_SCHEDULING_DELAY_S"
    extras = {float(bench._with_jitter({"flavor": "cpu-basic"}, args)["env_vars"][key]) for _ in range(50)}
    assert len(extras) > 40 and all(0.0 <= extra < 0.5 for extra in extras)  # spread over the whole cycle
    assert min(extras) < 0.1 and max(extras) > 0.4
    fixed = bench._parser().parse_args(["--local", "--no-jitter"])
    assert bench._with_jitter({"flavor": "cpu-basic"}, fixed) == {"flavor": "cpu-basic"}
    hub = bench._parser().parse_args([])
    assert "env_vars" not in bench._with_jitter({"flavor": "cpu-basic"}, hub)


def test_markdown_table_counts_environments_whose_overhead_was_not_recorded():
    row = {"concurrency": 2, "success": 2, "wall_s": 7.5, "scheduling_s": [4.0, 5.0],
           "running_to_ready_s": [1.0, 1.5], "total_s": [6.0, 7.0], "throughput_env_per_min": 16.0,
           "overhead_s": [0.2, 0.2], "overhead_unrecorded": 1, "api_calls_per_env": 3.5, "peak_rss_mib": 80.0,
           "peak_threads": 20}
    assert "| 0.20s/0.20s (1 n/r) |" in bench._bench_markdown({"rows": [row]})
