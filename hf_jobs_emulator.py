"""A local stand-in for Hugging Face Jobs, and an OpenEnv-compatible echo environment.

`JobsEmulator` serves the HF Jobs REST API (whoami-v2, hardware, create, inspect, list, cancel, logs,
labels, expose, metrics, rerun; optionally the Hub's per-user rate limit and pagination) on loopback with the
JSON shapes huggingface_hub's `HfApi` parses, runs each job's command as a local
process group, and fronts every exposed port with a token gate, as `https://<id>--<port>.hf.jobs`
does. Faults (slow scheduling, crash at boot, 429s and 5xx, lost create answers, jobs that never get a
URL, sudden death, and with `network_faults=True` stalls and resets on the wire) can be set per
emulator or per job, so the provider's failure paths can be exercised offline.

A job that is huggingface_hub's sandbox bootstrap (`SandboxPool` hosts, `Sandbox.create`) runs the
emulated sandbox server of `hf_sbx_emulator.py` on its port 49983 instead of downloading the real one.

`python -m hf_jobs_emulator echo-server` is a stdlib OpenEnv echo environment (HTTP and `/ws`, on
`$SBX_PROXY_DIR/<port>.sock` in a pooled sandbox);
`python -m hf_jobs_emulator serve` runs the emulator standalone and prints its endpoint and token.

Built for hundreds of jobs at once: nothing slow runs under the emulator's lock, echo-server jobs are
forked from one pre-imported "zygote" process (a fresh interpreter per job cannot boot 256 of them on
2 cores in seconds), and one thread probes every booting job's `/health`.

Where it differs from the real service: jobs run on this machine (the image is not pulled; the
command runs as is, or `default_command` when the create body has none or OpenEnv's default server
command, so the echo server plays an OpenEnv image), exposed URLs are
`http://127.0.0.1:<port>` gates instead of `https://<id>--<port>.hf.jobs`, every valid token is a
user of this emulator only, and `timeoutSeconds` counts from the start of RUNNING.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import errno
import gc
import importlib
import importlib.util
import json
import logging
import os
import random
import re
import secrets
import select
import selectors
import shutil
import signal
import socket
import socketserver
import ssl
import string
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

if __package__:  # vendored inside a package: proxy.py sits next to this module
    from .proxy import AuthProxy, Refusal, Route, _is_loopback_host
else:  # top-level module (the repo layout), or run as a script
    from proxy import AuthProxy, Refusal, Route, _is_loopback_host

log = logging.getLogger("hf_jobs_emulator")


def _jobs_facts() -> Any:
    """The provider's core, for the HF Jobs facts it holds (KNOWN_FLAVORS, LIVE_STAGES, TERMINAL_STAGES: one
    copy). Imported on first use by the Hub side only: the echo server and its job processes never load it."""
    if __package__:
        from . import hf_sandbox_provider as core
    else:
        import hf_sandbox_provider as core
    return core

# The default namespace (user name) of the emulator's own token.
DEFAULT_NAMESPACE = "local"
# HF Jobs runs a job for 30 minutes when the create body has no `timeoutSeconds`.
DEFAULT_JOB_TIMEOUT_S = 30 * 60
# SIGTERM first so a job can shut down cleanly, SIGKILL after this many seconds: short, because
# tests and benchmarks stop hundreds of jobs and a server that ignores SIGTERM must not stall them.
KILL_GRACE_S = 3.0
# How often the supervisor of a Popen job looks at its process and at cancel / timeout / fault
# deadlines: quick enough that a cancel is seen well under a second later. (Zygote jobs do not poll:
# their exit and every request wake their supervisor.)
SUPERVISE_POLL_S = 0.1
# How often the emulator probes a booting job's first exposed port for `GET /health` == 200, to record
# when its server became ready (benchmarks subtract it from the provider's own ready time).
HEALTH_PROBE_INTERVAL_S = 0.02
# The one prober thread makes at most this many attempts per second over all booting jobs (256 jobs
# -> each every 64 ms): a refused loopback connect costs ~30 us of CPU, so this stays under ~15% of a
# core while hundreds of servers boot, and the recorded time is at worst one interval late.
HEALTH_PROBES_PER_S = 4000
# An attempt (connect, send, status line) that takes longer is abandoned and retried.
HEALTH_PROBE_TIMEOUT_S = 1.0
# The zygote answers a fork request in milliseconds, but requests queue behind each other: 256 at once
# on a machine at load 100 took up to 10 s. This long without an answer means it is wedged (the job
# then starts with Popen, and a late child is killed).
ZYGOTE_SPAWN_TIMEOUT_S = 60.0
# Upper bound of one control message (a job's environment as JSON; os.environ is a few KB).
ZYGOTE_MAX_MESSAGE_BYTES = 256 * 1024
# prctl option (linux/prctl.h): deliver a signal to this process when its parent dies.
PR_SET_PDEATHSIG = 1
# How long stop() waits for the zygote to exit after its control socket closed.
ZYGOTE_EXIT_WAIT_S = 5.0
# Job processes listen on ports drawn from here, below the kernel's ephemeral range (Linux 32768-60999,
# macOS 49152-65535): a port picked from the ephemeral range could be taken by the next gate or client
# socket before the job binds it, and a request would then land on the wrong listener.
JOB_PORT_RANGE = (20000, 32767)
# The real logs stream sends a `: keep-alive` comment every 30 s; the same here keeps clients honest.
LOG_KEEPALIVE_S = 30.0
# A create body is a few KB; anything bigger is a client bug, refused before it is read.
MAX_BODY_BYTES = 1024 * 1024
# Keep-alive connections that stay idle this long are closed so handler threads do not pile up.
IDLE_CONNECTION_TIMEOUT_S = 120.0
# serve_forever's poll interval: how long stop() waits for the accept loop to notice (stdlib: 0.5 s).
SERVE_POLL_S = 0.05
# Listen backlog: benchmarks open hundreds of connections at once; the stdlib default (5) drops them.
LISTEN_BACKLOG = 1024
# `JobsEmulator(tls=True)`: exposed ports are `https://<job_id>--<port>.<TLS_HOST_SUFFIX>:<gate port>`,
# as on the Hub (`https://<job_id>--<port>.hf.jobs`), so the provider's exposed-URL rule runs for real.
# Under `localhost` because RFC 6761 reserves such names for loopback; this process's resolver maps them
# to 127.0.0.1 while a TLS emulator runs (many system resolvers do not, see _LoopbackNames).
TLS_HOST_SUFFIX = "jobs.localhost"
# How long a TLS client of an exposed port may take to complete its handshake.
TLS_HANDSHAKE_TIMEOUT_S = 10.0
# Labels starting with this prefix configure faults on one job (see FAULT_KEYS).
FAULT_LABEL_PREFIX = "emulator-"
# So do environment variables `HF_JOBS_EMULATOR_<KEY>` (upper case, `_` for `-`): the form a provider passes
# them in, since it holds labels to the Hub's rule, whose values have no room for a message or "0.5".
FAULT_ENV_PREFIX = "HF_JOBS_EMULATOR_"
# The fault keys, as emulator-wide `faults={key: value}` or per-job labels `emulator-<key>: value`.
FAULT_KEYS = (
    "scheduling-delay-s",  # extra seconds in SCHEDULING (float)
    "crash-at-boot",  # the job starts, prints this message to stderr and exits 1 -> ERROR
    "die-after-s",  # the job's process group is SIGKILLed this many seconds after RUNNING -> ERROR
    "lost-create-response",  # "true": the job is created but the create connection drops unanswered
    "rate-limit-after-create",  # N: the N API calls after this create answer 429 with Retry-After
    "no-url",  # "true": the job runs but its exposed URLs never appear (status.exposeUrls stays empty)
    # "true" (tls=True only): status.exposeUrls name another job id (`https://<other>--<port>.`) while
    # still reaching this job's gate, as a misrouted answer would; a client must refuse to send its
    # token there, and if it does not, its request still lands here, on loopback, for the test to see.
    "foreign-url",
)
# Status an injected API server error answers when none is given (the Hub's load balancer says 503).
DEFAULT_SERVER_ERROR_STATUS = 503
# Network faults (`network_faults=True`): how long a link waits on a socket before looking again for a
# reset order, and the most bytes it relays per read (small enough to cut a response in the middle).
LINK_POLL_S = 0.5
LINK_CHUNK = 16 * 1024
# Route names: keys of `api_calls` and the `routes` of `inject_rate_limit`.
API_ROUTES = ("whoami", "create", "list", "inspect", "cancel", "logs", "hardware", "labels", "expose", "metrics",
              "duplicate", "unknown")
# Job routes below /api/jobs/{namespace}/{job_id}/: their method (huggingface_hub's HfApi calls them so).
# (`duplicate` is HfApi.rerun_job: a new job from this one's spec.)
JOB_SUBROUTES = {"cancel": "POST", "logs": "GET", "labels": "PUT", "expose": "PUT", "metrics": "GET",
                 "duplicate": "POST"}
# The Hub's rule for labels (huggingface_hub's update_job_labels): keys and values of at most this many
# letters, digits, '-' and '_'. The emulator's own fault labels (FAULT_LABEL_PREFIX) keep free-form values.
LABEL_MAX_CHARS = 100
# GET .../metrics sends one `event: metric` a second (huggingface_hub's fetch_job_metrics).
METRICS_INTERVAL_S = 1.0
# What a job's metrics report as its memory size (cpu-basic's 16 GB; the emulator does not limit memory).
METRICS_MEMORY_TOTAL_BYTES = 16 * 1024 ** 3
# Seconds a client is told to wait in `Retry-After` when a 429 is injected without an explicit value.
DEFAULT_RETRY_AFTER_S = 1
# `rate_limit=(quota, window_s)`: the Hub's API limit is per user, in fixed windows (5 minutes; 1,000 calls
# for a free account, 2,500 PRO, 3,000 Team, 6,000 Enterprise). Off by default, so tests and benchmarks that
# do not ask for it are not paced.
HUB_RATE_LIMIT_WINDOW_S = 300.0
# whoami-v2 is limited much harder than the rest ("intentionally strict", huggingface_hub says; the real
# number is not published): in the emulator, this fraction of the quota per window (at least 1 call).
WHOAMI_QUOTA_FRACTION = 0.05
# Environment variables of this process a job must not inherit: the real service never hands the
# submitting user's token to a job unless it is passed as a secret.
SCRUBBED_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_API_TOKEN")
# Signals every child the emulator starts can receive and that end it by default, whichever thread started
# it: a child inherits its creator thread's mask (library threads block these) and ignored dispositions.
CHILD_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))
# Sandbox hosts (hf_sbx_emulator.py), upstream figures (issue 20): a cold host takes ~13 s to RUNNING and
# ~4.7 s more until its server answers; a sandbox on a warm host ~0.27 s. Tests set them near zero.
SANDBOX_HOST_BOOT_S = 13.0
SANDBOX_HOST_READY_S = 4.7
SANDBOX_CREATE_S = 0.27
# huggingface_hub reads a sandbox host's URL from the create answer, so the answer waits for its gates
# (made in milliseconds; this bounds a wedged machine).
SANDBOX_GATES_WAIT_S = 60.0
# Echo server defaults: OpenEnv images listen on 8000; the step delay is for benchmarks only.
ECHO_DEFAULT_PORT = 8000
# In a pooled sandbox (this variable set by the sandbox server), the echo server binds the unix
# socket `$SBX_PROXY_DIR/<port>.sock` that the host's `proxy/<port>/...` forwards to: no TCP port.
SANDBOX_PROXY_DIR_ENV = "SBX_PROXY_DIR"
# OpenEnv's image command (its Dockerfile template's CMD, which the provider sends when `command` is
# not given, with `exec` or without): a job running it gets the echo server on that port, as if the
# image were an OpenEnv echo environment.
OPENENV_DEFAULT_COMMAND = re.compile(r"^cd /app/env && (?:exec )?uvicorn server\.app:app "
                                     r"--host [0-9.:]+ --port (?P<port>[0-9]{1,5})$")
# The same command on a unix socket, as a pooled sandbox runs it (hf_sandbox_pool's default, inside
# its shell wrapper): the emulated sandbox server runs the echo server on that socket instead.
OPENENV_POOLED_COMMAND = re.compile(r"cd /app/env && (?:exec )?uvicorn server\.app:app --uds ")
ECHO_STEP_DELAY_ENV = "ECHO_STEP_DELAY_S"
# Largest WebSocket message the echo server accepts (OpenEnv clients default to 100 MiB; 16 MiB is
# plenty for an echo and bounds memory).
ECHO_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


# ==================================================================================================
# Public API: the emulator
# ==================================================================================================


class EmulatedJob:
    """One job of the emulator: its spec, stage, process and timings (read-only for callers).

    Monotonic times (`*_mono`) share `time.monotonic()`'s clock with the caller's process, so a
    provider's own timings can be compared with `first_health_ok_mono` to measure its overhead.
    """

    def __init__(self, job_id: str, namespace: str, owner_type: str, initiator: str,
                 spec: Dict[str, Any], faults: Dict[str, str]) -> None:
        self.id = job_id
        self.namespace = namespace
        self.owner_type = owner_type
        self.initiator = initiator
        self.spec = spec  # the validated create body minus secrets
        self.secret_names: List[str] = []  # values are never in an answer
        # Kept in memory only, for a rerun (POST .../duplicate starts a new job from this spec, secrets included).
        self._secret_values: Dict[str, str] = {}
        self.faults = faults
        self.stage = "SCHEDULING"
        self.message: Optional[str] = None
        self.expose_urls: Optional[List[str]] = None
        self.created_at = _utcnow()
        self.started_at: Optional[datetime.datetime] = None
        self.finished_at: Optional[datetime.datetime] = None
        self.created_mono = time.monotonic()
        self.started_mono: Optional[float] = None
        self.finished_mono: Optional[float] = None
        self.first_health_ok_mono: Optional[float] = None
        self.pid: Optional[int] = None
        self.exit_code: Optional[int] = None
        self.port: Optional[int] = None  # the job's $PORT
        self.local_ports: Dict[int, int] = {}  # exposed port -> loopback port the process listens on
        self.logs: List[Tuple[str, str]] = []  # (timestamp, line)
        self._process: Optional[subprocess.Popen] = None
        self._gates: List[Any] = []
        self._stop_reason: Optional[str] = None  # set by cancel / emulator stop
        # Set on anything its supervisor must look at (stop request, kill_job, a zygote child's exit):
        # a supervisor waits on its own event, not on the emulator's condition (which every stage change
        # and log line notifies: 256 waiters there made each notify wake 256 threads).
        self._attention = threading.Event()
        self._die_now = False  # set by JobsEmulator.kill_job
        self._links: List["_FaultLink"] = []  # network_faults=True: one per exposed port
        self._gates_made = threading.Event()  # its exposed URLs are known (a sandbox host answers them at create)
        self._supervisor: Optional[threading.Thread] = None

    @property
    def terminal(self) -> bool:
        """Whether the job reached a stage it never leaves."""
        return self.stage in _jobs_facts().TERMINAL_STAGES

    def __repr__(self) -> str:
        return f"EmulatedJob(id={self.id!r}, stage={self.stage!r}, pid={self.pid!r})"


class JobsEmulator:
    """A loopback HF Jobs API whose jobs are local process groups behind token gates.

    Use as a context manager (or `start()` / `stop()`); `stop()` ends every job process and gate.
    `token` is generated (`hf_...`) when not given; `extra_tokens` maps more tokens to user names and
    `orgs` maps organisation namespaces to their member users, so initiator and namespace checks can
    be tested. `faults` applies the FAULT_KEYS to every job; labels `emulator-<key>` apply them to one.
    `default_command` runs when a create body has no command (default: this module's echo server);
    `image_commands` picks one per image instead. `zygote=False` starts even the echo server with
    `Popen` (see `launch_process`). `rate_limit=(quota, window_s)` limits each user as the Hub does (fixed
    windows, RateLimit headers on every answer, 429 past the quota, whoami harder); `flavors` replaces the
    Hub's hardware list; `list_page_size` / `next_link_base` paginate listings; `ended_url_status` makes an
    ended job's exposed URLs answer that status instead of refusing connections. A job that is
    huggingface_hub's sandbox bootstrap runs the emulated sbx-server instead (hf_sbx_emulator.py; `sandbox_*`
    settings, `sandbox_hosts` for its hosts and faults).
    """

    def __init__(
        self,
        token: Optional[str] = None,
        namespace: str = DEFAULT_NAMESPACE,
        host: str = "127.0.0.1",
        port: int = 0,
        scheduling_delay_s: float = 0.0,
        *,
        extra_tokens: Optional[Mapping[str, str]] = None,
        orgs: Optional[Mapping[str, Iterable[str]]] = None,
        faults: Optional[Mapping[str, Any]] = None,
        default_command: Optional[Sequence[str]] = None,
        image_commands: Optional[Mapping[str, Sequence[str]]] = None,
        kill_grace_s: float = KILL_GRACE_S,
        zygote: bool = True,
        network_faults: bool = False,
        tls: bool = False,
        flavors: Optional[Iterable[str]] = None,
        list_page_size: Optional[int] = None,
        next_link_base: Optional[str] = None,
        rate_limit: Optional[Tuple[int, float]] = None,
        ended_url_status: Optional[int] = None,
        sandbox_host_boot_s: float = SANDBOX_HOST_BOOT_S,
        sandbox_host_ready_s: float = SANDBOX_HOST_READY_S,
        sandbox_create_s: float = SANDBOX_CREATE_S,
        sandbox_capacity: Optional[int] = None,
        sandbox_idle_timeout_s: Optional[float] = None,
        sandbox_strict_tokens: bool = True,
    ) -> None:
        reason = (_host_rejection(host) or _namespace_rejection(namespace)
                  or _delay_rejection("scheduling_delay_s", scheduling_delay_s)
                  or _delay_rejection("kill_grace_s", kill_grace_s)
                  or _faults_rejection(faults or {}, "faults"))
        if reason:
            raise ValueError(reason)
        self.token = token if token is not None else _generate_token()
        if not isinstance(self.token, str) or not self.token:
            raise ValueError("token must be a non-empty string (or None to generate one)")
        self.namespace = namespace
        self.host = host
        self.scheduling_delay_s = float(scheduling_delay_s)
        self.kill_grace_s = float(kill_grace_s)
        self.default_faults = {k: str(v) for k, v in (faults or {}).items()}
        self.default_command = list(default_command) if default_command else echo_server_command()
        self.image_commands = {k: list(v) for k, v in (image_commands or {}).items()}
        # The flavors `GET /api/jobs/hardware` lists and creates accept (default: the Hub's).
        self.flavors = tuple(sorted(flavors if flavors is not None else _jobs_facts().KNOWN_FLAVORS))
        # list_page_size=N: listings answer N jobs a page with a `Link: <...>; rel="next"` (as the Hub
        # paginates), whose scheme://host:port is `next_link_base` (default: the emulator's own endpoint), so
        # a client can be shown the same server under another name, or a foreign one.
        if list_page_size is not None and (_count_rejection(list_page_size, "list_page_size") or list_page_size < 1):
            raise ValueError(f"list_page_size must be an int >= 1, got {list_page_size!r}")
        self.list_page_size = list_page_size
        self.next_link_base = next_link_base.rstrip("/") if next_link_base else None
        # rate_limit=(quota, window_s): per user (every token and process of that user), fixed windows.
        reason = _rate_limit_rejection(rate_limit)
        if reason:
            raise ValueError(reason)
        self.rate_limit = (int(rate_limit[0]), float(rate_limit[1])) if rate_limit is not None else None
        # ended_url_status=N: once a job has ended, its exposed URLs stay up and answer every request N, as a front
        # serving many jobs' names would; None: they refuse connections. What the Hub's `*.hf.jobs` front answers
        # for an ended job is not known (a 404 or a 502 are both plausible), so a client must cope with each.
        if ended_url_status is not None and (_count_rejection(ended_url_status, "ended_url_status")
                                             or not 400 <= ended_url_status <= 599):
            raise ValueError(f"ended_url_status must be an HTTP error status (400-599) or None, "
                             f"got {ended_url_status!r}")
        self.ended_url_status = ended_url_status
        self._windows: Dict[Tuple[str, str], List[float]] = {}  # (user, bucket) -> [window start, calls]
        self.rate_limited_calls = 0  # calls answered 429 by the limit (not by inject_rate_limit)
        self.window_peaks: Dict[str, int] = {}  # user -> the most calls any one window of theirs admitted
        self._users: Dict[str, str] = {self.token: namespace}  # token -> user name
        for extra_token, user in (extra_tokens or {}).items():
            reason = _namespace_rejection(user)
            if reason:
                raise ValueError(f"extra_tokens: {reason}")
            self._users[extra_token] = user
        self._orgs: Dict[str, List[str]] = {org: list(members) for org, members in (orgs or {}).items()}
        self._requested_port = port
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # stage or log changes; log streams wait here
        self._jobs: Dict[str, EmulatedJob] = {}
        self._api_calls: Dict[str, int] = {}
        self._rate_limits = _Injection(DEFAULT_RETRY_AFTER_S)  # 429s to answer; value: Retry-After seconds
        self._lose_creates_left = 0
        self._server_errors = _Injection(DEFAULT_SERVER_ERROR_STATUS)  # 5xx answers to give; value: status
        self._withhold_urls_left = 0
        self._create_delays = _Injection(0.0)  # creates whose answer waits; value: seconds
        self._late_creates = _Injection(0.0)  # creates answered 504 whose job comes later; value: seconds
        self.create_answers_held = 0  # creates made whose answer is being held now
        self.create_answers_peak = 0  # the most held at once: how many creates a client had in flight
        # network_faults=True puts a _FaultLink between each exposed port's gate and the job's process,
        # so stall_next_responses / reset_next_responses / reset_tunnels can act on the wire.
        self.network_faults = bool(network_faults)
        self._reserved_ports: set = set()  # job ports handed out; released when the job ends
        self._server: Optional[_TrackingHTTPServer] = None
        self._server_thread: Optional[threading.Thread] = None
        self._stopping = False
        # Fork the echo server from a pre-imported process where the platform can (POSIX with fork).
        self.zygote = bool(zygote) and hasattr(os, "fork") and hasattr(socket, "send_fds")
        self._zygote_lock = threading.Lock()
        self._zygote: Optional[_Zygote] = None
        self._retired_zygotes: List[_Zygote] = []  # ones that died; their children are cleaned up
        self._prober: Optional[_HealthProber] = None
        # tls=True: exposed ports serve https under job-shaped names; `ca_path` is the CA to trust
        # (pass it as the provider's or proxy's `verify`). Made at start(), removed at stop().
        self.tls = bool(tls)
        self.ca_path: Optional[str] = None
        self._tls: Optional[_TLSMaterial] = None
        # huggingface_hub's sandbox host jobs run the emulated sbx-server (hf_sbx_emulator.py, when present).
        self.sandbox_hosts = _sandbox_hosts(host_boot_s=sandbox_host_boot_s, host_ready_s=sandbox_host_ready_s,
                                            sandbox_create_s=sandbox_create_s, capacity=sandbox_capacity,
                                            idle_timeout_s=sandbox_idle_timeout_s,
                                            strict_tokens=sandbox_strict_tokens)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> "JobsEmulator":
        """Bind the API listener and serve it from a background thread; returns self."""
        with self._lock:
            if self._server is not None:
                return self
            handler = type("_BoundApiHandler", (_ApiHandler,), {"emulator": self})
            if self.tls and self._tls is None:
                self._tls = _TLSMaterial(TLS_HOST_SUFFIX)
                self.ca_path = self._tls.ca_path
                _LoopbackNames.add(TLS_HOST_SUFFIX)
            self._server = _TrackingHTTPServer((self.host, self._requested_port), handler)
            self._stopping = False
            _running_emulators.add(self)
        self._server_thread = threading.Thread(
            target=self._server.serve_forever, args=(SERVE_POLL_S,), name=f"jobs-emulator:{self.port}", daemon=True)
        self._server_thread.start()
        return self

    def stop(self) -> List[str]:
        """End every job process group and gate, then the API listener. Safe to call twice.

        Never raises but for a Ctrl-C (KeyboardInterrupt), and that only once every job's process group is
        SIGKILLed: returns (and logs) what could not be cleaned up, e.g. `["job 6b00... pid 123"]`.
        """
        try:
            problems, interrupted = self._stop()
        except KeyboardInterrupt:  # one in the teardown, or a second one after the grace was cut short
            self._kill_job_groups()
            raise
        if interrupted is not None:  # the one that cut the grace short: every group was killed then
            raise interrupted
        return problems

    def _stop(self) -> Tuple[List[str], Optional[BaseException]]:
        with self._lock:
            self._stopping = True
            jobs = list(self._jobs.values())
            for job in jobs:
                if job._stop_reason is None:
                    job._stop_reason = "emulator stopped"
                    job._attention.set()
            self._changed.notify_all()
        interrupted: Optional[BaseException] = None
        for job in jobs:
            if job._supervisor is not None and job._supervisor.ident is not None:  # started
                try:
                    job._supervisor.join(self.kill_grace_s + 5.0)
                except KeyboardInterrupt as exc:  # no more grace: every group is killed now, the rest of the
                    interrupted = exc             # teardown runs, then the interrupt propagates
                    self._kill_job_groups()
                    break
        problems: List[str] = []
        for job in jobs:
            if job._process is not None and job._process.poll() is None:
                _kill_process_group(job._process, 0.0)  # its supervisor could not finish: no grace
            if job._process is not None and job._process.poll() is None:
                problems.append(f"job {job.id} pid {job.pid}")
            for gate in job._gates:
                if not _stop_quietly(gate):
                    problems.append(f"job {job.id} gate on port {gate.port}")
        with self._lock:
            prober, self._prober = self._prober, None
        if prober is not None and not prober.stop():
            problems.append("health prober thread")
        with self._zygote_lock:  # _stopping is set, so no new zygote can start after this
            zygotes = self._retired_zygotes + ([self._zygote] if self._zygote is not None else [])
            self._zygote, self._retired_zygotes = None, []
        for zygote in zygotes:
            problems.extend(zygote.stop())
        server, self._server = self._server, None
        if server is not None:
            try:
                server.shutdown()
                server.close_all_connections()
                server.server_close()
            except Exception as exc:  # teardown goes on; say what is left
                problems.append(f"API listener ({exc!r})")
        if self._server_thread is not None:
            self._server_thread.join(5.0)
            if self._server_thread.is_alive():
                problems.append("API listener thread")
            self._server_thread = None
        material, self._tls = self._tls, None
        if material is not None:
            _LoopbackNames.remove(TLS_HOST_SUFFIX)
            material.remove()
        if problems:
            log.warning("hf_jobs_emulator stopped but could not clean up: %s", ", ".join(problems))
        _running_emulators.discard(self)
        return problems, interrupted

    def _kill_job_groups(self) -> None:
        """SIGKILL, without waiting, the process group of every job whose supervisor has not finished it (a stop()
        cut short by Ctrl-C, or interpreter exit without stop()): no grace, and nothing here can block."""
        for job in list(self._jobs.values()):
            process = job._process
            if process is None or (job.terminal and process.poll() is not None):
                continue  # not started, or finished by its supervisor, which killed its group
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # the whole group is gone already

    def __enter__(self) -> "JobsEmulator":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def __repr__(self) -> str:  # never shows the token
        state = "running" if self._server is not None else "stopped"
        return f"JobsEmulator(endpoint={self.endpoint!r}, namespace={self.namespace!r}, {state})"

    # -- what callers read ------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The API listener's port (0 before `start()`)."""
        return self._server.server_address[1] if self._server is not None else 0

    @property
    def endpoint(self) -> str:
        """Base URL to give `HfApi(endpoint=...)` or the provider's `endpoint=`."""
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def api_calls(self) -> Dict[str, int]:
        """API calls received so far per route (whoami, create, list, inspect, cancel, logs, unknown)."""
        with self._lock:
            return dict(self._api_calls)

    def job(self, job_id: str) -> EmulatedJob:
        """The job with this id (KeyError naming it when unknown)."""
        with self._lock:
            if job_id not in self._jobs:
                raise KeyError(f"no job {job_id!r} on this emulator")
            return self._jobs[job_id]

    @property
    def jobs(self) -> List[EmulatedJob]:
        """Every job created so far, oldest first."""
        with self._lock:
            return list(self._jobs.values())

    def live_pids(self) -> List[int]:
        """Process ids of job and sandbox processes that are still running (for leak checks)."""
        sandboxes = self.sandbox_hosts.live_pids() if self.sandbox_hosts is not None else []
        return [job.pid for job in self.jobs
                if job._process is not None and job._process.poll() is None and job.pid is not None] + sandboxes

    def wait_for_stage(self, job_id: str, stages: Iterable[str], timeout_s: float = 10.0) -> EmulatedJob:
        """Block until the job is in one of `stages` (or terminal); TimeoutError naming the stage."""
        wanted = set(stages) | _jobs_facts().TERMINAL_STAGES
        deadline = time.monotonic() + timeout_s
        with self._changed:
            job = self.job(job_id)
            while job.stage not in wanted:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"job {job_id} still {job.stage} after {timeout_s}s")
                self._changed.wait(left)
            return job

    # -- fault injection --------------------------------------------------------------------------

    def inject_rate_limit(self, calls: int, retry_after_s: int = DEFAULT_RETRY_AFTER_S,
                          routes: Optional[Iterable[str]] = None) -> None:
        """Answer the next `calls` API calls (optionally only on these route names) with 429."""
        if not isinstance(calls, int) or calls < 0:
            raise ValueError(f"calls must be an int >= 0, got {calls!r}")
        if not isinstance(retry_after_s, int) or retry_after_s < 0:
            raise ValueError(f"retry_after_s must be an int >= 0 (whole seconds), got {retry_after_s!r}")
        unknown = sorted(set(routes or ()) - set(API_ROUTES))
        if unknown:
            raise ValueError(f"unknown route names {unknown}; use some of {', '.join(API_ROUTES)}")
        with self._lock:
            self._rate_limits.arm(calls, retry_after_s, routes)

    def lose_next_create_responses(self, count: int = 1) -> None:
        """Create the next `count` jobs but drop each create connection before answering."""
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        with self._lock:
            self._lose_creates_left = count

    def delay_next_create_answers(self, count: int, seconds: float) -> None:
        """Make each of the next `count` jobs at once but answer its create `seconds` later (sooner if the
        emulator stops), as a slow Hub does: the job exists while the caller's create is in flight.
        `create_answers_held` / `create_answers_peak` count those held now / at most at once."""
        reason = _count_rejection(count) or _delay_rejection("seconds", seconds)
        if reason:
            raise ValueError(reason)
        with self._lock:
            self._create_delays.arm(count, float(seconds), None)

    def make_next_creates_late(self, count: int, after_s: float) -> None:
        """Answer each of the next `count` creates 504 at once, as a gateway that gave up on a slow backend
        does, and make its job `after_s` later (not if the emulator stops first): a client that looks for
        it at once finds none. Whether the Hub's gateway ever answers so is not known; a timed-out create
        leaves a client in the same place."""
        reason = _count_rejection(count) or _delay_rejection("after_s", after_s)
        if reason:
            raise ValueError(reason)
        with self._lock:
            self._late_creates.arm(count, float(after_s), None)

    def kill_job(self, job_id: str) -> None:
        """SIGKILL a running job's process group now, as if its machine died: the job ends in ERROR.

        The deterministic twin of the `die-after-s` fault, for tests that must first see the job ready.
        """
        with self._lock:
            job = self.job(job_id)
            if job.stage != "RUNNING":
                raise ValueError(f"job {job_id} is {job.stage}; only a RUNNING job can be killed")
            job._die_now = True
            job._attention.set()

    def forget_job(self, job_id: str, timeout_s: float = 30.0) -> None:
        """The Hub forgets a job (deleted, or garbage-collected after it ended): it is stopped if
        it still runs (CANCELED, its gates and processes gone), then every API call about it answers
        404, which huggingface_hub raises as JobNotFoundError. For tests; no route does it."""
        with self._lock:
            job = self.job(job_id)
            if not job.terminal and job._stop_reason is None:
                job._stop_reason = "canceled"
                job._attention.set()
            supervisor = job._supervisor
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout_s)  # stop() joins listed jobs' supervisors only: end it here
            if supervisor.is_alive():
                raise TimeoutError(f"job {job_id} did not stop within {timeout_s}s; still listed")
        with self._lock:
            del self._jobs[job_id]
            self._changed.notify_all()
        for gate in job._gates:  # (kept up by ended_url_status; stop() stops only the gates of listed jobs)
            _stop_quietly(gate)
        log.info("job %s forgotten: the API answers 404 for it", job_id)

    def inject_server_errors(self, calls: int, status: int = DEFAULT_SERVER_ERROR_STATUS,
                             routes: Optional[Iterable[str]] = None) -> None:
        """Answer the next `calls` API calls (optionally only on these route names) with a 5xx `status`.

        The call is refused before it does anything: an injected error on a create makes no job (a
        create that makes a job but loses its answer is `lose_next_create_responses`)."""
        reason = _count_rejection(calls, "calls") or _route_names_rejection(routes)
        if not isinstance(status, int) or not 500 <= status <= 599:
            reason = reason or f"status must be a 5xx status code (500..599), got {status!r}"
        if reason:
            raise ValueError(reason)
        with self._lock:
            self._server_errors.arm(calls, status, routes)

    def withhold_next_urls(self, count: int = 1) -> None:
        """The next `count` jobs to reach RUNNING never publish their exposed URLs (the `no-url` fault):
        a client waiting for `status.exposeUrls` waits until it gives up and cancels."""
        reason = _count_rejection(count)
        if reason:
            raise ValueError(reason)
        with self._lock:
            self._withhold_urls_left = count

    def stall_next_responses(self, job_id: str, count: int = 1, seconds: float = 10.0) -> None:
        """Hold the job's next `count` HTTP responses for `seconds` (the request has run), then reset
        their connections: the caller sees the upstream stall past its read timeout. Needs
        `network_faults=True`."""
        reason = _delay_rejection("seconds", seconds) or _count_rejection(count)
        if reason:
            raise ValueError(reason)
        self._links_of(job_id, "stall_next_responses")[0].arm("stall", count, float(seconds))

    def reset_next_responses(self, job_id: str, count: int = 1, after_bytes: int = 20) -> None:
        """Relay only the first `after_bytes` bytes of the job's next `count` HTTP responses, then reset
        the connection (TCP RST), as when the job's machine drops mid-answer. Needs `network_faults=True`."""
        reason = _count_rejection(count) or _count_rejection(after_bytes, "after_bytes")
        if reason:
            raise ValueError(reason)
        self._links_of(job_id, "reset_next_responses")[0].arm("reset", count, int(after_bytes))

    def reset_tunnels(self, job_id: str) -> int:
        """Reset (TCP RST) every open WebSocket connection to the job now; returns how many.
        Needs `network_faults=True`."""
        return sum(link.reset_tunnels() for link in self._links_of(job_id, "reset_tunnels"))

    def _links_of(self, job_id: str, what: str) -> List["_FaultLink"]:
        if not self.network_faults:
            raise ValueError(f"{what} needs JobsEmulator(network_faults=True): without it nothing sits "
                             "between the gate and the job to act on the wire")
        with self._lock:
            job = self.job(job_id)
            if job.stage != "RUNNING" or not job._links:
                raise ValueError(f"job {job_id} is {job.stage}; network faults apply to a RUNNING job "
                                 "with an exposed port")
            return list(job._links)

    def record_health_ok(self, job_id: str) -> None:
        """Note the first time the job's server answered 200 on /health (the emulator's own probe)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.first_health_ok_mono is not None:
                return
            job.first_health_ok_mono = time.monotonic()
        log.info("job %s ready: /health answered 200, %.2fs after create", job_id,
                 job.first_health_ok_mono - job.created_mono)

    # -- the API's rules, apart from HTTP (answers are JSON-ready values; refusals raise _ApiError) --

    def _authenticate(self, authorization: Optional[str]) -> Optional[str]:
        """The user name behind an `Authorization` header, or None."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":  # the scheme is case-insensitive (RFC 9110 section 11.1)
            return None
        return self._users.get(token.strip())

    def _gate_rejection(self, job: EmulatedJob, authorization: Optional[str]) -> Optional[str]:
        """Why a request to the job's exposed port is refused (no token / no read access), or None."""
        user = self._authenticate(authorization)
        if user is None:
            return (f"Job {job.id}: this exposed port needs 'Authorization: Bearer <token>' with read access "
                    f"to namespace '{job.namespace}'")
        return self._namespace_access_rejection(user, job.namespace)

    def _namespace_access_rejection(self, user: str, namespace: str) -> Optional[str]:
        if namespace == user or user in self._orgs.get(namespace, ()):
            return None
        return f"You don't have access to namespace '{namespace}' (authenticated as '{user}')"

    def _take_rate_limit(self, route: str) -> Optional[int]:
        """Retry-After seconds when this call must be answered 429, else None."""
        with self._lock:
            return self._rate_limits.take(route)

    def _take_server_error(self, route: str) -> Optional[int]:
        """The 5xx status this call must be answered with (inject_server_errors), else None."""
        with self._lock:
            return self._server_errors.take(route)

    def _admit(self, user: str, route: str) -> Tuple[Optional[int], Dict[str, str]]:
        """Count one call of `user` against the fixed-window limit: (None or the seconds to wait when it must be
        answered 429, the RateLimit / RateLimit-Policy headers). whoami also counts against its own, smaller
        bucket; the headers describe the tighter one. Refused calls are not counted."""
        if self.rate_limit is None:
            return None, {}
        quota, window = self.rate_limit
        buckets = [("api", quota)]
        if route == "whoami":
            buckets.append(("whoami", max(1, int(quota * WHOAMI_QUOTA_FRACTION))))
        now = time.monotonic()
        with self._lock:
            states = []
            for bucket, limit in buckets:
                state = self._windows.get((user, bucket))
                if state is None or now >= state[0] + window:  # a fresh fixed window from this call
                    state = self._windows[(user, bucket)] = [now, 0]
                states.append((bucket, limit, state))
            full = [entry for entry in states if entry[2][1] >= entry[1]]
            if not full:
                for _, _, state in states:
                    state[1] += 1
                peak = states[0][2][1]
                self.window_peaks[user] = max(self.window_peaks.get(user, 0), int(peak))
            else:
                self.rate_limited_calls += 1
            bucket, limit, state = full[0] if full else min(states, key=lambda entry: entry[1] - entry[2][1])
        reset = max(1, int(-(-(state[0] + window - now) // 1)))  # whole seconds, rounded up
        headers = {"RateLimit": f'"{bucket}";r={max(0, int(limit - state[1]))};t={reset}',
                   "RateLimit-Policy": f'"fixed window";"{bucket}";q={limit};w={int(window)}'}
        return (reset if full else None), headers

    def _hold_create_answer(self) -> None:
        """Wait before answering a create when delay_next_create_answers armed it."""
        with self._changed:
            delay = self._create_delays.take("create")
            if delay is None:
                return
            self.create_answers_held += 1
            self.create_answers_peak = max(self.create_answers_peak, self.create_answers_held)
            deadline = time.monotonic() + delay
            try:
                while not self._stopping and time.monotonic() < deadline:
                    self._changed.wait(deadline - time.monotonic())
            finally:
                self.create_answers_held -= 1

    def _count(self, route: str) -> None:
        with self._lock:
            self._api_calls[route] = self._api_calls.get(route, 0) + 1

    def _whoami(self, user: str) -> Dict[str, Any]:
        orgs = [{"type": "org", "id": _stable_id(org), "name": org, "fullname": org, "roleInOrg": "write"}
                for org, members in sorted(self._orgs.items()) if user in members]
        return {
            "type": "user", "id": _stable_id(user), "name": user, "fullname": user,
            "email": f"{user}@emulator.invalid", "emailVerified": True, "canPay": True,
            "isPro": False, "periodEnd": None, "avatarUrl": "", "orgs": orgs,
            "auth": {"type": "access_token",
                     "accessToken": {"displayName": "hf-jobs-emulator", "role": "write"}},
        }

    def _create(self, user: str, namespace: str, body: Any) -> Tuple[EmulatedJob, bool]:
        """Validate and register a job, start its supervisor; returns (job, lose_the_answer)."""
        reason = _create_body_rejection(body, self.flavors)
        if reason:
            raise _ApiError(400, reason)
        labels = dict(body.get("labels") or {})
        job_faults = {k[len(FAULT_LABEL_PREFIX):]: v for k, v in labels.items()
                      if k.startswith(FAULT_LABEL_PREFIX)}
        env_faults = {k[len(FAULT_ENV_PREFIX):].lower().replace("_", "-"): v
                      for k, v in (body.get("environment") or {}).items() if k.startswith(FAULT_ENV_PREFIX)}
        reason = (_faults_rejection(job_faults, "labels", prefix=FAULT_LABEL_PREFIX)
                  or _faults_rejection(env_faults, "environment", prefix=FAULT_ENV_PREFIX))
        job_faults.update(env_faults)
        if reason:
            raise _ApiError(400, reason)
        faults = {**self.default_faults, **job_faults}
        if _truthy(faults.get("foreign-url", "false")) and not self.tls:
            raise _ApiError(400, "the foreign-url fault needs JobsEmulator(tls=True): a plain emulator's "
                                 "loopback URLs carry no job id to make foreign")
        spec = {k: v for k, v in body.items() if k != "secrets"}
        secret_values = dict(body.get("secrets") or {})
        owner_type = "org" if namespace in self._orgs else "user"
        with self._lock:
            if self._stopping:
                raise _ApiError(503, "the emulator is stopping; no new jobs")
            job = EmulatedJob(_new_job_id(), namespace, owner_type, user, spec, faults)
            job.secret_names = sorted(secret_values)
            job._secret_values = secret_values
            # Made under the lock so stop() always sees (and joins) the supervisor of a listed job.
            job._supervisor = threading.Thread(
                target=self._supervise, args=(job, secret_values), name=f"job:{job.id}", daemon=True)
            self._jobs[job.id] = job
            lose = _truthy(faults.get("lost-create-response", "false"))
            if self._lose_creates_left > 0:
                self._lose_creates_left -= 1
                lose = True
            after = int(faults.get("rate-limit-after-create", "0"))
            if after > 0:
                self._rate_limits.arm(after, DEFAULT_RETRY_AFTER_S, None)
        log.info("job %s created in %s (%s, %s)", job.id, namespace,
                 spec.get("dockerImage") or spec.get("spaceId"), spec.get("flavor") or "cpu-basic")
        job._supervisor.start()
        if self._is_sandbox_host(job):
            job._gates_made.wait(SANDBOX_GATES_WAIT_S)
        return job, lose

    def _rerun_body(self, job: EmulatedJob) -> Dict[str, Any]:
        """The create body of a rerun (POST .../duplicate, HfApi.rerun_job): the job's spec as it is now (labels and
        exposed ports as last updated) with its secrets; the new job is checked and started as any create."""
        with self._lock:
            body = json.loads(json.dumps(job.spec))  # a deep copy: the two jobs' specs change independently
            if job._secret_values:
                body["secrets"] = dict(job._secret_values)
        return body

    def _find_job(self, namespace: str, job_id: str) -> EmulatedJob:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.namespace != namespace:
                raise _ApiError(404, f"Job {job_id} not found in namespace {namespace}")
            return job

    def _list(self, namespace: str, query: List[Tuple[str, str]]) -> List[Dict[str, Any]]:
        labels: List[Tuple[str, str]] = []
        stages = set()
        for key, value in query:
            if key == "label":
                name, sep, wanted = value.partition("=")
                if not sep or not name:
                    raise _ApiError(400, f"label filter must be key=value, got {value!r}")
                labels.append((name, wanted))
            elif key == "stage":
                all_stages = _jobs_facts().LIVE_STAGES + tuple(sorted(_jobs_facts().TERMINAL_STAGES))
                if value.upper() not in all_stages:
                    raise _ApiError(400, f"stage filter {value!r} is not a job stage; "
                                         f"use one of {', '.join(all_stages)}")
                stages.add(value.upper())
        with self._lock:  # only a snapshot under the lock: 256 jobs' JSON is built outside it
            chosen = [(j, _JobState.of(j)) for j in self._jobs.values()
                      if j.namespace == namespace and (not stages or j.stage in stages)
                      and all((j.spec.get("labels") or {}).get(k) == v for k, v in labels)]
        return [_job_info(j, state) for j, state in chosen]

    def _cancel(self, job: EmulatedJob) -> None:
        with self._lock:
            if not job.terminal and job._stop_reason is None:
                job._stop_reason = "canceled"
                job._attention.set()
            self._changed.notify_all()

    def _update_labels(self, job: EmulatedJob, body: Any) -> None:
        """PUT .../labels: `{"labels": {...}}` replaces every label of the job (huggingface_hub's
        update_job_labels); the Hub's label rule applies (fault labels act only at create)."""
        labels = body.get("labels") if isinstance(body, dict) else None
        reason = ("the request body must be {\"labels\": {key: value}}" if not isinstance(labels, dict)
                  else _str_map_rejection(body, "labels") or _labels_rejection(labels, fault_prefix=None))
        if reason:
            raise _ApiError(400, reason)
        with self._lock:
            job.spec["labels"] = dict(labels)

    def _update_expose(self, job: EmulatedJob, body: Any) -> None:
        """PUT .../expose: `{"ports": [...], "portsPublic": [...]}` replaces a RUNNING job's exposed ports
        (huggingface_hub's update_job_expose). A kept port keeps its gate and URL; a new one gets a gate to a
        new local port ($PORT_<n> was fixed at start, so the job's process must find that port itself)."""
        reason = _expose_rejection(body)
        if reason:
            raise _ApiError(400, reason)
        ports, public = list(body.get("ports") or []), set(body.get("portsPublic") or [])
        with self._lock:
            if job.stage != "RUNNING":
                raise _ApiError(400, f"Job {job.id} is {job.stage}: only a running job's ports can be changed")
            kept = {gate.exposed_port: gate for gate in job._gates
                    if gate.exposed_port in ports and gate._public == (gate.exposed_port in public)}
            dropped = [gate for gate in job._gates if gate not in kept.values()]
            for port in ports:
                if port not in job.local_ports:
                    job.local_ports[port] = self._reserve_port()
        for gate in dropped:
            _stop_quietly(gate)
        gates = [kept.get(port) or self.make_gate(job, port, public=port in public) for port in ports]
        with self._lock:
            job._gates = gates
            job.spec["expose"] = {"ports": ports, "portsPublic": sorted(public)}
            if job.expose_urls is not None or ports:
                job.expose_urls = [gate.url for gate in gates] or None
            self._changed.notify_all()

    def _job_json(self, job: EmulatedJob) -> Dict[str, Any]:
        """The job as the real API answers it (field names and shapes HfApi's JobInfo reads)."""
        with self._lock:
            state = _JobState.of(job)
        return _job_info(job, state)

    # -- job machinery ----------------------------------------------------------------------------

    def _supervise(self, job: EmulatedJob, secret_values: Dict[str, str]) -> None:
        """Run one job: scheduling delay, gates, process, deadlines, final stage. Never raises."""
        try:
            self._run_job(job, secret_values)
        except Exception as exc:  # a bug here must still leave the job terminal and nothing running
            log.error("hf_jobs_emulator: running job %s failed", job.id, exc_info=True)  # where, for the fix
            if job._process is not None:
                _kill_process_group(job._process, 0.0)
            self._finish(job, "ERROR", f"emulator error while running the job: {exc!r}")
        finally:
            job._gates_made.set()  # a sandbox host's create, waiting for its gates, answers now (not in 60 s)
            self._end_gates(job)
            if self.sandbox_hosts is not None:
                self.sandbox_hosts.release(job.id)  # a sandbox host's sandboxes end with its job

    def _run_job(self, job: EmulatedJob, secret_values: Dict[str, str]) -> None:
        # Everything slow (port probes, gates, starting the process) happens outside the lock, so
        # hundreds of jobs leaving SCHEDULING together neither queue behind each other nor block the API.
        # Ports and gates are made while the job waits out its scheduling delay (nobody can see them
        # before RUNNING publishes the URLs), which keeps ~1 ms of work per job out of the RUNNING burst.
        scheduled_at = job.created_mono + self.scheduling_delay_s + float(job.faults.get("scheduling-delay-s", "0"))
        sbx_host = self._is_sandbox_host(job)
        if sbx_host:
            scheduled_at += self.sandbox_hosts.host_boot_s
        argv = self._job_argv(job)
        crash = "crash-at-boot" in job.faults  # a crashing sandbox host runs the crash command instead
        exposed = list((job.spec.get("expose") or {}).get("ports") or [])
        public = set((job.spec.get("expose") or {}).get("portsPublic") or [])
        job.local_ports = {p: self._reserve_port() for p in exposed}
        job.port = job.local_ports[exposed[0]] if exposed else self._reserve_port()
        process_ports = self._insert_fault_links(job)
        urls = []
        for exposed_port in exposed:
            gate = self.make_gate(job, exposed_port, public=exposed_port in public)
            job._gates.append(gate)
            urls.append(gate.url)
        if sbx_host:  # its server answers 503 while it boots; huggingface_hub reads its URL at create
            declared = {**(job.spec.get("environment") or {}), **secret_values}
            self.sandbox_hosts.prepare(job, _job_environment(job.spec.get("environment") or {}, secret_values),
                                       self.host, process_ports, declared)
            if not _truthy(job.faults.get("no-url", "false")):
                with self._lock:
                    job.expose_urls = urls
        job._gates_made.set()
        if self.zygote and argv[:len(echo_server_command())] == echo_server_command():
            self._zygote_for_jobs()  # started (once) while jobs are still scheduling
        if self._wait_for_stop_request(job, scheduled_at):
            self._finish(job, "CANCELED", _stop_message(job._stop_reason))
            return
        env = _job_environment(job.spec.get("environment") or {}, secret_values)
        env["PORT"] = str(process_ports.get(job.port, job.port))
        for exposed_port, local_port in job.local_ports.items():
            env[f"PORT_{exposed_port}"] = str(process_ports.get(local_port, local_port))
        default_port = _openenv_default_port(job.spec.get("command") or [])
        if f"PORT_{default_port}" in env:  # OpenEnv's command names the port its server listens on
            env["PORT"] = env[f"PORT_{default_port}"]
        try:
            if sbx_host and not crash:
                process = self.sandbox_hosts.launch(job)
            else:
                process = self.launch_process(argv, env)
        except OSError as exc:
            self._finish(job, "ERROR", f"Failed to start the job's command {argv[0]!r}: {exc.strerror or exc}")
            return
        with self._lock:
            job._process = process
            job.pid = process.pid
            canceled = job._stop_reason is not None  # canceled while the process was starting
            withhold = _truthy(job.faults.get("no-url", "false"))
            if not canceled and not withhold and exposed and self._withhold_urls_left > 0:
                self._withhold_urls_left -= 1
                withhold = True
            if not canceled:
                job.stage = "RUNNING"
                job.started_at = _utcnow()
                job.started_mono = time.monotonic()
                job.expose_urls = urls if exposed and not withhold else None
                job.logs.append((_iso(job.started_at), f"===== Job started at {job.started_at.isoformat()} ====="))
                self._changed.notify_all()
        if not canceled:
            log.info("job %s running (pid %s)%s", job.id, process.pid,
                     "" if job.expose_urls or not exposed else " without an exposed URL")
        reader = threading.Thread(target=self._read_output, args=(job,), name=f"job-log:{job.id}", daemon=True)
        reader.start()
        if exposed and not canceled:
            # The emulator's own probe goes to the process itself, never through a fault link: it must
            # not take (or be hit by) a fault armed for the job's clients.
            probe_port = job.local_ports[exposed[0]]
            self._health_prober().watch(job, process_ports.get(probe_port, probe_port))
        outcome = self._watch_process(job)
        _kill_process_group(process, self.kill_grace_s)  # also ends any child left behind
        reader.join(2.0)
        if process.stdout is not None:
            process.stdout.close()
        job.exit_code = process.returncode
        self._finish(job, *outcome)

    def launch_process(self, argv: List[str], env: Dict[str, str]) -> Any:
        """Start a job's command as its own process group with its output on one pipe (a hook).

        The emulator's own echo server is forked from a pre-imported zygote process (a few ms instead
        of ~100 ms of interpreter start and imports); any other command runs through `Popen`. Returns a
        `Popen` or an object with the same `pid`, `stdout`, `returncode`, `poll()` and `wait()`.
        """
        echo = echo_server_command()
        if self.zygote and argv[:len(echo)] == echo:
            zygote = self._zygote_for_jobs()
            if zygote is not None:
                try:
                    return zygote.spawn(argv[len(echo):], env)
                except _ZygoteUnavailable as exc:  # it died under us: the ordinary path still works
                    log.warning("hf_jobs_emulator: zygote unavailable (%s); starting the job with Popen", exc)
        return spawn_process(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)

    def _watch_process(self, job: EmulatedJob) -> Tuple[str, Optional[str]]:
        """Wait for the process to exit or a deadline to pass; returns (final stage, message)."""
        timeout_s = float(job.spec.get("timeoutSeconds") or DEFAULT_JOB_TIMEOUT_S)
        die_after = job.faults.get("die-after-s")
        start = job.started_mono or time.monotonic()
        die_at = start + float(die_after) if die_after is not None else None
        proc = job._process
        assert proc is not None
        if isinstance(proc, _ZygoteChild):  # its exit sets the event too: no polling at all
            proc.on_exit = job._attention.set
            if proc.poll() is not None:  # it exited before the hook was set
                job._attention.set()
        while True:
            if isinstance(proc, _ZygoteChild):
                deadlines = [start + timeout_s] + ([die_at] if die_at is not None else [])
                job._attention.wait(max(0.0, min(deadlines) - time.monotonic()))
                job._attention.clear()  # before the checks below, so nothing set after them is lost
                code = proc.poll()
            else:
                try:
                    code = proc.wait(SUPERVISE_POLL_S)
                except subprocess.TimeoutExpired:
                    code = None
            if code is not None:
                crash = job.faults.get("crash-at-boot")
                if code == 0:
                    return "COMPLETED", None
                if crash is not None:
                    return "ERROR", crash
                return "ERROR", f"Job failed with exit code: {code}"
            now = time.monotonic()
            if job._stop_reason is not None:
                return "CANCELED", _stop_message(job._stop_reason)
            if now - start >= timeout_s:
                return "CANCELED", f"Job timed out after {timeout_s:g} seconds (timeoutSeconds)"
            if die_at is not None and now >= die_at:
                _kill_process_group(proc, 0.0)
                return "ERROR", f"Job process died: killed {die_after}s after start (emulator fault die-after-s)"
            if job._die_now:
                _kill_process_group(proc, 0.0)
                return "ERROR", "Job process died: killed by JobsEmulator.kill_job"

    def _reserve_port(self) -> int:
        """A loopback port in JOB_PORT_RANGE that is free now and not promised to another live job."""
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randint(*JOB_PORT_RANGE)
            with self._lock:
                if port in self._reserved_ports:
                    continue
                self._reserved_ports.add(port)  # promised first, probed outside the lock
            if _port_is_free(self.host, port):
                return port
            with self._lock:
                self._reserved_ports.discard(port)
        raise RuntimeError(f"no free loopback port in {JOB_PORT_RANGE} for the job after 200 tries")

    def _wait_for_stop_request(self, job: EmulatedJob, until: float) -> bool:
        """Sleep until `until` unless the job is canceled first; True when it was."""
        while job._stop_reason is None:
            left = until - time.monotonic()
            if left <= 0:
                return False
            job._attention.wait(left)
            job._attention.clear()  # a kill_job of a job not RUNNING yet is refused: only stops matter
        return True

    def _is_sandbox_host(self, job: EmulatedJob) -> bool:
        """Whether the job is huggingface_hub's sandbox bootstrap, run as an emulated sbx-server."""
        return self.sandbox_hosts is not None and _sbx_module().is_sandbox_host_spec(job.spec)

    def _job_argv(self, job: EmulatedJob) -> List[str]:
        crash = job.faults.get("crash-at-boot")
        if crash is not None:
            return [sys.executable, "-c", "import sys; sys.stderr.write(sys.argv[1] + '\\n'); sys.exit(1)", crash]
        command = list(job.spec.get("command") or [])
        image = job.spec.get("dockerImage") or job.spec.get("spaceId") or ""
        if not command or _openenv_default_port(command) is not None:  # the image's own server
            command = list(self.image_commands.get(image, self.default_command))
        return command + list(job.spec.get("arguments") or [])

    def _read_output(self, job: EmulatedJob) -> None:
        """Copy the job's merged stdout/stderr into its log, one timestamped entry per line."""
        stream = job._process.stdout if job._process is not None else None
        if stream is None:
            return
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                with self._lock:
                    job.logs.append((_iso(_utcnow()), line))
                    self._changed.notify_all()
        except (OSError, ValueError):  # the pipe was closed under us during teardown
            pass

    def _health_prober(self) -> "_HealthProber":
        """The one thread that probes every booting job's `/health` (started on first use)."""
        with self._lock:
            if self._prober is None:
                host = "127.0.0.1" if self.host == "localhost" else self.host
                self._prober = _HealthProber(host, self.record_health_ok)
            return self._prober

    def _zygote_for_jobs(self) -> Optional["_Zygote"]:
        """The running zygote (started on first use, restarted if it died), or None when it cannot run."""
        with self._zygote_lock:  # not the global lock: starting it takes ~100 ms
            if self._stopping:
                return None
            if self._zygote is None or not self._zygote.alive:
                if self._zygote is not None:
                    self._retired_zygotes.append(self._zygote)
                try:
                    self._zygote = _Zygote.start()
                except (OSError, _ZygoteUnavailable) as exc:
                    log.warning("hf_jobs_emulator: cannot start the zygote (%s); jobs start with Popen", exc)
                    self.zygote = False
                    self._zygote = None
            return self._zygote

    def _end_gates(self, job: EmulatedJob) -> None:
        """An ended job's fault links stop, and its gates too, or with `ended_url_status` answer that status."""
        for gate in job._gates + job._links:
            if self.ended_url_status is not None and isinstance(gate, _JobGate):
                gate.end(self.ended_url_status)  # stopped with the emulator (stop())
            else:
                _stop_quietly(gate)

    def _finish(self, job: EmulatedJob, stage: str, message: Optional[str]) -> None:
        self._end_gates(job)
        with self._lock:
            self._reserved_ports -= {job.port, *job.local_ports.values(), *(l.backend_port for l in job._links)}
            if job.terminal:
                return
            job.stage = stage
            job.message = message
            job.finished_at = _utcnow()
            job.finished_mono = time.monotonic()
            self._changed.notify_all()
        log.info("job %s %s%s", job.id, stage.lower(), f": {message}" if message else "")

    def _insert_fault_links(self, job: EmulatedJob) -> Dict[int, int]:
        """With network_faults, put a _FaultLink on each exposed port's local port and move the job's
        process to a new port behind it; returns {local port: port the process listens on}."""
        if not self.network_faults:
            return {}
        moved = {}
        for local_port in job.local_ports.values():
            link = _FaultLink(self.host, local_port, self._reserve_port())
            job._links.append(link.start())
            moved[local_port] = link.backend_port
        return moved

    # -- the exposed-port gate (a small overridable hook) ---------------------------------------

    def make_gate(self, job: EmulatedJob, exposed_port: int, public: bool = False) -> Any:
        """Start the token gate in front of one exposed port; returns an object with `.url`, `.stop()`."""
        return _JobGate(self, job, exposed_port, public).start()


# ==================================================================================================
# Public API: the echo environment
# ==================================================================================================


class EchoEnvironment:
    """OpenEnv's echo environment: observations echo the message; reward is 0.1 per character."""

    def __init__(self) -> None:
        self.episode_id = str(uuid.uuid4())
        self.step_count = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None) -> Dict[str, Any]:
        self.episode_id = episode_id or str(uuid.uuid4())
        self.step_count = 0
        return _observation("Echo environment ready!", reward=0.0)

    def step(self, message: str) -> Dict[str, Any]:
        self.step_count += 1
        return _observation(message, reward=len(message) * 0.1)

    def state(self) -> Dict[str, Any]:
        return {"episode_id": self.episode_id, "step_count": self.step_count}


class EchoServer:
    """The echo environment served like an OpenEnv server: HTTP endpoints plus `/ws` sessions.

    The HTTP endpoints share one environment (as legacy servers do); every WebSocket session gets its
    own. `step_delay_s` sleeps in every step, to model a slow environment in benchmarks.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, step_delay_s: float = 0.0,
                 unix_socket: Optional[str] = None) -> None:
        reason = _delay_rejection("step_delay_s", step_delay_s)
        if reason:
            raise ValueError(reason)
        self.host = host
        self.step_delay_s = float(step_delay_s)
        self.http_env = EchoEnvironment()
        self.http_lock = threading.Lock()
        # unix_socket: serve on that path instead of host:port (a pooled sandbox's socket)
        self.unix_socket = unix_socket
        handler = type("_BoundEchoHandler", (_EchoHandler,), {"server_ref": self})
        self._server: Any = (_TrackingHTTPServer((host, port), handler) if unix_socket is None
                             else _TrackingUnixServer(unix_socket, handler))
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> Optional[int]:
        """The TCP port it listens on (None on a unix socket)."""
        return self._server.server_address[1] if self.unix_socket is None else None

    @property
    def url(self) -> str:
        if self.unix_socket is not None:
            return f"unix:{self.unix_socket}"
        return f"http://{_url_host(self.host)}:{self.port}"

    def start(self) -> "EchoServer":
        """Serve from a background thread; returns self."""
        self._thread = threading.Thread(target=self._server.serve_forever, args=(SERVE_POLL_S,),
                                        name=f"echo:{self.port or self.unix_socket}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close every open connection, WebSocket sessions included. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._server.shutdown()
            thread.join(5.0)
        self._server.close_all_connections()
        self._server.server_close()
        if self.unix_socket is not None:
            try:
                os.unlink(self.unix_socket)
            except OSError:
                pass  # already removed

    def __enter__(self) -> "EchoServer":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


def echo_server_command() -> List[str]:
    """The argv that runs this module's echo server on `$PORT`, or in a pooled sandbox on
    `$SBX_PROXY_DIR/<port>.sock` (the emulator's default job command)."""
    return [sys.executable, os.path.abspath(__file__), "echo-server"]


def tls_rejection() -> Optional[str]:
    """Why `JobsEmulator(tls=True)` (its sandbox hosts, pooled placement) cannot run here, or None:
    it makes its certificates with `cryptography`, a test dependency the library does not need."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return ("the local emulator's TLS mode (sandbox hosts, pooled placement) makes its "
                "certificates with the `cryptography` package, which is not installed: pip install "
                "cryptography (or the project's test extra: pip install -e '.[test]')")
    return None


# ==================================================================================================
# Machinery: validation (each returns the reason something is refused, or None)
# ==================================================================================================


class _Injection:
    """An armed API fault: the next `left` calls (of `routes`, or any) are answered with `value`."""

    def __init__(self, value: Any) -> None:
        self.left = 0
        self.value = value
        self.routes: Optional[frozenset] = None

    def arm(self, calls: int, value: Any, routes: Optional[Iterable[str]]) -> None:
        self.left, self.value = calls, value
        self.routes = frozenset(routes) if routes is not None else None

    def take(self, route: str) -> Optional[Any]:
        """The value for this call, counting it, or None when it is not one of the armed calls."""
        if self.left <= 0 or (self.routes is not None and route not in self.routes):
            return None
        self.left -= 1
        return self.value


class _ApiError(Exception):
    def __init__(self, status: int, message: str, headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


# What HTTP/1.1 allows as a Content-Length (decimal digits) and a chunk size (hex digits, RFC 9112): stricter than
# int(), which also takes a sign, `_` separators and a `0x` prefix.
_FRAMING_DIGITS = {10: re.compile(rb"[0-9]+"), 16: re.compile(rb"[0-9A-Fa-f]+")}


def _framing_number(text: Any, base: int, what: str) -> int:
    """A Content-Length or chunk size; a malformed one is the client's fault: 400 naming it, as a real front end
    answers, and the connection is closed (where the body ends is unknown, so the next request cannot be found)."""
    raw = (text.encode("latin-1", "replace") if isinstance(text, str) else bytes(text)).strip()
    if not _FRAMING_DIGITS[base].fullmatch(raw):
        raise _ApiError(400, f"malformed {what}: {raw[:40].decode('latin-1')!r}", {"Connection": "close"})
    return int(raw, base)


def _host_rejection(host: str) -> Optional[str]:
    if not _is_loopback_host(host):
        return (f"host {host!r} is not a loopback address: the emulator runs commands for anyone holding "
                "its token, so it only binds 127.0.0.1, ::1 or localhost")
    return None


def _namespace_rejection(name: Any) -> Optional[str]:
    allowed = set(string.ascii_letters + string.digits + "-_.")
    if not isinstance(name, str) or not name or not set(name) <= allowed:
        return f"namespace {name!r} must be a non-empty string of letters, digits, '-', '_' or '.'"
    return None


def _delay_rejection(name: str, value: Any) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return f"{name} must be a number of seconds >= 0, got {value!r}"
    return None


def _faults_rejection(faults: Mapping[str, Any], where: str, prefix: str = "") -> Optional[str]:
    def named(key: str) -> str:  # as the caller wrote it: `emulator-die-after-s`, `HF_JOBS_EMULATOR_DIE_AFTER_S`
        return prefix + (key.upper().replace("-", "_") if prefix == FAULT_ENV_PREFIX else key)

    for key, value in faults.items():
        shown = f"{where} {named(str(key))}"
        if key not in FAULT_KEYS:
            return f"{shown}: unknown fault; known faults are {', '.join(map(named, FAULT_KEYS))}"
        text = str(value)
        if key in ("scheduling-delay-s", "die-after-s"):
            try:
                number = float(text)
            except ValueError:
                number = -1.0
            if not number >= 0:
                return f"{shown}={text!r}: must be a number of seconds >= 0"
        elif key == "rate-limit-after-create" and not (text.isdigit()):
            return f"{shown}={text!r}: must be a whole number of API calls >= 0"
        elif (key in ("lost-create-response", "no-url", "foreign-url")
              and text.lower() not in ("true", "false", "1", "0", "yes", "no")):
            return f"{shown}={text!r}: must be true or false"
        elif key == "crash-at-boot" and not text:
            return f"{shown}: give the crash message as the value"
    return None


def _rate_limit_rejection(rate_limit: Any) -> Optional[str]:
    if rate_limit is None:
        return None
    try:
        quota, window = rate_limit
    except (TypeError, ValueError):
        quota = window = None
    if (isinstance(quota, bool) or not isinstance(quota, int) or quota < 1 or isinstance(window, bool)
            or not isinstance(window, (int, float)) or not window > 0):
        return f"rate_limit must be (calls >= 1, window seconds > 0), e.g. (1000, 300), got {rate_limit!r}"
    return None


def _count_rejection(count: Any, name: str = "count") -> Optional[str]:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        return f"{name} must be an int >= 0, got {count!r}"
    return None


def _route_names_rejection(routes: Optional[Iterable[str]]) -> Optional[str]:
    unknown = sorted(set(routes or ()) - set(API_ROUTES))
    return f"unknown route names {unknown}; use some of {', '.join(API_ROUTES)}" if unknown else None


def _str_list_rejection(body: Mapping[str, Any], field: str) -> Optional[str]:
    value = body.get(field)
    if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
        return f"field '{field}' must be a list of strings, got {type(value).__name__}"
    return None


def _str_map_rejection(body: Mapping[str, Any], field: str) -> Optional[str]:
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"field '{field}' must be an object of string values, got {type(value).__name__}"
    for key, item in value.items():
        if not isinstance(item, str):
            return f"field '{field}.{key}' must be a string, got {type(item).__name__}"
    return None


def _create_body_rejection(body: Any, flavors: Sequence[str]) -> Optional[str]:
    """Why a create body is refused (naming the field), or None."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object describing the job"
    image, space = body.get("dockerImage"), body.get("spaceId")
    if (image is None) == (space is None):
        return "give exactly one of 'dockerImage' or 'spaceId'"
    source = "dockerImage" if image is not None else "spaceId"
    if not isinstance(body[source], str) or not body[source]:
        return f"field '{source}' must be a non-empty string"
    for field in ("command", "arguments"):
        reason = _str_list_rejection(body, field)
        if reason:
            return reason
    for field in ("environment", "secrets", "labels"):
        reason = _str_map_rejection(body, field)
        if reason:
            return reason
    flavor = body.get("flavor")
    if flavor is not None and flavor not in flavors:
        return f"field 'flavor': unknown flavor {flavor!r}; use one of {', '.join(flavors)}"
    timeout = body.get("timeoutSeconds")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0):
        return f"field 'timeoutSeconds' must be a whole number of seconds > 0, got {timeout!r}"
    reason = (_labels_rejection(body.get("labels") or {}, FAULT_LABEL_PREFIX)
              or _network_rejection(body.get("network")) or _volumes_rejection(body.get("volumes")))
    if reason:
        return reason
    return None if body.get("expose") is None else _expose_rejection(body["expose"], "expose.")


def _network_rejection(network: Any) -> Optional[str]:
    """`network`: {"group": name, "aliases": [names]} (huggingface_hub's network_group and
    network_aliases)."""
    if network is None:
        return None
    group = network.get("group") if isinstance(network, dict) else None
    if not isinstance(group, str) or not group:
        return "field 'network' must be {\"group\": a non-empty string, \"aliases\": [strings]}"
    aliases = network.get("aliases")
    if aliases is not None and not (isinstance(aliases, list)
                                    and all(isinstance(a, str) and a for a in aliases)):
        return "field 'network.aliases' must be a list of non-empty strings"
    return None


def _volumes_rejection(volumes: Any) -> Optional[str]:
    """`volumes`: [{"type", "source", "mountPath", ...}] (huggingface_hub's Volume.to_dict())."""
    if volumes is None:
        return None
    if not isinstance(volumes, list):
        return "field 'volumes' must be a list of volume objects"
    for index, volume in enumerate(volumes):
        if not isinstance(volume, dict) or not all(isinstance(volume.get(key), str) and volume[key]
                                                   for key in ("type", "source", "mountPath")):
            return (f"field 'volumes[{index}]' must be an object with string 'type', 'source' "
                    "and 'mountPath'")
    return None


def _labels_rejection(labels: Mapping[str, Any], fault_prefix: Optional[str]) -> Optional[str]:
    """Why labels break the Hub's rule (naming the label), or None; fault labels keep free-form values."""
    allowed = set(string.ascii_letters + string.digits + "-_")
    for key, value in labels.items():
        if not key or len(key) > LABEL_MAX_CHARS or not set(key) <= allowed:
            return f"label key {key!r}: keys must be 1-{LABEL_MAX_CHARS} letters, digits, '-' or '_'"
        if fault_prefix and key.startswith(fault_prefix):
            continue
        if len(value) > LABEL_MAX_CHARS or not set(value) <= allowed:
            return f"label {key}={value!r}: values must be at most {LABEL_MAX_CHARS} letters, digits, '-' or '_'"
    return None


def _expose_rejection(expose: Any, prefix: str = "") -> Optional[str]:
    """Why an expose object (`{"ports": [...], "portsPublic": [...]}`) is refused, naming the field, or None."""
    if not isinstance(expose, dict):
        return f"field '{prefix or 'expose'}' must be an object {{\"ports\": [...], \"portsPublic\": [...]}}"
    ports, public = expose.get("ports") or [], expose.get("portsPublic") or []
    for field, values in ((prefix + "ports", ports), (prefix + "portsPublic", public)):
        if not isinstance(values, list) or not all(
                isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in values):
            return f"field '{field}' must be a list of port numbers (1-65535), got {values!r}"
        if len(set(values)) != len(values):
            return f"field '{field}' lists a port twice: {values!r}"
    if not set(public) <= set(ports):
        return f"field '{prefix}portsPublic' must be a subset of '{prefix}ports'"
    return None


def _json_body(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8")) if body else None
    except (UnicodeDecodeError, ValueError) as exc:
        raise _ApiError(400, f"the request body is not valid JSON: {exc}")


def _process_cpu_seconds(pid: Optional[int]) -> float:
    """User + system CPU seconds of a process (Linux /proc; 0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return 0.0


def _process_rss_bytes(pid: Optional[int]) -> int:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, TypeError):
        return 0


class _JobState:
    """The fields of a job that change while it runs, copied under the emulator's lock."""

    __slots__ = ("stage", "message", "expose_urls", "started_at", "finished_at", "started_mono", "finished_mono")

    @classmethod
    def of(cls, job: EmulatedJob) -> "_JobState":
        state = cls()
        state.stage, state.message = job.stage, job.message
        state.expose_urls = list(job.expose_urls) if job.expose_urls is not None else None
        if state.expose_urls and _truthy(job.faults.get("foreign-url", "false")):
            foreign = job.id[::-1]  # another well-formed job id, stable for the job's life
            state.expose_urls = [url.replace("//%s--" % job.id, "//%s--" % foreign)
                                 for url in state.expose_urls]
        state.started_at, state.finished_at = job.started_at, job.finished_at
        state.started_mono, state.finished_mono = job.started_mono, job.finished_mono
        return state


def _job_info(job: EmulatedJob, state: _JobState) -> Dict[str, Any]:
    """The job as the real API answers it (field names and shapes HfApi's JobInfo reads)."""
    spec = job.spec
    now = time.monotonic()
    end = state.finished_mono if state.finished_mono is not None else now
    status: Dict[str, Any] = {"stage": state.stage, "message": state.message}
    if state.expose_urls is not None:
        status["exposeUrls"] = list(state.expose_urls)
    info: Dict[str, Any] = {
        "id": job.id,
        "createdAt": _iso(job.created_at),
        "command": list(spec.get("command") or []),
        "arguments": list(spec.get("arguments") or []),
        "environment": dict(spec.get("environment") or {}),
        # Names only: the real API never gives a secret's value back.
        "secrets": {name: None for name in job.secret_names},
        "flavor": spec.get("flavor") or "cpu-basic",
        "labels": dict(spec.get("labels") or {}) or None,
        "timeoutSeconds": spec.get("timeoutSeconds", DEFAULT_JOB_TIMEOUT_S),
        "status": status,
        "owner": {"id": _stable_id(job.namespace), "name": job.namespace, "type": job.owner_type},
        "initiator": {"type": "user", "id": _stable_id(job.initiator), "name": job.initiator},
        "durations": {
            "schedulingSecs": (int((state.started_mono or end) - job.created_mono)
                               if state.started_mono is not None else None),
            "runningSecs": (int(end - state.started_mono) if state.started_mono is not None else None),
            "totalSecs": int(end - job.created_mono),
        },
    }
    if "spaceId" in spec:
        info["spaceId"] = spec["spaceId"]
    else:
        info["dockerImage"] = spec.get("dockerImage")
    if state.started_at is not None:
        info["startedAt"] = _iso(state.started_at)
    if state.finished_at is not None:
        info["finishedAt"] = _iso(state.finished_at)
    if "expose" in spec:
        info["expose"] = {"ports": list(spec["expose"].get("ports") or []),
                          "portsPublic": list(spec["expose"].get("portsPublic") or [])}
    if spec.get("network"):  # `aliases` only when some were claimed, as huggingface_hub sends it
        network = spec["network"]
        info["network"] = {"group": network["group"], **({"aliases": list(network["aliases"])}
                                                         if network.get("aliases") else {})}
    if spec.get("volumes"):
        info["volumes"] = [dict(volume) for volume in spec["volumes"]]
    return info


# ==================================================================================================
# Machinery: small helpers
# ==================================================================================================


def _openenv_default_port(command: Sequence[str]) -> Optional[int]:
    """The port of OpenEnv's default server command (`sh -c "cd /app/env && exec uvicorn ..."`),
    or None when `command` is another one."""
    if len(command) != 3 or command[0] not in ("sh", "/bin/sh") or command[1] != "-c":
        return None
    match = OPENENV_DEFAULT_COMMAND.match(str(command[2]).strip())
    return int(match.group("port")) if match else None


def _hardware_list(flavors: Sequence[str]) -> List[Dict[str, Any]]:
    """`GET /api/jobs/hardware` in the shape huggingface_hub's JobHardwareInfo reads. Only the names are the
    Hub's (the provider's KNOWN_FLAVORS); the specs and prices are placeholders (docs/emulator.md)."""
    entries = []
    for name in flavors:
        shape = re.match(r"^(?P<model>.+?)(?:-(?:small|medium|large))?(?:x(?P<count>[0-9]+))?$", name)
        gpu = None if name.startswith("cpu") or shape is None else shape.group("model").upper()
        count = (shape.group("count") if shape is not None else None) or "1"
        entries.append({
            "name": name, "prettyName": name.replace("-", " ").title(), "cpu": "emulated", "ram": "emulated",
            "ephemeralStorage": "emulated",
            "accelerator": None if gpu is None else {
                "type": "gpu", "model": gpu, "quantity": count,
                "vram": "emulated", "manufacturer": "Nvidia"},
            "unitCostMicroUSD": 0, "unitCostUSD": 0.0, "unitLabel": "minute",
        })
    return entries
def _sbx_module() -> Any:
    """hf_sbx_emulator, imported on first use (it imports this module), or None in a vendored copy without it."""
    name = f"{__package__}.hf_sbx_emulator" if __package__ else "hf_sbx_emulator"
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)


def _sandbox_hosts(**settings: Any) -> Any:
    """The emulator's `hf_sbx_emulator.SandboxHosts`, or None without that module (bootstraps then run as is)."""
    module = _sbx_module()
    return module.SandboxHosts(**settings) if module is not None else None


def _generate_token() -> str:
    alphabet = string.ascii_letters
    return "hf_" + "".join(secrets.choice(alphabet) for _ in range(34))


def _new_job_id() -> str:
    # Like the real ids (24 hex digits, time first) so ids sort by creation and look familiar.
    return f"{int(time.time()):08x}{secrets.token_hex(8)}"


def _stable_id(name: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_URL, f"hf-jobs-emulator:{name}").hex[:24]


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _iso(moment: datetime.datetime) -> str:
    """The Hub's timestamp format: `2025-07-16T20:35:12.808Z`."""
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _truthy(text: str) -> bool:
    return str(text).lower() in ("true", "1", "yes")


def _stop_message(reason: Optional[str]) -> str:
    return "Job canceled by the emulator stopping" if reason == "emulator stopped" else "Job canceled"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = host if host != "localhost" else "127.0.0.1"
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((bind_host, port))
        except OSError:
            return False
    return True


def _job_environment(environment: Mapping[str, str], secret_values: Mapping[str, str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV_VARS}
    env.setdefault("PYTHONUNBUFFERED", "1")  # log lines reach the job log as they are printed
    env.update(environment)
    env.update(secret_values)
    return env


def spawn_process(argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen` whose child has CHILD_SIGNALS unblocked and at their default action, even when
    the calling thread blocks them (the child inherits its mask) or this process ignores one.

    The mask is lifted in the calling thread for the instant of the fork (a signal arriving then is
    handled as it would be in the main thread). An ignored disposition (SIGHUP under `nohup`) survives
    exec, so the child first runs `_SIGNAL_DEFAULT_SHIM`, which resets it and execs `argv`: Python code
    between fork and exec (`preexec_fn`) can deadlock the child of a process with threads (seen: CI under
    nohup left forks of pytest that never reached exec).
    """
    argv = list(argv)
    ignored = [sig for sig in CHILD_SIGNALS if signal.getsignal(sig) == signal.SIG_IGN]
    if ignored:
        # A command that cannot run fails here, as Popen's own exec would, not later in the shim.
        argv[0] = _executable(argv[0], popen_kwargs.get("env"), popen_kwargs.get("cwd"))
        argv = _signal_reset_prefix(ignored) + argv
    if not hasattr(signal, "pthread_sigmask"):
        return subprocess.Popen(argv, **popen_kwargs)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_SIGNALS)
    try:
        return subprocess.Popen(argv, **popen_kwargs)
    finally:
        if blocked & set(CHILD_SIGNALS):
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


# Run by a child of spawn_process when this process ignores some of CHILD_SIGNALS: argv[1] lists them,
# argv[2:] is the command (its pid, fds, cwd and environment are the child's own: exec keeps them).
_SIGNAL_DEFAULT_SHIM = (
    "import os, signal, sys\n"
    "for number in sys.argv[1].split(','):\n"
    "    signal.signal(int(number), signal.SIG_DFL)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")


def _signal_reset_prefix(ignored: Sequence[int]) -> List[str]:
    """What a child of spawn_process runs first to reset the ignored signals and exec its command: GNU env's
    --default-signal (a small C program, ~1 ms of CPU), or where env lacks it (BSD, older coreutils) the
    Python shim (an interpreter start, ~15 ms of CPU: under nohup, 64 sandboxes at once paid ~1 CPU-s)."""
    env = _default_signal_env()
    if env:
        return [env, "--default-signal=" + ",".join(signal.Signals(sig).name[3:] for sig in ignored), "--"]
    return [sys.executable, "-I", "-S", "-c", _SIGNAL_DEFAULT_SHIM, ",".join(str(int(sig)) for sig in ignored)]


_default_signal_env_found: List[Optional[str]] = []  # [path or None] once checked


def _default_signal_env() -> Optional[str]:
    """The path of an `env` that has --default-signal (GNU coreutils >= 8.31), checked once, else None."""
    if not _default_signal_env_found:
        path = shutil.which("env") or ""
        try:
            works = bool(path) and subprocess.run([path, "--default-signal=HUP", "--version"], stdin=subprocess.DEVNULL,
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                  timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            works = False
        _default_signal_env_found[:] = [path if works else None]
    return _default_signal_env_found[0]


def _executable(command: str, env: Optional[Mapping[str, str]], cwd: Optional[str]) -> str:
    """The path `command` runs from (searched on the child's PATH when it names no directory), or the
    FileNotFoundError/PermissionError Popen raises for a command that cannot run."""
    if os.sep in command:
        path = os.path.join(cwd, command) if cwd and not os.path.isabs(command) else command
    else:
        path = shutil.which(command, path=(env if env is not None else os.environ).get("PATH", os.defpath)) or ""
    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), command)
    if not os.access(path, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), command)
    return os.path.abspath(path)


# Emulators started and not (completely) stopped. At interpreter exit their jobs' process groups are SIGKILLed: a
# job started with Popen leads its own session, so neither a terminal's Ctrl-C nor its parent's exit reaches it
# (zygote children die with the zygote anyway), and a stop() cut short, or never called, would leave it running.
# A plain set: an emulator whose stop() was interrupted after its threads ended must stay reachable from here.
# (An emulator process killed outright, by SIGKILL or a signal it does not handle, runs no atexit hook.)
_running_emulators: "set[JobsEmulator]" = set()


@atexit.register
def _kill_jobs_at_exit() -> None:
    for emulator in list(_running_emulators):
        emulator._kill_job_groups()


def _kill_process_group(proc: Optional[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM the process's group, SIGKILL it after `grace_s`, and reap the process."""
    if proc is None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if sig == signal.SIGTERM and grace_s <= 0:
            continue
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            # The leader exited; anything else in its group is killed outright.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return


def _stop_quietly(thing: Any) -> bool:
    """Stop a gate; False (never an exception) when it failed, so teardown goes on and can say so."""
    try:
        thing.stop()
    except Exception:
        return False
    return True


def _observation(message: str, reward: float) -> Dict[str, Any]:
    return {"observation": {"echoed_message": message, "message_length": len(message)},
            "reward": reward, "done": False}


# ==================================================================================================
# Machinery: the zygote (fast echo-server jobs) and the health prober
# ==================================================================================================


class _ZygoteUnavailable(RuntimeError):
    """The zygote is not running (or died while starting a job); use the ordinary Popen path."""


class _ZygoteChild:
    """A job process forked by the zygote, with the part of `Popen`'s interface the emulator uses.

    The zygote (its parent) reaps it and reports the exit code; until then `poll()` is None.
    """

    def __init__(self, pid: int, stdout: Any, argv: List[str]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.args = argv
        self.returncode: Optional[int] = None
        self.on_exit: Optional[Callable[[], None]] = None  # called once it exited (a supervisor's wake-up)
        self._exited = threading.Event()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _set_exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._exited.set()
        if self.on_exit is not None:
            self.on_exit()


class _Zygote:
    """One pre-imported helper process that forks a fresh echo-server child per job.

    Protocol over a SOCK_SEQPACKET socketpair, one JSON message each way per event:
    `{"id", "args", "env"}` plus the write end of the job's output pipe (SCM_RIGHTS) -> the zygote forks
    and answers `{"id", "pid"}` (or `{"id", "error"}`); whenever it reaps a child it sends
    `{"exit": pid, "code": returncode}`. If the emulator goes away the zygote kills its children and
    exits; if the zygote dies the emulator SIGKILLs the children it knew (each is its own group).
    """

    def __init__(self, process: subprocess.Popen, sock: socket.socket) -> None:
        self._process = process
        self._sock = sock
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next_id = 0
        self._pending: Dict[int, List[Any]] = {}  # request id -> [Event, answer]
        self._children: Dict[int, _ZygoteChild] = {}  # pid -> child not yet reported exited
        self._argv: Dict[int, List[str]] = {}
        self.alive = True
        self._reader = threading.Thread(target=self._read_answers, name=f"zygote:{process.pid}", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls) -> "_Zygote":
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = spawn_process(
                [sys.executable, os.path.abspath(__file__), "zygote", str(theirs.fileno())],
                stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), start_new_session=True,
                env={k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV_VARS})
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(process, ours)

    @property
    def pid(self) -> int:
        return self._process.pid

    def spawn(self, args: List[str], env: Dict[str, str]) -> _ZygoteChild:
        """Fork one echo server (`echo-server *args`) with this environment; its output on a new pipe."""
        read_fd, write_fd = os.pipe()
        waiter: List[Any] = [threading.Event(), None]
        with self._lock:
            if not self.alive:
                os.close(read_fd)
                os.close(write_fd)
                raise _ZygoteUnavailable("the zygote has exited")
            self._next_id += 1
            request_id = self._next_id
            self._pending[request_id] = waiter
        try:
            message = json.dumps({"id": request_id, "args": args, "env": env}).encode("utf-8")
            with self._send_lock:
                socket.send_fds(self._sock, [message], [write_fd])
        except OSError as exc:
            os.close(read_fd)
            with self._lock:
                self._pending.pop(request_id, None)
            raise _ZygoteUnavailable(f"cannot reach the zygote: {exc}")
        finally:
            os.close(write_fd)  # the child holds its copy now; EOF on read_fd means the job's output ended
        if not waiter[0].wait(ZYGOTE_SPAWN_TIMEOUT_S) or not isinstance(waiter[1], dict) or "pid" not in waiter[1]:
            os.close(read_fd)
            with self._lock:
                self._pending.pop(request_id, None)
            reason = (waiter[1] or {}).get("error") if isinstance(waiter[1], dict) else None
            raise _ZygoteUnavailable(reason or f"no answer from the zygote within {ZYGOTE_SPAWN_TIMEOUT_S}s")
        child = waiter[1]["child"]
        child.stdout = os.fdopen(read_fd, "rb")
        child.args = echo_server_command() + list(args)
        return child

    def stop(self) -> List[str]:
        """Close the control socket (the zygote then kills what it still runs) and reap it. Never raises."""
        problems: List[str] = []
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._process.wait(ZYGOTE_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            _kill_process_group(self._process, 0.0)
        if self._process.poll() is None:
            problems.append(f"zygote pid {self._process.pid}")
        self._reader.join(ZYGOTE_EXIT_WAIT_S)
        if self._reader.is_alive():
            problems.append("zygote reader thread")
        self._sock.close()
        return problems

    def _read_answers(self) -> None:
        """Route the zygote's answers to `spawn` calls and its exit reports to the children."""
        while True:
            try:
                data = self._sock.recv(ZYGOTE_MAX_MESSAGE_BYTES)
            except OSError:
                data = b""
            if not data:
                break
            try:
                message = json.loads(data.decode("utf-8"))
            except ValueError:
                continue
            with self._lock:
                if "exit" in message:
                    child = self._children.pop(message["exit"], None)
                    if child is not None:
                        child._set_exited(int(message["code"]))
                    continue
                waiter = self._pending.pop(message.get("id"), None)
                if "pid" in message:  # (handed to spawn() itself: its exit report may pop it from _children first)
                    message["child"] = self._children[message["pid"]] = _ZygoteChild(message["pid"], None, [])
            if waiter is None and "pid" in message:  # its spawn() gave up waiting: no job owns it
                try:
                    os.killpg(message["pid"], signal.SIGKILL)  # the zygote reaps it and reports the exit
                except (ProcessLookupError, PermissionError):
                    pass
            if waiter is not None:
                waiter[1] = message
                waiter[0].set()
        self._orphaned()

    def _orphaned(self) -> None:
        """The zygote is gone: no exit report will come, so end its children here and wake every waiter."""
        with self._lock:
            self.alive = False
            children, self._children = list(self._children.values()), {}
            pending, self._pending = list(self._pending.values()), {}
        for child in children:
            try:
                os.killpg(child.pid, signal.SIGKILL)  # each child leads its own process group
            except (ProcessLookupError, PermissionError):
                pass
            child._set_exited(-signal.SIGKILL)
        for waiter in pending:
            waiter[0].set()
        if children:
            log.warning("hf_jobs_emulator: the zygote exited; killed its %d job process(es)", len(children))


def _zygote_main(fd: int) -> int:
    """The zygote process: fork an echo server per request on the control socket, report exits."""
    import selectors as _selectors
    import wsproto.events  # noqa: F401 - pre-imported so the children start warm
    import wsproto.extensions  # noqa: F401
    import wsproto.utilities  # noqa: F401

    prctl = _load_prctl()
    gc.freeze()  # children share the imported objects' pages instead of copying them on the first GC
    control = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler is needed for the wakeup fd to fire
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the emulator ends us by closing the socket
    children: set = set()
    selector = _selectors.DefaultSelector()
    selector.register(control, _selectors.EVENT_READ)
    selector.register(wake_r, _selectors.EVENT_READ)

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            control.send(json.dumps({"exit": pid, "code": code}).encode("utf-8"))

    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj == wake_r:
                    try:
                        while os.read(wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    reap()
                    continue
                data, fds, _, _ = socket.recv_fds(control, ZYGOTE_MAX_MESSAGE_BYTES, 1)
                if not data:
                    return 0
                request = json.loads(data.decode("utf-8"))
                try:
                    pid = os.fork()
                except OSError as exc:
                    for extra in fds:
                        os.close(extra)
                    control.send(json.dumps({"id": request["id"], "error": f"fork failed: {exc}"}).encode())
                    continue
                if pid == 0:
                    inherited = (control.fileno(), wake_r, wake_w, getattr(selector, "fileno", lambda: -1)())
                    _zygote_child(request, fds, inherited, prctl)
                # The child's own group before anyone learns its pid, so a cancel's killpg never misses
                # it (both sides call setpgid: whichever runs first wins, the classic race fix). No
                # setsid: the zygote leads a session without a terminal, which its children share.
                try:
                    os.setpgid(pid, pid)
                except OSError:
                    pass  # the child already did it (EACCES after exec cannot happen: it never execs)
                children.add(pid)
                for extra in fds:
                    os.close(extra)
                control.send(json.dumps({"id": request["id"], "pid": pid}).encode("utf-8"))
                reap()
    except OSError:
        return 1  # the emulator is gone
    finally:
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        selector.close()
        control.close()


def _zygote_child(request: Dict[str, Any], fds: List[int], close_fds: Tuple[int, ...],
                  prctl: Optional[Callable[..., int]]) -> None:
    """In a fresh fork of the zygote: become a job (own process group, output pipe, environment), run the
    echo server, and never return into the zygote's loop."""
    code = 1
    zygote_pid = os.getppid()
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.setpgid(0, 0)  # its own group; the zygote does the same from its side (see _zygote_main)
        _die_with_parent(prctl, zygote_pid)
        for fd in close_fds:  # the zygote's own: a job holds only its pipe and what it opens
            try:
                os.close(fd)
            except OSError:
                pass  # -1 (a selector without an fd) or not inherited (kqueue)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[0], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered, like PYTHONUNBUFFERED
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        # No arguments (the usual job): skip building the argparse parser, ~1 ms per child.
        code = main(["echo-server", *request["args"]]) if request["args"] else _run_echo_server()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _load_prctl() -> Optional[Callable[..., int]]:
    """libc's prctl (Linux), loaded once in the zygote so children do not pay for ctypes; else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent(prctl: Optional[Callable[..., int]], parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent (the zygote) dies, even if nobody else is left to
    clean up (the emulator and the zygote both killed). Elsewhere the emulator's own cleanup is all."""
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class _HealthProber:
    """One thread that probes every booting job's server with `GET /health` until it answers 200.

    Non-blocking sockets on one selector, instead of a thread per job: hundreds of jobs booting at once
    cost one thread, and the probe rate is bounded (HEALTH_PROBES_PER_S) so it never starves the jobs.
    """

    def __init__(self, host: str, record: Callable[[str], None]) -> None:
        self._host = host
        self._record = record
        self._lock = threading.Lock()
        self._jobs: Dict[str, Tuple[EmulatedJob, int]] = {}  # job id -> (job, local port)
        self._stopping = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="job-health-prober", daemon=True)
        self._thread.start()

    def watch(self, job: EmulatedJob, port: int) -> None:
        """Start probing this job (until it answers 200 or ends)."""
        with self._lock:
            self._jobs[job.id] = (job, port)
        self._wake()

    def stop(self) -> bool:
        """End the thread; False when it did not end in time."""
        with self._lock:
            self._stopping = True
        self._wake()
        self._thread.join(5.0)
        if self._thread.is_alive():
            return False
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        return True

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # already full (a wake is pending) or closed

    def _run(self) -> None:
        attempts: Dict[str, Dict[str, Any]] = {}  # job id -> in-flight attempt {sock, deadline, sent, data}
        next_at: Dict[str, float] = {}  # job id -> when to try again
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    jobs = dict(self._jobs)
                now = time.monotonic()
                interval = max(HEALTH_PROBE_INTERVAL_S, len(jobs) / HEALTH_PROBES_PER_S)
                for job_id, (job, port) in jobs.items():
                    if job.terminal or job._stop_reason is not None or job.first_health_ok_mono is not None:
                        self._drop(job_id, attempts, next_at)
                    elif job_id not in attempts and next_at.get(job_id, 0.0) <= now:
                        attempts[job_id] = self._connect(job_id, port, now)
                for job_id, attempt in list(attempts.items()):
                    if now >= attempt["deadline"]:
                        self._retry(job_id, attempts, next_at, now + interval)
                waits = [attempt["deadline"] for attempt in attempts.values()]
                waits += [next_at.get(j, now) for j in jobs if j not in attempts]
                timeout = max(0.0, min(waits) - now) if waits else None
                for key, events in self._selector.select(timeout):
                    if key.fileobj is self._wake_r:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                        continue
                    job_id = key.data
                    if job_id in attempts:
                        self._advance(job_id, attempts, next_at, time.monotonic() + interval)
        finally:
            for job_id in list(attempts):
                self._drop(job_id, attempts, next_at)

    def _connect(self, job_id: str, port: int, now: float) -> Dict[str, Any]:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect_ex((self._host, port))
        self._selector.register(sock, selectors.EVENT_WRITE, job_id)
        return {"sock": sock, "deadline": now + HEALTH_PROBE_TIMEOUT_S, "sent": False, "data": b""}

    def _advance(self, job_id: str, attempts: Dict[str, Dict[str, Any]], next_at: Dict[str, float],
                 retry_at: float) -> None:
        """One step of an attempt: connected -> send the request; readable -> read the status line."""
        attempt = attempts[job_id]
        sock = attempt["sock"]
        try:
            if not attempt["sent"]:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                    raise OSError("not listening yet")
                sock.send(b"GET /health HTTP/1.1\r\nHost: job\r\nConnection: close\r\n\r\n")
                attempt["sent"] = True
                self._selector.modify(sock, selectors.EVENT_READ, job_id)
                return
            chunk = sock.recv(1024)
            attempt["data"] += chunk
            if b"\r\n" not in attempt["data"] and chunk:
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._retry(job_id, attempts, next_at, retry_at)
            return
        status = attempt["data"].split(b"\r\n", 1)[0].split()
        if len(status) >= 2 and status[0].startswith(b"HTTP/") and status[1] == b"200":
            self._record(job_id)
            with self._lock:
                self._jobs.pop(job_id, None)
            self._drop(job_id, attempts, next_at)
        else:
            self._retry(job_id, attempts, next_at, retry_at)

    def _retry(self, job_id: str, attempts: Dict[str, Dict[str, Any]], next_at: Dict[str, float],
               when: float) -> None:
        self._close(attempts.pop(job_id, None))
        next_at[job_id] = when

    def _drop(self, job_id: str, attempts: Dict[str, Dict[str, Any]], next_at: Dict[str, float]) -> None:
        self._close(attempts.pop(job_id, None))
        next_at.pop(job_id, None)
        with self._lock:
            self._jobs.pop(job_id, None)

    def _close(self, attempt: Optional[Dict[str, Any]]) -> None:
        if attempt is None:
            return
        try:
            self._selector.unregister(attempt["sock"])
        except (KeyError, ValueError):
            pass
        attempt["sock"].close()


# ==================================================================================================
# Machinery: HTTP servers
# ==================================================================================================


class _OpenConnections:
    """A threading socketserver mixin that remembers open connections so `stop()` can close every
    one of them (idle keep-alive connections, log streams and WebSocket sessions outlive it)."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._open: set = set()
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_all_connections(self) -> None:
        with self._open_lock:
            sockets = list(self._open)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its handler

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that reset or dropped its connection is routine: logged at DEBUG, not a traceback on stderr
        (socketserver's default). Anything else is a bug worth seeing: logged at ERROR with its traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
            log.debug("hf_jobs_emulator: a client dropped its connection (%r)", error)
            return
        log.error("hf_jobs_emulator: error while serving a connection from %s", client_address, exc_info=True)


class _TrackingHTTPServer(_OpenConnections, ThreadingHTTPServer):
    """A ThreadingHTTPServer on loopback TCP whose open connections `stop()` can close."""

    def __init__(self, address: Tuple[str, int], handler: type) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (socket.getfqdn): 3-4 ms of every echo
        # server's start, and a stall with a slow resolver. Nothing here uses the name.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), port


class _TrackingUnixServer(_OpenConnections, socketserver.ThreadingMixIn,
                          socketserver.UnixStreamServer):
    """The same on a unix socket (a pooled sandbox's server); a stale socket file is replaced."""

    def server_bind(self) -> None:
        if os.path.exists(self.server_address):
            os.unlink(self.server_address)
        super().server_bind()


class _FaultLink:
    """A loopback TCP relay between an exposed port's gate and the job's process (network_faults=True),
    where wire faults happen: a response held back then reset (stall), a response cut after a few bytes
    then reset, every WebSocket connection reset at once. One thread accepts; two relay each connection.

    Faults are armed per link and taken by the next HTTP response to start (the first bytes the job
    sends after a request on a connection that was not upgraded); a reset is a TCP RST (SO_LINGER 0)."""

    def __init__(self, host: str, listen_port: int, backend_port: int) -> None:
        bind_host = "127.0.0.1" if host == "localhost" else host
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self.backend = (bind_host, backend_port)
        self.backend_port = backend_port
        self._listener = socket.create_server((bind_host, listen_port), family=family, backlog=LISTEN_BACKLOG)
        self._listener.settimeout(LINK_POLL_S)
        self._lock = threading.Lock()
        self._armed: List[Tuple[str, float]] = []  # (kind, parameter), taken oldest first
        self._pairs: Dict[int, Dict[str, Any]] = {}  # id -> {"client", "backend", "upgraded", "awaiting"}
        self._threads: List[threading.Thread] = []
        self._stopped = threading.Event()

    def start(self) -> "_FaultLink":
        self._spawn(self._accept_loop, "accept")
        return self

    def arm(self, kind: str, count: int, parameter: float) -> None:
        with self._lock:
            self._armed.extend([(kind, parameter)] * count)

    def reset_tunnels(self) -> int:
        with self._lock:
            tunnels = [pair for pair in self._pairs.values() if pair["upgraded"]]
        for pair in tunnels:
            self._reset(pair)
        return len(tunnels)

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            self._reset(pair)
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(LINK_POLL_S + 5.0)
        self._listener.close()

    def _spawn(self, target: Callable[..., None], what: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=f"fault-link:{self.backend_port}:{what}", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                backend = socket.create_connection(self.backend, timeout=5.0)
                backend.settimeout(None)
            except OSError:  # the job's process is not listening (yet): refuse like a closed port
                self._close(client, rst=True)
                continue
            for sock in (client, backend):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = {"client": client, "backend": backend, "upgraded": False, "awaiting": False, "closed": False}
            with self._lock:
                if self._stopped.is_set():
                    self._close(client, rst=True)
                    self._close(backend, rst=True)
                    return
                self._pairs[id(pair)] = pair
            self._spawn(self._relay_requests, "up", pair)
            self._spawn(self._relay_responses, "down", pair)

    def _relay_requests(self, pair: Dict[str, Any]) -> None:
        try:
            while True:
                data = pair["client"].recv(LINK_CHUNK)
                if not data:
                    break
                pair["awaiting"] = True  # the next bytes from the job start its answer
                pair["backend"].sendall(data)
        except OSError:
            pass
        self._reset(pair)

    def _relay_responses(self, pair: Dict[str, Any]) -> None:
        first = True
        try:
            while True:
                data = pair["backend"].recv(LINK_CHUNK)
                if not data:
                    break
                if first and data.startswith(b"HTTP/1.1 101"):
                    pair["upgraded"] = True
                first = False
                fault = None
                if pair["awaiting"] and not pair["upgraded"]:
                    pair["awaiting"] = False
                    fault = self._take()
                if fault is not None and fault[0] == "stall":
                    self._stopped.wait(fault[1])  # the request ran; its answer never comes in time
                    break
                if fault is not None and fault[0] == "reset":
                    pair["client"].sendall(data[:int(fault[1])])
                    break
                pair["client"].sendall(data)
        except OSError:
            pass
        self._reset(pair)

    def _take(self) -> Optional[Tuple[str, float]]:
        with self._lock:
            return self._armed.pop(0) if self._armed else None

    def _reset(self, pair: Dict[str, Any]) -> None:
        """End both sides of a connection with a TCP RST (idempotent; wakes both relay threads)."""
        with self._lock:
            if pair["closed"]:
                return
            pair["closed"] = True
            self._pairs.pop(id(pair), None)
        for sock in (pair["client"], pair["backend"]):
            self._close(sock, rst=True)

    @staticmethod
    def _close(sock: socket.socket, rst: bool) -> None:
        try:
            if rst:  # SHUT_RD wakes a thread blocked in recv without sending a FIN; close then sends RST
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RD if rst else socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


class _JobGate(AuthProxy):
    """One exposed port, like `https://<id>--<port>.hf.jobs`: 401 unless the bearer token can read the
    job's namespace (public ports skip the check), then HTTP and WebSocket go to the job's local port
    with `Authorization` consumed (the route injects no token). All of proxy.py's forwarding is reused."""

    def __init__(self, emulator: JobsEmulator, job: EmulatedJob, exposed_port: int, public: bool) -> None:
        super().__init__(host=emulator.host)
        local_host = "127.0.0.1" if emulator.host == "localhost" else emulator.host
        self.exposed_port = exposed_port
        self._emulator = emulator
        self._job = job
        self._public = public
        self.ended_status: Optional[int] = None  # set when the job has ended (JobsEmulator.ended_url_status)
        self._upstream = Route(f"http://{_url_host(local_host)}:{job.local_ports[exposed_port]}", None)
        # The proxy's log lines name a route by its label: say which job's port this is.
        self._upstream.label = f"job {job.id} port {exposed_port} ({self._upstream.label})"
        material = emulator._tls
        self._front = _TLSFront(material.server_context(), self) if material is not None else None

    def start(self) -> "_JobGate":
        super().start()
        if self._front is not None:
            try:
                self._front.start()
            except BaseException:
                super().stop()
                raise
        return self

    def stop(self) -> None:
        if self._front is not None:
            self._front.stop()
        super().stop()

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<port>`, or with tls `https://<job_id>--<port>.jobs.localhost:<port>`."""
        if self._front is None:
            return super().url
        return f"https://{self._job.id}--{self.exposed_port}.{TLS_HOST_SUFFIX}:{self._front.port}"

    def end(self, status: int) -> None:
        """The job has ended: cut what is open to it (requests, WebSocket sessions), answer `status` from now on."""
        self.ended_status = status
        self._upstream.close()

    def route_request(self, target: str, headers: Any) -> Any:
        if self.ended_status is not None:
            return Refusal(self.ended_status, "job-ended", f"Job {self._job.id} is not running", proxy_error=False)
        reason = None if self._public else self._emulator._gate_rejection(self._job, headers.get("Authorization"))
        if reason:
            return Refusal(401, "unauthorized", reason, (("WWW-Authenticate", 'Bearer realm="hf.jobs"'),),
                           proxy_error=False)  # the real *.hf.jobs 401 carries no proxy header
        return self._upstream, target


class _TLSMaterial:
    """A throwaway CA and a `*.<suffix>` server certificate (PEM files in a temporary directory), made
    with `cryptography` (a test dependency: the emulator's TLS mode is for tests and benchmarks)."""

    def __init__(self, suffix: str) -> None:
        reason = tls_rejection()
        if reason:
            raise RuntimeError(f"JobsEmulator(tls=True): {reason}")
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
        self.directory = tempfile.mkdtemp(prefix="hf-jobs-emulator-tls-")
        now = datetime.datetime.now(datetime.timezone.utc)
        lifetime = (now - datetime.timedelta(days=1), now + datetime.timedelta(days=2))
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hf_jobs_emulator test CA")])
        ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(lifetime[0]).not_valid_after(lifetime[1])
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .sign(ca_key, hashes.SHA256()))
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "*." + suffix)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(lifetime[0]).not_valid_after(lifetime[1])
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("*." + suffix)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(ca_key, hashes.SHA256()))
        self.ca_path = os.path.join(self.directory, "ca.pem")
        self.cert_path = os.path.join(self.directory, "server.pem")
        self.key_path = os.path.join(self.directory, "server.key")
        for path, data in ((self.ca_path, ca_cert.public_bytes(serialization.Encoding.PEM)),
                           (self.cert_path, cert.public_bytes(serialization.Encoding.PEM)),
                           (self.key_path, key.private_bytes(serialization.Encoding.PEM,
                                                             serialization.PrivateFormat.PKCS8,
                                                             serialization.NoEncryption()))):
            with open(path, "wb") as fh:
                fh.write(data)
        self._context: Optional[ssl.SSLContext] = None

    def server_context(self) -> ssl.SSLContext:
        if self._context is None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(self.cert_path, self.key_path)
            # No TLS 1.3 session tickets. They arrive just after the handshake, while a client like the
            # `websockets` sync one reads its SSL socket in one thread (select, then a blocking recv)
            # and writes its upgrade request in another; OpenSSL forbids that, and about one
            # connection in ten (more under load) lost the request (the client waited for an answer
            # that never came), raised `SSLError: internal error`, or crashed. With nothing to read
            # before the answer, the reader sleeps in select() until the request has been written.
            context.num_tickets = 0
            self._context = context
        return self._context

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class _LoopbackNames:
    """Resolve `<anything>.<suffix>` to 127.0.0.1 in this process while a TLS emulator runs (RFC 6761:
    names under `localhost` are loopback), by wrapping `socket.getaddrinfo`; every other name goes to the
    system resolver unchanged. Installed with the first suffix, removed with the last."""

    _lock = threading.Lock()
    _suffixes: Dict[str, int] = {}
    _original: Optional[Callable[..., Any]] = None

    @classmethod
    def add(cls, suffix: str) -> None:
        with cls._lock:
            cls._suffixes[suffix] = cls._suffixes.get(suffix, 0) + 1
            if cls._original is None:
                cls._original = socket.getaddrinfo
                socket.getaddrinfo = cls._getaddrinfo  # type: ignore[assignment]

    @classmethod
    def remove(cls, suffix: str) -> None:
        with cls._lock:
            left = cls._suffixes.get(suffix, 0) - 1
            if left > 0:
                cls._suffixes[suffix] = left
            else:
                cls._suffixes.pop(suffix, None)
            if not cls._suffixes and cls._original is not None:
                socket.getaddrinfo = cls._original  # type: ignore[assignment]
                cls._original = None

    @classmethod
    def _getaddrinfo(cls, host: Any, *args: Any, **kwargs: Any) -> Any:
        original = cls._original or socket.getaddrinfo
        name = host.decode("idna") if isinstance(host, bytes) else host
        if isinstance(name, str) and any(name.lower().endswith("." + suffix) for suffix in list(cls._suffixes)):
            host = "127.0.0.1"
        return original(host, *args, **kwargs)


class _TLSFront:
    """The https side of one exposed port: accepts TLS connections and relays each, decrypted, to the
    gate's plain loopback listener. One thread per connection moves bytes both ways with select(), so
    no two threads ever use one TLS object (OpenSSL forbids it)."""

    def __init__(self, context: ssl.SSLContext, gate: AuthProxy) -> None:
        self._context, self._gate = context, gate
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(LISTEN_BACKLOG)
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._conns: List[socket.socket] = []
        self._threads: List[threading.Thread] = []
        self._stopping = False
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"tls-front:{self.port}", daemon=True)

    def start(self) -> None:
        self._acceptor.start()

    def stop(self) -> None:
        with self._lock:
            if self._stopping:  # a job's gates are stopped when it ends and again by the emulator's stop()
                return
            self._stopping = True
            conns, threads = list(self._conns), list(self._threads)
        self._wake_w.send(b"x")
        self._acceptor.join(5.0)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(5.0)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def _accept_loop(self) -> None:
        while True:
            readable, _, _ = select.select([self._listener, self._wake_r], [], [])
            if self._wake_r in readable:
                return
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            with self._lock:
                if self._stopping:
                    client.close()
                    return
                self._conns.append(client)
                thread = threading.Thread(target=self._relay, args=(client,), name="tls-front-conn", daemon=True)
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _relay(self, raw: socket.socket) -> None:
        plain: Optional[socket.socket] = None
        tls: Optional[ssl.SSLSocket] = None
        try:
            raw.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
            tls = self._context.wrap_socket(raw, server_side=True)
            with self._lock:
                self._conns.append(tls)  # wrap_socket detached `raw`: stop() must shut this one
            plain = socket.create_connection(("127.0.0.1", self._gate.port), timeout=TLS_HANDSHAKE_TIMEOUT_S)
            plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls.settimeout(None)
            plain.settimeout(None)
            while True:
                readable = [tls] if tls.pending() else select.select([tls, plain], [], [])[0]
                if tls in readable:
                    data = tls.recv(65536)
                    if not data:
                        return
                    plain.sendall(data)
                if plain in readable:
                    data = plain.recv(65536)
                    if not data:
                        return
                    tls.sendall(data)
        except (OSError, ValueError):
            return  # a failed handshake, a reset, or stop(): the connection just ends
        finally:
            for sock in (plain, tls, raw):
                if sock is not None:
                    sock.close()
            with self._lock:
                self._conns = [c for c in self._conns if c is not raw and c is not tls]


class _QuietHandler(BaseHTTPRequestHandler):
    """Shared HTTP plumbing: HTTP/1.1 keep-alive, bounded bodies, JSON answers, no stderr logging."""

    protocol_version = "HTTP/1.1"
    timeout = IDLE_CONNECTION_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        # Headers and body leave in two writes; with Nagle on, the body waits for the peer's delayed
        # ACK of the headers (40 ms on Linux), which made every echo-server answer cost 40 ms.
        if self.connection.family != getattr(socket, "AF_UNIX", None):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def address_string(self) -> str:
        return str(self.client_address[0]) if self.client_address else "unix"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # request lines may carry job ids only, but tests and benchmarks want a quiet stderr

    def read_body(self, limit: int = MAX_BODY_BYTES) -> bytes:
        """The request body (Content-Length or chunked); _ApiError 413 when it is over `limit` bytes, 400 when its
        framing is malformed (either way the connection closes after the answer: the rest cannot be parsed)."""
        try:
            return self._read_body(limit)
        except _ApiError:
            self.close_connection = True
            raise

    def _read_body(self, limit: int) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks, total = [], 0
            while True:
                size = _framing_number(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16, "chunk size")
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                total += size
                if total > limit:
                    raise _ApiError(413, f"request body larger than {limit} bytes")
                chunks.append(self.rfile.read(size))
                self.rfile.readline(1024)
        header = self.headers.get("Content-Length")
        length = 0 if header is None else _framing_number(header, 10, "Content-Length header")
        if length > limit:
            raise _ApiError(413, f"request body larger than {limit} bytes")
        return self.rfile.read(length) if length > 0 else b""

    def send_json(self, status: int, payload: Any, headers: Optional[Mapping[str, str]] = None) -> None:
        body = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class _ApiHandler(_QuietHandler):
    """The HF Jobs REST API: routing and HTTP framing only; the rules live in JobsEmulator."""

    emulator: JobsEmulator
    server_version = "hf-jobs-emulator"

    def do_GET(self) -> None:
        self._dispatch()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_GET

    def _dispatch(self) -> None:
        self.request_id = uuid.uuid4().hex
        self.limit_headers: Dict[str, str] = {}  # the user's RateLimit headers, sent on every answer
        try:
            self._handle()
        except _ApiError as exc:
            self._send_error(exc.status, exc.message, exc.headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # a bug must still answer, never hang the client
            self._send_error(500, f"emulator error: {exc!r}")

    def _handle(self) -> None:
        emu = self.emulator
        target = urlsplit(self.path)
        body = self.read_body()
        try:
            route, params = _match_api_route(self.command, unquote(target.path))
        except _ApiError:
            emu._count("unknown")
            raise
        emu._count(route)
        user = emu._authenticate(self.headers.get("Authorization"))
        if user is None:
            raise _ApiError(401, "Invalid credentials in Authorization header: send "
                                 "'Authorization: Bearer <token>' with this emulator's token")
        namespace = params.get("namespace")
        if namespace is not None:
            reason = emu._namespace_access_rejection(user, namespace)
            if reason:
                raise _ApiError(403, reason)
        retry_after = emu._take_rate_limit(route)  # before the count: a refused call uses no unit of the window
        if retry_after is not None:
            quota, window = emu.rate_limit or (1000, 300)  # the real window's policy; else the free tier's
            raise _ApiError(429, "You have exceeded the rate limit of the Jobs API (injected by the emulator). "
                                 f"Retry after {retry_after} seconds.",
                            {"Retry-After": str(retry_after), "RateLimit": f'"api";r=0;t={retry_after}',
                             "RateLimit-Policy": f'"fixed window";"api";q={quota};w={int(window)}'})
        wait, self.limit_headers = emu._admit(user, route)
        if wait is not None:
            raise _ApiError(429, f"You have exceeded the rate limit of the Hub's API for user '{user}' "
                                 f"({emu.rate_limit[0]} calls per {emu.rate_limit[1]:g}s, whoami less). "
                                 f"Retry after {wait} seconds.", {"Retry-After": str(wait)})
        server_error = emu._take_server_error(route)
        if server_error is not None:
            raise _ApiError(server_error, "Internal error (injected by the emulator); retry later")
        if route == "whoami":
            self._ok(emu._whoami(user))
        elif route == "hardware":
            self._ok(_hardware_list(emu.flavors))
        elif route == "create":
            self._create(user, namespace, lambda: _json_body(body))
        elif route == "duplicate":  # HfApi.rerun_job: a create from the stored spec, answered as one
            original = emu._find_job(namespace, params["job_id"])
            self._create(user, namespace, lambda: emu._rerun_body(original))
        elif route == "list":
            self._list_page(namespace, parse_qsl(target.query, keep_blank_values=True))
        elif route == "inspect":
            self._ok(emu._job_json(emu._find_job(namespace, params["job_id"])))
        elif route == "cancel":
            job = emu._find_job(namespace, params["job_id"])
            emu._cancel(job)
            self._ok(emu._job_json(job))
        elif route == "logs":
            self._stream_logs(emu._find_job(namespace, params["job_id"]), target.query)
        elif route == "labels":
            job = emu._find_job(namespace, params["job_id"])
            emu._update_labels(job, _json_body(body))
            self._ok(emu._job_json(job))
        elif route == "expose":
            job = emu._find_job(namespace, params["job_id"])
            emu._update_expose(job, _json_body(body))
            self._ok(emu._job_json(job))
        elif route == "metrics":
            self._stream_metrics(emu._find_job(namespace, params["job_id"]))

    def _create(self, user: str, namespace: str, create_body: Callable[[], Any]) -> None:
        """A create (or a rerun, whose body is a stored spec): the create faults apply to both."""
        emu = self.emulator
        with emu._changed:
            late = emu._late_creates.take("create")
        if late is not None:  # answered now; the job is made on this thread once the delay passed
            self.close_connection = True
            self._send_error(504, "Gateway Timeout (injected by the emulator)", {"Connection": "close"})
            with emu._changed:
                emu._changed.wait_for(lambda: emu._stopping, late)
            with contextlib.suppress(_ApiError):  # (the emulator stopped meanwhile)
                emu._create(user, namespace, create_body())
            return
        job, lose_answer = self.emulator._create(user, namespace, create_body())
        self.emulator._hold_create_answer()
        if lose_answer:  # the job exists, but the client never learns it
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self._ok(self.emulator._job_json(job))

    def _list_page(self, namespace: str, query: List[Tuple[str, str]]) -> None:
        """The listing, one page of `list_page_size` jobs at a time when set, the next page linked by an
        `cursor=<offset>` query (the Hub's cursor format is its own; only the Link header is the contract)."""
        emu = self.emulator
        filters = [(key, value) for key, value in query if key != "cursor"]
        jobs = emu._list(namespace, filters)
        if emu.list_page_size is None:
            return self._ok(jobs)
        cursor = dict(query).get("cursor", "0")
        if not cursor.isdigit():
            raise _ApiError(400, f"query parameter 'cursor' must be a whole number, got {cursor!r}")
        start, end = int(cursor), int(cursor) + emu.list_page_size
        headers = {"X-Request-Id": self.request_id, **self.limit_headers}
        if end < len(jobs):
            base = emu.next_link_base or emu.endpoint
            headers["Link"] = '<%s/api/jobs/%s?%s>; rel="next"' % (base, namespace,
                                                                   urlencode(filters + [("cursor", str(end))]))
        self.send_json(200, jobs[start:end], headers)

    def _start_event_stream(self) -> None:
        """The head of a server-sent events answer (logs, metrics): it ends when the connection closes."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.send_header("X-Request-Id", self.request_id)
        for name, value in self.limit_headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.close_connection = True

    def _stream_metrics(self, job: EmulatedJob) -> None:
        """Server-sent `event: metric` once a second while the job runs (the shape huggingface_hub documents);
        406 once it has ended, as the Hub answers. CPU and memory are the job process's own."""
        emu = self.emulator
        if job.terminal:
            raise _ApiError(406, f"Job {job.id} has finished: no live metrics")
        self._start_event_stream()
        replica = job.id[-5:]
        previous = _process_cpu_seconds(job.pid), time.monotonic()
        while not job.terminal and not emu._stopping:
            due = time.monotonic() + METRICS_INTERVAL_S  # one sample per interval: other jobs' notifies wake too
            with emu._changed:
                while not job.terminal and not emu._stopping and (left := due - time.monotonic()) > 0:
                    emu._changed.wait(left)
            cpu, now = _process_cpu_seconds(job.pid), time.monotonic()
            busy = max(0.0, cpu - previous[0]) / max(1e-6, now - previous[1])
            previous = cpu, now
            sample = {"cpu_usage_pct": round(100.0 * busy, 1), "cpu_millicores": int(1000 * busy),
                      "memory_used_bytes": _process_rss_bytes(job.pid),
                      "memory_total_bytes": METRICS_MEMORY_TOTAL_BYTES, "rx_bps": 0, "tx_bps": 0, "gpus": {},
                      "replica": replica}
            self.wfile.write(b"event: metric\ndata: " + json.dumps(sample).encode("utf-8") + b"\n\n")
            self.wfile.flush()

    def _stream_logs(self, job: EmulatedJob, query: str) -> None:
        """Server-sent events, one `data: {"data": line, "timestamp": ...}` per line, live until the
        job ends (as the real endpoint does); `tail=N` starts from the last N lines."""
        emu = self.emulator
        tail_text = dict(parse_qsl(query)).get("tail")
        if tail_text is not None and not tail_text.isdigit():
            raise _ApiError(400, f"query parameter 'tail' must be a whole number, got {tail_text!r}")
        self._start_event_stream()
        with emu._lock:
            index = max(0, len(job.logs) - int(tail_text)) if tail_text is not None else 0
        while True:
            with emu._changed:
                waited_since = time.monotonic()
                while (index == len(job.logs) and not job.terminal and not emu._stopping
                       and time.monotonic() - waited_since < LOG_KEEPALIVE_S):
                    emu._changed.wait(1.0)
                batch = job.logs[index:]
                index += len(batch)
                finished = job.terminal or emu._stopping
            if batch:
                self.wfile.write(b"".join(
                    b"data: " + json.dumps({"data": line, "timestamp": ts}).encode("utf-8") + b"\n\n"
                    for ts, line in batch))
            elif not finished:
                self.wfile.write(b": keep-alive\n\n")
            if finished:
                return

    def _ok(self, payload: Any) -> None:
        self.send_json(200, payload, {"X-Request-Id": self.request_id, **self.limit_headers})

    def _send_error(self, status: int, message: str, headers: Optional[Mapping[str, str]] = None) -> None:
        header_message = message.replace("\r", " ").replace("\n", " ").encode("latin-1", "replace").decode("latin-1")
        self.send_json(status, {"error": message}, {"X-Request-Id": self.request_id, "X-Error-Message": header_message,
                                                    **self.limit_headers, **(headers or {})})


def _match_api_route(method: str, path: str) -> Tuple[str, Dict[str, str]]:
    """(route name, path parameters) for an API request; _ApiError 404 / 405 naming what is wrong."""
    parts = [p for p in path.split("/") if p]
    routes: List[Tuple[str, str, Dict[str, str]]] = []  # (method, route, params) this path can take
    if parts == ["api", "whoami-v2"]:
        routes = [("GET", "whoami", {})]
    elif parts == ["api", "jobs", "hardware"]:  # the hardware list, not a namespace called "hardware"
        routes = [("GET", "hardware", {})]
    elif len(parts) == 3 and parts[:2] == ["api", "jobs"]:
        routes = [("GET", "list", {"namespace": parts[2]}), ("POST", "create", {"namespace": parts[2]})]
    elif len(parts) == 4 and parts[:2] == ["api", "jobs"]:
        routes = [("GET", "inspect", {"namespace": parts[2], "job_id": parts[3]})]
    elif len(parts) == 5 and parts[:2] == ["api", "jobs"] and parts[4] in JOB_SUBROUTES:
        routes = [(JOB_SUBROUTES[parts[4]], parts[4], {"namespace": parts[2], "job_id": parts[3]})]
    if parts[:2] == ["api", "scheduled-jobs"]:
        # Real Hub routes not emulated: a 404 here would read to huggingface_hub as JobNotFoundError ("check the
        # job id") for a scheduled job that may well exist on the Hub.
        raise _ApiError(501, f"Not implemented by hf_jobs_emulator: {method} {path!r} (huggingface_hub's "
                             "HfApi scheduled-job methods, create_scheduled_job, list_scheduled_jobs, "
                             "inspect_scheduled_job and the rest, are not emulated)")
    if not routes:
        raise _ApiError(404, f"Not found: no API route {path!r} (this emulator serves /api/whoami-v2, "
                             "/api/jobs/hardware and /api/jobs/{namespace}[/{job_id}[/cancel|/logs|/labels|/expose"
                             "|/metrics|/duplicate]])")
    for verb, route, params in routes:
        if verb == method or (verb == "GET" and method == "HEAD"):
            return route, params
    allowed = " or ".join(verb for verb, _, _ in routes)
    raise _ApiError(405, f"Method {method} not allowed on {path!r}; use {allowed}")


# ==================================================================================================
# Machinery: the echo server's protocol (no I/O) and its HTTP / WebSocket plumbing
# ==================================================================================================

_ECHO_METADATA = {
    "name": "EchoEnvironment",
    "description": "Echoes back every message; reward is 0.1 per character (hf_jobs_emulator).",
    "readme_content": None, "version": "1.0.0", "author": None, "documentation_url": None,
}
_ECHO_SCHEMA = {
    "action": {"title": "EchoAction", "type": "object", "additionalProperties": False,
               "properties": {"metadata": {"title": "Metadata", "type": "object"},
                              "message": {"title": "Message", "type": "string"}},
               "required": ["message"]},
    "observation": {"title": "EchoObservation", "type": "object", "additionalProperties": False,
                    "properties": {"done": {"title": "Done", "type": "boolean", "default": False},
                                   "reward": {"title": "Reward", "anyOf": [{"type": "boolean"}, {"type": "integer"},
                                                                           {"type": "number"}, {"type": "null"}]},
                                   "metadata": {"title": "Metadata", "type": "object"},
                                   "echoed_message": {"title": "Echoed Message", "type": "string"},
                                   "message_length": {"title": "Message Length", "type": "integer"}},
                    "required": ["echoed_message", "message_length"]},
    "state": {"title": "State", "type": "object", "additionalProperties": True,
              "properties": {"episode_id": {"title": "Episode Id", "anyOf": [{"type": "string"}, {"type": "null"}]},
                             "step_count": {"title": "Step Count", "type": "integer", "minimum": 0}}},
}
_ECHO_ROUTES = {"/health": "GET", "/metadata": "GET", "/schema": "GET", "/state": "GET",
                "/reset": "POST", "/step": "POST", "/ws": "GET"}


def _validation_error(kind: str, loc: Sequence[Any], msg: str, value: Any) -> Dict[str, Any]:
    """One error in pydantic's shape, as OpenEnv servers put them in a 422 `detail` list."""
    return {"type": kind, "loc": list(loc), "msg": msg, "input": value}


def _echo_action_errors(action: Any) -> List[Dict[str, Any]]:
    """Validation errors of an echo action (`{"message": str}`); empty when it is valid."""
    if not isinstance(action, dict):
        return [_validation_error("model_type", [], "Input should be an object", action)]
    errors = [_validation_error("extra_forbidden", [key], "Extra inputs are not permitted", action[key])
              for key in action if key not in ("message", "metadata")]
    if "message" not in action:
        errors.append(_validation_error("missing", ["message"], "Field required", action))
    elif not isinstance(action["message"], str):
        errors.append(_validation_error("string_type", ["message"], "Input should be a valid string",
                                        action["message"]))
    return errors


def _echo_reset_errors(options: Any) -> List[Dict[str, Any]]:
    if not isinstance(options, dict):
        return [_validation_error("model_type", ["body"], "Input should be an object", options)]
    errors = []
    seed, episode = options.get("seed"), options.get("episode_id")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        errors.append(_validation_error("int_type", ["body", "seed"], "Input should be an integer >= 0", seed))
    if episode is not None and (not isinstance(episode, str) or len(episode) > 255):
        errors.append(_validation_error("string_type", ["body", "episode_id"],
                                        "Input should be a string of at most 255 characters", episode))
    return errors


def _echo_http_answer(server: EchoServer, method: str, path: str, body: bytes) -> Tuple[int, Any]:
    """(status, JSON payload) of one echo HTTP request, FastAPI-style errors included."""
    expected = _ECHO_ROUTES.get(path)
    if expected is None:
        return 404, {"detail": "Not Found"}
    if method != expected and not (method == "HEAD" and expected == "GET"):
        return 405, {"detail": "Method Not Allowed"}
    if path == "/health":
        return 200, {"status": "healthy"}
    if path == "/metadata":
        return 200, dict(_ECHO_METADATA)
    if path == "/schema":
        return 200, _ECHO_SCHEMA
    if path == "/state":
        with server.http_lock:
            return 200, server.http_env.state()
    if path == "/ws":
        return 400, {"detail": "WebSocket endpoint: connect with an Upgrade: websocket request"}
    try:
        request = json.loads(body.decode("utf-8")) if body.strip() else {}
    except (UnicodeDecodeError, ValueError) as exc:
        return 422, {"detail": [_validation_error("json_invalid", ["body"], f"JSON decode error: {exc}", None)]}
    if path == "/reset":
        errors = _echo_reset_errors(request)
        if errors:
            return 422, {"detail": errors}
        with server.http_lock:
            return 200, server.http_env.reset(request.get("seed"), request.get("episode_id"))
    # /step
    if not isinstance(request, dict) or "action" not in request:
        return 422, {"detail": [_validation_error("missing", ["body", "action"], "Field required", request)]}
    errors = _echo_action_errors(request["action"])
    if errors:
        return 422, {"detail": errors}
    if server.step_delay_s:
        time.sleep(server.step_delay_s)
    with server.http_lock:
        return 200, server.http_env.step(request["action"]["message"])


def _echo_ws_reply(env: EchoEnvironment, text: str, step_delay_s: float = 0.0) -> Optional[Dict[str, Any]]:
    """The reply to one OpenEnv WebSocket message, or None when the client asked to close."""
    try:
        message = json.loads(text)
    except ValueError as exc:
        return {"type": "error", "data": {"message": f"Invalid JSON: {exc}", "code": "INVALID_JSON"}}
    kind = message.get("type", "") if isinstance(message, dict) else ""
    data = message.get("data", {}) if isinstance(message, dict) else {}
    if kind == "close":
        return None
    if kind == "reset":
        errors = _echo_reset_errors(data)
        if errors:
            return {"type": "error", "data": {"message": "Invalid message", "code": "VALIDATION_ERROR",
                                              "errors": errors}}
        return {"type": "observation", "data": env.reset(data.get("seed"), data.get("episode_id"))}
    if kind == "step":
        errors = _echo_action_errors(data)
        if errors:
            return {"type": "error", "data": {"message": "Invalid message", "code": "VALIDATION_ERROR",
                                              "errors": errors}}
        if step_delay_s:
            time.sleep(step_delay_s)
        return {"type": "observation", "data": env.step(data["message"])}
    if kind == "state":
        return {"type": "state", "data": env.state()}
    return {"type": "error", "data": {"message": f"Unknown message type: {kind}", "code": "UNKNOWN_TYPE"}}


class _EchoHandler(_QuietHandler):
    server_ref: EchoServer
    server_version = "openenv-echo"

    def do_GET(self) -> None:
        if (self.command == "GET" and urlsplit(self.path).path == "/ws"
                and "websocket" in self.headers.get("Upgrade", "").lower()):
            _serve_echo_websocket(self, self.server_ref)
            return
        self._answer()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_GET

    def _answer(self) -> None:
        try:
            body = self.read_body()
        except _ApiError as exc:
            self.send_json(exc.status, {"detail": exc.message})
            return
        status, payload = _echo_http_answer(self.server_ref, self.command, urlsplit(self.path).path, body)
        self.send_json(status, payload)


def _serve_echo_websocket(handler: BaseHTTPRequestHandler, server: EchoServer) -> None:
    """Take the socket over after the upgrade request and run one OpenEnv session on it (wsproto)."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Ping, RejectConnection,
                                Request, TextMessage)
    from wsproto.extensions import PerMessageDeflate
    from wsproto.utilities import RemoteProtocolError

    handler.close_connection = True
    sock = handler.connection
    sock.settimeout(None)  # sessions idle between steps for as long as the trainer likes
    ws = WSConnection(ConnectionType.SERVER)
    head = handler.requestline + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in handler.headers.items()) + "\r\n"
    env = EchoEnvironment()
    parts: List[str] = []
    size = 0
    try:
        ws.receive_data(head.encode("latin-1"))
        data = b""
        while True:
            for event in ws.events():
                if isinstance(event, Request):
                    sock.sendall(ws.send(AcceptConnection(extensions=[PerMessageDeflate()])))
                elif isinstance(event, TextMessage):
                    parts.append(event.data)
                    size += len(event.data)
                    if size > ECHO_MAX_MESSAGE_BYTES:
                        sock.sendall(ws.send(CloseConnection(code=1009, reason="message too big")))
                        return
                    if not event.message_finished:
                        continue
                    text, parts, size = "".join(parts), [], 0
                    reply = _echo_ws_reply(env, text, server.step_delay_s)
                    if reply is None:
                        sock.sendall(ws.send(CloseConnection(code=1000)))
                        return
                    sock.sendall(ws.send(TextMessage(data=json.dumps(reply))))
                elif isinstance(event, BytesMessage):
                    if event.message_finished:
                        error = {"type": "error", "data": {"message": "binary frames are not supported; "
                                                                      "send JSON text", "code": "INVALID_JSON"}}
                        sock.sendall(ws.send(TextMessage(data=json.dumps(error))))
                elif isinstance(event, Ping):
                    sock.sendall(ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    sock.sendall(ws.send(event.response()))
                    return
            data = handler.rfile.read1(65536)
            if not data:
                return
            ws.receive_data(data)
    except RemoteProtocolError as exc:
        try:
            if exc.event_hint is not None and isinstance(exc.event_hint, RejectConnection):
                sock.sendall(ws.send(exc.event_hint))
        except Exception:
            pass
    except OSError:
        pass  # the client (or stop()) closed the socket


# ==================================================================================================
# CLI
# ==================================================================================================


def _parse_rate_limit(text: str) -> Tuple[int, float]:
    calls, _, window = text.partition("/")
    try:
        limit = (int(calls), float(window or HUB_RATE_LIMIT_WINDOW_S))
    except ValueError:
        limit = None
    reason = _rate_limit_rejection(limit) if limit is not None else "not CALLS/SECONDS"
    if reason:
        raise argparse.ArgumentTypeError(f"--rate-limit {text!r}: {reason}")
    return limit  # type: ignore[return-value]


def _parse_fault(text: str) -> Tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--fault takes KEY=VALUE, got {text!r}; keys: {', '.join(FAULT_KEYS)}")
    return key.strip(), value.strip()


def _echo_port_default() -> int:
    text = os.environ.get("PORT", "")
    return int(text) if text.isdigit() else ECHO_DEFAULT_PORT


def _step_delay_default() -> float:
    text = os.environ.get(ECHO_STEP_DELAY_ENV, "")
    try:
        return float(text) if text else 0.0
    except ValueError:
        raise SystemExit(f"{ECHO_STEP_DELAY_ENV}={text!r} is not a number of seconds")


def _run_until_signal(stop: Callable[[], Any], announce: Callable[[], None] = lambda: None) -> Any:
    """Block the main thread until SIGINT / SIGTERM, then call `stop` (so nothing is left running).
    `announce` runs once the handlers are in place, so a caller that reads it may signal at once."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        announce()
        while not done.wait(0.5):
            pass
    finally:
        result = stop()
    return result


def _run_echo_server(host: str = "127.0.0.1", port: Optional[int] = None,
                     step_delay_s: Optional[float] = None,
                     unix_socket: Optional[str] = None) -> int:
    """`echo-server`: serve the echo environment until SIGINT / SIGTERM (port default $PORT), on
    `unix_socket`, or on `$SBX_PROXY_DIR/<port>.sock` when run in a pooled sandbox."""
    port = port if port is not None else _echo_port_default()
    delay = step_delay_s if step_delay_s is not None else _step_delay_default()
    proxy_dir = os.environ.get(SANDBOX_PROXY_DIR_ENV)
    if unix_socket is None and proxy_dir:
        unix_socket = os.path.join(proxy_dir, f"{port}.sock")
    try:
        server = EchoServer(host, port, delay, unix_socket=unix_socket)
    except (ValueError, OSError) as exc:
        where = unix_socket or f"{host}:{port}"
        print(f"echo-server: cannot listen on {where}: {exc}", file=sys.stderr)
        return 2
    server.start()
    print(f"echo-server: OpenEnv echo environment listening on {server.url}", flush=True)
    _run_until_signal(server.stop)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`serve` runs the emulator standalone; `echo-server` runs the echo environment on $PORT."""
    parser = argparse.ArgumentParser(prog="python -m hf_jobs_emulator", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HF Jobs emulator and print its endpoint and token")
    serve.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="API port (default: a free one)")
    serve.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="user name of the token")
    serve.add_argument("--token", default=None, help="bearer token to accept (default: generated)")
    serve.add_argument("--scheduling-delay-s", type=float, default=0.0, help="seconds each job spends SCHEDULING")
    serve.add_argument("--fault", action="append", type=_parse_fault, default=[], metavar="KEY=VALUE",
                       help=f"fault applied to every job; keys: {', '.join(FAULT_KEYS)}")
    serve.add_argument("--rate-limit", type=_parse_rate_limit, default=None, metavar="CALLS/SECONDS",
                       help="per-user API limit in fixed windows, as on the Hub (e.g. 1000/300); default none")
    serve.add_argument("--tls", action="store_true",
                       help="serve exposed ports as https://<job>--<port>.jobs.localhost (prints the CA to trust)")
    serve.add_argument("--sandbox-host-boot-s", type=float, default=SANDBOX_HOST_BOOT_S,
                       help=f"extra seconds a sandbox host job spends SCHEDULING (default {SANDBOX_HOST_BOOT_S:g})")
    serve.add_argument("--sandbox-host-ready-s", type=float, default=SANDBOX_HOST_READY_S,
                       help=f"seconds from RUNNING until a sandbox host answers (default {SANDBOX_HOST_READY_S:g})")
    serve.add_argument("--sandbox-create-s", type=float, default=SANDBOX_CREATE_S,
                       help=f"seconds each sandbox create takes on a warm host (default {SANDBOX_CREATE_S:g})")
    serve.add_argument("--sandbox-capacity", type=int, default=None,
                       help="sandboxes per host, overriding the pool's SBX_CAPACITY")
    serve.add_argument("--sandbox-idle-timeout-s", type=float, default=None,
                       help="idle seconds before any sandbox is evicted, overriding what each create asks")
    serve.add_argument("--json", action="store_true", help="print endpoint and token as one JSON line")
    echo = commands.add_parser("echo-server", help="run the OpenEnv-compatible echo environment")
    echo.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    echo.add_argument("--port", type=int, default=None,
                      help=f"port (default $PORT or {ECHO_DEFAULT_PORT}); in a pooled sandbox, "
                           "the socket $SBX_PROXY_DIR/<port>.sock")
    echo.add_argument("--unix-socket", default=None, metavar="PATH",
                      help="serve on this unix socket instead")
    echo.add_argument("--step-delay-s", type=float, default=None,
                      help=f"seconds to sleep in every step (default ${ECHO_STEP_DELAY_ENV} or 0)")
    zygote = commands.add_parser("zygote", help=argparse.SUPPRESS)  # internal: started by JobsEmulator
    zygote.add_argument("fd", type=int)
    args = parser.parse_args(argv)

    if args.command == "zygote":
        return _zygote_main(args.fd)
    if args.command == "echo-server":
        return _run_echo_server(args.host, args.port, args.step_delay_s, args.unix_socket)

    # Job activity (created, running, ready, ended) and the gates' proxy lines, each with its time.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("proxy").setLevel(logging.WARNING)  # the gates' problems, not their starts
    try:
        emulator = JobsEmulator(args.token, args.namespace, args.host, args.port, args.scheduling_delay_s,
                                faults=dict(args.fault), rate_limit=args.rate_limit, tls=args.tls,
                                sandbox_host_boot_s=args.sandbox_host_boot_s,
                                sandbox_host_ready_s=args.sandbox_host_ready_s,
                                sandbox_create_s=args.sandbox_create_s, sandbox_capacity=args.sandbox_capacity,
                                sandbox_idle_timeout_s=args.sandbox_idle_timeout_s)
        emulator.start()
    except (ValueError, OSError) as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    def announce() -> None:
        if args.json:
            print(json.dumps({"endpoint": emulator.endpoint, "token": emulator.token,
                              "namespace": emulator.namespace, "ca_path": emulator.ca_path}), flush=True)
            return
        print(f"HF Jobs emulator listening on {emulator.endpoint} (namespace {emulator.namespace})", flush=True)
        print(f"HF_ENDPOINT={emulator.endpoint}", flush=True)
        print(f"HF_TOKEN={emulator.token}", flush=True)
        if emulator.ca_path:
            print(f"SSL_CERT_FILE={emulator.ca_path}", flush=True)
        print("Ctrl-C stops it and every job it runs.", flush=True)

    leftovers = _run_until_signal(emulator.stop, announce)
    if leftovers:
        print(f"serve: could not clean up: {', '.join(leftovers)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
