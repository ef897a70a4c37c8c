"""Issue row 20: Redis full (`maxmemory` with `noeviction`) made `hangdx worker` exit, never to come back.

A real redis-server of its own, filled past its maxmemory so that every write is refused with OOM (as a Redis
shared with other services, or one whose RQ results piled up, refuses). The worker waits it out as it waits
out a lost connection, says so, and works again once there is room."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import redis
from rq import Worker

from hangdx.bot.incidents import IncidentStore

from .test_incidents import start_redis, stop_redis


def _fill(conn: redis.Redis) -> None:
    """Past maxmemory, every write is refused (noeviction): OOM command not allowed."""
    blob = b"x" * (256 * 1024)
    for i in range(16):
        conn.set(f"filler:{i}", blob)
    conn.config_set("maxmemory-policy", "noeviction")
    used = int(conn.info("memory")["used_memory"])
    conn.config_set("maxmemory", str(used - 2 * 1024 * 1024))  # well under what is used: no write fits
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        conn.hset("hangdx:probe", "a", "b")


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


def test_the_worker_waits_out_a_full_redis_and_works_again(tmp_path):
    proc, url = start_redis(str(tmp_path))
    worker = None
    try:
        conn = redis.Redis.from_url(url)
        # A diagnosis whose worker died: the reaper's pass writes to requeue it, and meets the full Redis too.
        IncidentStore(conn).claim_run("4242", "rq-gone", {"job_id": "4242"}, {})
        _fill(conn)
        log = open(tmp_path / "worker.log", "wb")
        worker = subprocess.Popen(
            [sys.executable, "-m", "hangdx.bot.worker", url],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HANGDX_NOTIFIER": "", "HANGDX_REAP_INTERVAL": "0.2", "HANGDX_LOCK_TTL": "1"},
        )
        said = lambda: (tmp_path / "worker.log").read_text(errors="replace")  # noqa: E731
        assert _wait(lambda: "full" in said() or worker.poll() is not None, 30), said()
        time.sleep(2.0)  # a few more tries at registering, all refused
        assert worker.poll() is None, f"the worker exited ({worker.returncode}): {said()[-1500:]}"
        assert Worker.all(connection=conn) == []  # it could not register: nothing was written
        assert "reaper: redis is full" in said() and "Traceback" not in said(), said()[-1500:]
        conn.delete("hangdx:run:4242", "hangdx:runs")  # (deleting is allowed when full) no diagnosis to run
        conn.config_set("maxmemory", "0")  # room again (an operator raised the limit or freed keys)
        assert _wait(lambda: len(Worker.all(connection=conn)) == 1, 60), said()[-1500:]
        assert worker.poll() is None and "working again" in said()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
    finally:
        if worker is not None and worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
        stop_redis(proc)
