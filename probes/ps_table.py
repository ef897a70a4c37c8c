"""Process tables people paste: `ps` (and `top`) output with a state and a wait channel, and `/proc/PID/stack`.

    PID  STAT WCHAN                    ELAPSED      COMMAND
    1533  DNl  nfs_start_io_read      1-22:05:51   python train.py

The header line names the columns (`ps -o pid,stat,wchan:32,etime,cmd`, `ps axl`, `ps -eLo ...`, top's
`PID USER ... S %CPU ...`); each row under it is one process: its PID, its state (the first letter of STAT or S:
R, S, D, Z, T...) and, when there is one, the kernel function it sleeps in (WCHAN). A row is cut into fields at
blanks; the columns before the last are single words in every ps format, the last (COMMAND) may hold blanks.

`/proc/PID/stack` (as root) prints the task's kernel stack, innermost first:

    [<0>] nfs_start_io_read+0x1a/0x40 [nfs]
    [<0>] nfs_file_read+0x3f/0xa0 [nfs]

Its innermost frame that is not the scheduler's own is where the task waits: its wait channel.
"""

from __future__ import annotations

from hangdx.probes.model import Evidence, ProcessState, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines

KIND = "ps_table"

_PID_COLS = {"PID", "TID", "LWP", "SPID"}
_STATE_COLS = {"STAT", "S", "STATE"}
_WCHAN_COLS = {"WCHAN", "WCHAN:32", "WCHAN:30", "WCHAN:40", "WCHAN:50"}
_CMD_COLS = {"COMMAND", "CMD", "ARGS", "COMM"}
_KSTACK = lazy(
    r"^\[<[0-9a-fA-F]{1,16}>\] (?:\? )?([A-Za-z_][\w.]{0,200})\+0x[0-9a-fA-F]{1,16}/0x[0-9a-fA-F]{1,16}"
)
# A frame's module tag, the last thing on its line: `[<0>] nv_get_p2p_free_callback+0x59/0x110 [nv_peer_mem]`.
_KMODULE = lazy(r"\[([A-Za-z_][\w]{0,63})\]\s*$")
_PROC_PATH = lazy(r"/proc/(\d{1,10})/(?:task/\d{1,10}/)?stack\b")
_STATE = lazy(r"^[RSDZTtXIWKPL][<NLsl+]{0,6}$")
# Scheduler and wait plumbing: a frame of these says the task sleeps, not where.
_PLUMBING = lazy(
    r"^(?:__schedule|schedule\w*|io_schedule\w*|preempt_schedule\w*|__switch_to\w*|do_wait\w*|wait_woken"
    r"|wait_for_completion\w*|rwsem_down_\w+|down|down_interruptible|down_killable|down_timeout|down_read\w*|down_write\w*|__down\w*|__mutex_lock\w*"
    r"|mutex_lock\w*|__x64_sys_\w+|__se_sys_\w+|__do_sys_\w+|do_syscall_64|entry_SYSCALL_64\w*|ret_from_fork"
    r"|kthread|bit_wait\w*|__wait_on_bit\w*|out_of_line_wait_on_bit\w*|prepare_to_wait\w*)$"
)


# The ps command itself, echoed above output whose header a filter dropped (`ps -eo pid,state,wchan:32,cmd |
# awk '$2 ~ /D/'`): its -o / o / --format list names the columns, in order.
_PS_CMD = lazy(
    r"(?:^|[\s$#>|;])ps\s+(?:-[a-zA-Z]{0,8}o\s?|o\s|--format[= ]|-[a-zA-Z]{1,8}\s+-o\s?)([\w:,=]{3,300})"
)


# `ps aux` (BSD syntax, also `ps -aux`, `ps auxww`, `ps auxf`) prints a fixed set of columns: its output under a
# `| grep` has no header line, but the command above it says what the columns are.
_PS_AUX = lazy(r"(?:^|[\s$#>|;])ps\s+-?(?:aux|axu|uax)[wfe]{0,3}(?=\s|$|\|)")
_AUX_COLS = ["USER", "PID", "%CPU", "%MEM", "VSZ", "RSS", "TTY", "STAT", "START", "TIME", "COMMAND"]


def _command_header(line: str) -> list[str] | None:
    if "ps" in line and _PS_AUX.search(line):
        return list(_AUX_COLS)
    m = _PS_CMD.search(line) if "ps" in line else None
    if not m:
        return None
    up = [c.split("=")[0].split(":")[0].upper() for c in m.group(1).split(",") if c]
    if not (_PID_COLS & set(up)) or not (_STATE_COLS & set(up)):
        return None
    return up


def _header(line: str) -> list[str] | None:
    cols = line.split()
    if len(cols) < 3 or len(cols) > 40:
        return None
    up = [c.upper() for c in cols]
    if up != cols and not all(c.isupper() or not c.isalpha() for c in cols[:3]):
        return None
    if not (_PID_COLS & set(up)) or not (_STATE_COLS & set(up)):
        return None
    return up


def sniff(head: bytes) -> int:
    text = head[:16384].decode("utf-8", errors="replace")
    for ln in text.splitlines()[:200]:
        if claims(ln) >= 8:
            return 60
    return 0


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("[<", "PID", "TID", "ps")
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is a process table's or a kernel stack's (see probes/reader.py)."""
    if line.startswith("[<") and _KSTACK.match(line):
        return 8
    if len(line) < 400 and ("PID" in line or "TID" in line) and ("STAT" in line or " S " in line):
        cols = _header(line)
        if cols and (_WCHAN_COLS & set(cols) or "STAT" in cols):
            return 8
    if len(line) < 400 and "ps" in line and _command_header(line):
        return 8
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_lines(list(enumerate(lines(data), 1)), src, ev)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    cols: list[str] | None = None
    kstack: list[tuple[int, str, str]] = []  # (line, text, function)
    kpid: int | None = None

    def flush_kstack() -> None:
        nonlocal kstack
        if kstack:
            where = next((f for _, _, f in kstack if not _PLUMBING.match(f)), kstack[0][2])
            no, text, _ = next(k for k in kstack if k[2] == where)
            pid = kpid if kpid is not None else src.pid
            # The modules its frames are in, innermost first: the drivers and file systems the task waits in (one
            # asleep on a lock taken inside the NVIDIA driver shows `down` first, then the driver's own frames).
            modules = list(dict.fromkeys(m.group(1) for _, t, _ in kstack if (m := _KMODULE.search(t))))
            if pid is not None or len(kstack) >= 1:
                ev.processes.append(
                    ProcessState(
                        host=src.host,
                        pid=pid if pid is not None else -1,
                        rank=src.rank,
                        wchan=where,
                        quote=Quote(src.name, no, text),
                        kernel_modules=modules or None,
                    )
                )
        kstack = []

    for no, raw in numbered:
        text = raw.rstrip()
        k = _KSTACK.match(text)
        if k:
            kstack.append((no, text, k.group(1)))
            continue
        flush_kstack()
        p = _PROC_PATH.search(text)
        if p:
            kpid = int(p.group(1))
        h = _header(text) or _command_header(text)
        if h:
            cols = h
            continue
        if cols is None or not text.strip():
            continue
        row = _row(cols, text)
        if row is None:
            continue
        pid, state, wchan, cmd = row
        ev.processes.append(
            ProcessState(
                host=src.host,
                pid=pid,
                rank=src.rank,
                state=state,
                wchan=wchan,
                command=cmd,
                quote=Quote(src.name, no, text.strip()),
            )
        )
    flush_kstack()
    ev.note_host(src.host)


def _row(cols: list[str], text: str) -> tuple[int, str, str | None, str | None] | None:
    """(pid, state letter, wchan, command) of a row under the header, or None for a line that is not one."""
    cmd_at = next((i for i, c in enumerate(cols) if c in _CMD_COLS), None)
    parts = text.split(None, cmd_at) if cmd_at == len(cols) - 1 else text.split()
    if len(parts) < min(len(cols), (cmd_at if cmd_at is not None else len(cols))):
        # A row cut short (a paste that lost its last columns) still gives the columns it has.
        if len(parts) < 2:
            return None
    values = dict(zip(cols, parts, strict=False))
    pid_col = next(c for c in cols if c in _PID_COLS)
    state_col = next(c for c in cols if c in _STATE_COLS)
    pid_s, state_s = values.get(pid_col, ""), values.get(state_col, "")
    if not pid_s.isdigit() or len(pid_s) > 10 or not _STATE.match(state_s):
        return None
    wchan_col = next((c for c in cols if c in _WCHAN_COLS), None)
    wchan = values.get(wchan_col) if wchan_col else None
    if wchan in ("-", "0", None, ""):
        wchan = None
    cmd = values.get(cols[cmd_at]) if cmd_at is not None else None
    return int(pid_s), state_s[0], wchan, cmd
