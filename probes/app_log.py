"""A training program's own log lines that say where the job was: saving a checkpoint, training finished, and
object-storage transfers that stall (libcurl under tensorstore, gcsfs, the AWS and GCS SDKs).

Formats:
- checkpoint lines as frameworks print them: `Saving latest checkpoint ...` (a `logging` line with its
  `2026-02-18 10:28:25,496` time), `Saved checkpoint to gs://bucket/run/step-30000` (levanter),
  `Saving model checkpoint to out/checkpoint-500` (Hugging Face Trainer);
- the end of training: Lightning's ``Trainer.fit` stopped: `max_epochs=3` reached.``, Hugging Face's
  `Training completed. Do not forget to share your model ...`;
- libcurl's own error texts (`curl_easy_strerror`, CURLE_OPERATION_TIMEDOUT = 28): `Timeout was reached`,
  `Operation too slow. Less than 1024 bytes/sec transferred the last 60 seconds`, `Operation timed out after
  30000 milliseconds with 0 bytes received`, often behind an absl/glog header
  (`W0000 00:00:1715498963.019816  583764 curl_transport.cc:444] Error [28]=Timeout was reached ...`).
"""

from __future__ import annotations

import re
from datetime import datetime

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines as text_lines
from hangdx.probes.text import looks_binary

KIND = "app_log"
QUIET_WHEN_EMPTY = True

_CHECKPOINT = lazy(
    r"\b(Saving|Saved|Writing|Wrote|Loading|Loaded|Restoring|Restored)\b[^\n]{0,60}?\bcheckpoints?\b"
    r"|\b[Cc]heckpoint (saved|written|loaded)\b"
)
_TARGET = lazy(r"\b(?:to|at|from|in) ((?:[a-z][a-z0-9+]{1,10}://|/|\./)\S{1,400})")
_FINISHED = lazy(
    r"Trainer\.fit`? stopped|`?max_(?:epochs|steps)=\S{1,20}`? reached|Training completed\. Do not forget"
)
_CURL = lazy(
    r"Operation too slow\. Less than \d{1,12} bytes/sec transferred the last \d{1,9} seconds"
    r"|Operation timed out after \d{1,12} milliseconds with \d{1,15}(?: out of -?\d{1,15})? bytes received"
    r"|Timeout was reached"
)
# absl / glog: `W0000 00:00:1715498963.019816  583764 curl_transport.cc:444] ` (absl before its clock is set
# prints `0000 00:00:<epoch seconds>`).
_GLOG = lazy(r"^[IWEF]\d{4} \d\d:\d\d:\d{2,12}\.\d{1,9}\s{1,4}(\d{1,10}) ([^\s\]]{1,200}):\d{1,7}\] ")
_PY_TIME = lazy(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?")


# What a checkpoint line says of the save or load it is about, whichever framework printed it (the catalogue's
# checkpoint rows, probes/catalogue/frameworks.yaml, and the lines this parser reads).
_CKPT_SAVE = lazy(
    r"\b(?:sav(?:e|ed|ing)|writ(?:e|ing|ten)|wrote|stag(?:e|ed|ing)|commit(?:s|ted|ting)?)\b", re.I
)
_CKPT_LOAD = lazy(r"\b(?:load(?:ed|ing)?|restor(?:e|ed|ing))\b", re.I)
_CKPT_OVER = lazy(
    r"\b(?:saved|wrote|written|staged|committed|loaded|restored|finished|done|complete[d]?|failed|died|timed out)\b",
    re.I,
)
_CKPT_AHEAD = lazy(r"\babout to be saved\b|\bwill be saved\b", re.I)


def checkpoint_reading(text: str) -> dict[str, object]:
    """A checkpoint line's reading: a save (or a load), whether it is over (finished, failed) or under way, and the
    time the line carries (for the playbooks that put it beside a timeout: playbooks/timeline.py)."""
    saving = bool(_CKPT_SAVE.search(text)) and not _CKPT_LOAD.search(text)
    over = bool(_CKPT_OVER.search(text)) and not _CKPT_AHEAD.search(text)
    when = line_time(text)
    return {"saving": saving, "done": over, "time": when.isoformat() if when else None}


def line_time(text: str) -> datetime | None:
    """The wall-clock time a log line starts with or carries (`2026-02-18 10:28:25,496`), when it has one."""
    m = _PY_TIME.search(text[:120])
    if not m:
        return None
    frac = (m.group(7) or "0")[:6].ljust(6, "0")
    try:
        return datetime(*(int(m.group(i)) for i in range(1, 7)), int(frac))
    except ValueError:
        return None


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("Operation t", "Timeout was", "stopped", "reached", "Training completed", "heckpoint")
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is one of these (see probes/reader.py); bars are torch_log's."""
    if ("Operation t" in line or "Timeout was" in line) and _CURL.search(line):
        return 8
    if "it/s" in line or "s/it" in line:
        return 0
    if ("stopped" in line or "reached" in line or "Training completed" in line) and _FINISHED.search(line):
        return 6
    if "heckpoint" in line and _CHECKPOINT.search(line):
        return 6  # above a generic Python logging line (torch_log's 5): a save is what this line says
    return 0


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head.decode("utf-8", errors="replace")
    return 15 if _CURL.search(text) else 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    if not data or looks_binary(data[:8192]):
        return
    parse_lines(list(enumerate(text_lines(data), 1)), src, ev)


def parse_lines(lines: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    def add(kind: str, **fields: object) -> None:
        ev.events.append(LogEvent(kind, quote, host=src.host, rank=src.rank, pid=src.pid, fields=fields))

    for item in lines:
        no, text = item[0], item[1]
        if len(text) > 8192:
            text = text[:8192]
        quote = Quote(src.name, no, item[1])
        when = line_time(text)
        m = _CURL.search(text)
        if m:
            g = _GLOG.match(text)
            add("storage_stall", error=m.group(0), thread=int(g.group(1)) if g else None,
                where=g.group(2) if g else None, curl=True)  # fmt: skip
            continue
        if "it/s" in text or "s/it" in text:
            continue
        if _FINISHED.search(text):
            add("training_finished", time=when.isoformat() if when else None)
            continue
        m = _CHECKPOINT.search(text)
        if m:
            verb = (m.group(1) or m.group(2) or "").lower()
            t = _TARGET.search(text, m.start())
            add("checkpoint_io", verb=verb, saving=verb.startswith(("sav", "writ", "wrote")),
                done=verb in ("saved", "wrote", "written", "loaded", "restored"),
                target=t.group(1).rstrip(".,;") if t else None, time=when.isoformat() if when else None)  # fmt: skip
