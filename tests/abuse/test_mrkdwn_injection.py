"""Issue 10.3: text a node, a log or a user wrote never reaches Slack as live mrkdwn.

The attack: a value seen in a process environment (an "other job" id on the node) or an error quoting one
reaches a message posted in the incident's thread; unescaped, `<!channel>` pings everyone and
`<https://evil|Sign in to Slack>` is a disguised link. Every such value goes through blocks.mrkdwn (redacted and
escaped), the one way outside text becomes a Slack message."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import Incident
from hangdx.bot.service import SlackNotifier, slack_client
from hangdx.bot.slack.blocks import mention, mrkdwn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slack_standin import SlackStandin  # noqa: E402

HOSTILE = "<!channel> <https://evil.example/login|Sign in to Slack again> HF_TOKEN=hf_aBcDeFgHiJkLmNoPqRsTuVwXyZ012345"


def _live(text: str) -> bool:
    return "<!channel>" in text or "<https://evil" in text or "hf_aBcDeF" in text


def _incident() -> Incident:
    now = time.time()
    return Incident("4242", "investigating", now, now, channel="C0ALERTS01", thread_ts="1700000000.000100")


def test_an_error_quoting_node_text_is_posted_escaped():
    with SlackStandin() as slack:
        cfg = BotConfig.from_env({"SLACK_BOT_TOKEN": "xoxb-1-2-x", "SLACK_API_URL": slack.url})
        notifier = SlackNotifier(slack_client(cfg))
        notifier(_incident(), None, f"no process of job 4242 here; other jobs on this node: {HOSTILE}")
        notifier.say(_incident(), f"the diagnosis of job 4242 was queued again ({HOSTILE})")
        posts = slack.calls_to("chat.postMessage")
    assert len(posts) == 2
    for p in posts:
        assert not _live(p.body["text"]), p.body["text"]
        assert "&lt;!channel&gt;" in p.body["text"]


def test_mrkdwn_keeps_hangdx_words_and_neutralises_the_values():
    said = mrkdwn("Diagnosis of job {job} could not run: {error}", job="4242", error=HOSTILE)
    assert said.startswith("Diagnosis of job 4242 could not run: ")
    assert not _live(said)
    assert mention("U0ONCALL01") == "<@U0ONCALL01>"
    assert mention("<!channel>") == "&lt;!channel&gt;"
