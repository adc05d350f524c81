"""Real OpenEnv on both ends, offline: a server built with openenv's `create_app` runs as the emulator's
job, and openenv's own `GenericEnvClient` talks to it through HFSandboxProvider's base URL, from plain
threads (`.sync()`), in parallel, and with the async `from_docker_image` flow inside a running loop."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

pytest.importorskip("openenv.core.env_server.http_server")
pytest.importorskip("uvicorn")
from openenv.core import GenericEnvClient  # noqa: E402

from hf_jobs_emulator import JobsEmulator  # noqa: E402
from hf_sandbox_provider import HFSandboxProvider  # noqa: E402
from proxy import AuthProxy  # noqa: E402

TIMEOUT = 60  # the job imports fastapi, uvicorn and openenv: a few seconds on a busy 2-core machine
SESSIONS = 16
IMAGE = "registry.hf.space/openenv-counting-echo:latest"  # not pulled: the emulator runs the command

# A real OpenEnv server, built the way OpenEnv environments are, listening on the job's $PORT.
OPENENV_SERVER = '''
import os
import uuid

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class MessageAction(Action):
    message: str


class MessageObservation(Observation):
    echoed_message: str = ""
    message_length: int = 0


class CountingEcho(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return MessageObservation(echoed_message="ready", message_length=0, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        return MessageObservation(echoed_message=action.message, message_length=len(action.message),
                                  reward=len(action.message) * 0.1)

    @property
    def state(self):
        return self._state


app = create_app(CountingEcho, MessageAction, MessageObservation, env_name="counting_echo",
                 max_concurrent_envs=64)
uvicorn.run(app, host="127.0.0.1", port=int(os.environ["PORT"]), log_level="warning")
'''


@pytest.fixture(scope="module")
def server_command(tmp_path_factory):
    script = tmp_path_factory.mktemp("openenv_job") / "server.py"
    script.write_text(OPENENV_SERVER)
    return [sys.executable, str(script)]


def make_provider(emu: JobsEmulator, proxy: AuthProxy, command: list) -> HFSandboxProvider:
    return HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, command=command, proxy=proxy,
                             poll_interval_s=0.1, start_timeout_s=TIMEOUT, ready_timeout_s=TIMEOUT)


def wait_for_no_processes(emu: JobsEmulator) -> None:
    deadline = time.monotonic() + TIMEOUT
    while emu.live_pids():
        assert time.monotonic() < deadline, "job processes outlived the provider"
        time.sleep(0.05)


@pytest.mark.slow  # the job imports fastapi, uvicorn and openenv
def test_sixteen_sync_clients_in_plain_threads_keep_their_own_sessions(emu, proxy, server_command):
    with make_provider(emu, proxy, server_command) as provider:
        base_url = provider.start_container()
        provider.wait_for_ready()
        results = {}
        errors = []

        def session(index: int) -> None:
            try:
                with GenericEnvClient(base_url=base_url).sync() as client:
                    reset = client.reset(episode_id=f"episode-{index}")
                    assert reset.observation["echoed_message"] == "ready"
                    for step in range(index + 1):
                        result = client.step({"message": f"s{index}-{step}"})
                        assert result.observation["echoed_message"] == f"s{index}-{step}"
                    results[index] = client.state()
            except Exception as exc:  # collected: a failing thread must fail the test, not vanish
                errors.append((index, exc))

        threads = [threading.Thread(target=session, args=(i,), name=f"openenv-session-{i}") for i in range(SESSIONS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        assert not any(thread.is_alive() for thread in threads), "a session hung"
        assert errors == []
        for index in range(SESSIONS):
            assert results[index]["episode_id"] == f"episode-{index}"
            assert results[index]["step_count"] == index + 1
    wait_for_no_processes(emu)


@pytest.mark.slow  # the job imports fastapi, uvicorn and openenv
def test_async_from_docker_image_inside_a_running_event_loop(emu, proxy, server_command):
    provider = make_provider(emu, proxy, server_command)
    seen = {}

    async def scenario() -> None:
        assert asyncio.get_running_loop() is not None
        client = await GenericEnvClient.from_docker_image(IMAGE, provider=provider)
        try:
            seen["job_id"] = provider.job_id
            await client.reset(episode_id="in-a-loop")
            step = await client.step({"message": "async"})
            seen["echo"] = step.observation["echoed_message"]
            seen["state"] = await client.state()
        finally:
            await client.close()  # OpenEnv's close() calls provider.stop_container()

    asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    assert seen["echo"] == "async"
    assert seen["state"] == {"episode_id": "in-a-loop", "step_count": 1}
    assert emu.wait_for_stage(seen["job_id"], ["CANCELED"]).stage == "CANCELED"
    wait_for_no_processes(emu)
