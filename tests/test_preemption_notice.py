"""The preemption-notice poller against a real HTTP server on 127.0.0.1 (AWS spot format)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stoker.runtime.preemption import StopFlag


class SpotEndpoint(BaseHTTPRequestHandler):
    """404 until ``notice`` is set, then 200 with the instance-action JSON."""

    notice: dict | None = None
    requests = 0

    def do_GET(self):  # noqa: N802 - http.server's naming
        type(self).requests += 1
        if self.notice is None:
            self.send_response(404)
            self.end_headers()
            return
        body = json.dumps(self.notice).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_spot_notice_sets_the_stop_flag():
    server = ThreadingHTTPServer(("127.0.0.1", 0), SpotEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/latest/meta-data/spot/instance-action"
    try:
        flag = StopFlag()
        flag.watch_notice_url(url, interval_s=0.05)
        time.sleep(0.5)
        assert SpotEndpoint.requests >= 3 and not flag.requested  # 404: no notice yet
        SpotEndpoint.notice = {"action": "terminate", "time": "2026-11-30T08:00:00Z"}
        deadline = time.monotonic() + 5
        while not flag.requested and time.monotonic() < deadline:
            time.sleep(0.02)
        assert flag.requested and "terminate" in flag.reason and url in flag.reason
    finally:
        server.shutdown()
