"""One loopback rule, one token order, one flavor list and one stage list for provider, proxy and emulator.

They used to keep their own copies and disagreed (only the proxy took `[::1]` and `*.localhost`, the
emulator refused `h100`, the proxy CLI read HF_TOKEN before huggingface_hub's login file while the
provider did the opposite). Each table below is checked through every module's own behaviour, so a
copy that drifts again fails here."""

from __future__ import annotations

import os

import pytest

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
    assert proxy_module._discover_token() == expected
    provider = hsp.HFSandboxProvider("python:3.12")
    if expected is None:
        with pytest.raises(hsp.SandboxConfigError, match="no Hugging Face token"):
            provider._resolve_token()
    else:
        assert provider._resolve_token() == expected
    assert hsp._discover_token is proxy_module._discover_token  # the proxy CLI's own lookup


@pytest.mark.parametrize("flavor", sorted(proxy_module.JOB_FLAVORS))
def test_every_flavor_the_provider_sends_the_emulator_accepts(flavor):
    provider = hsp.HFSandboxProvider("python:3.12", flavor=flavor)
    body = hsp._job_body(provider._settings({"image": "python:3.12"}), "start-label")
    assert emulator_module._create_body_rejection(body) is None


@pytest.mark.parametrize("flavor", ["cpu-huge", "H100", "", "a100", "h100", "h100x8"])  # h100: Spaces hardware
def test_a_flavor_unknown_to_both_is_refused_by_both_naming_it(flavor):
    with pytest.raises(hsp.SandboxConfigError, match="flavor"):
        hsp.HFSandboxProvider("python:3.12", flavor=flavor)
    body = hsp._job_body(hsp.HFSandboxProvider("python:3.12")._settings({"image": "python:3.12"}), "label")
    body["flavor"] = flavor
    assert "flavor" in (emulator_module._create_body_rejection(body) or "")


def test_provider_and_emulator_share_the_job_stages():
    assert hsp.TERMINAL_STAGES == set(emulator_module.TERMINAL_STAGES) == set(proxy_module.JOB_TERMINAL_STAGES)
    assert set(emulator_module.ALL_STAGES) == set(proxy_module.JOB_LIVE_STAGES) | hsp.TERMINAL_STAGES
    assert hsp.KNOWN_FLAVORS == set(emulator_module.FLAVORS)


def test_the_shared_block_is_the_only_copy():
    """Each helper is defined once, in proxy.py: the other modules bind the same objects."""
    for name in ("_is_loopback_host", "_discover_token"):
        sources = [path for path in ("hf_sandbox_provider.py", "hf_sandbox_training.py", "hf_sandbox_cli.py",
                                     "proxy.py", "hf_jobs_emulator.py")
                   if "def %s(" % name in open(os.path.join(os.path.dirname(proxy_module.__file__), path)).read()]
        assert sources == ["proxy.py"], name
    assert emulator_module._is_loopback_host is proxy_module._is_loopback_host is hsp._is_loopback_host
