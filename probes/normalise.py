"""Turning what people paste into clean lines: prefixes, colour codes, progress bars, fences and wraps.

A line of real evidence rarely arrives as the tool printed it. A launcher put `[rank3]:` (torchrun),
`3: ` (srun --label), `node17: ` (pdsh, clush), `[pod/NAME/CONTAINER] ` (kubectl logs --prefix),
`(RayTrainWorker pid=615, ip=10.0.0.3) ` (Ray) or a `grep -H` file name before it; a terminal left ANSI
colours and carriage-return progress bars in it; a chat window wrapped it; a bug report put it inside a
markdown fence or a `> ` quote and cut the boring part with `...`. `Normaliser.line()` takes all of that off
and says what the prefixes named (the rank, the host, the file), so that each line is read as the tool
printed it and attributed to the process that printed it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hangdx.probes.naming import host_from_path, rank_from_name
from hangdx.probes.rx import lazy

# CSI (colours, cursor moves), OSC (titles, links) and two-character escapes; bounded, so linear.
_ANSI = lazy(r"\x1b(?:\[[0-9;?]{0,64}[ -/]{0,4}[@-~]|\][^\x07\x1b]{0,512}(?:\x07|\x1b\\)?|[@-Z\\-_])")
# torchrun: `[rank3]:` (c10d's log prefix) and `[default3]:` (the elastic agent's `[{role}{local_rank}]:` with --tee).
_TORCHRUN = lazy(r"\[(?:(?:default)?rank|default)(\d{1,9})\]:\s?")
# Open MPI's `mpirun --tag-output`: `[1,3]<stderr>:` is job 1, rank 3 (the line follows the colon directly).
# horovodrun's own launcher tags `[3]<stderr>:`, after `time.asctime()` with --prefix-output-with-timestamp
# (horovod/runner/common/util/safe_shell_exec.py): `Fri Sep 18 03:11:09 2020[3]<stderr>:`.
_OMPI_TAG = lazy(
    r"(?:[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})?\[(?:\d{1,9},)?(\d{1,9})\]<(?:stdout|stderr|stddiag)>:"
)
# A shell prompt before a command (`user@gpu-node-03:~/run$ nvidia-smi`, `[user@node17 dir]# dmesg`,
# `zeyer@cn-234 ~ % nvidia-smi`): the output under it came from that host.
_PROMPT = lazy(
    r"(?:\([\w.\-]{1,64}\) ?)?\[?[a-z_][\w.\-]{0,31}@([A-Za-z0-9][A-Za-z0-9_.\-]{0,62})"
    r"(?::[~/][^\s$#%>\]]{0,256}| [~/][^\s$#%>\]]{0,256}| [\w.\-~/]{1,128}(?=\]))?\]? ?[$#%](?: (.*)|\s*$)"
)
# Commands whose output comes from other hosts (launchers, remote shells): their prompt names no source.
_REMOTE_CMD = lazy(
    r"\s*(?:sudo )?(?:mpirun|mpiexec|srun|salloc|sbatch|torchrun|deepspeed|accelerate|horovodrun|pdsh|clush|ssh"
    r"|kubectl|docker|ray|python\S* -m torch\.distributed)\b"
)
_SRUN = lazy(r"\s{0,6}(\d{1,6}):(?: |$)")  # an empty labelled line may have lost its blank
_RANK_WORD = lazy(r"[Rr]ank[ _]?(\d{1,9}) ?[:|] ")
# `[rank8] ...`: torchrun's tag as people retype it, without its colon.
_RANK_TAG = lazy(r"\[(?:default)?rank(\d{1,9})\] (?=\S)")
# A line that only names a rank, as people head what they paste of each rank (`Rank 1:`, `rank 0 (waiting):`,
# `**Rank 0 worker (one of 8):**` once the bold is undone, `### Rank 3`): the lines under it are that rank's, up
# to the next such heading or a line whose own prefix names a rank.
_CHILD_WORD = lazy(r"\b(?:[Ww]orkers?|[Cc]hild(?:ren)?|[Ss]ubprocess(?:es)?)\b")
_RANK_HEADING = lazy(
    r"(?:#{1,6} {1,3}(?=[Rr]))?[Rr]ank[ _#]?(\d{1,6})(?:[ \-][A-Za-z][\w \-]{0,30}?)?(?: ?\([^()]{0,40}\))?"
    r"(?:(?<=\d)|(?<=[\w)]) ?:| ?:)\s*"
)
# The same in prose, as people head each dump they paste (`The stack for rank0:`, `py-spy dump of rank 3:`, `rank 1
# stack trace:`): a short line that ends with its only colon, names one rank and nothing else by number, and says
# what it heads (a stack, a trace, a dump, a log); a log message that ends with a colon (`Timed out waiting for rank
# 5:`, `INFO train.py: waiting for rank 0:`) is none.
_PROSE_HEADING_RANK = lazy(r"(?i)(?<![\w-])rank[ _#-]?(\d{1,6})(?![\w-])")
_PROSE_HEADING_WHAT = lazy(
    r"(?i)\b(?:stacks?|traces?|traceback|backtraces?|dumps?|py-?spy|pystack|gdb|threads?|logs?|output)\b"
)
_PROSE_HEADING_MAX = 70
_POD = lazy(r"\[pod/([^/\]\s]{1,253})/[^\]\s]{1,253}\] ")
# Ray's actor prefix `(RayTrainWorker pid=615, ip=10.0.0.3) ` (an IPv6 node in brackets: `ip=[fdbd::30f]`), and vLLM's
# worker processes, which print the same
# shape (vllm's _add_prefix): `(VllmWorker rank=1 pid=8700) `, in newer releases `(Worker_TP1 pid=1163) `,
# `(Worker_PP1_TP0 pid=...) `, `(EngineCore_DP0 pid=...) `. A worker's rank is read when its name gives it alone
# (rank=N, or a tensor-parallel rank with no pipeline or data-parallel rank beside it).
_RAY = lazy(
    r"\((?:VllmWorker rank=(\d{1,6})|Worker_TP(\d{1,6})|\w{1,64}) pid=(\d{1,10})(?:, ip=\[?([0-9a-fA-F.:]{1,45})\]?)?\) ?"
)
# SGLang's log prefix (python/sglang/srt/utils.py configure_logger: `[%(asctime)s TP3] `): the tensor-parallel
# rank of the scheduler that printed, read when no DP or PP rank stands beside it; the line keeps its time.
_SGLANG = lazy(r"\[(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d )?TP(\d{1,5})(?: EP\d{1,5})?\] ")
# A logging library's own rank tag, right after the log header it sits in: DeepSpeed's log_dist
# (deepspeed/utils/logging.py: `"[Rank {}] {}".format(my_rank, message)` under `[%(asctime)s] [%(levelname)s]
# [%(filename)s:%(lineno)d:%(funcName)s] `), `[rank=3]` loggers. The header must be there (a time, a level or a
# `[file:line]`): a bare `[Rank 3] ...` is as often a message about rank 3 (c10d's, a rank 0 printing the others'
# figures). Lightning's rank_prefixed_message (lightning_fabric/utilities/rank_zero.py: `f"[rank: {rank}] {message}"`)
# opens the message itself, so its tag is read with or without a header. The tag names the global rank, so it
# wins over torchrun's `[defaultN]:`, which is the local one.
_TIME = r"\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?\]? {1,2}"
_LEVEL = r"\[?(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\]? {1,2}"
_SRC = r"\[[\w.\-]{1,128}:\d{1,6}(?::\w{1,128})?\] {1,2}"
_LOG_RANK = lazy(
    rf"(?:(?:{_TIME}(?:{_LEVEL})?(?:{_SRC})?|{_LEVEL}(?:{_SRC})?|{_SRC})\[[Rr]ank(?:: ?|=| )|\[rank: ?)(\d{{1,6}})\] (?=\S)"
)
# icefall's and its recipes' logger (icefall/utils.py setup_logger: `%(asctime)s %(levelname)s
# [%(filename)s:%(lineno)d] ({rank}/{world_size}) %(message)s`): the rank after that whole header, when its world
# size allows it.
_ICEFALL_RANK = lazy(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \[[\w.\-]{1,128}:\d{1,6}\] "
    r"\((\d{1,6})/(\d{1,6})\) "
)
_RFC3339 = lazy(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)? ")
_GUTTER = lazy(r"\[(\d{1,9})\] ")
# NCCL's own `[dev] ` before its message when the host:pid:tid part is gone (`[10] NCCL INFO ...`, `[10]
# ./src/include/alloc.h:58 NCCL WARN ...`): the CUDA device the line is about, never a log viewer's line number.
_NCCL_AFTER_DEV = lazy(r"(?:\S{1,300}\.(?:cc|cu|h|c|cpp):\d{1,6} )?NCCL (?:INFO|WARN|TRACE|ABORT)\b")
_HOST = lazy(r"([A-Za-z0-9][A-Za-z0-9_.\-]{0,62}): ")
_GREP_H = lazy(
    r"((?:[\w.\-]{1,128}/){0,16}[\w.\-]{1,128}\.(?:log|txt|out|err|stderr|stdout|trace))(?::(\d{1,9}))?[:\-]"
)
# grep -H over the system log, whose files have no extension (`/var/log/messages:Jun 17 ...`, `syslog.1:...`).
_GREP_SYSLOG = lazy(
    r"(/?(?:[\w.\-]{1,128}/){0,16}(?:messages|syslog|dmesg)(?:[.\-]\d{1,8})?)(?::(\d{1,9}))?:(?=\S)"
)
# `ip link` rows (`2: eth0: <BROADCAST,...>`) look like srun's `2: ` label; they are not one.
_IP_LINK_ROW = lazy(r"\d{1,6}: [\w@.\-]{1,40}: <")
# Nor are the rows of MPICH mpiexec's `job aborted:` table (`rank: node: exit code: error`): the row is read whole.
_MPI_ABORT_ROW = lazy(r"\d{1,7}: [\w.\-]{1,253}: -?\d{1,4}: Fatal error in ")
# A host label is a node name (`gpu-node-03`, `node17`, `ip-10-0-0-1.ec2.internal`), not a word that ends a
# Python exception or a logging level.
_NOT_HOST = lazy(
    r"(?:Error|Exception|Warning|Interrupt|Exit|Iteration|Traceback|Note|Hint)$|^(?:kernel|localhost6?)$|torch"
    # The kernel's and drivers' own device names before a message (`bond0: (slave ens1f0): ...`, `ib0: ...`,
    # `nvme0n1: Read(0x2) ...`, `nvidia-nvswitch3: SXid ...`, `mlx5_core 0000:3b:00.0: ...`, `mlx5: host: ...`):
    # a device of the node that printed the line, not the node's name.
    r"|^(?:bond|eth|ib|ens|enp|eno|enx|nvme|nvidia-nvswitch|nvswitch|hfi\d_|mlx\d_|qedr|bnxt_re|irdma|efa_)\w{0,24}$"
    r"|^mlx\d(?:_core|_ib)?$"
)
_FENCE = lazy(r"\s{0,8}(?:```|~~~)")
# pytest's failure report marks each line of the error it explains with `E` and seven spaces (the line's own
# indentation follows): `E       Traceback (most recent call last):`, `E         File "x.py", line 3, in f`.
_PYTEST_E = "E       "
_ELISION = lazy(
    r"\s*(?:\.{2,}|…+|\[\s*(?:\.{3}|…|snip\w*)\s*\]|\(\s*(?:\.{3}|…|snip\w*)\s*\)|<\s*(?:\.{3}|snip\w*)\s*>"
    r"|(?:\.{3}|…) ?\(?\d{0,9} ?(?:more )?lines?(?: \w+){0,3}\)?)\s*"
)
# The end of a tqdm / Lightning bar (`12/100 [00:03<00:24,  3.61it/s, loss=2.6]`), when more text follows it on
# the same line (the bar had no newline of its own and the next message was printed after it).
_BAR_END = lazy(
    r"(?<!\d)\d{1,12}/\d{1,12} \[[0-9:<>?]{1,32}(?:, {1,3}[0-9.?]{1,12} ?(?:it/s|s/it))?[^\]\n]{0,240}\]"
)


@dataclass(frozen=True)
class Line:
    """One clean line, with what its prefixes said about who printed it."""

    no: int  # 1-based line number in the input
    text: str
    rank: int | None = None
    host: str | None = None
    pid: int | None = None
    label: str | None = None  # a `grep -H` file name or a pod, when one was given
    torchrun: str = (
        ""  # torchrun's own `[rank3]:` prefix as printed, which log parsers read (and quote) themselves
    )
    parts: tuple[str, ...] = ()  # the pieces of a line rejoined after a wrap, as they were printed


# NCCL's `host:pid:tid [dev]` wherever it sits on a line, with the host in any form a log or a person left:
# `gpu-node-48`, `...-48` (shortened by hand), `10.0.0.7`, `trainer-0-worker-3` (a pod).
_NCCL_ORIGIN = lazy(
    r"(?:^|[\s\]|])(?P<host>[^\s:\[\]|]{1,253}):(?P<pid>\d{1,10}):\d{1,10} \[(?P<dev>-?\d{1,6})\]"
)


@dataclass(frozen=True)
class Origin:
    """Who printed an NCCL line, as its own prefix says (not a launcher's)."""

    host: str | None
    pid: int | None
    device: int | None


def nccl_origin(text: str) -> Origin | None:
    """The `host:pid:tid [dev]` NCCL put before its message, anywhere on the line; None when there is none."""
    m = _NCCL_ORIGIN.search(text[:512]) if ":" in text[:512] else None
    if not m:
        return None
    host: str | None = m.group("host")
    if host.startswith(("...", "…")):
        host = "…" + host.lstrip(".…")  # a name the poster shortened stays recognisably shortened
    host = host.rstrip(".,;") or None
    return Origin(host, int(m.group("pid")), int(m.group("dev")))


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text) if "\x1b" in text else text


def overwritten(text: str) -> str:
    """What a terminal shows of a line rewritten with carriage returns: its last non-empty segment."""
    if "\r" not in text:
        return text
    for seg in reversed(text.split("\r")):
        if seg.strip():
            return seg
    return ""


def same_host(a: str, b: str) -> bool:
    """One host under two names: equal, or a short name and a fully qualified one it begins (`ip-10-0-1-7` and
    `ip-10-0-1-7.ec2.internal`); an IP address only as itself."""
    a, b = a.lower().rstrip("."), b.lower().rstrip(".")
    if a == b:
        return True
    short, full = (a, b) if len(a) < len(b) else (b, a)
    return "." not in short and not short.isdigit() and full.startswith(short + ".") and not full[0].isdigit()


def same_origin(line: Line, nxt: Line) -> bool:
    """Can `nxt` be more of what `line` printed (the rest of a wrapped line, the lines under a message)? Only if it
    came from the same process, or its prefixes name none (a wrap leaves a launcher's prefix on the first piece)."""
    theirs = (nxt.rank, nxt.host, nxt.pid, nxt.label)
    return theirs == (None, None, None, None) or theirs == (line.rank, line.host, line.pid, line.label)


def is_host_label(label: str) -> bool:
    if _NOT_HOST.search(label) or label.isupper() or label.isdigit():
        return False
    return any(c.isdigit() for c in label) or "-" in label or label in ("localhost",)


class Normaliser:
    """Cleans lines one at a time; keeps the little state a paste needs (a line-number gutter, fences)."""

    def __init__(self) -> None:
        self._gutter: int | None = None  # the last line number of a `[1743] ` gutter, when the text has one
        self._prompt_host: str | None = None  # the host of the last shell prompt, until the next or a fence
        self._heading_rank: int | None = (
            None  # the rank a heading line named, for the unprefixed lines under it
        )

    def line(self, no: int, raw: str) -> list[Line]:
        """The clean line(s) of one raw line: none for fences and elisions, two where a bar hid a message."""
        text = overwritten(strip_ansi(raw))
        rank = host = pid = label = None
        lead = ""
        if text.startswith("`") and not text.startswith("``"):  # a line quoted as inline code in a chat
            text = text[1:].removesuffix("``").removesuffix("`")
        prompt = _PROMPT.match(text) if "@" in text[:300] else None
        if prompt:
            named = prompt.group(1)
            remote = prompt.group(2) is not None and _REMOTE_CMD.match(prompt.group(2))
            ok = not (_NOT_HOST.search(named) or named.isupper() or named.isdigit())
            self._prompt_host = named if ok and not remote else None
        for _ in range(6):  # prefixes nest (`node3: [rank12]: ...`); each is taken off once
            stripped = text.lstrip(" ") if text.startswith(" ") and text.lstrip(" ")[:1] in "[(" else text
            m = _TORCHRUN.match(stripped)
            if m:
                rank, text, lead = int(m.group(1)), stripped[m.end() :], m.group(0)
                continue
            m = _OMPI_TAG.match(text)
            if m:
                rank, text = int(m.group(1)), text[m.end() :]
                continue
            m = _POD.match(text)
            if m:
                host, label, text = host or m.group(1), label or m.group(1), text[m.end() :]
                continue
            m = _RAY.match(text)
            if m:
                named = m.group(1) or m.group(2)
                rank = int(named) if named is not None else rank
                pid, host, text = int(m.group(3)), host or m.group(4), text[m.end() :]
                continue
            m = _RFC3339.match(text)
            if m:
                text = text[m.end() :]
                continue
            m = _GUTTER.match(text)
            if m and self._is_gutter(int(m.group(1)), text[m.end() :]):
                text = text[m.end() :]
                continue
            m = _GREP_H.match(text) or _GREP_SYSLOG.match(text)
            if m:
                label = label or m.group(1)
                rank = rank if rank is not None else rank_from_name(m.group(1))
                host = host or host_from_path(m.group(1))
                text = text[m.end() :]
                continue
            m = _SRUN.match(text)
            if m and not _IP_LINK_ROW.match(text.lstrip()) and not _MPI_ABORT_ROW.match(text.lstrip()):
                rank, text = int(m.group(1)), text[m.end() :]
                continue
            m = _RANK_WORD.match(text) or _RANK_TAG.match(text)
            if m:
                rank, text = int(m.group(1)), text[m.end() :]
                continue
            m = _HOST.match(text)
            if m and host is None and is_host_label(m.group(1)) and not _IP_LINK_ROW.match(text):
                host, text = m.group(1), text[m.end() :]
                continue
            break
        if rank is None and text.startswith("[") and (m := _SGLANG.match(text)):
            rank = int(m.group(1))
        if (rank is None or lead.startswith("[default")) and text.find("ank", 0, 160) >= 0:
            m = _LOG_RANK.match(text)
            rank = int(m.group(1)) if m else rank
        if rank is None and text.find(") ", 0, 160) >= 0 and (m := _ICEFALL_RANK.match(text)):
            if int(m.group(1)) < int(m.group(2)):
                rank = int(m.group(1))
        if text.startswith(">") and (len(text) == 1 or text[1] == " "):
            text = text[2:]  # a markdown quote
        if text.startswith(_PYTEST_E) or text.rstrip() == "E":
            text = text[len(_PYTEST_E) :]  # pytest's failure report: `E       ` before each line of the error
        while text.startswith("^C"):
            text = text[2:]  # the terminal's echo of Ctrl-C, before the traceback it caused
        # Markdown bold around a pasted line (`**RuntimeError: ...**`), not a run of three or more stars that the
        # message itself prints (Slurm's `*** JOB 12 ON n CANCELLED AT ... ***`, Open MPI's `*** Process received
        # signal ***`, HF Trainer's `***** Running training *****`).
        if text.startswith("**") and text[2:3].strip() and text[2:3] != "*":
            text = text[2:]
        if text.rstrip().endswith("**") and text.rstrip()[-3:-2].strip() and text.rstrip()[-3:-2] != "*":
            text = text.rstrip()[:-2]
        if host is None and self._prompt_host:
            host = self._prompt_host
        if rank is not None:
            self._heading_rank = None  # the text's own prefixes name ranks from here on
        elif len(text) <= 90 and "ank" in text[:12] and (h := _RANK_HEADING.fullmatch(text.strip())):
            # `Rank 0 worker:` heads a stack of one of that rank's worker processes, not of the rank's own.
            self._heading_rank = None if _CHILD_WORD.search(text) else int(h.group(1))
        elif (h := _prose_heading(text)) is not None:
            self._heading_rank = h
        rank = rank if rank is not None else self._heading_rank
        if _FENCE.match(text):
            self._prompt_host = None  # a fence closes the output the prompt named
            return []
        if _ELISION.fullmatch(text):
            return []
        out = []
        m = _BAR_END.search(text) if "/" in text and "[" in text else None
        if m and text[m.end() :].strip():
            out.append(Line(no, text[: m.end()], rank, host, pid, label, lead))
            rest = self.line(no, text[m.end() :])
            return out + [
                Line(
                    r.no,
                    r.text,
                    r.rank if r.rank is not None else rank,
                    r.host or host,
                    r.pid or pid,
                    label,
                    r.torchrun,
                )  # fmt: skip
                for r in rest
            ]
        return [Line(no, text.rstrip(), rank, host, pid, label, lead)]

    def _is_gutter(self, n: int, rest: str) -> bool:
        """`[1743] text`: a log viewer's line numbers, told apart from `[3] Timeout at collective` by counting up."""
        if self._gutter is not None and 0 < n - self._gutter <= 50:
            self._gutter = n
            return True
        if (
            self._gutter is None
            and n >= 10
            and not rest.startswith(("Timeout at", "joined", "finished"))
            and not _NCCL_AFTER_DEV.match(rest)
        ):
            self._gutter = n
            return True
        return False


# A message a chat window or terminal wrapped: its opening parenthesis is closed only on a later line.
_WRAPPED_HEADS = ("WorkNCCL(", "CollectiveFingerPrint(", "WorkGloo(")


_WATCHDOG = "Watchdog caught collective operation timeout"
_RAN_FOR = lazy(r"ran for \d{1,15} milliseconds")


# NCCL's interface list (`NET/Socket : Using [0]eth0:10.0.0.1<0> [1]ib0:10.1.0.1<0>`, the bootstrap's and NET/IB's
# alike) is one line; a paste or a narrow terminal may break it before each `[N]name:address<port>` entry.
_IF_LIST = lazy(r"(?:NET/Socket|NET/IB|NET/OFI|Bootstrap) ?: ?Using(?: \S{1,300}?<\d{1,6}>)*\s*$")
_IF_ENTRY = lazy(r"\s{0,8}(?:\[\d{1,3}\])?[\w.\-]{1,32}:[0-9A-Za-z:.%\-]{2,120}<\d{1,6}>\s*")


def _prose_heading(text: str) -> int | None:
    """The rank a prose heading over a pasted dump names (`The stack for rank0:`), or None."""
    if len(text) > 2 * _PROSE_HEADING_MAX:
        return None
    text = text.strip()
    if not (8 <= len(text) <= _PROSE_HEADING_MAX and text.endswith(":") and text.count(":") == 1):
        return None
    if "ank" not in text.lower() or not _PROSE_HEADING_WHAT.search(text):
        return None
    ranks = {int(m.group(1)) for m in _PROSE_HEADING_RANK.finditer(text)}
    if len(ranks) != 1 or _CHILD_WORD.search(text):
        return None
    rank = ranks.pop()
    # Another number in the line (`rank 0 of 8:`, a time) makes it a message, not a heading.
    rest = _PROSE_HEADING_RANK.sub("", text)
    return None if any(c.isdigit() for c in rest) else rank


def _if_list(text: str) -> bool:
    return "Using" in text and len(text) <= 4096 and bool(_IF_LIST.search(text))


# A Python traceback's own lines (traceback.format_list: `  File "{}", line {}, in {}`; the header `Traceback (most
# recent call last):`) cut by a word wrap: a window or a page that breaks lines at spaces leaves `File` or
# `Traceback (most` alone on a line and the rest on the next. A line that is only such a beginning is always a cut.
_TB_PARTIAL = lazy(
    r"\s{0,16}(?:Traceback(?: \(most(?: recent(?: call)?)?)?"
    r'|File(?: "[^"\n]{1,1024}"(?:,(?: line(?: \d{1,9}(?:,(?: in)?)?)?)?)?)?)'
)
_TB_WHOLE = lazy(
    r'\s{0,16}(?:Traceback \(most recent call last\):|File "[^"\n]{1,1024}", line \d{1,9}, in \S.{0,1024})'
)


# The exception line that ends a traceback, cut after its type (`AssertionError:` alone, the message on the next).
_EXC_TYPE_ALONE = lazy(r"[A-Za-z_][\w.]{0,200}(?:Error|Exception|Interrupt|Exit|Failure):")


def traceback_cut(text: str) -> bool:
    """Is this line only the beginning of a traceback's header or frame line, or an exception's type without its
    message, cut by a word wrap?"""
    if len(text) > 1100:
        return False
    if ("File" in text or "Traceback" in text) and _TB_PARTIAL.fullmatch(text):
        return True
    return text.endswith(":") and bool(_EXC_TYPE_ALONE.fullmatch(text))


def traceback_goes_on(text: str, nxt: str) -> bool:
    """Does `nxt` finish (or carry on) the traceback line `text` was cut from?"""
    if text.endswith(":") and _EXC_TYPE_ALONE.fullmatch(text):
        # Its message: words, not the table or banner some exceptions print under their type (torchrun's
        # ChildFailedError and its `=====` rule).
        return nxt[:1].isalnum() and not traceback_cut(nxt)
    joined = text.rstrip() + " " + nxt.strip()
    return bool(_TB_WHOLE.fullmatch(joined) or _TB_PARTIAL.fullmatch(joined))


def joins_next(text: str) -> bool:
    """True when a line was cut by a wrap and continues on the next one."""
    if len(text) > 4096:
        return False
    if traceback_cut(text):
        return True
    if any(h in text for h in _WRAPPED_HEADS) and text.count("(") > text.count(")"):
        return True
    if _if_list(text):
        return True  # it goes on only with a next line that is one more interface (continues)
    # The watchdog prints its message on one line, ending `ran for N milliseconds before timing out.`.
    return _WATCHDOG in text and not _RAN_FOR.search(text)


def continues(text: str, nxt: str) -> bool:
    """Does `nxt` go on with the wrapped `text`? A cut-open parenthesis always does; an NCCL interface list only
    with one more `[N]name:address<port>`; an unfinished watchdog message only with its own parts (`WorkNCCL(...)`,
    `ran for ...`) or an indented line."""
    if traceback_cut(text):
        return traceback_goes_on(text, nxt)
    if any(h in text for h in _WRAPPED_HEADS) and text.count("(") > text.count(")"):
        return True
    if _if_list(text):
        return bool(_IF_ENTRY.fullmatch(nxt))
    return nxt[:1].isspace() or nxt.startswith(("WorkNCCL(", "ran for "))


# -- a terminal's hard wrap ----------------------------------------------------------------------------------
#
# A terminal (or a pager, or a copy out of tmux) that cuts every line at its width W leaves each long message in
# pieces: every piece but the last exactly W characters long, cut anywhere, mid-word included (`indi` / `cates`), and
# the next piece starting wherever the cut fell, never with the prefix the message began with. A text so cut says
# so: its longest lines are all W long and are followed by pieces of another shape. Lines that are merely as long
# as each other (a table, a run of lines of one format) are followed by lines of their own shape, and are left.

WRAP_MIN, WRAP_MAX = 60, 400  # terminal widths
WRAP_LOOK = 20_000  # lines of a text looked at to find its width (pasted texts are far shorter)
WRAP_JOIN_MAX = 64 * 1024  # a rejoined line stops growing here, as the reader cuts any line (a folded blob)
_SHAPE_DIGIT, _SHAPE_UPPER, _SHAPE_LOWER = lazy(r"\d"), lazy(r"[A-Z]"), lazy(r"[a-z]")


def _shape(text: str) -> str:
    """A line's opening as a pattern of character classes: `[rank6]:` and `[rank3]:` are one shape."""
    head = text.lstrip()[:6]
    return _SHAPE_LOWER.sub("a", _SHAPE_UPPER.sub("A", _SHAPE_DIGIT.sub("9", head)))


def _padded(text: str) -> bool:
    """A piece filled out to the width with blanks (tmux's copy): the message ended in it."""
    return text.endswith("  ")


def _goes_on(piece: str, start_shape: str, nxt: str, nxt_shape: str, starts: frozenset[str]) -> bool:
    """Does `nxt` continue the message whose piece `piece` (the last so far, W long) began as `start_shape`? Not when
    it opens the way the text's lines open (`starts`: the shapes of the lines that follow a line shorter than W)."""
    return (
        bool(nxt.strip())
        and not _padded(piece)
        and not piece.rstrip().endswith(("|", "+"))  # a table's border
        and not nxt.startswith("  ")  # an indented line is a line of its own (a traceback's frame)
        and nxt_shape != start_shape
        and nxt_shape not in starts
    )


def _starts(texts: list[str], width: int) -> frozenset[str]:
    return frozenset(_shape(texts[i + 1]) for i in range(len(texts) - 1) if len(texts[i]) < width)


def hard_wrap_width(texts: list[str]) -> int | None:
    """The width W a terminal cut this text at, or None when it was not cut: the longest lines, W long, at least
    three of them (and half of them) followed by a piece that goes on with them, pieces that open in more than one
    way (a header's fixed next line is a record, not a cut)."""
    if len(texts) < 4:
        return None
    width = max(map(len, texts))
    if not WRAP_MIN <= width <= WRAP_MAX:
        return None
    full = [i for i, t in enumerate(texts[:-1]) if len(t) == width]
    if len(full) < 3:
        return None
    starts = _starts(texts, width)
    going = [
        texts[i + 1]
        for i in full
        if _goes_on(texts[i], _shape(texts[i]), texts[i + 1], _shape(texts[i + 1]), starts)
    ]
    if len(going) < 3 or 2 * len(going) < len(full) or len({_shape(t) for t in going}) < 2:
        return None
    return width


def rejoin_hard_wraps(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Numbered lines with the pieces of each hard-wrapped message joined back into one line (numbered as its
    first piece), up to WRAP_JOIN_MAX characters; the text unchanged when no terminal cut it."""
    look = [t for _, t in lines[:WRAP_LOOK]]
    width = hard_wrap_width(look)
    if width is None:
        return lines
    starts = _starts(look, width)
    out: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        no, start = lines[i]
        text, piece, last = start, start, no
        start_shape = _shape(start) if len(start) == width else ""
        while (
            len(piece) == width
            and len(text) < WRAP_JOIN_MAX
            and i + 1 < len(lines)
            and lines[i + 1][0] == last + 1
            and _goes_on(piece, start_shape, lines[i + 1][1], _shape(lines[i + 1][1]), starts)
        ):
            i += 1
            last, piece = lines[i]
            text += piece
        out.append((no, text))
        i += 1
    return out
