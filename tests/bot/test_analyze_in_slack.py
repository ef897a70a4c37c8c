"""`@hangdx analyze` and the "Diagnose with hangdx" shortcut, as a team runs them: `hangdx serve` and `hangdx worker`
as processes, a real redis-server, signed Slack requests over HTTP, and the local Slack Web API stand-in holding
the thread (conversations.replies) and its files (url_private_download, bot token only).

What is pasted is real: artifacts of the real-world corpus (tests/fixtures/real/, each with its source); the
hostile lines added to one of them (a broadcast mention, a token) are ours and say so.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

import pytest
import requests
from slack_sdk.signature import SignatureVerifier

from hangdx.bot.incidents import connect

from .test_end_to_end import bot_env, running_bot, wait_for
from .test_incidents import redis_url  # noqa: F401  (the session's redis-server)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from slack_standin import BOT_USER_ID, SlackStandin  # noqa: E402

REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real"
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
CHANNEL = "C0ONCALL01"
ONCALL = "U0ONCALL01"
INTRUDER = "U0INTRUDER"
TOKEN = "xoxb-1111-2222-hangdxtest"


def real(stem: str) -> str:
    return (REAL / f"{stem}.log").read_text()


def _slack_escaped(text: str) -> str:
    """What Slack stores as a message's text: &, < and > escaped."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@pytest.fixture
def bot(redis_url, tmp_path):  # noqa: F811
    connect(redis_url).flushdb()
    with SlackStandin() as slack:
        env = bot_env(slack, redis_url, SLACK_SIGNING_SECRET=SECRET, HANGDX_ALLOWED_USERS=ONCALL)
        with running_bot(env, tmp_path / "bot.log") as url:
            yield url, slack


def _signed(url: str, body: str, content_type: str) -> requests.Response:
    stamp = str(int(time.time()))
    sig = SignatureVerifier(SECRET).generate_signature(timestamp=stamp, body=body)
    headers = {"Content-Type": content_type, "X-Slack-Request-Timestamp": stamp, "X-Slack-Signature": sig}
    # Slack gives up on an answer after 3 seconds: the bot acknowledges first and queues the reading.
    return requests.post(url + "/slack/events", data=body.encode(), headers=headers, timeout=3)


def mention(url: str, slack: SlackStandin, thread_ts: str, user: str = ONCALL, extra: str = "") -> str:
    text = f"<@{BOT_USER_ID}> analyze{extra}"
    ts = slack.say(CHANNEL, _slack_escaped(text), user=user, thread_ts=thread_ts)
    envelope = {
        "token": "gIkuvaNzQIHg97ATvDxqgjtO",
        "team_id": "T0HANGDX1",
        "api_app_id": "A0HANGDX01",
        "event": {"type": "app_mention", "user": user, "text": text, "ts": ts, "thread_ts": thread_ts,
                  "channel": CHANNEL, "event_ts": ts},
        "type": "event_callback",
        "event_id": f"Ev0{ts.replace('.', '')}",
        "event_time": int(time.time()),
    }  # fmt: skip
    r = _signed(url, json.dumps(envelope), "application/json")
    assert r.status_code == 200, r.text
    return ts


def shortcut(url: str, message: dict, user: str = ONCALL) -> requests.Response:
    payload = {
        "type": "message_action",
        "token": "gIkuvaNzQIHg97ATvDxqgjtO",
        "action_ts": f"{time.time():.6f}",
        "team": {"id": "T0HANGDX1", "domain": "hangdx-test"},
        "user": {"id": user, "name": "oncall", "team_id": "T0HANGDX1"},
        "channel": {"id": CHANNEL, "name": "oncall-training"},
        "callback_id": "hangdx_analyze",
        "trigger_id": "13345224609.738474920.8088930838d88f008e0",
        "message_ts": message["ts"],
        "message": message,
        "response_url": "http://127.0.0.1:9/respond",
    }
    return _signed(url, urlencode({"payload": json.dumps(payload)}), "application/x-www-form-urlencoded")


def verdict_in(slack: SlackStandin, thread_ts: str, timeout: float = 60.0) -> dict:
    """The analysis posted in the thread: its blocks, fields and text, as the reader of the thread sees them."""
    post = wait_for(
        "the verdict in the thread",
        lambda: next(
            (c for c in slack.calls_to("chat.postMessage")
             if c.body.get("thread_ts") == thread_ts and c.body.get("blocks")),
            None,
        ),
        timeout=timeout,
    )  # fmt: skip
    blocks = json.loads(post.body["blocks"]) if isinstance(post.body["blocks"], str) else post.body["blocks"]
    fields = {}
    for b in blocks:
        for f in b.get("fields") or []:
            name, _, value = f["text"].partition("\n")
            fields[name.strip("*")] = value.strip("`")
    return {"blocks": blocks, "fields": fields, "all": json.dumps(blocks) + post.body.get("text", "")}


def test_analyze_in_a_thread_reads_the_pasted_log_and_answers_there(bot):
    url, slack = bot
    root = slack.say(CHANNEL, "our vLLM job hangs at allreduce, log below", user=ONCALL)
    # A real paste (vllm-project/vllm#6042: one rank's illegal memory access, the others time out), and two
    # hostile lines of our own: a broadcast mention and a token, which must not reach the channel as such.
    hostile = "<!channel> look here\nexport SLACK_BOT_TOKEN=xoxb-9999-8888-supersecretvalue\n"
    slack.say(CHANNEL, _slack_escaped(hostile + real("rank_crashed__vllm-project-vllm-6042")), thread_ts=root)
    mention(url, slack, root)
    v = verdict_in(slack, root)
    assert v["fields"]["Root cause"] == "rank_crashed"
    assert v["fields"]["Culprit"] == "rank 3"
    assert "Pasted evidence" in v["all"]
    assert "<!channel>" not in v["all"] and "supersecretvalue" not in v["all"]
    acks = [c for c in slack.calls_to("chat.postEphemeral") if c.body.get("thread_ts") == root]
    assert acks and "Reading this thread" in acks[0].body["text"]
    # The one thread answered once, and it was read with the bot token through conversations.replies.
    replies = slack.calls_to("conversations.replies")
    assert (
        replies and replies[0].body["ts"] == root and replies[0].headers["authorization"] == f"Bearer {TOKEN}"
    )


def test_analyze_reads_an_uploaded_file_and_says_what_it_skipped(bot):
    url, slack = bot
    dmesg = slack.upload("dmesg.txt", real("gpu_fault__NVIDIA-NVSentinel-155").encode())
    png = slack.upload(
        "screenshot.png", b"\x89PNG\r\n\x1a\n" + bytes(2000), mimetype="image/png", filetype="png"
    )
    lying = slack.upload("more.log", b"\x00\x01\x02binary\x00" * 100)  # says text/plain, holds binary
    elsewhere = dict(
        slack.upload("evil.log", b"x"), url_private_download="http://127.0.0.2:9/steal/token.log"
    )
    root = slack.say(
        CHANNEL, "GPU node went bad overnight, dmesg attached", files=[dmesg, png, lying, elsewhere]
    )
    mention(url, slack, root)
    v = verdict_in(slack, root)
    assert v["fields"]["Root cause"] == "gpu_fault"
    assert "dmesg.txt" in v["all"]  # said as read
    assert "screenshot.png: not a text file" in v["all"]
    assert "more.log: not text" in v["all"]
    assert "evil.log: not a file hosted by Slack" in v["all"]


def test_the_shortcut_reads_one_message_and_answers_in_its_thread(bot):
    url, slack = bot
    root = slack.say(CHANNEL, "two jobs died today, here are both logs")
    nccl = slack.say(CHANNEL, _slack_escaped(real("network_fault__NVIDIA-nccl-928")), thread_ts=root)
    slack.say(CHANNEL, _slack_escaped(real("rank_crashed__vllm-project-vllm-6042")), thread_ts=root)
    message = next(m for m in slack.messages[CHANNEL] if m["ts"] == nccl)
    r = shortcut(url, message)
    assert r.status_code == 200, r.text
    v = verdict_in(slack, root)
    assert v["fields"]["Root cause"] == "network_fault"  # the other message was not read
    assert "message 1" in v["all"] and "message 2" not in v["all"]


def test_someone_not_allowed_is_refused_and_nothing_is_read(bot):
    url, slack = bot
    root = slack.say(CHANNEL, _slack_escaped(real("rank_crashed__vllm-project-vllm-6042")), user=INTRUDER)
    mention(url, slack, root, user=INTRUDER)
    refusal = wait_for(
        "the refusal",
        lambda: [c for c in slack.calls_to("chat.postEphemeral") if c.body.get("user") == INTRUDER],
    )
    assert "allowed users" in refusal[0].body["text"]
    time.sleep(2)
    assert not slack.calls_to("conversations.replies")
    assert not [c for c in slack.calls_to("chat.postMessage") if c.body.get("thread_ts") == root]


def test_a_thread_with_no_evidence_gets_one_line_saying_what_hangdx_looks_for(bot):
    url, slack = bot
    root = slack.say(CHANNEL, "anyone else seeing the cluster slow today?")
    mention(url, slack, root)
    said = wait_for(
        "the answer",
        lambda: [c for c in slack.calls_to("chat.postMessage") if c.body.get("thread_ts") == root],
    )
    assert "found no evidence" in said[0].body["text"] and "py-spy" in said[0].body["text"]


def test_the_byte_cap_is_a_setting_and_a_cut_says_where(monkeypatch):
    """Uploads are streamed, so a team may raise the 20 MB cap; what passes it is said, in MB."""
    from hangdx.bot import pasted

    assert pasted.Budget().bytes == 20 << 20
    monkeypatch.setenv("HANGDX_ANALYZE_MAX_MB", "1")
    budget = pasted.Budget()
    text = pasted._Text("huge.log", b"x" * (3 << 20), budget)
    assert len(text.read()) == 1 << 20 and budget.bytes == 0
    assert budget.skipped == ["huge.log: cut at the 1 MB cap"]
    monkeypatch.setenv("HANGDX_ANALYZE_MAX_MB", "many")
    assert pasted.Budget().bytes == 20 << 20  # not a number: the default
