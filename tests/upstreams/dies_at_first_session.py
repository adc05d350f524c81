"""An environment server that answers /health 200 until its first WebSocket upgrade, which it refuses with 500,
and /health 503 from then on: a server that dies as the first session arrives, seen through a live host."""
import http.server
import os

state = {"dead": False}


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # type: ignore[no-untyped-def]
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/health"):
            code = 503 if state["dead"] else 200
        else:
            state["dead"], code = True, 500
        body = b'{"status": "healthy"}' if code == 200 else b"down"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
