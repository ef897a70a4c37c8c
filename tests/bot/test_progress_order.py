"""The parent message's last edit is the verdict, whatever thread or retry sends a progress edit (issue 14)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import Incident
from hangdx.bot.service import SlackNotifier, slack_client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from slack_standin import SlackStandin  # noqa: E402

VERDICT = {
    "job_id": "4242",
    "status": "hung",
    "root_cause": {
        "category": "conditional_collective",
        "summary": "Rank 1 skipped a collective.",
        "confidence": 0.9,
        "culprit": {"ranks": [1], "hosts": [], "gpus": [], "links": []},
        "fix": "Fix the branch.",
    },
    "findings": [],
}


def _notifier(standin: SlackStandin) -> SlackNotifier:
    cfg = BotConfig.from_env({"SLACK_BOT_TOKEN": "xoxb-test", "SLACK_API_URL": standin.url})
    return SlackNotifier(slack_client(cfg))


def _incident() -> Incident:
    now = time.time()
    return Incident("4242", "investigating", now, now, channel="C0ALERTS01", thread_ts="1700000000.000100")


def test_a_progress_edit_retried_after_a_429_lands_before_the_verdict_edit():
    with SlackStandin() as slack:
        notifier, inc = _notifier(slack), _incident()
        slack.fail("chat.update", status=429, retry_after=1)  # the progress edit is retried a second later
        progress = threading.Thread(target=notifier.progress, args=(inc, 1, 4))
        progress.start()
        time.sleep(0.3)  # the verdict is ready while the progress edit waits out its Retry-After
        notifier(inc, VERDICT, None)
        progress.join(timeout=10)
        edits = [c.body.get("text", "") for c in slack.calls_to("chat.update")]
        assert len(edits) == 3  # the refused progress edit, its retry, the verdict
        assert "conditional_collective" in edits[-1] or "Rank 1" in edits[-1], edits
        assert "1/4" in edits[1] or "hosts" in edits[1], edits


def test_no_progress_edit_after_the_verdict_until_a_new_diagnosis_begins():
    with SlackStandin() as slack:
        notifier, inc = _notifier(slack), _incident()
        notifier(inc, VERDICT, None)
        notifier.progress(inc, 2, 4)  # a late report from a host of the finished diagnosis
        assert len(slack.calls_to("chat.update")) == 1
        notifier.begin(inc)  # the same job is diagnosed again
        notifier.progress(inc, 1, 4)
        assert len(slack.calls_to("chat.update")) == 2


def test_a_failed_diagnosis_leaves_the_parent_saying_so_not_at_its_progress():
    """Issue 22 item 6 in the thread's parent: a diagnosis that fails (the job gone, no known_hosts) ends the
    progress edits with a last edit that says so; an earlier verdict of the incident stands beside it."""
    with SlackStandin() as slack:
        notifier, inc = _notifier(slack), _incident()
        notifier.begin(inc)
        notifier.progress(inc, 0, 1)
        notifier(inc, None, "no process of job '4242' found on gpu-node-03")
        notifier.progress(inc, 1, 1)  # a late report of the failed run: not shown
        edits = [c.body.get("text", "") for c in slack.calls_to("chat.update")]
        assert len(edits) == 2 and edits[-1] == (
            "hangdx: job 4242: diagnosis failed: no process of job '4242' found on gpu-node-03"
        ), edits

        inc.verdicts.append(VERDICT)  # a Re-run (or a repeated alert) of a diagnosed incident fails
        notifier.begin(inc)
        notifier.progress(inc, 0, 1)
        notifier(inc, None, "no process of job '4242' found on gpu-node-03")
        last = [c.body.get("text", "") for c in slack.calls_to("chat.update")][-1]
        assert last.startswith("hangdx: job 4242 HUNG: conditional_collective (0.90), culprit rank 1."), last
        assert last.endswith(
            "(the latest diagnosis could not run: no process of job '4242' found on gpu-node-03)"
        )
