"""Issue 22, item 9: the paste verdict as the thread reads it, through the real bot (`hangdx serve` and `hangdx
worker` as processes, a real redis-server, signed Slack requests, the Slack stand-in holding the thread).

What was read and what was skipped is said once and briefly: the `@hangdx analyze` request is not evidence, the
chat around a paste is one short line, never each message with the 25 kinds looked for. A culprit host is named
only when the evidence tells hosts apart: `localhost`, which every rank of the real torchrun failure table below
printed, names no machine.

What is pasted is real: tests/fixtures/real/ (each with its source: vllm-project/speculators#1115 and
NVIDIA/nccl#928); the chat lines are ours.
"""

from __future__ import annotations

import io
from pathlib import Path

from hangdx.bot.diagnosis import analyze_texts

from .test_analyze_in_slack import CHANNEL, ONCALL, _slack_escaped, bot, mention, real, verdict_in  # noqa: F401
from .test_incidents import redis_url  # noqa: F401

TORCH_LOG = Path(__file__).resolve().parent.parent / "fixtures" / "torch_log"


def _contexts(blocks: list[dict]) -> list[str]:
    return [e["text"] for b in blocks if b["type"] == "context" for e in b["elements"]]


def test_the_paste_verdict_says_briefly_what_it_read_and_skipped(bot):  # noqa: F811
    url, slack = bot
    root = slack.say(CHANNEL, "our job hangs after step 2k, any idea?", user=ONCALL)
    slack.say(CHANNEL, "same on both nodes", user=ONCALL, thread_ts=root)
    slack.say(CHANNEL, _slack_escaped(real("network_fault__NVIDIA-nccl-928")), user=ONCALL, thread_ts=root)
    mention(url, slack, root)
    v = verdict_in(slack, root)
    said = _contexts(v["blocks"])
    assert v["fields"]["Root cause"] == "network_fault"
    assert any(s.startswith("Read: message 3 (U0ONCALL01): read as PyTorch/NCCL log") for s in said), said
    assert "Skipped: messages 1, 2: chat, no evidence in them" in said, said
    # Before: "Not collected: message N (...): not a known artifact ... (looked for app_log, dcgmi diag results,
    # ...)" for every chat message, the mention included.
    assert "looked for" not in v["all"] and "Not collected" not in v["all"]
    assert "message 4" not in v["all"]  # the request itself


def test_a_host_name_every_rank_printed_is_not_a_culprit_host(bot):  # noqa: F811
    url, slack = bot
    root = slack.say(CHANNEL, "torchrun says this, rank 1 died?", user=ONCALL)
    slack.say(CHANNEL, _slack_escaped(real("rank_crashed__vllm-project-speculators-1115")), thread_ts=root)
    mention(url, slack, root)
    v = verdict_in(slack, root)
    assert v["fields"]["Root cause"] == "rank_crashed"
    assert v["fields"]["Culprit"] == "rank 1"  # before: "rank 1; host localhost"
    assert "localhost: not named as a culprit host: a loopback name, which every machine has" in v["all"]
    # `hangdx analyze` on the same text says the same.
    text = real("rank_crashed__vllm-project-speculators-1115")
    offline = analyze_texts([("message 1", io.BytesIO(text.encode()))]).to_dict()
    assert offline["root_cause"]["culprit"]["hosts"] == []


def test_two_pods_printing_one_host_name_name_no_culprit_host(bot):  # noqa: F811
    """Two nodes of a real torchrun job, each in a UTS namespace called `trainer` (tests/fixtures/torch_log/)."""
    url, slack = bot
    root = slack.say(CHANNEL, "both pods of the job died, logs below", user=ONCALL)
    for node in (0, 1):
        text = (TORCH_LOG / f"two_pods_trainer_node{node}.log").read_text()
        slack.say(CHANNEL, _slack_escaped(text), user=ONCALL, thread_ts=root)
    mention(url, slack, root)
    v = verdict_in(slack, root)
    assert (v["fields"]["Root cause"], v["fields"]["Culprit"]) == (
        "rank_crashed",
        "rank 2",
    )  # before: host trainer
    note = "trainer: not named as a culprit host: printed by more than one machine (ranks 0 and 2 are both its local rank 0)"
    assert note in v["all"]
