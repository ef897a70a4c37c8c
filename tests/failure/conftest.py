"""Fixtures of the failure tests: their own redis-server (append-only, restartable), the Slack stand-in, the
bot's processes and fake ranks, all ended by PID when the test ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from hangdx.bot.config import BotConfig
from hangdx.bot.diagnosis import DiagnoseOptions
from hangdx.bot.service import Service, slack_client

from .harness import (
    CHANNEL,
    REDIS,
    TOKEN,
    FakeRanks,
    Processes,
    RedisServer,
    Slack,
    bot_env,
    free_port,
    healthy,
    wait_for,
    worker_count,
)


@pytest.fixture
def rs(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def conn(rs: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(rs.url, socket_connect_timeout=2, socket_timeout=10)


@pytest.fixture
def slack() -> Iterator[Slack]:
    with Slack() as s:
        yield s


@pytest.fixture
def ranks() -> Iterator[FakeRanks]:
    r = FakeRanks()
    try:
        yield r
    finally:
        r.stop()


class Bot:
    """The bot as a team runs it: `hangdx serve` (optional) and `hangdx worker` processes."""

    def __init__(self, rs: RedisServer, slack: Slack, conn: redis.Redis, log: Path) -> None:
        self.rs, self.slack, self.conn, self.log = rs, slack, conn, log
        self.procs = Processes(bot_env(rs.url, slack), log)
        self.url = ""

    def workers(self, n: int) -> Bot:
        before = worker_count(self.conn)
        for _ in range(n):
            self.procs.worker()
        wait_for(f"{n} RQ workers", lambda: worker_count(self.conn) >= before + n, timeout=60)
        return self

    def serve(self) -> Bot:
        port = free_port()
        self.procs.serve(port)
        self.url = f"http://127.0.0.1:{port}"
        wait_for("the bot's /healthz", lambda: healthy(self.url), timeout=60)
        return self

    def service(self, opts: DiagnoseOptions) -> Service:
        """The object `serve` runs, in this process, with diagnosis options a test chooses."""
        cfg = BotConfig(bot_token=TOKEN, api_url=self.slack.url, redis_url=self.rs.url, alert_channel=CHANNEL)

        class Tuned(Service):
            def options(self, req):  # noqa: ANN001, ANN202
                return opts

        return Tuned(cfg, client=slack_client(cfg))

    def log_text(self) -> str:
        self.procs.log.flush()
        return self.log.read_text(errors="replace")


@pytest.fixture
def bot(rs: RedisServer, slack: Slack, conn: redis.Redis, tmp_path: Path) -> Iterator[Bot]:
    b = Bot(rs, slack, conn, tmp_path / "bot.log")
    try:
        yield b
    finally:
        b.procs.stop()
