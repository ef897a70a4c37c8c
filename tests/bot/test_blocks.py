"""Block Kit for a verdict: a real verdict (the engine on a recorded torch log) rendered within Slack's limits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hangdx.bot.slack.blocks import help_blocks, progress_text, verdict_blocks, verdict_text
from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "torch_log" / "ddp_unused_info.log"
TOKEN = "xoxb-123456789012-abcdef"


@pytest.fixture(scope="module")
def verdict() -> dict:
    ev = evidence_from_paths([str(FIXTURE)])
    ev.job_id = "12345"
    return engine.run(ev).to_dict()


def _by_type(blocks: list[dict], kind: str) -> list[dict]:
    return [b for b in blocks if b["type"] == kind]


def _text(blocks: list[dict]) -> str:
    return json.dumps(blocks, ensure_ascii=False)


def test_header_names_job_and_status(verdict: dict) -> None:
    blocks = verdict_blocks(verdict, "12345")
    assert blocks[0]["type"] == "header"
    assert blocks[0]["text"] == {"type": "plain_text", "text": "🔴 Job 12345: FAILED", "emoji": True}


def test_root_cause_confidence_and_culprit(verdict: dict) -> None:
    fields = verdict_blocks(verdict, "12345")[1]["fields"]
    assert [f["text"] for f in fields] == [
        "*Root cause*\n`ddp_unused_parameters`",
        "*Confidence*\n0.92",
        "*Culprit*\nrank 1",
    ]


def test_summary_fix_evidence_and_next_steps(verdict: dict) -> None:
    text = _text(verdict_blocks(verdict, "12345"))
    assert "DDP is waiting for gradients that rank 1 never produced" in text
    assert "find_unused_parameters=True" in text
    assert "```ddp_unused_info.log:24  [rank1]: Parameters which did not receive grad for rank 1" in text
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in text
    assert "Also considered: rank_crashed (0.85): rank 1; host localhost" in text


def test_five_buttons_carry_the_job_id(verdict: dict) -> None:
    blocks = verdict_blocks(verdict, "12345", slurm=True)
    actions = next(b for b in blocks if b.get("block_id") == "hangdx_actions")
    assert actions["type"] == "actions"
    assert [(e["action_id"], e["text"]["text"], e["value"]) for e in actions["elements"]] == [
        ("hangdx_rerun", "Re-run", "12345"),
        ("hangdx_stacks", "Full stacks", "12345"),
        ("hangdx_ack", "Acknowledge", "12345"),
        ("hangdx_resolve", "Resolve", "12345"),
        ("hangdx_handoff", "Hand off", "12345"),
    ]
    # A Slurm job id: requeue and cancel (and a drain per culprit node), each behind a confirmation dialog.
    slurm = blocks[-1]
    assert slurm["block_id"] == "hangdx_slurm"
    assert all("confirm" in e for e in slurm["elements"])
    assert [e["action_id"] for e in slurm["elements"]][-2:] == ["hangdx_requeue", "hangdx_cancel"]
    assert not any(
        b.get("block_id") == "hangdx_slurm" for b in verdict_blocks(verdict, "zoo-skip-1", slurm=True)
    )
    # An all-digit id Slurm does not know (a torchrun job, a local run): no Slurm buttons.
    assert not any(b.get("block_id") == "hangdx_slurm" for b in verdict_blocks(verdict, "12345"))
    # Each confirmation says what it does; "Go back" is the way out (not a second "Cancel").
    dialogs = {
        e["text"]["text"]: (e["confirm"]["confirm"]["text"], e["confirm"]["deny"]["text"])
        for e in slurm["elements"]
    }
    assert dialogs["Requeue job"] == ("Requeue job", "Go back") and dialogs["Cancel job"] == (
        "Cancel job",
        "Go back",
    )


def test_secret_in_summary_and_evidence_is_redacted(verdict: dict) -> None:
    v = json.loads(json.dumps(verdict))
    v["root_cause"]["summary"] += f" (token {TOKEN})"
    v["findings"][0]["evidence"][0]["text"] = f"SLACK_BOT_TOKEN={TOKEN} <!channel>"
    blocks = verdict_blocks(v, "12345")
    text = _text(blocks) + verdict_text(v)
    assert TOKEN not in text
    assert "[REDACTED]" in text
    # A quoted <!channel> must not ping the channel.
    assert "<!channel>" not in text and "&lt;!channel&gt;" in text


def test_slack_limits_hold_for_huge_verdicts(verdict: dict) -> None:
    v = json.loads(json.dumps(verdict))
    v["status"] = "hung"
    v["job_id"] = "J" * 127
    v["root_cause"]["summary"] = "rank 3 stalled " * 1000
    v["root_cause"]["fix"] = "restart the job " * 1000
    v["findings"][0]["evidence"] = [
        {"source": "h/x.log", "line": i, "text": "e" * 1000} for i in range(1, 50)
    ]
    v["findings"][0]["next_steps"] = ["n" * 900] * 30
    blocks = verdict_blocks(v, "J" * 127)
    assert len(blocks) <= 50
    assert len(blocks[0]["text"]["text"]) <= 150
    for b in blocks:
        if "text" in b and b["type"] == "section":
            assert len(b["text"]["text"]) <= 3000
    evidence = next(b["text"]["text"] for b in blocks if "*Evidence*" in b.get("text", {}).get("text", ""))
    assert evidence.startswith("*Evidence* (10 of 49 lines)")
    assert all(len(line.strip("`")) <= 300 for line in evidence.splitlines()[1:])
    assert blocks[-1]["type"] == "actions"


def test_verdict_without_root_cause() -> None:
    v = {
        "job_id": "7",
        "status": "unknown",
        "root_cause": None,
        "findings": [],
        "gaps": ["no py-spy on gpu-1"],
    }
    blocks = verdict_blocks(v, "7")
    assert "No root cause found" in _text(blocks)
    assert "Not collected: no py-spy on gpu-1" in _text(blocks)
    assert verdict_text(v) == "hangdx: job 7 UNKNOWN: no root cause found"


def test_verdict_text_is_a_one_line_fallback(verdict: dict) -> None:
    t = verdict_text(verdict)
    assert t.startswith(
        "hangdx: job 12345 FAILED: ddp_unused_parameters (0.92), culprit rank 1. DDP is waiting"
    )
    assert "\n" not in t


def test_progress_text() -> None:
    assert progress_text("12345", 0, 0) == ":hourglass_flowing_sand: Diagnosing job 12345… finding its hosts"
    assert progress_text("12345", 8, 3).endswith("collecting evidence from 3/8 hosts")
    assert progress_text("12345", 8, 8).endswith("evidence from 8/8 hosts, running playbooks")


def test_help_blocks_name_the_commands() -> None:
    text = _text(help_blocks())
    assert "/diagnose <jobid>" in text and "@hangdx diagnose <jobid>" in text
