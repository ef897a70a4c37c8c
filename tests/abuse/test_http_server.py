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
import time
from pathlib import Path

import pytest
import requests

from hangdx.bot.incidents import connect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bot.test_end_to_end import free_port, wait_for  # noqa: E402
from slack_standin import SlackStandin  # noqa: E402

ATTACKERS = 3000


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
               "REDIS_URL": redis_url}  # fmt: skip
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
