"""One loopback rule, one token order, one flavor list and one stage list for provider, proxy and emulator.

They used to keep their own copies and disagreed (only the proxy took `[::1]` and `*.localhost`, the
emulator refused `h100`, the proxy CLI read HF_TOKEN before huggingface_hub's login file while the
provider did the opposite). The loopback rule lives in proxy.py (the module below both); the Jobs facts
and the token order in the core, which the emulator's Hub side reads and the proxy CLI mirrors through
huggingface_hub's get_token(). Each table below is checked through every module's own behaviour, so a
copy that drifts again fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

import hf_jobs_emulator as emulator_module
import hf_sandbox_provider as hsp
import proxy as proxy_module
from hf_jobs_emulator import JobsEmulator

# (host as it appears in a URL, is it this machine?)
HOSTS = [
    ("127.0.0.1", True), ("127.9.8.7", True), ("[::1]", True), ("localhost", True), ("LocalHost", True),
    ("api.localhost", True), ("localhost.", True),
    ("localhost.example.com", False), ("mylocalhost", False), ("10.0.0.5", False), ("0.0.0.0", False),
    ("[::]", False), ("[2001:db8::1]", False), ("example.com", False), ("127.0.0.1.nip.io", False),
]


def provider_accepts_http_endpoint(host: str) -> bool:
    try:
        hsp.HFSandboxProvider("python:3.12", endpoint="http://%s:9" % host)
    except hsp.InsecureURLError:
        return False
    return True


def proxy_accepts_http_upstream(host: str) -> bool:
    try:
        proxy_module.Route("http://%s:9" % host, "hf_test_token")
    except proxy_module.InsecureURLError:
        return False
    return True


def emulator_accepts_bind_host(host: str) -> bool:
    try:
        JobsEmulator(host=host.strip("[]"))
    except ValueError as exc:
        assert "loopback" in str(exc)
        return False
    return True


@pytest.mark.parametrize("host, loopback", HOSTS)
def test_provider_proxy_and_emulator_agree_on_which_hosts_are_this_machine(host, loopback):
    assert provider_accepts_http_endpoint(host) is loopback
    assert proxy_accepts_http_upstream(host) is loopback
    assert emulator_accepts_bind_host(host) is loopback


def test_the_exposed_url_rule_uses_the_same_loopback_test():
    for host, loopback in HOSTS:
        reason = hsp._exposed_url_rejection("http://%s:4321" % host, "job1", 8000, "http://127.0.0.1:9")
        assert (reason is None) is loopback, host


# (environment variables, token file content, expected token): env vars first, as huggingface_hub does,
# then the login file; blank values count as absent.
TOKEN_CASES = [
    ({"HF_TOKEN": "hf_env"}, "hf_file", "hf_env"),
    ({"HUGGING_FACE_HUB_TOKEN": "hf_legacy"}, "hf_file", "hf_legacy"),
    ({"HF_TOKEN": "hf_env", "HUGGING_FACE_HUB_TOKEN": "hf_legacy"}, None, "hf_env"),
    ({"HF_TOKEN": "  hf_padded \n"}, None, "hf_padded"),
    ({"HF_TOKEN": "   "}, "hf_file", "hf_file"),
    ({}, "hf_file\n", "hf_file"),
    ({}, None, None),
    ({"HF_TOKEN": ""}, "", None),
]


@pytest.mark.parametrize("env, file_content, expected", TOKEN_CASES)
def test_provider_and_proxy_cli_find_the_same_token_in_the_same_order(monkeypatch, tmp_path, env, file_content,
                                                                       expected):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    try:  # huggingface_hub reads its token path once at import: point it at this test's file too
        from huggingface_hub import constants as hub_constants
        monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    except ImportError:
        pass
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if file_content is not None:
        (tmp_path / "token").write_text(file_content)
    from huggingface_hub import get_token  # what `python proxy.py UPSTREAM_URL` asks

    assert (get_token() or None) == expected
    assert hsp._discover_token() == expected
    provider = hsp.HFSandboxProvider("python:3.12")
    if expected is None:
        with pytest.raises(hsp.SandboxConfigError, match="no Hugging Face token"):
            provider._resolve_token()
    else:
        assert provider._resolve_token() == expected


@pytest.mark.parametrize("flavor", sorted(hsp.KNOWN_FLAVORS))
def test_every_flavor_the_provider_sends_the_emulator_accepts(flavor):
    provider = hsp.HFSandboxProvider("python:3.12", flavor=flavor)
    body = hsp._job_body(provider._settings({"image": "python:3.12"}), "start-label")
    assert emulator_module._create_body_rejection(body, JobsEmulator().flavors) is None


@pytest.mark.parametrize("flavor", ["cpu-huge", "H100", "", "a100", "h100", "h100x8"])  # h100: Spaces hardware
def test_a_flavor_unknown_to_both_is_refused_by_both_naming_it(flavor):
    with pytest.raises(hsp.SandboxConfigError, match="flavor"):
        hsp.HFSandboxProvider("python:3.12", flavor=flavor)
    body = hsp._job_body(hsp.HFSandboxProvider("python:3.12")._settings({"image": "python:3.12"}), "label")
    body["flavor"] = flavor
    assert "flavor" in (emulator_module._create_body_rejection(body, JobsEmulator().flavors) or "")


def test_provider_and_emulator_share_the_job_stages_and_flavors(emu):
    assert hsp.TERMINAL_STAGES == {"COMPLETED", "CANCELED", "ERROR", "DELETED"} and hsp.LIVE_STAGES[0] == "SCHEDULING"
    auth = {"Authorization": "Bearer " + emu.token}
    for stage in hsp.LIVE_STAGES + tuple(hsp.TERMINAL_STAGES):  # the emulator's list filter takes each
        assert requests.get(emu.endpoint + "/api/jobs/local", params={"stage": stage}, headers=auth,
                            timeout=10).status_code == 200
    refused = requests.get(emu.endpoint + "/api/jobs/local", params={"stage": "PAUSED"}, headers=auth, timeout=10)
    assert refused.status_code == 400 and "SCHEDULING, RUNNING, CANCELED, COMPLETED" in refused.json()["error"]
    hardware = requests.get(emu.endpoint + "/api/jobs/hardware", headers=auth, timeout=10).json()
    assert {entry["name"] for entry in hardware} == hsp.KNOWN_FLAVORS


def test_each_shared_fact_and_helper_is_defined_once():
    """The loopback test in proxy.py, the token lookup and the Jobs facts in the core: the other modules
    bind the same objects or read them from there."""
    here = os.path.dirname(proxy_module.__file__)
    modules = ("hf_sandbox_provider.py", "hf_sandbox_training.py", "hf_sandbox_cli.py", "hf_sandbox_pool.py",
               "proxy.py", "hf_jobs_emulator.py", "hf_sbx_emulator.py")
    for definition, home in (("def _is_loopback_host(", "proxy.py"), ("def _discover_token(", "hf_sandbox_provider.py"),
                             ('"rtx-pro-6000x8"', "hf_sandbox_provider.py"), ('"SCHEDULING", "RUNNING"', "hf_sandbox_provider.py"),
                             ("TOKEN_ENV_VARS = ", "hf_sandbox_provider.py")):
        sources = [path for path in modules if definition in Path(here, path).read_text()]
        assert sources == [home], definition
    assert emulator_module._is_loopback_host is proxy_module._is_loopback_host is hsp._is_loopback_host


def test_the_echo_server_path_of_the_emulator_loads_neither_requests_nor_the_core():
    """Every echo-server job process imports hf_jobs_emulator: the Jobs facts are read from the core only by
    the emulator's Hub side, so a job process stays light."""
    script = ("import sys, hf_jobs_emulator\n"
              "print(sorted(m for m in ('requests', 'hf_sandbox_provider', 'huggingface_hub') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(proxy_module.__file__),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and json.loads(result.stdout.replace("'", '"')) == [], result.stderr
