"""The emulator's OpenEnv echo environment (HTTP /health /reset /step, WebSocket /ws) served on a unix
socket, as a pooled sandbox's server: `python uds_echo_env.py [SOCKET] [--one-session] [--crash-after S]`.

SOCKET defaults to $HF_SANDBOX_SOCKET (set by hf_sandbox_pool's server command). `--one-session` refuses
a second concurrent WebSocket session like an OpenEnv server without concurrent sessions (an error
message, then close); `--crash-after S` exits with status 3 after S seconds, printing a line first.
"""
from __future__ import annotations

import os
import signal
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import hf_jobs_emulator as emulator  # noqa: E402


class UnixEchoServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 1024


def main(argv: list) -> int:
    args = [a for a in argv if not a.startswith("--")]
    path = args[0] if args else os.environ["HF_SANDBOX_SOCKET"]
    one_session = "--one-session" in argv
    crash_after = float(argv[argv.index("--crash-after") + 1]) if "--crash-after" in argv else None
    if crash_after is not None and crash_after <= 0:
        print("uds_echo_env: crashing at boot as asked", flush=True)
        return 3
    state = emulator.EchoServer.__new__(emulator.EchoServer)  # the echo server's state, without its TCP listener
    state.host, state.step_delay_s = "uds", 0.0
    state.http_env, state.http_lock = emulator.EchoEnvironment(), threading.Lock()
    sessions = threading.BoundedSemaphore(1)

    class Handler(emulator._EchoHandler):
        server_ref = state

        def setup(self) -> None:
            BaseHTTPRequestHandler.setup(self)  # no TCP_NODELAY on a unix socket

        def address_string(self) -> str:
            return "uds"

        def do_GET(self) -> None:
            if one_session and self.path.startswith("/ws"):
                if not sessions.acquire(blocking=False):
                    self.send_json(503, {"detail": "SessionCapacityError: this server serves one session"})
                    return
                try:
                    super().do_GET()
                finally:
                    sessions.release()
                return
            super().do_GET()

        do_POST = do_PUT = do_DELETE = do_GET

    if os.path.exists(path):
        os.unlink(path)
    server = UnixEchoServer(path, Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print("uds_echo_env: serving on %s" % path, flush=True)
    if crash_after is not None:
        def crash() -> None:
            time.sleep(crash_after)
            print("uds_echo_env: crashing as asked", flush=True)
            os._exit(3)
        threading.Thread(target=crash, daemon=True).start()
    server.serve_forever(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
