"""Plumbing shared by the examples: their flags and the `--local` Jobs emulator.

Nothing here is needed to use the library; it keeps each example about its own user path. The
blocking WebSocket session the examples use is the library's `EnvSession` (hf_sandbox_training.py,
importable from hf_sandbox_provider).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Dict, List

# Run from a checkout without installing: the library modules sit one folder up.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)

# OpenEnv's echo environment, published as a Space image; $HF_SANDBOX_IMAGE overrides it, as for `smoke`.
DEFAULT_IMAGE = os.environ.get("HF_SANDBOX_IMAGE") or "registry.hf.space/openenv-echo-env:latest"
# Exit codes, the same as `python -m hf_sandbox_provider smoke`.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def parser(description: str) -> argparse.ArgumentParser:
    """The flags every example takes: --local, --image, --flavor, --command, --pool, -v."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--local", action="store_true",
                   help="run against a local HF Jobs emulator and its echo server (no token, no network)")
    p.add_argument("--image", default=DEFAULT_IMAGE, help="environment image (default: %(default)s)")
    p.add_argument("--flavor", default="cpu-basic", help="HF Jobs hardware flavor (default: %(default)s)")
    p.add_argument("--command", help="the job's server command (default: OpenEnv's uvicorn "
                   "command; the local emulator plays it with its echo server)")
    p.add_argument("--pool", metavar="NAME", help="pooled placement: each environment a sandbox of the named "
                   "SandboxPool's host jobs instead of its own job (docs/pool.md)")
    p.add_argument("-v", "--verbose", action="store_true", help="log each job's stage changes")
    return p


class Backend:
    """Where the jobs run: the Hub (token from the environment) or, with --local, a JobsEmulator.

    `settings` are the HFSandboxProvider keywords for it. Leaving the block stops the emulator and
    records any job process it could not end in `leftovers` (which must stay empty).
    """

    def __init__(self, args: argparse.Namespace, **emulator_settings: Any) -> None:
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(asctime)s %(name)s %(message)s")
        if not args.verbose:
            # The proxy warns about every 502 it answers, including the /health probes that reach a
            # job still booting; those are expected here, so they only show with -v.
            logging.getLogger("proxy").setLevel(logging.ERROR)
        self.settings: Dict[str, Any] = {"flavor": args.flavor}
        if args.command:
            self.settings["command"] = args.command
        if args.pool:
            self.settings["pool"] = args.pool
        self.pool = args.pool
        self.emulator: Any = None
        self.leftovers: List[str] = []
        if args.local:
            import hf_jobs_emulator
            from hf_sandbox_cli import SMOKE_POOL_EMULATOR, _local_pool_rejection
            reason = _local_pool_rejection(hf_jobs_emulator) if args.pool else None
            if reason:  # a package to install: one line, the usage exit code, no traceback
                print("error: %s" % reason, file=sys.stderr)
                raise SystemExit(EXIT_USAGE)
            settings = dict(SMOKE_POOL_EMULATOR if args.pool else {}, **emulator_settings)
            try:
                self.emulator = hf_jobs_emulator.JobsEmulator(**settings)
            except ValueError as exc:  # e.g. an unknown fault: a usage error, in one line
                print("error: %s" % exc, file=sys.stderr)
                raise SystemExit(EXIT_USAGE) from None

    def __enter__(self) -> "Backend":
        if self.emulator is not None:
            self.emulator.start()
            self.settings.update(endpoint=self.emulator.endpoint, token=self.emulator.token)
            if self.pool:  # TLS hosts huggingface_hub trusts (as smoke --local --pool)
                from hf_sandbox_cli import _local_pool_settings
                self._undo_pool_settings = _local_pool_settings(self.settings, self.emulator)
            print("local HF Jobs emulator at %s" % self.emulator.endpoint)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.pool:
            from hf_sandbox_pool import close_pools
            close_pools()  # the host jobs this run booted (the Hub's too)
        if getattr(self, "_undo_pool_settings", None) is not None:
            self._undo_pool_settings()  # the pool cache's temporary directory, the TLS trust it set
        if self.emulator is None:
            return
        problems = self.emulator.stop()  # names what it could not end, e.g. "job 6b00... pid 123"
        self.leftovers = list(problems) or ["pid %d" % pid for pid in self.emulator.live_pids()]
        print("local emulator stopped: %d jobs run, %d job processes left"
              % (len(self.emulator.jobs), len(self.leftovers)))
        if self.leftovers:
            print("error: job processes still running: %s" % ", ".join(self.leftovers), file=sys.stderr)


def failure_exit(exc: BaseException) -> int:
    """Print why the run failed and return its exit code (2 for a usage or configuration error)."""
    from hf_sandbox_provider import SandboxConfigError
    print("error: %s: %s" % (type(exc).__name__, exc), file=sys.stderr)
    causes = [error for _, error in getattr(exc, "errors", [])] or [exc]  # StartManyError lists its causes
    return EXIT_USAGE if all(isinstance(c, SandboxConfigError) for c in causes) else EXIT_FAILED


def leftover_exit(code: int, backend: Backend) -> int:
    """The run's exit code, made a failure when a job process outlived it."""
    return EXIT_FAILED if backend.leftovers and code == EXIT_OK else code


