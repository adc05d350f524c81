"""Pooled placement: each environment runs as a sandbox of a shared host job (huggingface_hub's `SandboxPool`).

`HFSandboxProvider(image, pool="name")` (or a caller's own `SandboxPool`) imports this module on its
first pooled start. A start creates one sandbox on a warm host (booting a host only when every host is
full), runs the environment server in it in the background bound to the unix socket
`$SBX_PROXY_DIR/<port>.sock`, and mounts the host's proxy URL for that socket
(`https://<host_job_id>--49983.<domain>/v1/sandboxes/<id>/proxy/<port>`) on the shared `AuthProxy`,
with the sandbox's headers (bearer and `X-Sandbox-Token`) read at every request. The provider's contract
is unchanged: a loopback `base_url`, `wait_for_ready` (failing fast with the server's own output when it
exits), typed errors, `stop_container()` (kills the sandbox), and the safety nets (finalizer, atexit,
signal teardown), which also cancel the host jobs this process booted for a named pool.

Public names: `close_pools()`, `MIN_HUB_VERSION`, `MIN_PYTHON_VERSION`, `TESTED_HUB_VERSIONS`. See docs/pool.md.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import shlex
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import requests

if __package__:  # vendored inside a package
    from . import hf_sandbox_provider as _core
else:
    import hf_sandbox_provider as _core

__all__ = ["close_pools", "MIN_HUB_VERSION", "MIN_PYTHON_VERSION", "TESTED_HUB_VERSIONS"]

logger = logging.getLogger("hf_sandbox_provider")

# --------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------

# The oldest huggingface_hub pooled placement accepts. Sandbox.proxy_url_for/proxy_headers exist since
# 1.22.0, but until 1.31 its sandbox client follows redirects carrying the token, and until 2.1 a pooled
# sandbox's proxy_headers carry the host's credential (authority over every sibling) and it speaks an
# older sbx-server protocol than 3, which current hosts (and the emulator) serve.
MIN_HUB_VERSION = (2, 1, 1)
# The oldest Python MIN_HUB_VERSION installs on (huggingface_hub 2.x: Requires-Python >= 3.10).
MIN_PYTHON_VERSION = (3, 10)
# The versions this module's tests ran against (tests/test_pool.py; docs/pool.md says how to rerun).
TESTED_HUB_VERSIONS = ("2.1.1", "2.4.0")
# The port a host's sandbox server listens on (huggingface_hub's SANDBOX_SERVER_PORT): the token may go
# only to `https://<host_job_id>--49983.<domain>`.
SANDBOX_SERVER_PORT = 49983
# In a custom `command`, where the server's unix socket path goes (a shell word, expanded in the sandbox).
SOCKET_PLACEHOLDER = "{socket}"
# OpenEnv's image command (see the core's DEFAULT_COMMAND_TEMPLATE) with a unix socket instead of a port:
# a pooled sandbox cannot bind TCP ports, its host proxies `proxy/<port>/...` to `$SBX_PROXY_DIR/<port>.sock`.
POOL_COMMAND_TEMPLATE = "cd /app/env && exec uvicorn server.app:app --uds {socket}"
# Where the server's stdout and stderr go inside the sandbox (read back as a failed start's log tail).
SERVER_LOG_TEMPLATE = '"${HOME:-/tmp}/.hf-sandbox-server-%d.log"'
# While waiting for /health, how often the host is asked whether the server process still runs (one
# small request each): a crash at boot is reported within about this long, with its output.
SERVER_CHECK_INTERVAL_S = 0.5
# Each such question waits this long for its answer, as a /health probe does (huggingface_hub's own 60 s let a
# stalled host hold a 3 s readiness budget for a minute).
SERVER_CHECK_TIMEOUT_S = 10.0
# A sandbox's own idle eviction (huggingface_hub's default, 10 minutes). A running server counts as activity,
# so this only ends a sandbox whose server has exited, e.g. at its job_timeout deadline after this process
# was killed without teardown; the host, once empty, then ends after its own idle timeout. That is the
# pooled form of a dedicated job's timeoutSeconds: nothing bills forever.
SANDBOX_IDLE_TIMEOUT = 600
# Hosts a named pool pre-boots when this process first uses it (SandboxPool's warm_up): one, the rest
# on demand as hosts fill.
NAMED_POOL_WARM_UP = 1
# Sandboxes per host prewarm() plans for before the pool exists (huggingface_hub's default density).
HOST_CAPACITY_ASSUMED = 50
# At exit, how long killing the pooled sandboxes still running may take (in parallel), before the pools close.
EXIT_KILL_BUDGET_S = 15.0
# How long after its pool's close began a sandbox's release waits for that close to cancel its host (the signal
# teardown runs both at once) before it kills the sandbox anyway: a cancel is one Jobs API call. A close still
# waiting for creates in flight cancels later, and those kills let an uncancelled host idle out.
HOST_CLOSE_WAIT_S = 1.0
# A sandbox create the host answers 429 or 5xx (busy, restarting), or one of HOST_GONE_STATUSES while the host's
# job still runs, is retried this many times, with the Jobs client's backoff; huggingface_hub does not retry it.
CREATE_RETRIES = 4
CREATE_RETRY_STATUSES = frozenset([429, 500, 502, 503, 504])
# A create that fails with no answer (refused, reset, timed out) or one of these, which a front serving many
# jobs' names may give for one that has ended (what the Hub's gives is not known), asks the pool's host jobs'
# stages: huggingface_hub keeps placing sandboxes on a host it booted until the pool closes, so an ended host
# is forgotten and the sandbox placed again.
HOST_GONE_STATUSES = frozenset([404, 410, 502, 503, 504])
# While a host job this process started boots, huggingface_hub checks its stage every 2 s: one inspect per
# host. The pool's HfApi answers those checks from the process's job watcher instead, which refreshes every
# job the process is starting with one call (a `list` by this process's label) this often: a 13 s cold boot
# costs ~4 calls for all the hosts booting at once instead of ~7 per host, and a host that dies while
# booting still fails its start within this long plus huggingface_hub's 2 s, with its stage and log.
HOST_WATCH_INTERVAL_S = 3.0
# When a pool closes, how long it waits for its background cache writer's last write (one file write, under
# huggingface_hub's file lock) before writing the hosts it could not cancel.
CACHE_FLUSH_S = 10.0
# Pool names become the `hf-sandbox-pool` job label: the Hub's label rule.
_POOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,100}\Z")  # \Z: `$` would accept a trailing newline


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def close_pools() -> List[str]:
    """Close every named pool this process created: cancel the host jobs it booted (their sandboxes end
    with them; hosts it only adopted keep running). Never raises; returns (and warns naming) the host job ids
    it could not cancel, which still run and bill."""
    with _pools_lock:
        entries = list(_pools.values())
        _pools.clear()
    left: List[str] = []
    _core._in_parallel([lambda entry=entry: left.extend(entry.close()) for entry in entries])
    return sorted(left)


# --------------------------------------------------------------------------------------------------
# Validation (each returns the reason something is refused, or None)
# --------------------------------------------------------------------------------------------------


def pool_rejection(pool: Any) -> Optional[str]:
    """Why `pool=` cannot place environments (None, a pool name, or a huggingface_hub SandboxPool)."""
    if pool is None:
        return None
    if isinstance(pool, str):
        if not _POOL_NAME.match(pool):
            return ("pool=%r must be a pool name of 1-100 letters, digits, '-' or '_' (it becomes the host "
                    "jobs' hf-sandbox-pool label), or a huggingface_hub SandboxPool" % (pool,))
        return None
    reason = hub_rejection()
    if reason:
        return reason
    from huggingface_hub import SandboxPool
    if not isinstance(pool, SandboxPool):
        return "pool must be None, a pool name, or a huggingface_hub SandboxPool, not %s" % type(pool).__name__
    return None


def hub_rejection() -> Optional[str]:
    """Why the installed huggingface_hub cannot run pooled placement, or None."""
    needed = ".".join(str(part) for part in MIN_HUB_VERSION)
    advice = ("pip install -U 'huggingface_hub>=%s' (or the 'pool' extra: pip install 'hf-sandbox-provider[pool]')"
              % needed)
    if sys.version_info < MIN_PYTHON_VERSION:  # huggingface_hub 2.x requires Python 3.10: pip cannot install it here
        advice = ("pooled placement needs Python %s+ (huggingface_hub %s requires it); this is Python %s: use "
                  "dedicated placement (pool=None) here, or run on Python %s or newer"
                  % (_dotted(MIN_PYTHON_VERSION), needed, _dotted(sys.version_info[:3]), _dotted(MIN_PYTHON_VERSION)))
    try:
        import huggingface_hub
    except ImportError:
        return "pooled placement needs huggingface_hub >= %s, which is not installed: %s" % (needed, advice)
    version = str(getattr(huggingface_hub, "__version__", "0"))
    sandbox = getattr(huggingface_hub, "Sandbox", None)
    if (_version_tuple(version) < MIN_HUB_VERSION or getattr(huggingface_hub, "SandboxPool", None) is None
            or not hasattr(sandbox, "proxy_url_for") or not hasattr(sandbox, "proxy_headers")):
        return ("pooled placement needs huggingface_hub >= %s (its SandboxPool with per-sandbox proxy "
                "credentials, no redirects followed, sbx-server protocol 3); huggingface_hub %s is installed: %s"
                % (needed, version, advice))
    return None


def _dotted(version: Sequence[int]) -> str:
    return ".".join(str(part) for part in version)


def _version_tuple(version: str) -> Tuple[int, ...]:
    """(2, 4, 0) for '2.4.0', '2.4.0rc1', '2.4.0.dev0'; (0,) when unparseable."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = re.match(r"[0-9]+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts) or (0,)


def server_command(command: Union[None, str, Sequence[str]], port: int, timeout_s: Optional[int] = None) -> str:
    """The shell command a sandbox runs for the environment server: its output to the server log, the
    socket path in `$HF_SANDBOX_SOCKET`, a deadline after `timeout_s` (the provider's job_timeout: the
    process group is sent SIGTERM), `{socket}` in `command` replaced by the path (a list is quoted word
    by word), then the server (default: OpenEnv's uvicorn on the socket)."""
    socket_word = '"$SBX_PROXY_DIR/%d.sock"' % port
    if command is None:
        body = POOL_COMMAND_TEMPLATE.replace(SOCKET_PLACEHOLDER, socket_word)
    elif isinstance(command, str):
        body = command.replace(SOCKET_PLACEHOLDER, socket_word)
    else:
        body = "exec " + " ".join(socket_word.join(shlex.quote(piece) if piece else "" for piece in part.split(
            SOCKET_PLACEHOLDER)) if part else "''" for part in command)
    head = 'exec >%s 2>&1; export HF_SANDBOX_SOCKET=%s; ' % (SERVER_LOG_TEMPLATE % port, socket_word)
    if timeout_s is None:
        return head + body
    # The deadline: a watcher that sends the process group SIGTERM after timeout_s, and that ends (its
    # sleep too) as soon as the server does, so nothing of it outlives the server.
    watcher = ("(trap 'kill $s 2>/dev/null; exit 0' TERM; sleep %d & s=$!; wait $s; "
               'echo "hf-sandbox: job_timeout of %ds reached: stopping the server"; kill -TERM 0) & d=$!; '
               % (timeout_s, timeout_s))
    return head + watcher + "(%s); status=$?; kill $d 2>/dev/null; wait $d; exit $status" % body


# --------------------------------------------------------------------------------------------------
# One environment in a pooled sandbox: what HFSandboxProvider delegates to (like its _ReplicaSet)
# --------------------------------------------------------------------------------------------------


class PooledSandbox:
    """One provider's environment in a sandbox of a `SandboxPool` host: the provider's `_jobs` while
    it runs pooled. It starts, probes and tears down the sandbox; the provider keeps its phase."""

    def __init__(self, owner: "_core.HFSandboxProvider", settings: Mapping[str, Any]) -> None:
        reason = pool_rejection(settings["pool"]) or hub_rejection()
        if reason:
            raise _core.SandboxConfigError(reason)
        if int(settings.get("replicas") or 1) != 1:
            raise _core.SandboxConfigError("replicas=%r and pool= cannot be combined: a pooled environment is one "
                                           "sandbox (start several providers instead)" % (settings["replicas"],))
        self._owner = weakref.ref(owner)  # weak: the owner holds this object and must stay collectable
        self._lock = threading.Lock()
        self.sandbox: Any = None  # huggingface_hub Sandbox, until torn down
        self.process_id: Optional[str] = None  # the server's background process on the sandbox
        self.host_id: Optional[str] = None
        self.port = int(settings["port"])

    @property
    def owner(self) -> "_core.HFSandboxProvider":
        return self._owner()  # type: ignore[return-value]  # alive: only the owner calls it

    # -- the five operations the provider delegates ---------------------------------------------------

    def _start_jobs(self, settings: Dict[str, Any], token: str) -> str:
        """Create the sandbox, start the server in it, mount the host's proxy URL for its socket. Any
        failure (or a stop meanwhile) kills the sandbox before raising."""
        owner = self.owner
        owner._active = settings
        owner._submitted_at = time.monotonic()
        client = owner._job_client = _core._JobsClient(owner.endpoint, token, owner._hooks()._new_session())
        try:
            if isinstance(settings["pool"], str):  # a named pool boots hosts of this flavor (a caller's pool: its own)
                _core._raise_if_rejected(_core._live_flavor_rejection(client, settings["flavor"]))
            namespace = settings["namespace"] or client.whoami_namespace()
            with owner._lock:
                owner._job_namespace = namespace
                owner._move(_core.Phase.STARTING)  # from here on a teardown kills whatever sandbox we hold
            pool = _pool_for(settings, token, namespace, owner.endpoint, new_session=owner._hooks()._new_session)
            owner._raise_if_stopped()
            env = {**{k: str(v) for k, v in settings["secrets"].items()},
                   **{k: str(v) for k, v in settings["env_vars"].items()}}
            if settings["labels"]:
                logger.debug("pool=%s: labels are not used by a pooled sandbox (its host's labels are the pool's)",
                             pool.name)
            sandbox = self._create(pool, env)
            self._hold(owner, sandbox, namespace)
            owner._raise_if_stopped()
            upstream = sandbox.proxy_url_for(self.port, "").rstrip("/")
            reason = owner._hooks()._exposed_url_rejection(upstream, self.host_id or "", SANDBOX_SERVER_PORT)
            if reason:
                raise _core.InsecureURLError(reason)
            command = server_command(settings["command"], self.port, _core._parse_duration(settings["job_timeout"]))
            try:  # (not retried: a request that reached the host may have started the server)
                process = sandbox.run(command, background=True)
            except Exception as exc:  # e.g. the host answered 502, or evicted the sandbox meanwhile (404)
                raise _as_library_error("starting the server in sandbox %s" % sandbox.id, exc) from None
            self.process_id = process.id
            owner._raise_if_stopped()
            proxy = owner._proxy_instance()
            owner.upstream_url = upstream
            base_url = proxy.mount(upstream, token=None, verify=settings["verify"], headers=_SandboxHeaders(sandbox))
            owner._publish_route(proxy, base_url, _core._reaper.arm(owner, _release_sandbox, sandbox, proxy, base_url,
                                                                    None, True))
            logger.info("sandbox %s (pool %s, host %s) serving through the proxy (%.1fs after submit)",
                        sandbox.id, pool.name, self.host_id, owner._elapsed())
            return base_url
        except BaseException:
            owner._teardown(client)
            raise

    def _wait_ready(self, base_url: str, budget: float) -> None:
        """Probe /health through the proxy until 200, asking the host every SERVER_CHECK_INTERVAL_S meanwhile
        whether the server process still runs: one that exited fails at once with its output as the log tail."""
        owner = self.owner
        next_check = [time.monotonic() + SERVER_CHECK_INTERVAL_S]

        def check() -> None:
            if time.monotonic() >= next_check[0]:
                self._raise_if_server_ended()
                next_check[0] = time.monotonic() + SERVER_CHECK_INTERVAL_S

        owner._probe_until_ready(base_url, budget, check, "sandbox %s" % owner.job_id, "sandbox %s" % owner.job_id)

    def _teardown_jobs(self, client: Optional["_core._JobsClient"], start: Optional[int] = None) -> None:
        """Unmount the route and kill the sandbox (its host keeps running for the pool's other sandboxes)."""
        if (gone := self.owner._detach(start)) is None:
            return  # the teardown of a start that already ended
        with self._lock:
            sandbox, self.sandbox = self.sandbox, None
        ended = _release_sandbox(sandbox, gone.proxy, gone.base_url, client or gone.client, namespace=gone.namespace)
        with self.owner._lock:  # (a start made during a slow kill has a sandbox, and a stage, of its own)
            if ended and self.owner._stage not in _core.TERMINAL_STAGES and self.owner.job_id == gone.job_id:
                self.owner._stage = ended

    def _job_ids(self) -> List[str]:
        job_id = self.owner.job_id
        return [job_id] if job_id else []

    def _job_stage(self) -> Optional[str]:
        return self.owner._stage

    # -- more of the provider's API -------------------------------------------------------------------

    def logs(self, tail: int) -> List[str]:
        """The last `tail` lines the environment server wrote (its log file in the sandbox)."""
        sandbox = self.sandbox
        if sandbox is None:
            raise _core.SandboxError("logs(): sandbox %s was stopped (a pooled server's output goes with its "
                                     "sandbox)" % self.owner.job_id)
        return _server_log_tail(sandbox, self.port, tail)

    # -- machinery ------------------------------------------------------------------------------------

    def _create(self, pool: Any, env: Mapping[str, str]) -> Any:
        """pool.create(), retrying a 429/5xx answer (CREATE_RETRIES times, with backoff); what still fails
        is raised as this library's error, with huggingface_hub's message."""
        owner = self.owner
        for attempt in range(CREATE_RETRIES + 1):
            try:
                return pool.create(env=dict(env) or None, idle_timeout=SANDBOX_IDLE_TIMEOUT, forward_hf_token=False)
            except Exception as exc:
                if isinstance(exc, _core.SandboxError):
                    raise
                status = getattr(exc, "status_code", None)
                if (not isinstance(pool, _pool_class()) and (status is None or status in HOST_GONE_STATUSES)
                        and attempt < CREATE_RETRIES and self._drop_dead_hosts(pool)):
                    continue  # (a caller's own SandboxPool; ours forgets a dead host in _create_one)
                if (status in CREATE_RETRY_STATUSES or status in HOST_GONE_STATUSES) and attempt < CREATE_RETRIES:
                    delay = _core._retry_delay(attempt, None)
                    logger.info("pool %s: sandbox create answered %s; retrying in %.1fs", pool.name, status, delay)
                    if owner._stop_requested.wait(delay):
                        owner._raise_if_stopped()
                    continue
                raise _as_library_error("creating a sandbox in pool %s" % pool.name, exc) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _drop_dead_hosts(self, pool: Any) -> bool:
        """Make a SandboxPool the caller made forget its hosts whose jobs have ended or that the Hub no longer
        knows (see HOST_GONE_STATUSES); True if it forgot any."""
        owner = self.owner
        client, hosts, drop = owner._job_client, getattr(pool, "_hosts", None), getattr(pool, "_drop_host", None)
        if client is None or hosts is None or drop is None:
            return False
        dropped = []
        for host in list(hosts):
            stage = _ended_host_stage(client, getattr(host, "owner", None) or owner._job_namespace, host.job_id)
            if stage is not None:
                drop(host)
                dropped.append("%s (%s)" % (host.job_id, stage))
        if dropped:
            logger.warning("pool %s: host job(s) %s ended; placing sandboxes on the others or a new host",
                           pool.name, ", ".join(dropped))
        return bool(dropped)

    def _hold(self, owner: "_core.HFSandboxProvider", sandbox: Any, namespace: str) -> None:
        """Record the new sandbox so every teardown from now on kills it, and make that the safety net."""
        with self._lock:
            self.sandbox = sandbox
        self.host_id = sandbox.host_id
        with owner._lock:
            owner.job_id = sandbox.id
            owner.job_url = "%s/jobs/%s/%s" % (owner.endpoint, namespace, self.host_id)
            owner._stage = "RUNNING"  # a sandbox exists only on a running host
            owner.timings["created"] = owner.timings["running"] = owner._elapsed()
        owner._swap_finalizer(_core._reaper.arm(owner, _release_sandbox, sandbox, None, None, None, True))

    def _raise_if_server_ended(self) -> None:
        """JobFailedError when the server process exited, the sandbox is gone or its host has ended."""
        owner, sandbox = self.owner, self.sandbox
        if sandbox is None:
            owner._raise_if_stopped()
            raise _core.SandboxError("sandbox %s was stopped while starting" % owner.job_id)
        try:
            processes = _processes(sandbox)
        except Exception as exc:
            self._raise_if_host_ended(exc)
            return  # a transient failure asking: /health decides, or the next check
        process = next((p for p in processes if p.get("id") == self.process_id), {"exit_code": "unknown"})
        if process.get("running"):
            return
        code = process.get("exit_code")
        raise _core.JobFailedError(owner.job_id or "", "ERROR",
                                   "the environment server exited (code %s) before it answered /health" % code,
                                   _server_log_tail(sandbox, self.port, _core.LOG_TAIL_LINES))

    def _raise_if_host_ended(self, error: BaseException) -> None:
        """After the host failed to answer: JobFailedError if its job has ended, or else if the sandbox is gone
        (a 404: asked after the host's stage, since a front may answer 404 for an ended job too)."""
        owner, client, host_id = self.owner, self.owner._job_client, self.host_id
        if client is not None and host_id is not None:
            job: Dict[str, Any] = {}
            with contextlib.suppress(Exception):
                job = client.get_job(owner._job_namespace or "", host_id, retries=0)
            status = job.get("status") or {}
            if status.get("stage") in _core.TERMINAL_STAGES:
                tail = client.job_logs(owner._job_namespace or "", host_id, tail=_core.LOG_TAIL_LINES)
                raise _core.JobFailedError(host_id, str(status["stage"]), status.get("message")
                                           or "the sandbox's host job ended", tail)
        if getattr(error, "status_code", None) == 404:
            raise _core.JobFailedError(owner.job_id or "", "DELETED", "the sandbox no longer exists on host %s "
                                       "(evicted or killed, or its host job is ending)" % host_id)


class _SandboxHeaders:
    """The proxy route's headers: the sandbox's own (bearer and X-Sandbox-Token), read at each request
    because the bearer may rotate. Never shown."""

    __slots__ = ("_sandbox",)

    def __init__(self, sandbox: Any) -> None:
        self._sandbox = sandbox

    def __call__(self) -> Mapping[str, str]:
        return self._sandbox.proxy_headers

    def __repr__(self) -> str:
        return "<sandbox proxy headers>"


def _release_sandbox(sandbox: Any, proxy: Any, base_url: Optional[str], client: Any,
                     abandoned: bool = False, namespace: Optional[str] = None) -> Optional[str]:
    """Unmount the route and kill the sandbox, warning (never raising) about what could not be done; the stage
    the sandbox ended in ("CANCELED", or its host job's when that ended first), else None. Plain values, never
    the provider: the safety net uses it too."""
    if sandbox is None and not base_url and client is None:
        return None
    sandbox_id = getattr(sandbox, "id", None)
    if abandoned and sandbox_id:
        logger.warning("sandbox %s is still running at exit (or its provider was garbage-collected): killing it",
                       sandbox_id)
    problems = []
    ended: Optional[str] = None
    try:
        problems.extend(_core._unmount(proxy, base_url))
        if sandbox is not None:
            if _host_cancelled_by_us(sandbox, wait=True):
                ended = "CANCELED"  # its host job was cancelled with its pool: the sandbox went with it
            else:
                sandbox.kill()  # logs its own warning on failure and stays killable
                if getattr(sandbox, "_killed", True):
                    ended = "CANCELED"
                    logger.info("sandbox %s killed", sandbox_id)
                elif _host_cancelled_by_us(sandbox, wait=True):  # the kill met its host's cancel, begun meanwhile
                    ended = "CANCELED"
                    logger.info("sandbox %s ended with its host job %s (its pool closed)", sandbox_id, sandbox.host_id)
                elif (ended := _ended_host_stage(client, namespace, getattr(sandbox, "host_id", None))) is not None:
                    logger.info("sandbox %s ended with its host job %s (%s)", sandbox_id, sandbox.host_id, ended)
                elif _released_if_gone(sandbox):
                    ended = "DELETED"
                    logger.info("sandbox %s was gone from its host already (evicted)", sandbox_id)
                else:
                    problems.append("could not kill it")
        if client is not None:
            client.close()
    except BaseException as exc:  # e.g. a second Ctrl-C during teardown: report, do not mask
        problems.append("teardown interrupted (%s)" % type(exc).__name__)
    if problems:
        logger.warning("sandbox %s: %s. It ends with its host job %s (pool close, the host's idle timeout, or "
                       "`python -m hf_sandbox_provider sweep --pool NAME`)", sandbox_id, "; ".join(problems),
                       getattr(sandbox, "host_id", None) or "")
    return ended


def _processes(sandbox: Any) -> List[Dict[str, Any]]:
    """What huggingface_hub's `Sandbox.processes()` asks (`GET /processes`, one dict per process: `id`, `running`,
    `exit_code`...), within SERVER_CHECK_TIMEOUT_S; its request helper takes the timeout its public call does not."""
    request = getattr(sandbox, "_request", None)
    if request is None:  # a huggingface_hub without it: its own call, and its own 60 s
        return [{"id": p.id, "running": p.running, "exit_code": p.exit_code} for p in sandbox.processes()]
    payload = request("GET", "/processes", timeout=SERVER_CHECK_TIMEOUT_S).json()
    if not isinstance(payload, list) or not all(isinstance(p, dict) and "running" in p for p in payload):
        raise ValueError("the host's process list is not a list of processes")  # as processes() would fail
    return payload


def _released_if_gone(sandbox: Any) -> bool:
    """After a kill that failed: whether the host answers 404 for the sandbox (it evicted it, e.g. once its server
    had exited). huggingface_hub's kill() counts that 404 as a failure and so keeps the sandbox's place on the host
    taken: after as many as a host holds, the pool would boot (and bill) a new host for an empty one. So the
    sandbox is released here as its kill() would have (its `_killed` mark and `_on_kill` hook, huggingface_hub 1.x)."""
    try:
        _processes(sandbox)
        return False
    except Exception as exc:
        if getattr(exc, "status_code", None) != 404:
            return False
    sandbox._killed = True
    on_kill = getattr(sandbox, "_on_kill", None)
    if callable(on_kill):
        on_kill(sandbox)
    return True


def _ended_host_stage(client: Optional["_core._JobsClient"], namespace: Optional[str],
                      host_id: Optional[str]) -> Optional[str]:
    """A host job's terminal stage, asked once (DELETED for a job the Hub no longer knows: deleted, garbage-
    collected); None while it runs, or when it cannot be asked. A host that died takes its sandboxes with it."""
    if client is None or not namespace or not host_id:
        return None
    try:
        stage = (client.get_job(namespace, host_id, retries=0).get("status") or {}).get("stage")
    except _core.JobsAPIError as exc:
        return "DELETED" if exc.status_code == 404 else None
    except Exception:
        return None
    return stage if stage in _core.TERMINAL_STAGES else None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _as_library_error(what: str, exc: BaseException) -> Exception:
    """huggingface_hub's (or its HTTP client's) error raised as this library's, so `except SandboxError`
    catches it: JobsAPIError with the HTTP status it carries, else SandboxError; its first line kept."""
    status = getattr(exc, "status_code", None)
    if status is not None:
        return _core.JobsAPIError(what, status, _first_line(exc))
    return _core.SandboxError("%s failed: %s" % (what, _first_line(exc)))


def _server_log_tail(sandbox: Any, port: int, tail: int) -> List[str]:
    """The last `tail` lines of the server's log in the sandbox ([] when it cannot be read)."""
    try:
        result = sandbox.run("tail -n %d %s" % (int(tail), SERVER_LOG_TEMPLATE % port), check=False,
                             timeout=_core.LOG_FETCH_TIMEOUT_S)
    except Exception as exc:
        logger.debug("could not read the server log of sandbox %s (%s)", getattr(sandbox, "id", "?"),
                     type(exc).__name__)
        return []
    return result.stdout.splitlines()[-tail:]


# --------------------------------------------------------------------------------------------------
# Named pools: one SandboxPool per (name, image, flavor, namespace, token) in the process
# --------------------------------------------------------------------------------------------------


class _NamedPool:
    """A named pool of this process: created (its first host booted) on first use, closed by
    close_pools(), at exit or by signal teardown (its safety net is among the provider's)."""

    def __init__(self, key: Tuple[Any, ...]) -> None:
        self.key = key
        self.lock = threading.Lock()  # held while the pool is made: concurrent first starts wait for it
        self.pool: Any = None
        self.closed = False
        self.finalizer: Optional[weakref.finalize] = None
        self.cancelled_hosts: "set[str]" = set()
        self.planned_hosts = 0  # hosts start_many asked for before the pool exists: its first start boots them
        self.failures = 0  # pool creations that failed, and the last one's reason (shared by the starts waiting)
        self.failure = ""

    def close(self) -> List[str]:
        """Close the pool (once); the ids of the host jobs it booted that could not be cancelled."""
        with self.lock:
            pool, self.pool, self.closed = self.pool, None, True
            finalizer, self.finalizer = self.finalizer, None
        if finalizer is not None:
            _core._reaper.retire(finalizer)
        return [] if pool is None else _close_pool(pool, self)


def _close_pool(pool: Any, entry: Optional[_NamedPool] = None) -> List[str]:
    """Close a pool we created: its host jobs this process booted are cancelled (so their sandboxes
    end), adopted ones only released. Never raises; returns the ids of those it could not cancel."""
    owned = _owned_hosts(pool)
    closing = [_closing_hosts.setdefault(job_id, _Closing()) for job_id in owned]  # (or the teardown's marks)
    try:
        try:
            pool.close()
            failed: List[str] = []
        except Exception as exc:  # a host it could not cancel runs on: its sandboxes are still killed one by one
            logger.warning("pool %s: %s", getattr(pool, "name", "?"), str(exc))
            cancelled = getattr(pool.__dict__.get("_provider_api"), "cancelled", set())
            failed = [job_id for job_id in owned if job_id not in cancelled]
        done = [job_id for job_id in owned if job_id not in failed]
        if entry is not None:  # marked only once cancelled: a sandbox of a host still running must be killed
            entry.cancelled_hosts.update(done)
            _cancelled_hosts.update(done)
    finally:  # (a Ctrl-C too: the releases waiting go on to kill their sandboxes)
        for job_id, mark in zip(owned, closing):
            if _closing_hosts.get(job_id) is mark:
                del _closing_hosts[job_id]
            mark.ended.set()
    if done:
        logger.info("pool %s closed: host job(s) %s cancelled", getattr(pool, "name", "?"), ", ".join(done))
    return failed


def _close_named_pool(entry: _NamedPool) -> List[str]:
    """A named pool's safety net (the exit hook, the signal teardown): its close, as close_pools() makes it but with
    no lock (a signal may have interrupted a thread holding one). The entry stays, closed: a start during the
    teardown fails rather than boot a host nothing would cancel, until _forget_closed() at its end."""
    pool, entry.pool, entry.closed = entry.pool, None, True
    return [] if pool is None else _close_pool(pool, entry)


def _forget_closed() -> None:
    """After the signal teardown: forget the pools its safety nets closed, so a process that lives on (a handler of
    its own) makes a new pool of that name at its next pooled start. Skipped if the lock stays taken (a thread the
    signal interrupted may hold it): those starts then say the pool was closed."""
    if _pools_lock.acquire(timeout=0.5):
        try:
            for key, entry in list(_pools.items()):
                if entry.closed and entry.pool is None:
                    del _pools[key]
        finally:
            _pools_lock.release()


def _owned_hosts(pool: Any) -> List[str]:
    """The ids of the host jobs `pool` booted (a close cancels those; adopted ones are only released)."""
    return [host.job_id for host in list(getattr(pool, "_hosts", [])) if getattr(host, "owned", False)]


# Host job ids this process cancelled by closing their pool: their sandboxes need no kill of their own.
_cancelled_hosts: "set[str]" = set()


class _Closing:
    """A host job whose pool is closing: `ended` is set once that close has ended (cancelled or not)."""

    def __init__(self, later_s: float = 0.0) -> None:  # later_s: the close begins that much later, at most
        self.ended, self.deadline = threading.Event(), time.monotonic() + later_s + HOST_CLOSE_WAIT_S


# Host job ids whose pool is closing.
_closing_hosts: Dict[str, _Closing] = {}


def _host_cancelled_by_us(sandbox: Any, wait: bool = False) -> bool:
    """Whether closing its pool cancelled the sandbox's host job; `wait`: first wait for a close under way (up to
    HOST_CLOSE_WAIT_S after it began), so that its cancel and the sandbox's own kill do not race (the kill fails)."""
    host_id = getattr(sandbox, "host_id", None)
    mark = _closing_hosts.get(host_id) if wait else None
    if mark is not None:
        mark.ended.wait(max(0.0, mark.deadline - time.monotonic()))
    return host_id in _cancelled_hosts


def _closes_first(budget_s: float) -> List[Callable[[], None]]:
    """For a teardown that runs every safety net at once, in batches, within `budget_s`: each named pool's close,
    taken from its net (so no batch runs it too), to run first and apart. The sandboxes of hosts it only adopted (a
    close releases those hosts' clients and cancels nothing) are killed first, as at exit, for up to half the budget:
    the rest is the cancels'. Its own hosts are marked as closing meanwhile, so that their sandboxes' releases wait
    for the cancels instead of racing them (see _host_cancelled_by_us). Takes no lock (a signal may have interrupted
    a thread holding one); a pool being closed already is left out."""
    closes = []
    for entry in list(_pools.values()):
        pool, net = entry.pool, entry.finalizer
        if pool is None or net is None or entry.closed:
            continue
        hosts = list(getattr(pool, "_hosts", []))
        adopted = {host.job_id for host in hosts if not getattr(host, "owned", False)}
        kills = []
        for other in list(_core._live_finalizers) if adopted else []:
            release = _release_of(other)
            if (getattr(release, "release", None) is _release_sandbox
                    and getattr(release.args[0], "host_id", None) in adopted):
                taken = _take(other)
                if taken is not None:
                    kills.append(taken.run)
        kills_s = budget_s / 2 if kills else 0.0
        for host in hosts:
            if getattr(host, "owned", False):
                _closing_hosts.setdefault(host.job_id, _Closing(later_s=kills_s))
        close = _take(net)
        if close is not None:
            closes.append(functools.partial(_kill_then_close, kills, kills_s, close.run))
    return closes


def _kill_then_close(kills: List[Callable[[], None]], kills_s: float, close: Callable[[], None]) -> None:
    _core._in_parallel(kills, kills_s)
    close()


def _release_of(net: "weakref.finalize") -> Any:
    """The release (`_core._Release`) an armed safety net holds, else None."""
    info = net.peek()
    return None if info is None else info[2][0]


def _take(net: "weakref.finalize") -> Any:
    """The release of a safety net, taken from it (None when it ran, or was taken, already): the taker runs it. The
    net is no longer armed (retired), so the reaper thread may end without it."""
    info = net.detach()
    _core._reaper.retire(net)
    return None if info is None else info[2][0]


_pools_lock = threading.Lock()
_pools: Dict[Tuple[Any, ...], _NamedPool] = {}


def _forget_pools_after_fork() -> None:
    """A forked child owns none of the parent's pools (as of its jobs, see the core's _reset_after_fork): they
    are forgotten, not closed, so its exit or stop_sandboxes() cancels no host job of the parent's, and its own
    starts get pools of their own. The lock is new: a parent thread may have held it at the fork."""
    global _pools_lock
    _pools_lock = threading.Lock()
    _pools.clear()
    _cancelled_hosts.clear()
    _closing_hosts.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)


def prewarm(provider: "_core.HFSandboxProvider", n: int, boot: bool = True) -> None:
    """Before `start_many(n, pool="name")`: make sure the named pool has hosts for `n` more sandboxes,
    booting the missing ones in parallel (one cold start for all of them, not one per full host). With
    `boot=False` and no pool yet, only plan them: the first start then boots them all at once, while the
    other starts do their own set-up instead of waiting for the boot to begin theirs."""
    settings = provider._settings({})
    if not isinstance(settings["pool"], str):
        return
    token = provider._resolve_token()
    client = _core._JobsClient(provider.endpoint, token, provider._new_session())
    try:
        namespace = settings["namespace"] or client.whoami_namespace()
    finally:
        client.close()
    hosts = -(-n // HOST_CAPACITY_ASSUMED)
    entry = _entry(_pool_key(settings, token, namespace, provider.endpoint))
    if not boot:
        with entry.lock:
            if entry.pool is None and not entry.closed:
                entry.planned_hosts = max(entry.planned_hosts, hosts)
                return
    pool = _pool_for(settings, token, namespace, provider.endpoint, warm_up=hosts, new_session=provider._new_session)
    per_host = int(getattr(pool, "sandboxes_per_host", HOST_CAPACITY_ASSUMED) or HOST_CAPACITY_ASSUMED)
    wanted = -(-(n + pool.num_sandboxes) // per_host)
    if pool.num_hosts < wanted:
        logger.info("pool %s: warming %d host(s) for %d environments", pool.name, wanted, n)
        with entry.lock:  # close() takes it first: a host booted here is in the pool before close() lists them
            if entry.pool is pool and not entry.closed:
                try:
                    pool.warm(wanted)
                except Exception as exc:  # as a first boot's failure: this library's error, not huggingface_hub's
                    if isinstance(exc, _core.SandboxError):
                        raise
                    raise _core.SandboxError("pool %s could not start a host job: %s" % (pool.name, exc)) from None


def _pool_key(settings: Mapping[str, Any], token: str, namespace: str, endpoint: str) -> Tuple[Any, ...]:
    return (settings["pool"], settings["image"], settings["flavor"], namespace, _core._token_key(endpoint, token))


def _entry(key: Tuple[Any, ...]) -> _NamedPool:
    with _pools_lock:
        entry = _pools.get(key)
        if entry is None:
            entry = _pools[key] = _NamedPool(key)
        return entry


def _pool_for(settings: Mapping[str, Any], token: str, namespace: str, endpoint: str, warm_up: int = 1,
              new_session: Callable[[], requests.Session] = requests.Session) -> Any:
    """The pool a start places its sandbox in: the caller's SandboxPool as given, or this process's
    named pool for these settings (made on first use, which boots its first `warm_up` hosts; the job
    watcher's session for its booting hosts comes from `new_session`)."""
    pool = settings["pool"]
    if not isinstance(pool, str):
        return pool
    entry = _entry(_pool_key(settings, token, namespace, endpoint))
    failures_seen = entry.failures  # read before waiting: a boot that fails meanwhile fails this start too
    with entry.lock:
        if entry.pool is None:
            if entry.closed:
                raise _core.SandboxError("pool %r was closed (close_pools() or teardown); start again to make a new "
                                         "one" % pool)
            if entry.failures != failures_seen:  # not a new boot per waiting start: one failed boot fails them all
                raise _core.SandboxError(entry.failure)
            warm_up = max(warm_up, entry.planned_hosts)
            entry.planned_hosts = 0  # start_many's plan is this boot's, whether it succeeds or fails
            logger.info("pool %s: starting (image %s, flavor %s, namespace %s)", pool, settings["image"],
                        settings["flavor"], namespace)
            made: List[Any] = []
            try:
                entry.pool = _new_pool(pool, settings, token, namespace, endpoint, warm_up, new_session, made)
            except BaseException as exc:  # its first hosts failed to boot (and were cancelled by huggingface_hub)
                if not isinstance(exc, Exception):  # Ctrl-C: the interrupted boot cancelled the host jobs it made
                    for unfinished in made:  # (see _HostBoots); any that reached the pool unseen go with it here
                        if getattr(unfinished, "_hosts", None):
                            _close_pool(unfinished)
                    entry.failure = "pool %s: its first host boot was interrupted (%s)" % (pool, type(exc).__name__)
                    entry.failures += 1  # the starts waiting for it fail too, rather than each booting again
                    raise
                entry.failure = (str(exc) if isinstance(exc, _core.SandboxError)
                                 else "pool %s could not start a host job: %s" % (pool, exc))
                entry.failures += 1
                if isinstance(exc, _core.SandboxError):
                    raise
                raise _core.SandboxError(entry.failure) from None
            entry.finalizer = _core._reaper.arm(entry, _close_named_pool, entry)  # atexit and signal teardown
        return entry.pool


def _new_pool(name: str, settings: Mapping[str, Any], token: str, namespace: str, endpoint: str,
              warm_up: int, new_session: Callable[[], requests.Session], made: Optional[List[Any]] = None) -> Any:
    """A SandboxPool (booting its first `warm_up` hosts in parallel) whose Hub calls go to the provider's
    endpoint, its booting hosts watched by the process's job watcher. The pool is appended to `made` before
    it boots, so a caller whose constructor call is interrupted can still close it."""
    return _pool_class()(image=settings["image"], flavor=settings["flavor"], name=name, namespace=namespace,
                         token=token, warm_up=max(NAMED_POOL_WARM_UP, warm_up),
                         start_timeout=float(settings["start_timeout_s"]), hub_endpoint=endpoint,
                         new_session=new_session, made=made)


class _HostBoots:
    """The host jobs one boot of a pool (its warm-up, `warm()` or an on-demand boot: one `_provision_hosts`)
    creates. huggingface_hub boots them in threads of its own; when the caller is interrupted (Ctrl-C) those
    go on without it, and the hosts they return are dropped. `abandon()` cancels what they created, and a
    create that answers after it is cancelled at once."""

    def __init__(self, api: Any) -> None:
        self._api = api
        self._lock = threading.Lock()
        self._jobs: List[Tuple[str, Optional[str]]] = []
        self._abandoned = False

    def add(self, job_id: str, namespace: Optional[str]) -> bool:
        """Record a host job just created; False (the job cancelled) when the boot was abandoned meanwhile."""
        with self._lock:
            if not self._abandoned:
                self._jobs.append((job_id, namespace))
                return True
        _cancel_abandoned_host(self._api, job_id, namespace)
        return False

    def abandon(self) -> None:
        with self._lock:
            self._abandoned, jobs, self._jobs = True, self._jobs, []
        for job_id, namespace in jobs:
            _cancel_abandoned_host(self._api, job_id, namespace)


def _cancel_abandoned_host(api: Any, job_id: str, namespace: Optional[str]) -> None:
    try:
        api.cancel_job(job_id=job_id, namespace=namespace)
    except Exception as exc:
        logger.warning("host job %s, whose boot was interrupted, could not be cancelled (%s): it runs until its "
                       "idle timeout; `python -m hf_sandbox_provider sweep` cancels it", job_id, _first_line(exc))
        return
    logger.info("host job %s cancelled: its boot was interrupted", job_id)


_pool_class_cache: List[Any] = []


def _pool_class() -> Any:
    """SandboxPool with the provider's endpoint and the process's job watcher.

    huggingface_hub's own calls go to the endpoint HF_ENDPOINT named when it was imported, while a provider's
    `endpoint=` (e.g. the emulator's) may differ: the pool makes its HfApi first thing in its constructor
    (which then boots a host), so the HfApi is replaced as it is assigned, by one that also serves the stage
    checks of the hosts the pool boots from the job watcher (HOST_WATCH_INTERVAL_S)."""
    if _pool_class_cache:
        return _pool_class_cache[0]
    from huggingface_hub import HfApi, JobInfo, SandboxPool
    from huggingface_hub.errors import JobNotFoundError, SandboxError

    class WatchingHfApi(HfApi):  # type: ignore[misc,valid-type]
        """HfApi whose `inspect_job` of a host this pool is booting reads the job watcher's latest answer
        (no call of its own); the host job carries this process's label so the watcher's `list` finds it."""

        def __init__(self, endpoint: str, token: Optional[str], new_session: Callable[[], requests.Session]) -> None:
            super().__init__(endpoint=endpoint, token=token)
            self._new_session = new_session
            self._booting = threading.local()  # the current thread's _boot_host: its boot record, its host jobs
            self._watches: Dict[str, Tuple[Any, Any]] = {}  # job id -> (watch, the create answer)
            self._watches_lock = threading.Lock()
            self.cancelled: "set[str]" = set()  # host job ids whose cancel succeeded

        def run_job(self, *, labels: Optional[Dict[str, str]] = None, **kwargs: Any) -> Any:
            started, boots = getattr(self._booting, "jobs", None), getattr(self._booting, "boots", None)
            if started is None or boots is None:  # not a host boot: as huggingface_hub does it
                return super().run_job(labels=labels, **kwargs)
            # The library's label too: a plain `sweep` finds the hosts a killed process left (huggingface_hub's
            # discovery and `sweep --pool` select hosts by the pool's own labels, which stay as they are).
            job = super().run_job(labels={**(labels or {}), _core.PROVIDER_LABEL_KEY: _core.PROVIDER_LABEL_VALUE,
                                          _core.PROCESS_LABEL_KEY: _core._process_label}, **kwargs)
            if not boots.add(job.id, job.owner.name):  # the boot's caller was interrupted: the job is cancelled
                raise _core.SandboxError("host job %s cancelled: its boot was interrupted" % job.id)
            if not self.token:
                return job
            try:
                watch = _core._watcher.register(self.endpoint, self.token, self._new_session, job.owner.name,
                                                job.id, HOST_WATCH_INTERVAL_S, threading.Event())
            except Exception as exc:  # e.g. no thread for the watcher: huggingface_hub's inspects then serve
                logger.debug("host job %s is not watched (%s)", job.id, type(exc).__name__)
                return job  # (raising here would leave the job running: it is not the pool's yet)
            with self._watches_lock:
                self._watches[job.id] = (watch, job)
            started.append(job.id)
            return job

        def inspect_job(self, *, job_id: str, **kwargs: Any) -> Any:
            with self._watches_lock:
                entry = self._watches.get(job_id)
            if entry is None:
                return super().inspect_job(job_id=job_id, **kwargs)
            watch, created = entry
            if watch.error is not None:
                raise watch.error
            return created if watch.job is None else JobInfo(**watch.job, endpoint=self.endpoint)

        def cancel_job(self, *, job_id: str, **kwargs: Any) -> None:
            if job_id in self.cancelled:  # e.g. a boot abandoned by Ctrl-C, then failing: cancelled already
                return
            super().cancel_job(job_id=job_id, **kwargs)
            self.cancelled.add(job_id)

        def booting(self, boots: Optional[_HostBoots]) -> None:
            """Around one `_boot_host` (in its thread): record (in `boots`) and watch the host jobs it starts,
            then, given None, stop watching them."""
            started, self._booting.jobs = getattr(self._booting, "jobs", None), [] if boots is not None else None
            self._booting.boots = boots
            for job_id in started or []:
                with self._watches_lock:
                    watch, _ = self._watches.pop(job_id)
                _core._watcher.unregister(watch)

    class ProviderSandboxPool(SandboxPool):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, hub_endpoint: str, new_session: Callable[[], requests.Session],
                     made: Optional[List[Any]] = None, **kwargs: Any) -> None:
            self.__dict__["_hub_endpoint"] = hub_endpoint
            self.__dict__["_new_session"] = new_session
            self._cache_lock = threading.Lock()
            self._cache_stale = self._cache_closed = False
            self._cache_writer: Optional[threading.Thread] = None
            self._provisioning = threading.local()  # the boot (_HostBoots) the current thread's _provision_hosts runs
            self._stages_lock = threading.Lock()  # see _ended
            self._asked_at: Dict[str, float] = {}  # host job id -> when _ended last asked its stage
            self._ended_ids: "set[str]" = set()  # host jobs _ended found ended (and dropped)
            self._stages_client: Optional[_core._JobsClient] = None
            if made is not None:
                made.append(self)
            super().__init__(*args, **kwargs)

        @property
        def _api(self) -> Any:
            return self.__dict__["_provider_api"]

        @_api.setter
        def _api(self, api: Any) -> None:
            if not isinstance(api, WatchingHfApi):
                api = WatchingHfApi(self.__dict__.get("_hub_endpoint") or api.endpoint, api.token,
                                    self.__dict__["_new_session"])
            self.__dict__["_provider_api"] = api

        def _save_cache(self, hosts: Any = None) -> None:
            """huggingface_hub saves its host cache file after every create (under a file lock polled every
            50 ms; 64 creates at once waited up to 4 s in line for it) and at warm-up, in the caller's thread.
            Here the saves go to one background writer, so no start waits for the file: a save asked for while
            it writes is folded into its next write (the latest state), and the file still ends with the last
            state. `hosts` (close()) is written as given, after the writer's last write."""
            if hosts is not None:
                self.flush_cache()
                return super()._save_cache(hosts)
            with self._cache_lock:
                if self._cache_closed:  # close() writes (or deletes) the pool's entry itself
                    return
                self._cache_stale = True
                if self._cache_writer is not None:
                    return
                writer = self._cache_writer = threading.Thread(target=self._write_cache, name="hf-sandbox-pool-cache",
                                                               daemon=True)
            try:
                _core._start_thread(writer)
            except RuntimeError:  # no thread to be had (interpreter exit, a thread limit): write it here
                with self._cache_lock:
                    self._cache_writer = None
                    self._cache_stale = False
                SandboxPool._save_cache(self)

        def close(self) -> None:
            """huggingface_hub's close, after the background writer's last write: no write of ours lands after
            close() has deleted (or rewritten) the pool's cache entry."""
            with self._cache_lock:
                self._cache_closed = True
            self.flush_cache()
            try:
                super().close()
            finally:
                if self._stages_client is not None:
                    self._stages_client.close()

        def flush_cache(self) -> None:
            """Wait (at most CACHE_FLUSH_S) for the background writer's last write."""
            with self._cache_lock:
                writer = self._cache_writer
            if writer is not None and writer is not threading.current_thread():
                writer.join(CACHE_FLUSH_S)

        def _write_cache(self) -> None:
            try:
                while True:
                    with self._cache_lock:  # the check and the hand-back in one step: no save is lost
                        if not self._cache_stale or self._cache_closed:
                            self._cache_writer = None
                            return
                        self._cache_stale = False
                    SandboxPool._save_cache(self)
            except Exception as exc:  # best effort, as huggingface_hub's cache is: the pool works without it
                logger.debug("pool %s: could not save the pool cache (%s)", self.name, type(exc).__name__)
                with self._cache_lock:
                    self._cache_writer = None

        def _confirm_cached_host(self, cached: Any) -> bool:
            """huggingface_hub (2.4.0) re-checks a cache entry older than its trust TTL with
            inspect_job and prunes it on an httpx HTTPStatusError 404, but inspect_job raises
            JobNotFoundError, which is not one: a host whose job the Hub forgot then failed every
            start of the pool with "Could not confirm cached host".
            That answer is a definite no: forget the host, as its pruning means to (the next cache
            save drops the entry), and place the sandbox elsewhere."""
            try:
                return bool(super()._confirm_cached_host(cached))
            except SandboxError as exc:
                if not isinstance(exc.__cause__, JobNotFoundError):
                    raise
            logger.info("pool %s: cached host %s is gone (the Hub no longer knows its job); "
                        "forgetting it", self.name, cached.job_id)
            with self._lock:
                self._dead_host_ids.add(cached.job_id)
            return False

        def _create_one(self, host: Any, env: Any, idle_secs: Any) -> Any:
            """huggingface_hub's, but a host that fails the create as an ended one would (HOST_GONE_STATUSES) and
            whose job has ended is forgotten: None, so huggingface_hub places the sandbox again, as it does for
            a cached host that is gone (not while the pool closes: a new host would only be cancelled)."""
            try:
                return super()._create_one(host, env, idle_secs)
            except Exception as exc:
                status = getattr(exc, "status_code", None)
                if (status is not None and status not in HOST_GONE_STATUSES) or self._closed or not self._ended(
                        host, time.monotonic()):
                    raise
            return None

        def _ended(self, host: Any, failed_at: float) -> bool:
            """Whether `host` was found ended since `failed_at`. One question at a time for the pool: the host's
            stage, unless asked since (a create that failed meanwhile takes that answer), and once it has ended
            every other host's (hosts may die together); each ended host is dropped with one WARNING."""
            with self._stages_lock:
                if (host.job_id not in self._ended_ids and self._asked_at.get(host.job_id, float("-inf")) < failed_at
                        and self._ask_stage(host)):
                    with self._lock:
                        others = [each for each in self._hosts if each is not host]
                    for each in others:
                        self._ask_stage(each)
                return host.job_id in self._ended_ids

        def _ask_stage(self, host: Any) -> bool:
            """Ask the host job's stage (under _stages_lock); drop the host if it has ended, and say so."""
            self._asked_at[host.job_id] = time.monotonic()
            stage = _ended_host_stage(self._stage_client(), host.owner, host.job_id)
            if stage is None:
                return False
            logger.warning("pool %s: host job %s has ended (%s); placing sandboxes on the other hosts or a new one",
                           self.name, host.job_id, stage)
            self._ended_ids.add(host.job_id)
            self._drop_host(host)
            return True

        def _stage_client(self) -> "_core._JobsClient":
            """The Jobs client of those questions (the provider's kind: the token's API budget, its timeouts)."""
            if self._stages_client is None:
                self._stages_client = _core._JobsClient(self._api.endpoint, self._api.token or "",
                                                        self.__dict__["_new_session"]())
            return self._stages_client

        def _provision_hosts(self, num_new: int, **kwargs: Any) -> Any:
            """huggingface_hub's parallel boot, its host jobs recorded: if this thread is interrupted (Ctrl-C)
            while the boot threads run, the host jobs they create are cancelled instead of left running."""
            boots = self._provisioning.boots = _HostBoots(self._api)
            try:
                return super()._provision_hosts(num_new, **kwargs)
            except BaseException as exc:
                if not isinstance(exc, Exception):  # a failed boot's hosts huggingface_hub cancels itself
                    boots.abandon()
                raise
            finally:
                self._provisioning.boots = None

        @property
        def _boot_host(self) -> Callable[[], Any]:
            # huggingface_hub submits `self._boot_host` to its boot threads, looked up in the thread that runs
            # _provision_hosts: read here, it carries that boot's record into each of its threads.
            boots = getattr(self._provisioning, "boots", None) or _HostBoots(self._api)
            return functools.partial(self._boot_host_recorded, boots)

        def _boot_host_recorded(self, boots: _HostBoots) -> Any:
            self._api.booting(boots)
            try:
                return SandboxPool._boot_host(self)
            finally:
                self._api.booting(None)

    _pool_class_cache.append(ProviderSandboxPool)
    return ProviderSandboxPool


@atexit.register
def _close_pools_at_exit() -> None:
    """At exit (before the core's own hook: atexit runs in reverse order, and this module is imported
    after the core), kill pooled sandboxes still running, then close the named pools."""
    kills = [functools.partial(_core._reaper.retire, net, True) for net in list(_core._live_finalizers)
             if getattr(_release_of(net), "release", None) is _release_sandbox]
    _core._in_parallel(kills, EXIT_KILL_BUDGET_S)
    close_pools()


_core._register_placement("pool", sys.modules[__name__])  # the core's pool= finds this layer here
