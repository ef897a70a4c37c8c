"""hangdx node-side collector: finds one job's processes on this host and brings back raw artifacts.

Self-contained and standard-library-only (Python >= 3.8) on purpose: it runs in-process for
`--local`, and is sent as-is over SSH to `python3 -` on nodes where nothing but py-spy is installed.
It only reads; it never changes the job. Secrets are redacted before anything leaves the host.

Output: one JSON document
    {"hangdx_collector": 1, "host": ..., "job_id": ..., "started": t, "finished": t,
     "artifacts": [{"name": ..., "kind": ..., "rank": r, "pid": p, "data": text}],
     "errors": [{"source": ..., "message": ...}], "other_jobs": [...]}
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import platform
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

COLLECTOR_VERSION = 1
JOB_ENV_KEYS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "HANGDX_JOB_ID")
TAIL_BYTES = 256 * 1024
PYSPY_TIMEOUT = 15.0
CMD_TIMEOUT = 10.0

# Blocking syscalls worth naming; the first argument of those in _FD_SYSCALLS is a file descriptor.
_SYSCALLS = {
    "x86_64": {
        0: "read",
        1: "write",
        2: "open",
        7: "poll",
        17: "pread64",
        18: "pwrite64",
        19: "readv",
        20: "writev",
        23: "select",
        35: "nanosleep",
        40: "sendfile",
        42: "connect",
        43: "accept",
        44: "sendto",
        45: "recvfrom",
        47: "recvmsg",
        61: "wait4",
        72: "fcntl",
        73: "flock",
        74: "fsync",
        75: "fdatasync",
        202: "futex",
        219: "restart_syscall",
        208: "io_getevents",
        230: "clock_nanosleep",
        232: "epoll_wait",
        257: "openat",
        262: "newfstatat",
        270: "pselect6",
        271: "ppoll",
        275: "splice",
        281: "epoll_pwait",
        288: "accept4",
        326: "copy_file_range",
        332: "statx",
    },
    "aarch64": {
        4: "io_getevents",
        22: "epoll_pwait",
        25: "fcntl",
        32: "flock",
        56: "openat",
        63: "read",
        64: "write",
        65: "readv",
        66: "writev",
        67: "pread64",
        68: "pwrite64",
        72: "pselect6",
        73: "ppoll",
        79: "newfstatat",
        82: "fsync",
        83: "fdatasync",
        98: "futex",
        128: "restart_syscall",
        101: "nanosleep",
        115: "clock_nanosleep",
        202: "accept",
        203: "connect",
        206: "sendto",
        207: "recvfrom",
        212: "recvmsg",
        242: "accept4",
        260: "wait4",
        291: "statx",
    },
}
_FD_SYSCALLS = {
    "read",
    "write",
    "pread64",
    "pwrite64",
    "readv",
    "writev",
    "fsync",
    "fdatasync",
    "flock",
    "fcntl",
    "recvfrom",
    "recvmsg",
    "sendto",
    "accept",
    "accept4",
    "connect",
    "sendfile",
    "splice",
}
_PATH_SYSCALLS = {"open": 0, "openat": 1, "newfstatat": 1, "statx": 1}

# Names whose value is a secret: `HF_TOKEN=...`, `"password": "..."`, `--db-password x`, `MYSQL_PWD=...`.
_SECRET_NAME = (
    r"(?:token|secret|passw(?:or)?d|passwd|passphrase|[_-]pwd|api[_-]?key|access[_-]?key|private[_-]?key"
    r"|credential"
    # `key` and `pass` alone or as the last part of a name (--key, WANDB_KEY, --wandb-key, AccountKey, DB_PASS,
    # --pass), not inside a word (monkey, bypass, compass).
    # `pw` alone likewise (pw=..., DB_PW=...), not in pwr or pwd's own place (pwd= is handled above as [_-]pwd).
    r"|(?:(?<![A-Za-z0-9])|(?<=[_.-])|(?-i:(?<=[a-z])(?=K)))(?:key|pass|pw)(?![A-Za-z0-9]))"
)
_SECRET_KEY = r"[A-Za-z0-9_.-]{0,64}?(?P<word>" + _SECRET_NAME + r")(?P<tail>[A-Za-z0-9_.-]{0,64})"
# A value: "quoted with spaces", 'quoted', \"quoted inside a JSON string\" (escaped once or more), or bare up to
# a space, quote, comma or semicolon.
_SECRET_VALUE = (
    r"""(?:(?P<eb>\\{1,3})(?P<eq>["'])(?P<ev>(?:(?!(?P=eb)(?P=eq))[^\r\n]){1,512})(?P=eb)(?P=eq)"""
    r"""|"(?P<dq>[^"\r\n]{1,512})"|'(?P<sq>[^'\r\n]{1,512})'|(?P<q>["']?)(?P<bare>[^\s"',;]+))"""
)
_NUMBER = re.compile(r"^[0-9][0-9.,_eE+-]*$")
_WORD_GOES_ON = re.compile(r"(?i)^iz(?:er|ed|e|ation)")  # tokenizer=gpt2 names a tokenizer, not a token
_SECRET_TAIL = re.compile(r"(?i)key|pin|code|value|secret|pass|pwd|hash|salt|seed|otp")


def _named_secret(m) -> str:
    """`key=value` with a secret-sounding key -> `key=[REDACTED]`; `token_count=5`, `max_tokens: 512` stay."""
    value = m.group("ev") or m.group("dq") or m.group("sq") or m.group("bare") or ""
    tail = m.group("tail")
    if value.startswith("[REDACTED") or _WORD_GOES_ON.match(tail):
        return m.group(0)
    # A number under a longer name is a count or a frame (token_count=5, max_tokens: 512, tokens.py:12), unless
    # the rest of the name says secret (SECRET_KEY_BASE, DB_PASSWORD_2) or it is the bare plural (tokens=...).
    prefix = m.group("key")[: m.start("word") - m.start("key")].lstrip("-")
    if (
        _NUMBER.match(value.rstrip(")]"))
        and re.search("[A-Za-z]", tail)
        and not _SECRET_TAIL.search(tail)
        and (prefix or tail.lower() != "s")
    ):
        return m.group(0)
    if m.group("ev") is not None:
        quote = m.group("eb") + m.group("eq")
        return m.group("key") + m.group("sep") + quote + "[REDACTED]" + quote
    if m.group("dq") is not None:
        return m.group("key") + m.group("sep") + '"[REDACTED]"'
    if m.group("sq") is not None:
        return m.group("key") + m.group("sep") + "'[REDACTED]'"
    return m.group("key") + m.group("sep") + m.group("q") + "[REDACTED]"


# PEM private keys: the BEGIN line, the base64 after it (real or JSON-escaped line breaks, the headers of an
# encrypted key) and the END line when it is there: a key cut short before its END line goes all the same.
_PEM_KEY = re.compile(
    r"-----BEGIN [A-Z ]*PRIVATE KEY(?: BLOCK)?-----"
    r"(?:[A-Za-z0-9+/=]|(?:\r?\n|\\[nr])(?:\[[^\]\r\n]{1,40}\]:?|[A-Za-z0-9_.-]{1,40}:(?=[ \t]))?[ \t]*"
    r"|Proc-Type:[^\r\n]*|DEK-Info:[^\r\n]*)*"
    r"(?:-----END [A-Z ]*PRIVATE KEY(?: BLOCK)?-----)?"
)
# The base64 tail of a key whose BEGIN line was cut off (a log tail that starts mid-key), to its END line.
_PEM_TAIL = re.compile(
    r"(?m)(?:^[ \t]*[A-Za-z0-9+/=]{16,}[ \t]*\r?\n){1,120}[ \t]*-----END [A-Z ]*PRIVATE KEY(?: BLOCK)?-----"
    r"|(?<![A-Za-z0-9+/=])(?:[A-Za-z0-9+/=]{16,}\\n[ \t]*){1,120}-----END [A-Z ]*PRIVATE KEY(?: BLOCK)?-----"
)
# ANSI codes (colours, cursor moves, titles) as normalise.py takes them off; the collector stands alone, so its own.
_ANSI_CODE = re.compile(
    r"\x1b(?:\[[0-9;?]{0,64}[ -/]{0,4}[@-~]|\][^\x07\x1b]{0,512}(?:\x07|\x1b\\)?|[@-Z\\-_])"
)
_PEM_BEGIN = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY(?: BLOCK)?-----")
_PEM_END = re.compile(r"-----END [A-Z ]*PRIVATE KEY(?: BLOCK)?-----")
# The base64 that ends a line of a key under a log prefix (`INFO:root:MIIE...`, `[1,0]<stdout>:MIIE...`), the
# whole run (a prefix that ends in a letter glued to the body goes with it).
_PEM_BODY = re.compile(r"(?<![A-Za-z0-9+/=])[A-Za-z0-9+/=]+[ \t\r]*$")
_PEM_HEADER = re.compile(r"(?:Proc-Type|DEK-Info):[^\r\n]*$")
_BASE64_RUN = re.compile(r"[ \t]*[A-Za-z0-9+/]*={0,2}")


def _key_part(plain: str, prefix: str | None, next_plain: str) -> tuple[int, int] | None:
    """The span of key material on one line of a prefixed key, or None when the line holds none. In turn: a
    base64 run that fills the rest of the line after the BEGIN line's own prefix (or from the line's start);
    a header; a base64 run that ends the line and is long (a body line under another prefix, a timestamp that
    changed) or followed by the END line; last, a long run at the line's start with text after it (an
    unprefixed key that ends inside the line)."""
    lead = len(plain) - len(plain.lstrip())
    starts = [lead]
    if prefix is not None and prefix.strip() and plain.startswith(prefix.strip(), lead):
        starts.insert(0, lead + len(prefix.strip()))
    for start in starts:
        m = _BASE64_RUN.match(plain, start)
        if m and not plain[m.end() :].strip():
            if len(m.group(0).strip()) >= 16 or (prefix is not None and start == starts[0]):
                return m.start(), m.end()
    m = _PEM_HEADER.search(plain) or _PEM_BODY.search(plain)
    if m and (m.re is _PEM_HEADER or len(m.group(0).strip()) >= 16 or _PEM_END.search(next_plain)):
        return m.start(), m.end()
    m = _BASE64_RUN.match(plain, lead)
    if m and len(m.group(0).strip()) >= 16:
        return m.start(), m.end()
    return None


def _redact_prefixed_keys(text: str) -> str:
    """PEM private keys whose every line carries a log prefix (a timestamp and level, `INFO:root:`, journald,
    `[1,0]<stdout>:`, `rank0.log:`, `(pid=123) `, `> `, ANSI colours): each line is read without its ANSI codes
    and whatever prefix it has, as normalise.py reads it, and the key's lines go from BEGIN to END (or to the first
    line that is not key material, for a key cut short); a tail whose BEGIN line was cut off goes back from END."""
    if "PRIVATE KEY" not in text:
        return text
    lines = text.split("\n")
    plains = [_ANSI_CODE.sub("", ln) if "\x1b" in ln else ln for ln in lines]
    out: list[str] = []
    prefix: str | None = None  # inside a key: its BEGIN line's prefix
    for i, plain in enumerate(plains):
        nxt = plains[i + 1] if i + 1 < len(plains) else ""
        if prefix is None:
            begin = _PEM_BEGIN.search(plain)
            end = _PEM_END.search(plain)
            rest = plain[begin.end() :] if begin else ""
            if begin and rest.strip() and not _BASE64_RUN.fullmatch(rest):
                out.append(plain)  # the key goes on in this line (JSON-escaped `\n`): _PEM_KEY takes it whole
            elif begin and not (end and end.start() > begin.start()):
                prefix = plain[: begin.start()]
                out.append(prefix + "[REDACTED KEY]")
            elif end and not begin:
                # A tail: the lines before END that are key material go with it.
                after = plain
                while out and _key_part(out[-1], None, after):
                    out.pop()
                    after = ""
                out.append(plain[: end.start()] + "[REDACTED KEY]" + plain[end.end() :])
            else:
                out.append(lines[i])
            continue
        end = _PEM_END.search(plain)
        part = None if end else _key_part(plain, prefix, nxt)
        if end:
            rest = plain[end.end() :]
            prefix = None
        elif part is None:
            rest = lines[i]
            prefix = None
        else:
            rest = plain[part[1] :]
            if rest.strip():
                prefix = None  # the key ended inside this line
        if rest.strip():
            out.append(rest)
    return "\n".join(out)


_SECRET_PATTERNS = [
    # Tokens known by their form, wherever they are: Slack, GitHub, GitLab, Hugging Face, OpenAI-style, Stripe,
    # AWS access key ids, Google API keys, npm, JWTs, Slack webhook URLs.
    (
        re.compile(
            r"\b(?:xox[abposre]-[A-Za-z0-9-]{10,}|xoxe\.xox[bp]-[A-Za-z0-9-]{10,}|xapp-[A-Za-z0-9-]{10,}"
            r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|glpat-[A-Za-z0-9_-]{20,}"
            r"|hf_[A-Za-z0-9]{30,}|sk-[A-Za-z0-9_-]{20,}|[rs]k_(?:live|test)_[A-Za-z0-9]{16,}"
            r"|(?:AKIA|ASIA)[0-9A-Z]{16}|AIza[0-9A-Za-z_-]{35}|npm_[A-Za-z0-9]{36}"
            r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})"
        ),
        "[REDACTED]",
    ),
    (re.compile(r"(?i)(hooks\.slack\.com/(?:services|workflows|triggers)/)[A-Za-z0-9/_-]+"), r"\1[REDACTED]"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{12,}"), r"\1 [REDACTED]"),
    # Credentials in headers: `Authorization: <scheme> <credential>` keeps its scheme; a cookie header goes whole.
    (
        re.compile(
            r"(?i)\b((?:proxy-)?authorization[ \t]*[:=][ \t]*)(?![ \t])(?!(?:bearer|basic)[ \t]+\[REDACTED)"
            r"((?:[A-Za-z-]+[ \t]+)?)[^\s\"',;]+"
        ),
        r"\1\2[REDACTED]",
    ),
    (re.compile(r"(?im)\b((?:set-)?cookie[ \t]*:[ \t]*)[^\r\n]+"), r"\1[REDACTED]"),
    # key=value, key: value, "key": "value" where the key names a secret; bounded and anchored at the start of
    # a word (unbounded runs made this quadratic on long words).
    (
        re.compile(
            r"(?i)(?<![A-Za-z0-9_.-])(?P<key>"
            + _SECRET_KEY
            + r")(?P<sep>(?:\\{0,3}[\"'])?\s{0,8}[=:]\s{0,8})"
            + _SECRET_VALUE
        ),
        _named_secret,
    ),
    # --password VALUE, -token VALUE on a command line (py-spy's header quotes it).
    (
        re.compile(
            r"(?i)(?<![A-Za-z0-9_.-])(?P<key>--?" + _SECRET_KEY + r")(?P<sep>\s{1,8})(?!-)" + _SECRET_VALUE
        ),
        _named_secret,
    ),
    # argv printed as a Python list: '--password', 'VALUE'
    (
        re.compile(
            r"(?i)(?P<lead>([\"'])--?"
            + _SECRET_KEY
            + r"\2,\s{0,4})(?P<quote>[\"'])[^\"'\r\n]{1,512}(?P=quote)"
        ),
        lambda m: m.group("lead") + m.group("quote") + "[REDACTED]" + m.group("quote"),
    ),
    # -pVALUE (mysql, mysqldump): not a port (-p2222), not a compiler flag (-pthread, -pipe, -pedantic, -pie).
    (re.compile(r"(?<![\w-])-p(?!thread|ipe|edantic|ie\b|g\b|[0-9-])([^\s\"',;]{4,})"), "-p[REDACTED]"),
    # Passwords tools take after a bare -p: `sshpass -p V`, `docker login -p V` (podman, nerdctl, ...).
    (
        re.compile(
            r"(?i)(\b(?:sshpass|(?:docker|podman|nerdctl|buildah|skopeo|oras|helm[ \t]+registry)[ \t]+login)\b"
            r"(?:(?![ \t]-p)[^\r\n]){0,200}[ \t]-p[ \t]*)(?!\[REDACTED)(?:\"[^\"\r\n]{1,512}\"|'[^'\r\n]{1,512}'|[^\s\"']+)"
        ),
        r"\1[REDACTED]",
    ),
    # .netrc: `machine HOST login USER password V`, on one line or several.
    (
        re.compile(
            r"(?i)(\b(?:machine[ \t]+\S+|default)(?:\s+(?:login|account|port)\s+\S+){0,4}\s+password\s+)"
            r"(?!\[REDACTED)\S+"
        ),
        r"\1[REDACTED]",
    ),
    # user:password@ in URLs; the user may be empty (redis://:password@host), the password may hold an @.
    (re.compile(r"(://[^:/\s@]*:)[^\s/]*@"), r"\1[REDACTED]@"),
]


def redact(text: str, known: Iterable[str] = ()) -> str:
    """Blank out tokens, keys and passwords; and every `known` secret value (seen in a rank's environment or
    argv) wherever it appears. Colour codes go first, as the reader's normalising pass takes them off: a key
    printed in colour (`\x1b[1mpassword\x1b[0m: ...`) is a key all the same."""
    if "\x1b" in text:
        text = _ANSI_CODE.sub("", text)
    text = _redact_prefixed_keys(text)
    text = _PEM_KEY.sub("[REDACTED KEY]", text)
    if "-----END" in text:
        text = _PEM_TAIL.sub("[REDACTED KEY]", text)
    for pattern, repl in _SECRET_PATTERNS:
        text = pattern.sub(repl, text)
    for value in sorted(known, key=len, reverse=True):
        if value in text:
            text = text.replace(value, "[REDACTED]")
    return text


_SECRET_VAR = re.compile(r"(?i)" + _SECRET_NAME)
MIN_KNOWN_SECRET = 8  # shorter values (a `1`, `true`) would blank out ordinary text


def secret_values(env: dict[str, str], argv: list[str]) -> set[str]:
    """Values of secret-named variables and of secret-named options (`--key VALUE`, `--key=VALUE`)."""
    out = {v for k, v in env.items() if _SECRET_VAR.search(k) and len(v) >= MIN_KNOWN_SECRET}
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            continue
        name, eq, value = arg.partition("=")
        if not _SECRET_VAR.search(name.lstrip("-")):
            continue
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
        if len(value) >= MIN_KNOWN_SECRET:
            out.add(value)
    return out


def _read(path: str, limit: int = 1 << 20) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def _read_text(path: str) -> str | None:
    raw = _read(path)
    return raw.decode("utf-8", "replace") if raw is not None else None


def tail_file(path: str, limit: int = TAIL_BYTES) -> bytes | None:
    """The last `limit` bytes of a file: reading a 50 GB log costs no more than reading its tail."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except OSError:
        return None
    if size > limit:
        nl = data.find(b"\n")
        data = data[nl + 1 :] if nl >= 0 else data
    return data


def _environ(pid: int) -> dict[str, str] | None:
    """A process's environment; None when it is gone or a kernel thread; raises PermissionError."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            raw = f.read(4 << 20)
    except PermissionError:
        raise
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def _jobs_of(env: dict[str, str]) -> list[str]:
    """The job ids a process carries; torchrun's default run id "none" names no job."""
    return [env[k] for k in JOB_ENV_KEYS if env.get(k) and env[k] != "none"]


def _stat(pid: int) -> dict | None:
    raw = _read_text("/proc/%d/stat" % pid)
    if not raw:
        return None
    # comm may hold spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        tick = os.sysconf("SC_CLK_TCK")
        return {
            "state": rest[0],
            "ppid": int(rest[1]),
            "cpu_seconds": (int(rest[11]) + int(rest[12])) / float(tick),
            "threads": int(rest[17]),
            "started": int(rest[19]),  # clock ticks after boot
        }
    except (IndexError, ValueError):
        return None


def find_job_processes(job_id: str, secrets: set[str] | None = None) -> tuple[list[dict], list[str], int]:
    """The job's processes (ranks and their children), other jobs seen, and /proc entries not readable; `secrets`
    gets the secret values of their environments and command lines (never kept in what is returned)."""
    procs, others, unreadable = [], set(), 0
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        try:
            env = _environ(pid)
        except PermissionError:
            unreadable += 1
            continue
        if env is None:
            continue
        jobs = _jobs_of(env)
        if job_id not in jobs:
            others.update(jobs)
            continue
        if secrets is not None:
            argv = (_read("/proc/%d/cmdline" % pid, 65536) or b"").decode("utf-8", "replace").split("\0")
            secrets.update(secret_values(env, argv))
        if "RANK" not in env:
            continue  # the launcher (torchrun's agent, srun): not a rank
        st = _stat(pid) or {}
        procs.append(
            {
                "pid": pid,
                "uid": _uid(pid),
                "ppid": st.get("ppid"),
                "started": st.get("started"),
                "rank": _int(env.get("RANK")),
                "local_rank": _int(env.get("LOCAL_RANK")),
                "world_size": _int(env.get("WORLD_SIZE")),
                "env": {k: env[k] for k in _KEPT_ENV if k in env},
                "command": _cmdline(pid),
            }
        )
    by_pid = {p["pid"]: p for p in procs}
    for p in procs:
        parent = by_pid.get(p.get("ppid"))
        # A DataLoader worker (or any child) inherits its rank's environment.
        p["role"] = "worker" if parent is not None and parent["rank"] == p["rank"] else "rank"
    procs.sort(key=lambda p: (p["rank"] if p["rank"] is not None else 1 << 30, p["role"] != "rank", p["pid"]))
    return procs, sorted(others), unreadable


_KEPT_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NCCL_DEBUG",
    "NCCL_DEBUG_FILE",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_HCA",
    "GLOO_SOCKET_IFNAME",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_WORKER_SERVER_SOCKET",
    "TORCH_DISTRIBUTED_DEBUG",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_RAS_ENABLE",
    "NCCL_RAS_ADDR",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "TORCHELASTIC_RUN_ID",
    "HANGDX_JOB_ID",
    "HANGDX_COLLECTIVE_TIMEOUT",
    "DEEPSPEED_TIMEOUT",
)


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    raw = _read("/proc/%d/cmdline" % pid, 4096) or b""
    return redact(raw.replace(b"\0", b" ").decode("utf-8", "replace").strip())


def _describe_fd(pid: int, fd: int) -> str | None:
    path = "/proc/%d/fd/%d" % (pid, fd)
    try:
        target = os.readlink(path)
    except OSError:
        return None
    try:
        mode = os.stat(path).st_mode
        kind = (
            "fifo"
            if stat.S_ISFIFO(mode)
            else "socket"
            if stat.S_ISSOCK(mode)
            else "file"
            if stat.S_ISREG(mode)
            else None
        )
    except OSError:
        kind = None
    return f"{target} ({kind})" if kind and not target.startswith(kind) else target


def _read_string(pid: int, address: int) -> str | None:
    """A NUL-terminated string from the process's memory (the path an open() is blocked on)."""
    try:
        with open("/proc/%d/mem" % pid, "rb") as mem:
            mem.seek(address)
            raw = mem.read(4096)
    except (OSError, ValueError, OverflowError):
        return None
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace") or None


def _syscall(pid: int, tid: int | None = None) -> tuple[str | None, str | None]:
    raw = _read_text("/proc/%d/syscall" % pid if tid is None else "/proc/%d/task/%d/syscall" % (pid, tid))
    if not raw:
        return None, None
    parts = raw.split()
    if parts[0] == "running":
        return "running", None
    try:
        number = int(parts[0])
        args = [int(a, 16) for a in parts[1:7]]
    except (ValueError, IndexError):
        return None, None
    if number < 0:
        return None, None
    name = _SYSCALLS.get(platform.machine(), {}).get(number, "syscall %d" % number)
    target = None
    if name in _FD_SYSCALLS and args:
        target = _describe_fd(pid, args[0])
    elif name in _PATH_SYSCALLS and len(args) > _PATH_SYSCALLS[name]:
        target = _read_string(pid, args[_PATH_SYSCALLS[name]])
        if target:
            try:
                if stat.S_ISFIFO(os.stat(target).st_mode):
                    target += " (fifo)"
            except OSError:
                pass
    return name, target


_FILE_SYSCALLS = (
    "open",
    "openat",
    "read",
    "write",
    "pread64",
    "pwrite64",
    "fsync",
    "fdatasync",
    "flock",
    "statx",
)


def _thread_syscalls(pid: int, limit: int = 64) -> dict:
    """The threads other than the main one that are blocked in a file syscall: tid -> "syscall(target)"."""
    try:
        tids = sorted(int(t) for t in os.listdir("/proc/%d/task" % pid) if t.isdigit() and int(t) != pid)
    except OSError:
        return {}
    out = {}
    for tid in tids[:limit]:
        name, target = _syscall(pid, tid)
        if name in _FILE_SYSCALLS and target and not target.startswith(("socket:", "pipe:", "anon_inode:")):
            out[str(tid)] = "%s(%s)" % (name, redact(target)[:300])
    return out


def _io_bytes(pid: int) -> int | None:
    raw = _read_text("/proc/%d/io" % pid)
    if not raw:
        return None
    fields = dict(line.split(": ", 1) for line in raw.splitlines() if ": " in line)
    try:
        return int(fields["rchar"]) + int(fields["wchar"])
    except (KeyError, ValueError):
        return None


def _switches(pid: int) -> int | None:
    total, seen = 0, False
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return None
    for tid in tids:
        raw = _read_text("/proc/%d/task/%s/status" % (pid, tid)) or ""
        m = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", raw, re.M)
        if m:
            total += int(m.group(1))
            seen = True
    return total if seen else None


def sample_process(proc: dict, host: str) -> dict:
    """One /proc sample of one process."""
    pid = proc["pid"]
    now = time.time()
    st = _stat(pid)
    if st is None:
        return {
            "host": host,
            "pid": pid,
            "rank": proc["rank"],
            "state": "exited",
            "sampled_at": now,
            "role": proc["role"],
            "parent_pid": proc.get("ppid"),
        }
    syscall, target = _syscall(pid)
    wchan = (_read_text("/proc/%d/wchan" % pid) or "").strip() or None
    others = _thread_syscalls(pid)
    return {
        "host": host,
        "pid": pid,
        "rank": proc["rank"],
        "local_rank": proc["local_rank"],
        "world_size": proc["world_size"],
        "state": st["state"],
        "wchan": None if wchan == "0" else wchan,
        "syscall": syscall,
        "syscall_target": redact(target) if target else None,
        "cpu_seconds": st["cpu_seconds"],
        "io_bytes": _io_bytes(pid),
        "voluntary_switches": _switches(pid),
        "threads": st["threads"],
        "thread_syscalls": others or None,
        "sampled_at": now,
        "command": proc["command"],
        "role": proc["role"],
        "parent_pid": proc.get("ppid"),
    }


def _main_thread(pid: int) -> tuple[float | None, int | None]:
    """The main thread's CPU seconds and voluntary context switches: a rank blocked in a wait adds none of
    either, while its process's other threads (a watchdog, a heartbeat) tick on."""
    raw = _read_text("/proc/%d/task/%d/stat" % (pid, pid)) or ""
    cpu = None
    rest = raw[raw.rfind(")") + 2 :].split() if raw else []
    try:
        cpu = (int(rest[11]) + int(rest[12])) / float(os.sysconf("SC_CLK_TCK"))
    except (IndexError, ValueError):
        pass
    status = _read_text("/proc/%d/task/%d/status" % (pid, pid)) or ""
    m = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)
    return cpu, int(m.group(1)) if m else None


def _gpu_counters() -> list[dict]:
    """Utilisation and power of each GPU through NVML, where it is there; [] elsewhere."""
    got = nvml_csv()
    if got is None:
        return []
    out = []
    for line in got[0].splitlines()[1:]:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 8:
            continue
        util = re.match(r"(\d+) %", cells[4])
        power = re.match(r"([0-9.]+) W", cells[7])
        out.append(
            {
                "index": _int(cells[0]),
                "uuid": cells[1],
                "util": int(util.group(1)) if util else None,
                "power_w": float(power.group(1)) if power else None,
            }
        )
    return out


def counters(job_id: str, host: str | None = None, gpus: bool = True, ras: bool = True) -> dict:
    """The cheap per-rank counters `hangdx watch` reads every pass, without touching the job (no ptrace, no
    py-spy): each process's CPU milliseconds (its main thread's apart), the main thread's voluntary context
    switches, its I/O bytes (rchar + wchar), its state; the GPUs' utilisation and power where NVML is; and, where
    `ncclras` is on PATH, each rank's count of collective operations as NCCL RAS reports them (ncclras_counts)."""
    host = host or socket.gethostname()
    t0 = time.time()
    procs, others, unreadable = find_job_processes(job_id)
    procs, impostors = split_impostors(procs, job_uid(job_id))
    errors = [{"source": "processes", "message": m} for m in impostors]
    collectives = ncclras_counts(procs, errors) if ras and procs and shutil.which("ncclras") else None
    rows = []
    for p in procs:
        st = _stat(p["pid"])
        if st is None:
            continue
        main_cpu, main_switches = _main_thread(p["pid"])
        rows.append(
            {
                "pid": p["pid"],
                "rank": p["rank"],
                "role": p["role"],
                "state": st["state"],
                "cpu_ms": int(round(st["cpu_seconds"] * 1000)),
                "main_cpu_ms": None if main_cpu is None else int(round(main_cpu * 1000)),
                "main_switches": main_switches,
                "io_bytes": _io_bytes(p["pid"]),
                "timeout_s": _timeout_of(p.get("env") or {}),
            }
        )
    return {
        "hangdx_collector": COLLECTOR_VERSION,
        "hangdx": "counters",
        "host": host,
        "node_hostname": socket.gethostname(),
        "job_id": job_id,
        "sampled_at": t0,
        "processes": rows,
        "gpus": _gpu_counters() if gpus and rows else [],
        "collective_counts": collectives or {},
        "errors": errors,
        "unreadable": unreadable,
        "elapsed_ms": round((time.time() - t0) * 1000, 1),
    }


# A watch pass's query (`ncclras -t 2`): a job's RAS answers in well under a second.
NCCLRAS_COUNTS_TIMEOUT = 5.0


def ncclras_counts(procs: list, errors: list) -> dict:
    """Each global rank's collective operations as NCCL RAS counts them (`ncclras -f json`, NCCL >= 2.28.7), summed
    over the job's communicators: {"RANK": N}. A count that grows between two passes is progress even when the
    rank's CPU thread idles (its GPU does the work). Asked, as the full collector asks, only on the nodes of the
    job's first and last rank. A communicator rank is a global rank when its process is one of this node's ranks
    (by pid) or when the communicator spans the whole job (its size is WORLD_SIZE); other ranks are left out.
    {} when RAS is off, ncclras is too old for JSON, or its report names none of this node's ranks (another job's
    NCCL may hold the RAS port: its counts must never pass for this job's progress)."""
    ranks = {p["pid"]: p["rank"] for p in procs if p.get("rank") is not None}
    sizes = [p["world_size"] for p in procs if p.get("world_size")]
    world = sizes[0] if sizes else None
    if not ranks or not (0 in ranks.values() or (world and world - 1 in ranks.values())):
        return {}
    if all((p.get("env") or {}).get("NCCL_RAS_ENABLE") == "0" for p in procs):
        return {}
    where, problem = _ras_address(procs)
    if problem:
        errors.append({"source": "ncclras", "message": problem + "; queried the default address"})
    argv = ["ncclras", "-t", "2", "-f", "json"]
    if where:
        argv += ["-h", where[0], "-p", str(where[1])]
    out, err, cut = run_capped(argv, NCCLRAS_COUNTS_TIMEOUT, NCCLRAS_MAX_BYTES)
    if err or cut or not out:
        errors.append({"source": "ncclras", "message": err or "ncclras -f json: no whole report"})
        return {}
    try:
        doc = json.loads(out)
        comms = [c for c in doc.get("communicators") or [] if isinstance(c, dict)]
    except (ValueError, AttributeError, TypeError):
        errors.append(
            {"source": "ncclras", "message": "ncclras -f json printed no JSON report (NCCL < 2.28.7?)"}
        )
        return {}
    counts = {}
    named = False
    for comm in comms:
        whole = world is not None and comm.get("size") == world
        listed = comm.get("ranks")
        for r in listed if isinstance(listed, list) else []:
            if not isinstance(r, dict) or not isinstance(r.get("collective_counts"), dict):
                continue
            pid = r.get("pid") if isinstance(r.get("pid"), int) else None
            named = named or pid in ranks
            rank = ranks[pid] if pid in ranks else (r.get("rank") if whole else None)
            if not isinstance(rank, int) or isinstance(rank, bool):
                continue
            n = sum(
                v for v in r["collective_counts"].values() if isinstance(v, int) and not isinstance(v, bool)
            )
            counts[str(rank)] = counts.get(str(rank), 0) + n
    if not named:
        errors.append(
            {
                "source": "ncclras",
                "message": "the RAS report names none of this job's processes on this node: its counts not used",
            }
        )
        return {}
    return counts


def _timeout_of(env: dict[str, str]) -> float | None:
    """The job's collective timeout in seconds, where its environment says it: HANGDX_COLLECTIVE_TIMEOUT (seconds:
    the value the job gives init_process_group), else DEEPSPEED_TIMEOUT (minutes: DeepSpeed's process-group
    timeout, deepspeed/constants.py), else None (the caller's default: the NCCL process group's 10 minutes)."""
    for key, scale in (("HANGDX_COLLECTIVE_TIMEOUT", 1.0), ("DEEPSPEED_TIMEOUT", 60.0)):
        try:
            value = float(env.get(key, "")) * scale
        except ValueError:
            continue
        if 0 < value < 1e7:
            return value
    return None


def find_pyspy() -> str | None:
    """$HANGDX_PYSPY, else py-spy on PATH, else beside this Python (a virtualenv's bin)."""
    forced = os.environ.get("HANGDX_PYSPY")
    if forced is not None:
        return forced if os.access(forced, os.X_OK) else None
    found = shutil.which("py-spy")
    if found:
        return found
    candidate = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return candidate if os.access(candidate, os.X_OK) else None


_MAIN_THREAD = re.compile(r'^Thread \S+ \((\w+)[^)]*\): "MainThread"\n[ \t]+(\S[^\n]*)', re.M)


def _sample_marker(t: float, host: str, p: dict) -> str:
    """The line before each py-spy dump in a stacks file: when, where, and whose (probes/pyspy.py reads it)."""
    return "# hangdx stack-sample time=%.3f host=%s rank=%s pid=%d role=%s" % (
        t,
        host,
        p["rank"],
        p["pid"],
        p["role"],
    )


def _busy_in_place(samples: list[str]) -> bool:
    """Every sample (at least two) shows the main thread active with the same innermost frame."""
    tops = set()
    for text in samples:
        m = _MAIN_THREAD.search(text)
        if m is None or m.group(1) != "active":
            return False
        tops.add(m.group(2).strip())
    return len(samples) >= 2 and len(tops) == 1


def pyspy_dump(pyspy: str, pid: int, native: bool = False, locals_: bool = False) -> tuple[str, str | None]:
    """py-spy's dump of one process: (stdout, error line or None)."""
    cmd = [pyspy, "dump", "--pid", str(pid)]
    if native:
        cmd.append("--native")
    if locals_:
        cmd.append("--locals")
    try:
        out = subprocess.run(cmd, capture_output=True, timeout=PYSPY_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "", "py-spy dump --pid %d did not answer within %ds" % (pid, PYSPY_TIMEOUT)
    except OSError as e:
        return "", f"py-spy could not run: {e}"
    text = out.stdout.decode("utf-8", "replace")
    if out.returncode != 0 or not text.strip():
        err = out.stderr.decode("utf-8", "replace").strip().splitlines()
        first = next((line for line in err if line.strip()), "exit status %d" % out.returncode)
        return text, first
    return text, None


def _ptrace_hint() -> str:
    scope = (_read_text("/proc/sys/kernel/yama/ptrace_scope") or "").strip()
    hint = "run hangdx as root or as the job's user"
    if scope and scope != "0":
        hint += f"; kernel.yama.ptrace_scope is {scope} (set it to 0, or grant py-spy CAP_SYS_PTRACE)"
    return hint


def _run(cmd: list[str], timeout: float = CMD_TIMEOUT) -> tuple[str | None, str | None]:
    """(stdout, error) of a fixed command; error says what is missing or failed."""
    if shutil.which(cmd[0]) is None:
        return None, f"{cmd[0]} not found on this host"
    try:
        out = subprocess.run(cmd, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, "%s did not answer within %ds" % (" ".join(cmd), timeout)
    except OSError as e:
        return None, f"{cmd[0]} could not run: {e}"
    text = out.stdout.decode("utf-8", "replace")
    if out.returncode != 0 and not text.strip():
        err = out.stderr.decode("utf-8", "replace").strip().splitlines()
        return None, "{} failed: {}".format(
            " ".join(cmd), err[0] if err else "exit status %d" % out.returncode
        )
    return text, None


NCCLRAS_TIMEOUT = 15.0  # ncclras -t 5: 1 s to connect, 5 s for the RAS collective, 5 s more (client.cc)
NCCLRAS_MAX_BYTES = 8 << 20  # a JSON report is ~0.6 KB a rank: 8 MiB holds a 10,000-rank job's communicators
NCCLRAS_PAUSE = 2.0  # between the two queries: counts that stay put across them are a stuck communicator


def run_capped(cmd: list, timeout: float, limit: int):
    """(stdout, error, cut) of a fixed command, its output read up to `limit` bytes (the command is ended then)."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    except OSError as e:
        return None, "%s could not run: %s" % (cmd[0], e), False
    out = bytearray()
    err = bytearray()
    cut = [False]

    def pump(stream, buf, cap):
        while True:
            chunk = stream.read(65536)
            if not chunk:
                return
            if len(buf) < cap:
                buf.extend(chunk[: cap - len(buf)])
            if len(buf) >= cap and stream is proc.stdout:
                cut[0] = True
                proc.kill()
                return

    readers = [
        threading.Thread(target=pump, args=(proc.stdout, out, limit), daemon=True),
        threading.Thread(target=pump, args=(proc.stderr, err, 4096), daemon=True),
    ]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for t in readers:
            t.join(timeout=2)
        text = out.decode("utf-8", "replace")
        return (text or None), "%s did not finish within %ds" % (" ".join(cmd), timeout), True
    for t in readers:
        t.join(timeout=2)
    text = out.decode("utf-8", "replace")
    if proc.returncode != 0 and not cut[0] and not text.strip():
        lines = err.decode("utf-8", "replace").strip().splitlines()
        return (
            None,
            "%s failed: %s" % (" ".join(cmd), lines[-1] if lines else "exit status %d" % proc.returncode),
            False,
        )
    return text, None, cut[0]


def _ras_address(procs: list) -> tuple:
    """(host, port) from the job's NCCL_RAS_ADDR when it is an IP literal (or localhost) and a port; else None.

    The job's environment is not trusted text: anything else is refused, never passed on to ncclras."""
    import ipaddress

    for p in procs:
        addr = (p.get("env") or {}).get("NCCL_RAS_ADDR")
        if not addr:
            continue
        m = re.fullmatch(r"\[?([0-9A-Za-z.:]{1,45}?)\]?:(\d{1,5})", addr.strip())
        if m is None:
            return None, "NCCL_RAS_ADDR %r is not host:port" % addr[:80]
        host, port = m.group(1), int(m.group(2))
        if host != "localhost":
            try:
                ipaddress.ip_address(host)
            except ValueError:
                return None, "NCCL_RAS_ADDR %r: only an IP address or localhost is queried" % addr[:80]
        if not 0 < port < 65536:
            return None, "NCCL_RAS_ADDR %r: no such port" % addr[:80]
        return (host, port), None
    return None, None


def ncclras_reports(procs: list, add, errors: list) -> None:
    """NCCL RAS's view of the whole job (NCCL >= 2.24): `ncclras -v` and `ncclras -f json`, a few seconds apart.

    Any process of the job answers for all of its ranks, so only the nodes of the job's first and last rank ask
    (two queries per job, whatever its size; the last rank's node still asks when rank 0 is gone)."""
    ranks = [p["rank"] for p in procs if p.get("rank") is not None]
    sizes = [p["world_size"] for p in procs if p.get("world_size")]
    if not ranks or not (0 in ranks or (sizes and sizes[0] - 1 in ranks)):
        return
    if all((p.get("env") or {}).get("NCCL_RAS_ENABLE") == "0" for p in procs):
        errors.append(
            {"source": "ncclras", "message": "NCCL RAS is off in this job (NCCL_RAS_ENABLE=0): not queried"}
        )
        return
    where, problem = _ras_address(procs)
    if problem:
        errors.append({"source": "ncclras", "message": problem + "; queried the default address"})
    base = ["ncclras", "-t", "5"]
    if where:
        base += ["-h", where[0], "-p", str(where[1])]
    texts = []
    for i, (name, argv) in enumerate(
        (("ncclras.txt", base + ["-v"]), ("ncclras.json", base + ["-f", "json"]))
    ):
        if i:
            time.sleep(NCCLRAS_PAUSE)
        out, err, cut = run_capped(argv, NCCLRAS_TIMEOUT, NCCLRAS_MAX_BYTES)
        if err and not (i and texts and "json" in argv and "failed" in err):
            errors.append({"source": "ncclras", "message": err})
        if cut and not err:
            errors.append(
                {
                    "source": "ncclras",
                    "message": "%s printed more than %d bytes: cut there" % (name, NCCLRAS_MAX_BYTES),
                }
            )
        if out and out.strip():
            texts.append(out)
            add(name, "ncclras", out)
            named = {int(x) for x in re.findall(r'"pid": (\d{1,10})', out)} if "json" in argv else set()
            if named and not named & {p["pid"] for p in procs}:
                # RAS answers for the job of whichever NCCL process holds the port: say so when it is not this one.
                errors.append(
                    {
                        "source": "ncclras",
                        "message": "the RAS report names none of this job's processes on this node (pids %s): "
                        "another job's NCCL may hold the RAS port, or the ranks run in their own PID namespace"
                        % ", ".join(str(p["pid"]) for p in procs[:8]),
                    }
                )
        elif i and texts:
            # An ncclras older than 2.28.7 has no -f: the second query is the text form again.
            out, err, _ = run_capped(base + ["-v"], NCCLRAS_TIMEOUT, NCCLRAS_MAX_BYTES)
            if out and out.strip():
                add("ncclras-2.txt", "ncclras", out)


def fetch_fr_trace(socket_path: str, timeout: float = 5.0) -> tuple[str | None, str | None]:
    """A live rank's Flight Recorder as JSON, from torch's control plane (worker_main's unix socket).

    `fr_trace_json` dumps the generic recorder (gloo's); ProcessGroupNCCL keeps its own, served by
    `dump_nccl_trace_json` (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp's jsonDumpHandler; a CPU-only build
    has no such handler and answers 404). The NCCL one is asked for when the generic one holds no entries."""
    body, err = _control_plane(socket_path, "fr_trace_json", timeout)
    if body is not None and '"entries"' in body:
        return body, None
    nccl, nccl_err = _control_plane(
        socket_path, "dump_nccl_trace_json?includecollectives=true&onlyactive=false", timeout
    )
    if nccl is not None and '"entries"' in nccl:
        return nccl, None
    return (body, None) if body is not None else (None, err or nccl_err)


def _control_plane(socket_path: str, handler: str, timeout: float) -> tuple[str | None, str | None]:
    """POST /handler/HANDLER on torch's control-plane socket: (body, None) on 200, else (None, why)."""
    import http.client

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(socket_path)

    conn = UnixConnection("localhost", timeout=timeout)
    try:
        conn.request("POST", "/handler/" + handler)
        resp = conn.getresponse()
        body = resp.read(64 << 20).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as e:
        return None, "control-plane socket %s did not answer: %s" % (socket_path, e)
    finally:
        conn.close()
    if resp.status != 200:
        return None, "control-plane socket %s answered %d: %s" % (socket_path, resp.status, body[:200])
    return body, None


def _expand_nccl_path(pattern: str, host: str, pid: int) -> str:
    # NCCL_DEBUG_FILE understands %h (hostname) and %p (pid).
    return pattern.replace("%h", host).replace("%p", str(pid))


def collect(
    job_id: str,
    samples: int = 3,
    interval: float = 0.7,
    host: str | None = None,
    hardware: bool = True,
    native: bool = False,
) -> dict:
    """Collect every artifact of job `job_id` on this host."""
    host = host or socket.gethostname()
    started = time.time()
    artifacts: list[dict] = []
    errors: list[dict] = []

    secrets: set[str] = set()

    def add(name: str, kind: str, data: str, rank=None, pid=None) -> None:
        artifacts.append(
            {"name": name, "kind": kind, "rank": rank, "pid": pid, "data": redact(data, secrets)}
        )

    procs, others, unreadable = find_job_processes(job_id, secrets)
    uid = job_uid(job_id)
    procs, impostors = split_impostors(procs, uid)
    for line in impostors:
        errors.append({"source": "processes", "message": line})
    if uid is None and procs:
        uid = procs[0].get("uid")  # the one user left: whose files may be read
    if unreadable and not procs and os.geteuid() != 0:
        errors.append(
            {
                "source": "processes",
                "message": "%d processes could not be read (other users'?): %s"
                % (unreadable, _ptrace_hint()),
            }
        )
    pyspy = find_pyspy() if procs else None
    if procs and pyspy is None:
        errors.append(
            {
                "source": "py-spy",
                "message": f"py-spy not found on {host}: no stacks (fix: pip install py-spy)",
            }
        )

    host_thread = None
    if hardware:
        # GPU, kernel and fabric probes (perfquery waits 2 s between samples) run while stacks are sampled.
        host_thread = threading.Thread(target=_collect_host, args=(host, add, errors), daemon=True)
        host_thread.start()

    ras_thread = None
    if procs and shutil.which("ncclras"):
        # NCCL RAS answers for every rank of the job at once; it runs while stacks are sampled.
        ras_thread = threading.Thread(target=ncclras_reports, args=(procs, add, errors), daemon=True)
        ras_thread.start()

    stacks: dict[int, list[str]] = {p["pid"]: [] for p in procs}
    states: list[dict] = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(procs))))
    failed_pyspy: set[int] = set()
    try:
        for i in range(samples if procs else 0):
            if i:
                time.sleep(interval)
            states.extend(sample_process(p, host) for p in procs)
            if pyspy is None:
                continue
            t = time.time()
            futures = {
                # The last sample shows locals: a blocked send/recv's src/dst names the peer it waits on.
                pool.submit(pyspy_dump, pyspy, p["pid"], native, i == samples - 1 and samples > 1): p
                for p in procs
                if p["pid"] not in failed_pyspy
            }
            for fut, p in futures.items():
                text, err = fut.result()
                if err:
                    failed_pyspy.add(p["pid"])
                    if not os.path.exists("/proc/%d" % p["pid"]):
                        err = "rank %s (pid %d) exited while being probed" % (p["rank"], p["pid"])
                    elif "ermission" in err:
                        err = "py-spy may not read pid %d: %s (%s)" % (p["pid"], err, _ptrace_hint())
                    errors.append({"source": "py-spy pid %d" % p["pid"], "message": err})
                    continue
                stacks[p["pid"]].append(_sample_marker(t, host, p) + "\n" + text)
        if procs:
            states.extend(sample_process(p, host) for p in procs)
        if pyspy is not None and not native:
            # Where Python frames cannot tell: a main thread busy on the same line of its own code in every sample
            # is computing, or spinning in native code (a CUDA synchronisation under `.item()` waits for the
            # queued NCCL kernels with the CPU at 100%). One `--native` sample says which.
            busy = [p for p in procs if p["pid"] not in failed_pyspy and _busy_in_place(stacks[p["pid"]])]
            futures = {pool.submit(pyspy_dump, pyspy, p["pid"], True, False): p for p in busy}
            t = time.time()
            for fut, p in futures.items():
                text, err = fut.result()
                if not err:
                    stacks[p["pid"]].append(_sample_marker(t, host, p) + " native=1\n" + text)
    finally:
        pool.shutdown(wait=True)

    for p in procs:
        if stacks[p["pid"]]:
            name = "stacks-rank%s-%s%d.txt" % (
                p["rank"],
                "worker" if p["role"] == "worker" else "pid",
                p["pid"],
            )
            add(name, "pyspy", "\n".join(stacks[p["pid"]]), p["rank"], p["pid"])
    if procs:
        doc = {
            "hangdx": "procstate",
            "host": host,
            "job_id": job_id,
            "samples": states,
            "world_size": next((p["world_size"] for p in procs if p["world_size"]), None),
        }
        add("processes.json", "procstate", json.dumps(doc, indent=1))

    _collect_rank_files(procs, host, add, errors, uid)
    if host_thread is not None:
        host_thread.join(timeout=60)
    if ras_thread is not None:
        ras_thread.join(timeout=2 * NCCLRAS_TIMEOUT + 5)
    return {
        "hangdx_collector": COLLECTOR_VERSION,
        "host": host,
        "node_hostname": socket.gethostname(),
        "job_id": job_id,
        "started": started,
        "finished": time.time(),
        "artifacts": artifacts,
        "errors": errors,
        "other_jobs": others,
    }


def _uid(pid: int) -> int | None:
    try:
        return os.stat("/proc/%d" % pid).st_uid
    except OSError:
        return None


def _owned_file(path: str, uid: int | None, limit: int, tail: bool = True) -> tuple[bytes | None, str | None]:
    """A rank's file, read only when it is a regular file that rank's user owns, never through a link: what a
    process says in its environment (NCCL_DEBUG_FILE=/etc/shadow) must not make root read what its user cannot.
    (data, None), or (None, why not)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        return None, "a link, refused" if e.errno == 40 else (e.strerror or "not readable")
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        if uid is None or (st.st_uid != uid and uid != 0):
            return None, "not owned by the rank's user (uid %s), refused" % uid
        if tail and st.st_size > limit:
            f.seek(st.st_size - limit)
            data = f.read(limit)
            nl = data.find(b"\n")
            return (data[nl + 1 :] if nl >= 0 else data), None
        return f.read(limit), None


def _owned_socket(path: str, uid: int | None) -> str | None:
    """Why root must not connect to this socket for a rank (not a socket its user owns), or None."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return e.strerror or "not there"
    if not stat.S_ISSOCK(st.st_mode):
        return "not a socket"
    if uid is None or (st.st_uid != uid and uid != 0):
        return "not owned by the rank's user (uid %s), refused" % uid
    return None


def job_uid(job_id: str) -> int | None:
    """The job's user as Slurm knows it (`squeue -o %U`: the number alone, which no job name can shadow), on a
    Slurm node; None elsewhere."""
    if not shutil.which("squeue") or not re.fullmatch(r"[0-9]+(?:_[0-9]+)?", job_id):
        return None
    out, _ = _run(["squeue", "-h", "-j", job_id, "-o", "%U"], timeout=5)
    first = (out or "").strip().splitlines()[:1]
    return int(first[0]) if first and first[0].strip().isdigit() else None


def split_impostors(procs: list[dict], uid: int | None) -> tuple[list[dict], list[str]]:
    """The job's processes, and one line per process that claims the job but runs as another user: never read
    as a rank. The job's user is Slurm's (`uid`) or else the user of the rank started first (a process that
    joins a job later cannot have started it)."""
    if uid is None:
        owned = [p for p in procs if p.get("uid") is not None and p["role"] == "rank"]
        if len({p["uid"] for p in owned}) <= 1:
            return procs, []
        first = min(owned, key=lambda p: (p.get("started") is None, p.get("started") or 0, p["pid"]))
        uid, why = first["uid"], "the user of the job's first-started rank, pid %d" % first["pid"]
    else:
        why = "Slurm's user of the job"
    kept = [p for p in procs if p.get("uid") == uid]
    lines = [
        "pid %s claims rank %s of this job but runs as uid %s, not as the job's user (uid %d, %s): not read as a "
        "rank (another user's process carrying the job's id)" % (p["pid"], p["rank"], p.get("uid"), uid, why)
        for p in procs
        if p.get("uid") != uid
    ]
    return kept, lines


def _collect_rank_files(
    procs: list[dict], host: str, add, errors: list[dict], uid: int | None = None
) -> None:
    seen: set[str] = set()
    for p in procs:
        if p["role"] != "rank":
            continue
        if uid is not None and p.get("uid") != uid:
            continue  # a process claiming the job as another user: named in the errors, its files unread
        pid, rank, env = p["pid"], p["rank"], p["env"]
        owner = p.get("uid")
        # The rank's own stdout/stderr when they go to files: tracebacks and watchdog lines land there.
        for fd in (1, 2):
            try:
                target = os.readlink("/proc/%d/fd/%d" % (pid, fd))
            except OSError:
                continue
            if target in seen or not target.startswith("/") or not os.path.isfile(target):
                continue
            seen.add(target)
            data, _ = _owned_file(target, owner, TAIL_BYTES)
            if data:
                add(
                    "rank{}-{}.log".format(rank, "stdout" if fd == 1 else "stderr"),
                    "log",
                    data.decode("utf-8", "replace"),
                    rank,
                    pid,
                )
        pattern = env.get("NCCL_DEBUG_FILE")
        if pattern:
            path = _expand_nccl_path(pattern, host, pid)
            data, why = _owned_file(path, owner, TAIL_BYTES)
            if data is None:
                errors.append(
                    {"source": "nccl log", "message": f"rank {rank}: NCCL_DEBUG_FILE {path}: {why}"}
                )
            elif path not in seen:
                seen.add(path)
                add(f"nccl-rank{rank}.log", "nccl_log", data.decode("utf-8", "replace"), rank, pid)
        sock = env.get("TORCH_WORKER_SERVER_SOCKET")
        refused = _owned_socket(sock, owner) if sock else None
        if sock and refused:
            errors.append({"source": "flight recorder", "message": f"rank {rank}: socket {sock}: {refused}"})
        elif sock:
            dump, err = fetch_fr_trace(sock)
            if dump:
                add("fr-rank%s.json" % rank, "flight_recorder", dump, rank, pid)
            else:
                errors.append({"source": "flight recorder", "message": "rank %s: %s" % (rank, err)})
        for key in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
            prefix = env.get(key)
            if not prefix:
                continue
            path = f"{prefix}{rank}"
            if path in seen or not os.path.lexists(path):
                continue
            seen.add(path)
            raw, why = _owned_file(path, owner, 64 << 20, tail=False)
            if why:
                errors.append({"source": "flight recorder", "message": f"rank {rank}: {path}: {why}"})
            if raw:
                # Flight Recorder dumps are pickles: carried as latin-1 text, decoded back by the reader.
                add(f"fr-rank{rank}.bin", "flight_recorder", raw.decode("latin-1"), rank, pid)


def nvml_csv() -> tuple[str, str] | None:
    """GPU state through NVML (pynvml), printed as nvidia-smi's --query-gpu / --query-compute-apps CSV."""
    try:
        import pynvml  # nvidia-ml-py: present on GPU nodes that have it, never required
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no GPU: nvidia-smi will say why
        return None

    def text(v) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    gpus = [
        "index, uuid, pci.bus_id, name, utilization.gpu [%], memory.used [MiB], memory.total [MiB], power.draw [W]"
    ]
    apps = ["pid, process_name, gpu_uuid, gpu_bus_id, used_memory [MiB]"]
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = text(pynvml.nvmlDeviceGetUUID(h))
            bus = text(pynvml.nvmlDeviceGetPciInfo(h).busId)
            try:
                util = "%d %%" % pynvml.nvmlDeviceGetUtilizationRates(h).gpu
            except Exception:  # noqa: BLE001 - a lost GPU answers some calls and not others
                util = "[Unknown Error]"
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                power = "%.2f W" % (pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
            except Exception:  # noqa: BLE001
                power = "[N/A]"
            gpus.append(
                "%d, %s, %s, %s, %s, %d MiB, %d MiB, %s"
                % (
                    i,
                    uuid,
                    bus,
                    text(pynvml.nvmlDeviceGetName(h)),
                    util,
                    mem.used // 2**20,
                    mem.total // 2**20,
                    power,
                )
            )
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                used = (proc.usedGpuMemory or 0) // 2**20
                apps.append("%d, %s, %s, %s, %d MiB" % (proc.pid, _comm(proc.pid), uuid, bus, used))
    except Exception:  # noqa: BLE001 - fall back to nvidia-smi
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return "\n".join(gpus) + "\n", "\n".join(apps) + "\n"


def _comm(pid: int) -> str:
    return (_read_text("/proc/%d/comm" % pid) or "?").strip()


KERNEL_LOG_COMMANDS = (
    ["dmesg", "--ctime"],
    # kernel.dmesg_restrict=1 refuses dmesg to users without CAP_SYSLOG; a sudo rule may allow exactly this
    # command (deploy/node/hangdx.sudoers). -n: sudo fails instead of asking for a password.
    ["sudo", "-n", "dmesg", "--ctime"],
    ["journalctl", "-k", "-n", "5000", "--no-pager"],
)


def read_kernel_log(timeout: float = CMD_TIMEOUT) -> tuple[str | None, str | None, list[str]]:
    """The kernel log: (its text, the command that read it, why each command tried before it failed).

    dmesg first; where it is refused, `sudo -n dmesg --ctime` (never prompts), then `journalctl -k`."""
    refused: list[str] = []
    for cmd in KERNEL_LOG_COMMANDS:
        shown = " ".join(cmd)
        if cmd[0] == "sudo" and shutil.which("dmesg") is None:
            continue  # no dmesg to run through sudo either
        if shutil.which(cmd[0]) is None:
            refused.append("%s: %s not found" % (shown, cmd[0]))
            continue
        try:
            out = subprocess.run(cmd, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            refused.append("%s: no answer within %ds" % (shown, timeout))
            continue
        except OSError as e:
            refused.append("%s: could not run: %s" % (shown, e))
            continue
        text = out.stdout.decode("utf-8", "replace")
        # journalctl says "-- No entries --" (exit 0) to a user who may not read the kernel's messages.
        if out.returncode == 0 and text.strip() and text.strip() != "-- No entries --":
            return text, shown, refused
        # The last line explains (journalctl prints a hint first, then why it read nothing).
        err = [line.strip() for line in out.stderr.decode("utf-8", "replace").splitlines() if line.strip()]
        if err:
            why = err[-1]
        elif text.strip():
            why = text.strip().splitlines()[-1]
        else:
            why = "printed nothing (exit status %d)" % out.returncode
        refused.append("%s: %s" % (shown, why))
    return None, None, refused


def _collect_host(host: str, add, errors: list[dict]) -> None:
    nvml = nvml_csv()
    if nvml is not None:
        add("nvml-gpus.csv", "nvidia_smi", nvml[0])
        add("nvml-apps.csv", "nvidia_smi", nvml[1])
    probes = [
        (
            "nvidia-smi.csv",
            "nvidia_smi",
            [
                "nvidia-smi",
                "--query-gpu=index,uuid,pci.bus_id,name,utilization.gpu,memory.used,memory.total,power.draw",
                "--format=csv",
            ],
        ),
        (
            "nvidia-smi-apps.csv",
            "nvidia_smi",
            [
                "nvidia-smi",
                "--query-compute-apps=pid,process_name,gpu_uuid,gpu_bus_id,used_memory",
                "--format=csv",
            ],
        ),
        ("ibstat.txt", "ibstat", ["ibstat"]),
        ("ip-link.txt", "ip_link", ["ip", "link"]),
    ]
    quiet_missing = {"nvidia-smi", "ibstat"}  # a CPU-only or Ethernet-only host simply has none
    out_ibstat = None
    for name, kind, cmd in probes:
        if nvml is not None and cmd[0] == "nvidia-smi":
            continue
        out, err = _run(cmd)
        if cmd[0] == "ibstat":
            out_ibstat = out
        if out:
            add(name, kind, out)
        elif err and not (cmd[0] in quiet_missing and "not found" in err):
            errors.append({"source": cmd[0], "message": err})
    text, how, refused = read_kernel_log()
    if text is None:
        errors.append({"source": "kernel log", "message": "no kernel log: " + "; ".join(refused)})
    else:
        # The artifact's name says how it was read: dmesg, or the fallback that worked once dmesg was refused.
        add(
            "kernel.log" if how == "dmesg --ctime" else "kernel-%s.log" % how.split()[0],
            "kernel_log",
            kernel_excerpt(text),
        )
    if shutil.which("perfquery"):
        ports = _ib_ports(out_ibstat) or [(None, None)]
        blocks = []
        for i in range(2):
            if i:
                time.sleep(2.0)  # two samples: a counter that rises between them is a live fault
            for ca, port in ports:
                cmd = ["perfquery", "-x"] + (["-C", ca, "-P", str(port)] if ca else [])
                out, err = _run(cmd)
                if out:
                    marker = "# hangdx sample %.3f host=%s" % (time.time(), host)
                    if ca:
                        marker += " ca=%s port=%s" % (ca, port)
                    blocks.append(marker + "\n" + out)
                elif err:
                    errors.append({"source": "perfquery", "message": err})
        if blocks:
            add("perfquery.txt", "perfquery", "\n".join(blocks))


_KERNEL_SIGNS = re.compile(
    r"Xid|NVRM|nvidia|mlx[45]|infiniband|\bib\d|Link (?:is )?(?:down|up)|Out of memory|oom-kill|oom_reaper|"
    r"blocked for more than|hung_task|nfs: server|lustre|gpfs|segfault|general protection|AER|PCIe Bus Error|"
    r"Cable|link flap|NETDEV WATCHDOG|watchdog: BUG",
    re.I,
)


def kernel_excerpt(text: str, scan: int = 20000, tail: int = 200) -> str:
    """The kernel-log lines that can name a fault (of the last `scan`), plus the last `tail` lines, in order."""
    lines = text.splitlines()[-scan:]
    keep = [i for i, line in enumerate(lines) if _KERNEL_SIGNS.search(line)]
    wanted = sorted(set(keep[-3000:]) | set(range(max(0, len(lines) - tail), len(lines))))
    return "\n".join(lines[i] for i in wanted)


def _ib_ports(ibstat: str | None) -> list[tuple[str, int]]:
    """(CA, port) pairs from ibstat's output."""
    ports, ca, port = [], None, None
    for line in (ibstat or "").splitlines():
        m = re.match(r"^CA '([^']+)'", line)
        if m:
            ca, port = m.group(1), None
            continue
        m = re.match(r"^\s+Port (\d+):", line)
        if m and ca and re.match(r"^[A-Za-z0-9_.-]+$", ca):
            port = (ca, int(m.group(1)))
            ports.append(port)
            continue
        # RoCE ports (Ethernet link layer) have no InfiniBand counters for perfquery to read.
        if port is not None and re.match(r"^\s+Link layer:\s*Ethernet", line):
            ports.remove(port)
            port = None
    return ports


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="hangdx node-side collector")
    ap.add_argument("job_id")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--interval", type=float, default=0.7)
    ap.add_argument("--no-hardware", action="store_true")
    ap.add_argument("--host", help="the name the caller knows this node by (default: its hostname)")
    ap.add_argument("--counters", action="store_true", help="only the cheap per-rank counters (hangdx watch)")
    args = ap.parse_args(argv)
    if args.counters:
        json.dump(counters(args.job_id, host=args.host, gpus=not args.no_hardware), sys.stdout)
        return 0
    doc = collect(args.job_id, args.samples, args.interval, host=args.host, hardware=not args.no_hardware)
    json.dump(doc, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
