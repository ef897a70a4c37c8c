"""`hangdx worker`: an RQ worker on the "hangdx" queue (python -m hangdx.bot.worker [REDIS_URL] [--burst]).

Besides running diagnoses it runs the reaper (queue.reap) every HANGDX_REAP_INTERVAL seconds, and it outlives
Redis restarts and a full Redis (maxmemory with noeviction: every write refused with OOM): when RQ's loop gives
up, the worker waits until Redis answers and takes a write again, then starts again (SIGTERM or SIGINT while
waiting ends it cleanly). A diagnosis running meanwhile keeps its verdict by retrying.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import redis
from rq import Worker
from rq.serializers import JSONSerializer

from hangdx.bot.queue import DEFAULT_REDIS_URL, Reaper, check_settings, notifier_say, worker_queues

log = logging.getLogger("hangdx.worker")
# What the worker waits out: Redis gone, slow, or full (maxmemory reached with noeviction refuses every write).
UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.OutOfMemoryError,
)
WRITE_PROBE = "hangdx:worker:writable"


def _why(e: Exception) -> str:
    if isinstance(e, redis.exceptions.OutOfMemoryError):
        return f"full (maxmemory reached, writes refused: {' '.join(str(e).split())[:160]})"
    return f"unavailable ({e})"


class HangdxWorker(Worker):
    """RQ's forking worker, whose heartbeats while a diagnosis runs survive a Redis outage."""

    def maintain_heartbeats(self, job, execution):  # noqa: ANN001 - RQ's signature
        try:
            super().maintain_heartbeats(job, execution)
        except UNAVAILABLE as e:
            self.log.warning("Worker %s: heartbeat skipped, redis is %s", self.name, _why(e))


def _wait_for_redis(conn: redis.Redis, stop: threading.Event) -> bool:
    """Try with backoff until Redis answers and takes a write (True) or a stop signal comes (False). A full
    Redis answers PING; only a write shows that there is room again."""
    wait = 0.5
    while not stop.is_set():
        try:
            conn.ping()
            conn.set(WRITE_PROBE, "1", px=5000)
            return True
        except redis.exceptions.RedisError as e:
            log.warning("hangdx worker: redis is %s; trying again in %.1f s", _why(e), wait)
            stop.wait(wait)
            wait = min(wait * 2, 30.0)
    return False


def main(redis_url: str | None = None, burst: bool = False) -> int:
    """Run a worker until stopped (or, with burst, until the queue is empty); 0 on a clean stop."""
    url = redis_url or os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    try:
        check_settings()
    except ValueError as e:
        print(f"hangdx worker: {e}", file=sys.stderr)
        return 2
    # RQ needs raw bytes from Redis (decode_responses off); the timeout keeps a dead Redis from hanging start-up.
    conn = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        conn.ping()
    except redis.exceptions.RedisError as e:
        print(f"hangdx worker: redis at {url} is unavailable: {e}", file=sys.stderr)
        return 1
    reaper = None if burst else Reaper(redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10))
    if reaper is not None:
        reaper.say = notifier_say()
        reaper.start()
    stop = threading.Event()
    current: list[HangdxWorker] = []

    def on_stop(signum: int, frame: object) -> None:
        # Between a restarted worker's registration and RQ putting in its own handlers, a SIGTERM lands here:
        # RQ's loop then sees the stop request at its first turn instead of never.
        stop.set()
        if current:
            current[0]._stop_requested = True

    try:
        while True:
            worker = HangdxWorker(worker_queues(conn), connection=conn, serializer=JSONSerializer)
            try:
                current[:] = [worker]
                if stop.is_set():
                    return 0
                worker.work(burst=burst, with_scheduler=False)
            except UNAVAILABLE as e:
                if isinstance(e, redis.exceptions.OutOfMemoryError):
                    print(f"hangdx worker: redis at {url} is {_why(e)}; waiting", file=sys.stderr)
                else:
                    print(f"hangdx worker: lost redis at {url}: {e}", file=sys.stderr)
                if worker.pubsub_thread is not None:  # RQ's teardown stopped before ending it
                    worker.pubsub_thread.stop()
            if (
                burst
                or worker._stop_requested
                or worker._shutdown_requested_date is not None
                or stop.is_set()
            ):
                return 0
            # RQ's loop ended on a Redis error (it only retries while waiting for a job): wait and go on.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, on_stop)
            if not _wait_for_redis(conn, stop) or stop.wait(1.0):  # (never restart in a tight loop)
                return 0
            print(f"hangdx worker: redis at {url} is back; working again", file=sys.stderr)
    finally:
        if reaper is not None:
            reaper.stop()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--burst"]
    sys.exit(main(args[0] if args else None, burst="--burst" in sys.argv[1:]))
