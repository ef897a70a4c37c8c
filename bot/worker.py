"""`hangdx worker`: an RQ worker on the "hangdx" queue (python -m hangdx.bot.worker [REDIS_URL] [--burst])."""

from __future__ import annotations

import os
import sys

import redis
from rq import Worker
from rq.serializers import JSONSerializer

from hangdx.bot.queue import DEFAULT_REDIS_URL, queue


def main(redis_url: str | None = None, burst: bool = False) -> int:
    """Run a worker until stopped (or, with burst, until the queue is empty); 0 on a clean stop."""
    url = redis_url or os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    # RQ needs raw bytes from Redis (decode_responses off); the timeout keeps a dead Redis from hanging start-up.
    conn = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        conn.ping()
    except redis.exceptions.RedisError as e:
        print(f"hangdx worker: redis at {url} is unavailable: {e}", file=sys.stderr)
        return 1
    worker = Worker([queue(conn)], connection=conn, serializer=JSONSerializer)
    try:
        worker.work(burst=burst, with_scheduler=False)
    except redis.exceptions.ConnectionError as e:
        print(f"hangdx worker: lost redis at {url}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--burst"]
    sys.exit(main(args[0] if args else None, burst="--burst" in sys.argv[1:]))
