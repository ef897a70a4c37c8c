"""A node that stops answering halfway: a real sshd behind a TCP relay that goes silent once the collector
is half uploaded (the node accepted, authenticated, began, then hung). The diagnosis ends by its deadline
with a verdict naming the silent node, from the evidence of the node that answered; the incident gets
exactly one verdict. Needs root and OpenSSH's sshd (as tests/ssh/test_ssh.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangdx.bot.diagnosis import DiagnoseOptions
from hangdx.bot.incidents import IncidentStore
from hangdx.bot.request import DiagnoseRequest

from .harness import (
    CHANNEL,
    free_port,
    record,
    settle,
    stuck_rq_jobs,
    tally,
    wait_for,
    wait_until,
    wait_verdicts,
)

SSHD = "/usr/sbin/sshd"
DEADLINE = 5.0


class FreezingRelay:
    """Relays TCP to 127.0.0.1:`port` until the client has sent `after` bytes, then relays nothing more,
    either way, and keeps the connection open: a peer that went silent mid-session."""

    def __init__(self, port: int, after: int) -> None:
        self.target, self.after = port, after
        self.sent = 0
        self.frozen = threading.Event()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._socks.append(self.listener)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while not self.frozen.is_set():
                data = src.recv(65536)
                if not data or self.frozen.is_set():
                    return
                if counted and self.sent + len(data) >= self.after:
                    dst.sendall(data[: self.after - self.sent])
                    self.sent = self.after
                    self.frozen.set()
                    return
                dst.sendall(data)
                if counted:
                    self.sent += len(data)
        except OSError:
            return

    def close(self) -> None:
        self._stop.set()
        for s in self._socks:
            s.close()


def _keygen(path: Path) -> list[str]:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().split()[:2]


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[dict]:
    if os.geteuid() != 0:
        pytest.skip("needs root: sshd's privilege separation and a root login on 127.0.0.1")
    if not os.access(SSHD, os.X_OK) or not shutil.which("ssh-keygen"):
        pytest.skip(f"{SSHD} not installed (apt-get install -y openssh-server)")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    root = tmp_path / "sshd"
    root.mkdir()
    key_type, key_b64 = _keygen(root / "host_key")
    _keygen(root / "client_key")
    (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
    port = free_port()
    beside = Path(sys.executable).parent  # this python3 and the py-spy pip put beside it
    path = f"{beside}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    (root / "sshd_config").write_text(
        textwrap.dedent(
            f"""\
            ListenAddress 127.0.0.1
            Port {port}
            HostKey {root / "host_key"}
            PidFile {root / "sshd.pid"}
            AuthorizedKeysFile {root / "authorized_keys"}
            PermitRootLogin prohibit-password
            StrictModes no
            UsePAM no
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            SetEnv PATH={path}
            """
        )
    )
    log = open(root / "sshd.log", "wb")
    proc = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(root / "sshd_config")], stdout=log, stderr=subprocess.STDOUT
    )

    def listening() -> bool:
        if proc.poll() is not None:
            pytest.skip(f"sshd did not start: {(root / 'sshd.log').read_text()[-300:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    relay = None
    try:
        wait_for("sshd to listen", listening, timeout=10)
        # The silent node: the same sshd behind a relay that stops halfway through the 30 kB collector upload.
        relay = FreezingRelay(port, after=12000)
        (root / "known_hosts").write_text(
            f"[127.0.0.1]:{port} {key_type} {key_b64}\n[127.0.0.1]:{relay.port} {key_type} {key_b64}\n"
        )
        yield {"root": root, "port": port, "relay": relay}
    finally:
        if relay is not None:
            relay.close()
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_a_node_that_goes_silent_halfway_is_named_by_the_one_verdict_at_the_deadline(
    bot, ranks, sshd, record_property
):
    root, relay = sshd["root"], sshd["relay"]
    job = ranks.job(f"silent-{uuid.uuid4().hex[:6]}", ranks=(0, 1), world=3)  # ranks 0, 1 on node-a
    inventory = root / "inventory.yaml"
    inventory.write_text(
        textwrap.dedent(
            f"""\
            ssh: {{user: root, key_file: {root / "client_key"}, known_hosts: {root / "known_hosts"},
                  use_agent: false}}
            hosts:
              node-a: {{address: 127.0.0.1, port: {sshd["port"]}}}
              node-b: {{address: 127.0.0.1, port: {relay.port}}}
            jobs:
              "{job}": [node-a, node-b]
            """
        )
    )
    bot.workers(1)
    opts = DiagnoseOptions(how=f"inventory:{inventory}", samples=1, interval=0, deadline=DEADLINE)
    service = bot.service(opts)
    started = time.monotonic()
    service.submit(DiagnoseRequest(job_id=job, source="alert", requested_by="alertmanager", channel=CHANNEL))
    wait_verdicts(bot.slack, bot.conn, [job], timeout=60)
    wait_until(lambda: stuck_rq_jobs(bot.conn) == 0, 30)
    settle(1.5)
    counts = tally(bot.conn, bot.slack, [job])
    record(record_property, counts)
    assert relay.frozen.is_set() and relay.sent == 12000  # node-b went silent after the SSH handshake
    assert counts == {**counts, "incidents": 1, "threads": 1, "verdict_posts": 1, "verdicts": 1}
    assert counts["lost"] == 0 and counts["doubled"] == 0 and counts["stuck"] == 0

    v = IncidentStore(bot.conn).get(job).latest_verdict
    rc = v["root_cause"]
    assert v["status"] == "hung" and rc["category"] == "rank_crashed"
    assert rc["culprit"]["hosts"] == ["node-b"] and rc["culprit"]["ranks"] == [2]
    assert rc["summary"].startswith("Host node-b did not answer (hung)")
    quotes = [q for f in v["findings"] for q in f["evidence"] if q["source"] == "node-b/ssh"]
    assert quotes and "deadline" in quotes[0]["text"]
    # The diagnosis ended by its deadline (not the 60 s command timeout), with the evidence node-a gave.
    assert v["elapsed_seconds"] < DEADLINE + 5 and time.monotonic() - started < 60
    assert any(
        "sleep" in q["text"] or "train_step" in q["text"] for f in v["findings"] for q in f["evidence"]
    )
