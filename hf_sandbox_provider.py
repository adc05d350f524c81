"""Run OpenEnv environment servers as Hugging Face Jobs, fronted by a local auth proxy: the core.

`HFSandboxProvider` implements OpenEnv's `ContainerProvider` on HF Jobs: it submits a job serving the environment on an
exposed port, waits for the job's URL, mounts it on a shared loopback `AuthProxy` (which adds the bearer token) and
returns the proxy's base URL, usable by any unmodified OpenEnv client. Synchronous and threads-only, so it embeds in any
training stack. Many environments per process are a first-class path: every provider shares one proxy, one job watcher
thread (one Jobs API call per interval for all starting jobs) and one API budget per token; `start_many()` launches n
with bounded concurrency, all or nothing; `replicas=K` puts K jobs of one image behind one route.

Imports `proxy` and no layer: hf_sandbox_training.py, hf_sandbox_pool.py (via `_register_placement`) and
hf_sandbox_cli.py import this module, which loads them on use (`_LAYERS`, `_PLACEMENT_LAYERS`). Vendoring: copy this
file and proxy.py, plus each layer you use; a missing one is named by its file.
"""

from __future__ import annotations

import abc
import atexit
import concurrent.futures
import contextlib
import difflib
import email.utils
import enum
import functools
import hashlib
import http.client
import importlib.util  # binds importlib too
import itertools
import json
import logging
import os
import queue
import random
import re
import shlex
import sys
import threading
import time
import traceback  # (a traceback logged as text: a record kept with exc_info would hold providers)
import uuid
import weakref
from collections import deque, namedtuple
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import urlsplit

import requests
import urllib3.exceptions

if __package__:  # vendored inside a package: the proxy module sits next to this one
    from . import proxy as _proxy
else:
    import proxy as _proxy

InsecureURLError = _proxy.InsecureURLError
_is_loopback_host, _start_thread, _library_signal_mask = (  # one copy each
    _proxy._is_loopback_host, _proxy._start_thread, _proxy._library_signal_mask)

__all__ = [  # the provider and its errors; the layers' names join at the end of the module
    "HFSandboxProvider", "Phase", "SandboxError", "SandboxConfigError", "JobFailedError", "JobStartTimeout",
    "JobsAPIError", "StartManyError", "ReplicaStartError", "stop_all", "InsecureURLError",
    "DEFAULT_COMMAND_TEMPLATE", "KNOWN_FLAVORS"]

# The layers (see the docstring): module -> its public names, re-exported lazily by `__getattr__`.
_LAYERS: Dict[str, List[str]] = {
    "hf_sandbox_training": """EnvSession SessionError SessionRefusedError SessionTimeout EnvError Sandbox stop_sandboxes
        EpisodeLost install_signal_teardown uninstall_signal_teardown SESSION_TIMEOUT_S SESSION_CONNECT_TIMEOUT_S
        SESSION_CLOSE_WAIT_S SESSION_MAX_MESSAGE_BYTES SESSION_REFUSAL_BODY_CHARS BACKGROUND_MAX_PARALLEL
        BACKGROUND_STOP_WAIT_S BACKGROUND_STOP_REPEAT_S SIGNAL_TEARDOWN_BUDGET_S EXIT_TEARDOWN_BUDGET_S""".split(),
    "hf_sandbox_cli": """main SMOKE_DEFAULT_IMAGE SMOKE_DEFAULT_ACTION SMOKE_WS_STEPS SMOKE_REQUEST_TIMEOUT_S EXIT_OK
        EXIT_FAILED EXIT_USAGE""".split()}

__version__ = "0.1.0"

logger = logging.getLogger("hf_sandbox_provider")

# -- Constants -------------------------------------------------------------------------------------
DEFAULT_ENDPOINT = "https://huggingface.co"  # HF_ENDPOINT overrides it (mirrors, staging, emulator)
DEFAULT_PORT = 8000  # what OpenEnv servers listen on in every image built from OpenEnv's template
DEFAULT_FLAVOR = "cpu-basic"  # the cheapest: OpenEnv environment servers are CPU-bound HTTP servers
DEFAULT_JOB_TIMEOUT_S = 3600  # always sent: the Hub ends the job then, even if this client died
DEFAULT_START_TIMEOUT_S = 600.0  # to the URL: CPU jobs in 4-11 s; GPU ones, big images in minutes
DEFAULT_READY_TIMEOUT_S = 300.0  # from URL to a 200 on /health: image pull plus server boot
# The job watcher makes ONE call per interval for the whole process (a `list` by this process's label):
DEFAULT_POLL_INTERVAL_S = 0.5  # a stage change is seen within 0.5 s for at most 60 calls per 30 s wave
MAX_SECONDS = 1e9  # longer durations are refused: no job runs 30 years, and a wait that long overflows the clock
WATCH_SLOWDOWN_AFTER_S = 30.0  # jobs that waited this long are slow (minutes): refreshed every WATCH_SLOW_INTERVAL_S
WATCH_SLOW_INTERVAL_S = 5.0  # so a long wait costs ~60 calls per 5 minutes instead of ~600
HEALTH_PROBE_FIRST_S = 0.05  # /health, probed through the local proxy (no API call): a fast boot is seen within ~0.1 s
HEALTH_PROBE_GROWTH = 1.3  # quickly at first, then less often up to the cap
HEALTH_PROBE_INTERVAL_S = 0.5  # the cap, so a slow image is not flooded with probes
HEARTBEAT_S = 10.0  # a start that waits (minutes on the Hub) logs its stage this often (INFO)
HEALTH_PROBE_TIMEOUT_S = (5.0, 10.0)  # per /health probe: a wedged server must not eat the budget
API_TIMEOUT_S = (10.0, 30.0)  # Jobs API calls: (connect, read)
API_MAX_RETRIES = 5  # for 429/5xx/connection failures of API calls, with full-jitter exponential backoff
API_BACKOFF_BASE_S, API_BACKOFF_CAP_S = 0.5, 20.0
RETRY_AFTER_CAP_S = 60.0  # a server asking for a longer pause is waited for only this long
CANCEL_ATTEMPTS, CANCEL_BACKOFF_CAP_S = 3, 2.0  # teardown retries a failed cancel briefly: in `finally` blocks, at exit
LOG_TAIL_LINES, LOG_FETCH_TIMEOUT_S = 40, 5.0  # JobFailedError's log tail, bounded (a running job's log never ends)
LIST_MAX_PAGES = 50  # `list` pages (Link: rel="next"): more is a loop or thousands of jobs
# Names of the one public Hub: a next-page link may use either (any other host would get the token).
HUB_HOST_NAMES = frozenset({"huggingface.co", "hf.co"})
# A proxy route id in a URL: the loopback credential, never printed (repr, errors). (base64: 4 characters per 3 bytes)
_hide_route = functools.partial(re.compile(r"/[A-Za-z0-9_-]{%d}(?=/|$|\?)" % (-(-_proxy.ROUTE_ID_BYTES // 3) * 4)).sub,
                                "/<route id>")
PROVIDER_LABEL_KEY = "hf-sandbox-provider"  # a label on every job this library makes: `sweep` finds leftovers by it
PROVIDER_LABEL_VALUE = "1"
START_LABEL_KEY = "hf-sandbox-start"  # one unique per start: a lost create answer's job is found by it
PROCESS_LABEL_KEY = "hf-sandbox-process"  # one per process: the watcher lists all of this process's jobs with one call
LABEL_MAX_CHARS = 100  # the Hub's rule: label keys and values of at most this many [A-Za-z0-9_-]
RATE_LIMIT_CALLS = 1000  # the Hub's, per user and fixed 5-minute window (free; PRO 2,500, Team 3,000, Enterprise 6,000)
RATE_LIMIT_WINDOW_S = 300.0  # used until RateLimit headers say what is left; or HF_SANDBOX_RATE_LIMIT (e.g. "2500/300")
RATE_LIMIT_ENV = "HF_SANDBOX_RATE_LIMIT"
RATE_LIMIT_RESOURCE = "api"  # the bucket the budget follows (whoami-v2 has its own, smaller one)
# Below this fraction left, calls are spread over the time to the reset, paced by the server's count:
RATE_LIMIT_PACE_BELOW = 0.25  # it falls with every process's calls, so N processes slow down together without talking
RATE_LIMIT_RESERVE, RATE_LIMIT_RESERVE_MIN = 0.05, 5  # of the quota (at least _MIN calls, never all of it): for cancels
RATE_LIMIT_RECHECK_S = 2.0  # a call held here looks again this often: others' answers count too
RATE_LIMIT_RESET_MARGIN_S = 1.0  # added to a 429's reset, as huggingface_hub does (`t` is rounded)
# Jobs missing from the watcher's `list` (ended, or not listed yet) inspected per refresh, at most:
WATCH_MAX_INSPECTS = 8  # a burst of endings cannot turn one call per interval into hundreds
DEFAULT_MAX_PARALLEL = 64  # start_many(): at once by default (spreads the creates and probes)
PROGRESS_STEP = 0.05  # start_many(progress=True): at most a line per this fraction of the environments ...
PROGRESS_INTERVAL_S = 1.0  # ... or this many seconds
MAX_REPLICAS = 64  # jobs behind one route; beyond, use start_many() or several providers
REPLICA_CHECK_INTERVAL_S = 5.0  # replica_status() inspects a sick replica this often (API budget)
PROXY_PROCESS = "process"  # one shared AuthProxy child process: relaying costs the trainer no GIL
STOP_PARALLEL = 32  # stop_all(): cancels at a time (each one API call plus a brief retry)
STOP_WAIT_S = 30.0  # stop_container() waits for another thread's start: no job appears after it
EXIT_SETTLE_S = 15.0  # at exit, cancels and creates still under way (e.g. a 429's wait) get this long, then are named
RESCUE_RESERVE_S = 1.5  # of that wait (at most half), kept to list and cancel a job that a create still under way made
_NEVER = threading.Event()  # the stop of a Jobs API call no stop gives up: never set
LIVE_STAGES = ("SCHEDULING", "RUNNING")  # huggingface_hub's JobStage: the live ones, in the order a job passes them
TERMINAL_STAGES = frozenset({"COMPLETED", "CANCELED", "ERROR", "DELETED"})  # ... and the terminal ones
# Order of the live stages, least advanced first (an unknown live stage counts as not running yet).
_LIVE_STAGE_ORDER = {None: 0, **{stage: order for order, stage in enumerate(LIVE_STAGES, 1)}}
# OpenEnv's image template's CMD (openenv_env/server/Dockerfile), `exec` so the server gets the stop signal.
DEFAULT_COMMAND_TEMPLATE = ("sh", "-c", "cd /app/env && exec uvicorn server.app:app --host 0.0.0.0 --port {port}")
# huggingface_hub 2.4's JobHardware, for one without Jobs (`_flavor_rejection()` adds the live lists).
KNOWN_FLAVORS = frozenset({
    "cpu-basic", "cpu-upgrade", "cpu-performance", "cpu-xl", "t4-small", "t4-medium", "l4x1", "l4x4", "l40sx1",
    "l40sx4", "l40sx8", "a10g-small", "a10g-large", "a10g-largex2", "a10g-largex4", "a100-large", "a100x4", "a100x8",
    "h200", "h200x2", "h200x4", "h200x8", "rtx-pro-6000", "rtx-pro-6000x2", "rtx-pro-6000x4", "rtx-pro-6000x8"})
SPACES_ONLY_HARDWARE = frozenset({"h100", "h100x8", "zero-a10g"})  # never Jobs flavors, if listed
TOKEN_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")  # read first, as huggingface_hub does
# Image references of HF Spaces, sent as `spaceId` rather than `dockerImage` (as huggingface_hub does).
SPACE_IMAGE_PREFIXES = ("https://huggingface.co/spaces/", "https://hf.co/spaces/",
                        "huggingface.co/spaces/", "hf.co/spaces/")
_OVERRIDABLE = ("command", "flavor", "namespace", "secrets", "labels", "job_timeout", "start_timeout_s",
                "ready_timeout_s", "poll_interval_s", "verify", "replicas", "pool")
USER_AGENT = "hf-sandbox-provider/" + __version__
_STATUS_HINTS = {  # what a Jobs API error answer adds, by HTTP status
    401: "Check the token (HF_TOKEN or `hf auth login`)", 404: "Check the namespace and job id",
    402: "The namespace needs a payment method or credits to run Jobs",
    403: "The token lacks permission to run Jobs in this namespace (a fine-grained token needs 'jobs' write access)",
    429: "The Jobs API rate limit (about 1,000 calls per 5 minutes) was hit; poll less often"}
_Failures = Sequence[Tuple[int, BaseException]]  # (index, exception) per failed start of a group


# -- Errors ----------------------------------------------------------------------------------------
class SandboxError(RuntimeError):
    """Base class of every error this module raises on purpose."""

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickled by message and attributes, not constructor arguments: a worker process's error arrives whole."""
        return (_unpickled_error, (type(self), self.args), self.__dict__)


def _unpickled_error(cls: type, args: Tuple[Any, ...]) -> BaseException:
    error = (OSError if issubclass(cls, OSError) else Exception).__new__(cls, *args)  # (an OSError: its own)
    error.args = args  # here, not by __init__, whose arguments are not these
    return error


class SandboxConfigError(SandboxError, ValueError):
    """A bad argument or missing credential, found before any network call."""


class JobFailedError(SandboxError):
    """The job reached a terminal stage before serving; carries its stage, message and log tail."""

    def __init__(self, job_id: str, stage: str, message: Optional[str], log_tail: Sequence[str] = ()):
        self.job_id, self.stage, self.message, self.log_tail = job_id, stage, message, list(log_tail)
        tail = ("--- last %d log lines ---\n%s" % (len(self.log_tail), "\n".join(self.log_tail))
                if self.log_tail else "(no log lines could be fetched)")
        super().__init__("HF job %s ended with stage %s before it was ready: %s\n%s" % (
            job_id, stage, message or "(no message from the Jobs API)", tail))


class JobStartTimeout(SandboxError, TimeoutError):
    """The job did not expose its URL, or its server did not answer /health, in time."""

    def __init__(self, message: str, job_id: Optional[str] = None, stage: Optional[str] = None):
        self.job_id, self.stage = job_id, stage
        super().__init__(message)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0]


class _StartFailures(SandboxError):
    """Some starts of a group failed: `errors` holds `(index, exception)` per failure, in index order,
    `aborted` counts the starts given up because of them. The message names each failure on a line."""

    def __init__(self, headline: str, item: str, errors: _Failures, aborted: int):
        self.errors, self.aborted = sorted(errors, key=lambda pair: pair[0]), aborted
        super().__init__("\n".join([headline] + ["  %s %d: %s: %s" % (item, index, type(exc).__name__, _first_line(exc))
                                                 for index, exc in self.errors]))


class StartManyError(_StartFailures):
    """start_many() could not bring every environment up; every job it started was cancelled."""

    def __init__(self, total: int, errors: _Failures, aborted: int = 0):
        super().__init__("%d of %d environments failed to start (%d more were cancelled before they were "
                         "ready; every job started was cancelled):" % (len(errors), total, aborted),
                         "environment", errors, aborted)


class ReplicaStartError(_StartFailures):
    """Some of K replica jobs failed to start or get ready; all K were cancelled (`job_ids`)."""

    def __init__(self, phase: str, total: int, errors: _Failures, aborted: int, job_ids: Sequence[str]):
        self.job_ids = list(job_ids)
        super().__init__("%d of %d replicas failed to %s (%d more were given up; every replica job was cancelled: "
                         "%s):" % (len(errors), total, phase, aborted, ", ".join(self.job_ids) or "none was created"),
                         "replica", errors, aborted)


class JobsAPIError(SandboxError):
    """The Jobs REST API answered with an error (or could not be reached). `may_have_acted` is False when
    no attempt of the call can have reached the server: a failed create then made no job."""

    def __init__(self, action: str, status_code: Optional[int], server_message: Optional[str],
                 request_id: Optional[str] = None, hint: Optional[str] = None):
        self.action, self.status_code, self.server_message = action, status_code, server_message
        self.request_id, self.may_have_acted = request_id, True
        super().__init__("%s failed: %s%s%s%s" % (action, "HTTP %d" % status_code if status_code else "no answer",
                                                  ": " + server_message if server_message else "",
                                                  " (request id %s)" % request_id if request_id else "",
                                                  ". " + hint if hint else ""))


# -- The job lifecycle: one explicit phase per provider (in the spirit of wsproto's ConnectionState) ---
class Phase(enum.Enum):
    """Where a provider is in its job's life. Only `_move()` changes it (locked, along `_PHASE_MOVES`): races agree."""

    IDLE = "idle"              # no job: start_container() may begin (also after a stop)
    SUBMITTING = "submitting"  # a start is claimed; its create call is in flight, no job recorded yet
    STARTING = "starting"      # the job is recorded (any teardown cancels it); waiting for its URL, mounting
    RUNNING = "running"        # start_container() returned: the job serves behind the mounted route
    STOPPING = "stopping"      # torn down while the start still runs in its thread; it gives up at its next check


# The only phase changes. A start: IDLE -> SUBMITTING -> STARTING -> RUNNING. A teardown: RUNNING -> IDLE, or with
# the start in flight -> STOPPING, made IDLE as it returns (STARTING first if its create answers late: then cancelled).
_PHASE_MOVES = {
    Phase.IDLE: frozenset({Phase.SUBMITTING, Phase.IDLE}),
    Phase.SUBMITTING: frozenset({Phase.STARTING, Phase.STOPPING, Phase.IDLE}),
    Phase.STARTING: frozenset({Phase.RUNNING, Phase.STOPPING}),
    Phase.RUNNING: frozenset({Phase.IDLE}),
    Phase.STOPPING: frozenset({Phase.STARTING, Phase.STOPPING, Phase.IDLE})}
_START_IN_FLIGHT = frozenset({Phase.SUBMITTING, Phase.STARTING, Phase.STOPPING})  # a start runs
_JOB_HELD = frozenset({Phase.STARTING, Phase.RUNNING})  # a job is recorded: a teardown cancels it
# What one teardown took from its provider: the job to cancel (None if none is held) and its route.
_Detached = namedtuple("_Detached", "job_id namespace job_url base_url proxy client twin_label")


# -- The provider ----------------------------------------------------------------------------------
class HFSandboxProvider:
    """One OpenEnv environment server run as an HF Job behind the local auth proxy. Settings are checked before
    any network call; `stop_container()`, a failure after the create, exit or `job_timeout` end the job."""

    # What a pickled provider carries: its settings (and explicit token), never its job, lock, threads
    # or sockets. A subclass with settings of its own adds their names (like requests' Session.__attrs__).
    _pickled_settings: Tuple[str, ...] = _OVERRIDABLE + (
        "image", "port", "endpoint", "env_vars", "_token", "warn_env_credentials")

    def __init__(self, image: Optional[str] = None, *, command: Union[None, str, Sequence[str]] = None,
                 port: int = DEFAULT_PORT, flavor: str = DEFAULT_FLAVOR, namespace: Optional[str] = None,
                 token: Optional[str] = None, endpoint: Optional[str] = None,
                 env_vars: Optional[Mapping[str, Any]] = None, secrets: Optional[Mapping[str, Any]] = None,
                 labels: Optional[Mapping[str, str]] = None,
                 job_timeout: Union[int, float, str] = DEFAULT_JOB_TIMEOUT_S,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S, ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
                 poll_interval_s: float = DEFAULT_POLL_INTERVAL_S, verify: Union[bool, str] = True,
                 proxy: Union[None, str, "_proxy.AuthProxy"] = None,
                 replicas: int = 1, pool: Any = None, warn_env_credentials: bool = True) -> None:
        self.image, self.command, self.port, self.flavor = image, command, port, flavor
        self.namespace, self.endpoint = namespace, _resolve_endpoint(endpoint)
        self.env_vars, self.secrets, self.labels = _as_dict(env_vars), _as_dict(secrets), _as_dict(labels)
        self.job_timeout, self.start_timeout_s, self.ready_timeout_s = job_timeout, start_timeout_s, ready_timeout_s
        self.poll_interval_s, self.verify, self.replicas = poll_interval_s, verify, replicas
        self.pool = pool  # None: a dedicated job; a pool name or SandboxPool: pooled (hf_sandbox_pool)
        self.warn_env_credentials, self._token, self._proxy = warn_env_credentials, token, proxy
        _raise_if_rejected(_proxy_rejection(proxy) or _settings_rejection(self._settings({}), image_required=False))
        if warn_env_credentials:
            _warn_credential_env_vars(self.env_vars)
        self._init_runtime_state()

    def start_container(self, image: Optional[str] = None, port: Optional[int] = None,
                        env_vars: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> str:
        """Submit the job, wait for its URL, mount it on the proxy, return the base URL. Keywords in
        `_OVERRIDABLE` override the constructor once; a failure after the create cancels the job."""
        overrides = {key: value for key, value in kwargs.items() if key in _OVERRIDABLE}
        for key in [key for key in kwargs if key not in _OVERRIDABLE]:
            logger.debug("start_container: ignoring keyword %r (not used by HF Jobs)", key)
        overrides.update(image=image if image is not None else self.image, port=port if port is not None else self.port)
        if env_vars:
            overrides["env_vars"] = {**self.env_vars, **env_vars} if isinstance(env_vars, Mapping) else env_vars
        settings = self._settings(overrides)
        _raise_if_rejected(_settings_rejection(settings, image_required=True))
        if env_vars and getattr(self, "warn_env_credentials", True):
            _warn_credential_env_vars(env_vars)
        token = self._resolve_token()
        if not getattr(self._proxy_instance(), "running", True):  # (the shared one starts now) no job for a dead proxy
            raise SandboxConfigError("proxy=%r is not serving: start() it first, or pass proxy=None" % (self._proxy,))
        self._claim_start()
        started = False
        try:  # What runs the jobs (`_jobs`): bad combinations and overrides fail here, before any job.
            pooled = _placement("pool").PooledSandbox(self, settings) if settings["pool"] is not None else None
            replicas = (_ReplicaSet(self, settings, token, self._proxy_instance())
                        if pooled is None and settings["replicas"] > 1 else None)
            with self._lock:
                self._pooled, self._replicas = pooled, replicas
            base_url, started = self._jobs._start_jobs(settings, token), True
            return base_url
        finally:
            self._end_start(started)

    def wait_for_ready(self, base_url: Optional[str] = None, timeout_s: Optional[float] = None) -> None:
        """Poll `/health` through the proxy until 200, watching the job's stage: JobFailedError if
        it ends, JobStartTimeout at the deadline; any failure cancels it. Another URL is refused."""
        if self._phase is not Phase.RUNNING or self.base_url is None:
            raise SandboxError("wait_for_ready(): job %s was stopped; call start_container() to start a new "
                               "one" % self.job_id if self._phase is Phase.IDLE and self.job_id else
                               "wait_for_ready() needs a started provider: call start_container() first")
        budget, start = self._active["ready_timeout_s"] if timeout_s is None else timeout_s, self._starts
        _raise_if_rejected(_positive_number_rejection("timeout_s", budget)
                           or _ready_url_rejection(base_url, self.base_url))
        try:
            self._jobs._wait_ready(base_url or self.base_url, float(budget))
        except BaseException:
            self._teardown(start=start)  # no-op if another thread stopped and restarted the provider meanwhile
            raise

    @classmethod
    def start_many(cls, n: int, image: Optional[str] = None, *, max_parallel: int = DEFAULT_MAX_PARALLEL,
                   all_or_nothing: bool = True, progress: Union[bool, Callable[[int, int, int], None]] = True,
                   **provider_kwargs: Any) -> Union[
                       List["HFSandboxProvider"], Tuple[List["HFSandboxProvider"], List[Tuple[int, BaseException]]]]:
        """Start `n` providers, `max_parallel` at a time, until each is ready: all, or StartManyError with every job
        cancelled (else `(ready, [(index, exception)])`). `progress`: stderr lines or a callable(ready, failed, n)."""
        _raise_if_rejected(_positive_int_rejection("n", n) or _positive_int_rejection("max_parallel", max_parallel)
                           or (None if isinstance(progress, bool) or callable(progress) else
                               "progress=%r must be True, False or a callable(ready, failed, total)" % (progress,)))
        providers = [cls(image, **provider_kwargs) for _ in range(n)]  # bad settings fail before any job
        _raise_if_rejected(_image_rejection(providers[0].image))
        providers[0]._resolve_token()  # no token: one SandboxConfigError now, not n failures later
        if isinstance(providers[0].pool, str):  # the hosts n sandboxes need, booted by the first start
            _placement("pool").prewarm(providers[0], n, boot=False)
        shown = _ProgressLine(n, progress)
        launch = _Parallel(providers, lambda index, p: p.wait_for_ready(p.start_container()), max_parallel,
                           all_or_nothing, on_done=lambda index, error: shown.update(
                               len(launch.ready), len(launch.errors), index, error))
        try:
            launch.run("hf-sandbox-start")
        except BaseException:
            stop_all(providers)
            raise
        finally:
            shown.close()
        if launch.errors and all_or_nothing:
            stop_all(providers)
            raise StartManyError(n, launch.errors, launch.aborted)
        stop_all([p for i, p in enumerate(providers) if i not in launch.ready])  # none if all are ready
        ready = [p for i, p in enumerate(providers) if i in launch.ready]
        return ready if all_or_nothing else (ready, sorted(launch.errors, key=lambda item: item[0]))

    def stop_container(self) -> None:
        """Unmount the route and cancel the job(s); idempotent, never raises (failures: WARNING)."""
        try:
            start = self._starts  # read first: a start claimed after this teardown is not this stop's to wait for
            self._request_stop()  # a start or readiness wait in another thread notices at once
            self._teardown()
            self._wait_for_start_to_end(start)
        except BaseException:  # a teardown must never mask the caller's own exception
            logger.error("unexpected error while stopping HF job %s:\n%s", self.job_id, traceback.format_exc())

    def close(self) -> None:
        """Same as `stop_container()`."""
        self.stop_container()

    def logs(self, tail: int = LOG_TAIL_LINES) -> List[str]:
        """The last `tail` log lines of the current (or last) job, fetched within a few seconds."""
        if self.job_id is None or self._job_namespace is None:
            raise SandboxError("logs() needs a job: call start_container() first")
        _raise_if_rejected(_positive_int_rejection("tail", tail))
        if self._pooled is not None:
            return self._pooled.logs(tail)
        # the job's own client, else (it closed at the job's stop) one for this call
        with (contextlib.nullcontext(client) if (client := self._job_client) is not None else contextlib.closing(
                _JobsClient(self.endpoint, self._resolve_token(), self._hooks()._new_session()))) as client:
            return client.job_logs(self._job_namespace, self.job_id, tail=tail)

    def replica_status(self, refresh: bool = False) -> List[Dict[str, Any]]:
        """Per replica job, in start order: the proxy's view of it, `index`, `job_id`, `stage` and
        `message`. A replica out of rotation is inspected; one whose job ended leaves the route."""
        if (replicas := self._replicas) is None:
            raise SandboxError("replica_status() needs a provider started with replicas > 1 (this one runs "
                               "%s); use .stage and .job_id for a single job" % (self.job_id or "no job"))
        return replicas.status(refresh)

    @property
    def phase(self) -> Phase:
        """Where this provider is in its job's life (see `Phase`)."""
        return self._phase

    @property
    def job_ids(self) -> List[str]:
        """Every job of this provider: K with replicas, else the one job (empty before a start)."""
        return self._jobs._job_ids()

    @property
    def stage(self) -> Optional[str]:
        """The job's stage; with replicas, one stage for the K jobs (see `_ReplicaSet._job_stage`)."""
        return self._jobs._job_stage()

    def __enter__(self) -> "HFSandboxProvider":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop_container()

    def __repr__(self) -> str:
        return "<HFSandboxProvider image=%r flavor=%r job_id=%r stage=%r base_url=%r%s>" % (
            self.image, self.flavor, self.job_id, self.stage, self.base_url and _hide_route(self.base_url),
            " job_ids=%r" % (job_ids,) if len(job_ids := self.job_ids) > 1 else "")

    def __getstate__(self) -> Dict[str, Any]:
        """Un-started providers pickle (TRL ships env factories to workers): settings only."""
        if self._phase is not Phase.IDLE:
            raise TypeError("cannot pickle an HFSandboxProvider while its job %s is running: pickle it before "
                            "start_container() (each worker then starts its own job) or call stop_container() first"
                            % (self.job_id or "(being created)"))
        state = {name: getattr(self, name) for name in self._pickled_settings if hasattr(self, name)}
        if isinstance(self._proxy, str):  # proxy="process" is a setting; a proxy object stays here
            state["_proxy"] = self._proxy
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        for name in [name for name in self._pickled_settings if name in state]:
            setattr(self, name, state[name])
        # A proxy's sockets and threads stay in their process: use the shared one (of the same kind).
        self._proxy = state.get("_proxy") if isinstance(state.get("_proxy"), str) else None
        self._init_runtime_state()

    # -- overridable hooks ----------------------------------------------------------------------------
    def _new_session(self) -> requests.Session:
        """The HTTP session the Jobs client uses (override to add adapters or a corporate CA)."""
        return requests.Session()

    def _exposed_url_rejection(self, url: str, job_id: str, port: int) -> Optional[str]:
        """Why the job's exposed URL must not receive the token, or None (see `_exposed_url_rejection`)."""
        return _exposed_url_rejection(url, job_id, port, self.endpoint)

    def _replica_settings(self, index: int, settings: Dict[str, Any]) -> Dict[str, Any]:
        """The settings replica `index` starts with (override to vary one, e.g. a label per index)."""
        return settings

    def _init_runtime_state(self) -> None:
        # Guards the phase and the job's handles (re-entrant: a teardown moves both in one critical section).
        self._lock = threading.RLock()
        self._phase_changed = threading.Condition(self._lock)  # a stop waits on it for the start to end
        self._phase = Phase.IDLE
        self._starter: Optional[int] = None  # the thread running start_container(), while it runs
        self._owner_pid = os.getpid()  # the process whose start made the job: a copy forked from it ends none
        self._starts = 0  # starts claimed so far: which start a stop waits for, or a teardown may end
        self._stop_requested = threading.Event()  # "give up": set by stop, and by start_many's abort
        self._wake = threading.Event()  # set by the job watcher on a stage change, and by stop
        self._watch: Optional[_Watch] = None
        self._last_job: Optional[Mapping[str, Any]] = None
        self._job_client: Optional[_JobsClient] = None
        self._owner: Optional["weakref.ReferenceType[HFSandboxProvider]"] = None  # a replica uses its owner's hooks
        self._reset_job_state()
        _register_with_openenv()

    def _reset_job_state(self) -> None:
        self.job_id: Optional[str] = None
        self.job_url: Optional[str] = None
        self.upstream_url: Optional[str] = None
        self.base_url: Optional[str] = None
        self._stage: Optional[str] = None
        self.timings: Dict[str, float] = {}
        self._replicas: Optional[_ReplicaSet] = None  # set by a start with replicas > 1
        self._pooled: Any = None  # hf_sandbox_pool.PooledSandbox, set by a start with pool=
        self._job_namespace: Optional[str] = None
        self._submitted_at = 0.0
        self._start_label: Optional[str] = None  # labels the create in flight: a lost answer is found by it
        self._twin_label: Optional[str] = None  # that label once the create was sent twice: see _release_job
        self._mounted_on: Optional[_proxy.AuthProxy] = None
        self._finalizer: Optional[weakref.finalize] = None
        self._active: Dict[str, Any] = self._settings({})  # this start's settings (after overrides)

    def _move(self, phase: Phase) -> Phase:
        """The one way the phase changes: under the lock, along `_PHASE_MOVES`. Returns the previous one."""
        with self._lock:
            previous = self._phase
            if phase not in _PHASE_MOVES[previous]:
                raise SandboxError("internal error: a provider in phase %s cannot move to %s"
                                   % (previous.name, phase.name))
            self._phase = phase
            self._phase_changed.notify_all()
            return previous

    def _claim_start(self) -> None:
        with self._lock:
            if self._phase is not Phase.IDLE:
                raise SandboxError("this provider already runs job %s; call stop_container() before starting another "
                                   "(or use one provider per environment)" % (self.job_id or "(being created)"))
            self._stop_requested.clear()
            self._reset_job_state()
            self._starter, self._owner_pid = threading.get_ident(), os.getpid()
            self._starts += 1
            self._move(Phase.SUBMITTING)

    def _end_start(self, started: bool) -> None:
        """End a start: RUNNING if it returned a URL and no stop landed meanwhile, else IDLE. A start that
        succeeded just as a stop cancelled its job raises instead of returning a dead URL."""
        if not started and self._phase is Phase.STARTING:  # a recorded job never outlives a failed start
            self._teardown()
        with self._lock:
            stopped, self._starter = self._phase is Phase.STOPPING, None
            self._move(Phase.RUNNING if started and not stopped else Phase.IDLE)
        if started and stopped:
            raise SandboxError("stop_container() was called while job %s was starting; it was cancelled"
                               % (self.job_id or "(being created)"))

    def _wait_for_start_to_end(self, start: int) -> None:
        """After a stop's teardown: wait (bounded) until the start `start` in another thread has let go of its
        job, so a create answered after the stop is cancelled before stop_container() returns."""
        with self._lock:
            if self._starter == threading.get_ident():
                return  # called from the start's own thread (e.g. a hook): it ends after this returns
            if not self._phase_changed.wait_for(
                    lambda: self._phase not in _START_IN_FLIGHT or self._starts != start, STOP_WAIT_S):
                sweep = ("sweep --label %s=%s" % (START_LABEL_KEY, self._start_label) if self._start_label else
                         "sweep --pool %s" % self.pool if isinstance(self.pool, str) else "sweep")  # (replicas: each's)
                logger.warning("stop_container(): the start of this provider has not ended after %gs; it cancels "
                               "its job when its create answers, but if this process exits first cancel it with "
                               "`python -m hf_sandbox_provider %s`", STOP_WAIT_S, sweep)

    def _request_stop(self) -> None:
        """Make a start or readiness wait in another thread give up at its next check."""
        self._stop_requested.set()
        self._wake.set()

    def _detach(self, start: Optional[int] = None) -> Optional["_Detached"]:
        """Take what a teardown releases and retire the safety net, in one critical section with the phase
        change: a start claimed right after cannot swap the job's identity under it. None: `start` ended."""
        with self._lock:
            if start is not None and start != self._starts:
                return None  # the teardown of a start that already ended: the newer one is not its to end
            held, in_flight = self._phase in _JOB_HELD, self._phase in _START_IN_FLIGHT
            if in_flight:
                self._request_stop()  # under the lock, after the start's claim cleared any earlier one
            self._move(Phase.STOPPING if in_flight else Phase.IDLE)
            detached = _Detached(self.job_id if held else None, self._job_namespace, self.job_url,
                                 self.base_url, self._mounted_on, self._job_client, self._twin_label)
            finalizer, self._finalizer = self._finalizer, None
            self.base_url = self._mounted_on = self._job_client = None
        if finalizer is not None:
            if not finalizer.alive:  # the exit safety net already released the job and its route
                detached = detached._replace(job_id=None, base_url=None)
            _reaper.retire(finalizer)
        return detached if self._owner_pid == os.getpid() else None  # (a forked copy: its parent ends the job)

    @property
    def _jobs(self) -> Any:
        """What runs this provider's jobs: its `_ReplicaSet` or pooled sandbox, else itself (one job). Each
        offers `_start_jobs`, `_wait_ready`, `_teardown_jobs`, `_job_ids`, `_job_stage`."""
        return self._replicas or self._pooled or self

    def _hooks(self) -> "HFSandboxProvider":
        """Whose overridable hooks this job uses: its own, or for a replica job its owner's."""
        return (self._owner is not None and self._owner()) or self

    def _teardown(self, client: Optional["_JobsClient"] = None, start: Optional[int] = None) -> None:
        """Unmount and cancel, logging (never raising) what could not be cleaned up. `client`: the starting
        thread's own, in case a concurrent stop already took ours; `start`: only if that start still holds it."""
        self._jobs._teardown_jobs(client, start)

    def _settings(self, overrides: Mapping[str, Any]) -> Dict[str, Any]:
        return {**{name: getattr(self, name) for name in _OVERRIDABLE}, "image": self.image,
                "port": self.port, "env_vars": self.env_vars, **overrides}

    def _resolve_token(self) -> str:
        if not (token := self._token if self._token is not None else _discover_token()):
            raise SandboxConfigError("no Hugging Face token found: pass token=..., set HF_TOKEN, or run `hf auth "
                                     "login` (the token needs permission to run Jobs); to try everything offline "
                                     "use `python -m hf_sandbox_provider smoke --local`")
        if not isinstance(token, str) or not token.isascii() or not token.isprintable() or " " in token:
            raise SandboxConfigError("the Hugging Face token must be a string of printable ASCII without whitespace "
                                     "(a pasted token may carry a quote or space)")
        return token

    def _proxy_instance(self) -> "_proxy.AuthProxy":
        return _shared_proxy(self._proxy) if self._proxy is None or isinstance(self._proxy, str) else self._proxy

    def _elapsed(self) -> float:
        return time.monotonic() - self._submitted_at

    def _start_jobs(self, settings: Dict[str, Any], token: str) -> str:
        self._active = settings
        client = self._job_client = _JobsClient(self.endpoint, token, self._hooks()._new_session())
        start_label, self._twin_label = uuid.uuid4().hex, None
        self._start_label = start_label
        namespace: Optional[str] = None
        recorded = False  # until the job is ours to cancel, a failure must find it by its start label
        try:
            _raise_if_rejected(_live_flavor_rejection(client, settings["flavor"]))
            namespace = settings["namespace"] or client.whoami_namespace()
            self._submitted_at, budget_waited = time.monotonic(), client._budget.waited_s
            logger.info("submitting HF job: image=%s flavor=%s namespace=%s", settings["image"],
                        settings["flavor"], namespace)
            with _unsettled_while("the create of start %s" % start_label, "sweep --label %s=%s" % (
                    START_LABEL_KEY, start_label), lambda: _cancel_labelled(client, namespace, start_label)):
                job = client.create_job(namespace, _job_body(settings, start_label), {START_LABEL_KEY: start_label},
                                        self._stop_requested, lambda: setattr(self, "_twin_label", start_label))
                with self._lock:
                    self.job_id, self._job_namespace = str(job["id"]), namespace
                    self.job_url = "%s/jobs/%s/%s" % (self.endpoint, namespace, self.job_id)
                    self._move(Phase.STARTING)  # from here on every teardown cancels this job
                    self.timings["created"] = self._elapsed()
                recorded = True
                self._swap_finalizer(self._safety_net(client, None, None))
            logger.info("HF job %s created (%.1fs after submit): %s", self.job_id, self._elapsed(), self.job_url)
            self._observe(job)
            watch = self._watch_job(client, job)
            try:
                upstream = self._wait_for_url(client, settings, budget_waited)
            finally:
                self._unwatch_job(watch)
            self._raise_if_stopped()
            proxy, self.upstream_url = self._proxy_instance(), upstream
            base_url = proxy.mount(upstream, token=token, verify=settings["verify"])
            self._publish_route(proxy, base_url, self._safety_net(client, proxy, base_url))
            logger.info("HF job %s serving at %s (%.1fs after submit)", self.job_id, upstream, self._elapsed())
            return base_url
        except BaseException as exc:
            if namespace is not None and not recorded and getattr(exc, "may_have_acted", True):
                # The create may have made the job though its answer was lost, unusable (no id) or interrupted.
                for problem in _cancel_labelled(client, namespace, start_label):
                    logger.warning("%s", problem)
            self._teardown(client)
            raise

    def _teardown_jobs(self, client: Optional["_JobsClient"], start: Optional[int] = None) -> None:
        if (gone := self._detach(start)) is None:
            return
        cancelled = _release_job(client or gone.client, gone.namespace, gone.job_id, gone.proxy, gone.base_url,
                                 gone.job_url, twin_label=gone.twin_label)
        with self._lock:  # (a start claimed during a slow cancel has a stage of its own)
            if cancelled and self._stage not in TERMINAL_STAGES and self.job_id == gone.job_id:
                self._stage = "CANCELED"

    def _job_ids(self) -> List[str]:
        return [self.job_id] if self.job_id else []

    def _job_stage(self) -> Optional[str]:
        return self._stage

    def _raise_if_stopped(self) -> None:
        """A start or readiness wait gives up once a stop was requested (its teardown cancels the job)."""
        if self._stop_requested.is_set():
            raise SandboxError("stop_container() was called while %s starting" % ("job %s was" % self.job_id if
                               self._replicas is None else "the %d replicas were" % len(self._replicas.children)))

    def _publish_route(self, proxy: "_proxy.AuthProxy", base_url: str, finalizer: "weakref.finalize") -> None:
        """Record the mounted route, so a stop from now on unmounts it, and make `finalizer` the safety net.
        A stop that ran during the mount saw no route to unmount: then the start gives up here."""
        with self._lock:
            self._mounted_on, self.base_url = proxy, base_url
        self._swap_finalizer(finalizer)
        self._raise_if_stopped()
        self.timings["url"] = self._elapsed()

    def _observe(self, job: Mapping[str, Any]) -> str:
        if (stage := str((job.get("status") or {}).get("stage") or "UNKNOWN")) != self._stage:
            logger.info("HF job %s: %s -> %s (%.1fs after submit)", self.job_id, self._stage or "submitted",
                        stage, self._elapsed())
            self._stage = stage
            if stage == "RUNNING" and "running" not in self.timings:
                self.timings["running"] = self._elapsed()
        return stage

    def _watch_job(self, client: "_JobsClient", job: Optional[Mapping[str, Any]]) -> "_Watch":
        """Register with the process-wide watcher: it refreshes the job and sets `_wake` on a change."""
        watch = _watcher.register(client.endpoint, client._token, self._hooks()._new_session, self._job_namespace or "",
                                  self.job_id or "", float(self._active["poll_interval_s"]), self._wake, job,
                                  self._submitted_at)
        with self._lock:
            self._watch = watch
        return watch

    def _unwatch_job(self, watch: "_Watch") -> None:
        _watcher.unregister(watch)
        with self._lock:
            if self._watch is watch:  # not a newer start's, made while this wait ended
                self._watch, self._last_job = None, watch.job

    def _latest_job(self, client: "_JobsClient") -> Optional[Mapping[str, Any]]:
        """The watcher's latest answer for our job (raising what it failed with, or on a terminal stage)."""
        if (watch := self._watch) is None:
            raise SandboxError("job %s was stopped while starting" % self.job_id)
        if watch.error is not None:
            raise watch.error
        stage = self._observe(job) if (job := watch.job) is not None else None
        if stage not in TERMINAL_STAGES or stage in ("CANCELED", "DELETED"):  # a crash outranks a stop: its logs
            self._raise_if_stopped()                                           # say why (start_many counts it)
        if job is not None and stage in TERMINAL_STAGES:
            tail = client.job_logs(self._job_namespace or "", self.job_id or "", tail=LOG_TAIL_LINES)
            raise JobFailedError(self.job_id or "", stage, (job.get("status") or {}).get("message"), tail)
        return job

    def _wait_for_url(self, client: "_JobsClient", settings: Mapping[str, Any], budget_waited: float) -> str:
        deadline, heartbeat = self._submitted_at + float(settings["start_timeout_s"]), time.monotonic() + HEARTBEAT_S
        job_id, port = self.job_id or "", int(settings["port"])
        while True:
            self._wake.clear()  # before reading, so a change made after the read still wakes the wait
            if urls := ((self._latest_job(client) or {}).get("status") or {}).get("exposeUrls") or []:
                url = str(urls[0]).rstrip("/")  # one port is exposed, so one URL
                if reason := self._hooks()._exposed_url_rejection(url, job_id, port):
                    raise InsecureURLError(reason)
                return url
            if (remaining := deadline - time.monotonic()) <= 0:
                held = client._budget.waited_s > budget_waited or client._budget.wait_s() > 0  # since submit, or now
                advice = ("the Hub's API rate limit (see %s) held this token's calls: start fewer "
                          "jobs at once or raise start_timeout_s" % RATE_LIMIT_ENV if held else
                          "raise start_timeout_s for slow flavors or large images")
                raise JobStartTimeout("HF job %s exposed no URL within start_timeout_s=%gs (last stage %s); %s"
                                      % (job_id, settings["start_timeout_s"], self.stage, advice), job_id, self.stage)
            if time.monotonic() >= heartbeat:
                logger.info("HF job %s: still %s, %.0fs after submit (start_timeout_s=%g)", job_id,
                            self.stage, self._elapsed(), settings["start_timeout_s"])
                heartbeat = time.monotonic() + HEARTBEAT_S
            self._wake.wait(min(remaining, max(0.0, heartbeat - time.monotonic())))

    def _wait_ready(self, base_url: str, budget: float) -> None:
        if (client := self._job_client) is None:
            raise SandboxError("job %s was stopped before it became ready" % self.job_id)
        watch = self._watch_job(client, self._last_job)
        try:  # between probes: the watcher's latest answer (a crash it saw ends the wait)
            self._probe_until_ready(base_url, budget, lambda: self._latest_job(client), "HF job %s" % self.job_id,
                                    "job %s" % self.job_id, lambda: ", stage %s" % self.stage)
        finally:
            self._unwatch_job(watch)

    def _probe_until_ready(self, base_url: str, budget: float, check: Callable[[], Any], label: str, short: str,
                           detail: Callable[[], str] = lambda: "") -> None:
        """Probe `/health` until 200 (JobStartTimeout after `budget` s), calling `check` after each
        other answer: it raises when waiting is pointless. `label`, `short`, `detail()`: wording."""
        url, interval, last_seen = base_url.rstrip("/") + "/health", HEALTH_PROBE_FIRST_S, "no answer yet"
        deadline, heartbeat = time.monotonic() + budget, time.monotonic() + HEARTBEAT_S
        with requests.Session() as session:
            session.trust_env = False  # loopback proxy: never route through HTTP(S)_PROXY
            while True:
                self._wake.clear()
                self._raise_if_stopped()
                probed_at = time.monotonic()
                try:
                    response = session.get(url, timeout=HEALTH_PROBE_TIMEOUT_S)
                    last_seen = _describe_health_answer(response)
                    response.close()
                    if response.status_code == 200:
                        self.timings["ready"] = self._elapsed()
                        logger.info("%s ready (%.1fs after submit)", label, self._elapsed())
                        return
                    if reason := _health_status_rejection(response):
                        self._raise_if_stopped()  # a stop unmounted the route: say that, not "no route"
                        raise SandboxError("%s: /health %s" % (short, reason))
                except requests.RequestException as exc:
                    last_seen = type(exc).__name__
                check()
                if time.monotonic() >= heartbeat:
                    logger.info("%s: /health not ready yet, %.0fs after submit (last: %s%s)", label,
                                self._elapsed(), last_seen, detail())
                    heartbeat = time.monotonic() + HEARTBEAT_S
                if (remaining := deadline - time.monotonic()) <= 0:
                    raise JobStartTimeout("%s did not answer /health with 200 within %gs (last: %s%s)"
                                          % (label, budget, last_seen, detail()), self.job_id, self.stage)
                # the next probe `interval` after this one began; a stop, or a crash the watcher saw, ends it
                self._wake.wait(max(0.0, min(probed_at + interval - time.monotonic(), remaining)))
                interval = min(HEALTH_PROBE_INTERVAL_S, interval * HEALTH_PROBE_GROWTH)

    def _safety_net(self, client: "_JobsClient", proxy: Optional["_proxy.AuthProxy"],
                    base_url: Optional[str]) -> "weakref.finalize":
        """The job's finalizer (collection, exit): it holds its client and ids, not the provider."""
        return _reaper.arm(self, _release_job, client, self._job_namespace, self.job_id, proxy, base_url, self.job_url,
                           abandoned=True, twin_label=self._twin_label)

    def _swap_finalizer(self, finalizer: "weakref.finalize") -> None:
        with self._lock:
            old, self._finalizer = self._finalizer, finalizer
        if old is not None:
            _reaper.retire(old)


def _register_with_openenv() -> None:
    """Make HFSandboxProvider a virtual OpenEnv `ContainerProvider` once OpenEnv is loaded. Runs at import
    and at every construction (OpenEnv may have been imported since); registering again is a no-op."""
    for module_name in _OPENENV_PROVIDER_MODULES:
        base = getattr(sys.modules.get(module_name), "ContainerProvider", None)
        if isinstance(base, abc.ABCMeta):  # not an unrelated package that happens to be called `core`
            base.register(HFSandboxProvider)
            return


# Where OpenEnv's `ContainerProvider` ABC has lived. Looked up in sys.modules, never imported: `openenv.core`'s init
# loads gradio, pandas and pyarrow (about 4 s, 170 MiB); whoever checks isinstance has imported it already.
_OPENENV_PROVIDER_MODULES = ("openenv.core.containers.runtime.providers", "openenv.core.containers.runtime",
                             "openenv_core.containers.runtime.providers", "core.containers.runtime.providers")
_register_with_openenv()


# -- Replicas: K single-job providers behind one route, run for the provider that owns them --------
class _ReplicaSet:
    """K jobs of one image behind ONE replica route, for the provider that owns them (its `_jobs`): each a
    single-job `HFSandboxProvider` with the owner's proxy, token and hooks, probed on its own route."""

    def __init__(self, owner: HFSandboxProvider, settings: Mapping[str, Any], token: str,
                 proxy: "_proxy.AuthProxy") -> None:
        self.proxy = proxy
        self._owner = weakref.ref(owner)  # weak: the owner holds this set and must stay collectable
        self.children: List[HFSandboxProvider] = []
        for index in range(int(settings["replicas"])):  # a bad override fails before any job
            item = dict(owner._replica_settings(index, dict(settings, replicas=1)))
            if reason := (_settings_rejection(item, image_required=True)
                          or (None if item.get("replicas") == 1 else "replicas must stay 1")):
                raise SandboxConfigError("_replica_settings(%d): %s" % (index, reason))
            options = {name: item[name] for name in ("image", "port", "env_vars", *_OVERRIDABLE) if name != "replicas"}
            child = HFSandboxProvider(token=token, endpoint=owner.endpoint, proxy=proxy,
                                      warn_env_credentials=owner.warn_env_credentials, **options)
            child._owner = self._owner  # it uses its owner's hooks
            self.children.append(child)
        self.removed: Dict[int, str] = {}  # why a replica left the route, by index
        self.checked: Dict[int, float] = {}  # when status() last inspected each replica's job

    @property
    def owner(self) -> HFSandboxProvider:
        return self._owner()  # type: ignore[return-value]  # alive: only the owner calls its set

    def _start_jobs(self, settings: Dict[str, Any], token: str) -> str:
        """Start the K jobs in parallel, then mount one replica route over their URLs."""
        owner, count, proxy = self.owner, len(self.children), self.proxy
        owner._active, owner._submitted_at = settings, time.monotonic()
        with owner._lock:
            owner._mounted_on = proxy
            owner._move(Phase.STARTING)  # from here on a teardown stops the replicas, whatever happens

        def start_one(index: int, child: HFSandboxProvider) -> None:
            child._claim_start()
            started = False
            try:
                if group.stopping or owner._stop_requested.is_set():  # given up before this one began
                    child._request_stop()
                    raise SandboxError("replica %d was not started: the start was given up" % index)
                child._start_jobs(child._settings({}), token)
                started = True
            finally:
                child._end_start(started)
        try:
            logger.info("starting %d replica jobs of %s", count, settings["image"])
            group = self._parallel(start_one)
            self._run(group, "hf-sandbox-replica-start", "start")
            first = self.children[0]
            with owner._lock:
                owner.job_id, owner.job_url, owner.upstream_url = first.job_id, first.job_url, first.upstream_url
                owner._job_namespace = first._job_namespace
            base_url = proxy.mount_replicas([child.upstream_url for child in self.children], token=token,
                                            verify=settings["verify"])
            owner.timings.update({key: self._all_reached(key) for key in ("created", "running")})
            net = _reaper.arm(owner, _release_job, None, None, None, proxy, base_url, None)
            owner._publish_route(proxy, base_url, net)  # unmounts the route (each replica's own net cancels its job)
            logger.info("%d replica jobs (%s) serving on one route (%.1fs after submit)", count,
                        ", ".join(self._job_ids()), owner._elapsed())
            return base_url
        except BaseException:
            owner._teardown()
            raise

    def _wait_ready(self, base_url: str, budget: float) -> None:
        """Wait for every replica's own /health (in parallel); one failure fails them all."""
        self._run(self._parallel(lambda index, child: child.wait_for_ready(timeout_s=budget)),
                  "hf-sandbox-replica-ready", "become ready")
        self.owner.timings["ready"] = self.owner._elapsed()
        logger.info("%d replica jobs ready (%.1fs after submit)", len(self.children), self.owner._elapsed())

    def _teardown_jobs(self, client: Optional["_JobsClient"], start: Optional[int] = None) -> None:
        """Unmount the replica route, then stop every replica (each names a job it could not cancel)."""
        if (gone := self.owner._detach(start)) is None:
            return
        for problem in _unmount(gone.proxy, gone.base_url):
            logger.warning("replica jobs %s: %s", ", ".join(self._job_ids()), problem)
        stop_all(self.children)

    def _job_ids(self) -> List[str]:
        return [child.job_id for child in self.children if child.job_id]

    def _job_stage(self) -> Optional[str]:
        """One stage for the K jobs: the least advanced live one; all ended: ERROR, else CANCELED, else their end."""
        if not (stages := [child.stage for child in self.children]):
            return None
        if live := [stage for stage in stages if stage not in TERMINAL_STAGES]:
            return min(live, key=lambda stage: _LIVE_STAGE_ORDER.get(stage, 1))
        return next((stage for stage in ("ERROR", "CANCELED") if stage in stages), stages[0])

    def status(self, refresh: bool) -> List[Dict[str, Any]]:
        """`HFSandboxProvider.replica_status()`: the proxy's view of each replica plus its job's stage."""
        with self.owner._lock:
            base_url, proxy = self.owner.base_url, self.owner._mounted_on
        entries, now = self._route_entries(proxy, base_url), time.monotonic()
        for index, child in enumerate(self.children):
            entry = entries.get(child.upstream_url or "")
            if refresh or (entry is not None and not entry["healthy"] and now - self.checked.get(
                    index, float("-inf")) >= REPLICA_CHECK_INTERVAL_S):
                self.checked[index] = now
                self._check(index, child, proxy, base_url)
        entries = self._route_entries(proxy, base_url)
        status = []
        for index, child in enumerate(self.children):
            entry = entries.get(child.upstream_url or "") or {
                "upstream": child.upstream_url, "open_sessions": 0, "healthy": False,
                "reason": self.removed.get(index, "not in the route (stopped)")}
            message = ((child._last_job or {}).get("status") or {}).get("message")
            status.append(dict(entry, index=index, job_id=child.job_id, stage=child.stage, message=message))
        return status

    def _check(self, index: int, child: HFSandboxProvider, proxy: Optional["_proxy.AuthProxy"],
               base_url: Optional[str]) -> None:
        """Inspect a replica's job; one that has ended leaves the route for good, with a WARNING."""
        if (client := child._job_client) is None or child.job_id is None or index in self.removed:
            return
        try:
            job = client.get_job(child._job_namespace or "", child.job_id, retries=0)
        except Exception as exc:  # a status call must not fail over a busy API: report what is known
            logger.debug("replica %d: could not inspect job %s (%s)", index, child.job_id, type(exc).__name__)
            return
        child._last_job, stage = job, child._observe(job)
        if stage not in TERMINAL_STAGES or proxy is None or base_url is None:
            return
        message = (job.get("status") or {}).get("message") or "(no message from the Jobs API)"
        with contextlib.suppress(ValueError, RuntimeError):  # unmounted meanwhile, or a proxy child being replaced
            removed = proxy.remove_replica(base_url, child.upstream_url or "")
            self.removed[index] = "job %s: %s" % (stage, message)  # (not after a failure: the next check tries again)
            if removed:
                logger.warning("replica %d (HF job %s) ended with stage %s (%s): taken out of rotation; %d replicas "
                               "remain on the route", index, child.job_id, stage, message,
                               len(self._route_entries(proxy, base_url)))

    def _parallel(self, action: Callable[[int, HFSandboxProvider], None]) -> "_Parallel":
        """All K replicas at once, all or nothing, given up when the owner is stopped."""
        return _Parallel(self.children, action, len(self.children), True, self.owner._stop_requested, self.owner._wake)

    def _run(self, group: "_Parallel", name: str, phase: str) -> None:
        group.run(name)
        self.owner._raise_if_stopped()
        if group.errors:
            raise ReplicaStartError(phase, len(self.children), group.errors, group.aborted, self._job_ids())

    def _all_reached(self, key: str) -> float:
        """Seconds from the owner's submit until every replica had reached `key` of its timings."""
        moments = [child._submitted_at + child.timings[key] for child in self.children if key in child.timings]
        return max(moments) - self.owner._submitted_at if moments else self.owner._elapsed()

    @staticmethod
    def _route_entries(proxy: Optional["_proxy.AuthProxy"], base_url: Optional[str]) -> Dict[str, Dict[str, Any]]:
        if proxy is None or base_url is None:
            return {}
        try:
            return {str(entry["upstream"]): dict(entry) for entry in proxy.replica_status(base_url)}
        except ValueError:  # unmounted by a concurrent stop
            return {}


# -- Many providers at once: stop_all and the parallel workers of start_many and replica sets ------
def stop_all(providers: Iterable["HFSandboxProvider"]) -> None:
    """Stop many providers at once (one thread each, bounded); never raises, like stop_container()."""
    _in_parallel([p.stop_container for p in providers if p is not None])


def _in_parallel(actions: Sequence[Callable[[], None]], budget_s: Optional[float] = None) -> None:
    """Run each action in a daemon thread (STOP_PARALLEL at once) up to `budget_s`: executors take no work at exit."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for first in range(0, len(actions), STOP_PARALLEL):
        batch = [threading.Thread(target=action, name="hf-sandbox-stop", daemon=True)
                 for action in actions[first:first + STOP_PARALLEL]]
        for thread in batch:
            with contextlib.suppress(RuntimeError):  # no thread to spare (a limit, a late exit): run it below
                _start_thread(thread)
        for thread in batch:
            if thread.ident is None:
                thread.run()
            else:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


class _Parallel:
    """Runs `action(index, provider)` on `max_parallel` threads; with `all_or_nothing` the first
    failure, like `stop_requested`, makes the rest give up. Outcomes: ready, errors, aborted."""

    def __init__(self, providers: List["HFSandboxProvider"], action: Callable[[int, "HFSandboxProvider"], None],
                 max_parallel: int, all_or_nothing: bool = True, stop_requested: Optional[threading.Event] = None,
                 wake: Optional[threading.Event] = None,
                 on_done: Callable[[int, Optional[BaseException]], None] = lambda index, error: None) -> None:
        self.providers, self.action, self.on_done = providers, action, on_done
        self.max_parallel, self.all_or_nothing = max(1, min(max_parallel, len(providers))), all_or_nothing
        self.stop_requested = stop_requested or threading.Event()
        self.wake = wake or threading.Event()  # set by each action that ends (and by the owner's stop)
        self.ready: set = set()
        self.errors: List[Tuple[int, BaseException]] = []
        self.aborted, self.stopping, self._lock = 0, False, threading.Lock()
        self._began: set = set()  # indexes whose action has begun

    def run(self, name: str) -> None:
        """Returns when every action has ended; an interrupt gives the rest up, then propagates."""
        with concurrent.futures.ThreadPoolExecutor(self.max_parallel, thread_name_prefix=name) as pool:
            with _library_signal_mask():  # the pool starts its threads in submit(): they inherit the mask
                futures = [pool.submit(self._one, index) for index in range(len(self.providers))]
            try:
                while not all(future.done() for future in futures):
                    self.wake.clear()  # before the checks, so a change made after them still wakes the wait
                    if self.stop_requested.is_set() or self.stopping:
                        self.abort()  # each turn: a start claimed since the last abort cleared its stop request
                    self.wake.wait(0.5)  # bounded: a Ctrl-C reaches this thread
            except BaseException:
                while not all(future.done() for future in futures):  # the actions in flight give up, then it raises
                    self.abort()
                    self.wake.wait(0.5)
                raise

    def abort(self) -> None:
        with self._lock:
            self.stopping = True
            in_flight = [self.providers[index] for index in self._began - self.ready]
        for provider in in_flight:
            provider._request_stop()

    def _one(self, index: int) -> None:
        provider, error = self.providers[index], None
        try:
            with self._lock:
                if self.stopping:
                    self.aborted += 1
                    return
                self._began.add(index)
            try:
                self.action(index, provider)
            except BaseException as exc:  # recorded and raised by the caller, never lost
                error = exc
            with self._lock:
                if error is None:
                    self.ready.add(index)
                elif self.stopping and provider._stop_requested.is_set() and not isinstance(
                        error, (JobFailedError, JobStartTimeout)):  # those two are its own, even after the abort
                    self.aborted += 1  # given up because another one failed: not its own failure
                    return
                else:
                    self.errors.append((index, error))
            self.on_done(index, error)
            if error is not None and self.all_or_nothing:
                self.abort()
        finally:
            self.wake.set()


class _ProgressLine:
    """start_many's `progress`: a callable's errors are logged; True writes stderr lines, one per PROGRESS_STEP or
    PROGRESS_INTERVAL_S at most (a first failure at once), updated in place on a terminal, none older than one shown."""

    def __init__(self, total: int, progress: Union[bool, Callable[[int, int, int], None]]) -> None:
        self.total, self.progress, self.lock, self.began = total, progress, threading.Lock(), time.monotonic()
        self.tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
        self.shown_at, self.shown_done, self.open = float("-inf"), 0, False

    def update(self, ready: int, failed: int, index: int, error: Optional[BaseException]) -> None:
        if self.progress is not True:
            try:
                if self.progress:
                    self.progress(ready, failed, self.total)  # type: ignore[operator]
            except Exception:  # a caller's display must not kill a launch worker (and its work)
                logger.warning("start_many: the progress callback raised; ignoring it:\n%s", traceback.format_exc())
            return
        with self.lock:
            now, done = time.monotonic(), ready + failed
            due = (done - self.shown_done >= self.total * PROGRESS_STEP or now - self.shown_at >= PROGRESS_INTERVAL_S)
            if done < self.shown_done or not (self.tty or due or done == self.total or (error and failed == 1)):
                return
            line = "start_many: %d/%d ready, %d failed (%.1fs)" % (ready, self.total, failed, now - self.began)
            if error is not None:
                line += "; environment %d: %s" % (index, _first_line(error) or type(error).__name__)
            self.shown_at, self.shown_done, self.open = now, done, self.tty
            # no stderr, or a closed one: a display must not kill a launch worker (and lose its work)
            with contextlib.suppress(AttributeError, OSError, ValueError):
                sys.stderr.write("\r%s\x1b[K" % line if self.tty else line + "\n")
                sys.stderr.flush()

    def close(self) -> None:
        """End a terminal's updated line, so what is printed next starts on a line of its own."""
        with self.lock:
            if self.open:
                sys.stderr.write("\n")
                sys.stderr.flush()
                self.open = False


# -- Settings validation (pure: each `_..._rejection` returns why a value is refused, or None) -----
# Patterns end in \Z, not $: `$` also matches before a trailing newline, which would let "name\n" through.
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_DOMAIN = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_REFERENCE = re.compile(
    r"^(?:(?P<domain>%s)/)?%s(?:/%s)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@[A-Za-z0-9_+.-]+:[0-9a-fA-F]{32,})?\Z"
    % (_DOMAIN, _PATH_COMPONENT, _PATH_COMPONENT))
_JOB_HOST = re.compile(r"^[^.]+--[0-9]+\.")  # an exposed-port host: `<job_id>--<port>.<domain>`
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_SPACE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9_-]{1,%d}\Z" % LABEL_MAX_CHARS)
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_-]{0,%d}\Z" % LABEL_MAX_CHARS)
_CREDENTIAL_NAME_ENDINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS", "APIKEY")
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_credential_warnings: "set[str]" = set()  # names warned about (once per process, for all providers)
_credential_warnings_lock = threading.Lock()
_live_hardware: Dict[str, Optional[frozenset]] = {}  # endpoint -> the flavors its hardware list gave, or None
_hardware_locks: Dict[str, threading.Lock] = {}  # each list is asked for once per process, under its own lock


def _raise_if_rejected(reason: Optional[str]) -> None:
    if reason:
        raise SandboxConfigError(reason)


def _proxy_rejection(proxy: Any) -> Optional[str]:
    if proxy is None or proxy == PROXY_PROCESS or (
            not isinstance(proxy, str) and callable(getattr(proxy, "mount", None))):
        return None
    return ("proxy must be None (one in-process proxy shared by the process), %r (one shared proxy in a "
            "child process) or a started AuthProxy / AuthProxy.spawn() handle, got %r" % (PROXY_PROCESS, proxy))


def _image_rejection(image: Any) -> Optional[str]:
    if not isinstance(image, str) or not image.strip():
        return ("no image given: pass one to HFSandboxProvider(image=...) or start_container(image), "
                "e.g. 'registry.hf.space/openenv-echo-env:latest' or 'hf.co/spaces/owner/name'")
    if (space := _space_id(image)) is not None:
        return None if _SPACE_ID.match(space) else (
            "image %r: a Space reference must look like 'hf.co/spaces/<owner>/<name>'" % image)
    return None if _IMAGE_REFERENCE.match(image) else (
        "image %r is not a valid Docker image reference (expected e.g. 'python:3.12', "
        "'registry.hf.space/openenv-echo-env:latest' or 'hf.co/spaces/<owner>/<name>'; "
        "repository names are lower case)" % image)


def _space_id(image: str) -> Optional[str]:
    """`<owner>/<name>` when `image` names an HF Space (sent as `spaceId`), else None (a Docker image)."""
    return next((image[len(prefix):] for prefix in SPACE_IMAGE_PREFIXES if image.startswith(prefix)), None)


def _flavor_rejection(flavor: Any, known: Optional[frozenset] = None) -> Optional[str]:
    if known is None:  # the flavors a job may ask for: huggingface_hub's JobHardware (else ours), the live lists
        try:
            from huggingface_hub import JobHardware  # type: ignore[attr-defined]
            known = (KNOWN_FLAVORS | {str(member.value) for member in JobHardware}) - SPACES_ONLY_HARDWARE
        except Exception:  # huggingface_hub older than Jobs, or absent: the static copy
            known = KNOWN_FLAVORS
        # Unlocked (list() of a dict's values is atomic): a constructor never waits out another start's hardware fetch
        known = known.union(*(flavors for flavors in list(_live_hardware.values()) if flavors is not None))
    if isinstance(flavor, str) and flavor in known:
        return None
    close = difflib.get_close_matches(flavor, known, n=1) if isinstance(flavor, str) else []
    return ("unknown flavor %r%s; valid Jobs flavors: %s (see `hf jobs hardware`; if HF added a new one, upgrade "
            "huggingface_hub)" % (flavor, " (did you mean %r?)" % close[0] if close else "", ", ".join(sorted(known))))


def _live_flavor_rejection(client: "_JobsClient", flavor: str) -> Optional[str]:
    """Why the Hub's live hardware list (fetched once) refuses `flavor`, or None; no list: only the static check."""
    with _hardware_locks.setdefault(client.endpoint, threading.Lock()):  # (setdefault: atomic, one lock per key)
        if client.endpoint not in _live_hardware:
            _live_hardware[client.endpoint] = client.hardware_flavors()
        live = _live_hardware[client.endpoint]
    return None if live is None else _flavor_rejection(flavor, live)


def _parse_duration(value: Any) -> Optional[int]:
    """Seconds from 3600, 90.5, "3600", "30m", "2h", "1d"; None when unparseable or not positive."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    else:
        return None
    return int(seconds) if 1 <= seconds <= MAX_SECONDS else None  # (also rejects NaN and inf)


def _positive_number_rejection(name: str, value: Any) -> Optional[str]:
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS  # NaN too
    return "%s=%r must be a positive number of seconds, at most %g" % (name, value, MAX_SECONDS) if bad else None


def _positive_int_rejection(name: str, value: Any) -> Optional[str]:
    bad = isinstance(value, bool) or not isinstance(value, int) or value <= 0
    return "%s=%r must be a positive integer" % (name, value) if bad else None


def _replicas_rejection(replicas: Any) -> Optional[str]:
    if reason := _positive_int_rejection("replicas", replicas):
        return reason + " (the number of jobs behind one route; 1 = a single job)"
    if replicas > MAX_REPLICAS:
        return ("replicas=%d is more than %d jobs behind one route; use start_many() for independent "
                "environments, or several providers" % (replicas, MAX_REPLICAS))
    return None


def _as_dict(value: Any) -> Any:
    """A copy of a mapping setting (None: empty); anything else as given, for its rejection to name."""
    return {} if value is None else dict(value) if isinstance(value, Mapping) else value


def _mapping_rejection(name: str, value: Any, check_names: bool) -> Optional[str]:
    if not isinstance(value, Mapping):
        return "%s must be a dict of name -> string value, not %s" % (name, type(value).__name__)
    for key, item in value.items():
        if not isinstance(key, str) or (check_names and not _ENV_NAME.match(key)) or not key:
            return "%s: %r is not a valid name (letters, digits and _, not starting with a digit)" % (name, key)
        if not isinstance(item, (str, int, float)) or isinstance(item, bool):
            return "%s[%r] must be a string or number, not %s" % (name, key, type(item).__name__)
    return None


def _credential_env_names(env_vars: Mapping[str, Any]) -> List[str]:
    """The names in `env_vars` that look like credentials: a `_`-separated part ending in TOKEN, SECRET,
    PASSWORD..., or a last part KEY (OPENAI_API_KEY). TOKENIZERS_PARALLELISM and MAX_TOKENS are not."""
    parts = {str(name): str(name).upper().split("_") for name in env_vars}
    return [name for name, split in parts.items()
            if any(part.endswith(_CREDENTIAL_NAME_ENDINGS) for part in split) or split[-1] == "KEY"]


def _warn_credential_env_vars(env_vars: Mapping[str, Any]) -> None:
    """One WARNING per credential-like name and process: who can read a namespace's jobs sees env vars, not secrets."""
    with _credential_warnings_lock:
        names = [name for name in _credential_env_names(env_vars) if name not in _credential_warnings]
        _credential_warnings.update(names)
    for name in names:
        logger.warning("env_vars[%r] looks like a credential: job environment variables are visible to anyone who "
                       "can read the namespace's jobs; pass it as secrets={%r: ...} instead (or "
                       "warn_env_credentials=False if it is not secret)", name, name)


def _command_rejection(command: Any) -> Optional[str]:
    if command is None or isinstance(command, str):
        try:  # split now, as the job body will: a bad string is refused before any call
            return None if command is None or shlex.split(command) else "command must not be empty"
        except ValueError as exc:
            return "command %r cannot be split like a shell line (%s); pass a list of arguments" % (command, exc)
    if isinstance(command, Sequence) and command and all(isinstance(part, str) for part in command):
        return None
    return "command must be None (OpenEnv's default server command), a string, or a non-empty list of strings"


def _label_rule_rejection(labels: Any) -> Optional[str]:
    """Why a label breaks the Hub's rule (refused at create time, after the call), or None."""
    for key, value in (labels or {}).items():
        if not _LABEL_KEY.match(str(key)):
            return ("label key %r must be 1 to %d characters of letters, digits, '-' and '_' (the Hub's rule "
                    "for job labels)" % (key, LABEL_MAX_CHARS))
        if not _LABEL_VALUE.match(str(value)):
            return ("label %s=%r: the value must be at most %d characters of letters, digits, '-' and '_' "
                    "(the Hub's rule for job labels)" % (key, str(value), LABEL_MAX_CHARS))
    return None


def _reserved_labels_rejection(labels: Any) -> Optional[str]:
    reserved = sorted(key for key in labels or {} if str(key).startswith("hf-sandbox-"))  # (pool hosts' too)
    return "labels %s are reserved: keys starting with 'hf-sandbox-' are the library's own (and its pool hosts'); " \
        "pick another key" % reserved if reserved else None


# Each setting's check, in the order refusals are reported (the first one wins).
_SETTING_CHECKS: Tuple[Tuple[str, Callable[[Any], Optional[str]]], ...] = (
    ("port", lambda value: None if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535
        else "port %r must be an integer from 1 to 65535 (the port the server listens on in the job)" % (value,)),
    ("flavor", _flavor_rejection), ("command", _command_rejection),
    *[(name, functools.partial(_mapping_rejection, name, check_names=True)) for name in ("env_vars", "secrets")],
    ("labels", functools.partial(_mapping_rejection, "labels", check_names=False)),
    *[(name, functools.partial(_positive_number_rejection, name))
      for name in ("start_timeout_s", "ready_timeout_s", "poll_interval_s")], ("replicas", _replicas_rejection),
    ("job_timeout", lambda value: None if _parse_duration(value) is not None else (
        "job_timeout=%r must be a positive duration: seconds (3600) or a string like '30m', '2h', '1d'" % (value,))),
    ("labels", _reserved_labels_rejection), ("labels", _label_rule_rejection),
    ("namespace", lambda value: None if value is None or (isinstance(value, str) and _NAMESPACE.match(value)) else (
        "namespace %r must be a user or organisation name" % (value,))),
    ("verify", lambda value: None if isinstance(value, (bool, str)) else (
        "verify must be True, False or a CA bundle path, not %r" % (value,))),
    ("pool", lambda value: None if value is None else _placement("pool").pool_rejection(value)))


def _settings_rejection(settings: Mapping[str, Any], image_required: bool) -> Optional[str]:
    """Why these provider settings cannot start a job (checked before any network call), or None."""
    if (image_required or settings.get("image") is not None) and (reason := _image_rejection(settings.get("image"))):
        return reason
    return next(filter(None, (check(settings.get(name, 1 if name == "replicas" else None))
                              for name, check in _SETTING_CHECKS)), None)


def _job_body(settings: Mapping[str, Any], start_label: str) -> Dict[str, Any]:
    """The JSON body of `POST /api/jobs/{namespace}` for these (validated) settings."""
    command, port, space = settings["command"], int(settings["port"]), _space_id(settings["image"])
    labels = {**{str(k): str(v) for k, v in (settings["labels"] or {}).items()},
              PROVIDER_LABEL_KEY: PROVIDER_LABEL_VALUE, START_LABEL_KEY: start_label, PROCESS_LABEL_KEY: _process_label}
    body: Dict[str, Any] = {
        "command": ([part.format(port=port) for part in DEFAULT_COMMAND_TEMPLATE] if command is None
                    else shlex.split(command) if isinstance(command, str) else list(command)),
        "arguments": [], "environment": {k: str(v) for k, v in (settings["env_vars"] or {}).items()},
        "flavor": settings["flavor"], "timeoutSeconds": _parse_duration(settings["job_timeout"]),
        "labels": labels, "expose": {"ports": [port], "portsPublic": []}}
    if settings["secrets"]:
        body["secrets"] = {k: str(v) for k, v in settings["secrets"].items()}
    body.update({"spaceId": space} if space is not None else {"dockerImage": settings["image"]})
    return body


def _exposed_url_rejection(url: str, job_id: str, port: int, endpoint: str) -> Optional[str]:
    """Why `url` must not receive the token, or None. Allowed: `https://<job_id>--<port>.<domain>`, or a
    loopback http(s) URL when the Jobs endpoint itself is loopback (the emulator)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # raises on a malformed port
    except ValueError:
        return "the job's exposed URL %r is malformed; not sending the token to it" % url
    if parts.username or parts.password:
        return "the job's exposed URL %r carries credentials; not sending the token to it" % url
    # A job-shaped host is checked as on the Hub even on loopback (the TLS emulator's `<id>--<port>.jobs.localhost`).
    job_shaped = bool(host) and _JOB_HOST.match(host) is not None
    if (not job_shaped and _is_loopback_host(urlsplit(endpoint).hostname) and _is_loopback_host(host)
            and parts.scheme in ("http", "https")):
        return None
    if parts.scheme != "https":
        return "the job's exposed URL %r is not https; refusing to send the token in clear text" % url
    expected = ("%s--%d." % (job_id, port)).lower()
    if not host or not host.lower().startswith(expected) or len(host) <= len(expected):
        return ("the job's exposed URL %r does not belong to job %s port %d (expected host %s<domain>); "
                "refusing to send the token to it" % (url, job_id, port, expected))
    return None


def _describe_health_answer(response: requests.Response) -> str:
    """`HTTP 502 upstream-tls: <why>`: the proxy's errors carry X-Proxy-Error and a JSON body."""
    if not (kind := response.headers.get("X-Proxy-Error")):
        return "HTTP %d" % response.status_code
    try:
        detail = response.json()
        message = detail.get("message") or detail.get("error") if isinstance(detail, dict) else None
    except ValueError:
        message = None
    return "HTTP %d %s%s" % (response.status_code, kind, ": %s" % str(message)[:300] if message else "")


def _health_status_rejection(response: requests.Response) -> Optional[str]:
    """Why a /health answer means "give up now" (auth refused, no such route), or None for "not yet"."""
    if response.status_code in (401, 403):
        return ("answered HTTP %d: the job's proxy refused the token (it needs read access to the "
                "job's namespace)" % response.status_code)
    if response.status_code == 404 and response.headers.get("X-Proxy-Error") == "unknown-route":
        return ("the local proxy has no route at %s: it was unmounted, or the URL is not the one "
                "start_container() returned (use provider.base_url)" % _hide_route(response.url.rsplit("/", 1)[0]))
    return None


def _ready_url_rejection(url: Optional[str], base_url: str) -> Optional[str]:
    """Why wait_for_ready(url) is not about this job (it would wait in vain, then cancel a healthy
    one), or None. `urljoin(base_url, "/step")` makes such URLs: a leading "/" drops the route."""
    if url is None or (isinstance(url, str) and url.rstrip("/") == base_url.rstrip("/")):
        return None
    if not isinstance(url, str):
        return "wait_for_ready(url) takes the base URL start_container() returned, not %s" % type(url).__name__
    given, own = urlsplit(str(url)), urlsplit(base_url)
    same_origin = (given.scheme, given.netloc) == (own.scheme, own.netloc)
    slip = ("; under the proxy's address only the base URL itself serves this job: urljoin(base_url, "
            "'/step') drops its route id, base_url + '/step' keeps it" if same_origin else "")
    return "wait_for_ready(%r): not this provider's base URL, which is %s (pass it, or nothing)%s" % (
        _hide_route(str(url)), _hide_route(base_url), slip)


def _endpoint_rejection(endpoint: str) -> Optional[str]:
    try:
        parts = urlsplit(endpoint)
        parts.port  # (raises for a port out of range)
    except ValueError as exc:
        return "Jobs endpoint %r is not a valid URL (%s)" % (endpoint, exc)
    if (parts.scheme == "https" and parts.hostname) or (parts.scheme == "http" and _is_loopback_host(parts.hostname)):
        return None
    return ("Jobs endpoint %r must be https (http only for a loopback host such as the local emulator): "
            "the token is sent to it" % endpoint)


def _discover_token() -> Optional[str]:
    """The HF token (never logged; blank: absent): TOKEN_ENV_VARS, get_token(), $HF_TOKEN_PATH or $HF_HOME/token."""
    for value in map(os.environ.get, TOKEN_ENV_VARS):
        if value and value.strip():
            return value.strip()
    with contextlib.suppress(Exception):  # absent or too old: fall back to the documented location
        try:
            from huggingface_hub import get_token  # type: ignore[attr-defined]
        except ImportError:
            from huggingface_hub.utils import get_token  # type: ignore[no-redef]
        if value := (get_token() or "").strip():
            return value
    path = os.environ.get("HF_TOKEN_PATH") or os.path.join(os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"), "token")
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as handle:
        return handle.read().strip() or None
    return None


def _resolve_endpoint(endpoint: Optional[str]) -> str:
    value = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).strip().rstrip("/")
    if reason := _endpoint_rejection(value):
        raise InsecureURLError(reason)
    return value


# -- The Jobs REST client --------------------------------------------------------------------------
def _token_key(endpoint: str, token: str) -> Tuple[str, str]:
    """(endpoint, sha256 of the token): what the process caches a namespace and an API budget by."""
    return (endpoint, hashlib.sha256(token.encode("utf-8")).hexdigest())


def _next_link_rejection(url: str, endpoint: str) -> Optional[str]:
    """Why a pagination link must not be followed (it would carry the token to another server), or None. The
    same Hub under another of its names (hf.co for huggingface.co; another loopback name) is the same server."""
    try:
        link, base = urlsplit(url), urlsplit(endpoint)
        same_port = link.port == base.port
    except ValueError:
        same_port, link, base = False, urlsplit(""), urlsplit(endpoint)
    host, base_host = (link.hostname or "").lower(), (base.hostname or "").lower()
    same_hub = host == base_host or {host, base_host} <= HUB_HOST_NAMES or (
        _is_loopback_host(host) and _is_loopback_host(base_host))
    if (link.scheme != base.scheme or not same_hub or not same_port or link.username or link.password
            or not link.path.startswith(base.path.rstrip("/") + "/api/jobs/")):
        return ("the API's next-page link %r is not under %s/api/jobs/ (nor the same Hub under another name); "
                "not following it, since the token would go with it" % (url[:200], endpoint))
    return None


def _on_endpoint(url: str, endpoint: str) -> str:
    """A next-page link (already accepted by _next_link_rejection) moved onto the configured endpoint."""
    link, base = urlsplit(url), urlsplit(endpoint)
    return endpoint.rstrip("/") + link.path[len(base.path.rstrip("/")):] + ("?" + link.query if link.query else "")


def _retry_after_seconds(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """Seconds to wait from a Retry-After header (delta seconds or an HTTP date), or None."""
    with contextlib.suppress(ValueError):
        return max(0.0, float((value or "").strip()))
    try:
        when = email.utils.parsedate_to_datetime((value or "").strip())
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _retry_delay(attempt: int, retry_after: Optional[float], base: float = API_BACKOFF_BASE_S,
                 cap: float = API_BACKOFF_CAP_S, rng: Callable[[float, float], float] = random.uniform) -> float:
    """Full-jitter exponential backoff; a server's Retry-After wins, capped at RETRY_AFTER_CAP_S."""
    return min(retry_after, RETRY_AFTER_CAP_S) if retry_after is not None else rng(0.0, min(cap, base * (2 ** attempt)))


def _transport_failure(exc: requests.RequestException) -> Tuple[str, bool]:
    """(what went wrong, whether the server may have got the request) for a call with no answer,
    from the exceptions requests wraps: a failed connection sent nothing; the OS's reason kept."""
    reason, nothing_sent, pending, seen = None, isinstance(exc, requests.ConnectTimeout), [exc], set()
    while pending:
        if id(cause := pending.pop(0)) in seen:
            continue
        seen.add(id(cause))
        nothing_sent = nothing_sent or isinstance(cause, urllib3.exceptions.NewConnectionError)
        if reason is None and isinstance(cause, http.client.RemoteDisconnected):
            reason = str(cause)
        elif reason is None and isinstance(cause, OSError) and cause.strerror:
            reason = cause.strerror
        pending += [item for item in (getattr(cause, "reason", None), cause.__cause__, cause.__context__)
                    + tuple(cause.args) if isinstance(item, BaseException)]
    return "%s (%s)" % (type(exc).__name__, reason) if reason else type(exc).__name__, not nothing_sent


def _refused(exc: BaseException) -> bool:
    """A 4xx answer other than 429: the API refused the call, and asking again will not change that."""
    status = exc.status_code if isinstance(exc, JobsAPIError) else None
    return status is not None and 400 <= status < 500 and status != 429


def _server_message(response: requests.Response) -> Optional[str]:
    message = response.headers.get("X-Error-Message")
    try:
        payload = None if message else response.json()
        message = message or (payload.get("error") or payload.get("message") if isinstance(payload, dict) else None)
    except ValueError:
        message = (response.text or "").strip()[:300] or None
    return str(message) if message else None


def _sse_lines(chunks: Iterable[str]) -> Iterable[str]:
    """Log lines from an HF Jobs SSE stream: `data: {"data": line, "timestamp": ...}` events."""
    for raw in chunks:
        if raw is None or not raw.startswith("data:"):
            continue
        payload = raw[5:].strip()
        try:
            event = json.loads(payload)
            line = event.get("data") if isinstance(event, dict) else None
        except ValueError:
            line = payload
        if isinstance(line, str) and not line.startswith("===== Job started"):
            yield line


class _JobsClient:
    """The few Jobs REST calls the provider needs, on a private requests.Session."""

    def __init__(self, endpoint: str, token: str, session: Optional[requests.Session] = None):
        self.endpoint, self._token, self._session = endpoint, token, session or requests.Session()
        if self._session.headers.get("User-Agent", "python-requests/").startswith("python-requests/"):
            self._session.headers["User-Agent"] = USER_AGENT  # a session's own agent (a hook's) is kept
        def bearer(request: Any) -> Any:  # the session's auth, not a header, which a ~/.netrc entry would replace
            request.headers["Authorization"] = "Bearer " + token
            return request
        self._session.auth = bearer
        self.token_key = _token_key(endpoint, token)  # its namespace, API budget and watcher group go by it
        self._budget = _api_budget(endpoint, token)  # shared with every client of this token

    def __repr__(self) -> str:
        return "<_JobsClient endpoint=%r>" % self.endpoint

    def close(self) -> None:
        self._session.close()

    def whoami_namespace(self) -> str:
        with _namespace_locks.setdefault(key := self.token_key, threading.Lock()):  # one call per token and process
            if key not in _namespace_cache:
                payload = self._json("GET", "/api/whoami-v2", "whoami-v2 (namespace lookup)")
                if not (name := payload.get("name") if isinstance(payload, dict) else None):
                    raise JobsAPIError("whoami-v2 (namespace lookup)", 200, "answer has no 'name'",
                                       hint="pass namespace=... explicitly")
                _namespace_cache[key] = str(name)
            return _namespace_cache[key]

    def create_job(self, namespace: str, body: Mapping[str, Any], unique_label: Mapping[str, str],
                   given_up: threading.Event = _NEVER, resent: Callable[[], None] = lambda: None) -> Dict[str, Any]:
        """POST the job; after an ambiguous failure the job with `unique_label` is adopted if listed, else the POST is
        sent again and `resent()` told (the first may make a job later). Once `given_up` is set (a stop), no retry."""
        def find_lost() -> Optional[Dict[str, Any]]:
            if found := self.list_jobs(namespace, labels=unique_label):
                logger.info("create answer was lost; adopting job %s found by its start label", found[0].get("id"))
                return found[0]
            resent()
            return None
        action = "creating the job in namespace %r" % namespace
        job = self._json("POST", "/api/jobs/%s" % namespace, action, body=dict(body), find_lost=find_lost,
                         given_up=given_up)
        if not isinstance(job, dict) or not job.get("id"):  # the caller finds it by its label and cancels it
            raise JobsAPIError(action, 200, "the answer names no job id")
        return job

    def get_job(self, namespace: str, job_id: str, retries: int = API_MAX_RETRIES) -> Dict[str, Any]:
        return self._json("GET", "/api/jobs/%s/%s" % (namespace, job_id), "inspecting job %s" % job_id, retries=retries)

    def cancel_job(self, namespace: str, job_id: str) -> None:
        self._json("POST", "/api/jobs/%s/%s/cancel" % (namespace, job_id), "cancelling job %s" % job_id,
                   retries=2, max_delay=CANCEL_BACKOFF_CAP_S, allow_empty=True, teardown=True)

    def list_jobs(self, namespace: str, labels: Optional[Mapping[str, str]] = None, stages: Sequence[str] = (),
                  retries: int = API_MAX_RETRIES, teardown: bool = False) -> List[Dict[str, Any]]:
        """Jobs with all these labels and one of these stages, following next-page links. A job that names its labels
        must carry them too: a listing that ignored the filter hands over no other job to adopt or cancel."""
        params: Any = [("label", "%s=%s" % item) for item in (labels or {}).items()] + [("stage", s) for s in stages]
        path, jobs = "/api/jobs/%s" % namespace, []  # type: Optional[str], List[Dict[str, Any]]
        for _ in range(LIST_MAX_PAGES):
            links: List[Optional[str]] = []
            payload = self._json("GET", path or "", "listing jobs", params=params, retries=retries, next_links=links,
                                 teardown=teardown)
            jobs += [job for job in (payload if isinstance(payload, list) else []) if isinstance(job, dict) and (
                "labels" not in job or all(isinstance(job["labels"], dict) and job["labels"].get(k) == v
                                           for k, v in (labels or {}).items()))]
            path, params = links[-1] if links else None, None  # the next link carries the query
            if path is None:
                return jobs
            # a listing cut short would miss jobs (a lost create, a leftover for sweep): say so
            if reason := _next_link_rejection(path, self.endpoint):
                raise JobsAPIError("listing jobs", 200, "%s after %d jobs" % (reason, len(jobs)),
                                   hint="report the link to the Jobs API's maintainers")
            path = _on_endpoint(path, self.endpoint)
        raise JobsAPIError("listing jobs", 200, "the API gave more than %d pages (%d jobs so far); a next-page link "
                           "loops or the namespace has too many jobs for one listing" % (LIST_MAX_PAGES, len(jobs)))

    def hardware_flavors(self) -> Optional[frozenset]:
        """The flavor names `GET /api/jobs/hardware` lists, or None (asked once, never retried)."""
        try:
            payload = self._json("GET", "/api/jobs/hardware", "listing the Jobs hardware", retries=0)
        except JobsAPIError as exc:
            logger.debug("the Jobs hardware list is not available (%s); using the built-in flavor list", str(exc))
            return None
        names = [entry.get("name") for entry in payload if isinstance(entry, dict)] if isinstance(payload, list) else []
        return frozenset(str(name) for name in names if name) or None

    def job_logs(self, namespace: str, job_id: str, tail: int = LOG_TAIL_LINES) -> List[str]:
        """The last `tail` log lines, reading the SSE stream for at most LOG_FETCH_TIMEOUT_S. Never raises."""
        lines, deadline = deque(maxlen=tail), time.monotonic() + LOG_FETCH_TIMEOUT_S
        try:
            if self._budget.wait_s() > LOG_FETCH_TIMEOUT_S:  # the budget holds calls past it (a 429's pause): no tail
                return []
            ticket = self._budget.acquire()
            with self._session.get(self.endpoint + "/api/jobs/%s/%s/logs" % (namespace, job_id), params={"tail": tail},
                                   stream=True, timeout=(API_TIMEOUT_S[0], min(2.0, LOG_FETCH_TIMEOUT_S))) as response:
                self._budget.observe(response.headers, ticket)
                if response.status_code >= 300:
                    return []
                for line in _sse_lines(response.iter_lines(decode_unicode=True)):
                    lines.append(line)
                    if time.monotonic() > deadline:
                        break
        except (requests.RequestException, OSError) as exc:  # a read timeout ends a live stream
            logger.debug("log stream for job %s ended: %s", job_id, type(exc).__name__)
        return list(lines)

    def _json(self, method: str, path: str, action: str, params: Any = None, retries: int = API_MAX_RETRIES,
              max_delay: float = RETRY_AFTER_CAP_S, allow_empty: bool = False, body: Any = None,
              next_links: Optional[List[Optional[str]]] = None, find_lost: Optional[Callable[[], Any]] = None,
              teardown: bool = False, given_up: threading.Event = _NEVER) -> Any:
        """A call retried on 429/5xx/connection errors with backoff; after an ambiguous failure a create asks
        `find_lost()` for what it made anyway. A `teardown` never waits for budget. `given_up` set: no more sent."""
        url = path if path.startswith(self.endpoint + "/") else self.endpoint + path
        sent_maybe = False  # whether any attempt may have reached the server without an answer
        for attempt in itertools.count():
            retry_after, paused = None, None  # type: Optional[float], Optional[float]
            if (ticket := self._budget.acquire(teardown, given_up)) is None:
                stopped = SandboxError("stop_container() was called while %s" % action)
                stopped.may_have_acted = sent_maybe  # type: ignore[attr-defined]
                raise stopped
            try:
                response: Optional[requests.Response] = self._session.request(
                    method, url, params=params, json=body, timeout=API_TIMEOUT_S)
            except requests.RequestException as exc:
                response = None
                failure, ambiguous = _transport_failure(exc)
            else:
                self._budget.observe(response.headers, ticket)
                if response.status_code < 300:
                    if next_links is not None:
                        next_links.append((response.links.get("next") or {}).get("url"))
                    try:
                        return response.json()
                    except ValueError:  # also an empty body
                        if allow_empty:
                            return None
                        raise JobsAPIError(action, response.status_code, "the answer is not JSON",
                                           response.headers.get("X-Request-Id")) from None
                retry_after = _retry_after_seconds(response.headers.get("Retry-After"))
                if response.status_code == 429:
                    paused = self._budget.rate_limited(retry_after, response.headers)
                elif not 500 <= response.status_code <= 599:
                    retries = attempt  # refused: final, and it made nothing (an earlier attempt may have)
                failure, ambiguous = "HTTP %d" % response.status_code, 500 <= response.status_code <= 599
                response.close()
            sent_maybe = sent_maybe or ambiguous
            if find_lost is not None and ambiguous:
                try:
                    found = find_lost()
                except JobsAPIError as lookup:  # report the create, which is what failed
                    raise JobsAPIError(
                        action, response.status_code if response is not None else None,
                        "%s; whether it made a job anyway could not be checked (%s)" % (failure, lookup),
                        hint="run `python -m hf_sandbox_provider sweep` once %s answers" % self.endpoint) from None
                if found is not None:
                    return found
            if attempt >= retries:
                err = JobsAPIError(action, None, failure, hint="check the network and HF_ENDPOINT (%s)" % self.endpoint)
                if response is not None:  # the last answer, with the server's own words
                    err = JobsAPIError(action, response.status_code, _server_message(response),
                                       response.headers.get("X-Request-Id"), _STATUS_HINTS.get(response.status_code))
                err.may_have_acted = sent_maybe
                raise err from None
            # after a 429 the budget holds ordinary calls until the reset; a teardown waits it out here
            delay = (paused if teardown else max(0.0, paused - self._budget.wait_s())) if paused is not None else min(
                _retry_delay(attempt, retry_after), max_delay)
            logger.info("%s: %s from %s; retry %d of %d in %.1fs", action, failure, self.endpoint,
                        attempt + 1, retries, delay)
            given_up.wait(delay)  # a stop ends the pause: the next acquire sends nothing


# -- Process-wide Jobs API budget and job watcher (many providers, a thread per group, O(1) calls per interval) -
# By _token_key, made once under its own lock (a stalled Hub stalls no other's starts): namespace (whoami-v2), budget.
_namespace_cache: Dict[Tuple[str, str], str] = {}
_namespace_locks: Dict[Tuple[str, str], threading.Lock] = {}
_budgets: Dict[Tuple[str, str], "_ApiBudget"] = {}
_budgets_lock = threading.Lock()
_RateLimitInfo = Optional[Tuple[int, int, Optional[int], Optional[int], str]]
# huggingface_hub's regular expressions for the IETF draft's headers, for a huggingface_hub older than 1.2.
_RATELIMIT = re.compile(r"\"(?P<resource>\w+)\"\s*;\s*r\s*=\s*(?P<r>\d+)\s*;\s*t\s*=\s*(?P<t>\d+)")
_RATELIMIT_POLICY = re.compile(r"q\s*=\s*(?P<q>\d+).*?w\s*=\s*(?P<w>\d+)")


class _ApiBudget:
    """One token's view of the Hub's rate limit: the server's RateLimit headers, else its own calls in a sliding window.
    With little left it paces calls to the reset, keeping `reserve` for teardown; a 429 pauses every other call."""

    def __init__(self, calls: int = RATE_LIMIT_CALLS, window_s: float = RATE_LIMIT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.calls, self.window_s = calls, window_s  # the quota per window: the server's once it says
        self.clock, self.sleep, self._lock = clock, sleep, threading.Lock()
        self.server_told = False  # whether an answer carried RateLimit headers
        self.remaining: Optional[float] = None  # the server's count (less calls sent since), while it holds
        self.reset_at = 0.0  # clock time the server's window resets
        self.paused_until = 0.0  # after a 429: ordinary calls wait until then
        self.rate_limited_count = self.teardown_sent = 0
        self.sent = 0  # calls sent through this budget; a call's ticket is this count once it was sent
        self.waited_s = 0.0  # time calls spent held here (and watcher refreshes put off), over all threads
        self._next_paced = 0.0  # while pacing: when the next ordinary call may go
        self._sent: deque = deque()  # send times within the window, for a server that says nothing

    @property
    def reserve(self) -> int:  # (a quota of a few calls keeps one for ordinary calls, or none would go)
        return min(self.calls - 1, max(RATE_LIMIT_RESERVE_MIN, int(self.calls * RATE_LIMIT_RESERVE)))

    def acquire(self, teardown: bool = False, given_up: threading.Event = _NEVER) -> Optional[int]:
        """Block until a call may be sent and count it; returns its ticket for `observe` (None once `given_up` is
        set). Teardown (cancels) never waits: the reserve is kept for it, and past that the server's 429 answers."""
        warned = False
        while True:
            if given_up.is_set():  # a stop: the call is not sent
                return None
            with self._lock:
                now = self.clock()
                left, reset_in = self._estimate(now)
                if (wait := 0.0 if teardown else self._wait(now, left, reset_in)) <= 0:
                    if not teardown and left < self.calls * RATE_LIMIT_PACE_BELOW:
                        self._next_paced = now + reset_in / max(1.0, left - self.reserve)
                    if self.remaining is not None:
                        self.remaining = max(0.0, self.remaining - 1)
                    if not self.server_told:  # (once the server counts, send times are not needed)
                        self._sent.append(now)
                    self.teardown_sent += int(teardown)
                    self.sent += 1
                    return self.sent
            if not warned and wait >= RATE_LIMIT_RECHECK_S:
                warned = True
                logger.info("Jobs API budget: about %d of %d calls left for %.0fs; pacing this call %.1fs",
                            left, self.calls, reset_in, wait)
            self.waited_s += min(wait, RATE_LIMIT_RECHECK_S)
            self.sleep(min(wait, RATE_LIMIT_RECHECK_S))  # other threads' answers may change the count

    def wait_s(self) -> float:
        """How long an ordinary call would wait now, counting nothing (the watcher never blocks)."""
        with self._lock:
            now = self.clock()
            return self._wait(now, *self._estimate(now))

    def observe(self, headers: Mapping[str, str], ticket: int) -> None:
        """Take the server's count from an answer's RateLimit headers; `ticket` (from acquire) discounts the
        calls this process sent after that request, which the count does not include yet."""
        info = _ratelimit_info(headers)
        if info is None or info[4] != RATE_LIMIT_RESOURCE:  # e.g. whoami's own, smaller bucket
            return
        remaining, reset_in, quota, window, _ = info
        with self._lock:
            self.server_told = True
            self._sent.clear()  # the server counts from now on
            if quota and window:
                self.calls, self.window_s = quota, float(window)
            self.remaining, self.reset_at = max(0.0, remaining - (self.sent - ticket)), self.clock() + reset_in

    def rate_limited(self, retry_after: Optional[float], headers: Optional[Mapping[str, str]] = None) -> float:
        """A call was answered 429: pause every ordinary call until the server's reset (`t` of RateLimit when
        it says nothing is left, else Retry-After, else a backoff). Returns the pause in seconds."""
        info = _ratelimit_info(headers or {})
        with self._lock:
            self.rate_limited_count += 1
            if info is not None and info[0] == 0:
                delay = info[1] + RATE_LIMIT_RESET_MARGIN_S
                if info[4] == RATE_LIMIT_RESOURCE:
                    self.remaining, self.reset_at = 0.0, self.clock() + info[1]
            elif retry_after is not None:
                delay = retry_after + RATE_LIMIT_RESET_MARGIN_S
            else:
                delay = _retry_delay(min(self.rate_limited_count, 6), None)
            delay = min(delay, self.window_s + RATE_LIMIT_RESET_MARGIN_S)
            if info is None or info[4] == RATE_LIMIT_RESOURCE:  # another bucket's (whoami's) 429: its call waits
                self.paused_until = max(self.paused_until, self.clock() + delay)
        logger.info("Jobs API answered 429 (%s): %.1fs pause", info[4] if info else "no RateLimit header", delay)
        return delay

    def _estimate(self, now: float) -> Tuple[float, float]:
        """(calls left, seconds to the reset), under the lock: the server's count while its window lasts
        (then a fresh quota until it says otherwise), else this process's calls in the last window."""
        if self.server_told:
            if now >= self.reset_at:
                self.remaining, self.reset_at = float(self.calls), now + self.window_s
            return float(self.remaining or 0.0), self.reset_at - now
        while self._sent and self._sent[0] <= now - self.window_s:
            self._sent.popleft()
        return float(self.calls - len(self._sent)), (self._sent[0] if self._sent else now) + self.window_s - now

    def _wait(self, now: float, left: float, reset_in: float) -> float:
        """An ordinary call's wait: a 429's pause, the reset if only the reserve is left, else its pacing turn."""
        if self.paused_until > now:
            return self.paused_until - now
        if left <= self.reserve:
            return max(reset_in, 0.01)
        return max(0.0, self._next_paced - now) if left < self.calls * RATE_LIMIT_PACE_BELOW else 0.0


def _ratelimit_info(headers: Mapping[str, str]) -> _RateLimitInfo:
    """(remaining, seconds to reset, quota or None, window or None, resource) from an answer's RateLimit
    headers, or None: huggingface_hub's parse_ratelimit_headers (1.2 and later), else the same reading."""
    try:
        from huggingface_hub.utils import parse_ratelimit_headers
    except ImportError:
        return _parse_ratelimit(headers)
    info = parse_ratelimit_headers(headers)
    return None if info is None else (info.remaining, info.reset_in_seconds, info.limit, info.window_seconds,
                                      info.resource_type)


def _parse_ratelimit(headers: Mapping[str, str]) -> _RateLimitInfo:
    lowered = {str(key).lower(): value for key, value in headers.items()}
    if (match := _RATELIMIT.search(lowered.get("ratelimit") or "")) is None:
        return None
    policy = _RATELIMIT_POLICY.search(lowered.get("ratelimit-policy") or "")
    return (int(match.group("r")), int(match.group("t")), int(policy.group("q")) if policy else None,
            int(policy.group("w")) if policy else None, match.group("resource"))


def _configured_rate_limit() -> Tuple[int, float]:
    """The quota and window assumed until the server says: HF_SANDBOX_RATE_LIMIT, or free tier."""
    if not (text := os.environ.get(RATE_LIMIT_ENV, "").strip()):
        return RATE_LIMIT_CALLS, RATE_LIMIT_WINDOW_S
    calls, _, window = text.partition("/")
    try:
        quota, seconds = int(calls), float(window or RATE_LIMIT_WINDOW_S)
    except ValueError:
        quota, seconds = 0, 0.0
    if quota < 1 or not seconds > 0:
        raise SandboxConfigError("%s=%r must be <calls>/<seconds>, e.g. 2500/300 for a PRO account"
                                 % (RATE_LIMIT_ENV, text))
    return quota, seconds


def _api_budget(endpoint: str, token: str) -> _ApiBudget:
    with _budgets_lock:
        if (key := _token_key(endpoint, token)) not in _budgets:
            _budgets[key] = _ApiBudget(*_configured_rate_limit())
        return _budgets[key]


class _Watch:
    """A starting provider's registration: its latest job answer or the error ending its wait; `wake` on each change."""

    def __init__(self, job_id: str, interval_s: float, wake: threading.Event,
                 job: Optional[Mapping[str, Any]] = None, since: Optional[float] = None) -> None:
        self.job_id, self.base_interval_s, self.wake = job_id, interval_s, wake
        self.since = time.monotonic() if since is None else since  # when the job was submitted
        self.job, self.error = job, None  # type: Optional[Mapping[str, Any]], Optional[BaseException]
        self.refreshed = 0  # answers received: a refresh inspects the least refreshed missing jobs first

    def interval_s(self, now: float) -> float:
        slow = now - self.since >= WATCH_SLOWDOWN_AFTER_S
        return max(self.base_interval_s, WATCH_SLOW_INTERVAL_S) if slow else self.base_interval_s

    def deliver(self, job: Mapping[str, Any]) -> None:
        changed = _watch_signature(job) != _watch_signature(self.job or {})  # raises before keeping a non-object
        self.job, self.refreshed = job, self.refreshed + 1
        if changed:
            self.wake.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.wake.set()


def _watch_signature(job: Mapping[str, Any]) -> Tuple[Any, ...]:
    status = job.get("status") or {}
    return (status.get("stage"), tuple(status.get("exposeUrls") or ()))


class _WatchGroup:
    """The watches that share one (endpoint, token, namespace): refreshed together by one call, in their own thread."""

    def __init__(self, client: "_JobsClient", namespace: str) -> None:
        self.client, self.namespace, self.next_due, self.failures = client, namespace, 0.0, 0
        self.watches, self.thread = [], None  # type: List[_Watch], Optional[threading.Thread]


class _JobWatcher:
    """Refreshes every starting job of the process: per group, one thread and per interval one `inspect` (one job) or
    one `list` by this process's label plus an `inspect` per job missed. A group's stalled Hub holds up no other."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: the GC may run a finalizer that unregisters while it is held
        self._cond = threading.Condition(self._lock)
        self._groups: Dict[Tuple[str, str, str], _WatchGroup] = {}

    def register(self, endpoint: str, token: str, new_session: Callable[[], requests.Session], namespace: str,
                 job_id: str, interval_s: float, wake: threading.Event,
                 job: Optional[Mapping[str, Any]] = None, since: Optional[float] = None) -> _Watch:
        """Watch `job_id` until `unregister`; one (endpoint, token, namespace)'s jobs share a refresh (one client)."""
        watch = _Watch(job_id, interval_s, wake, job, since)  # its group holds the namespace
        key = _token_key(endpoint, token) + (namespace,)
        with self._lock:
            if (group := self._groups.get(key)) is None:
                group = self._groups[key] = _WatchGroup(_JobsClient(endpoint, token, new_session()), namespace)
                group.next_due = time.monotonic() + interval_s
            group.watches.append(watch)
            group.next_due = min(group.next_due, time.monotonic() + watch.interval_s(time.monotonic()))
            if group.thread is None:  # (recorded once started: a start refused by a thread limit is tried again)
                thread = threading.Thread(target=self._run, args=(key, group), name="hf-sandbox-job-watcher",
                                          daemon=True)
                try:
                    _start_thread(thread)
                except BaseException:  # a thread limit, or a signal that landed as the thread began (it runs)
                    group.watches.remove(watch)
                    if thread.ident is None:  # no thread: forget the group now (only its thread would)
                        self._groups.pop(key, None)
                        group.client.close()
                    raise
                finally:
                    group.thread = thread if thread.ident is not None else None
            self._cond.notify_all()
        return watch

    def unregister(self, watch: _Watch) -> None:
        with self._lock:
            for group in [g for g in self._groups.values() if watch in g.watches]:
                group.watches.remove(watch)
            self._cond.notify_all()

    def _run(self, key: Tuple[str, str, str], group: _WatchGroup) -> None:
        """A group's thread: refresh it when due; once it has no watch, forget it (under the lock: the next
        register() makes a new group and thread) and end."""
        while True:
            with self._lock:
                if not group.watches:
                    self._groups.pop(key, None)
                    break
                now = time.monotonic()
                if group.next_due > now:
                    self._cond.wait(group.next_due - now)
                    continue
                watches = list(group.watches)
                group.next_due = now + min(w.interval_s(now) for w in watches)
            self._refresh(group, watches)
        group.client.close()

    def _refresh(self, group: _WatchGroup, watches: List[_Watch]) -> None:
        """One refresh of a group; failures pause it, and end the waits after API_MAX_RETRIES. A refresh the
        budget would hold is put off: a group whose waits all ended keeps no thread through a pause."""
        client = group.client
        if (held := client._budget.wait_s()) > 0:
            put_off = min(held, RATE_LIMIT_RECHECK_S)
            group.next_due = max(group.next_due, time.monotonic() + put_off)
            client._budget.waited_s += put_off
            return
        try:
            if len(watches) == 1:
                found = {watches[0].job_id: client.get_job(group.namespace, watches[0].job_id, retries=0)}
            else:
                found = {str(job.get("id")): job for job in client.list_jobs(
                    group.namespace, labels={PROCESS_LABEL_KEY: _process_label}, stages=LIVE_STAGES, retries=0)}
                # the least refreshed first, so a job that stays unlisted cannot starve the others
                missing = sorted((w for w in watches if w.job_id not in found),
                                 key=lambda w: w.refreshed)[:WATCH_MAX_INSPECTS]
                for watch in missing:
                    try:
                        found[watch.job_id] = client.get_job(group.namespace, watch.job_id, retries=0)
                    except JobsAPIError as exc:
                        if not _refused(exc):
                            raise
                        watch.fail(exc)  # e.g. 404: this job is gone; the others are fine
            for watch in [w for w in watches if w.job_id in found]:
                watch.deliver(found[watch.job_id])  # (an answer that is no JSON object fails here, in the try)
            group.failures = 0
        except BaseException as exc:  # never kill the thread: the waiting providers get the error instead
            group.failures += 1
            # An outage (5xx, 429, no answer) fails no watch (each wait has a deadline); a refusal or a lasting bug does
            if _refused(exc) or not isinstance(exc, JobsAPIError if group.failures > API_MAX_RETRIES else Exception):
                for watch in watches:
                    watch.fail(exc)
                group.failures = 0
            else:  # a 429 paused this token: wait that out here, so other tokens' groups keep going
                group.next_due = max(time.monotonic() + _retry_delay(group.failures, None), client._budget.paused_until)
                logger.debug("job watcher: refresh failed (%s), retrying", str(exc))


def _reset_after_fork() -> None:
    """A forked child inherits no threads: give it its own watcher, budgets, process label and locks (a lock held at the
    fork would stay held; hardware lists stay valid). Of the parent's jobs and proxies it owns none: their safety nets
    and shared proxies are forgotten, not stopped, so its exit cancels nothing of the parent's; it mounts on its own."""
    global _watcher, _process_label, _budgets_lock, _hardware_locks, _namespace_locks, _shared_proxy_lock, _reaper
    _watcher, _process_label, _reaper = _JobWatcher(), uuid.uuid4().hex, _Reaper()
    _budgets_lock, _hardware_locks, _namespace_locks, _shared_proxy_lock = threading.Lock(), {}, {}, threading.Lock()
    _budgets.clear()
    for finalizer in list(_live_finalizers):
        finalizer.detach()
    _live_finalizers.clear()
    _shared_proxies.clear()
    _unsettled.clear()  # (the parent's threads: not the child's to wait for)


_watcher = _JobWatcher()
_process_label = uuid.uuid4().hex  # this process's PROCESS_LABEL_KEY value (a forked child gets its own)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


# -- Process-wide state: the shared proxy and the exit hook ----------------------------------------
_shared_proxies: Dict[Optional[str], Any] = {}  # by mode, None or "process" (see _shared_proxy)
_shared_proxy_lock = threading.Lock()
_live_finalizers: "set[weakref.finalize]" = set()  # armed safety nets (weak), and those the reaper has yet to end


class _Release:
    """A safety net's work, `release(*args, **kwargs)`, queued for the reaper when the GC fires its net."""

    def __init__(self, release: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self.release, self.args, self.kwargs, self.net = release, args, kwargs, None  # net: its weakref.finalize

    def run(self) -> None:
        try:
            self.release(*self.args, **self.kwargs)
        finally:
            _live_finalizers.discard(self.net)


class _Reaper:
    """Runs the releases of collected providers. The GC runs a finalizer in whichever thread allocates, which may hold
    a lock the release takes (the proxy's host pools, its child's channel) and would wait on itself for ever: so a
    finalizer only queues (SimpleQueue.put is safe there) for this thread, which lives while a safety net is armed."""

    def __init__(self) -> None:
        self.queue: "queue.SimpleQueue[Optional[_Release]]" = queue.SimpleQueue()
        self.lock, self.thread, self.exiting = threading.Lock(), None, False  # type: threading.Lock, Any, bool

    def arm(self, owner: Any, release: Callable[..., Any], *args: Any, **kwargs: Any) -> "weakref.finalize":
        """`owner`'s safety net: `release(*args, **kwargs)` once it is collected (never if args hold it), or at exit."""
        with self.lock:  # (the thread ends under it once no net is armed: a new net starts another)
            if self.thread is None or not self.thread.is_alive():  # (or its start failed, or a release killed it)
                self.thread = threading.Thread(target=self._run, name="hf-sandbox-reaper", daemon=True)
                with contextlib.suppress(RuntimeError):  # no thread to spare: the next arm tries, the exit runs all
                    _start_thread(self.thread)
            action = _Release(release, args, kwargs)
            action.net = net = weakref.finalize(owner, self.queue.put, action)  # all the GC's thread does
            net.atexit = False
            _live_finalizers.add(net)
        return net

    def retire(self, net: "weakref.finalize", run: bool = False) -> None:
        """Disarm `net` (`run`: run it here first, unless it ran); the thread ends if it was the last net."""
        if (info := net.detach()) is not None and run:
            info[2][0].run()
        _live_finalizers.discard(net)
        self.queue.put(None)

    def now(self) -> List[Callable[[], None]]:
        """For the exit hooks and signal teardown: the armed nets, and the releases queued and not begun (each once)."""
        actions = [functools.partial(self.retire, net, True) for net in list(_live_finalizers)]
        with contextlib.suppress(queue.Empty):
            while True:
                actions.append(getattr(self.queue.get_nowait(), "run", lambda: None))
        return actions + [functools.partial(self.queue.put, None)]  # (a wake-up the drain took: the reaper may end)

    def _run(self) -> None:
        while (action := self.queue.get()) is None or not self.exiting:  # (exiting: the exit hook runs the queue)
            if action is not None:  # (one at a time, as the collector ran them)
                with _unsettled_while("the release of a garbage-collected provider", "sweep"):  # (exit waits)
                    action.run()
            with self.lock:
                if not _live_finalizers and self.queue.empty():
                    self.thread = None
                    return
        with self.lock:  # (an arm from now on starts a new thread)
            self.thread = None
        self.queue.put(action)


_reaper = _Reaper()
# Cancels and creates under way by (what, thread) (two threads may cancel one job): the sweep that finds the job, and
# for a create the rescue that cancels what it made, found by its start label (see _settle). No lock: dict operations
# are atomic, and a signal handler's raise can leave a lock the main thread enters held for ever (a Condition's
# __enter__ is Python code: the raise can land after its acquire).
_unsettled: Dict[Tuple[str, int], Tuple[str, Optional[Callable[[], List[str]]]]] = {}
# Made before our exit hook is registered, so weakref.finalize's own runs after it: from then on a net fires nothing.
weakref.finalize(_in_parallel, int).detach()


@contextlib.contextmanager
def _unsettled_while(what: str, sweep: str, rescue: Optional[Callable[[], List[str]]] = None) -> Iterator[None]:
    key = (what, threading.get_ident())
    try:
        _unsettled[key] = (sweep, rescue)
        yield
    finally:
        _unsettled.pop(key, None)


def _settle(budget_s: float, stuck: Optional[int] = None) -> None:
    """Wait up to `budget_s` for other threads' cancels and creates (not thread `stuck`'s: a signal interrupted it),
    cancel the job each create left made if the Hub lists it, then name each left and the sweep that cancels its job."""
    me, deadline = threading.get_ident(), time.monotonic() + budget_s
    waited = deadline - min(RESCUE_RESERVE_S, budget_s / 2)
    while any(ident not in (me, stuck) for _, ident in list(_unsettled)) and time.monotonic() < waited:
        time.sleep(0.05)  # (a poll: at exit only, and no lock where a signal may land)
    left = {what: entry for (what, _), entry in list(_unsettled.items())}  # a job named once
    rescued: Dict[str, List[str]] = {}  # what -> the rescue's problems ([]: cancelled)
    _in_parallel([lambda what=what, rescue=rescue: rescued.__setitem__(what, rescue()) for what, (_, rescue)
                  in left.items() if rescue is not None], max(0.0, deadline - time.monotonic()))
    for what, (sweep, _) in sorted(item for item in left.items() if rescued.get(item[0]) != []):  # not cancelled
        logger.warning("%s had not ended as this process exits (the Hub was slow or refusing calls): its job may run "
                       "(and bill) until its timeout; cancel it with `python -m hf_sandbox_provider %s`", what, sweep)


def _shared_proxy(mode: Optional[str] = None) -> "_proxy.AuthProxy":
    """One loopback proxy for every provider in the process (started on first use). `mode="process"`:
    one proxy host child process (AuthProxy.spawn) shared the same way, replaced once it ended."""
    with _shared_proxy_lock:
        shared = _shared_proxies.get(mode)
        if mode == PROXY_PROCESS and shared is not None and not shared.running:
            shared.stop()  # reaps the dead child and closes its channel; its routes died with it
            shared = None
        if shared is None:  # a proxy host offers the same routes API as an AuthProxy
            shared = _shared_proxies[mode] = (_proxy.AuthProxy.spawn() if mode == PROXY_PROCESS
                                              else _proxy.AuthProxy().start())
        return shared


def _cancel_briefly(client: "_JobsClient", namespace: str, job_id: str) -> Optional[str]:
    """Cancel with a few brief retries; None once nothing bills any more, else the last reason."""
    reason: Optional[str] = None
    for attempt in range(CANCEL_ATTEMPTS):
        try:
            client.cancel_job(namespace, job_id)
            return None
        except JobsAPIError as exc:
            reason = str(exc)
            if exc.status_code == 404:
                return None  # the job no longer exists
            if _refused(exc):  # the API refuses to cancel a finished job: that is success too
                with contextlib.suppress(Exception):
                    if (client.get_job(namespace, job_id, retries=0).get("status") or {}).get(
                            "stage") in TERMINAL_STAGES:
                        return None
        except Exception as exc:
            reason = "%s: %s" % (type(exc).__name__, exc)
        if attempt + 1 < CANCEL_ATTEMPTS:
            time.sleep(random.uniform(0, min(CANCEL_BACKOFF_CAP_S, 0.25 * 2 ** attempt)))
    return reason


def _release_job(client: Optional["_JobsClient"], namespace: Optional[str], job_id: Optional[str],
                 proxy: Optional["_proxy.AuthProxy"], base_url: Optional[str], job_url: Optional[str],
                 abandoned: bool = False, twin_label: Optional[str] = None) -> bool:
    """Unmount the route and cancel the job, warning (never raising) about what could not be done; True
    when cancelled. Plain values, never the provider: the safety net (`abandoned`) uses it too."""
    if abandoned and job_id:
        logger.warning("HF job %s is still running at exit (or its provider was garbage-collected): "
                       "cancelling it", job_id)
    problems, cancelled = [], False
    try:
        problems.extend(_unmount(proxy, base_url))
        if job_id and namespace and client is not None:
            with _unsettled_while("the cancel of HF job %s" % job_id, "sweep"):
                outcome = _cancel_briefly(client, namespace, job_id)
            if outcome is None:
                cancelled = True
                logger.info("HF job %s cancelled", job_id)
            else:
                problems.append("could not cancel it (%s)" % outcome)
            if twin_label:  # the create was sent again after a lost answer: the first may have made a job too
                problems.extend(_cancel_labelled(client, namespace, twin_label, keep=job_id))
        if client is not None:
            client.close()
    except BaseException as exc:  # e.g. a second Ctrl-C during teardown: report, do not mask
        problems.append("teardown interrupted (%s)" % type(exc).__name__)
    if problems:  # (a job that was cancelled is not billing: then only what failed is said)
        still = "" if cancelled or not job_id else (
            " Unless it has ended, it runs (and bills) until its timeout; cancel it at %s or run `python -m "
            "hf_sandbox_provider sweep`" % (job_url or "the Hub"))
        logger.warning("HF job %s: %s.%s", job_id, "; ".join(problems), still)
    return cancelled


def _cancel_labelled(client: "_JobsClient", namespace: str, start_label: str, keep: Optional[str] = None) -> List[str]:
    """Cancel every job but `keep` labelled with `start_label` (made by a create whose answer was lost); return what
    could not be done, and that none is listed yet if so: the Hub may still make it (when is unknown)."""
    sweep = "run `python -m hf_sandbox_provider sweep --label %s=%s`" % (START_LABEL_KEY, start_label)
    who = "the first create" if keep else "the failed create"
    try:
        found = [job_id for job in client.list_jobs(namespace, labels={START_LABEL_KEY: start_label}, teardown=True)
                 if (job_id := str(job.get("id"))) != keep]
    except BaseException as exc:
        return ["could not check whether %s made a job anyway (%s); if it did, it runs until its timeout: %s"
                % (who, type(exc).__name__, sweep)]
    problems = [] if found else ["no job of %s is listed yet (its answer was lost or interrupted); if the Hub makes "
                                 "one later, it runs until its timeout: %s" % (who, sweep)]
    for job_id in found:
        logger.info("%s made HF job %s anyway: cancelling it", who, job_id)
        _release_job(client, namespace, job_id, None, None, None)  # says if it could not
    return problems


def _unmount(proxy: Optional["_proxy.AuthProxy"], base_url: Optional[str]) -> List[str]:
    if base_url and proxy is not None:
        try:
            proxy.unmount(base_url)
        except Exception as exc:
            return ["could not unmount its proxy route (%s)" % type(exc).__name__]
    return []


@atexit.register
def _stop_everything_at_exit() -> None:
    """Cancel the jobs of providers still running at interpreter exit (STOP_PARALLEL at a time, as stop_all does:
    hundreds one by one could outlast a supervisor's kill), then stop the shared proxy."""
    _reaper.exiting = True  # releases queued from now on are the hook's (one under way: _settle waits for it)
    _in_parallel(_reaper.now())  # each runs at most once; a no-op if teardown already detached it
    _settle(EXIT_SETTLE_S)  # e.g. a stop_all() that Ctrl-C cut short, its cancels waiting out a 429
    _in_parallel(_reaper.now())  # the jobs those creates recorded meanwhile
    _reaper.exiting = False  # (a test calling the hook in-process leaves the reaper working)
    with _shared_proxy_lock:
        shared = list(_shared_proxies.values())  # proxy="process": its child stops cleanly
        _shared_proxies.clear()
    for proxy in shared:
        with contextlib.suppress(Exception):
            proxy.stop()


# -- The layers: the registry of placements, the names re-exported lazily (PEP 562), the command line ---
_LAYER_OF = {name: module for module, names in _LAYERS.items() for name in names}
# A layer's names count as this module's (dir(), `import *`) when its file is present.
__all__ += [name for name, module in _LAYER_OF.items()
            if importlib.util.find_spec("%s.%s" % (__package__, module) if __package__ else module)]
# Placements besides a dedicated job, by keyword: the layer (file) loaded on first use; it calls _register_placement.
_PLACEMENT_LAYERS = {"pool": "hf_sandbox_pool"}
_placements: Dict[str, Any] = {}  # keyword -> the registered layer; filled as layers are imported


def _register_placement(keyword: str, layer: Any) -> None:
    """Called by a placement layer as it is imported. The pool layer offers `pool_rejection(value)`,
    `PooledSandbox(provider, settings)` (what runs the provider's job) and `prewarm(provider, n, boot)`."""
    _placements[keyword] = layer


def _placement(keyword: str) -> Any:
    """The layer registered for `keyword=`, imported on first use (a dedicated job never loads one)."""
    if keyword not in _placements:
        _import_layer(_PLACEMENT_LAYERS[keyword], "%s= (pooled placement)" % keyword)
    return _placements[keyword]


def _import_layer(module: str, wanted: str) -> Any:
    """A layer beside this module (relative in a package, absolute at top level), imported on first use; an
    ImportError naming its file when it is missing (a vendored core copies only the layers it uses)."""
    name = "%s.%s" % (__package__, module) if __package__ else module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise  # the layer is there but something it imports is not: its own error says what
        raise ImportError("%s lives in %s.py, which is not next to %s: copy it there from the hf-sandbox-provider "
                          "repository" % (wanted, module, os.path.basename(__file__)), name=name) from None


def __getattr__(name: str) -> Any:
    if name not in _LAYER_OF:
        raise AttributeError("module %r has no attribute %r" % (__name__, name))
    return getattr(_import_layer(_LAYER_OF[name], name), name)


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))


if __name__ == "__main__":
    try:
        _cli = _import_layer("hf_sandbox_cli", "The command line (smoke, sweep, bench)")
    except ImportError as exc:
        print("error: %s" % exc, file=sys.stderr)
        sys.exit(2)  # the command line's usage-error status
    sys.exit(_cli.main())
