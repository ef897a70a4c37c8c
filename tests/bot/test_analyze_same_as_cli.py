"""`@hangdx analyze` in Slack and `hangdx analyze` read a paste through the one reader: the same verdict."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from hangdx.bot import render
from hangdx.bot.diagnosis import analyze_texts

PASTES = [
    "...-48:34050:34121 [0] NCCL WARN NET/IB : Got async event : port error\n",
    "[ 1234.567] python invoked oom-killer: gfp_mask=0x100cca(GFP_HIGHUSER_MOVABLE), order=0\n"
    "[ 1234.600] Out of memory: Killed process 4242 (python) total-vm:1234kB\n",
    "Epoch 1:  45%|####5     | 450/1000 [01:23<01:40,  5.4it/s]RuntimeError: Rank 1 failed to pass "
    "monitoredBarrier in 10000 ms\n",
]


def _cli(text: str) -> tuple[int, dict | None]:
    r = subprocess.run([sys.executable, "-m", "hangdx", "analyze", "-", "--json"], input=text.encode(),
                       capture_output=True, timeout=60)  # fmt: skip
    return r.returncode, json.loads(r.stdout) if r.returncode == 0 else None


@pytest.mark.parametrize("text", PASTES)
def test_slack_and_cli_agree(text):
    code, cli = _cli(text)
    verdict = analyze_texts([("message 1", io.BytesIO(text.encode()))])
    assert code == 0 and verdict is not None
    slack = json.loads(render.to_json(verdict))
    for key in ("category", "culprit"):
        assert slack["root_cause"][key] == cli["root_cause"][key]


def test_nothing_readable_is_none_in_slack_and_exit_2_in_cli():
    text = "lunch is at noon\nbring the slides\n"
    assert _cli(text)[0] == 2
    assert analyze_texts([("message 1", io.BytesIO(text.encode()))]) is None
