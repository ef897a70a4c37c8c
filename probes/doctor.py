"""`hangdx doctor`: does each node have what hangdx needs, and if not, what exactly to change.

Two halves in one file:

- Node side (standard library only, Python >= 3.8, like collector.py): `check_node()` looks at what the
  collector will use on this node: python3, py-spy (found as the collector finds it, and runnable),
  permission to attach to and read other users' processes, the kernel log (dmesg, `sudo -n dmesg`,
  journalctl -k, read exactly as the collector reads it), and the optional GPU and fabric tools. It never
  touches a job: nothing is attached to, nothing is changed. Over SSH, `node_script()` sends the collector
  (as a module) and this file to `python3 -` on stdin, like the collector itself: no user text reaches a
  shell.
- Host side: `check_hosts()` fans out over SSH with probes/ssh.py (host keys verified, never added),
  `check_local()` runs the checks in-process, `report()` turns the node documents into the report that
  `render()` prints and `--json` emits (its format is documented in docs/nodes.md).

Every check is {"check", "required", "status", "detail", "fix"}: status "ok", "warn" (works, with less
evidence, or only for some jobs), "fail" (a required piece is missing: hangdx cannot do its job there) or
"skip" (not checked).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import socket
import sys

# Over SSH the launcher of node_script() registers the collector under this name before loading this file.
SENT_COLLECTOR = "hangdx_sent_collector"
collector = sys.modules.get(SENT_COLLECTOR)
if collector is None:
    from hangdx.probes import collector

DOCTOR_VERSION = 1
CHECKS = ("ssh", "python", "py-spy", "ptrace", "environ", "kernel-log", "gpu", "ibstat", "perfquery", "ip")
# Capability bits (linux/capability.h): reading other users' /proc/PID/environ and their interpreters' files
# takes DAC_READ_SEARCH (or DAC_OVERRIDE); attaching to them takes SYS_PTRACE. Root has all three.
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE = 1, 2, 19
MIN_PYTHON = (3, 8)
DOCS = "docs/nodes.md"

PRIVILEGE_FIX = (
    "log in as root (a dedicated, restricted key), or give the SSH user CAP_SYS_PTRACE and "
    "CAP_DAC_READ_SEARCH (" + DOCS + "); or run hangdx as the job's user with kernel.yama.ptrace_scope=0"
)
KERNEL_LOG_FIX = (
    "install deploy/node/hangdx.sudoers as /etc/sudoers.d/hangdx (it lets the SSH user run `dmesg --ctime` "
    "and nothing else), or `sysctl -w kernel.dmesg_restrict=0` (persist it in /etc/sysctl.d/), or add the "
    "user to the systemd-journal group (journalctl -k)"
)
IB_FIX = "install infiniband-diags (apt-get install infiniband-diags, or dnf install infiniband-diags)"


def _check(check: str, required: bool, status: str, detail: str, fix: str | None = None) -> dict:
    return {"check": check, "required": required, "status": status, "detail": detail, "fix": fix}


# ---------------------------------------------------------------- node side


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _who(euid: int, user: str) -> str:
    return "root" if euid == 0 else f"{user} (uid {euid})"


def effective_caps(status: str) -> int:
    """The effective capability set (CapEff) of a /proc/PID/status text, as a bit mask."""
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)\s*$", status, re.M)
    return int(m.group(1), 16) if m else 0


def has_cap(caps: int, cap: int) -> bool:
    return bool(caps >> cap & 1)


def ptrace_scope() -> int | None:
    """kernel.yama.ptrace_scope, or None when the kernel has no Yama (classic ptrace rules)."""
    raw = (collector._read_text("/proc/sys/kernel/yama/ptrace_scope") or "").strip()
    return int(raw) if raw.isdigit() else None


def ptrace_verdict(
    euid: int, user: str, scope: int | None, cap: bool, dac: bool = True
) -> tuple[str, str, str | None]:
    """(status, detail, fix) for py-spy attaching to a job's ranks, from who we are and Yama's ptrace_scope.

    CAP_SYS_PTRACE decides, not the uid: root has it, except where a container dropped it. `dac`: also
    CAP_DAC_READ_SEARCH, which py-spy needs to read an interpreter kept where the user may not read."""
    who = _who(euid, user)
    setting = (
        "kernel without Yama: classic ptrace rules" if scope is None else f"kernel.yama.ptrace_scope={scope}"
    )
    if scope is not None and scope >= 3:
        return (
            "fail",
            f"{setting}: no process may attach to another, not even root: py-spy can take no stacks",
            "set kernel.yama.ptrace_scope=1 (or 0) in /etc/sysctl.d/ and reboot (3 cannot be lowered while "
            "running)",
        )
    if cap and not dac:
        return (
            "warn",
            f"{who} has CAP_SYS_PTRACE but not CAP_DAC_READ_SEARCH: py-spy cannot read the interpreter of a "
            f"job kept where {who} may not read (a 0700 home directory) ({setting})",
            PRIVILEGE_FIX,
        )
    if cap:
        return "ok", f"{who} has CAP_SYS_PTRACE: may attach to every process ({setting})", None
    lacks = f"{who} without CAP_SYS_PTRACE" + (" (dropped by a container?)" if euid == 0 else "")
    if scope is None or scope == 0:
        return (
            "warn",
            f"{lacks} may attach only to its own user's processes ({setting}): the ranks of other users' "
            "jobs get no stacks",
            PRIVILEGE_FIX,
        )
    if scope == 1:
        return (
            "fail",
            f"{setting}: {lacks} may attach only to its own descendants, and a job's ranks are never "
            "descendants of an SSH session: py-spy can take no stacks",
            "log in as root or grant CAP_SYS_PTRACE; or `sysctl -w kernel.yama.ptrace_scope=0` so that a "
            "user may attach to its own processes (then run hangdx as the job's user)",
        )
    return (
        "fail",
        f"{setting}: only CAP_SYS_PTRACE may attach, and {who} lacks it: py-spy can take no stacks",
        "log in as root, or grant the session CAP_SYS_PTRACE",
    )


def _hidepid() -> str | None:
    """The hidepid= option /proc is mounted with, when it hides other users' processes."""
    for line in (collector._read_text("/proc/self/mounts") or "").splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[1] == "/proc" and parts[2] == "proc":
            for option in parts[3].split(","):
                if option.startswith("hidepid=") and option not in ("hidepid=0", "hidepid=off"):
                    return option
    return None


def environ_verdict(
    euid: int, user: str, lacks: list[str], unreadable: list[str], total: int, hidepid: str | None
) -> tuple[str, str, str | None]:
    """(status, detail, fix) for finding a job's processes by their environment (/proc/PID/environ).

    `lacks`: the capabilities missing for other users' processes; `unreadable`: the processes (as
    "pid (name)") whose environment could not be read."""
    who = _who(euid, user)
    count = f"{len(unreadable)} of {total} here are not readable"
    if not lacks:
        # Some process may still refuse (another user namespace, an LSM): worth a mention, not a warning.
        odd = f"; {count} even so: {', '.join(unreadable[:3])}" if unreadable else ""
        return "ok", f"{who} reads /proc/PID/environ of other users' processes ({total} here){odd}", None
    hidden = f"; /proc is mounted with {hidepid}: other users' processes are hidden" if hidepid else ""
    return (
        "warn",
        f"{who} without {' and '.join(lacks)} reads /proc/PID/environ of its own user's processes only "
        f"({count}{hidden}): jobs of other users cannot be found",
        PRIVILEGE_FIX,
    )


def _python() -> dict:
    shown = "Python {}.{}.{} ({})".format(*sys.version_info[:3], sys.executable)
    if sys.version_info[:2] >= MIN_PYTHON:
        return _check("python", True, "ok", shown)
    return _check(
        "python",
        True,
        "fail",
        shown + ": hangdx's collector needs Python 3.8 or newer",
        "install Python >= 3.8 as `python3` on the PATH of non-interactive SSH sessions",
    )


def _pyspy() -> dict:
    fix = (
        "pip install py-spy where the SSH session's PATH finds it (e.g. as root: /usr/local/bin), or set "
        "HANGDX_PYSPY=/path/to/py-spy in the session's environment (sshd_config: SetEnv)"
    )
    path = collector.find_pyspy()
    if path is None:
        forced = os.environ.get("HANGDX_PYSPY")
        if forced is not None:
            detail = f"HANGDX_PYSPY={forced} is not an executable file: no stacks"
        else:
            detail = "py-spy is not on this SSH session's PATH ({}) nor beside {}: no stacks".format(
                os.environ.get("PATH", ""),
                sys.executable,
            )
        return _check("py-spy", True, "fail", detail, fix)
    out, err = collector._run([path, "--version"])
    if not out:
        return _check(
            "py-spy",
            True,
            "fail",
            f"{path} does not run: {err}",
            "reinstall py-spy for this node's OS and CPU (pip install --force-reinstall py-spy)",
        )
    return _check("py-spy", True, "ok", f"{out.strip()} ({path})")


def _environ_readable(pid: int) -> bool:
    try:
        collector._environ(pid)
    except PermissionError:
        return False
    return True


def _privileges() -> list[dict]:
    euid = os.geteuid()
    user = _user(euid)
    caps = effective_caps(collector._read_text("/proc/self/status") or "")
    ptrace, dac = (
        has_cap(caps, CAP_SYS_PTRACE),
        has_cap(caps, CAP_DAC_READ_SEARCH) or has_cap(caps, CAP_DAC_OVERRIDE),
    )
    status, detail, fix = ptrace_verdict(euid, user, ptrace_scope(), ptrace, dac)
    checks = [_check("ptrace", True, status, detail, fix)]
    _, others, _ = collector.find_job_processes("")  # no job has an empty id: the jobs seen here
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) != os.getpid()]
    unreadable = [f"{pid} ({collector._comm(pid)})" for pid in pids if not _environ_readable(pid)]
    lacks = [name for name, held in (("CAP_SYS_PTRACE", ptrace), ("CAP_DAC_READ_SEARCH", dac)) if not held]
    status, detail, fix = environ_verdict(euid, user, lacks, unreadable, len(pids), _hidepid())
    if others:
        detail += "; jobs seen here: {}".format(", ".join(others[:8])) + (" ..." if len(others) > 8 else "")
    checks.append(_check("environ", True, status, detail, fix))
    return checks


def _kernel_log() -> dict:
    text, how, refused = collector.read_kernel_log()
    if text is not None:
        before = " ({})".format("; ".join(refused)) if refused else ""
        return _check("kernel-log", True, "ok", f"read with `{how}`{before}")
    return _check(
        "kernel-log",
        True,
        "fail",
        "not readable ({}): no Xid, OOM-kill, link or hung-task lines from this node".format(
            "; ".join(refused)
        ),
        KERNEL_LOG_FIX,
    )


def _nvml() -> bool:
    """Whether NVML answers through pynvml (nvidia-ml-py), as the collector would read the GPUs."""
    try:
        import pynvml
    except ImportError:
        return False
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no GPU: nvidia-smi is tried next
        return False
    return True


def _gpu() -> dict:
    if _nvml():
        return _check("gpu", False, "ok", "NVML answers (pynvml)")
    out, err = collector._run(["nvidia-smi", "-L"])
    if out:
        return _check("gpu", False, "ok", "nvidia-smi runs")
    missing = "no GPU evidence (utilisation, memory, which rank runs on which GPU)"
    if err and "not found" not in err:
        return _check(
            "gpu",
            False,
            "warn",
            f"{err}: {missing}",
            "check the NVIDIA driver on the node (does nvidia-smi work on its console?)",
        )
    return _check(
        "gpu",
        False,
        "warn",
        f"neither nvidia-smi nor NVML (pynvml) found: {missing}; fine on a CPU-only node",
        "install the NVIDIA driver's nvidia-smi, or `pip install nvidia-ml-py` for the python3 SSH runs",
    )


def _tool(name: str, cmd: list[str] | None, missing: str, fix: str) -> dict:
    """An optional tool: present (and, with cmd, answering), else a warning naming the evidence lost."""
    if cmd is None:
        found = shutil.which(name)
        if found:
            return _check(name, False, "ok", found)
        return _check(name, False, "warn", f"{name} not found: {missing}", fix)
    out, err = collector._run(cmd)
    if out and out.strip():
        return _check(name, False, "ok", "{} answers".format(" ".join(cmd)))
    if err and "not found" in err:
        return _check(name, False, "warn", f"{name} not found: {missing}", fix)
    return _check(
        name, False, "warn", "{}: {}: {}".format(" ".join(cmd), err or "printed nothing", missing), fix
    )


def check_node(host: str | None = None) -> dict:
    """This node's checks, as a document the SSH transport reads like a collector's."""
    euid = os.geteuid()
    checks = [_python(), _pyspy()] + _privileges() + [_kernel_log(), _gpu()]
    checks += [
        _tool(
            "ibstat", ["ibstat", "-l"], "no InfiniBand port state", IB_FIX + "; ignore on a node without IB"
        ),
        _tool("perfquery", None, "no InfiniBand error counters", IB_FIX + "; ignore on a node without IB"),
        _tool("ip", ["ip", "-V"], "no link state or MTU of the network interfaces", "install iproute2"),
    ]
    return {
        "hangdx_collector": collector.COLLECTOR_VERSION,  # first key: what the SSH transport looks for
        "hangdx_doctor": DOCTOR_VERSION,
        "host": host or socket.gethostname(),
        "node_hostname": socket.gethostname(),
        "user": _user(euid),
        "uid": euid,
        "checks": checks,
        "artifacts": [],
        "errors": [],
    }


def main(argv: list[str] | None = None) -> int:
    json.dump(check_node(), sys.stdout)
    return 0


# ---------------------------------------------------------------- host side

_LAUNCHER = """import sys
import types


def _load(name, source):
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, name + ".py", "exec"), module.__dict__)
    return module


_load({collector_name!r}, {collector_source!r})
sys.exit(_load("hangdx_doctor", {doctor_source!r}).main())
"""

_SSH_FIXES = {
    "refused": "start sshd on the node, or give the port it listens on (host:port, or the inventory)",
    "timeout": "check that the node is up and reachable from here (or reach it through --jump)",
    "unreachable": "check that the node is up and reachable from here (or reach it through --jump)",
    "dns": "check the name, or give the node's address in the inventory",
    "auth": "add hangdx's public key to the SSH user's authorized_keys on the node "
    "(deploy/node/authorized_keys.example)",
    "hung": "look at the node's console, or raise --deadline",
}


def node_script() -> bytes:
    """What `python3 -` runs on a node the collector, loaded as a module, then these checks, all on stdin."""
    from pathlib import Path

    return _LAUNCHER.format(
        collector_name=SENT_COLLECTOR,
        collector_source=Path(collector.__file__).read_text(encoding="utf-8"),
        doctor_source=Path(__file__).read_text(encoding="utf-8"),
    ).encode("utf-8")


def _ssh_check(doc: dict, known_hosts: str | None) -> dict:
    """The ssh check of a node that answered (or of this machine, with --local)."""
    if doc.get("transport") == "local":
        return _check("ssh", True, "skip", "--local: this machine, without SSH")
    noise = [e.get("message", "") for e in doc.get("errors") or [] if e.get("source") == "ssh"]
    if noise:
        return _check(
            "ssh",
            True,
            "warn",
            "; ".join(noise),
            "make the SSH user's shell start-up files quiet for non-interactive sessions",
        )
    where = f" against {known_hosts}" if known_hosts else ""
    return _check("ssh", True, "ok", "reached as {}; host key verified{}".format(doc.get("user"), where))


def _split_fix(message: str) -> tuple[str, str | None]:
    """A transport message "what happened; fix: what to do" as (what happened, what to do)."""
    parts = re.split(r"(?i)[;.]?\s*\bfix:\s*", message, maxsplit=1)
    return (parts[0].strip(), parts[1].strip()) if len(parts) == 2 else (message.strip(), None)


def _clean(value: object) -> str:
    """Text from a node, safe to print: no control characters (a terminal would obey escape sequences)."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", " ", str(value))


def _node_checks(doc: dict) -> list[dict]:
    """The checks a node sent, only the known ones, as plain text."""
    checks = []
    for c in doc.get("checks") or []:
        if isinstance(c, dict) and c.get("check") in CHECKS and c.get("status") in _MARK:
            fix = c.get("fix")
            checks.append(
                _check(
                    c["check"],
                    bool(c.get("required")),
                    c["status"],
                    _clean(c.get("detail", "")),
                    fix and _clean(fix),
                )
            )
    if not checks:
        checks.append(
            _check(
                "python",
                True,
                "fail",
                "the node answered without the doctor's checks",
                "check what the node runs for a non-interactive SSH command (ForceCommand, or command= in "
                "authorized_keys)",
            )
        )
    return checks


def _host_checks(doc: dict, known_hosts: str | None, python: str) -> tuple[list[dict], bool]:
    """(the node's checks, whether SSH reached it) from its document."""
    problem = doc.get("problem")
    if not isinstance(problem, dict):
        return [_ssh_check(doc, known_hosts)] + _node_checks(doc), True
    name, message = str(doc.get("host")), _clean(problem.get("message", ""))
    detail, fix = _split_fix(message[len(name) + 2 :] if message.startswith(name + ": ") else message)
    if repr(python + " -") + " failed" in message:
        # SSH worked; the node's python3 did not (missing, too old to read the script): the python check.
        return [
            _check("ssh", True, "ok", "reached; host key verified"),
            _check("python", True, "fail", detail, fix or "install Python >= 3.8 as `python3` on the node"),
        ], True
    return [_check("ssh", True, "fail", detail, fix or _SSH_FIXES.get(str(problem.get("kind"))))], False


def report(docs: list[dict], known_hosts: str | None = None, python: str = "python3") -> dict:
    """The doctor's report (documented in docs/nodes.md) from one document per node, in the nodes' order."""
    hosts = []
    for doc in docs:
        checks, reached = _host_checks(doc, known_hosts, python)
        hosts.append(
            {
                "host": str(doc.get("host")),
                "ok": not any(c["status"] == "fail" for c in checks),
                "reached": reached,
                "user": doc.get("user"),
                "checks": checks,
            }
        )
    problems = [
        {"host": h["host"], **{k: c[k] for k in ("check", "status", "detail", "fix")}}
        for status in ("fail", "warn")
        for h in hosts
        for c in h["checks"]
        if c["status"] == status
    ]
    return {
        "hangdx_doctor": DOCTOR_VERSION,
        "ok": all(h["ok"] for h in hosts),
        "ready": sum(h["ok"] for h in hosts),
        "total": len(hosts),
        "hosts": hosts,
        "problems": problems,
    }


def check_local() -> dict:
    """The report for this machine, checked in-process (`hangdx doctor --local`)."""
    doc = check_node(socket.gethostname())
    doc["transport"] = "local"
    return report([doc])


def check_hosts(hosts: list, settings) -> dict:
    """The report for these hosts (HostSpecs), all checked at once over SSH with `settings` (SshSettings)."""
    from hangdx.probes import ssh

    script = node_script()
    docs = ssh.fan_out(hosts, settings, "", script=lambda host: script)
    return report(docs, known_hosts=settings.known_hosts, python=settings.python)


_HEADER = {"kernel-log": "kernel"}  # so that the table fits 80 columns
_MARK = {
    "ok": ("ok", "green"),
    "warn": ("warn", "yellow"),
    "fail": ("FAIL", "bold red"),
    "skip": ("-", "dim"),
}


def render(rep: dict, console) -> None:
    """The report for people: a host x check table, then one line per problem with its fix."""
    from rich.table import Table
    from rich.text import Text

    from hangdx.probes.text import printable

    table = Table(
        box=None, pad_edge=False, collapse_padding=True, padding=(0, 1), header_style="bold underline"
    )
    table.add_column("host", overflow="fold")  # a long name folds; the marks never do
    for name in CHECKS:
        table.add_column(_HEADER.get(name, name), no_wrap=True)
    for h in rep["hosts"]:
        by_check = {c["check"]: c for c in h["checks"]}
        cells = []
        for name in CHECKS:
            c = by_check.get(name)
            mark, style = _MARK[c["status"]] if c else _MARK["skip"]
            cells.append(Text(mark, style=style))
        table.add_row(Text(printable(h["host"], False), style="bold" if h["ok"] else "bold red"), *cells)
    console.print(table)
    # One line per problem, never wrapped (easy to grep and paste); nodes with the same problem share it.
    same: dict[tuple, list[str]] = {}
    for p in rep["problems"]:
        same.setdefault((p["status"], p["check"], p["detail"], p.get("fix")), []).append(p["host"])
    for (status, check, detail, fix), hosts in same.items():
        mark, style = _MARK[status]
        line = Text.assemble(
            (printable(", ".join(hosts), False), "bold"), " ", (mark, style), " ", (check, "bold"), ": ",
            printable(detail, False),
        )  # fmt: skip
        if fix:
            line.append(" -- fix: ")
            line.append(printable(fix, False), style="cyan")
        console.print(line, soft_wrap=True)
    total, lacking = rep["total"], rep["total"] - rep["ready"]
    nodes = "the node" if total == 1 else f"all {total} nodes"
    if lacking:
        text = f"{lacking} of {total} nodes lack" if total > 1 else "The node lacks"
        console.print(Text(f"{text} something hangdx needs: see the fixes above ({DOCS}).", style="bold red"))
    else:
        warned = sum(1 for h in rep["hosts"] if any(c["status"] == "warn" for c in h["checks"]))
        tail = " (warnings: some evidence will be missing)" if warned else ""
        console.print(Text(f"hangdx has what it needs on {nodes}{tail}.", style="bold green"))


if __name__ == "__main__":
    sys.exit(main())
