"""The command line of hf-sandbox-provider: `smoke`, `sweep` and the `bench` entry.

`python -m hf_sandbox_provider smoke|sweep|bench` hands over to `main()` here (so does
`python -m hf_sandbox_cli`). Tooling, not code a trainer runs: it imports the core (`hf_sandbox_provider`)
and the training layer (`hf_sandbox_training`, for the smoke's WebSocket session), relatively inside a
package and absolutely at top level, like the core imports `proxy`; argparse only when it parses, and the
local emulator (hf_jobs_emulator.py) only for `smoke --local`. A vendored core needs this file only for
the command line.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import requests

if __package__:  # vendored inside a package: the core and the training layer sit next to this module
    from . import hf_sandbox_provider as _core
else:
    import hf_sandbox_provider as _core
EnvSession = _core._import_layer("hf_sandbox_training", "The smoke's WebSocket session (EnvSession)").EnvSession

# What the command line uses of the core.
HFSandboxProvider = _core.HFSandboxProvider
SandboxError, SandboxConfigError, JobsAPIError = _core.SandboxError, _core.SandboxConfigError, _core.JobsAPIError
InsecureURLError = _core.InsecureURLError
DEFAULT_ENDPOINT, DEFAULT_FLAVOR, TERMINAL_STAGES = _core.DEFAULT_ENDPOINT, _core.DEFAULT_FLAVOR, _core.TERMINAL_STAGES
PROVIDER_LABEL_KEY, PROVIDER_LABEL_VALUE = _core.PROVIDER_LABEL_KEY, _core.PROVIDER_LABEL_VALUE
_JobsClient, _cancel_briefly, _discover_token = _core._JobsClient, _core._cancel_briefly, _core._discover_token
_parse_duration, _resolve_endpoint = _core._parse_duration, _core._resolve_endpoint
_label_rule_rejection, START_LABEL_KEY = _core._label_rule_rejection, _core.START_LABEL_KEY

__all__ = ["main", "SMOKE_DEFAULT_IMAGE", "SMOKE_DEFAULT_ACTION", "SMOKE_WS_STEPS", "SMOKE_REQUEST_TIMEOUT_S",
           "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE"]


# --------------------------------------------------------------------------------------------------
# CLI: python -m hf_sandbox_provider smoke|sweep|bench
# --------------------------------------------------------------------------------------------------

# The image `smoke` runs on the real Hub unless --image or HF_SANDBOX_IMAGE says otherwise.
SMOKE_DEFAULT_IMAGE = "registry.hf.space/openenv-echo-env:latest"
# The echo environment's action; other environments take --action.
SMOKE_DEFAULT_ACTION = {"message": "hello from hf-sandbox-provider smoke"}
# The emulator's sandbox hosts for `smoke --local --pool`: ready at once (the defaults model the Hub's delays).
SMOKE_POOL_EMULATOR = dict(tls=True, sandbox_host_boot_s=0.0, sandbox_host_ready_s=0.1, sandbox_create_s=0.05)
# WebSocket steps after the reset: enough to show a session keeps its state.
SMOKE_WS_STEPS = 3
# Per-request timeout of the smoke's own HTTP and WebSocket calls.
SMOKE_REQUEST_TIMEOUT_S = 60.0
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# What a malformed `sweep --label` is told to type instead.
_SWEEP_LABEL_EXAMPLE = "--label %s=<the value a warning named> or --label run=exp1" % START_LABEL_KEY


class _Smoke:
    """Runs the smoke stages in order: a `...` line as a stage begins, its result as it ends. On a
    terminal the result replaces the `...` line (one line per stage); in a log or pipe both stay."""

    def __init__(self, out: Any) -> None:
        self.stages: List[Dict[str, Any]] = []
        self.out = out
        self.began = time.monotonic()
        self.live = bool(getattr(out, "isatty", lambda: False)())
        self._lock = threading.Lock()  # each line whole, even if another thread says something
        self._pending = False  # a terminal's `...` line is waiting for its result
        self.closed = False  # the reader went away (`| head`): the stages and the teardown go on unprinted

    def stage(self, name: str, action: Callable[[], Optional[str]]) -> bool:
        start, ok, detail = time.monotonic(), False, None
        try:  # (the `...` line too: a signal right after it is this stage's, never lost between stages)
            self._begin("  ...   %s" % name)
            ok, detail = True, action()
        except Exception as exc:
            detail = "%s: %s" % (type(exc).__name__, exc)
        except BaseException as exc:  # Ctrl-C (or SIGTERM/SIGHUP, see _interrupting): recorded, then it propagates
            detail = "interrupted (%s)" % (exc if isinstance(exc, _Terminated) else type(exc).__name__)
            raise
        finally:
            seconds, lines = time.monotonic() - start, (detail or "").splitlines() or [""]
            self.stages.append({"name": name, "ok": ok, "seconds": round(seconds, 3), "detail": detail or ""})
            self.say("%s %6.2fs  %s%s" % ("  ok  " if ok else "  FAIL", seconds, name,
                                           "  (%s)" % lines[0] if lines[0] else ""))
            if not ok and len(lines) > 1:
                self.say("\n".join("        | " + line for line in lines[1:]))
        return ok

    def say(self, line: str) -> None:
        with self._lock:
            erase = "\r\x1b[K" if self._pending else ""  # back over the `...` line, then clear it
            self._pending = False
            self._write(erase + line + "\n")

    def _write(self, text: str) -> None:
        if not self.closed:
            self.closed = not _emit(self.out, text)

    def log_to_stages(self) -> "logging.Handler":
        """A handler that shows the library's INFO lines (a job's id and Hub page as soon as its create
        answers, its stages, the heartbeat of a long wait, each retry) under the current stage."""
        smoke = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                smoke.say("        " + record.getMessage())

        return Handler(logging.INFO)

    def _begin(self, line: str) -> None:
        with self._lock:
            self._write(line if self.live else line + "\n")
            self._pending = self.live

    @property
    def ok(self) -> bool:
        return bool(self.stages) and all(stage["ok"] for stage in self.stages)

    def table(self, failure: Optional[str] = None) -> str:
        """The stages and the total; `failure` (an interrupt between stages) fails the total and is named."""
        width = max(len(stage["name"]) for stage in self.stages)
        rows = [(s["name"], "ok" if s["ok"] else "FAIL", "%8.2f" % s["seconds"]) for s in self.stages]
        rows = [("stage", "result", " seconds")] + rows + [
            ("total", "ok" if self.ok and not failure else "FAIL", "%8.2f" % (time.monotonic() - self.began))]
        unseen = failure and not any(s["detail"].startswith("interrupted") for s in self.stages)
        return "\n".join("%-*s  %-6s  %s" % (width, name, result, seconds) for name, result, seconds in rows) + (
            "\n%s between stages" % failure if unseen else "")


def _emit(out: Any, text: str) -> bool:
    """Write and flush `text`; False when the reader has gone (a closed pipe), whose stream then points at
    os.devnull so no later write or the interpreter's last flush fails."""
    try:
        out.write(text)
        out.flush()
        return True
    except OSError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, out.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # not a file descriptor (e.g. a StringIO)
            pass
        return False


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during `smoke`: handled like Ctrl-C, so the teardown stages run."""


@contextlib.contextmanager
def _interrupting(signals: Sequence[str] = ("SIGTERM", "SIGHUP")) -> Iterator[None]:
    """While in the block, `signals` raise _Terminated in the main thread (off it, or for a signal this process
    ignores, e.g. SIGHUP under nohup, nothing changes); the previous handlers come back after."""
    previous: Dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for name in signals:
            signum = getattr(signal, name, None)
            if signum is not None and signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(signal.Signals(signum).name)


def _smoke_checks(smoke: _Smoke, base_url: str, action: Mapping[str, Any]) -> None:
    """/health, HTTP /reset + /step, and a WebSocket /ws session, all through the proxy's base URL."""
    with requests.Session() as http:
        http.trust_env = False  # loopback proxy: never route through HTTP(S)_PROXY

        def call(method: str, path: str, body: Any = None) -> requests.Response:
            response = http.request(method, base_url + path, json=body, timeout=SMOKE_REQUEST_TIMEOUT_S)
            if response.status_code >= 400:  # the server's own words; the path only (the URL holds the route id)
                raise SandboxError("HTTP %d from %s %s: %s" % (response.status_code, method, path,
                                                               response.text.strip()[:300] or "(no body)"))
            return response

        def health() -> str:
            response = call("GET", "/health")
            return "HTTP %d %s" % (response.status_code, response.text.strip()[:80])

        def step() -> str:
            payload = call("POST", "/step", {"action": dict(action)}).json()
            return "reward=%s done=%s" % (payload.get("reward"), payload.get("done"))

        def websocket() -> str:
            with EnvSession(base_url, timeout_s=SMOKE_REQUEST_TIMEOUT_S) as ws:
                answers = [ws.exchange({"type": "reset", "data": {}})]
                answers += [ws.exchange({"type": "step", "data": dict(action)}) for _ in range(SMOKE_WS_STEPS)]
                state = ws.exchange({"type": "state"})
            errors = [a for a in answers + [state] if a.get("type") == "error"]
            if errors:
                raise SandboxError("server answered an error: %s" % json.dumps(errors[0].get("data"))[:300])
            if [a.get("type") for a in answers] != ["observation"] * (1 + SMOKE_WS_STEPS):
                raise SandboxError("unexpected answers: %s" % [a.get("type") for a in answers])
            return "reset + %d steps, step_count=%s" % (SMOKE_WS_STEPS, (state.get("data") or {}).get("step_count"))

        for name, check in [("GET /health", health),
                            ("HTTP POST /reset", lambda: "done=%s" % call("POST", "/reset", {}).json().get("done")),
                            ("HTTP POST /step", step), ("WebSocket /ws reset + %d steps" % SMOKE_WS_STEPS, websocket)]:
            smoke.stage(name, check)


def _import_emulator() -> Any:
    """The local HF Jobs emulator module, imported only when `smoke --local` asks for it; None if absent."""
    import importlib
    import importlib.util

    name = "%s.hf_jobs_emulator" % __package__ if __package__ else "hf_jobs_emulator"
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)  # present but broken: its own error says why


def _interruption(exc: BaseException) -> str:
    return "interrupted by %s" % exc if isinstance(exc, _Terminated) else "interrupted"


def _usage_error(message: str) -> int:
    print("error: %s" % message, file=sys.stderr)
    return EXIT_USAGE


def _run_smoke(args: Any) -> int:
    """`smoke`: one environment through every stage, then teardown; the exit status says if all
    passed. A bad flag exits EXIT_USAGE before anything starts, with --local or without."""
    try:
        action = json.loads(args.action) if args.action is not None else SMOKE_DEFAULT_ACTION
        if not isinstance(action, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        return _usage_error("--action must be a JSON object (%s)" % exc)
    image = args.image
    if image is None:
        image = os.environ.get("HF_SANDBOX_IMAGE") or SMOKE_DEFAULT_IMAGE
    settings: Dict[str, Any] = dict(flavor=args.flavor, command=args.command, pool=args.pool)
    if args.timeout is not None:
        settings.update(start_timeout_s=args.timeout, ready_timeout_s=args.timeout)
    module = _import_emulator() if args.local else None
    if args.local:
        if module is None:
            return _usage_error("smoke --local needs hf_jobs_emulator.py next to this module (it "
                                "is not part of a vendored copy); copy it from the "
                                "hf-sandbox-provider repository, or run smoke without --local "
                                "against the Hub")
    # --pool needs a recent huggingface_hub with --local or without; --local also the emulator's TLS certificates.
    reason = None if not args.pool else _local_pool_rejection(module) if args.local else _pool_module().hub_rejection()
    if reason:
        return _usage_error(reason)
    try:  # the settings' checks, before anything starts (the emulator's endpoint is loopback too)
        where = {"endpoint": "http://127.0.0.1"} if args.local else {}
        checked = HFSandboxProvider(image, **settings, **where)
        if not args.local:
            checked._resolve_token()  # fail now, with the hint, rather than mid-stage
    except (SandboxConfigError, InsecureURLError) as exc:
        source = " (from $HF_ENDPOINT)" if isinstance(exc, InsecureURLError) and os.environ.get("HF_ENDPOINT") else ""
        return _usage_error(str(exc) + source)
    out = sys.stderr if args.json else sys.stdout
    smoke, emulator, failure = _Smoke(out), None, None
    provider = None if args.local else checked

    def settle(name: str, action: Callable[[], Optional[str]]) -> None:
        """A teardown stage: Ctrl-C ends it, never the stages after it, and is reported, not a traceback."""
        nonlocal failure
        try:
            smoke.stage(name, action)
        except KeyboardInterrupt as exc:
            failure = _interruption(exc)

    undo_pool_settings: Optional[Callable[[], None]] = None
    with _interrupting():  # SIGTERM/SIGHUP (`timeout`, a CI cancel, a closed terminal) tear down as Ctrl-C does
        try:
            if args.local:
                emulator = module.JobsEmulator(**(SMOKE_POOL_EMULATOR if args.pool else {}))
                if smoke.stage("start local Jobs emulator",
                               lambda: "endpoint %s" % emulator.start().endpoint):
                    settings.update(endpoint=emulator.endpoint, token=emulator.token)
                    if args.pool:
                        undo_pool_settings = _local_pool_settings(settings, emulator)
                    provider = HFSandboxProvider(image, **settings)
            if provider is not None:
                with contextlib.ExitStack() as shown:
                    if not args.verbose:  # a start on the Hub may wait minutes: its log says what for
                        shown.enter_context(_library_log_shown(smoke.log_to_stages()))
                    started = smoke.stage("start_container (submit -> exposed URL)", lambda: "job %s at %s" % (
                        provider.start_container() and provider.job_id, provider.upstream_url))
                    ready = started and smoke.stage("wait_for_ready (/health through the proxy)",
                                                    lambda: provider.wait_for_ready())
                if ready:
                    _smoke_checks(smoke, provider.base_url or "", action)
        except KeyboardInterrupt as exc:
            failure = _interruption(exc)
        finally:
            if provider is not None:
                settle("stop_container (cancel job, unmount)", lambda: _stop_provider(provider))
                if args.pool and provider._pooled is not None:
                    settle("close pool %s (cancel the host jobs it booted)" % args.pool,
                           lambda: _close_pools(args.pool))
            if emulator is not None:
                settle("stop local Jobs emulator", lambda: _stop_emulator(emulator))
            if undo_pool_settings is not None:
                undo_pool_settings()
        if args.json:
            _emit(sys.stdout, json.dumps({
                "ok": smoke.ok and failure is None, "mode": "local" if args.local else "hub", "image": image,
                "job_id": provider.job_id if provider else None, "job_url": provider.job_url if provider else None,
                "timings": provider.timings if provider else {}, "stages": smoke.stages, "error": failure or next(
                    (s["detail"] for s in smoke.stages if not s["ok"]), None),
            }, indent=2) + "\n")
        else:
            smoke.say("\n" + smoke.table(failure))
            if provider is not None and provider.timings:
                smoke.say("job timings (s after submit): %s" % ", ".join(
                    "%s=%.2f" % item for item in sorted(provider.timings.items(), key=lambda kv: kv[1])))
    return EXIT_OK if smoke.ok and failure is None else EXIT_FAILED


def _pool_module() -> Any:
    """hf_sandbox_pool, imported only for --pool."""
    if __package__:
        from . import hf_sandbox_pool
    else:
        import hf_sandbox_pool
    return hf_sandbox_pool


def _local_pool_rejection(module: Any) -> Optional[str]:
    """Why `--local --pool` cannot run here (a package missing), or None: pooled placement needs a recent
    huggingface_hub, the emulator's sandbox hosts TLS certificates (`cryptography`). (The examples use it too.)"""
    return _pool_module().hub_rejection() or module.tls_rejection()


def _local_pool_settings(settings: Dict[str, Any], emulator: Any) -> Callable[[], None]:
    """`--local --pool`: huggingface_hub's clients trust the TLS emulator's CA and keep their pool
    cache in a temporary directory. Returns what undoes it (the directory removed)."""
    import tempfile

    import huggingface_hub.constants

    previous = os.environ.get("SSL_CERT_FILE"), huggingface_hub.constants.HF_HOME
    os.environ["SSL_CERT_FILE"] = emulator.ca_path
    home = huggingface_hub.constants.HF_HOME = tempfile.mkdtemp(prefix="hf-sandbox-smoke-")
    settings.update(verify=emulator.ca_path)

    def undo() -> None:
        shutil.rmtree(home, ignore_errors=True)
        huggingface_hub.constants.HF_HOME = previous[1]
        if previous[0] is None:
            os.environ.pop("SSL_CERT_FILE", None)
        else:
            os.environ["SSL_CERT_FILE"] = previous[0]

    return undo


def _close_pools(name: str) -> str:
    left = _pool_module().close_pools()
    if left:  # huggingface_hub's warning above says why
        raise SandboxError("host job(s) %s could not be cancelled and still run (and bill): cancel them with "
                           "`python -m hf_sandbox_provider sweep --pool %s`" % (", ".join(left), name))
    return "closed"


def _stop_provider(provider: "HFSandboxProvider") -> str:
    """stop_container(), which never raises: a job (or pooled sandbox) still live after it is a failure."""
    job_id = provider.job_id
    provider.stop_container()
    if not job_id:
        return "nothing to stop"
    if provider.stage not in TERMINAL_STAGES:
        raise SandboxError("job %s is still %s after stop_container(): its cancel failed (see the warning above) "
                           "and it bills until its job_timeout; `python -m hf_sandbox_provider sweep` cancels it"
                           % (job_id, provider.stage or "live"))
    return "job %s %s" % (job_id, provider.stage)


def _stop_emulator(emulator: Any) -> str:
    emulator.stop()
    live = emulator.live_pids()
    if live:
        raise SandboxError("job processes still alive: %s" % live)
    return "no job process left"


def _sweep_skip_reason(job: Mapping[str, Any], user: str) -> Optional[str]:
    """Why `sweep` must leave this listed job alone, or None. A label is a claim, not proof: only jobs
    the current user started are cancelled. (The listing holds only jobs carrying every label asked
    for, checked on each job: a Hub that ignored the filter hands sweep no other job.)"""
    if (job.get("status") or {}).get("stage") in TERMINAL_STAGES:
        return "already finished"
    initiator = job.get("initiator") or {}
    if initiator.get("name") != user:
        return "started by %s, not by %s" % (initiator.get("name") or "an unknown initiator", user)
    return None


def _job_age_s(job: Mapping[str, Any], now: float) -> Optional[float]:
    """Seconds since the job's `createdAt` (ISO 8601), or None when absent or unparseable."""
    created = job.get("createdAt")
    if not isinstance(created, str):
        return None
    try:
        moment = datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, now - moment.timestamp())


def _format_age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "age unknown"
    if seconds < 120:
        return "%ds old" % seconds
    return "%dm old" % (seconds // 60) if seconds < 7200 else "%.1fh old" % (seconds / 3600)


def _sweep_labels(given: Optional[Sequence[str]], base: Mapping[str, str]) -> Union[Dict[str, str], str]:
    """The --label filter as {key: value}, or why it is refused (a usage error, before any call): each
    must be KEY=VALUE under the Hub's label rule, one value per key, none contradicting `base` (sweep's own
    filter: the library's label, or the pool's)."""
    labels: Dict[str, str] = {}
    for item in given or ():
        key, sep, value = item.partition("=")
        if not sep:
            return "--label %r has no '=': give KEY=VALUE, e.g. %s" % (item, _SWEEP_LABEL_EXAMPLE)
        if not key:
            return "--label %r has an empty key: give KEY=VALUE, e.g. %s" % (item, _SWEEP_LABEL_EXAMPLE)
        reason = _label_rule_rejection({key: value})
        if reason:
            return "--label %r: %s; e.g. %s" % (item, reason, _SWEEP_LABEL_EXAMPLE)
        if labels.get(key, value) != value:
            return ("--label %s is given twice (%s=%s and %s=%s): a job carries one value per key, so no job "
                    "would match; keep one" % (key, key, labels[key], key, value))
        if base.get(key, value) != value:
            return ("--label %s=%s contradicts sweep's own filter %s=%s (sweep only touches this library's jobs, "
                    "or with --pool that pool's host jobs): drop it" % (key, value, key, base[key]))
        labels[key] = value
    return labels


def _run_sweep(args: Any) -> int:
    """Cancel (or with --dry-run, list) this library's jobs (those carrying every --label) the current user left
    scheduling or running."""
    try:
        endpoint = _resolve_endpoint(args.endpoint)
    except InsecureURLError as exc:
        return _usage_error(str(exc))
    older_than = None if args.older_than is None else _parse_duration(args.older_than)
    if args.older_than is not None and older_than is None:
        return _usage_error("--older-than %r is not a duration of at least 1 second: use seconds or a number "
                            "with s, m, h or d (e.g. 90s, 30m, 2h, 1d)" % args.older_than)
    labels = {PROVIDER_LABEL_KEY: PROVIDER_LABEL_VALUE}
    if args.pool is not None:  # the host jobs of a named pool (huggingface_hub's labels: hosts carry no label of ours)
        try:
            pools = _core._placement("pool")
        except ImportError as exc:  # a vendored copy without hf_sandbox_pool.py: the error names that file
            return _usage_error(str(exc))
        if pools.pool_rejection(args.pool):  # a name no pool can have would match nothing
            return _usage_error("--pool %r is not a pool name: 1-100 letters, digits, '-' or '_' (the name "
                                "smoke --pool and pool= take)" % args.pool)
        labels = {"hf-sandbox-mode": "pool", "hf-sandbox-pool": args.pool}
    wanted = _sweep_labels(args.label, labels)
    if isinstance(wanted, str):
        return _usage_error(wanted)
    token = _discover_token()
    if not token:
        return _usage_error("no Hugging Face token found: set HF_TOKEN or run `hf auth login`")
    client = _JobsClient(endpoint, token)
    with contextlib.ExitStack() as shown:
        if not args.verbose:  # (-v shows every record) a pause for the Hub's rate limit may last minutes
            shown.enter_context(_rate_limit_pauses_shown())
        return _sweep_with(client, args, labels, wanted, older_than)


def _rate_limit_pauses_shown() -> "contextlib.AbstractContextManager[None]":
    """Meanwhile the library's records of a pause for the Hub's rate limit ("Jobs API ...", INFO) go to
    stderr: without them a sweep that waits out a spent quota (up to 5 minutes) looks hung."""
    shown = logging.StreamHandler(sys.stderr)
    shown.addFilter(lambda record: record.levelno < logging.WARNING and record.getMessage().startswith("Jobs API"))
    shown.setFormatter(logging.Formatter("waiting: %(message)s"))
    return _library_log_shown(shown)


@contextlib.contextmanager
def _library_log_shown(handler: logging.Handler) -> Iterator[None]:
    """Meanwhile the library's logger hands its INFO records (and above) to `handler`; its level is put back
    after. (Without -v the command line shows none of them otherwise.)"""
    library_log = logging.getLogger("hf_sandbox_provider")
    level = library_log.level
    library_log.addHandler(handler)
    if library_log.getEffectiveLevel() > logging.INFO:
        library_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        library_log.removeHandler(handler)
        library_log.setLevel(level)


def _sweep_with(client: Any, args: Any, labels: Dict[str, str], wanted: Dict[str, str],
                older_than: Optional[float]) -> int:
    """The listing and the cancels of `_run_sweep`, on its client (closed here)."""
    cancelled: List[str] = []
    try:
        user = client.whoami_namespace()
        namespace = args.namespace or user
        found = client.list_jobs(namespace, labels={**labels, **wanted}, stages=_core.LIVE_STAGES)
        failed = swept = 0
        now = time.time()
        for job in found:
            job_id = str(job.get("id"))
            age = _job_age_s(job, now)
            carried = job.get("labels") if isinstance(job.get("labels"), Mapping) else {}
            pool = (", host of pool %s" % carried.get("hf-sandbox-pool")
                    if carried.get("hf-sandbox-mode") == "pool" else "")
            summary = "%s (%s, %s, %s%s)" % (job_id, (job.get("status") or {}).get("stage"),
                                             job.get("flavor") or "?", _format_age(age), pool)
            reason = _sweep_skip_reason(job, user)
            if reason is None and older_than is not None and (age is None or age < older_than):
                reason = "younger than %s" % args.older_than if age is not None else "its age is unknown"
            if reason:
                print("skipped %s: %s" % (summary, reason))
                continue
            swept += 1
            if args.dry_run:
                print("would cancel %s" % summary)
                continue
            outcome = _cancel_briefly(client, namespace, job_id)
            print("cancelled %s" % summary if outcome is None else "FAILED to cancel %s: %s" % (summary, outcome))
            failed += outcome is not None
            if outcome is None:
                cancelled.append(job_id)
        labelled = " labelled %s" % ", ".join("%s=%s" % item for item in wanted.items()) if wanted else ""
        print("%d leftover job(s) of %s in %s%s%s" % (swept, user, namespace, labelled,
                                                      " (dry run)" if args.dry_run else ""))
        if failed:
            print("error: %d of them could not be cancelled (see above): they run and bill on; run this sweep "
                  "again" % failed, file=sys.stderr)
        return EXIT_FAILED if failed else EXIT_OK
    except JobsAPIError as exc:
        print("error: %s" % exc, file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # one line saying what is done, not a traceback
        print("interrupted: %s" % ("cancelled %d job(s) so far: %s" % (len(cancelled), ", ".join(cancelled))
                                   if cancelled else "no job cancelled"), file=sys.stderr)
        return EXIT_FAILED
    finally:
        client.close()


def _parser() -> Any:
    import argparse  # only the command line needs it: a trainer importing the library never pays for it

    parser = argparse.ArgumentParser(prog="python -m hf_sandbox_provider",
                                     description="Run OpenEnv environments as HF Jobs behind a local auth proxy.")
    commands = parser.add_subparsers(dest="subcommand", metavar="{smoke,sweep,bench}")
    smoke = commands.add_parser("smoke", help="start one environment, check HTTP and WebSocket, tear down")
    smoke.add_argument("--local", action="store_true",
                       help="use the local HF Jobs emulator and its echo server: no token, no network")
    smoke.add_argument("--image", help="image to run (default: $HF_SANDBOX_IMAGE or %s)" % SMOKE_DEFAULT_IMAGE)
    smoke.add_argument("--command", help="server command in the job (default: OpenEnv's uvicorn "
                                         "command; the emulator plays it with its echo server)")
    smoke.add_argument("--flavor", default=DEFAULT_FLAVOR, help="hardware flavor (default %(default)s)")
    smoke.add_argument("--pool", metavar="NAME", help="pooled placement: a sandbox of the named SandboxPool's host "
                                                      "jobs instead of a dedicated job (docs/pool.md)")
    smoke.add_argument("--action", help="JSON action for /step (default: the echo environment's)")
    smoke.add_argument("--timeout", type=float, help="seconds allowed for the start and for readiness")
    smoke.add_argument("--json", action="store_true", help="print a JSON report on stdout (progress on stderr)")
    smoke.add_argument("-v", "--verbose", action="count", default=0, help="log the provider's progress")
    sweep = commands.add_parser("sweep", help="cancel this library's jobs still running in a namespace")
    sweep.add_argument("--dry-run", action="store_true", help="only list them")
    sweep.add_argument("--older-than", metavar="DURATION",
                       help="only jobs created at least this long ago (e.g. 90s, 30m, 2h, 1d): spares the "
                            "jobs of trainers still running")
    sweep.add_argument("--namespace", help="user or organisation (default: the token's user)")
    sweep.add_argument("--pool", metavar="NAME", help="cancel the host jobs of the named sandbox pool instead "
                                                      "(pooled placement; every sandbox on them ends too)")
    sweep.add_argument("--label", metavar="KEY=VALUE", action="append",
                       help="only jobs carrying this label, e.g. the %s=... a warning named; repeat it to "
                            "require several (all must match); combines with the other options" % START_LABEL_KEY)
    sweep.add_argument("--endpoint", help="Hub endpoint (default: $HF_ENDPOINT or %s)" % DEFAULT_ENDPOINT)
    sweep.add_argument("-v", "--verbose", action="count", default=0)
    commands.add_parser("bench", add_help=False,
                        help="lifecycle benchmark (runs benchmarks/lifecycle.py of a repository checkout; "
                             "`bench --help` lists its options)")
    return parser


def _run_bench(argv: Sequence[str]) -> int:
    """`bench`: a thin entry into benchmarks/lifecycle.py, which lives in the repository, not in the library."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks", "lifecycle.py")
    if not os.path.exists(path):
        print("error: `bench` runs benchmarks/lifecycle.py from a checkout of the hf-sandbox-provider repository; "
              "this copy of the module (%s) has none next to it" % os.path.abspath(__file__), file=sys.stderr)
        return EXIT_USAGE
    spec = importlib.util.spec_from_file_location("hf_sandbox_provider_lifecycle_bench", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return int(module.main(list(argv), prog="python -m hf_sandbox_provider bench"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `python -m hf_sandbox_provider`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _run_bench(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.subcommand is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return _run_smoke(args) if args.subcommand == "smoke" else _run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
