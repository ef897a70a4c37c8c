"""`hangdx doctor`: each node's requirements, checked where hangdx would run, with the exact fix.

The cluster tests run doctor over six simulated nodes (real sshd each, no job needed): node-01 has
everything (GPU and InfiniBand tools too), node-02 has no py-spy, node-03 refuses the kernel log (dmesg
under kernel.dmesg_restrict, sudo without a rule, journalctl without permission: the real tools' words),
node-04 refuses dmesg but has the sudo rule, node-05's host key is not in known_hosts, node-06's sshd is
down. The other tests need no cluster: the node-side script under `python3 -` on this machine, the
ptrace and environ rules, the kernel-log fallbacks of the collector, bad usage, the files in deploy/node.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hangdx.probes import collector, doctor

from .scenarios import gpu_node
from .sim import (
    SYSTEM_PATH,
    Cluster,
    NodeSpec,
    ToolOutput,
    node_address,
    quiet_kernel_log,
    unavailable_reason,
)

REPO = Path(__file__).resolve().parents[2]
_REASON = unavailable_reason()
needs_cluster = pytest.mark.skipif(_REASON is not None, reason=f"simulated cluster unavailable: {_REASON}")

# What the real tools print when they refuse (util-linux dmesg, sudo -n, systemd's journalctl).
DMESG_REFUSED = ToolOutput("", "dmesg: read kernel buffer failed: Operation not permitted\n", 1)
SUDO_NO_RULE = ToolOutput("", "sudo: a password is required\n", 1)
# Python 3.6 (RHEL 7's python3) given the collector: it cannot even compile it.
PYTHON36 = ToolOutput(
    "",
    "Traceback (most recent call last):\n"
    '  File "<stdin>", line 12, in <module>\n'
    '  File "<stdin>", line 7, in _load\n'
    '  File "hangdx_sent_collector.py", line 14\n'
    "    from __future__ import annotations\n"
    "    ^\n"
    "SyntaxError: future feature annotations is not defined\n",
    1,
)
JOURNAL_REFUSED = ToolOutput(
    "",
    "Hint: You are currently not seeing messages from other users and the system.\n"
    "      Users in groups 'adm', 'systemd-journal' can see all messages.\n"
    "      Pass -q to turn off this notice.\n"
    "No journal files were opened due to insufficient permissions.\n",
    1,
)


def ctime_log(raw: str) -> str:
    """Raw `[seconds.micros] msg` dmesg lines as `dmesg --ctime` prints them (booted an hour ago)."""
    boot = time.time() - 3600
    out = []
    for line in raw.splitlines():
        stamp, _, msg = line.partition("] ")
        when = time.localtime(boot + float(stamp.strip("[ ")))
        out.append("[" + time.strftime("%a %b %e %H:%M:%S %Y", when) + "] " + msg)
    return "\n".join(out) + "\n"


def hangdx(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hangdx", *args], capture_output=True, text=True, timeout=120, env=env
    )


def by_host(report: dict) -> dict[str, dict[str, dict]]:
    """host -> check -> the check's record."""
    return {h["host"]: {c["check"]: c for c in h["checks"]} for h in report["hosts"]}


# ---------------------------------------------------------------- the simulated cluster


@pytest.fixture(scope="module")
def cluster():
    if _REASON:
        pytest.skip(_REASON)
    if shutil.which("py-spy", path=SYSTEM_PATH):
        pytest.skip("this machine has py-spy on the system PATH: a node without it cannot be simulated")
    specs = {
        0: gpu_node(0, 2),
        1: NodeSpec(pyspy=False),
        2: NodeSpec(fixed={"dmesg": DMESG_REFUSED, "sudo": SUDO_NO_RULE, "journalctl": JOURNAL_REFUSED}),
        3: NodeSpec(fixed={"dmesg": DMESG_REFUSED, "sudo": ToolOutput(ctime_log(quiet_kernel_log()))}),
        5: NodeSpec(sshd=False),
        6: NodeSpec(fixed={"python3": PYTHON36}),
    }
    c = Cluster(7, 0, node_specs=specs, job_id="doctor")
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def known_hosts(cluster, tmp_path_factory) -> str:
    """The cluster's known_hosts without node-05's key."""
    path = tmp_path_factory.mktemp("doctor") / "known_hosts"
    unknown = f"[{node_address(4)}]:"
    lines = Path(cluster.known_hosts).read_text().splitlines(keepends=True)
    path.write_text("".join(line for line in lines if not line.startswith(unknown)))
    return str(path)


@pytest.fixture(scope="module")
def inventory_runs(cluster, known_hosts):
    """doctor --inventory, as JSON and as the table (both runs against the same nodes)."""
    args = ["doctor", "--inventory", cluster.inventory_file, "--known-hosts", known_hosts]
    return hangdx(*args, "--json"), hangdx(*args)


@needs_cluster
def test_doctor_json_names_exactly_which_node_lacks_what(inventory_runs):
    run, _ = inventory_runs
    assert run.returncode == 3, run.stderr
    report = json.loads(run.stdout)
    assert {"hangdx_doctor", "ok", "ready", "total", "hosts", "problems"} <= set(report)
    assert (report["ok"], report["ready"], report["total"]) == (False, 2, 7)
    failing = {
        h["host"]: sorted(c["check"] for c in h["checks"] if c["status"] == "fail")
        for h in report["hosts"]
        if not h["ok"]
    }
    assert failing == {
        "node-02": ["py-spy"],
        "node-03": ["kernel-log"],
        "node-05": ["ssh"],
        "node-06": ["ssh"],
        "node-07": ["python"],
    }
    checks = by_host(report)
    # The fully equipped node: every check run, every one OK, no problem reported for it.
    assert sorted(checks["node-01"]) == sorted(doctor.CHECKS)
    assert {c: r["status"] for c, r in checks["node-01"].items()} == dict.fromkeys(doctor.CHECKS, "ok")
    assert "host key verified" in checks["node-01"]["ssh"]["detail"]
    assert not [p for p in report["problems"] if p["host"] == "node-01"]
    # node-04: dmesg refused, the sudo rule reads it; says which way it went and what was refused.
    klog = checks["node-04"]["kernel-log"]
    assert klog["status"] == "ok" and "sudo -n dmesg --ctime" in klog["detail"]
    assert "Operation not permitted" in klog["detail"]


@needs_cluster
def test_doctor_says_why_each_failing_node_fails_and_the_fix(inventory_runs):
    report = json.loads(inventory_runs[0].stdout)
    checks = by_host(report)
    pyspy = checks["node-02"]["py-spy"]
    assert "not on this SSH session's PATH" in pyspy["detail"] and "pip install py-spy" in pyspy["fix"]
    assert "HANGDX_PYSPY" in pyspy["fix"]

    klog = checks["node-03"]["kernel-log"]
    for refusal in (
        "dmesg --ctime: dmesg: read kernel buffer failed: Operation not permitted",
        "sudo -n dmesg --ctime: sudo: a password is required",
        "No journal files were opened due to insufficient permissions",
    ):
        assert refusal in klog["detail"]
    assert "deploy/node/hangdx.sudoers" in klog["fix"] and "kernel.dmesg_restrict=0" in klog["fix"]

    key = checks["node-05"]["ssh"]
    assert "not in" in key["detail"] and "nothing was run" in key["detail"]
    assert "ssh-keyscan" in key["fix"]
    assert set(checks["node-05"]) == {"ssh"}  # nothing ran there: nothing else is claimed

    down = checks["node-06"]["ssh"]
    assert "refused the connection" in down["detail"] and "sshd" in down["fix"]

    old = checks["node-07"]
    assert old["ssh"]["status"] == "ok" and set(old) == {"ssh", "python"}
    assert "future feature annotations is not defined" in old["python"]["detail"]
    assert "Python >= 3.8" in old["python"]["fix"]

    # Missing optional tools are warnings that name the evidence lost, not failures.
    for name, lost in (("gpu", "no GPU evidence"), ("ibstat", "port state"), ("perfquery", "error counters")):
        assert checks["node-02"][name]["status"] == "warn" and lost in checks["node-02"][name]["detail"]
    # Every failure is listed before any warning, each with its fix.
    statuses = [p["status"] for p in report["problems"]]
    assert statuses == sorted(statuses, key=["fail", "warn"].index)
    assert all(p["fix"] for p in report["problems"])


@needs_cluster
def test_doctor_table_shows_each_problem_on_one_line_with_its_fix(inventory_runs):
    _, run = inventory_runs
    assert run.returncode == 3, run.stderr
    lines = run.stdout.splitlines()
    header = next(line.split() for line in lines if line.startswith("host "))
    table = [line.split() for line in lines if line.startswith("node-") and len(line.split()) == len(header)]
    rows = {parts[0]: dict(zip(header[1:], parts[1:], strict=True)) for parts in table}

    def problem(host: str, check: str) -> str:
        found = [line for line in lines if line.startswith(f"{host} FAIL {check}:")]
        assert len(found) == 1, run.stdout
        return found[0]

    assert "pip install py-spy" in problem("node-02", "py-spy")
    assert "hangdx.sudoers" in problem("node-03", "kernel-log")
    assert "ssh-keyscan" in problem("node-05", "ssh")
    assert "refused the connection" in problem("node-06", "ssh")
    assert sorted(rows) == [f"node-0{i}" for i in range(1, 8)]
    assert set(rows["node-01"].values()) == {"ok"}
    assert (rows["node-02"]["py-spy"], rows["node-03"]["kernel"], rows["node-04"]["kernel"]) == (
        "FAIL",
        "FAIL",
        "ok",
    )
    assert rows["node-05"]["ssh"] == rows["node-06"]["ssh"] == "FAIL"
    assert set(rows["node-05"].values()) - {"FAIL"} == {"-"}  # not reached: nothing else checked
    assert not [line for line in lines if line.startswith("node-01 ") and ":" in line]  # no problem line
    assert "Python >= 3.8" in problem("node-07", "python")
    assert "5 of 7 nodes lack something hangdx needs" in run.stdout


@needs_cluster
def test_doctor_exits_0_when_every_node_has_what_hangdx_needs(cluster, known_hosts):
    host = f"root@{cluster.addresses['node-01']}:{cluster.port}"
    run = hangdx(
        "doctor", "--hosts", host, "--ssh-key", cluster.key_file, "--known-hosts", known_hosts, "--json"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["ok"] and [h["host"] for h in report["hosts"]] == [cluster.addresses["node-01"]]
    assert report["problems"] == []


@needs_cluster
def test_collector_says_which_kernel_log_reads_were_refused(cluster, known_hosts):
    """The collector itself: node-03's gap names every refusal; node-04's log came through sudo."""
    from hangdx.probes import ssh
    from hangdx.probes.hosts import HostSpec, SshSettings

    settings = SshSettings(known_hosts=known_hosts, key_file=cluster.key_file, user="root", deadline=60)
    hosts = [HostSpec(h, address=cluster.addresses[h], port=cluster.port) for h in ("node-03", "node-04")]
    refused, via_sudo = ssh.fan_out(hosts, settings, "no-such-job", samples=1, interval=0.0)
    gaps = [e["message"] for e in refused["errors"] if e["source"] == "kernel log"]
    assert len(gaps) == 1 and "Operation not permitted" in gaps[0] and "a password is required" in gaps[0]
    assert not [a for a in refused["artifacts"] if a["kind"] == "kernel_log"]
    logs = [a["name"] for a in via_sudo["artifacts"] if a["kind"] == "kernel_log"]
    assert logs == ["kernel-sudo.log"]
    assert not [e for e in via_sudo["errors"] if e["source"] == "kernel log"]


# ---------------------------------------------------------------- no cluster needed


def _tool(directory: Path, name: str, out: ToolOutput) -> None:
    path = directory / name
    path.write_text(
        f"#!{sys.executable} -S\nimport sys\nsys.stdout.write({out.stdout!r})\n"
        f"sys.stderr.write({out.stderr!r})\nsys.exit({out.returncode})\n"
    )
    path.chmod(0o755)


def _node_checks(env: dict) -> dict[str, dict]:
    """The node-side script as SSH runs it (`python3 -`, on stdin), without site-packages (no hangdx)."""
    run = subprocess.run(
        [sys.executable, "-S", "-"], input=doctor.node_script(), capture_output=True, env=env, timeout=60
    )
    assert run.returncode == 0, run.stderr.decode()
    doc = json.loads(run.stdout)
    assert "hangdx_collector" in doc and doc["hangdx_doctor"] == doctor.DOCTOR_VERSION
    return {c["check"]: c for c in doc["checks"]}


def test_node_script_runs_under_python3_stdin_with_no_job_and_names_what_is_missing(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    _tool(tools, "dmesg", DMESG_REFUSED)
    _tool(tools, "sudo", SUDO_NO_RULE)
    pyspy = collector.find_pyspy()
    assert pyspy, "py-spy is installed with hangdx"
    env = {"PATH": str(tools), "HANGDX_PYSPY": pyspy, "HOME": str(tmp_path)}

    checks = _node_checks(env)
    assert list(checks) == [c for c in doctor.CHECKS if c != "ssh"]
    assert checks["python"]["status"] == "ok" and sys.executable in checks["python"]["detail"]
    assert checks["py-spy"]["status"] == "ok" and checks["py-spy"]["detail"].startswith("py-spy 0.")
    klog = checks["kernel-log"]
    assert klog["status"] == "fail" and klog["required"]
    assert "dmesg --ctime: dmesg: read kernel buffer failed: Operation not permitted" in klog["detail"]
    assert "sudo -n dmesg --ctime: sudo: a password is required" in klog["detail"]
    assert "journalctl -k -n 5000 --no-pager: journalctl not found" in klog["detail"]
    for name in ("gpu", "ibstat", "perfquery", "ip"):  # nothing on this PATH: warnings, not failures
        assert checks[name]["status"] == "warn" and not checks[name]["required"], checks[name]
    caps = doctor.effective_caps(Path("/proc/self/status").read_text())
    privileged = doctor.has_cap(caps, doctor.CAP_SYS_PTRACE) and doctor.has_cap(
        caps, doctor.CAP_DAC_READ_SEARCH
    )
    expected = doctor.ptrace_verdict(os.geteuid(), "me", doctor.ptrace_scope(), privileged)[0]
    assert checks["ptrace"]["status"] == expected
    assert checks["environ"]["status"] == ("ok" if privileged else "warn")

    env["HANGDX_PYSPY"] = str(tmp_path / "no-py-spy")
    missing = _node_checks(env)["py-spy"]
    assert missing["status"] == "fail" and f"HANGDX_PYSPY={tmp_path / 'no-py-spy'}" in missing["detail"]


@pytest.mark.parametrize(
    ("euid", "scope", "cap", "dac", "status", "said"),
    [
        (0, None, True, True, "ok", "CAP_SYS_PTRACE"),
        (0, 1, True, True, "ok", "every process"),
        (0, 2, True, True, "ok", "every process"),
        (1001, 1, True, True, "ok", "every process"),  # a dedicated user given both capabilities
        (1001, 0, True, False, "warn", "not CAP_DAC_READ_SEARCH"),
        (0, 0, False, True, "warn", "dropped by a container"),
        (1001, 0, False, False, "warn", "its own user's processes"),
        (1001, None, False, False, "warn", "its own user's processes"),
        (1001, 1, False, False, "fail", "own descendants"),
        (1001, 2, False, False, "fail", "only CAP_SYS_PTRACE"),
        (0, 3, True, True, "fail", "not even root"),
    ],
)
def test_ptrace_permission_follows_capabilities_and_yama(euid, scope, cap, dac, status, said):
    got, detail, fix = doctor.ptrace_verdict(euid, "hangdx", scope, cap, dac)
    assert (got, said in detail) == (status, True), detail
    assert (fix is None) == (status == "ok")


def test_environ_without_the_capabilities_is_limited_to_own_processes():
    lacks = ["CAP_DAC_READ_SEARCH"]
    status, detail, fix = doctor.environ_verdict(1001, "hangdx", lacks, ["1 (systemd)"], 120, "hidepid=2")
    assert status == "warn" and "own user's processes only" in detail and "hidepid=2" in detail
    assert "without CAP_DAC_READ_SEARCH" in detail and "CAP_DAC_READ_SEARCH" in fix
    status, detail, _ = doctor.environ_verdict(0, "root", [], [], 120, None)
    assert status == "ok" and "120" in detail


@pytest.mark.parametrize(
    ("capeff", "ptrace", "dac"),
    [
        ("000001ffffffffff", True, True),  # root
        ("0000000000080004", True, True),  # cap_sys_ptrace,cap_dac_read_search: the dedicated user
        ("0000000000080000", True, False),
        ("00000000a80425fb", False, True),  # docker's default set: no SYS_PTRACE, DAC_OVERRIDE (bit 1) only
        ("0000000000000000", False, False),
    ],
)
def test_capabilities_are_read_from_capeff(capeff, ptrace, dac):
    caps = doctor.effective_caps(f"CapInh:\t0000000000000000\nCapEff:\t{capeff}\nCapBnd:\t000001ffffffffff\n")
    assert doctor.has_cap(caps, doctor.CAP_SYS_PTRACE) == ptrace
    assert (
        doctor.has_cap(caps, doctor.CAP_DAC_READ_SEARCH) or doctor.has_cap(caps, doctor.CAP_DAC_OVERRIDE)
    ) == dac


def test_collector_reads_the_kernel_log_through_sudo_when_dmesg_is_refused(tmp_path, monkeypatch):
    _tool(tmp_path, "dmesg", DMESG_REFUSED)
    _tool(tmp_path, "sudo", ToolOutput(ctime_log(quiet_kernel_log())))
    monkeypatch.setenv("PATH", str(tmp_path))
    text, how, refused = collector.read_kernel_log()
    assert how == "sudo -n dmesg --ctime" and "NVRM" in text
    assert refused == ["dmesg --ctime: dmesg: read kernel buffer failed: Operation not permitted"]

    # journalctl's "-- No entries --" (a user who may not read the kernel's messages) is no kernel log.
    _tool(tmp_path, "sudo", SUDO_NO_RULE)
    _tool(tmp_path, "journalctl", ToolOutput("-- No entries --\n"))
    artifacts, errors = [], []
    collector._collect_host("n1", lambda name, kind, data, **kw: artifacts.append((name, kind)), errors)
    assert not [a for a in artifacts if a[1] == "kernel_log"]
    gap = [e["message"] for e in errors if e["source"] == "kernel log"]
    assert gap == [
        "no kernel log: dmesg --ctime: dmesg: read kernel buffer failed: Operation not permitted; "
        "sudo -n dmesg --ctime: sudo: a password is required; "
        "journalctl -k -n 5000 --no-pager: -- No entries --"
    ]


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
    reason="needs root, setpriv (util-linux) and /usr/bin/python3 to run the checks as another user",
)
def test_node_script_as_an_unprivileged_user_reports_the_real_limits():
    """No stand-ins: the checks as `nobody` on this machine, as a plain SSH account would run them."""
    run = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-"],
        input=doctor.node_script(),
        capture_output=True,
        env={"PATH": "/usr/bin:/bin", "HOME": "/"},
        timeout=60,
    )
    assert run.returncode == 0, run.stderr.decode()
    checks = {c["check"]: c for c in json.loads(run.stdout)["checks"]}
    scope = doctor.ptrace_scope()
    assert checks["ptrace"]["status"] == doctor.ptrace_verdict(65534, "nobody", scope, False, False)[0]
    assert checks["ptrace"]["status"] != "ok" and "without CAP_SYS_PTRACE" in checks["ptrace"]["detail"]
    environ = checks["environ"]
    assert environ["status"] == "warn" and "own user's processes only" in environ["detail"]
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1":
        refused = "dmesg --ctime: dmesg: read kernel buffer failed: Operation not permitted"
        assert refused in checks["kernel-log"]["detail"]
    if not shutil.which("py-spy", path="/usr/bin:/bin"):
        assert checks["py-spy"]["status"] == "fail" and "/usr/bin:/bin" in checks["py-spy"]["detail"]


def test_report_turns_transport_problems_into_checks_and_cleans_node_text():
    from hangdx.probes.ssh import problem_doc

    docs = [
        problem_doc(
            "n1", "auth", "n1: root@10.0.0.1 refused the ssh-agent's and ~/.ssh/id_* keys; fix: add it"
        ),
        problem_doc(
            "n2", "unreachable", "n2: 10.0.0.2 is unreachable (No route to host): node down or no route"
        ),
        {
            "hangdx_collector": 1,
            "host": "n3",
            "user": "hangdx",
            "checks": [
                {"check": "python", "required": True, "status": "ok", "detail": "Python 3.12\x1b[2J"},
                {"check": "rm -rf", "status": "fail", "detail": "not a check of ours"},
                {"check": "gpu", "status": "weird", "detail": "not a status of ours"},
            ],
        },
        {"hangdx_collector": 1, "host": "n4", "checks": []},
    ]
    report = doctor.report(docs)
    checks = by_host(report)
    assert checks["n1"]["ssh"]["detail"].endswith("keys") and checks["n1"]["ssh"]["fix"] == "add it"
    assert checks["n2"]["ssh"]["fix"] == doctor._SSH_FIXES["unreachable"]
    assert set(checks["n3"]) == {"ssh", "python"} and "\x1b" not in checks["n3"]["python"]["detail"]
    assert checks["n4"]["python"]["status"] == "fail"  # answered, but not with the doctor's checks
    assert [h["ok"] for h in report["hosts"]] == [False, False, True, False]
    assert [h["reached"] for h in report["hosts"]] == [False, False, True, True]


def test_doctor_without_nodes_is_bad_usage_in_one_line():
    run = hangdx("doctor")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "--hosts" in run.stderr and "--local" in run.stderr


def test_doctor_refuses_a_bad_host_and_a_missing_known_hosts_in_one_line(tmp_path):
    bad = hangdx("doctor", "--hosts", "node-01;reboot")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "node-01;reboot" in bad.stderr
    missing = hangdx("doctor", "--hosts", "node-01", "--known-hosts", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "known_hosts" in missing.stderr


def test_doctor_local_checks_this_machine_without_ssh():
    run = hangdx("doctor", "--local", "--json")
    report = json.loads(run.stdout)
    assert run.returncode == (0 if report["ok"] else 3)
    checks = by_host(report)[report["hosts"][0]["host"]]
    assert checks["ssh"]["status"] == "skip" and checks["python"]["status"] == "ok"
    assert checks["py-spy"]["status"] == "ok"  # installed with hangdx, beside this interpreter


@needs_cluster
def test_deploy_sshd_snippet_is_accepted_by_sshd(tmp_path):
    key = tmp_path / "host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    config = tmp_path / "sshd_config"
    config.write_text(
        f"HostKey {key}\nListenAddress 127.0.0.1:22\nInclude {REPO / 'deploy/node/sshd_hangdx.conf'}\n"
    )
    # sshd -t wants its privilege-separation directory: give it one in a private /run.
    script = 'mount -t tmpfs tmpfs /run && mkdir /run/sshd && exec /usr/sbin/sshd -T -f "$1" -C user=hangdx'
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(config)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    effective = dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)
    assert effective["allowtcpforwarding"] == "no" and effective["permittty"] == "no"
    assert effective["authenticationmethods"] == "publickey"


@pytest.mark.skipif(shutil.which("visudo") is None, reason="visudo (the sudo package) is not installed")
def test_deploy_sudoers_rule_parses():
    run = subprocess.run(["visudo", "-cf", str(REPO / "deploy/node/hangdx.sudoers")], capture_output=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_deploy_sudoers_allows_only_dmesg_ctime():
    rules = [
        line
        for line in (REPO / "deploy/node/hangdx.sudoers").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert "Cmnd_Alias HANGDX_KERNEL_LOG = /usr/bin/dmesg --ctime, /bin/dmesg --ctime" in rules
    assert rules[-1] == "hangdx ALL = (root) NOPASSWD: HANGDX_KERNEL_LOG"
    assert collector.KERNEL_LOG_COMMANDS[1] == ["sudo", "-n", "dmesg", "--ctime"]  # what the rule allows
    assert not any("ALL" in r.split("NOPASSWD:")[-1] for r in rules if "NOPASSWD" in r)


def test_node_script_carries_no_user_text():
    """The script is the collector and doctor's own source, nothing else: the same bytes for every node."""
    script = doctor.node_script()
    assert script == doctor.node_script()
    assert repr(Path(collector.__file__).read_text(encoding="utf-8")).encode() in script
    assert repr(Path(doctor.__file__).read_text(encoding="utf-8")).encode() in script
