"""Reward servers on the loopback, as OpenRLHF's examples write them (``--reward.remote_url``)."""

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def reward_servers(n: int = 1):
    """(``n`` URLs, state): each server records the JSON it was POSTed in ``state["bodies"]`` as
    (port, body) and answers ``{"rewards": [...]}``, a reward per query: its length / 100, or,
    once ``state["reply"]`` is set, that reply."""
    state = {"bodies": [], "reply": None}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["bodies"].append((self.server.server_port, body))
            reply = state["reply"] or {"rewards": [len(q) / 100 for q in body["query"]]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(n)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        yield [f"http://127.0.0.1:{s.server_port}/get_reward" for s in servers], state
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
