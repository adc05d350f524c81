"""A legacy requests-based OpenEnv client (HTTP `/reset`, `/step`, `/state`) on an HF Jobs sandbox.

Older training stacks talk to environments with a small client in the shape of OpenEnv's original
`HTTPEnvClient`: `from_docker_image(image, provider)` calls `provider.start_container(image, ...)` and
`provider.wait_for_ready(base_url)`, every call goes through one `requests.Session`, and `close()`
calls `provider.stop_container()`. Passing an `HFSandboxProvider` is the only change such a client
needs: the base URL is the local auth proxy, which adds the HF token on the way to the job.

    python examples/legacy_http_client.py --local     # local Jobs emulator, no token, no network
    python examples/legacy_http_client.py             # a real HF Job (token from HF_TOKEN or `hf auth login`)

Note: OpenEnv >= 0.2 servers make a fresh environment for every HTTP request (sessions live on the
WebSocket, see openenv_client.py); the echo environment does not mind.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence

import requests

import _common
from hf_sandbox_provider import HFSandboxProvider


class LegacyHTTPEnvClient:
    """The legacy client shape: one base URL, one session, JSON in and out, provider-managed lifetime."""

    def __init__(self, base_url: str, request_timeout_s: float = 15.0, provider: Optional[Any] = None) -> None:
        self._base = base_url.rstrip("/")
        self._timeout = request_timeout_s
        self._provider = provider
        self._http = requests.Session()
        self._http.trust_env = False  # the base URL is the loopback proxy: never send it through HTTP(S)_PROXY

    @classmethod
    def from_docker_image(cls, image: str, provider: Any, **kwargs: Any) -> "LegacyHTTPEnvClient":
        """Start the image with `provider` (any OpenEnv ContainerProvider), wait until it serves, connect."""
        base_url = provider.start_container(image, **kwargs)
        provider.wait_for_ready(base_url)  # on failure the provider has already cancelled its job
        return cls(base_url, provider=provider)

    def reset(self) -> Dict[str, Any]:
        return self._post("/reset", {})

    def step(self, action: Dict[str, Any]) -> Dict[str, Any]:
        return self._post("/step", {"action": action})

    def state(self) -> Dict[str, Any]:
        response = self._http.get(self._base + "/state", timeout=self._timeout)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        """Close the HTTP session and stop the sandbox (cancels the HF Job)."""
        self._http.close()
        if self._provider is not None:
            self._provider.stop_container()

    def _post(self, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
        response = self._http.post(self._base + path, json=body, timeout=self._timeout)
        if response.status_code >= 400:
            # The proxy marks its own failures (job unreachable, timeout) so they are not mistaken
            # for the environment refusing the request.
            kind = response.headers.get("X-Proxy-Error")
            who = "proxy (%s)" % kind if kind else "environment"
            raise RuntimeError("%s %s: HTTP %d from the %s: %s" % (
                "POST", path, response.status_code, who, response.text[:200]))
        return response.json()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    with _common.Backend(args) as backend:
        code = run(args, backend)
    return _common.leftover_exit(code, backend)


def run(args: Any, backend: _common.Backend) -> int:
    provider = None
    try:
        provider = HFSandboxProvider(**backend.settings)
        env = LegacyHTTPEnvClient.from_docker_image(args.image, provider=provider)
    except Exception as exc:
        if provider is not None:
            provider.close()  # a failed start cancels its job itself; closing again is harmless
        return _common.failure_exit(exc)
    print("job %s is serving (%s); client base URL %s" % (provider.job_id, provider.job_url, provider.base_url))
    try:
        result = env.reset()
        print("reset  -> %s" % result["observation"])
        total = 0.0
        for message in ("Hello", "from a legacy", "HTTP client"):
            result = env.step({"message": message})
            echoed = result["observation"]["echoed_message"]
            if echoed != message:
                raise RuntimeError("the environment echoed %r for %r" % (echoed, message))
            total += result.get("reward") or 0.0
            print("step   -> %-16r reward %.1f" % (echoed, result.get("reward") or 0.0))
        print("state  -> %s" % env.state())
        print("episode done: total reward %.1f" % total)
        return _common.EXIT_OK
    except Exception as exc:
        return _common.failure_exit(exc)
    finally:
        env.close()
        print("sandbox stopped: job %s is %s" % (provider.job_id, provider.stage))


if __name__ == "__main__":
    sys.exit(main())
