"""The emulator's echo environment on a unix socket with two faults the pool tests need:
`python uds_echo_env.py [SOCKET] [--one-session] [--crash-after S]`.

Without a fault, use the emulator's own echo server (`hf_jobs_emulator.echo_server_command()`),
which binds `$SBX_PROXY_DIR/<port>.sock` itself in a pooled sandbox. SOCKET defaults to
$HF_SANDBOX_SOCKET (set by hf_sandbox_pool's server command). `--one-session` refuses a second
concurrent WebSocket session like an OpenEnv server without concurrent sessions (an error message,
then close); `--crash-after S` exits with status 3 after S seconds, printing a line first.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import hf_jobs_emulator as emulator  # noqa: E402


def main(argv: list) -> int:
    args = [a for a in argv if not a.startswith("--")]
    path = args[0] if args else os.environ["HF_SANDBOX_SOCKET"]
    one_session = "--one-session" in argv
    crash_after = float(argv[argv.index("--crash-after") + 1]) if "--crash-after" in argv else None
    if crash_after is not None and crash_after <= 0:
        print("uds_echo_env: crashing at boot as asked", flush=True)
        return 3
    server = emulator.EchoServer(unix_socket=path)
    if one_session:
        sessions = threading.BoundedSemaphore(1)

        class OneSession(server._server.RequestHandlerClass):  # type: ignore[name-defined,misc]
            def do_GET(self) -> None:
                if not self.path.startswith("/ws"):
                    return super().do_GET()
                if not sessions.acquire(blocking=False):
                    busy = "SessionCapacityError: this server serves one session"
                    return self.send_json(503, {"detail": busy})
                try:
                    super().do_GET()
                finally:
                    sessions.release()

        server._server.RequestHandlerClass = OneSession
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    server.start()
    print("uds_echo_env: serving on %s" % path, flush=True)
    if crash_after is not None:
        def crash() -> None:
            time.sleep(crash_after)
            print("uds_echo_env: crashing as asked", flush=True)
            os._exit(3)
        threading.Thread(target=crash, daemon=True).start()
    done.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
