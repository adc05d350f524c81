"""OpenEnv's own WebSocket client (`GenericEnvClient`) on an HF Jobs sandbox, sync and async.

`HFSandboxProvider` is an OpenEnv `ContainerProvider`, so OpenEnv's client works unmodified on its
`base_url`. Two ways, both shown here:

1. sync: start the provider yourself, then use `GenericEnvClient(base_url).sync()` from plain code;
2. async: inside `asyncio.run(...)`, `await GenericEnvClient.from_docker_image(image, provider=...)`.
   The provider's calls block (HTTP polling, no event loop of its own), which is fine inside a
   running loop: this loop just waits for them. Use `await asyncio.to_thread(provider.start_container)`
   when other tasks must keep running meanwhile.

    python examples/openenv_client.py --local     # local Jobs emulator, no token, no network
    python examples/openenv_client.py             # real HF Jobs (needs `pip install openenv-core`)
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Dict, Optional, Sequence

import _common
from hf_sandbox_provider import HFSandboxProvider

MESSAGES = ("Hello", "from OpenEnv's", "WebSocket client")


def sync_episode(image: str, settings: Dict[str, Any]) -> float:
    """Provider first, then OpenEnv's sync client; leaving both blocks closes the session and the job."""
    from openenv.core import GenericEnvClient

    with HFSandboxProvider(image, **settings) as provider:
        base_url = provider.start_container()
        provider.wait_for_ready(base_url)
        print("[sync]  job %s ready in %.1fs, base URL %s" % (provider.job_id, provider.timings["ready"], base_url))
        with GenericEnvClient(base_url=base_url).sync() as env:
            env.reset()
            total = 0.0
            for message in MESSAGES:
                result = env.step({"message": message})
                check_echo(result.observation, message)
                total += result.reward or 0.0
                print("[sync]  step -> %-20r reward %.1f" % (result.observation["echoed_message"], result.reward))
            print("[sync]  state -> %s" % env.state())
    print("[sync]  job %s is %s" % (provider.job_id, provider.stage))
    return total


async def async_episode(image: str, settings: Dict[str, Any]) -> float:
    """OpenEnv's own flow: from_docker_image() starts the job; client.close() stops it (even on error)."""
    from openenv.core import GenericEnvClient

    provider = HFSandboxProvider(**settings)
    try:
        env = await GenericEnvClient.from_docker_image(image, provider=provider)
    except BaseException:
        provider.close()  # a failed start has cancelled its job already; this makes sure
        raise
    print("[async] job %s ready, base URL %s" % (provider.job_id, provider.base_url))
    try:
        await env.reset()
        total = 0.0
        for message in MESSAGES:
            result = await env.step({"message": message})
            check_echo(result.observation, message)
            total += result.reward or 0.0
            print("[async] step -> %-20r reward %.1f" % (result.observation["echoed_message"], result.reward))
        return total
    finally:
        await env.close()  # disconnects, then calls provider.stop_container()
        print("[async] job %s is %s" % (provider.job_id, provider.stage))


def check_echo(observation: Dict[str, Any], message: str) -> None:
    if observation.get("echoed_message") != message:
        raise RuntimeError("the environment echoed %r for %r" % (observation.get("echoed_message"), message))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        print("error: this example needs OpenEnv's client: pip install openenv-core", file=sys.stderr)
        return _common.EXIT_USAGE
    with _common.Backend(args) as backend:
        try:
            sync_total = sync_episode(args.image, backend.settings)
            async_total = asyncio.run(async_episode(args.image, backend.settings))
            print("both episodes done: total reward sync %.1f, async %.1f" % (sync_total, async_total))
            code = _common.EXIT_OK
        except Exception as exc:
            code = _common.failure_exit(exc)
    return _common.leftover_exit(code, backend)


if __name__ == "__main__":
    sys.exit(main())
