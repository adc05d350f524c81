"""A stdlib `http.server` upstream for the differential suite, in its own process, for what uvicorn
cannot be made to send: close-delimited bodies, HTTP/1.0 answers, 103 Early Hints.
`python tests/upstreams/stdlib_server.py [--tls CERT KEY]` prints its port, then serves.
"""
from __future__ import annotations

import http.server
import os
import ssl
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TOKEN = os.environ.get("DIFF_TOKEN", "")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "stdlib-upstream"
    sys_version = ""

    def log_message(self, format, *args):  # type: ignore[no-untyped-def]
        pass

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        if name.startswith("do_"):
            return self._serve
        raise AttributeError(name)

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return common.read_chunked(self.rfile)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _serve(self) -> None:
        body = self._body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        status, out, payload, options = common.plan(self.command, self.path, body, headers, TOKEN)
        if options.get("interim") and self.request_version == "HTTP/1.1":  # never 1xx to 1.0 (RFC 9110 15.2)
            self.wfile.write(b"HTTP/1.1 103 Early Hints\r\nLink: </hint.css>; rel=preload\r\n\r\n")
        mode = options.get("mode", "length")
        if status in (204, 304):
            mode = "length"
        self.send_response(status)
        for name, value in out:
            self.send_header(name, value)
        if mode == "length":
            self.send_header("Content-Length", str(len(payload)))
        elif mode == "chunked":
            self.send_header("Transfer-Encoding", "chunked")
        if mode == "close" or options.get("close"):
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command == "HEAD" or status in (204, 304):
            return
        step = max(1, len(payload) // 4) if options.get("slow") else max(1, len(payload))
        for i in range(0, len(payload), step):
            piece = payload[i:i + step]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if mode == "chunked" else piece)
            if options.get("slow"):
                time.sleep(0.003)
        if mode == "chunked":
            self.wfile.write(b"0\r\n\r\n")


def main() -> None:
    args = sys.argv[1:]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.handle_error = lambda request, client_address: None  # a client (the fuzz tests) hanging up is normal
    if "--tls" in args:
        cert, key = args[args.index("--tls") + 1:args.index("--tls") + 3]
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
