"""The SSH transport against a real OpenSSH server on 127.0.0.1 (started here, killed by PID at the end).

Needs root (the sshd privilege-separation user and root login) and /usr/sbin/sshd
(`apt-get install -y openssh-server`); the module is skipped with the reason otherwise.
One sshd listens on two ports: MAIN runs commands normally; RECORD has a ForceCommand that writes
$SSH_ORIGINAL_COMMAND (the exact command the client sent) to a file, then runs it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import uuid
from pathlib import Path

import paramiko
import pytest

from hangdx.probes import bundle
from hangdx.probes.hosts import HostSpec, SshSettings
from hangdx.probes.ssh import collector_script, fan_out, probe_host

SSHD = "/usr/sbin/sshd"
LOOPBACK = "127.0.0.1"


def _free_port() -> int:
    # sshd cannot bind port 0: borrow a free port from the kernel, release it, hand it to sshd.
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().split()[:2]


def _sign_host_key(
    ca: Path, pub: Path, principals: str, validity: str = "-5m:+1h", host: bool = True
) -> Path:
    """A real OpenSSH certificate of `pub`, signed by `ca` (written beside it as NAME-cert.pub)."""
    kind = ["-h"] if host else []
    subprocess.run(
        [
            "ssh-keygen",
            "-q",
            "-s",
            str(ca),
            "-I",
            "hangdx-test",
            *kind,
            "-n",
            principals,
            "-V",
            validity,
            str(pub),
        ],
        check=True,
    )
    return pub.with_name(pub.name.removesuffix(".pub") + "-cert.pub")


def _public_key(pub: Path) -> paramiko.PKey:
    """A key as a known_hosts line gives it: public only."""
    kind, b64 = pub.read_text().split()[:2]
    return paramiko.PKey.from_type_string(kind, base64.b64decode(b64))


def _fingerprint(pub: Path) -> str:
    return subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True).stdout.split()[1]


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


def _pyspy_dir() -> str | None:
    # The real binary, not a pyenv shim: what `pip install py-spy` puts beside the interpreter.
    beside = Path(sys.executable).parent / "py-spy"
    if os.access(beside, os.X_OK):
        return str(beside.parent)
    found = shutil.which("py-spy")
    return str(Path(found).parent) if found else None


class Server:
    """What the tests need to know about the running sshd."""

    def __init__(self, root: Path):
        self.root = root
        self.main_port = _free_port()
        self.record_port = _free_port()
        self.host_pub = root / "host_key.pub"
        self.client_key = str(root / "client_key")
        self.wrong_key = str(root / "wrong_key")
        self.known_hosts = str(root / "known_hosts")
        self.command_log = root / "command.txt"
        self.hang_pids = root / "hang.pids"

    def host(self, name: str = "node-a", port: int | None = None, **kw) -> HostSpec:
        return HostSpec(name=name, address=LOOPBACK, port=port or self.main_port, user="root", **kw)

    def settings(self, **kw) -> SshSettings:
        base = dict(
            known_hosts=self.known_hosts,
            key_file=self.client_key,
            use_agent=False,
            connect_timeout=3.0,
            command_timeout=20.0,
            deadline=30.0,
        )
        base.update(kw)
        return SshSettings(**base)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root: sshd's privilege separation and a root login on 127.0.0.1")
    if not os.access(SSHD, os.X_OK) or not shutil.which("ssh-keygen"):
        pytest.skip(f"{SSHD} not installed (apt-get install -y openssh-server)")
    pyspy_dir = _pyspy_dir()
    if pyspy_dir is None:
        pytest.skip("py-spy not installed (pip install py-spy)")
    # OpenSSH refuses to start without its privilege-separation directory (created by the service unit).
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)

    root = tmp_path_factory.mktemp("sshd")
    srv = Server(root)
    host_type, host_b64 = _keygen(root / "host_key")
    # The same host key also has a certificate from a site CA, as sites with an SSH CA deploy it.
    _keygen(root / "ca")
    _sign_host_key(root / "ca", root / "host_key.pub", "127.0.0.1,node-a")
    _keygen(root / "client_key")
    _keygen(root / "wrong_key")
    (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
    Path(srv.known_hosts).write_text(
        f"[{LOOPBACK}]:{srv.main_port} {host_type} {host_b64}\n[{LOOPBACK}]:{srv.record_port} {host_type} {host_b64}\n"
    )
    recorder = _script(
        root / "record.sh",
        f"""\
        printf '%s' "$SSH_ORIGINAL_COMMAND" > {srv.command_log}
        exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"
        """,
    )
    # The session PATH decides which python3 runs the collector and whether it finds py-spy.
    path = f"{pyspy_dir}:{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    config = root / "sshd_config"
    config.write_text(
        textwrap.dedent(
            f"""\
            ListenAddress {LOOPBACK}
            Port {srv.main_port}
            Port {srv.record_port}
            HostKey {root / "host_key"}
            HostCertificate {root / "host_key-cert.pub"}
            PidFile {root / "sshd.pid"}
            AuthorizedKeysFile {root / "authorized_keys"}
            PermitRootLogin prohibit-password
            StrictModes no
            UsePAM no
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            AllowTcpForwarding yes
            SetEnv PATH={path}
            Match LocalPort {srv.record_port}
                ForceCommand {recorder}
            """
        )
    )
    log = open(root / "sshd.log", "wb")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                pytest.skip(f"sshd did not start: {(root / 'sshd.log').read_text()[-500:]}")
            try:
                for port in (srv.main_port, srv.record_port):
                    socket.create_connection((LOOPBACK, port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > end:
                    pytest.skip("sshd did not listen within 10s")
                time.sleep(0.05)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        _kill_pids(srv.hang_pids)


def _kill_pids(pidfile: Path) -> None:
    """The `sleep` processes the hanging "nodes" left behind (recorded by PID when they started)."""
    if not pidfile.exists():
        return
    for line in pidfile.read_text().split():
        try:
            os.kill(int(line), 9)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture
def fake_job():
    """Two ranks of a job, idle in train_step(): what the collector must find and dump."""
    job_id = f"hangdx-test-{uuid.uuid4().hex[:10]}"
    code = "import time\ndef train_step():\n    time.sleep(120)\ntrain_step()\n"
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, HANGDX_JOB_ID=job_id, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
    time.sleep(0.5)  # let both reach time.sleep before py-spy looks
    try:
        yield job_id, procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _transports_alive(wait: float = 1.0) -> list[str]:
    """paramiko Transport threads still running; closed ones notice within 0.1 s."""
    end = time.monotonic() + wait
    while True:
        alive = [t.name for t in threading.enumerate() if isinstance(t, paramiko.Transport)]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.05)


def _problem(doc: dict) -> tuple[str, str]:
    return doc["problem"]["kind"], doc["problem"]["message"]


def _deadline(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


# -- a real collector run ------------------------------------------------------------------------------


def test_collector_over_ssh_finds_both_ranks(sshd, fake_job):
    job_id, procs = fake_job
    script = collector_script(job_id, samples=1, interval=0.1, hardware=False)
    doc = probe_host(sshd.host("gpu-node-07"), sshd.settings(), script, _deadline())

    assert "problem" not in doc, doc.get("problem")
    assert doc["host"] == "gpu-node-07"  # what the user called it
    assert doc["node_hostname"] == socket.gethostname()
    assert doc["transport"] == "ssh" and doc["elapsed"] > 0
    assert doc["job_id"] == job_id
    pids = {0: procs[0].pid, 1: procs[1].pid}
    stacks = {a["rank"]: a for a in doc["artifacts"] if a["kind"] == "pyspy"}
    assert set(stacks) == {0, 1}, doc["errors"]
    for rank, art in stacks.items():
        assert art["pid"] == pids[rank]
        assert "train_step" in art["data"]
    procstate = [a for a in doc["artifacts"] if a["kind"] == "procstate"]
    assert len(procstate) == 1
    samples = json.loads(procstate[0]["data"])["samples"]
    assert {(s["rank"], s["pid"]) for s in samples} == {(0, pids[0]), (1, pids[1])}

    ev = bundle.evidence_from_documents([doc], job_id=job_id)
    assert {s.rank for s in ev.stacks} == {0, 1}
    assert all(any(f.function == "train_step" for t in s.threads for f in t.frames) for s in ev.stacks)
    assert _transports_alive() == []


# -- host keys -----------------------------------------------------------------------------------------


def test_unknown_host_key_is_refused_and_nothing_runs(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    sshd.command_log.unlink(missing_ok=True)
    settings = sshd.settings(known_hosts=str(empty))
    script = collector_script("job-1", 1, 0.1, hardware=False)
    doc = probe_host(sshd.host(port=sshd.record_port), settings, script, _deadline())

    kind, message = _problem(doc)
    assert kind == "host_key_unknown"
    assert f"ssh-keyscan -p {sshd.record_port} {LOOPBACK}" in message
    assert _fingerprint(sshd.host_pub) in message  # the key to verify out of band
    assert "\n" not in message
    assert doc["artifacts"] == []
    assert not sshd.command_log.exists()  # the recorder never ran: no command was sent
    assert empty.read_text() == ""  # known_hosts is never written


def test_changed_host_key_is_refused(sshd, tmp_path):
    other = tmp_path / "other"
    key_type, b64 = _keygen(other)
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[{LOOPBACK}]:{sshd.main_port} {key_type} {b64}\n")
    doc = probe_host(sshd.host(), sshd.settings(known_hosts=str(kh)), b"", _deadline())

    kind, message = _problem(doc)
    assert kind == "host_key_changed"
    assert "man-in-the-middle" in message
    assert _fingerprint(other.with_suffix(".pub")) in message and _fingerprint(sshd.host_pub) in message
    assert f"ssh-keygen -R '[{LOOPBACK}]:{sshd.main_port}'" in message
    assert kh.read_text().count("\n") == 1


def test_cert_authority_and_revoked_lines_break_no_host(sshd, tmp_path):
    """Issue 10.8: a site with an SSH CA has @cert-authority lines; one used to make every host fail."""
    ca = tmp_path / "ca"
    ca_type, ca_b64 = _keygen(ca)
    other = tmp_path / "old"
    old_type, old_b64 = _keygen(other)
    kh = tmp_path / "known_hosts"
    kh.write_text(
        f"@cert-authority *.cluster.example {ca_type} {ca_b64}\n"
        f"@revoked * {old_type} {old_b64}\n" + Path(sshd.known_hosts).read_text()
    )
    doc = probe_host(sshd.host(), sshd.settings(known_hosts=str(kh)), b"", _deadline())
    assert doc.get("problem") is None or doc["problem"]["kind"] not in ("host_key_unknown", "error"), doc


def test_a_revoked_host_key_is_refused_even_when_listed(sshd, tmp_path):
    host_type, host_b64 = sshd.host_pub.read_text().split()[:2]
    kh = tmp_path / "known_hosts"
    kh.write_text(f"@revoked * {host_type} {host_b64}\n" + Path(sshd.known_hosts).read_text())
    sshd.command_log.unlink(missing_ok=True)
    doc = probe_host(sshd.host(port=sshd.record_port), sshd.settings(known_hosts=str(kh)), b"", _deadline())
    kind, message = _problem(doc)
    assert kind == "host_key_changed" and "marked @revoked" in message, message
    assert not sshd.command_log.exists()


def _openssh_accepts(sshd, known_hosts: Path, port: int) -> bool:
    """What the real `ssh` client decides with this known_hosts file (the reference hangdx must agree with)."""
    r = subprocess.run(
        ["ssh", "-F", "/dev/null", "-p", str(port), "-i", sshd.client_key, "-o", "IdentitiesOnly=yes",
         "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}",
         "-o", "GlobalKnownHostsFile=/dev/null", "-o", "ConnectTimeout=5", f"root@{LOOPBACK}", "true"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return r.returncode == 0


@pytest.mark.parametrize("gap", ["  ", "\t", " \t ", "\t\t"], ids=repr)
def test_a_revoked_marker_with_any_whitespace_is_honoured(sshd, tmp_path, gap):
    """Row 8: `@revoked  * KEY` (two spaces, a tab) was dropped and hangdx connected to a key OpenSSH refuses."""
    host_type, host_b64 = sshd.host_pub.read_text().split()[:2]
    kh = tmp_path / "known_hosts"
    kh.write_text(f"@revoked{gap}*{gap}{host_type}{gap}{host_b64}\n" + Path(sshd.known_hosts).read_text())
    assert not _openssh_accepts(sshd, kh, sshd.main_port)
    sshd.command_log.unlink(missing_ok=True)
    doc = probe_host(sshd.host(port=sshd.record_port), sshd.settings(known_hosts=str(kh)), b"", _deadline())
    kind, message = _problem(doc)
    assert kind == "host_key_changed" and "marked @revoked" in message, message
    assert not sshd.command_log.exists()


@pytest.mark.parametrize(
    "pattern, accepted",
    [
        ("[127.0.0.1]:{port}", True),
        ("[127.0.0.?]:{port}", True),
        ("[127.0.0.*]:{port}", True),
        ("[127.0.0.1]:?{rest}", True),
        ("[127.0.0.2]:{port}", False),
        ("[127.0.0.1]:1{port}", False),
        ("127.0.0.1", True),  # for a certificate OpenSSH also tries the name without the port
        ("127.0.0.?", True),
        ("[127.0.0.1]", False),
        ("1]:{port}", False),
        ("[127.0.0.1]:{port},![127.0.0.1]:{port}", False),
    ],
)
def test_cert_authority_patterns_match_as_openssh_matches_them(sshd, tmp_path, pattern, accepted):
    """Row 8: `[host]:port` and `?` under @cert-authority were read as fnmatch classes and never matched."""
    _hangdx_agrees_with_openssh(
        sshd, tmp_path, "@cert-authority  {names} {ca_type}\t{ca_b64}", pattern, accepted
    )


@pytest.mark.parametrize(
    "line",
    [
        "@cert-authority {names} {ca_type} {ca_b64}",
        "@cert-authority\t{names}\t{ca_type}\t{ca_b64}",
        "  @cert-authority \t {names}  {ca_type}  {ca_b64}  ",
        "@cert-authority\t{names} {ca_type} {ca_b64}",  # OpenSSH ends the marker at the first space: no marker
        "@cert-authority{names} {ca_type} {ca_b64}",
        "@Cert-Authority {names} {ca_type} {ca_b64}",
    ],
    ids=repr,
)
def test_cert_authority_markers_are_read_as_openssh_reads_them(sshd, tmp_path, line):
    _hangdx_agrees_with_openssh(sshd, tmp_path, line, "[127.0.0.1]:{port}", None)


def _hangdx_agrees_with_openssh(sshd, tmp_path, line: str, pattern: str, accepted: bool | None) -> None:
    ca_type, ca_b64 = (sshd.root / "ca.pub").read_text().split()[:2]

    def known_hosts(name: str, port: int) -> Path:
        path = tmp_path / name
        names = pattern.format(port=port, rest=str(port)[1:])
        path.write_text(line.format(names=names, ca_type=ca_type, ca_b64=ca_b64) + "\n")
        return path

    # The reference: the real client against the same server (both ports offer the same certified host key).
    openssh = _openssh_accepts(sshd, known_hosts("reference", sshd.main_port), sshd.main_port)
    if accepted is None:
        accepted = openssh
    assert openssh is accepted
    kh = known_hosts("known_hosts", sshd.record_port)
    sshd.command_log.unlink(missing_ok=True)
    doc = probe_host(
        sshd.host(port=sshd.record_port), sshd.settings(known_hosts=str(kh)), b"true", _deadline()
    )
    if accepted:
        assert sshd.command_log.exists(), doc.get("problem")
    else:
        assert _problem(doc)[0] == "host_key_unknown" and not sshd.command_log.exists()


def test_a_host_only_a_cert_authority_covers_is_reached_on_its_host_certificate(sshd, tmp_path, fake_job):
    """Issue 10.8: a site with an SSH CA lists the CA, not each host; the host's certificate is checked."""
    ca_type, ca_b64 = (sshd.root / "ca.pub").read_text().split()[:2]
    kh = tmp_path / "known_hosts"
    kh.write_text(f"@cert-authority * {ca_type} {ca_b64}\n")
    job_id, _ = fake_job
    script = collector_script(job_id, samples=1, interval=0.1, hardware=False)
    doc = probe_host(sshd.host(), sshd.settings(known_hosts=str(kh)), script, _deadline())
    assert "problem" not in doc, doc.get("problem")
    assert doc["job_id"] == job_id
    assert {a["rank"] for a in doc["artifacts"] if a["kind"] == "pyspy"} == {0, 1}, doc["errors"]
    assert kh.read_text() == f"@cert-authority * {ca_type} {ca_b64}\n"  # nothing added


def test_a_certificate_from_an_authority_not_listed_for_the_host_is_refused(sshd, tmp_path):
    other_type, other_b64 = _keygen(tmp_path / "other_ca")
    ca_type, ca_b64 = (sshd.root / "ca.pub").read_text().split()[:2]
    kh = tmp_path / "known_hosts"
    # The real CA is listed, but only for other hosts; an unrelated CA covers this one.
    kh.write_text(
        f"@cert-authority *.elsewhere.example {ca_type} {ca_b64}\n@cert-authority * {other_type} {other_b64}\n"
    )
    sshd.command_log.unlink(missing_ok=True)
    doc = probe_host(sshd.host(port=sshd.record_port), sshd.settings(known_hosts=str(kh)), b"", _deadline())
    kind, message = _problem(doc)
    assert kind == "host_key_unknown", message
    assert _fingerprint(sshd.root / "ca.pub") in message and "no @cert-authority line lists" in message
    assert not sshd.command_log.exists()


def test_a_revoked_certificate_authority_is_refused(sshd, tmp_path):
    ca_type, ca_b64 = (sshd.root / "ca.pub").read_text().split()[:2]
    kh = tmp_path / "known_hosts"
    kh.write_text(f"@cert-authority * {ca_type} {ca_b64}\n@revoked * {ca_type} {ca_b64}\n")
    doc = probe_host(sshd.host(), sshd.settings(known_hosts=str(kh)), b"", _deadline())
    kind, message = _problem(doc)
    assert kind == "host_key_unknown" and "marked @revoked" in message, message


def test_a_plain_host_key_is_not_enough_where_only_a_ca_covers_the_host(tmp_path):
    from hangdx.probes import host_certificate

    _keygen(tmp_path / "ca")
    _keygen(tmp_path / "host")
    key = paramiko.Ed25519Key.from_private_key_file(str(tmp_path / "host"))
    ca = _public_key(tmp_path / "ca.pub")
    said = host_certificate.check(key, ["127.0.0.1"], [ca], set())
    assert said == "the server offered a plain host key, not a certificate"


@pytest.mark.parametrize(
    "principals, validity, host, why",
    [
        ("127.0.0.1", "-5m:+1h", True, None),
        ("node-b,10.0.0.7", "-5m:+1h", True, "names node-b, 10.0.0.7, not 127.0.0.1 or node-a"),
        ("127.0.0.1", "-2h:-1h", True, "expired at"),
        ("127.0.0.1", "+1h:+2h", True, "not valid yet"),
        ("127.0.0.1", "-5m:+1h", False, "is not a host certificate"),
    ],
)
def test_a_host_certificate_is_checked_as_ssh_checks_it(tmp_path, principals, validity, host, why):
    from hangdx.probes import host_certificate

    _keygen(tmp_path / "ca")
    _keygen(tmp_path / "host")
    cert = _sign_host_key(tmp_path / "ca", tmp_path / "host.pub", principals, validity, host)
    key = paramiko.Ed25519Key.from_private_key_file(str(tmp_path / "host"))
    key.load_certificate(str(cert))
    ca = _public_key(tmp_path / "ca.pub")
    said = host_certificate.check(key, ["127.0.0.1", "node-a"], [ca], set())
    assert (said is None) if why is None else (why in said), said


def test_a_forged_certificate_does_not_verify(tmp_path):
    from hangdx.probes import host_certificate

    _keygen(tmp_path / "ca")
    _keygen(tmp_path / "host")
    cert = _sign_host_key(tmp_path / "ca", tmp_path / "host.pub", "127.0.0.1")
    kind, b64 = cert.read_text().split()[:2]
    blob = bytearray(base64.b64decode(b64))
    blob[-5] ^= 0x01  # one bit of the CA's signature
    key = paramiko.Ed25519Key.from_private_key_file(str(tmp_path / "host"))
    key.load_certificate(f"{kind} {base64.b64encode(bytes(blob)).decode()}")
    ca = _public_key(tmp_path / "ca.pub")
    said = host_certificate.check(key, ["127.0.0.1"], [ca], set())
    assert said and "forged or damaged" in said


def test_known_hosts_patterns_match_as_openssh_matches_them():
    from hangdx.probes.host_certificate import pattern_matches

    assert pattern_matches(["*.cluster.example"], ["gpu-07.cluster.example"])
    assert pattern_matches(["gpu-0?.cluster.example"], ["GPU-07.cluster.example"])
    assert not pattern_matches(["*.cluster.example", "!gpu-07.cluster.example"], ["gpu-07.cluster.example"])
    assert not pattern_matches(["*.cluster.example"], ["cluster.example.evil"])
    hashed = "|1|" + base64.b64encode(b"saltsaltsaltsaltsalt").decode() + "|"
    import hashlib
    import hmac

    digest = hmac.new(b"saltsaltsaltsaltsalt", b"[127.0.0.1]:2222", hashlib.sha1).digest()
    assert pattern_matches([hashed + base64.b64encode(digest).decode()], ["[127.0.0.1]:2222"])


# -- connecting and authenticating ---------------------------------------------------------------------


def test_closed_port_is_refused(sshd):
    port = _free_port()
    doc = probe_host(sshd.host(port=port), sshd.settings(), b"", _deadline())
    kind, message = _problem(doc)
    assert kind == "refused"
    assert f"{LOOPBACK}:{port}" in message and doc["host"] == "node-a"


def test_unknown_name_is_dns():
    doc = probe_host(HostSpec(name="no-such-node.invalid"), SshSettings(use_agent=False), b"", _deadline())
    kind, message = _problem(doc)
    assert kind == "dns" and "no-such-node.invalid" in message


def test_silent_listener_is_a_connect_timeout(sshd):
    # Accepts TCP (the kernel's backlog) but never speaks SSH: an overloaded or wedged node.
    with socket.socket() as lst:
        lst.bind((LOOPBACK, 0))
        lst.listen(5)
        host = sshd.host(port=lst.getsockname()[1])
        t = time.monotonic()
        doc = probe_host(host, sshd.settings(connect_timeout=1.0), b"", _deadline())
    assert _problem(doc)[0] == "timeout"
    assert time.monotonic() - t < 4


def test_wrong_client_key_is_auth(sshd):
    doc = probe_host(sshd.host(), sshd.settings(key_file=sshd.wrong_key), b"", _deadline())
    kind, message = _problem(doc)
    assert kind == "auth"
    assert "root@" in message and "authorized_keys" in message


def test_missing_key_file_is_auth(sshd, tmp_path):
    doc = probe_host(sshd.host(), sshd.settings(key_file=str(tmp_path / "nope")), b"", _deadline())
    assert _problem(doc)[0] == "auth"


# -- nodes that misbehave ------------------------------------------------------------------------------


def _hang_script(sshd) -> str:
    return _script(
        sshd.root / "hang.sh",
        f"""\
        echo $$ >> {sshd.hang_pids}
        exec sleep 600
        """,
    )


def test_hanging_node_is_hung_within_command_timeout(sshd):
    settings = sshd.settings(python=_hang_script(sshd), command_timeout=2.0)
    t = time.monotonic()
    doc = probe_host(sshd.host(), settings, collector_script("j", 1, 0.1), _deadline())
    took = time.monotonic() - t
    kind, message = _problem(doc)
    assert kind == "hung" and "2s" in message
    assert 2.0 <= took < 5.0


def test_garbage_answer_is_garbage_shown_safely(sshd):
    garbage = _script(
        sshd.root / "garbage.sh",
        """\
        cat > /dev/null
        printf 'Welcome to node!\\033[31m\\nnot json at all\\n'
        """,
    )
    doc = probe_host(sshd.host(), sshd.settings(python=garbage), collector_script("j", 1, 0.1), _deadline())
    kind, message = _problem(doc)
    assert kind == "garbage"
    assert "Welcome to node!" in message
    assert "\\x1b" in message and "\x1b" not in message and "\n" not in message


def test_json_without_marker_is_garbage(sshd):
    other = _script(sshd.root / "json.sh", "cat > /dev/null\necho '{\"hello\": 1}'\n")
    doc = probe_host(sshd.host(), sshd.settings(python=other), b"", _deadline())
    assert _problem(doc)[0] == "garbage"


def test_shell_banner_before_the_document_is_skipped(sshd):
    # A .bashrc that echoes a greeting: the document after it is still read, the noise is noted.
    noisy = _script(sshd.root / "noisy.sh", "echo 'Last login: today'\nexec python3 -\n")
    doc = probe_host(
        sshd.host(), sshd.settings(python=noisy), collector_script("j", 1, 0.1, False), _deadline()
    )
    assert "problem" not in doc, doc.get("problem")
    assert doc["job_id"] == "j"
    assert any("printed 18 bytes before" in e["message"] for e in doc["errors"])


def test_missing_python_says_so(sshd):
    doc = probe_host(sshd.host(), sshd.settings(python="no-such-python3"), b"", _deadline())
    kind, message = _problem(doc)
    assert kind == "error" and "no-such-python3 not found" in message


def test_huge_output_is_cut_fast_and_small(sshd):
    huge = _script(
        sshd.root / "huge.sh",
        """\
        cat > /dev/null
        yes 'hangdx huge output line' | head -c 200000000
        """,
    )
    settings = sshd.settings(python=huge, max_output_bytes=1 << 20)
    tracemalloc.start()
    try:
        t = time.monotonic()
        doc = probe_host(sshd.host(), settings, b"", _deadline())
        took = time.monotonic() - t
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    kind, message = _problem(doc)
    assert kind == "too_large" and str(1 << 20) in message
    assert took < 5.0
    assert peak < 16 << 20  # never anywhere near the 200 MB the node offered


# -- fan-out -------------------------------------------------------------------------------------------


def test_fan_out_five_hosts_two_dead_in_order(sshd):
    closed = _free_port()
    with socket.socket() as silent:
        silent.bind((LOOPBACK, 0))
        silent.listen(5)
        hosts = [
            sshd.host("n1"),
            sshd.host("n2-refuses", port=closed),
            sshd.host("n3"),
            sshd.host("n4-silent", port=silent.getsockname()[1]),
            sshd.host("n5"),
        ]
        settings = sshd.settings(connect_timeout=1.5, deadline=10.0)
        t = time.monotonic()
        docs = fan_out(hosts, settings, "no-such-job", samples=1, interval=0.1, hardware=False)
        took = time.monotonic() - t
    assert [d["host"] for d in docs] == ["n1", "n2-refuses", "n3", "n4-silent", "n5"]
    assert [d.get("problem", {}).get("kind") for d in docs] == [None, "refused", None, "timeout", None]
    assert all(d["transport"] == "ssh" for d in docs)
    assert all(d["job_id"] == "no-such-job" for d in (docs[0], docs[2], docs[4]))
    assert took < settings.deadline


def test_fan_out_deadline_aborts_hung_hosts_and_leaves_no_thread(sshd):
    settings = sshd.settings(python=_hang_script(sshd), command_timeout=60.0, deadline=2.0)
    hosts = [sshd.host(f"h{i}") for i in range(3)]
    t = time.monotonic()
    docs = fan_out(hosts, settings, "j", samples=1, interval=0.1, hardware=False)
    took = time.monotonic() - t
    assert [d["host"] for d in docs] == ["h0", "h1", "h2"]
    assert all(_problem(d)[0] == "hung" for d in docs)
    assert "deadline" in docs[0]["problem"]["message"]
    assert took < settings.deadline + 3
    assert [th.name for th in threading.enumerate() if th.name.startswith("hangdx-ssh")] == []
    assert _transports_alive() == []


def test_fan_out_empty():
    assert fan_out([], SshSettings(), "j") == []


# -- jump host -----------------------------------------------------------------------------------------


def test_through_a_jump_host(sshd):
    bastion = sshd.host("bastion")
    target = sshd.host("node-behind", jump=bastion)
    doc = probe_host(target, sshd.settings(), collector_script("no-such-job", 1, 0.1, False), _deadline())
    assert "problem" not in doc, doc.get("problem")
    assert doc["host"] == "node-behind" and doc["job_id"] == "no-such-job"
    assert _transports_alive() == []  # the target's and the jump host's


def test_jump_host_reports_what_it_sees(sshd):
    closed = _free_port()
    target = sshd.host("node-behind", port=closed, jump=sshd.host("bastion"))
    doc = probe_host(target, sshd.settings(), b"", _deadline())
    kind, message = _problem(doc)
    # OpenSSH answers a failed direct-tcpip with a bare "Connect failed": refused, down and unknown look alike.
    assert kind == "unreachable"
    assert f"jump host bastion could not reach {LOOPBACK}:{closed}" in message
    assert "as seen from the jump host" in message


def test_jump_host_key_is_verified_too(sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    target = sshd.host("node-behind", jump=sshd.host("bastion"))
    doc = probe_host(target, sshd.settings(known_hosts=str(kh)), b"", _deadline())
    kind, message = _problem(doc)
    assert kind == "host_key_unknown" and "jump host bastion" in message


# -- the command line on the node ----------------------------------------------------------------------


def test_remote_command_is_fixed_and_job_id_cannot_inject(sshd, tmp_path):
    pwned = tmp_path / "pwned"
    job_id = f"x'; touch {pwned} #\"$(touch {pwned})`touch {pwned}`"
    sshd.command_log.unlink(missing_ok=True)
    script = collector_script(job_id, samples=1, interval=0.1, hardware=False)
    doc = probe_host(sshd.host(port=sshd.record_port), sshd.settings(), script, _deadline())

    assert "problem" not in doc, doc.get("problem")
    assert sshd.command_log.read_text() == "python3 -"
    assert doc["job_id"] == job_id  # arrived intact, as data
    assert not pwned.exists()


def test_collector_script_is_the_collector_plus_a_trailer():
    script = collector_script("--help", 2, 0.5, hardware=False).decode()
    compile(script, "<collector>", "exec")
    assert script.count('if __name__ == "__main__":') == 1
    assert script.rstrip().endswith(
        """sys.exit(main(json.loads('["--samples", "2", "--interval", "0.5", "--no-hardware", "--", "--help"]')))"""
    )


def test_collector_script_runs_locally_with_a_dash_job_id():
    # The same bytes a node receives, run by a local python3: the job id is data, even "--help".
    script = collector_script("--help", 1, 0.1, hardware=False)
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, timeout=30)
    doc = json.loads(out.stdout)
    assert doc["hangdx_collector"] == 1 and doc["job_id"] == "--help"
