"""benchmarks/vs_nginx.py's parsing and reporting (no timing): wrk output, py-spy stacks, the nginx
configuration, and RESULTS.md sections it must leave alone."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import vs_nginx  # noqa: E402  (benchmarks/ is not a package)

WRK_OUTPUT = """Running 3s test @ http://127.0.0.1:4000/r/step
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     5.05ms    1.20ms  30.01ms   90.00%
  Latency Distribution
     50%  137.00us
     75%    5.20ms
     90%    6.00ms
     99%    1.20s
  33636 requests in 3.00s, 7.22MB read
  Socket errors: connect 0, read 2, write 0, timeout 0
  Non-2xx or 3xx responses: 7
Requests/sec:  11212.34
Transfer/sec:      2.41MB
"""


def test_wrk_output_is_read_with_units_errors_and_request_count():
    parsed = vs_nginx._parse_wrk(WRK_OUTPUT)
    assert parsed["p50_us"] == pytest.approx(137.0)
    assert parsed["p99_us"] == pytest.approx(1.2e6)
    assert parsed["rps"] == pytest.approx(11212.34)
    assert parsed["requests"] == 33636
    assert parsed["errors"] == 7
    assert parsed["socket_errors"] == "connect 0, read 2, write 0, timeout 0"


def test_wrk_output_without_a_latency_line_gives_none_not_zero():
    parsed = vs_nginx._parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")
    assert parsed["p50_us"] is None and parsed["rps"] is None and parsed["requests"] == 0


def test_py_spy_stacks_are_summed_inclusively_once_per_stack_and_plumbing_and_start_up_are_left_out(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "process 1;thread (0x1);_bootstrap (threading.py:995);_WorkerPool._work (/x/proxy.py:10);_forward (/x/proxy.py:20);"
        "_send_upstream (/x/proxy.py:30) 6\n"
        "process 1;thread (0x1);_bootstrap (threading.py:995);_forward (/x/proxy.py:20);_forward (/x/proxy.py:20) 2\n"
        "process 1;_find_and_load (<frozen importlib._bootstrap>:1176);exec_module (x.py:1) 5\n")
    summary = vs_nginx._summarize_stacks(str(raw))
    assert summary["samples"] == 8  # the import-time stack is not the load's
    inclusive = dict(summary["inclusive"])
    assert inclusive["proxy._forward"] == pytest.approx(1.0)  # a recursive frame counts once
    assert inclusive["proxy._send_upstream"] == pytest.approx(0.75)
    assert not any(name.startswith("threading.") or name == "proxy._WorkerPool._work" for name in inclusive)
    assert dict(summary["own"]) == {"proxy._send_upstream": pytest.approx(0.75), "proxy._forward": pytest.approx(0.25)}


def test_writing_the_section_replaces_only_its_own_markers(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n<!-- proxy_bench:start -->\nkeep me\n<!-- proxy_bench:end -->\n")
    vs_nginx.write_section(str(path), vs_nginx.SECTION_START + "\nfirst\n" + vs_nginx.SECTION_END + "\n")
    vs_nginx.write_section(str(path), vs_nginx.SECTION_START + "\nsecond\n" + vs_nginx.SECTION_END + "\n")
    text = path.read_text()
    assert "keep me" in text and "second" in text and "first" not in text
    assert text.count(vs_nginx.SECTION_START) == 1


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_the_generated_nginx_configuration_is_accepted_by_nginx(tmp_path, test_ca):
    conf = tmp_path / "nginx.conf"
    conf.write_text(vs_nginx._nginx_conf(str(tmp_path), {"plain": (20001, 1), "tls": (20002, 2)},
                                         {"plain": 20003, "tls": 20004}, test_ca.ca_path))
    check = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True,
                           timeout=30)
    assert "syntax is ok" in check.stderr, check.stderr


def _run(measure, target, upstream, **values):
    return dict(values, measure=measure, target=target, upstream=upstream, rep=0, others=0.0, loadavg=1.0)


def test_every_target_not_met_names_its_measured_bottleneck_and_what_would_remove_it():
    runs = [_run("http_c64", "proxy", "plain", rps=3000.0, cpu_us_per_request=300.0, sys_us_per_request=120.0),
            _run("http_c64", "nginx", "plain", rps=20000.0, cpu_us_per_request=30.0),
            _run("http_c1", "proxy", "plain", p50_us=200.0, cpu_us_per_request=140.0, sys_us_per_request=40.0),
            _run("http_c1", "nginx", "plain", p50_us=150.0),
            _run("ws_rt", "proxy", "plain", p50_us=300.0, cpu_us_per_rt=70.0),
            _run("ws_rt", "direct", "plain", p50_us=200.0),
            _run("upgrades", "proxy", "plain", upgrades_per_s=500.0, cpu_us_per_session=1300.0, sys_us_per_session=600.0),
            _run("upgrades", "nginx", "plain", upgrades_per_s=1000.0),
            _run("sessions", "proxy", "plain", n=2048, total_p99_s=2.0, success=1.0, rss_kib_per_open=40.0,
                 threads_peak=4100, peak_open=2048),
            _run("sessions", "nginx", "plain", n=2048, total_p99_s=1.0, success=1.0),
            _run("held", "proxy", "plain", n=1024, success=1.0, rss_kib_per_open=55.0, threads_peak=2051,
                 peak_open=1024)]
    result = {"runs": runs, "thread_rss_kib": 15.0, "syscalls": {"proxy/plain": {"per_session": 274.0, "futex_per_session": 237.0},
                                         "nginx/plain": {"per_session": 25.0}},
              "profiles": {"http_c64/plain": {"own": [("proxy.parse_request", 0.2), ("proxy._forward", 0.1)]},
                           "upgrades/plain": {"own": [("proxy._WorkerPool.submit", 0.3)]}}}
    verdicts = [line for line in vs_nginx._verdicts(result) if line.startswith("- plain")]
    not_met = [line for line in verdicts if "**NOT met**" in line]
    met = [line for line in verdicts if "**met**" in line]
    assert len(not_met) == 6 and len(met) == 1, verdicts  # only p50 (200 <= 2 x 150) is met
    assert all("Measured:" in line and "What would remove it:" in line for line in not_met), not_met
    assert not any("Measured:" in line for line in met)
    text = "\n".join(not_met)
    assert "274 system calls per session, 237 of them futex (nginx 25)" in text
    assert "1300 us CPU per session (600 us of it in the kernel)" in text
    assert "300 us CPU per request at 64 connections (180 us user, 120 us kernel)" in text
    assert "`proxy.parse_request` 20%" in text and "`proxy._WorkerPool.submit` 30%" in text
    assert "70 us of proxy CPU per round trip" in text
    assert "2.0 threads per open session (2051 threads, 1024 open)" in text
    assert "costs 15.0 KiB of RSS by itself" in text
    assert "RSS per open session <= 32 KiB (55 KiB with %d sessions held open" % vs_nginx.HELD_SESSIONS in text


def test_a_run_of_a_subset_of_the_measures_writes_its_own_section_beside_the_full_one(tmp_path):
    path = tmp_path / "RESULTS.md"
    vs_nginx.write_section(str(path), vs_nginx.SECTION_START + "\n## AuthProxy vs nginx vs direct, full\n" +
                           vs_nginx.SECTION_END + "\n")
    vs_nginx.write_section(str(path), vs_nginx.SECTION_START + "\n## AuthProxy vs nginx vs direct, part\n" +
                           vs_nginx.SECTION_END + "\n", subset=True)
    text = path.read_text()
    assert "full" in text and "part" in text and text.count(vs_nginx.SUBSET_START) == 1


def test_the_floor_verdicts_are_ratios_to_the_floor_of_the_same_run():
    runs = [_run("http_c64", "proxy", "tls", rps=3000.0, cpu_us_per_request=200.0),
            _run("http_c64", "floor", "tls", rps=4000.0, cpu_us_per_request=100.0),
            _run("held", "proxy", "tls", rss_kib_per_open=120.0, peak_open=2048, threads_peak=4099),
            _run("held", "floor", "tls", rss_kib_per_open=125.0, peak_open=2048, threads_peak=4098),
            _run("held", "proxy", "plain", rss_kib_per_open=63.0, peak_open=2048, threads_peak=4099),
            _run("held", "floor", "plain", rss_kib_per_open=60.0, peak_open=2048, threads_peak=4098)]
    lines = vs_nginx._floor_verdicts({"runs": runs})
    assert "- tls: CPU per HTTP request at 64 connections, proxy / floor <= 1.5x: 2.00x (limit 1.50x): **NOT met**" in lines
    assert "- tls: req/s at 64 connections, proxy / floor >= 0.67x: 0.75x (floor 0.67x): **met**" in lines
    assert ("- tls: RSS per held session (2048 held), proxy / floor <= 1.0x (120 KiB vs 125 KiB): 0.96x "
            "(limit 1.00x): **met**") in lines
    assert ("- plain: RSS per held session (2048 held), proxy / floor <= 1.0x (63 KiB vs 60 KiB): 1.05x "
            "(limit 1.00x): **NOT met**") in lines


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_convoy_counters_count_live_threads_switches_and_a_thread_that_ends_takes_none_off():
    import threading
    import time

    import gil_convoy

    stop, started, slept, end_early = (threading.Event() for _ in range(4))

    def sleeper():  # each short sleep is one voluntary context switch
        started.set()
        while not stop.is_set():
            time.sleep(0.001)

    def busy_then_gone():  # many switches before the first read, then it ends before the second
        for _ in range(1000):
            time.sleep(0.0001)
        slept.set()
        end_early.wait(10)

    threads = [threading.Thread(target=sleeper), threading.Thread(target=busy_then_gone)]
    for thread in threads:
        thread.start()
    try:
        assert started.wait(10) and slept.wait(10)
        before = gil_convoy.process_counters(os.getpid())
        end_early.set()
        threads[1].join(10)
        time.sleep(0.2)
        after = gil_convoy.process_counters(os.getpid())
    finally:
        stop.set()
        end_early.set()
        for thread in threads:
            thread.join(10)
    each = gil_convoy.per_request(before, after, 1)
    assert each["voluntary"] >= 20  # the sleeper's; a sum over live threads went below zero here
    assert each["user_s"] >= 0 and each["kernel_s"] >= 0
    earlier = {"user_s": 1.0, "kernel_s": 2.0, "threads": {"1": (10, 0), "2": (500, 9)}}
    later = {"user_s": 1.5, "kernel_s": 2.25, "threads": {"1": (30, 4), "3": (5, 1)}}  # 2 ended, 3 began
    assert gil_convoy.per_request(earlier, later, 10) == pytest.approx(
        {"user_s": 5e4, "kernel_s": 2.5e4, "voluntary": 2.5, "involuntary": 0.5})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; SO_REUSEPORT")
def test_a_floor_of_two_busy_processes_serves_from_both_on_one_port_and_both_end_with_the_first():
    import json

    import requests
    import support

    upstream = support.Upstream(token="vs-nginx-benchmark-token")  # (401 to any other bearer)
    floor = subprocess.Popen([sys.executable, os.path.join(REPO, "benchmarks", "_floor.py"),
                              upstream.url, "--processes", "2", "--busy", "1000"],  # (--busy: gil_convoy's)
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    sessions = [requests.Session() for _ in range(16)]  # held open: the kernel spreads them
    try:
        info = json.loads(floor.stdout.readline())
        pids = info["pids"]
        assert len(set(pids)) == 2 and pids[0] == floor.pid
        before = {pid: support.open_sockets(pid) for pid in pids}
        for index, session in enumerate(sessions):
            answer = session.post(info["base_url"] + "/step", data="s%d" % index, timeout=30)
            assert answer.status_code == 200 and answer.json()["body"] == "s%d" % index
        held = {pid: support.open_sockets(pid) for pid in pids}
        assert all(held[pid] > before[pid] for pid in pids), (before, held)
        floor.terminate()  # (as the Stack stops it)
        floor.wait(10)
        support.wait_until(lambda: not support.alive(pids[1]), "the second forwarder to end with the first", 10)
    finally:
        for session in sessions:
            session.close()
        if floor.poll() is None:
            floor.kill()
        floor.wait(10)
        upstream.stop()
