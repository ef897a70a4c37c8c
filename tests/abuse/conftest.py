"""The session's redis-server (started by tests/bot/test_incidents.py's fixture, killed by PID), and the count
of hostile inputs each test tried, kept with pytest's record_property for bench/hardening.py."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bot.test_incidents import redis_url  # noqa: E402,F401


class Inputs:
    """How many hostile inputs a test tried (1 unless it says more)."""

    def __init__(self) -> None:
        self.n = 0

    def tried(self, n: int = 1) -> None:
        self.n += n


@pytest.fixture(autouse=True)
def hostile_inputs(record_property) -> Iterator[Inputs]:
    counter = Inputs()
    yield counter
    record_property("inputs", counter.n or 1)
