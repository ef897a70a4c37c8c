"""Issue 22 item 11: trying the bot before wiring Slack. `hangdx demo --keep` leaves a real hung torch.distributed
job (gloo, CPU) running and says how to stop it; `hangdx console`, driven through its standard input as a person
types, reaches the same Bolt handlers Slack does, with a real redis-server and a real `hangdx worker`, and prints
the verdicts as text: `/diagnose JOB`, a button pressed by name, `/diagnose status`, and `@hangdx analyze` with a
pasted file (a real bug report's log)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hangdx.bot.incidents import IncidentStore, connect

from .test_incidents import redis_url  # noqa: F401  (the session's redis-server)

# gpu_fault on rank 12 (tests/fixtures/real/README.md: copied from pytorch/pytorch#113128).
PASTE = Path(__file__).resolve().parents[1] / "fixtures" / "real" / "gpu_fault__pytorch-pytorch-113128.log"


def _env(redis: str) -> dict[str, str]:
    env = {**os.environ, "REDIS_URL": redis, "HANGDX_RESOLVER": "local"}
    for name in (
        "SLACK_BOT_TOKEN",
        "SLACK_SIGNING_SECRET",
        "SLACK_API_URL",
        "SLACK_APP_TOKEN",
        "HANGDX_CONFIG",
    ):
        env.pop(name, None)
    return env


def _stop_kept(stop: str) -> None:
    """What `demo --keep` said to run, done by PID: each rank's process group, then the workdir."""
    kill, _, rm = stop.partition("; rm -rf ")
    for group in re.findall(r"-(\d+)", kill.split("--", 1)[1]):
        try:
            os.killpg(int(group), signal.SIGKILL)
        except ProcessLookupError:
            pass
    if rm.strip().startswith("/tmp/hangdx-zoo-"):
        shutil.rmtree(rm.strip(), ignore_errors=True)


@pytest.mark.zoo
def test_demo_keep_leaves_a_hung_job_that_the_console_diagnoses_through_the_slack_handlers(redis_url):  # noqa: F811
    pytest.importorskip("torch")
    connect(redis_url).flushdb()
    demo = subprocess.run(
        [sys.executable, "-m", "hangdx", "demo", "--keep"], env=_env(redis_url), capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    said = demo.stdout + demo.stderr
    stop = re.search(r"stop it with: (kill -KILL -- [-\d ]+; rm -rf \S+)", said)
    try:
        assert demo.returncode == 0, said[-3000:]
        left = re.search(r"left job (\S+) hung, its ranks running \(pids ([\d, ]+)\)", said)
        assert left and stop, said[-2000:]
        job, pids = left.group(1), [int(p) for p in left.group(2).split(", ")]
        assert "stopped every process" not in said
        # The demo has ended; its job has not.
        assert all(Path(f"/proc/{p}").exists() for p in pids), "the kept job's ranks are gone"

        typed = (
            f"/diagnose {job}\nwait\npress acknowledge\n/diagnose status\n"
            f"@hangdx analyze {PASTE}\nwait\nno-such-command\n"
        )
        console = subprocess.run(
            [sys.executable, "-m", "hangdx", "console", "--wait", "150"], input=typed, env=_env(redis_url),
            capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        out = console.stdout
        assert console.returncode == 0, console.stdout[-3000:] + console.stderr[-3000:]
    finally:
        if stop:
            _stop_kept(stop.group(1))

    # The verdict, as text: the real job's fault, its culprit, and the buttons to press by name.
    assert f"== 🔴 Job {job}: HUNG ==" in out, out[-4000:]
    verdict = out[out.index(f"== 🔴 Job {job}: HUNG ==") :]
    assert "`conditional_collective`" in verdict and "rank 1" in verdict
    assert "Rank 1 skipped the allreduce" in verdict
    assert "[Re-run] [Full stacks] [Acknowledge] [Resolve] [Hand off]" in verdict
    # The button went through the same handler as Slack's: the incident in Redis is acknowledged, by the console's
    # person, and /diagnose status says so.
    inc = IncidentStore(connect(redis_url)).get(job)
    assert inc.status == "acknowledged" and inc.owner == "U0HANGDXYOU"
    assert inc.latest_verdict["root_cause"]["culprit"]["ranks"] == [1]
    status = out[out.index("> /diagnose status") :]
    assert f"*Job {job}*: acknowledged" in status and "Owner: @you" in status
    # The paste: read by a worker from the console's thread, like a Slack thread's file.
    paste = out[out.index("> @hangdx analyze") :]
    assert f"pasted {PASTE.name}" in paste
    assert "gpu_fault" in paste and "12" in paste, paste[:3000]
    assert "hangdx console: no-such-command: not a command (type help)" in out


def test_a_pasted_file_is_read_by_the_worker_and_what_it_quotes_reaches_the_terminal_escaped(
    redis_url,  # noqa: F811
    tmp_path,
):
    connect(redis_url).flushdb()
    hostile = tmp_path / "rank3.log"
    # A real line (pytorch/pytorch#113128) behind a terminal escape that would clear the screen.
    line = next(x for x in PASTE.read_text().splitlines() if "uncorrectable ECC error" in x)
    hostile.write_text("\x1b[2J" + line + "\n")
    typed = (
        f"@hangdx analyze {hostile} {tmp_path / 'missing.log'}\n@hangdx analyze {hostile}\nwait\n"
        "@hangdx analyze\nhelp\n"
    )
    console = subprocess.run(
        [sys.executable, "-m", "hangdx", "console", "--wait", "120"], input=typed, env=_env(redis_url),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = console.stdout
    assert console.returncode == 0, out[-2000:] + console.stderr[-2000:]
    # (the console names a missing path on its first 80 characters)
    assert f"hangdx console: no such file: {str(tmp_path / 'missing.log')[:80]}" in out
    assert "== 🔴 Pasted evidence" in out and "`gpu_fault`" in out, out[-3000:]
    # Asked again without a file: read again in the thread of the paste, the same answer there.
    pasted = re.search(r"you \(thread (\S+)\): pasted rank3.log", out)
    assert pasted, out[-3000:]
    answers = re.findall(r"hangdx \[thread (\S+)\]:\n  == 🔴 Pasted evidence", out)
    assert answers == [pasted.group(1)] * 2, out[-4000:]
    assert "\x1b" not in out  # the reader drops the escape; the console never sends one raw
    assert "press BUTTON [JOBID]" in out  # help


def test_what_the_bot_says_is_shown_as_text_with_control_characters_escaped():
    from hangdx.bot.console import USER, blocks_text, mrkdwn_text

    said = mrkdwn_text(
        f"<@{USER}>: job x\x1b[2J &lt;7&gt; <https://slack.com/app_redirect?channel=C1|thread>"
    )
    assert said == "@you: job x\\x1b[2J <7> thread <https://slack.com/app_redirect?channel=C1>"
    blocks = [
        {"type": "header", "text": {"type": "plain_text", "text": "🔴 Job 7: HUNG"}},
        {"type": "section", "fields": [{"type": "mrkdwn", "text": "*Culprit*\nrank 1"}]},
        {"type": "actions", "elements": [{"type": "button", "text": {"type": "plain_text", "text": "Re-run"}},
                                         {"type": "button", "text": {"type": "plain_text", "text": "Resolve"}}]},
    ]  # fmt: skip
    assert blocks_text(blocks) == ["== 🔴 Job 7: HUNG ==", "  *Culprit*", "  rank 1", "  [Re-run] [Resolve]"]
