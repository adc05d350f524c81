"""An environment for TRL's `GRPOTrainer(environment_factory=...)`, running in an HF Jobs sandbox.

TRL calls `environment_factory()` per rollout slot and `reset()` before each episode, offers every
other public method to the model as a tool (docstring and type hints make the schema), and passes
the environments to the reward functions. So `EchoSandboxEnv` is:
- picklable until first use (AsyncGRPO ships it to worker processes): the sandbox starts lazily, on
  the first `reset()`, in the process that uses it;
- synchronous: `reset()` and `echo()` block on one socket, with no event loop, so they work from a
  trainer thread and inside a worker's running asyncio loop alike;
- leak-proof: `with env:`, `__del__`, then the provider's safety nets (exit, garbage collection, the
  job's server-side timeout). No public `close()`: TRL would offer it to the model as a tool.

    python examples/trl_environment_factory.py --local     # the environment part, offline
    python examples/trl_environment_factory.py --train     # GRPO training (needs trl, datasets, a model)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib.util
import inspect
import multiprocessing
import os
import pickle
import sys
from typing import Any, List, Optional, Sequence

import _common
from hf_sandbox_provider import HFSandboxProvider

# A spawned worker imports this module and starts its own sandbox before answering.
WORKER_TIMEOUT_S = 600.0
PHRASES = ("Hello World!", "TRL is great!", "OpenEnv on HF Jobs")


class EchoSandboxEnv:
    """One remote echo environment per instance; `reward` is the episode's total so far."""

    def __init__(self, image: str = _common.DEFAULT_IMAGE, **provider_kwargs: Any) -> None:
        self.reward = 0.0
        self.job_id: Optional[str] = None
        self._image = image
        self._provider_kwargs = dict(provider_kwargs)  # plain values only: this object must pickle
        self._provider: Optional[HFSandboxProvider] = None
        self._session: Optional[_common.WSSession] = None

    def reset(self, **kwargs: Any) -> None:
        """Start a new episode; the first call starts the sandbox (tens of seconds on HF Jobs).

        A sandbox lost since the last episode (its job died, the connection broke) is replaced by a
        new one, with a line on stderr; a replacement that cannot start raises.
        """
        if self._session is not None:
            try:
                self._session.request({"type": "reset", "data": {}})
            except (ConnectionError, OSError) as exc:
                print("sandbox job %s lost (%s); starting a new one" % (self.job_id, exc), file=sys.stderr)
                self._close()
        if self._session is None:
            self._start()
            self._session.request({"type": "reset", "data": {}})
        self.reward = 0.0

    def echo(self, message: str) -> str:
        """Send a message to the environment, which echoes it back.

        Args:
            message: The text to send.

        Returns:
            The environment's echo of the message.
        """
        if self._session is None:
            raise RuntimeError("call reset() before using the environment's tools")
        result = self._session.request({"type": "step", "data": {"message": message}})
        self.reward += float(result.get("reward") or 0.0)
        return result["observation"]["echoed_message"]

    def _start(self) -> None:
        self._provider = HFSandboxProvider(self._image, **self._provider_kwargs)
        try:
            self._provider.wait_for_ready(self._provider.start_container())
            self.job_id = self._provider.job_id
            self._session = _common.WSSession(self._provider.base_url or "")
        except BaseException:
            self._close()  # the provider has cancelled a failed job already; this releases the rest
            raise

    def _close(self) -> None:
        """Close the session and cancel the job. Idempotent; never raises (the provider logs problems)."""
        session, self._session = getattr(self, "_session", None), None
        provider, self._provider = getattr(self, "_provider", None), None
        if session is not None:
            session.close()  # never raises
        if provider is not None:
            provider.close()  # never raises

    def __enter__(self) -> "EchoSandboxEnv":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._close()

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:  # at interpreter exit modules may be half gone; the provider's atexit hook runs
            pass

    def __getstate__(self) -> dict:
        if self._provider is not None:
            raise TypeError("EchoSandboxEnv: pickle the environment before its first reset() (each process then "
                            "starts its own sandbox); this one runs job %s" % self.job_id)
        return dict(self.__dict__)


def reward_func(environments: List[EchoSandboxEnv], **kwargs: Any) -> List[float]:
    """TRL passes the episode's environments to reward functions as `environments`."""
    return [env.reward for env in environments]


def trl_tools(env: Any) -> List[str]:
    """The tools TRL derives from an environment: its public methods except reset()."""
    return [name for name, _ in inspect.getmembers(env, inspect.ismethod)
            if not name.startswith("_") and name != "reset"]


def episode(env: EchoSandboxEnv) -> str:
    """What a rollout does: reset, call the tool, read the reward; then check a started env refuses to pickle."""
    with env:
        env.reset()
        echoes = [env.echo(phrase) for phrase in PHRASES]
        if echoes != list(PHRASES):
            raise RuntimeError("the environment echoed %r" % echoes)
        try:
            pickle.dumps(env)
            raise RuntimeError("a started environment was pickled")
        except TypeError:
            pass
        return "job %s: %d tool calls, reward %.1f" % (env.job_id, len(echoes), reward_func([env])[0])


def worker_episode(blob: bytes) -> str:
    """A rollout worker process, as AsyncGRPO runs them: unpickle, then use it inside a running loop."""
    async def rollout() -> str:
        return episode(pickle.loads(blob))
    return asyncio.run(rollout()) + " (pid %d, inside a running event loop)" % os.getpid()


def demo(image: str, settings: dict) -> None:
    env = EchoSandboxEnv(image, **settings)
    print("tools TRL would offer the model: %s" % trl_tools(env))
    if trl_tools(env) != ["echo"]:
        raise RuntimeError("unexpected tools: %s" % trl_tools(env))
    blob = pickle.dumps(env)  # before first use, as AsyncGRPO ships it
    print("pickled before first use: %d bytes" % len(blob))
    print("[this process]   %s (pid %d)" % (episode(pickle.loads(blob)), os.getpid()))
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        print("[spawned worker] %s" % pool.submit(worker_episode, blob).result(timeout=WORKER_TIMEOUT_S))


def train(args: Any, settings: dict) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = [[{"role": "user", "content": "Make the environment echo '%s'." % p}] for p in PHRASES]
    trainer = GRPOTrainer(
        model=args.model, reward_funcs=reward_func, train_dataset=Dataset.from_dict({"prompt": prompts}),
        args=GRPOConfig(output_dir="echo-grpo", max_steps=10, logging_steps=1),
        environment_factory=functools.partial(EchoSandboxEnv, args.image, **settings))  # picklable
    trainer.train()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _common.parser(__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="train with TRL's GRPOTrainer (needs trl)")
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B", help="model to train (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.train and not all(importlib.util.find_spec(name) for name in ("trl", "datasets")):
        parser.error("--train needs TRL: pip install trl datasets")
    with _common.Backend(args) as backend:
        try:
            if args.train:
                train(args, backend.settings)
            else:
                demo(args.image, backend.settings)
            code = _common.EXIT_OK
        except Exception as exc:
            code = _common.failure_exit(exc)
    return _common.leftover_exit(code, backend)


if __name__ == "__main__":
    sys.exit(main())
