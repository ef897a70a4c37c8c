"""Issue row 22: fleet-memory notes went through `.capitalize()` on their way to Slack, which lower-cased all
but the first letter: node names (`DGX-A100-07` became `dgx-a100-07`, `gpu-node-17` became `Gpu-node-17`) and
the thread links (`channel=C0ONCALL01` became `channel=c0oncall01`, a link to no channel) were broken."""

from __future__ import annotations

import time

import pytest

from hangdx.bot.incidents import connect
from hangdx.bot.memory import Memory
from hangdx.bot.slack.blocks import verdict_blocks

from .test_incidents import redis_url  # noqa: F401
from .test_memory import DAY, gpu_verdict

CHANNEL, THREAD = "C0ONCALL01", "1700000100.000100"


@pytest.mark.parametrize("host", ["DGX-A100-07", "gpu-node-17", "Node17"])
def test_memory_notes_reach_the_thread_as_written(redis_url, host):  # noqa: F811
    conn = connect(redis_url)
    conn.flushdb()
    mem, now = Memory(conn), time.time()
    mem.remember("812", gpu_verdict("812", host), now - 5 * DAY, channel=CHANNEL, thread_ts=THREAD)
    mem.remember("907", gpu_verdict("907", host), now - 2 * DAY, channel=CHANNEL, thread_ts=THREAD)
    verdict = gpu_verdict("1001", host)
    verdict["notes"] = mem.recall("1001", verdict, now)
    assert verdict["notes"] and verdict["notes"][1].startswith(host)
    sections = [
        b["text"]["text"] for b in verdict_blocks(verdict, "1001") if b["type"] == "section" and "text" in b
    ]
    notes = [c for c in sections if c.startswith("*Notes*")]
    assert len(notes) == 1, sections
    assert f"{host} was the culprit in 2 earlier incidents" in notes[0]
    assert f"lemon: {host}, culprit in 3 incidents" in notes[0] and f"NodeName={host} State=DRAIN" in notes[0]
    # The link as Slack reads it, named after its job.
    assert f"<https://slack.com/app_redirect?channel={CHANNEL}&amp;message_ts={THREAD}|job 907>" in notes[0]
