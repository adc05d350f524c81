"""The sandbox server (`sbx-server`) that huggingface_hub's `Sandbox`/`SandboxPool` drive, emulated.

A sandbox host is an HF Job running huggingface_hub's bootstrap script, which downloads `sbx-server`
and serves it on exposed port 49983. `hf_jobs_emulator` cannot download that binary, so when a job is
such a bootstrap it runs this module's `SandboxHost` on the job's port instead: the protocol (version
3) that huggingface_hub's own client code speaks, read from its `_sandbox.py`: `/health`, sandbox
create/list/delete with server-authoritative capacity, each sandbox's capability token, foreground
`exec` (NDJSON), background processes (list, kill), files, idle eviction, and `proxy/<port>/...`
forwarding HTTP and WebSocket upgrades to the unix socket `$SBX_PROXY_DIR/<port>.sock`.

Each sandbox is a private directory (its home, and the `SBX_PROXY_DIR` its servers bind in) and the
local process groups started in it. Where this differs from the real server: no uid or Landlock
isolation (sandboxes are processes of the emulator's user), no resource limits, and the details the
client does not reveal are this module's choices (see docs/emulator.md, "Sandbox server").

Standard library and hf_jobs_emulator's pieces only; `hf_jobs_emulator` creates one `SandboxHosts` per
emulator and asks it to run each host job.
"""

from __future__ import annotations

import codecs
import hmac
import http.client
import json
import logging
import os
import posixpath
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import stat as stat_mod
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

if __package__:  # vendored inside a package
    from . import hf_jobs_emulator as _jobs
else:
    import hf_jobs_emulator as _jobs

log = logging.getLogger("hf_sbx_emulator")

# The port huggingface_hub's bootstrap exposes, and the wire contract its client checks in `/health`.
SANDBOX_SERVER_PORT = 49983
SANDBOX_SERVER_PROTOCOL = 3
# What `/health` reports as the server's version: the sbx-server release huggingface_hub 2.4.0 pins,
# marked as emulated so nobody mistakes it for the real binary.
EMULATED_SERVER_VERSION = "0.7.0+hf-jobs-emulator"
# The labels and environment huggingface_hub gives a sandbox job (its `_sandbox.py` constants).
SANDBOX_LABEL = "hf-sandbox"
TOKEN_ENV = "SBX_TOKEN"
HOST_MODE_ENV = "SBX_HOST_MODE"
CAPACITY_ENV = "SBX_CAPACITY"
IDLE_ENV = "SBX_IDLE_TIMEOUT"
PROXY_DIR_ENV = "SBX_PROXY_DIR"
TOKEN_HEADER = "X-Sandbox-Token"
# The emulator's own mark on every process a sandbox starts (the real server isolates a sandbox in its own
# uid and Landlock domain; the emulator finds what a sandbox left behind by this inherited variable).
SANDBOX_MARK_ENV = "HF_SBX_EMULATOR_SANDBOX"
# Sandboxes per host when neither the emulator nor the job's SBX_CAPACITY says (huggingface_hub's default).
DEFAULT_CAPACITY = 50
# The client reads an exec stream with a 70 s timeout and expects a ping every 15 s.
EXEC_PING_S = 15.0
# After an exec'd command exits, output still in its pipes is sent for this long; descendants that keep
# the pipes open are not waited for (they are killed with the command's process group).
EXEC_DRAIN_S = 0.5
# Finished background processes a sandbox keeps listing (the real server keeps "a bounded number").
FINISHED_PROCESSES_KEPT = 100
# SIGTERM, then SIGKILL after this long, when a process, a sandbox or a host is stopped.
KILL_GRACE_S = 1.0
# A sandbox's processes lead their own process groups (a shell's children stay in them). If the emulator is
# killed outright (SIGKILL), no teardown runs: a reaper process, told each group as it starts and ends,
# SIGKILLs the groups still listed when its input pipe reaches end of file, which the kernel makes happen
# however the emulator ended. PR_SET_PDEATHSIG on each process would not do: it is not inherited by the
# shell's children (the server itself), it fires when the *thread* that forked ends (here a request
# handler), and setting it needs code between fork and exec (preexec_fn, unsafe with threads).
REAPER_SOURCE = """
import os, signal, sys
groups = set()
for line in sys.stdin.buffer:
    pgid = int(line[1:])
    (groups.add if line[:1] == b"+" else groups.discard)(pgid)
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""
# How often idle sandboxes (and an idle empty host) are looked for.
EVICTION_POLL_S = 0.1
# Largest request body buffered (file writes come in 1-2 MiB ranges; proxied bodies are small).
MAX_BODY_BYTES = 64 * 1024 * 1024
# Directory listings come in pages of this many entries (the client follows `next`).
LIST_PAGE = 1000
# Reads from a process pipe, a file or an upstream socket.
IO_CHUNK = 64 * 1024
# A proxied server that accepts but never answers is given this long.
UPSTREAM_TIMEOUT_S = 300.0
# Headers that describe one connection, not the message (RFC 9110 7.6.1), and the two credentials the
# host consumes: an app in a sandbox never sees the HF bearer or a sandbox token.
HOP_BY_HOP = frozenset(["connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"])
CONSUMED = frozenset(["authorization", TOKEN_HEADER.lower()])
# The one sandbox of a dedicated job (never in a pool's listing).
DEDICATED_ID = "dedicated"
# A unix socket's path holds at most 104 bytes on macOS (108 on Linux), and a sandbox's `<port>.sock` sits
# 39 bytes below the temporary directory (`/sbx-XXXXXXXX/<12 hex>/p/65535.sock`): a temporary directory
# longer than this (pytest-xdist's, some of macOS's /var/folders/...) is passed over for /tmp.
MAX_STATE_ROOT_CHARS = 48
# Sandbox and process ids: 12 hex digits, never containing huggingface_hub's shared-id separator ".".
_SANDBOX_ROUTE = re.compile(r"^/v1/sandboxes/([0-9a-f]{12})(/.*)?$")
_PROXY_ROUTE = re.compile(r"^/proxy/([0-9]{1,5})(/.*)?$")


# ==================================================================================================
# Public API
# ==================================================================================================


def is_sandbox_host_spec(spec: Mapping[str, Any]) -> bool:
    """Whether a job's create body is huggingface_hub's sandbox bootstrap (a host or dedicated sandbox)."""
    labels = spec.get("labels") or {}
    ports = (spec.get("expose") or {}).get("ports") or []
    command = list(spec.get("command") or [])
    return (labels.get(SANDBOX_LABEL) == "1" and SANDBOX_SERVER_PORT in ports
            and command[:2] == ["/bin/sh", "-c"] and "sbx-server" in " ".join(command[2:]))


class SandboxHosts:
    """The emulator's sandbox hosts: their settings, the running hosts, and their faults.

    `host_boot_s` is added to a host job's SCHEDULING time, `host_ready_s` passes between RUNNING and
    the server answering, `sandbox_create_s` is spent in every sandbox create. `capacity` (None: the
    job's SBX_CAPACITY, else 50) and `idle_timeout_s` (None: what each create asks) override the
    client's settings for every host. `strict_tokens=False` also accepts a host's token on its
    sandboxes' routes, as huggingface_hub 1.22-1.31 (before per-sandbox tokens) send it there.
    """

    def __init__(self, *, host_boot_s: float = _jobs.SANDBOX_HOST_BOOT_S,
                 host_ready_s: float = _jobs.SANDBOX_HOST_READY_S, sandbox_create_s: float = _jobs.SANDBOX_CREATE_S,
                 capacity: Optional[int] = None,
                 idle_timeout_s: Optional[float] = None, strict_tokens: bool = True) -> None:
        for name, value in (("sandbox_host_boot_s", host_boot_s), ("sandbox_host_ready_s", host_ready_s),
                            ("sandbox_create_s", sandbox_create_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"sandbox_capacity must be an int >= 1 (or None for the job's own), got {capacity!r}")
        if idle_timeout_s is not None and (isinstance(idle_timeout_s, bool)
                                           or not isinstance(idle_timeout_s, (int, float)) or idle_timeout_s < 0):
            raise ValueError(f"sandbox_idle_timeout_s must be seconds >= 0 (or None), got {idle_timeout_s!r}")
        self.host_boot_s = float(host_boot_s)
        self.host_ready_s = float(host_ready_s)
        self.sandbox_create_s = float(sandbox_create_s)
        self.capacity = capacity
        self.idle_timeout_s = None if idle_timeout_s is None else float(idle_timeout_s)
        self.strict_tokens = bool(strict_tokens)
        self._lock = threading.Lock()
        self._hosts: Dict[str, SandboxHost] = {}
        self._create_errors: List[Tuple[int, Optional[int]]] = []  # (status, Retry-After) per next create
        self.reaper: Optional[_Reaper] = None  # while any host runs (see REAPER_SOURCE)

    def host(self, job_id: str) -> "SandboxHost":
        """The running host of this job (KeyError naming it when there is none)."""
        with self._lock:
            if job_id not in self._hosts:
                raise KeyError(f"no sandbox host runs as job {job_id!r}")
            return self._hosts[job_id]

    @property
    def hosts(self) -> List["SandboxHost"]:
        with self._lock:
            return list(self._hosts.values())

    def live_pids(self) -> List[int]:
        """Process ids still running in any sandbox of any host (for leak checks)."""
        return [pid for host in self.hosts for pid in host.live_pids()]

    def inject_create_errors(self, calls: int, status: int = 503, retry_after_s: Optional[int] = None) -> None:
        """Answer the next `calls` sandbox creates (`POST /v1/sandboxes`, any host) with `status`."""
        if not isinstance(calls, int) or calls < 0:
            raise ValueError(f"calls must be an int >= 0, got {calls!r}")
        if not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(f"status must be an HTTP error status (400-599), got {status!r}")
        if retry_after_s is None and status == 429:
            retry_after_s = 1
        with self._lock:
            self._create_errors = [(status, retry_after_s)] * calls

    # -- used by hf_jobs_emulator -----------------------------------------------------------------

    def prepare(self, job: Any, env: Dict[str, str], bind: str, moved: Mapping[int, int],
                declared: Optional[Mapping[str, str]] = None) -> None:
        """A bootstrap job was created: make its host and listen on the job's local port (answering 503);
        `moved` maps a local port to the one its process must use instead (network fault links);
        `declared` is what the job itself set (environment and secrets), a dedicated sandbox's commands' env."""
        local = job.local_ports[SANDBOX_SERVER_PORT]
        with self._lock:
            if self.reaper is None:
                self.reaper = _Reaper()
            sbx = SandboxHost(self, job.id, env, bind, moved.get(local, local), declared)
            self._hosts[job.id] = sbx
        sbx.listen()

    def launch(self, job: Any) -> subprocess.Popen:
        """The bootstrap job runs: start its host; returns the job's process (see SandboxHost)."""
        return self.host(job.id).start()

    def release(self, job_id: str) -> None:
        """The host's job ended: stop its server and every sandbox process. Never raises."""
        with self._lock:
            sbx = self._hosts.pop(job_id, None)
        if sbx is not None:
            problems = sbx.stop()
            if problems:
                log.warning("sandbox host %s stopped but could not clean up: %s", job_id, ", ".join(problems))
        with self._lock:
            reaper = self.reaper if not self._hosts else None
            if reaper is not None:
                self.reaper = None
        if reaper is not None:
            reaper.close()  # every host ended its sandboxes: nothing is left for it to kill

    def _take_create_error(self) -> Optional[Tuple[int, Optional[int]]]:
        with self._lock:
            return self._create_errors.pop(0) if self._create_errors else None


class SandboxHost:
    """One emulated `sbx-server`: a loopback HTTP server on the job's port and its sandboxes.

    The job's process is a `cat` fed by the host: its output is the job log, it dies with the job
    (cancel, `kill_job`, timeout), and the host ends the job (COMPLETED) by closing its input when an
    empty pool host has been idle for SBX_IDLE_TIMEOUT. The server answers after `host_ready_s`.
    """

    def __init__(self, owner: SandboxHosts, job_id: str, env: Mapping[str, str], bind: str, port: int,
                 declared: Optional[Mapping[str, str]] = None) -> None:
        self.job_id = job_id
        self._owner = owner
        self._env = dict(env)  # the job's environment: the stub runs in it, as the real server would
        # What the job set itself (its environment and secrets; unknown: guessed from `env`).
        self._declared = dict(declared) if declared is not None else {
            k: v for k, v in self._env.items() if os.environ.get(k) != v}
        self._bind = bind
        self._port = port
        self._token = env.get(TOKEN_ENV, "")
        self.pool_mode = env.get(HOST_MODE_ENV) == "1"
        env_capacity = env.get(CAPACITY_ENV, "")
        self.capacity = owner.capacity or (int(env_capacity) if env_capacity.isdigit() and int(env_capacity) > 0
                                           else DEFAULT_CAPACITY)
        idle = env.get(IDLE_ENV, "")
        self.idle_timeout_s: Optional[float] = float(idle) if idle.isdigit() else None
        self._lock = threading.RLock()
        self._sandboxes: Dict[str, EmulatedSandbox] = {}
        self._state_dir = tempfile.mkdtemp(prefix="sbx-", dir=_state_root())
        self._stub: Optional[subprocess.Popen] = None
        self._stub_lock = threading.Lock()
        self._server: Optional[Any] = None
        self._serve_thread: Optional[threading.Thread] = None
        self._tunnels: set = set()  # upstream sockets of open proxy connections, closed on stop
        self._stopped = threading.Event()
        self._last_active = time.monotonic()
        self._ready_at = float("inf")  # until then every request answers 503 (the server is still starting)
        self._listen_error: Optional[str] = None
        self._janitor = threading.Thread(target=self._evict_idle, name=f"sbx-janitor:{job_id}", daemon=True)

    def listen(self) -> None:
        """Bind the job's port while the job is still scheduling: until `start()` and `host_ready_s`
        every request answers 503, as a job proxy does for a server that is not up (instead of the gate
        failing to connect, and logging it, on every poll of a booting host)."""
        handler = type("_BoundSbxHandler", (_SbxHandler,), {"host": self})
        try:
            self._server = _jobs._TrackingHTTPServer((self._bind, self._port), handler)
        except OSError as exc:
            self._listen_error = f"sbx-server: cannot listen on port {self._port}: {exc}"
            return
        self._serve_thread = threading.Thread(target=self._server.serve_forever, args=(_jobs.SERVE_POLL_S,),
                                              name=f"sbx-server:{self.job_id}", daemon=True)
        self._serve_thread.start()

    def start(self) -> subprocess.Popen:
        """The job runs: start its process (the stub) and become ready after `host_ready_s`."""
        self._stub = _jobs.spawn_process(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, env=self._env, start_new_session=True)
        failure = self._listen_error or (None if self._token else
                                         f"sbx-server: {TOKEN_ENV} is not set; refusing to serve without a credential")
        if failure:
            self.log(failure)
            self._end_job(failed=True)
            return self._stub
        self._ready_at = time.monotonic() + self._owner.host_ready_s
        self._last_active = self._ready_at
        self._janitor.start()
        mode = f"pool host, {self.capacity} sandboxes" if self.pool_mode else "dedicated sandbox"
        self.log(f"sbx-server {EMULATED_SERVER_VERSION} (protocol {SANDBOX_SERVER_PROTOCOL}, emulated): {mode}")
        return self._stub

    @property
    def ready(self) -> bool:
        """Whether the server answers yet (it listens from the start, like a job proxy that is up)."""
        return time.monotonic() >= self._ready_at

    def stop(self) -> List[str]:
        """Close the server, every connection and tunnel, end every sandbox; returns what is left."""
        with self._lock:  # (under the lock: a create either made its sandbox before, or sees the stop)
            self._stopped.set()
        problems: List[str] = []
        server = self._server
        if server is not None:
            server.shutdown()
            server.close_all_connections()
            server.server_close()
        with self._lock:
            tunnels, self._tunnels = list(self._tunnels), set()
            sandboxes, self._sandboxes = list(self._sandboxes.values()), {}
        for sock in tunnels:
            _close_socket(sock)
        problems.extend(_end_sandboxes(sandboxes))
        if self._janitor.ident is not None:
            self._janitor.join(5.0)
        if self._serve_thread is not None:
            self._serve_thread.join(5.0)
            if self._serve_thread.is_alive():
                problems.append("server thread")
        with self._stub_lock:  # the job's supervisor reaped the stub and closed its output; its input is ours
            if self._stub is not None and self._stub.stdin is not None:
                try:
                    self._stub.stdin.close()
                except OSError:
                    pass
        shutil.rmtree(self._state_dir, ignore_errors=True)
        return problems

    @property
    def sandbox_ids(self) -> List[str]:
        with self._lock:
            return list(self._sandboxes)

    def live_pids(self) -> List[int]:
        with self._lock:
            sandboxes = list(self._sandboxes.values())
        return [pid for sbx in sandboxes for pid in sbx.live_pids()]

    def log(self, line: str) -> None:
        """A line in the host job's log (through the stub process)."""
        with self._stub_lock:
            stub = self._stub
            if stub is None or stub.stdin is None or stub.stdin.closed:
                return
            try:
                stub.stdin.write((line + "\n").encode("utf-8", "replace"))
                stub.stdin.flush()
            except (OSError, ValueError):
                pass  # the job died: its log is gone with it

    # -- machinery ---------------------------------------------------------------------------------

    def _end_job(self, failed: bool = False) -> None:
        """Exit as the real server does: idle, the stub ends and the job COMPLETES; failed, it is
        terminated and the job ends in ERROR."""
        with self._stub_lock:
            if self._stub is None:
                return
            if failed:
                self._stub.terminate()
            elif self._stub.stdin is not None:
                try:
                    self._stub.stdin.close()
                except OSError:
                    pass

    def _evict_idle(self) -> None:
        while not self._stopped.wait(EVICTION_POLL_S):
            now = time.monotonic()
            with self._lock:
                if self.pool_mode:  # per-sandbox eviction, then an empty host shuts down
                    idle = [s for s in self._sandboxes.values()
                            if s.idle_timeout_s is not None and s.idle_for(now) >= s.idle_timeout_s]
                    for sbx in idle:
                        del self._sandboxes[sbx.id]
                    quiet = now - self._last_active if not self._sandboxes else float("-inf")
                else:  # a dedicated sandbox is the job: the whole job shuts down when it idles
                    idle = []
                    only = self._sandboxes.get(DEDICATED_ID)
                    quiet = only.idle_for(now) if only is not None else now - self._last_active
                host_idle = self.idle_timeout_s is not None and quiet >= self.idle_timeout_s
            for sbx in idle:
                self.log(f"sbx-server: sandbox {sbx.id} evicted after {sbx.idle_timeout_s:g}s idle")
            _end_sandboxes(idle)
            if host_idle:
                self.log(f"sbx-server: no sandbox for {self.idle_timeout_s:g}s; shutting down")
                self._end_job()
                return

    def touch(self) -> None:
        with self._lock:
            self._last_active = time.monotonic()

    def create_sandboxes(self, count: int, idle_timeout_s: Optional[float],
                         env: Mapping[str, str]) -> Tuple[List["EmulatedSandbox"], int]:
        """Up to `count` new sandboxes within capacity; returns (created, rejected)."""
        if self._owner.idle_timeout_s is not None:
            idle_timeout_s = self._owner.idle_timeout_s
        created: List[EmulatedSandbox] = []
        with self._lock:
            if self._stopped.is_set():  # (its files are removed: a sandbox made now would leave them behind)
                raise _SbxError(503, "the sandbox host is shutting down")
            room = max(0, self.capacity - len(self._sandboxes))
            for _ in range(min(count, room)):
                sbx = EmulatedSandbox(self, _new_id(set(self._sandboxes)), idle_timeout_s, env)
                self._sandboxes[sbx.id] = sbx
                created.append(sbx)
            self._last_active = time.monotonic()
        return created, count - len(created)

    def delete_sandbox(self, sandbox_id: str) -> bool:
        with self._lock:
            sbx = self._sandboxes.pop(sandbox_id, None)
            self._last_active = time.monotonic()
        if sbx is None:
            return False
        _end_sandboxes([sbx])
        return True

    def find(self, sandbox_id: str) -> Optional["EmulatedSandbox"]:
        with self._lock:
            return self._sandboxes.get(sandbox_id)

    def dedicated_sandbox(self) -> "EmulatedSandbox":
        """A dedicated job is one sandbox, addressed under /v1 with the job's own token."""
        with self._lock:
            if DEDICATED_ID not in self._sandboxes:
                # Its commands run with the job's env and secrets: what the job set (not this
                # process's own variables, though one may hold the same value, e.g. HF_TOKEN),
                # without the server's SBX_* settings and token.
                job_env = {k: v for k, v in self._declared.items() if not k.startswith("SBX_")}
                sbx = EmulatedSandbox(self, DEDICATED_ID, self.idle_timeout_s, job_env,
                                      token=self._token)
                self._sandboxes[DEDICATED_ID] = sbx
            return self._sandboxes[DEDICATED_ID]

    def host_token_rejection(self, presented: Optional[str]) -> Optional[Tuple[int, str]]:
        return _token_rejection(presented, self._token, "the host's management token")

    def track_tunnel(self, sock: socket.socket, add: bool) -> bool:
        with self._lock:
            if add:
                if self._stopped.is_set():
                    return False
                self._tunnels.add(sock)
            else:
                self._tunnels.discard(sock)
            return True


class EmulatedSandbox:
    """One sandbox: a private home, the `SBX_PROXY_DIR` its servers bind in, and its processes."""

    def __init__(self, host: SandboxHost, sandbox_id: str, idle_timeout_s: Optional[float],
                 env: Mapping[str, str], token: Optional[str] = None) -> None:
        self.id = sandbox_id
        self.token = token or secrets.token_hex(32)
        # File paths: a pooled sandbox's are rooted at its home; a dedicated one's (the job's whole
        # container) are absolute, relative ones under its home (huggingface_hub's SandboxFiles).
        self.rooted = sandbox_id != DEDICATED_ID
        self.idle_timeout_s = idle_timeout_s
        root = os.path.join(host._state_dir, sandbox_id)
        self.home = os.path.join(root, "home")
        self.proxy_dir = os.path.join(root, "p")  # short: a unix socket path has ~104 bytes at most
        os.makedirs(self.home, mode=0o700)
        os.makedirs(self.proxy_dir, mode=0o700)
        self.env = {k: v for k, v in os.environ.items()
                    if k not in _jobs.SCRUBBED_ENV_VARS and not k.startswith("SBX_")}
        self.env.update({"HOME": self.home, PROXY_DIR_ENV: self.proxy_dir, "PYTHONUNBUFFERED": "1"})
        self.env.update({str(k): str(v) for k, v in env.items()})
        # Inherited by everything the sandbox starts, even what leaves its process group (`cmd &` whose
        # leader exits, a daemon's fork, setsid): end() kills every process still carrying it.
        self.mark = "%s-%s" % (sandbox_id, secrets.token_hex(8))
        self.ended = False  # set by end(): a process starting after that is killed at once
        self._lock = threading.Lock()
        self._processes: Dict[str, _Process] = {}
        self._foreground: set = set()  # Popen of commands being exec'd (ended with the sandbox too)
        self.reaper = host._owner.reaper
        self._active_requests = 0
        self._last_active = time.monotonic()

    def touch(self, delta: int = 0) -> None:
        with self._lock:
            self._active_requests += delta
            self._last_active = time.monotonic()

    def idle_for(self, now: float) -> float:
        """Seconds without an API call, proxied byte or running process (-inf when it never idles out)."""
        with self._lock:
            if (self.idle_timeout_s is None or self._active_requests
                    or any(p.running for p in self._processes.values())):
                return float("-inf")
            return now - self._last_active

    def start_process(self, argv: List[str], env: Mapping[str, str], cwd: str, cmd: Any,
                      tag: Optional[str]) -> "_Process":
        popen = _jobs.spawn_process(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env={**self.env, **env, SANDBOX_MARK_ENV: self.mark},
                                    cwd=cwd, start_new_session=True)
        with self._lock:
            if self.ended:  # deleted while this one started: it must not outlive its sandbox
                _kill_group(popen.pid, signal.SIGKILL)
                popen.wait()
                raise _SbxError(404, f"sandbox {self.id} was deleted")
            proc = _Process(_new_id(set(self._processes)), popen, cmd, tag, self.reaper)
            self._processes[proc.id] = proc
            finished = [p for p in self._processes.values() if not p.running]
            for old in finished[:max(0, len(finished) - FINISHED_PROCESSES_KEPT)]:
                del self._processes[old.id]
        return proc

    def foreground(self, popen: subprocess.Popen, running: bool) -> None:
        with self._lock:
            if running and self.ended:
                _kill_group(popen.pid, signal.SIGKILL)  # (the exec then ends with the command's kill)
            (self._foreground.add if running else self._foreground.discard)(popen)
        if self.reaper is not None:
            (self.reaper.watch if running else self.reaper.forget)(popen.pid)

    def processes(self) -> List["_Process"]:
        with self._lock:
            return list(self._processes.values())

    def process(self, process_id: str) -> Optional["_Process"]:
        with self._lock:
            return self._processes.get(process_id)

    def live_pids(self) -> List[int]:
        with self._lock:
            foreground = [p.pid for p in self._foreground if p.poll() is None]
        return [p.popen.pid for p in self.processes() if p.running] + foreground

    def end(self) -> List[str]:
        """Stop every process group of this sandbox whose leader still runs (an exited leader's pid may
        since belong to someone else); returns what survived. `_end_sandboxes` then kills what escaped
        the groups and removes the files."""
        with self._lock:
            self.ended = True
            foreground = [_Process("exec", p, None, None, None) for p in self._foreground]
        procs = [p for p in self.processes() + foreground if p.running]
        for proc in procs:
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        left = []
        for proc in procs:
            try:
                proc.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            proc.signal(signal.SIGKILL)  # the leader may be gone while its group lives on
            try:
                proc.popen.wait(5.0)
            except subprocess.TimeoutExpired:
                left.append(f"sandbox {self.id} pid {proc.popen.pid}")
            proc.forget_if_reaped()
        return left


# ==================================================================================================
# Machinery
# ==================================================================================================


class _Process:
    """A background process of a sandbox: its own process group, output discarded."""

    def __init__(self, process_id: str, popen: subprocess.Popen, cmd: Any, tag: Optional[str],
                 reaper: Optional["_Reaper"]) -> None:
        self.id = process_id
        self.popen = popen
        self.cmd = cmd
        self.tag = tag
        self.started_at_ms = int(time.time() * 1000)
        self._reaper = reaper  # told when the group starts, and when its leader is reaped
        if reaper is not None:
            reaper.watch(popen.pid)

    @property
    def running(self) -> bool:
        if self.popen.poll() is None:
            return True
        self.forget_if_reaped()
        return False

    def forget_if_reaped(self) -> None:
        """Once the leader is reaped its pid may be reused: take its group off the reaper's list."""
        if self.popen.returncode is not None:
            reaper, self._reaper = self._reaper, None
            if reaper is not None:
                reaper.forget(self.popen.pid)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> bool:
        """SIGTERM the group, SIGKILL it after a grace; True when this call is what stopped it."""
        if not self.running:
            return False
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        self.signal(signal.SIGKILL)
        try:
            self.popen.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        self.forget_if_reaped()
        return True

    def as_json(self) -> Dict[str, Any]:
        code = self.popen.poll()
        return {"id": self.id, "pid": self.popen.pid, "cmd": self.cmd, "tag": self.tag,
                "started_at_ms": self.started_at_ms, "running": code is None,
                "exit_code": code if code is not None and code >= 0 else None}


class _Reaper:
    """The reaper process (REAPER_SOURCE) and the pipe it reads: `watch(pgid)` when a sandbox process group
    starts, `forget(pgid)` once its leader is reaped; `close()` after every listed group ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process = _jobs.spawn_process([sys.executable, "-I", "-S", "-c", REAPER_SOURCE], stdin=subprocess.PIPE,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True)  # not in a terminal's group: Ctrl-C spares it

    def watch(self, pgid: int) -> None:
        self._send(b"+%d\n" % pgid)

    def forget(self, pgid: int) -> None:
        self._send(b"-%d\n" % pgid)

    def close(self) -> None:
        with self._lock:
            try:
                self._process.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
        try:
            self._process.wait(5.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _send(self, line: bytes) -> None:
        with self._lock:
            try:
                self._process.stdin.write(line)  # type: ignore[union-attr]
                self._process.stdin.flush()  # type: ignore[union-attr]
            except (OSError, ValueError):
                pass  # closed, or the reaper died: the emulator's own teardown still ends every group


class _SbxError(Exception):
    def __init__(self, status: int, message: str, headers: Optional[Mapping[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


class _UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a unix socket (a sandbox server's `<port>.sock`)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _SbxHandler(_jobs._QuietHandler):
    """The sbx-server routes. Management (`/v1/sandboxes`, `.../token`) wants the host token; every
    route of one sandbox wants that sandbox's own token (X-Sandbox-Token). The HF bearer was checked
    (and consumed) by the job's exposed-port gate in front of this server."""

    host: SandboxHost
    server_version = "sbx-server"

    def do_GET(self) -> None:
        self._body_read = False
        try:
            self._route()
        except _SbxError as exc:
            self._send_error(exc.status, exc.message, exc.headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        if not self._body_read and not self.close_connection:
            try:  # a body nobody read would be parsed as the next request on this connection
                self._body()
            except (_SbxError, OSError, ValueError):
                self.close_connection = True

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    def _send_error(self, status: int, message: str, headers: Optional[Mapping[str, str]] = None) -> None:
        try:
            self.send_json(status, {"error": message}, headers)
        except OSError:
            self.close_connection = True

    def _route(self) -> None:
        path = urlsplit(self.path).path
        method = self.command
        presented = self.headers.get(TOKEN_HEADER)
        if not self.host.ready:
            raise _SbxError(503, "the sandbox server is starting", {"Retry-After": "1"})
        if path == "/health" and method == "GET":
            return self._health()
        host = self.host
        if host.pool_mode:
            if path == "/v1/sandboxes":
                self._check(host.host_token_rejection(presented))
                if method == "POST":
                    return self._create()
                if method == "GET":
                    return self.send_json(200, [{"id": sid} for sid in host.sandbox_ids])
                raise _SbxError(405, f"{method} is not allowed on /v1/sandboxes (GET lists, POST creates)")
            match = _SANDBOX_ROUTE.match(path)
            if not match:
                raise _SbxError(404, f"no route {path}")
            sandbox_id, rest = match.group(1), match.group(2) or ""
            if rest == "/token":
                self._check(host.host_token_rejection(presented))
                sbx = host.find(sandbox_id)
                if sbx is None:
                    raise _SbxError(404, f"no sandbox {sandbox_id} on this host")
                return self.send_json(200, {"id": sbx.id, "token": sbx.token})
            sbx = host.find(sandbox_id)
            if sbx is None:
                raise _SbxError(404, f"no sandbox {sandbox_id} on this host")
            rejection = _token_rejection(presented, sbx.token, f"sandbox {sandbox_id}'s own token")
            if rejection is not None and not host._owner.strict_tokens and host.host_token_rejection(presented) is None:
                rejection = None  # lenient: the host's token opens its sandboxes too (clients before protocol 3)
            self._check(rejection)
            if rest == "" and method == "DELETE":
                host.delete_sandbox(sandbox_id)
                return self.send_json(200, {"id": sandbox_id, "deleted": True})
        else:
            if not path.startswith("/v1/"):
                raise _SbxError(404, f"no route {path}")
            self._check(host.host_token_rejection(presented))
            sbx, rest = host.dedicated_sandbox(), path[len("/v1"):]
        host.touch()
        sbx.touch(+1)
        try:
            self._sandbox_route(sbx, rest)
        finally:
            sbx.touch(-1)

    def _check(self, rejection: Optional[Tuple[int, str]]) -> None:
        if rejection is not None:
            raise _SbxError(*rejection)

    def _health(self) -> None:
        host = self.host
        self.send_json(200, {"status": "ok", "protocol": SANDBOX_SERVER_PROTOCOL, "version": EMULATED_SERVER_VERSION,
                             "mode": "pool" if host.pool_mode else "dedicated", "capacity": host.capacity,
                             "sandboxes": len(host.sandbox_ids)})

    def _json_body(self) -> Dict[str, Any]:
        raw = self._body()
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise _SbxError(400, "the request body must be JSON")
        if not isinstance(body, dict):
            raise _SbxError(400, "the request body must be a JSON object")
        return body

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise _SbxError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        self._body_read = True
        try:
            return self.read_body(MAX_BODY_BYTES)
        except _jobs._ApiError as exc:
            raise _SbxError(exc.status, exc.message)

    def _create(self) -> None:
        owner = self.host._owner
        body = self._json_body()
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise _SbxError(400, f"'count' must be an int >= 1, got {count!r}")
        idle = body.get("idle_timeout_secs")
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float)) or idle < 0):
            raise _SbxError(400, f"'idle_timeout_secs' must be seconds >= 0, got {idle!r}")
        env = body.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
            raise _SbxError(400, "'env' must be an object of variable names to values")
        fault = owner._take_create_error()
        if fault is not None:
            status, retry_after = fault
            headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
            raise _SbxError(status, f"injected fault: sandbox create answered {status}", headers)
        if owner.sandbox_create_s:
            time.sleep(owner.sandbox_create_s)
        created, rejected = self.host.create_sandboxes(count, idle, env)
        self.send_json(200, {"sandboxes": [{"id": s.id, "token": s.token} for s in created],
                             "rejected": rejected})

    # -- one sandbox's routes ----------------------------------------------------------------------

    def _sandbox_route(self, sbx: EmulatedSandbox, rest: str) -> None:
        method = self.command
        query = parse_qs(urlsplit(self.path).query, keep_blank_values=True)
        proxy = _PROXY_ROUTE.match(rest)
        if proxy:
            return self._proxy(sbx, int(proxy.group(1)))
        if rest == "/exec" and method == "POST":
            return self._exec(sbx, self._json_body())
        if rest == "/processes":
            if method == "POST":
                return self._spawn(sbx, self._json_body())
            if method == "GET":
                return self.send_json(200, [p.as_json() for p in sbx.processes()])
        if rest.startswith("/processes/") and method == "DELETE":
            proc = sbx.process(rest[len("/processes/"):])
            if proc is None:  # 400, as the reference server answers: a bad argument, not a route
                raise _SbxError(400, f"no process {rest[len('/processes/'):]!r} in this sandbox")
            killed = proc.kill()
            return self.send_json(200, {"id": proc.id, "pid": proc.popen.pid, "killed": killed})
        files = {("GET", "/files/read"): self._file_read, ("PUT", "/files/write"): self._file_write,
                 ("GET", "/files/stat"): self._file_stat, ("GET", "/files/list"): self._file_list,
                 ("DELETE", "/files/delete"): self._file_delete, ("POST", "/files/mkdir"): self._file_mkdir}
        handler = files.get((method, rest))
        if handler is not None:
            return handler(sbx, query)
        raise _SbxError(404, f"no route {method} {rest or '/'} on a sandbox")

    def _argv(self, sbx: EmulatedSandbox, body: Mapping[str, Any]) -> Tuple[List[str], Dict[str, str], str]:
        cmd, shell = body.get("cmd"), body.get("shell")
        if isinstance(cmd, str) and shell is not False:  # OpenEnv's server in the image: the echo's
            echo = " ".join(shlex.quote(part) for part in _jobs.echo_server_command())
            played = _jobs.OPENENV_POOLED_COMMAND.sub(lambda _: f"exec {echo} --unix-socket ", cmd)
            argv = ["/bin/sh", "-c", played]
        elif isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd) and shell is not True:
            argv = list(cmd)
        else:
            raise _SbxError(400, "'cmd' must be a shell string (shell true or absent) or a non-empty argv list "
                                 "(shell false or absent)")
        env = body.get("env") or {}
        if not isinstance(env, dict):
            raise _SbxError(400, "'env' must be an object")
        cwd = body.get("cwd")
        where = _resolve(sbx, cwd)[0] if cwd else sbx.home
        if not os.path.isdir(where):
            raise _SbxError(400, f"cwd {cwd!r} is not a directory in this sandbox")
        return argv, {str(k): str(v) for k, v in env.items()}, where

    def _spawn(self, sbx: EmulatedSandbox, body: Mapping[str, Any]) -> None:
        argv, env, cwd = self._argv(sbx, body)
        tag = body.get("tag")
        try:
            proc = sbx.start_process(argv, env, cwd, body.get("cmd"), tag if isinstance(tag, str) else None)
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte, or '=' in a variable's name
            raise _SbxError(400, f"cannot start {argv[0]!r}: {getattr(exc, 'strerror', None) or exc}")
        self.send_json(200, {"id": proc.id, "pid": proc.popen.pid, "tag": proc.tag})

    def _exec(self, sbx: EmulatedSandbox, body: Mapping[str, Any]) -> None:
        """Run a command to its end, streaming NDJSON events: start, stdout/stderr, ping, exit."""
        argv, env, cwd = self._argv(sbx, body)
        stdin, timeout = body.get("stdin"), body.get("timeout")
        if stdin is not None and not isinstance(stdin, str):
            raise _SbxError(400, "'stdin' must be a string")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise _SbxError(400, f"'timeout' must be seconds > 0, got {timeout!r}")
        started = time.monotonic()
        try:
            popen = _jobs.spawn_process(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        env={**sbx.env, **env, SANDBOX_MARK_ENV: sbx.mark}, cwd=cwd,
                                        start_new_session=True)
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte, or '=' in a variable's name
            raise _SbxError(400, f"cannot start {argv[0]!r}: {getattr(exc, 'strerror', None) or exc}")
        sbx.foreground(popen, True)
        events: "queue.Queue[Optional[Tuple[str, str]]]" = queue.Queue()
        workers = [threading.Thread(target=_pump, args=(stream, name, events), daemon=True)
                   for stream, name in ((popen.stdout, "stdout"), (popen.stderr, "stderr"))]
        workers.append(threading.Thread(target=lambda: (popen.wait(), events.put(("exit", ""))), daemon=True))
        for worker in workers:
            worker.start()
        if stdin is not None:
            threading.Thread(target=_feed, args=(popen.stdin, stdin.encode("utf-8")), daemon=True).start()
        deadline = started + float(timeout) if timeout is not None else None
        timed_out, exited_at = False, None
        try:
            self._start_stream()
            self._event({"event": "start", "pid": popen.pid})
            open_streams = 2
            while open_streams:
                # Each turn, not only when no output waits: a command printing without pause still times
                # out, and one that exited ends even while a descendant keeps writing to its pipes.
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    timed_out, deadline = True, None
                    _kill_group(popen.pid, signal.SIGKILL)
                if exited_at is not None:  # what is left in the pipes, not what descendants still write
                    wait = exited_at + EXEC_DRAIN_S - now
                    if wait <= 0:
                        break
                else:
                    wait = EXEC_PING_S if deadline is None else min(EXEC_PING_S, deadline - now)
                try:
                    item = events.get(timeout=max(0.0, wait))
                except queue.Empty:  # (a deadline or the drain's end is met at the top of the next turn)
                    if exited_at is None and (deadline is None or time.monotonic() < deadline):
                        self._event({"event": "ping"})
                    continue
                if item is None:
                    open_streams -= 1
                elif item[0] == "exit":
                    exited_at = time.monotonic()
                else:
                    self._event({"event": item[0], "data": item[1]})
            code = popen.wait()
            exit_event: Dict[str, Any] = {"event": "exit", "exit_code": code if code >= 0 else None,
                                          "duration_ms": int((time.monotonic() - started) * 1000),
                                          "timed_out": timed_out}
            if code < 0:
                exit_event["signal"] = -code
            self._event(exit_event)
            self._end_stream()
        except OSError:  # the client went away: the command goes with it
            self.close_connection = True
        finally:
            _kill_group(popen.pid, signal.SIGKILL)
            popen.wait()
            sbx.foreground(popen, False)
            # stdout and stderr are closed by their pumps (a close here could free a descriptor number a
            # pump is about to read, and let it read whatever the process opens next under that number)
            if popen.stdin is not None:
                try:
                    popen.stdin.close()
                except OSError:
                    pass

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _event(self, event: Mapping[str, Any]) -> None:
        self._chunk((json.dumps(event) + "\n").encode("utf-8"))

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # -- files (pooled: rooted at its home; dedicated: absolute; symlinks refused) -----------------

    def _file_read(self, sbx: EmulatedSandbox, query: Mapping[str, List[str]]) -> None:
        real, shown = _resolve(sbx, _param(query, "path"))
        offset = _int_param(query, "offset", 0)
        try:
            fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise _SbxError(404, f"{shown} does not exist")
        except OSError as exc:
            raise _SbxError(400, f"cannot read {shown}: {exc.strerror}")
        try:
            info = os.fstat(fd)
            if not stat_mod.S_ISREG(info.st_mode):
                raise _SbxError(400, f"{shown} is not a file")
            available = max(0, info.st_size - offset)
            length = min(_int_param(query, "length", available), available)
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(length))
            self.end_headers()
            while length > 0:
                data = os.pread(fd, min(IO_CHUNK, length), offset)
                if not data:
                    self.close_connection = True  # the file shrank: the promised length cannot be kept
                    return
                self.wfile.write(data)
                offset += len(data)
                length -= len(data)
        finally:
            os.close(fd)

    def _file_write(self, sbx: EmulatedSandbox, query: Mapping[str, List[str]]) -> None:
        real, shown = _resolve(sbx, _param(query, "path"))
        data = self._body()
        ranged = "offset" in query
        offset = _int_param(query, "offset", 0)
        truncate_to = _int_param(query, "truncate_to", -1)
        mode = query.get("mode", [None])[0]
        try:
            perms = int(mode, 8) if mode else None
        except ValueError:
            raise _SbxError(400, f"'mode' must be octal (e.g. 644), got {mode!r}")
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | (0 if ranged else os.O_TRUNC)
        try:
            os.makedirs(os.path.dirname(real), exist_ok=True)
            if os.path.exists(real) and not stat_mod.S_ISREG(os.lstat(real).st_mode):
                raise _SbxError(400, f"{shown} is not a file")  # (a FIFO would block the open)
            fd = os.open(real, flags, 0o644)
        except OSError as exc:
            raise _SbxError(400, f"cannot write {shown}: {exc.strerror}")
        try:
            os.pwrite(fd, data, offset)
            if truncate_to >= 0:
                os.ftruncate(fd, truncate_to)
            if perms is not None:
                os.fchmod(fd, perms)
        finally:
            os.close(fd)
        self.send_json(200, {"path": shown, "size": len(data)})

    def _file_stat(self, sbx: EmulatedSandbox, query: Mapping[str, List[str]]) -> None:
        real, shown = _resolve(sbx, _param(query, "path"))
        self.send_json(200, _entry(real, shown))

    def _file_list(self, sbx: EmulatedSandbox, query: Mapping[str, List[str]]) -> None:
        real, shown = _resolve(sbx, _param(query, "path"))
        try:
            names = sorted(os.listdir(real))
        except FileNotFoundError:
            raise _SbxError(404, f"{shown} does not exist")
        except NotADirectoryError:
            raise _SbxError(400, f"{shown} is not a directory")
        after = query.get("after", [None])[0]
        if after:
            names = [n for n in names if n > after]
        page = names[:LIST_PAGE]
        entries = []
        for name in page:
            try:
                entries.append(_entry(os.path.join(real, name), posixpath.join(shown, name)))
            except _SbxError:
                continue  # removed while listing
        self.send_json(200, {"entries": entries, "next": page[-1] if len(names) > LIST_PAGE else None})

    def _file_delete(self, sbx: EmulatedSandbox, query: Mapping[str, List[str]]) -> None:
        real, shown = _resolve(sbx, _param(query, "path"))
        if real in (sbx.home, "/"):
            raise _SbxError(400, f"{shown} cannot be deleted: it is the sandbox's home or root")
        recursive = query.get("recursive", ["0"])[0] in ("1", "true")
        try:
            if os.path.isdir(real) and not os.path.islink(real):
                shutil.rmtree(real) if recursive else os.rmdir(real)
            else:
                os.unlink(real)
        except FileNotFoundError:
            raise _SbxError(404, f"{shown} does not exist")
        except OSError as exc:
            raise _SbxError(400, f"cannot delete {shown}: {exc.strerror} (recursive=1 removes a directory's content)")
        self.send_json(200, {"path": shown, "deleted": True})

    def _file_mkdir(self, sbx: EmulatedSandbox, query: Mapping[str, List[str]]) -> None:
        real, shown = _resolve(sbx, _param(query, "path"))
        try:
            os.makedirs(real, exist_ok=True)
        except OSError as exc:
            raise _SbxError(400, f"cannot create {shown}: {exc.strerror}")
        self.send_json(200, {"path": shown, "created": True})

    # -- proxy/<port>/... ----------------------------------------------------------------------------

    def _proxy(self, sbx: EmulatedSandbox, port: int) -> None:
        """Forward to the sandbox's `<port>.sock` (pool) or 127.0.0.1:<port> (dedicated)."""
        if not 0 < port < 65536:
            raise _SbxError(400, f"port {port} is out of range")
        target = self._proxy_target()
        sock_path = os.path.join(sbx.proxy_dir, f"{port}.sock")
        headers = [(k, v) for k, v in self.headers.items()
                   if k.lower() not in HOP_BY_HOP and k.lower() not in CONSUMED and k.lower() != "content-length"]
        upgrade = "upgrade" in self.headers.get("Connection", "").lower() and self.headers.get("Upgrade")
        if upgrade:
            return self._tunnel(sbx, port, sock_path, target, headers)
        body = self._body()
        if self.host.pool_mode:
            conn: http.client.HTTPConnection = _UnixHTTPConnection(sock_path, UPSTREAM_TIMEOUT_S)
        else:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=UPSTREAM_TIMEOUT_S)
        try:
            try:
                conn.putrequest(self.command, target, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    conn.putheader(name, value)
                if body or self.command in ("POST", "PUT", "PATCH"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                response = conn.getresponse()
            except socket.timeout:
                raise _SbxError(504, f"the server on port {port} did not answer within {UPSTREAM_TIMEOUT_S:g}s")
            except OSError as exc:
                raise _SbxError(502, f"nothing answers on port {port} in this sandbox "
                                     f"(a server must listen on $SBX_PROXY_DIR/{port}.sock): {exc.strerror or exc}")
            except http.client.HTTPException as exc:
                raise _SbxError(502, f"the server on port {port} sent a broken answer: {exc!r}")
            self._relay_response(response)
        finally:
            conn.close()

    def _proxy_target(self) -> str:
        split = urlsplit(self.path)
        rest = _PROXY_ROUTE.match(re.sub(r"^/v1(/sandboxes/[0-9a-f]{12})?", "", split.path))
        target = (rest.group(2) if rest else None) or "/"
        return target + (f"?{split.query}" if split.query else "")

    def _relay_response(self, response: http.client.HTTPResponse) -> None:
        status = response.status
        no_body = self.command == "HEAD" or status in (204, 304) or 100 <= status < 200
        self.send_response_only(status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        length = response.length if not response.chunked else None
        if no_body:
            if response.getheader("Content-Length") is not None:
                self.send_header("Content-Length", response.getheader("Content-Length", "0"))
            self.end_headers()
            return
        chunked = length is None
        self.send_header(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(length))))
        self.end_headers()
        try:
            for data in iter(lambda: response.read1(IO_CHUNK), b""):
                self._chunk(data) if chunked else self.wfile.write(data)
        except (http.client.HTTPException, OSError) as exc:  # the sandbox's server died mid-body, or it stalled
            log.debug("sbx-server: a proxied body was cut short (%s)", type(exc).__name__)
            self.close_connection = True  # the client sees the body end early, as it did
            return
        if chunked:
            self._end_stream()
        elif response.length:  # the server closed before sending all it promised
            self.close_connection = True

    def _tunnel(self, sbx: EmulatedSandbox, port: int, sock_path: str, target: str,
                headers: List[Tuple[str, str]]) -> None:
        """WebSocket (any upgrade): replay the request, then relay raw bytes both ways until one side ends."""
        self.close_connection = True
        family = socket.AF_UNIX if self.host.pool_mode else socket.AF_INET
        upstream = socket.socket(family, socket.SOCK_STREAM)
        try:
            upstream.settimeout(10.0)
            upstream.connect(sock_path if self.host.pool_mode else ("127.0.0.1", port))
            upstream.settimeout(None)
        except OSError as exc:
            upstream.close()
            raise _SbxError(502, f"nothing answers on port {port} in this sandbox "
                                 f"(a server must listen on $SBX_PROXY_DIR/{port}.sock): {exc.strerror or exc}")
        if not self.host.track_tunnel(upstream, True):
            upstream.close()
            raise _SbxError(503, "the sandbox host is shutting down")
        head = [f"{self.command} {target} HTTP/1.1"]
        head += [f"{k}: {v}" for k, v in headers]
        head += [f"Connection: {self.headers.get('Connection', 'Upgrade')}", f"Upgrade: {self.headers['Upgrade']}"]
        client = self.connection
        client.settimeout(None)  # a WebSocket session may idle for longer than a keep-alive connection
        try:
            upstream.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
            self.wfile.flush()
            back = threading.Thread(target=_relay, args=(upstream, client, None, sbx), daemon=True)
            back.start()
            _relay(client, upstream, self.rfile, sbx)
            back.join()
        finally:
            self.host.track_tunnel(upstream, False)
            _close_socket(upstream)


def _relay(source: socket.socket, sink: socket.socket, reader: Any, sbx: EmulatedSandbox) -> None:
    """Copy bytes until EOF or an error, then end both directions (the peer relay sees it and stops)."""
    try:
        while True:
            data = reader.read1(IO_CHUNK) if reader is not None else source.recv(IO_CHUNK)
            if not data:
                break
            sink.sendall(data)
            sbx.touch()
    except (OSError, ValueError):
        pass
    for sock in (source, sink):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _pump(stream: Any, name: str, events: "queue.Queue[Optional[Tuple[str, str]]]") -> None:
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    try:
        while True:
            data = os.read(stream.fileno(), IO_CHUNK)
            text = decoder.decode(data, final=not data)
            if text:
                events.put((name, text))
            if not data:
                break
    except (OSError, ValueError):
        pass
    finally:
        stream.close()  # only here: see exec's cleanup
    events.put(None)


def _feed(stream: Any, data: bytes) -> None:
    try:
        stream.write(data)
    except (OSError, ValueError):
        pass
    finally:
        try:
            stream.close()
        except OSError:
            pass


def _end_sandboxes(sandboxes: List[EmulatedSandbox]) -> List[str]:
    """End sandboxes in parallel (each waits out a grace period), then kill every process still carrying
    one of their marks (`SANDBOX_MARK_ENV`) wherever it went, in one pass over /proc for all of them,
    then remove their files; returns what survived."""
    left: List[str] = []
    threads = [threading.Thread(target=lambda s=s: left.extend(s.end()), daemon=True) for s in sandboxes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(KILL_GRACE_S + 10.0)
    marks = {s.mark: s.id for s in sandboxes}
    left.extend(f"sandbox {marks[mark]} pid {pid}" for pid, mark in _kill_marked(SANDBOX_MARK_ENV, list(marks)))
    for sbx in sandboxes:  # after the sweep: an escaped process can no longer write into them
        shutil.rmtree(os.path.dirname(sbx.home), ignore_errors=True)
    return left


def _token_rejection(presented: Optional[str], expected: str, what: str) -> Optional[Tuple[int, str]]:
    """(status, reason) when the X-Sandbox-Token header is missing or is not `expected`."""
    if not presented:
        return 401, f"missing {TOKEN_HEADER}: this route wants {what}"
    if not expected or not hmac.compare_digest(presented.encode(), expected.encode()):
        return 403, f"{TOKEN_HEADER} refused: this route wants {what}"
    return None


def _resolve(sbx: EmulatedSandbox, raw: str) -> Tuple[str, str]:
    """(real path, path as the client sees it): rooted at a pooled sandbox's home; for a dedicated
    sandbox an absolute path as is and a relative one under its home."""
    if sbx.rooted:
        shown, real = posixpath.normpath("/" + raw.lstrip("/")), sbx.home
    else:
        shown = posixpath.normpath(raw if raw.startswith("/") else posixpath.join(sbx.home, raw))
        real = "/"
    for part in [p for p in shown.split("/") if p]:
        real = os.path.join(real, part)
        if os.path.islink(real):
            raise _SbxError(400, f"{shown} goes through a symlink; the file API refuses symlinks")
    return real, shown


def _entry(real: str, shown: str) -> Dict[str, Any]:
    try:
        info = os.lstat(real)
    except (FileNotFoundError, NotADirectoryError):  # (below a file: nothing is there either)
        raise _SbxError(404, f"{shown} does not exist")
    kind = "dir" if stat_mod.S_ISDIR(info.st_mode) else "symlink" if stat_mod.S_ISLNK(info.st_mode) else "file"
    return {"name": posixpath.basename(shown) or "/", "path": shown, "type": kind, "size": info.st_size,
            "mtime_ms": int(info.st_mtime * 1000), "mode": oct(stat_mod.S_IMODE(info.st_mode))[2:]}


def _param(query: Mapping[str, List[str]], name: str) -> str:
    value = query.get(name, [""])[0]
    if not value:
        raise _SbxError(400, f"query parameter '{name}' is required")
    if "\0" in value:
        raise _SbxError(400, f"query parameter '{name}' contains a NUL byte")
    return value


def _int_param(query: Mapping[str, List[str]], name: str, default: int) -> int:
    text = query.get(name, [None])[0]
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()):  # (isdigit alone passes "²", which int() refuses)
        raise _SbxError(400, f"query parameter '{name}' must be an int >= 0, got {text!r}")
    return int(text)


def _kill_marked(name: str, marks: List[str], rounds: int = 5) -> List[Tuple[int, str]]:
    """SIGKILL this user's processes whose environment holds `name=<one of marks>` (Linux /proc;
    elsewhere none are found), round after round while any is found (a forking one makes more);
    returns (pid, mark) of those still there after the last round."""
    needles = [(b"\0%s=%s\0" % (name.encode(), mark.encode()), mark) for mark in marks]
    found: List[Tuple[int, str]] = []
    for _ in range(rounds if needles else 0):
        found = []
        for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as handle:
                        environ = b"\0" + handle.read()
                except OSError:  # gone meanwhile, or not ours to read
                    continue
                found.extend((int(entry), mark) for needle, mark in needles if needle in environ)
        for pid, _mark in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not found:
            return []
        time.sleep(0.05)
    return [(pid, mark) for pid, mark in found if _alive(pid)]


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _state_root() -> Optional[str]:
    """Where a host keeps its state: the temporary directory, unless its path is too long for the sockets in it."""
    if len(os.fsencode(tempfile.gettempdir())) <= MAX_STATE_ROOT_CHARS or not os.access("/tmp", os.W_OK | os.X_OK):
        return None
    return "/tmp"


def _close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _new_id(taken: set) -> str:
    while True:
        candidate = secrets.token_hex(6)
        if candidate not in taken:
            return candidate
