"""Issue row 14: other people's text reached root's terminal with its escape sequences raw.

A file or FIFO name, a log line, another user's job id, an alert summary, a resolution note: each may carry
ESC sequences (clear the screen, set the window title, OSC 52 to write the clipboard), C1 controls (0x9b is a
CSI on its own), bidi overrides or a file name's undecodable bytes. The real `hangdx` command is run and the
bytes it writes are checked: no control character but newline (and a table's tab), and the hostile ones
shown escaped, as `\\x1b`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hangdx.bot.incidents import IncidentStore, connect
from hangdx.bot.memory import Memory
from hangdx.bot.request import DiagnoseRequest

from .harness import BOT_TOKEN, SECRET

ROOT = Path(__file__).resolve().parents[2]
OOM_LOG = ROOT / "tests/fixtures/torch_log/cuda_oom_rank1.log"
HOSTILE = [
    "\x1b]0;pwned\x07",  # window title
    "\x1b]52;c;cm0gLXJmIH4K\x07",  # OSC 52: write the clipboard
    "\x1b[2J\x1b[H",  # clear the screen
    "\x9b2J",  # C1 CSI
    "\x1bP+q\x1b\\",  # DCS
    "\u202eevil",  # right-to-left override
    "\x08\x08\x08\x7f\r",  # backspaces, DEL, carriage return
]
RAW = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\udc80-\udcff]")


def _hangdx(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run the installed CLI as root would, and what reached the terminal (stdout and stderr), decoded as a
    terminal would read it (UTF-8; a byte that is not, such as a raw 0x9b, kept as a lone surrogate)."""
    exe = shutil.which("hangdx") or str(Path(sys.executable).parent / "hangdx")
    r = subprocess.run(
        [exe, *args], capture_output=True, timeout=120, env={**os.environ, **(env or {}), "COLUMNS": "300"}
    )
    return r.returncode, (r.stdout + r.stderr).decode("utf-8", "surrogateescape")


def _clean(out: str) -> None:
    bad = sorted({hex(ord(c)) for c in RAW.findall(out.replace("\t", " "))})
    assert not bad, (bad, out[-2000:])
    assert re.search(r"\\(?:x[0-9a-f]{2}|u[0-9a-f]{4})", out), out[-2000:]  # shown, escaped


@pytest.mark.parametrize("hostile", HOSTILE, ids=repr)
def test_analyze_shows_hostile_file_names_and_log_lines_escaped(tmp_path, hostile, hostile_inputs):
    folder = tmp_path / "logs"
    folder.mkdir()
    # (A carriage return in a line is a terminal overwrite the reader undoes: the file's name carries it.)
    text = OOM_LOG.read_text().replace("CUDA out of memory.", f"CUDA out of memory.{hostile.strip(chr(13))}")
    (folder / f"rank1{hostile}.log").write_text(text)
    os.mkfifo(folder / f"fifo{hostile}")
    os.mkfifo(folder.joinpath(os.fsdecode(b"fifo\x9b\xff")))  # a name that is not UTF-8
    hostile_inputs.tried(3)
    code, out = _hangdx("analyze", "-v", str(folder))
    assert code == 0, out
    assert "rank_crashed" in out
    _clean(out)


@pytest.mark.parametrize("hostile", HOSTILE, ids=repr)
def test_an_error_line_shows_a_hostile_path_escaped(tmp_path, hostile):
    code, out = _hangdx("analyze", str(tmp_path / f"missing{hostile}"))
    assert code == 2 and out.startswith("hangdx: ") and out.count("\n") == 1, out
    _clean(out)


def test_incident_and_history_show_stored_text_escaped(redis_url):
    """An alert summary, a timeline note and a resolution note someone else wrote, read back by root."""
    conn = connect(redis_url)
    conn.flushdb()
    store, memory = IncidentStore(conn), Memory(conn)
    job = "4242"
    evil = "".join(HOSTILE)
    store.open_or_join(
        DiagnoseRequest(job_id=job, source="alert", requested_by="U1", summary=f"stuck {evil}")
    )
    verdict = {
        "job_id": job,
        "status": "hung",
        "root_cause": {
            "category": "gpu_fault",
            "summary": f"Xid 79 on gpu-node-03 {evil}",
            "confidence": 0.9,
            "culprit": {"ranks": [], "hosts": ["gpu-node-03"], "gpus": [], "links": []},
            "fix": "Drain it.",
        },
        "findings": [],
    }
    store.add_verdict(job, verdict)
    store.set_status(job, "resolved", "U2", detail=f"swapped the GPU {evil}")
    memory.remember(job, verdict)
    memory.resolve(job, f"swapped the GPU {evil}")
    env = {"REDIS_URL": redis_url, "SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_SIGNING_SECRET": SECRET}
    code, out = _hangdx("incident", job, env=env)
    assert code == 0 and "alert: stuck" in out and "swapped the GPU" in out, out
    _clean(out)
    code, out = _hangdx("history", "gpu-node-03", env=env)
    assert code == 0 and "resolved by: swapped the GPU" in out, out
    _clean(out)
