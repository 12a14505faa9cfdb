"""The preemption-notice poller against a real HTTP server on 127.0.0.1 (AWS spot format)."""

from __future__ import annotations

import json
import logging
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


class TokenEndpoint(BaseHTTPRequestHandler):
    """IMDSv2: GET answers 401 without the session token from ``PUT /latest/api/token``."""

    TOKEN = "AQAEAtoken=="
    notice: dict | None = None
    token_requests = 0

    def do_PUT(self):  # noqa: N802
        if self.path != "/latest/api/token" or \
                not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self.send_response(400)
            self.end_headers()
            return
        type(self).token_requests += 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.TOKEN.encode())

    def do_GET(self):  # noqa: N802
        if self.headers.get("X-aws-ec2-metadata-token") != self.TOKEN:
            self.send_response(401)
            self.end_headers()
            return
        self._answer()

    def _answer(self):
        if self.notice is None:
            self.send_response(404)
            self.end_headers()
            return
        body = json.dumps(self.notice).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve(handler) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/latest/meta-data/spot/instance-action"


def test_a_notice_behind_an_imdsv2_token_is_seen():
    server, url = serve(TokenEndpoint)
    try:
        flag = StopFlag()
        flag.watch_notice_url(url, interval_s=0.05)
        time.sleep(0.3)
        assert not flag.requested
        TokenEndpoint.notice = {"action": "stop", "time": "2026-11-30T08:00:00Z"}
        deadline = time.monotonic() + 5
        while not flag.requested and time.monotonic() < deadline:
            time.sleep(0.02)
        assert flag.requested and "stop" in flag.reason
        assert TokenEndpoint.token_requests >= 1
    finally:
        server.shutdown()


class BrokenEndpoint(BaseHTTPRequestHandler):
    def do_PUT(self):  # noqa: N802
        self.send_response(404)
        self.end_headers()

    def do_GET(self):  # noqa: N802
        self.send_response(403)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_an_erroring_notice_endpoint_is_warned_about_once(caplog):
    server, url = serve(BrokenEndpoint)
    try:
        with caplog.at_level(logging.WARNING, logger="stoker.runtime.preemption"):
            flag = StopFlag()
            flag.watch_notice_url(url, interval_s=0.02)
            time.sleep(0.5)
            flag.request("test over")
        warnings = [r for r in caplog.records if "answered HTTP 403" in r.getMessage()]
        assert len(warnings) == 1 and url in warnings[0].getMessage()
    finally:
        server.shutdown()


def test_the_stop_line_names_who_sent_the_signal(tmp_path):
    """The ranks only see the launcher's SIGTERM: after Ctrl-C to stoker run, or a stoker stop,
    they said "stop requested (SIGTERM)". The sender's record names it; an older record (an
    earlier stop's) or a damaged one does not."""
    import json
    import time

    from stoker.runtime.preemption import STOP_SENDER_FILE, record_stop_sender

    flag = StopFlag()
    assert flag.describe(tmp_path, 0.0) == "another rank"  # learned from its peers
    flag.request("SIGTERM")
    assert flag.describe(tmp_path, 0.0) == "SIGTERM"  # a spot reclaim, docker stop: no record
    since = time.time()
    (tmp_path / STOP_SENDER_FILE).write_text(json.dumps({"sender": "old", "time": since - 60}))
    assert flag.describe(tmp_path, since) == "SIGTERM"  # an earlier stop's record
    (tmp_path / STOP_SENDER_FILE).write_text('{"sender": "stoker run got SIGINT (Ctr')  # torn
    assert flag.describe(tmp_path, since) == "SIGTERM"
    (tmp_path / STOP_SENDER_FILE).write_text(json.dumps({"sender": "forged",  # trial
                                                          "time": 9999999999}))
    assert flag.describe(tmp_path, since) == "SIGTERM"  # a future time is no stop of this one
    record_stop_sender(tmp_path, "stoker run got SIGINT (Ctrl-C)")
    assert flag.describe(tmp_path, since) == "SIGTERM: stoker run got SIGINT (Ctrl-C)"
    # A stop request (stoker stop, the cost guard) is what the signal carries out: it wins.
    (tmp_path / "stop-requested.json").write_text(json.dumps(
        {"by": "user", "reason": "maintenance", "time": time.time()}))
    assert flag.describe(tmp_path, since) == "SIGTERM: stopped by user: maintenance"
    record_stop_sender(tmp_path / "missing-folder", "x")  # never raises
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / STOP_SENDER_FILE).mkdir()  # second trial: a folder in its place
    record_stop_sender(tmp_path / "blocked", "x")
    assert [p.name for p in (tmp_path / "blocked").iterdir()] == [STOP_SENDER_FILE]  # no .tmp
    notice = StopFlag()
    notice.request("preemption notice (terminate) from http://169.254.169.254/")
    assert notice.describe(tmp_path, since).startswith("preemption notice")  # not a signal
