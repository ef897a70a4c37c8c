"""Issue 10.4: `hangdx serve` under half-sent requests.

The attack: thousands of connections that send part of a request and then nothing. werkzeug's development server
gave each a thread with no read timeout: file descriptors ran out, the bot stopped answering, and it ignored
SIGTERM. `hangdx serve` (waitress) bounds the connections it holds, drops idle ones, keeps answering, keeps its
memory, and ends on SIGTERM while attacked."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from hangdx.bot.incidents import connect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bot.test_end_to_end import free_port, wait_for  # noqa: E402
from slack_standin import SlackStandin  # noqa: E402

ATTACKERS = 3000
ALERT_TOKEN = "alert-token-0123456789abcdef"


def _healthz(url: str, timeout: float = 2.0) -> bool:
    try:
        return requests.get(url + "/healthz", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture
def serve(redis_url, tmp_path):
    connect(redis_url).flushdb()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, ATTACKERS + 1024), hard))  # the attacker's side
    with SlackStandin() as slack:
        port = free_port()
        env = {**os.environ, "SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxtest",
               "SLACK_SIGNING_SECRET": "8f742231b10e8888abcd99yyyzzz85a5", "SLACK_API_URL": slack.url,
               "REDIS_URL": redis_url, "HANGDX_ALERT_TOKEN": ALERT_TOKEN}  # fmt: skip
        env.pop("SLACK_APP_TOKEN", None)
        log = open(tmp_path / "serve.log", "wb")
        # The bot's own limit stays the usual 1024: it must not need more.
        proc = subprocess.Popen(
            [sys.executable, "-m", "hangdx", "serve", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=log,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)),
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for("the bot's /healthz", lambda: _healthz(url), timeout=30)
            yield proc, port, url
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_half_sent_requests_neither_exhaust_the_bot_nor_stop_it_answering_or_ending(serve):
    proc, port, url = serve
    socks = []
    try:
        for _ in range(ATTACKERS):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        time.sleep(0.5)
        for s in socks:
            try:
                s.send(b"POST /slack/events HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n")  # and no more
            except OSError:
                pass
        time.sleep(2)
        assert proc.poll() is None
        assert _fds(proc.pid) < 1000, "connections held beyond the server's limit"
        # Idle connections are dropped: the bot answers again while the attackers still hold their sockets.
        assert wait_for("an answer during the attack", lambda: _healthz(url, 5), timeout=60)
        assert _rss_mb(proc.pid) < 400
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)  # ends on SIGTERM, attacked or not
        assert proc.returncode == 0
    finally:
        for s in socks:
            s.close()


def _head_only(port: int, path: str, length: int, auth: str | None = None) -> bytes:
    """Send a POST's headers announcing `length` bytes and none of them; what the server answers in 3 s."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        extra = f"Authorization: Bearer {auth}\r\n" if auth else ""
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
                  f"Content-Length: {length}\r\n\r\n".encode())  # fmt: skip
        try:
            return s.recv(200)
        except TimeoutError:
            return b""  # still waiting for the body: it would be buffered


def test_bodies_are_capped_per_route_when_their_headers_arrive(serve):
    # Hardening 21.5: unauthenticated bodies up to 64 MiB were buffered on every route before any check.
    _proc, port, _url = serve
    for path, auth in (("/slack/events", None), ("/alerts", None), ("/alerts", "wrong-token-0123456789"),
                       ("/healthz", None)):  # fmt: skip
        said = _head_only(port, path, 32 << 20, auth)
        assert said.startswith(b"HTTP/1.1 413"), (path, auth, said)
    # Alertmanager with the token may send a big group: its body is awaited, not refused.
    assert _head_only(port, "/alerts", 8 << 20, ALERT_TOKEN) == b""


def test_one_clients_idle_flood_leaves_the_bot_answering_others(serve):
    # Hardening 21.5: 900+ idle connections, reopened as they were dropped, stopped /healthz answering in 3 s.
    proc, port, url = serve
    stop = threading.Event()

    def flood() -> None:
        held: list[socket.socket] = []
        while not stop.is_set():
            held = [s for s in held if s.fileno() != -1]
            while len(held) < 1500 and not stop.is_set():
                s = socket.socket()
                s.setblocking(False)
                s.bind(("127.0.0.2", 0))  # the attacker: another address of this machine's loopback
                s.connect_ex(("127.0.0.1", port))
                held.append(s)
            for s in list(held):  # reopen what the server dropped
                try:
                    if s.recv(1, socket.MSG_PEEK) == b"":
                        s.close()
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
            time.sleep(0.2)
        for s in held:
            s.close()

    attacker = threading.Thread(target=flood, daemon=True)
    attacker.start()
    try:
        time.sleep(2)
        slow = []
        for _ in range(10):
            started = time.monotonic()
            ok = _healthz(url, 3)
            if not ok or time.monotonic() - started > 3:
                slow.append(round(time.monotonic() - started, 2))
            time.sleep(0.3)
        assert slow == [], f"/healthz unanswered within 3 s under the flood: {slow}"
        assert proc.poll() is None
    finally:
        stop.set()
        attacker.join(timeout=20)
