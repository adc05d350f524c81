"""A lean stand-in for a pooled environment server: OpenEnv's echo environment (HTTP /health /reset /step
/state, WebSocket /ws) on a unix socket, in the standard library's socket, json, hashlib and threading only.

    python -I -S uds_echo_lean.py [SOCKET]        # SOCKET defaults to $HF_SANDBOX_SOCKET

benchmarks/pool.py starts 64 of these at once on this 2-core machine, where every server's start-up CPU
competes with the emulator and the client. `uds_echo_env.py` (the emulator's echo server, which imports
hf_jobs_emulator and proxy) needs ~0.08 CPU-seconds to start; this one a fraction of it. It answers the
benchmark's requests as that server does (the same JSON), nothing more: no request validation, no
per-message deflate, no `--one-session`/`--crash-after` (the tests use uds_echo_env.py).
"""
import base64
import hashlib
import json
import os
import signal
import socket
import struct
import sys
import threading

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455's accept-key constant
MAX_HEAD_BYTES = 64 * 1024


class Echo:
    """OpenEnv's echo environment: observations echo the message; reward 0.1 per character."""

    def __init__(self):
        self.episode_id, self.step_count = _episode_id(), 0

    def reset(self, data):
        self.episode_id, self.step_count = data.get("episode_id") or _episode_id(), 0
        return _observation("Echo environment ready!", 0.0)

    def step(self, data):
        self.step_count += 1
        message = str(data.get("message", ""))
        return _observation(message, len(message) * 0.1)

    def state(self):
        return {"episode_id": self.episode_id, "step_count": self.step_count}


def _episode_id():
    raw = os.urandom(16).hex()  # a random id shaped like a uuid4 (the uuid module costs more to import)
    return "%s-%s-%s-%s-%s" % (raw[:8], raw[8:12], raw[12:16], raw[16:20], raw[20:])


def _observation(message, reward):
    return {"observation": {"echoed_message": message, "message_length": len(message)}, "reward": reward,
            "done": False}


HTTP_ENV = Echo()
HTTP_LOCK = threading.Lock()


def serve(conn):
    """One client connection: HTTP/1.1 requests (keep-alive) until a WebSocket upgrade or the end."""
    buffer = b""
    try:
        while True:
            while b"\r\n\r\n" not in buffer:
                chunk = conn.recv(65536)
                if not chunk or len(buffer) > MAX_HEAD_BYTES:
                    return
                buffer += chunk
            head, buffer = buffer.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ")[:2]
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            size = int(headers.get("content-length") or 0)
            while len(buffer) < size:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buffer += chunk
            body, buffer = buffer[:size], buffer[size:]
            path = path.split("?", 1)[0]
            if path == "/ws" and "websocket" in headers.get("upgrade", "").lower():
                key = headers.get("sec-websocket-key", "").encode()
                accept = base64.b64encode(hashlib.sha1(key + WS_GUID).digest()).decode()
                conn.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                              "Sec-WebSocket-Accept: %s\r\n\r\n" % accept).encode())
                return websocket(conn, buffer)
            status, payload = http_answer(method, path, body)
            data = json.dumps(payload).encode()
            conn.sendall(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
                status, b"OK" if status == 200 else b"Error", len(data), data))
            if headers.get("connection", "").lower() == "close":
                return
    except (OSError, ValueError):
        return
    finally:
        conn.close()


def http_answer(method, path, body):
    request = json.loads(body) if body.strip() else {}
    with HTTP_LOCK:
        if path == "/health":
            return 200, {"status": "healthy"}
        if path == "/reset" and method == "POST":
            return 200, HTTP_ENV.reset(request)
        if path == "/step" and method == "POST":
            return 200, HTTP_ENV.step(request.get("action") or {})
        if path == "/state":
            return 200, HTTP_ENV.state()
    return 404, {"detail": "Not Found"}


def websocket(conn, buffer):
    """One OpenEnv session: JSON text messages {type: reset|step|state|close, data}, each answered."""
    env, parts = Echo(), []
    while True:
        frame = read_frame(conn, buffer)
        if frame is None:
            return
        opcode, fin, payload, buffer = frame
        if opcode == 8:  # close: answer it
            conn.sendall(b"\x88\x02\x03\xe8")
            return
        if opcode == 9:  # ping
            send_frame(conn, 10, payload)
            continue
        if opcode in (0, 1):
            parts.append(payload)
            if not fin:
                continue
            message, parts = json.loads(b"".join(parts)), []
            kind, data = message.get("type"), message.get("data") or {}
            if kind == "close":
                conn.sendall(b"\x88\x02\x03\xe8")
                return
            if kind == "reset":
                reply = {"type": "observation", "data": env.reset(data)}
            elif kind == "step":
                reply = {"type": "observation", "data": env.step(data)}
            elif kind == "state":
                reply = {"type": "state", "data": env.state()}
            else:
                reply = {"type": "error", "data": {"message": "Unknown message type: %s" % kind,
                                                   "code": "UNKNOWN_TYPE"}}
            send_frame(conn, 1, json.dumps(reply).encode())


def read_frame(conn, buffer):
    """(opcode, fin, unmasked payload, rest of the buffer), or None at the end of the stream."""
    def need(n):
        nonlocal buffer
        while len(buffer) < n:
            chunk = conn.recv(65536)
            if not chunk:
                raise EOFError
            buffer += chunk
    try:
        need(2)
        fin, opcode, masked, length = buffer[0] >> 7, buffer[0] & 15, buffer[1] >> 7, buffer[1] & 127
        at = 2
        if length == 126:
            need(4)
            length, at = struct.unpack("!H", buffer[2:4])[0], 4
        elif length == 127:
            need(10)
            length, at = struct.unpack("!Q", buffer[2:10])[0], 10
        mask = b""
        if masked:
            need(at + 4)
            mask, at = buffer[at:at + 4], at + 4
        need(at + length)
    except EOFError:
        return None
    payload, buffer = buffer[at:at + length], buffer[at + length:]
    if masked:
        payload = bytes(b ^ mask[i & 3] for i, b in enumerate(payload))
    return opcode, fin, payload, buffer


def send_frame(conn, opcode, payload):
    n = len(payload)
    head = bytes([0x80 | opcode]) + (bytes([n]) if n < 126 else b"\x7e" + struct.pack("!H", n) if n < 65536
                                     else b"\x7f" + struct.pack("!Q", n))
    conn.sendall(head + payload)


def main(argv):
    path = argv[0] if argv else os.environ["HF_SANDBOX_SOCKET"]
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1024)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print("uds_echo_lean: serving on %s" % path, flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
