"""Hardening 21.18: the bot token goes only to Slack's file host or to the configured API URL's own port, and a
file that trickles in stops at the request's download deadline, said in what was skipped."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hangdx.bot import pasted


def test_the_token_goes_to_no_other_port_of_the_allowed_hosts():
    api = "http://127.0.0.1:8888/api/"
    assert pasted._allowed_host("http://127.0.0.1:8888/files/x.log", api)
    assert not pasted._allowed_host("http://127.0.0.1:9999/files/x.log", api)  # another port of loopback
    assert not pasted._allowed_host("http://127.0.0.1/files/x.log", api)  # port 80
    assert not pasted._allowed_host("https://127.0.0.1:8888/files/x.log", api)  # another scheme
    assert pasted._allowed_host("https://files.slack.com/files-pri/T1-F1/x.log", None)
    assert not pasted._allowed_host("https://files.slack.com:8443/files-pri/T1-F1/x.log", None)
    assert not pasted._allowed_host("http://files.slack.com/files-pri/T1-F1/x.log", None)
    assert not pasted._allowed_host("https://files.slack.com:99999/x.log", None)  # not a port at all


class _Trickle(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            for _ in range(100000):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.25)
        except OSError:
            pass

    def log_message(self, *args):
        pass


def test_a_trickling_file_stops_at_the_deadline_and_says_what_was_not_read(monkeypatch):
    monkeypatch.setattr(pasted, "DOWNLOAD_DEADLINE", 2)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        budget = pasted.Budget()
        assert budget.deadline - time.monotonic() <= 2.5
        dl = pasted._Download("slow.log", f"http://127.0.0.1:{server.server_port}/f", "xoxb-test", budget)
        started = time.monotonic()
        got = b""
        while chunk := dl.read(8 << 20):
            got += chunk
        took = time.monotonic() - started
        assert took < 2 + pasted.DOWNLOAD_TIMEOUT, took  # never RQ's 300 s
        assert 0 < len(got) < 100000
        assert budget.skipped == ["slow.log: the rest not read: downloads past 2 s were stopped"]
    finally:
        server.shutdown()
        server.server_close()
