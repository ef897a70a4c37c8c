"""NCCL's errors as the application around it prints them, without NCCL's `host:pid:tid [dev]` prefix.

Formats (NCCL's own words, as the frameworks pass them on):
    ncclInternalError: Internal check failed.              (a result code's name, nccl.h ncclResult_t, and
    Last error:                                             ncclGetErrorString's text; PyTorch prints the
    ncclSocketInit: connecting to address ...               last warning under it, from ncclGetLastError)
    ncclCommInitRankConfig(...) failed: invalid usage ... Last NCCL warning(error): 'Bootstrap : ...'   (XLA/JAX)
    NCCL operation ncclCommInitRank(&comm, ...) failed: unhandled system error                          (XLA)
    include/socket.h:344 WARN Socket creation failed : Address family not supported by protocol      (NCCL <= 2.3)
Each becomes an `nccl_error` (or `nccl_warn`) event whose `stage` says whether the failure was in set-up
(bootstrap, communicator init, socket creation: "init") or in the data path ("data"), as nccl_log does.
"""

from __future__ import annotations

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines as text_lines
from hangdx.probes.text import looks_binary

KIND = "nccl_error"
QUIET_WHEN_EMPTY = True

_CODES = (
    "ncclUnhandledCudaError",
    "ncclSystemError",
    "ncclInternalError",
    "ncclInvalidArgument",
    "ncclInvalidUsage",
    "ncclRemoteError",
)
# What ncclGetErrorString says for each (NCCL src/misc/...): XLA prints these words instead of the name.
_CODE_TEXT = {
    "unhandled cuda error": "ncclUnhandledCudaError",
    "unhandled system error": "ncclSystemError",
    "internal error": "ncclInternalError",
    "invalid argument": "ncclInvalidArgument",
    "invalid usage": "ncclInvalidUsage",
    "remote process exited or there was a network error": "ncclRemoteError",
}
# A line that starts with a result code (after a launcher's `[name]:` label at most): never a Python exception
# line, which torch_log reads (`RuntimeError: NCCL error in: ...` keeps its own line).
_LABEL = lazy(r"^\[[^\]\s]{1,64}\]:? ?")  # a launcher's `[trainer0|0]:`
_CODE_LINE = lazy(r"^(?:\[[^\]\s]{1,64}\]:? ?)?(?P<code>" + "|".join(_CODES) + r")\b:? ?(?P<msg>.*)$")
_CALL_FAILED = lazy(
    r"(?:NCCL operation )?(?P<func>nccl\w{2,40})\([^()]{0,200}\) failed"
    r"(?::? ?(?P<msg>.*))?$"
)
# XLA: "Last NCCL warning(error): 'Bootstrap : ...'" and "Last NCCL warning(error) log entry (may be unrelated)
# 'Cuda failure 2 'out of memory''."; PyTorch: "Last error:" then the warning on the next line.
_LAST = lazy(
    r"Last NCCL (?:warning|error)(?:\(\w{1,20}\))?(?: log entry(?: \(may be unrelated\))?)?:? ?'(?P<text>.*)'"
    r"|^Last error:\s*(?P<rest>.*)$"
)
# NCCL <= 2.3 printed `file:line WARN` without the word NCCL when pasted bare.
# (NCCL 2.0 printed `host [dev] include/socket.h:185 WARN Call to connect failed : Connection refused`.)
_OLD_WARN = lazy(
    r"^(?:[^\[\]]{1,64}? \[\d{1,6}\] )?(?P<file>\S+\.(?:h|hpp|c|cc|cu|cpp)):(?P<line>\d{1,6}) WARN (?P<msg>\S.*)$"
)
_CONTINUE = 4  # lines after a head that belong to its message ("Last error:", the warning itself)

SETUP_WORDS = lazy(
    r"[Bb]ootstrap|(?:(?<![\w/])|(?<=src/))init\.c[cu]:|ncclCommInit\w*|ncclCommSplit|[Nn]o socket interface|No usable listening "
    r"interface|Socket creation failed|ncclSocketInit\b|ncclSocketListen|ncclFindInterface"
)
DATA_WORDS = lazy(r"\[Pro(?:xy|gress) [Tt]hread\]|Proxy thread error|socket progress error")


def stage_of(text: str) -> str | None:
    """ "init" when the text names NCCL set-up, "data" when it names the proxy thread's data path, else None."""
    if SETUP_WORDS.search(text):
        return "init"
    if DATA_WORDS.search(text):
        return "data"
    return None


def _head(line: str) -> str | None:
    """What kind of head line this is, or None."""
    s = line.strip()
    if not s or len(s) > 4096:
        return None
    if "nccl" in s and _CODE_LINE.match(s):
        return "code"
    if "nccl" in s and _CALL_FAILED.search(s):
        return "call"
    if "Last NCCL warning" in s or "Last NCCL error" in s:
        return "last"
    if " WARN " in s and _OLD_WARN.match(s):
        return "warn"
    return None


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("nccl", "Last NCCL warning", "Last NCCL error", " WARN ")
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is NCCL's error text (see probes/reader.py)."""
    return 7 if _head(line) else 0


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    n = sum(1 for ln in head.decode("utf-8", errors="replace").splitlines()[:2000] if _head(ln))
    return min(15 + n, 25) if n else 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    if not data or looks_binary(data[:8192]):
        return
    parse_lines(list(enumerate(text_lines(data), 1)), src, ev)


def parse_lines(lines: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """Each head line and the few lines that continue its message become one event."""
    i = 0
    while i < len(lines):
        no, text = lines[i][0], lines[i][1]
        kind = _head(text)
        if kind is None:
            i += 1
            continue
        block = [(no, text)]
        j = i + 1
        while j < len(lines) and len(block) <= _CONTINUE and kind != "warn":
            nxt = lines[j][1]
            if not nxt.strip() or _head(nxt) not in (None, "last"):
                break
            block.append((lines[j][0], nxt))
            j += 1
        try:
            _event(kind, block, src, ev)
        except (ValueError, IndexError, KeyError):  # odd text is skipped, never fatal
            pass
        i = j


def _event(kind: str, block: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    quote = Quote(src.name, block[0][0], block[0][1])
    verbatim = [[no, t] for no, t in block]
    block = [(no, _LABEL.sub("", t.strip(), count=1)) for no, t in block]
    head = block[0][1]
    whole = " ".join(t for _, t in block)
    # `lines`: the whole message as (line number, verbatim text), for a finding to quote.
    fields: dict = {"stage": stage_of(whole), "lines": verbatim, "message": whole[:1000]}
    if (
        kind == "warn"
    ):  # an NCCL warning like any other: read by nccl_log (IB errors, connect failures, stage)
        from hangdx.probes import nccl_log  # here: nccl_log imports this module

        m = _OLD_WARN.match(head)
        line = nccl_log.NcclLine(quote.line, quote.text, "", None, None, -1, "WARN", m["msg"], src.rank)
        nccl_log.parse_nccl_lines([line], src, ev)
        return
    code = _CODE_LINE.match(head)
    call = _CALL_FAILED.search(whole)
    fields["code"] = code["code"] if code else _code_from_words(whole)
    fields["function"] = call["func"] if call else None
    last = None
    for _, t in block:
        m = _LAST.search(t.strip())
        if m:
            last = (m["text"] if m["text"] is not None else m["rest"]).strip()
            break
    if last == "" and len(block) > 1:  # `Last error:` on its own line: the message is the next line
        idx = next(k for k, (_, t) in enumerate(block) if _LAST.search(t.strip()))
        last = block[idx + 1][1].strip() if idx + 1 < len(block) else None
    fields["last_error"] = last or None
    ev.events.append(_log_event("nccl_error", quote, src, fields))


def _code_from_words(text: str) -> str | None:
    low = text.lower()
    return next((name for words, name in _CODE_TEXT.items() if words in low), None)


def _log_event(kind: str, quote: Quote, src: Source, fields: dict) -> LogEvent:
    return LogEvent(kind=kind, quote=quote, host=src.host, rank=src.rank, pid=src.pid, fields=fields)
