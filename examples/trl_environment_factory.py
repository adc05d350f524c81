"""An environment for TRL's `GRPOTrainer(environment_factory=...)`, running in an HF Jobs sandbox.

What TRL 1.16 does with it: it calls `environment_factory()` once per rollout slot (one instance at
trainer init, the others when the first batch needs them, all before the first `reset()`), calls
`reset(**example)` before each episode, offers every public plain or static method except `reset` and
`get_reward` to the model as a tool (docstring and type hints make the schema; classmethods and
properties are not offered), and scores each rollout with `get_reward()`. So `EchoSandboxEnv`:
- begins its sandbox's start when it is built (`hf_sandbox_provider.Sandbox`), in the background, and
  its first `reset()` waits for that job only: N slots wait about one cold start, not N;
- outlives its jobs: the slot starts a successor before a job's `job_timeout` ends and moves to it
  between episodes, and replaces a job that dies; a job lost mid-episode fails that rollout's tool
  call (`EpisodeLost`, which TRL records as a failed call) and the next `reset()` works;
- with `shared="name"` (and `replicas=K`) all slots of the process open their own WebSocket session
  on one group of K jobs instead of one job each (the server must host several sessions);
- talks over `hf_sandbox_provider.EnvSession`: one blocking socket, no event loop;
- is torn down by `EchoSandboxEnv.close_all()` (a classmethod: never offered as a tool), by leaving
  `with env:`, at exit, and on SIGTERM/SIGHUP when `install_signal_teardown()` was called.

    python examples/trl_environment_factory.py --local                    # the environment part, offline
    python examples/trl_environment_factory.py --train                    # GRPO (pip install '.[trl]'), GPU
    python examples/trl_environment_factory.py --train --cpu --steps 2 --batch 4 --model <small model>
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
import weakref
from typing import Any, List, Optional, Sequence

import _common
from hf_sandbox_provider import EnvSession, Sandbox, install_signal_teardown, stop_sandboxes

# A spawned worker imports this module and starts its own sandbox before answering.
WORKER_TIMEOUT_S = 600.0
PHRASES = ("Hello World!", "TRL is great!", "OpenEnv on HF Jobs")


class EchoSandboxEnv:
    """One remote echo environment per rollout slot; `get_reward()` is the episode's total so far.

    `image` and `provider_kwargs` are `HFSandboxProvider`'s; `shared` and `begin` are `Sandbox`'s.
    `teardown_on_signal=True` calls `install_signal_teardown()`: TRL's async rollout worker builds its
    environments on its main thread and is stopped with SIGTERM, which would otherwise leak the jobs.
    """

    _instances: "weakref.WeakSet[EchoSandboxEnv]" = weakref.WeakSet()

    def __init__(self, image: str = _common.DEFAULT_IMAGE, *, shared: Optional[str] = None, begin: bool = True,
                 teardown_on_signal: bool = False, **provider_kwargs: Any) -> None:
        if teardown_on_signal:
            install_signal_teardown()  # opt-in; idempotent; a no-op off the main thread
        self.reward = 0.0
        self.job_id: Optional[str] = None
        self._sandbox = Sandbox(image, shared=shared, begin=begin, **provider_kwargs)  # starts in the background
        self._session: Optional[EnvSession] = None
        EchoSandboxEnv._instances.add(self)

    def reset(self, **kwargs: Any) -> None:
        """Start a new episode on the slot's current job; the first call waits for this slot's sandbox
        (started when it was built). Renewals and replacements happen in the slot, not here."""
        if self._session is None:
            self._session = self._sandbox.session()  # follows the slot's jobs from episode to episode
        self._session.reset()
        self.job_id = (self._sandbox.job_ids or [None])[0]
        self.reward = 0.0

    def echo(self, message: str) -> str:
        """Send a message to the environment, which echoes it back.

        Args:
            message: The text to send.

        Returns:
            The environment's echo of the message.

        A job lost mid-episode raises `EpisodeLost` here: TRL records a failed tool call for this rollout.
        """
        if self._session is None:
            raise RuntimeError("call reset() before using the environment's tools")
        result = self._session.step({"message": message})
        self.reward += float(result.get("reward") or 0.0)
        return result["observation"]["echoed_message"]

    def get_reward(self) -> float:
        """The episode's reward (TRL 1.16 calls this once per finished rollout; never offered as a tool)."""
        return self.reward

    @classmethod
    def close_all(cls) -> None:
        """Close every environment's session and cancel every sandbox job of this process, in parallel.

        Call it when training ends: TRL never closes environments. A classmethod, so TRL does not offer it
        to the model as a tool."""
        for env in list(cls._instances):
            env._close_session()
        stop_sandboxes()

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()  # never raises

    def _close(self) -> None:
        """Close the session and cancel this environment's job (a shared group runs on). Never raises."""
        self._close_session()
        self._sandbox.stop()

    def __enter__(self) -> "EchoSandboxEnv":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._close()

    def __getstate__(self) -> dict:
        """Settings only: a copy opens its own session (its Sandbox refuses if it runs a job of its own)."""
        return dict(self.__dict__, _session=None, job_id=None)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        EchoSandboxEnv._instances.add(self)


def trl_tools(env: Any) -> List[str]:
    """The tools TRL 1.16 derives from an environment: the plain and static methods of its class, except
    `reset`, `get_reward` and names starting with `_` (classmethods and properties are not functions)."""
    return [name for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def episode(env: EchoSandboxEnv) -> str:
    """What a rollout does: reset, call the tool, read the reward."""
    with env:
        env.reset()
        echoes = [env.echo(phrase) for phrase in PHRASES]
        if echoes != list(PHRASES):
            raise RuntimeError("the environment echoed %r" % echoes)
        return "job %s: %d tool calls, reward %.1f" % (env.job_id, len(echoes), env.get_reward())


def worker_episode(factory: Any) -> str:
    """A spawned worker process that gets the pickled factory, as TRL's async rollout worker does, and
    builds and uses the environment from inside a running event loop (the session never needs one)."""
    async def rollout() -> str:
        return episode(factory())
    return asyncio.run(rollout()) + " (pid %d, inside a running event loop)" % os.getpid()


def demo(image: str, settings: dict, spawn_worker: bool = True) -> None:
    factory = functools.partial(EchoSandboxEnv, image, **settings)  # what you hand to GRPOTrainer
    probe = factory(begin=False)  # nothing starts: just the tools and the settings check
    print("tools TRL would offer the model: %s" % trl_tools(probe))
    if trl_tools(probe) != ["echo"]:
        raise RuntimeError("unexpected tools: %s" % trl_tools(probe))
    print("pickled factory: %d bytes" % len(pickle.dumps(factory)))
    print("[this process]   %s (pid %d)" % (episode(factory()), os.getpid()))
    if not spawn_worker:
        print("[spawned worker] skipped: with --local --pool the emulator's TLS host names resolve only in this "
              "process (on the Hub a worker uses the pool like this process)")
        return
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        print("[spawned worker] %s" % pool.submit(worker_episode, factory).result(timeout=WORKER_TIMEOUT_S))


def train(args: Any, settings: dict) -> None:
    """GRPO with one sandbox per rollout slot (or `--shared-jobs K` for all of them)."""
    if args.shared_jobs:
        settings = dict(settings, shared="echo-grpo", replicas=args.shared_jobs,
                        env_vars={"MAX_CONCURRENT_ENVS": str(args.batch)})
    # teardown_on_signal: a SIGTERM (a scheduler, TRL's async worker shutdown) cancels the jobs first.
    factory = functools.partial(EchoSandboxEnv, args.image, teardown_on_signal=True, **settings)
    factory(begin=False)  # settings and token checked now, before minutes of model loading

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = [[{"role": "user", "content": "Make the environment echo '%s'." % p}] for p in PHRASES]
    config = GRPOConfig(output_dir="echo-grpo", max_steps=args.steps, logging_steps=1, use_cpu=args.cpu,
                        per_device_train_batch_size=args.batch, num_generations=args.generations,
                        max_completion_length=256, report_to="none", save_strategy="no")
    trainer = GRPOTrainer(model=args.model, reward_funcs=[], args=config, environment_factory=factory,
                          train_dataset=Dataset.from_dict({"prompt": prompts * args.batch}))
    try:
        trainer.train()
    finally:
        EchoSandboxEnv.close_all()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _common.parser(__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="train with TRL's GRPOTrainer (pip install '.[trl]')")
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B", help="model to train (default: %(default)s)")
    parser.add_argument("--cpu", action="store_true", help="--train on the CPU (slow; for a small model)")
    parser.add_argument("--steps", type=int, default=10, help="--train: optimizer steps (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8,
                        help="--train: rollout slots per step, one sandbox each (default: %(default)s)")
    parser.add_argument("--generations", type=int, default=4,
                        help="--train: completions per prompt; divides --batch (default: %(default)s)")
    parser.add_argument("--shared-jobs", type=int, metavar="K",
                        help="--train: run every slot's session on K shared jobs instead of one job per slot")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.generations < 2 or args.batch % args.generations:
        parser.error("--steps and --batch must be at least 1, --generations at least 2 and a divisor of --batch")
    if args.shared_jobs is not None and not 1 <= args.shared_jobs <= args.batch:
        parser.error("--shared-jobs must be between 1 and --batch")
    if args.train and not all(importlib.util.find_spec(name) for name in ("trl", "datasets", "torch")):
        parser.error("--train needs TRL: pip install torch, then pip install 'hf-sandbox-provider[trl]'")
    with _common.Backend(args) as backend:
        try:
            if args.train:
                train(args, backend.settings)
            else:
                demo(args.image, backend.settings, spawn_worker=not (args.local and args.pool))
            code = _common.EXIT_OK
        except Exception as exc:
            code = _common.failure_exit(exc)
        finally:
            EchoSandboxEnv.close_all()
    return _common.leftover_exit(code, backend)


if __name__ == "__main__":
    sys.exit(main())
