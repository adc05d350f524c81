"""`python proxy.py UPSTREAM_URL [--port P]`: a real subprocess fronting a real upstream."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Dict, List

import pytest
import requests

from hf_jobs_emulator import spawn_process
from support import TEST_TOKEN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROXY_PY = os.path.join(ROOT, "proxy.py")
TIMEOUT = 15


def _env(tmp_path, token: str = "") -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(tmp_path)  # no cached login from the machine running the tests
    if token:
        env["HF_TOKEN"] = token
    return env


def _run(args: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, PROXY_PY] + args, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def test_cli_prints_the_base_url_first_forwards_with_the_token_and_stops_on_ctrl_c(upstream, tmp_path):
    # spawn_process: the child gets the default SIGINT even when the suite runs with it ignored (nohup, a
    # script's background job), as the CLI keeps an ignored disposition by design.
    proc = spawn_process([sys.executable, PROXY_PY, upstream.url, "--port", "0"], env=_env(tmp_path, TEST_TOKEN),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert base.startswith("http://127.0.0.1:")
        r = requests.get(base + "/health", timeout=TIMEOUT)
        assert r.status_code == 200
        assert ["Authorization", "Bearer " + TEST_TOKEN] in r.json()["headers"]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0
    assert TEST_TOKEN not in out + err
    assert "proxy stopped" in err


def test_cli_fixed_port_and_sigterm(upstream, tmp_path):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, PROXY_PY, upstream.url, "--port", str(port)],
                            env=_env(tmp_path, TEST_TOKEN), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert base.startswith("http://127.0.0.1:%d/" % port)
        proc.terminate()
        proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0


def test_cli_without_a_token_for_a_remote_job_exits_2_with_advice(tmp_path):
    result = _run(["https://job--8000.hf.jobs"], _env(tmp_path))
    assert result.returncode == 2
    assert "HF_TOKEN" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("url, fragment", [
    ("http://example.com", "https"),
    ("not a url", "whitespace"),
])
def test_cli_rejects_bad_upstream_urls(tmp_path, url, fragment):
    result = _run([url], _env(tmp_path, TEST_TOKEN))
    assert result.returncode == 2
    assert fragment in result.stderr
    assert TEST_TOKEN not in result.stderr


def test_cli_refuses_a_ca_bundle_together_with_insecure_instead_of_silently_not_verifying(tmp_path):
    result = _run(["https://job--8000.hf.jobs", "--ca-bundle", "/etc/ssl/certs/ca-certificates.crt", "--insecure"],
                  _env(tmp_path, TEST_TOKEN))
    assert result.returncode == 2 and result.stdout == ""
    assert "not allowed with argument" in result.stderr and "--insecure" in result.stderr


def test_cli_sets_its_own_switch_interval_and_open_files_limit_but_an_in_process_proxy_leaves_them_alone(
        upstream, tmp_path):
    import resource

    import proxy
    import support

    before, limits = sys.getswitchinterval(), resource.getrlimit(resource.RLIMIT_NOFILE)
    with proxy.AuthProxy() as in_process:
        in_process.mount(upstream.url, TEST_TOKEN)
        assert sys.getswitchinterval() == before  # a trainer's process keeps its own settings
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == limits
    hard = limits[1]
    low = min(256, hard)  # the CLI starts with a low soft limit on open files, and raises it to the hard one
    proc = subprocess.Popen([sys.executable, PROXY_PY, upstream.url, "-v"], env=_env(tmp_path, TEST_TOKEN),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    try:
        assert proc.stdout.readline().startswith("http://127.0.0.1:")  # type: ignore[union-attr]
        assert support.open_files_limits(proc.pid) == (hard, hard)
        proc.terminate()
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=TIMEOUT)
    assert ("GIL switch interval %.3g s, open files up to %d (this process only runs the proxy)"
            % (proxy.CLI_SWITCH_INTERVAL_S, hard)) in err
