"""SSH transport: runs the node-side collector on every host at once, with host keys always verified.

The remote command is the fixed string `<settings.python> -`; the collector's source and its
arguments (the job id among them) travel on stdin, so no user text ever reaches a remote shell.
Every failure becomes a problem document naming what happened and how to fix it; nothing raises.
"""

from __future__ import annotations

import errno
import getpass
import json
import logging
import os
import re
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paramiko

from hangdx.probes import collector, host_certificate
from hangdx.probes.hosts import HostSpec, SshSettings
from hangdx.probes.rx import lazy

STDERR_CAP = 64 * 1024
CHUNK = 64 * 1024
GRACE = 2.0  # after the deadline: how long aborted probes get to wind down
MAX_HOPS = 8
_MAIN_GUARD = lazy(r"\n+if __name__ == [\"']__main__[\"']:\n(?:[ \t]+[^\n]*\n)*(?:[ \t]+[^\n]*)?\Z")

# paramiko logs a traceback for every failed handshake; without a handler Python's last-resort
# handler would print them on the user's terminal, next to the one-line problem we report instead.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class _Problem(Exception):
    """Why a host could not be probed: a HostProblem kind and a one-line message."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def collector_script(
    job_id: str, samples: int, interval: float, hardware: bool = True, host: str | None = None
) -> bytes:
    """The collector's source plus a trailer calling main() with these arguments, for `python3 -`."""
    source = Path(collector.__file__).read_text(encoding="utf-8")
    source = _MAIN_GUARD.sub("\n", source)  # its own guard would call main() with no arguments
    args = ["--samples", str(int(samples)), "--interval", repr(float(interval))]
    if not hardware:
        args.append("--no-hardware")
    if host:
        args += ["--host", host]  # name the node as the user does, in every artifact it returns
    args += ["--", job_id]  # "--": a job id starting with "-" is still the job id
    # json.dumps is pure ASCII; repr() of it is a plain Python string literal: nothing to escape by hand.
    literal = repr(json.dumps(args))
    trailer = f'\n\nif __name__ == "__main__":\n    sys.exit(main(json.loads({literal})))\n'
    return (source.rstrip("\n") + trailer).encode("utf-8")


def problem_doc(name: str, kind: str, message: str) -> dict:
    """The document of a host that could not be probed."""
    return {
        "hangdx_collector": 1,
        "host": name,
        "artifacts": [],
        "errors": [{"source": "ssh", "message": message}],
        "problem": {"kind": kind, "message": message},
        "transport": "ssh",
    }


def _one_line(text: object, limit: int = 300) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _show(data: bytes) -> str:
    """Bytes from a node, printable on one line whatever they hold (escapes, controls, bidi marks)."""
    return repr(data.decode("utf-8", "replace"))


def _hostport(spec: HostSpec) -> str:
    addr = spec.connect_to
    if ":" in addr:
        addr = f"[{addr}]"
    return addr if spec.port == 22 else f"{addr}:{spec.port}"


def _known_hosts_name(spec: HostSpec) -> str:
    return spec.connect_to if spec.port == 22 else f"[{spec.connect_to}]:{spec.port}"


def _fingerprint(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


class KnownHosts:
    """A known_hosts file as OpenSSH reads it: plain and hashed entries, `@revoked` keys (refused whoever
    offers them) and `@cert-authority` lines (a host they cover is accepted on a valid host certificate)."""

    def __init__(self) -> None:
        self.entries: list[tuple[list[str], paramiko.PKey]] = []
        self.revoked: set[tuple[str, str]] = set()  # (key type, base64)
        self.cert_authorities: list[tuple[list[str], paramiko.PKey]] = []

    @classmethod
    def read(cls, path: str) -> KnownHosts:
        kh = cls()
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                kh._line(line.strip())
        return kh

    def _line(self, line: str) -> None:
        # Fields are separated by any run of spaces and tabs, as OpenSSH's hostfile.c reads them; paramiko's own
        # parser wants exactly one space and would drop `@revoked  * KEY`.
        line = line.strip(" \t\r\n")
        if not line or line.startswith("#"):
            return
        marker = None
        if line.startswith("@"):
            marker = _marker(line)
            if marker is None and re.match(r"@revoked[ \t]", line):
                # OpenSSH's check_markers() ends a marker at the first space when the line has one (so
                # `@revoked\t* KEY` is no marker to it, and the line is skipped); refusing that key is the
                # safe reading of what the administrator wrote.
                marker = "@revoked"
            if marker is None:
                return  # an unknown or malformed marker: OpenSSH skips the line
            line = re.split(r"[ \t]+", line, maxsplit=1)[1] if re.search(r"[ \t]", line) else ""
        fields = [f for f in re.split(r"[ \t]+", line) if f]
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(" ".join(fields))
        except (paramiko.SSHException, paramiko.hostkeys.InvalidHostKey, ValueError, TypeError):
            return  # a line OpenSSH would skip too: it breaks no other host
        if entry is None or entry.key is None:
            return
        if marker == "@revoked":
            self.revoked.add((entry.key.get_name(), entry.key.get_base64()))
        elif marker == "@cert-authority":
            self.cert_authorities.append((entry.hostnames, entry.key))
        elif marker is None:
            self.entries.append((entry.hostnames, entry.key))

    def install(self, client: paramiko.SSHClient) -> None:
        keys = client.get_host_keys()
        for names, key in self.entries:
            if (key.get_name(), key.get_base64()) in self.revoked:
                continue
            for name in names:
                keys.add(name, key.get_name(), key)

    def is_revoked(self, key: paramiko.PKey) -> bool:
        return (key.get_name(), key.get_base64()) in self.revoked

    def authorities_for(self, names: list[str]) -> list[paramiko.PKey]:
        """The CA keys of the @cert-authority lines whose patterns cover any of these names."""
        return [
            key
            for patterns, key in self.cert_authorities
            if host_certificate.pattern_matches(patterns, names)
        ]


def _marker(line: str) -> str | None:
    """The marker of a known_hosts line as OpenSSH's check_markers() finds it: up to the first space, else the
    first tab; None unless it is exactly @cert-authority or @revoked."""
    end = line.find(" ")
    if end < 0:
        end = line.find("\t")
    marker = line[:end] if end > 1 else ""
    return marker if marker in ("@cert-authority", "@revoked") else None


def _lookup_names(spec: HostSpec, certificate: bool = False) -> list[str]:
    """The names known_hosts patterns are matched against: the address hangdx connects to, as OpenSSH writes
    it, and the node's name as the operator gives it (an inventory maps names to addresses). For a host
    certificate on another port than 22, OpenSSH also tries the names without the port ("found matching key
    w/out port"), so an `@cert-authority gpu-07 ...` line covers gpu-07 on every port."""
    names = [_known_hosts_name(spec)]
    if spec.name != spec.connect_to:
        names.append(spec.name if spec.port == 22 else f"[{spec.name}]:{spec.port}")
    if certificate and spec.port != 22:
        names += [spec.connect_to] + ([spec.name] if spec.name != spec.connect_to else [])
    return names


class _RejectUnknown(paramiko.RejectPolicy):
    """RejectPolicy that says which key was offered and how to verify it."""

    def __init__(
        self,
        label: str,
        spec: HostSpec,
        known_hosts: str,
        known_hosts_missing: bool,
        kh: KnownHosts | None = None,
    ):
        self.label, self.spec, self.known_hosts, self.missing = label, spec, known_hosts, known_hosts_missing
        self.kh = kh or KnownHosts()

    def missing_host_key(self, client, hostname, key):
        spec = self.spec
        if self.kh.is_revoked(key):
            raise _Problem(
                "host_key_changed",
                f"{self.label}: {_hostport(spec)} offers {_fingerprint(key)}, a key marked @revoked in "
                f"{self.known_hosts}; nothing was run",
            )
        authorities = self.kh.authorities_for(_lookup_names(spec, certificate=True))
        if authorities:
            why = host_certificate.check(key, [spec.connect_to, spec.name], authorities, self.kh.revoked)
            if why is None:
                return  # a valid host certificate from a listed authority: accepted, never saved
            raise _Problem(
                "host_key_unknown",
                f"{self.label}: {_hostport(spec)} is covered by @cert-authority lines in {self.known_hosts}, "
                f"but {why}; nothing was run. Fix: re-issue the host certificate (`ssh-keygen -s CA -h -n "
                f"{spec.connect_to} ...`, `HostCertificate` in sshd_config), or add the host's own key line",
            )
        port = "" if spec.port == 22 else f"-p {spec.port} "
        where = f"{self.known_hosts} (which does not exist)" if self.missing else self.known_hosts
        raise _Problem(
            "host_key_unknown",
            f"{self.label}: the host key of {_hostport(spec)} is not in {where}; the server offers "
            f"{_fingerprint(key)}; nothing was run. Fix: `ssh-keyscan {port}{spec.connect_to}`, check that "
            f"fingerprint out of band (`ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub` on the node's console), "
            f"then append the line to {self.known_hosts}",
        )


def _asking_for_certificates(*args, **kwargs) -> paramiko.Transport:
    """A transport that asks the server for a host certificate first, its plain keys after."""
    transport = paramiko.Transport(*args, **kwargs)
    options = transport.get_security_options()
    options.key_types = host_certificate.CERT_KEY_TYPES + tuple(options.key_types)
    return transport


class _Probe:
    """One host's collector run, abortable from another thread by closing its connections."""

    def __init__(self, host: HostSpec, settings: SshSettings, script: bytes, deadline: float):
        self.host, self.settings, self.script, self.deadline = host, settings, script, deadline
        self.phase = "waiting for its turn"
        self.aborted = False
        self._open: list = []  # sockets and SSH clients, closed at the end or on abort
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------------

    def run(self) -> dict:
        started = time.monotonic()
        name = self.host.name
        try:
            if started >= self.deadline:
                raise _Problem("hung", f"{name}: not probed: the deadline passed before its turn")
            doc = self._collect()
        except _Problem as p:
            doc = problem_doc(name, p.kind, _one_line(p.message, 1000))
        except Exception as e:  # a transport must not take the whole fan-out down
            doc = problem_doc(
                name, "error", f"{name}: unexpected {type(e).__name__} while {self.phase}: {_one_line(e)}"
            )
        finally:
            self.close()
        doc["elapsed"] = round(time.monotonic() - started, 3)
        return doc

    def _track(self, thing):
        with self._lock:
            self._open.append(thing)
            aborted = self.aborted
        if aborted:
            self.close()
            raise _Problem("hung", f"{self.host.name}: aborted at the deadline while {self.phase}")
        return thing

    def close(self) -> None:
        with self._lock:
            things, self._open = self._open[::-1], []
        for thing in things:  # the target before its jump host: the tunnel outlives what runs in it
            try:
                thing.close()
            except Exception:
                pass

    def abort(self) -> None:
        """Stop a straggler: closing its transports wakes every blocked read with an error."""
        with self._lock:
            self.aborted = True
        self.close()

    def _left(self, limit: float) -> float:
        return max(0.1, min(limit, self.deadline - time.monotonic()))

    # -- connecting ------------------------------------------------------------------------------------

    def _collect(self) -> dict:
        hops, spec = [], self.host
        while spec is not None:
            if len(hops) == MAX_HOPS:
                raise _Problem("error", f"{self.host.name}: more than {MAX_HOPS} jump hosts (a loop?)")
            hops.insert(0, spec)
            spec = spec.jump
        sock = None
        client = None
        for i, hop in enumerate(hops):
            label = self.host.name if hop is self.host else f"{self.host.name}: jump host {hop.name}"
            if sock is None:
                sock = self._tcp(hop, label)
            client = self._ssh(hop, sock, label)
            if i + 1 < len(hops):
                sock = self._tunnel(client, hop, hops[i + 1], label)
        return self._run(client)

    def _tcp(self, spec: HostSpec, label: str) -> socket.socket:
        self.phase = f"connecting to {_hostport(spec)}"
        timeout = self._left(self.settings.connect_timeout)
        try:
            infos = socket.getaddrinfo(spec.connect_to, spec.port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise _Problem(
                "dns",
                f"{label}: cannot resolve {spec.connect_to!r} ({e.strerror}); fix: check the name, "
                f"or give the node's address in the inventory",
            ) from None
        except (UnicodeError, ValueError) as e:
            raise _Problem("dns", f"{label}: {spec.connect_to!r} is not a usable host name ({e})") from None
        failure: OSError | None = None
        for family, kind, proto, _, addr in infos:
            s = self._track(socket.socket(family, kind, proto))
            s.settimeout(timeout)
            try:
                s.connect(addr)
                return s
            except OSError as e:
                failure = e
                s.close()
        raise self._connect_problem(failure, spec, label, timeout)

    def _connect_problem(self, e: OSError | None, spec: HostSpec, label: str, timeout: float) -> _Problem:
        where = _hostport(spec)
        if isinstance(e, ConnectionRefusedError):
            return _Problem(
                "refused",
                f"{label}: {where} refused the connection: nothing listens on port {spec.port} "
                f"(sshd down or on another port?); fix: check sshd on the node, or the port in the inventory",
            )
        if isinstance(e, TimeoutError):
            return _Problem(
                "timeout",
                f"{label}: no answer from {where} within {timeout:.0f}s (node down, firewalled, or a wrong "
                f"address); fix: check that the node is up and reachable from here",
            )
        if e is not None and e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return _Problem(
                "unreachable", f"{label}: {where} is unreachable ({e.strerror}): node down or no route"
            )
        detail = e.strerror or str(e) if e is not None else "no address"
        return _Problem("error", f"{label}: cannot connect to {where}: {_one_line(detail)}")

    def _ssh(self, spec: HostSpec, sock, label: str) -> paramiko.SSHClient:
        s = self.settings
        self.phase = f"opening SSH to {_hostport(spec)}"
        client = self._track(paramiko.SSHClient())
        missing = False
        kh = KnownHosts()
        try:
            kh = KnownHosts.read(s.known_hosts)
        except FileNotFoundError:
            missing = True
        except OSError as e:
            raise _Problem(
                "error", f"{label}: cannot read known_hosts {s.known_hosts}: {e.strerror}"
            ) from None
        kh.install(client)
        factory = None
        if kh.authorities_for(_lookup_names(spec, certificate=True)) and not client.get_host_keys().lookup(
            _known_hosts_name(spec)
        ):
            factory = (
                _asking_for_certificates  # only a CA vouches for this host: have it show its certificate
            )
        # Never AutoAddPolicy and never save_host_keys: an unknown (or revoked) key stops the run.
        client.set_missing_host_key_policy(_RejectUnknown(label, spec, s.known_hosts, missing, kh))
        key = spec.key_file or s.key_file
        if key and not os.access(key, os.R_OK):
            raise _Problem("auth", f"{label}: key file {key} does not exist or is not readable")
        user = spec.user or s.user or getpass.getuser()
        timeout = self._left(s.connect_timeout)
        started = time.monotonic()
        try:
            client.connect(
                spec.connect_to,
                port=spec.port,
                username=user,
                key_filename=key,
                allow_agent=s.use_agent and not key,
                look_for_keys=not key,
                # A little over banner_timeout, so a missing banner is reported as such, not as "no session".
                timeout=timeout + 1.0,
                sock=sock,
                banner_timeout=timeout,
                auth_timeout=timeout,
                channel_timeout=timeout,
                transport_factory=factory,
            )
        except _Problem:
            raise
        except paramiko.BadHostKeyException as e:
            raise _Problem(
                "host_key_changed",
                f"{label}: the host key of {_hostport(spec)} CHANGED: {s.known_hosts} has "
                f"{_fingerprint(e.expected_key)}, the server offers {_fingerprint(e.key)}; possible "
                f"man-in-the-middle (or the node was reinstalled); nothing was run. Fix: verify the new key "
                f"out of band, then `ssh-keygen -R '{_known_hosts_name(spec)}' -f {s.known_hosts}` and add "
                f"the verified key",
            ) from None
        except paramiko.PasswordRequiredException:
            raise _Problem(
                "auth", f"{label}: key file {key} is passphrase-protected; fix: load it into ssh-agent"
            ) from None
        except paramiko.BadAuthenticationType as e:
            raise _Problem(
                "auth",
                f"{label}: {user}@{_hostport(spec)} accepts only {', '.join(e.allowed_types)} (hangdx uses "
                f"keys); fix: allow publickey for {user}",
            ) from None
        except paramiko.AuthenticationException:
            offered = f"key file {key}" if key else "the ssh-agent's and ~/.ssh/id_* keys"
            raise _Problem(
                "auth",
                f"{label}: {user}@{_hostport(spec)} refused {offered}; fix: add the public key to "
                f"~{user}/.ssh/authorized_keys on the node, or set the right user/key_file",
            ) from None
        except paramiko.SSHException as e:
            raise self._ssh_problem(e, spec, label, user, timeout, time.monotonic() - started) from None
        except TimeoutError:  # socket.timeout is TimeoutError
            raise _Problem(
                "timeout", f"{label}: {_hostport(spec)} stopped answering during the SSH handshake"
            ) from None
        except (EOFError, OSError) as e:
            raise _Problem(
                "error",
                f"{label}: {_hostport(spec)} dropped the connection during the SSH handshake ({_one_line(e) or type(e).__name__})",
            ) from None
        return client

    def _ssh_problem(
        self, e: Exception, spec: HostSpec, label: str, user: str, timeout: float, took: float
    ) -> _Problem:
        text = _one_line(e)
        if self.aborted:
            return _Problem("hung", f"{label}: aborted at the deadline while {self.phase}")
        if "No authentication methods available" in text:
            return _Problem(
                "auth",
                f"{label}: no key to offer {user}@{_hostport(spec)}: no key_file, no ssh-agent key and no "
                f"~/.ssh/id_* key; fix: set key_file or start ssh-agent",
            )
        if "banner" in text.lower():
            # paramiko words a banner timeout and a closed connection alike: tell them apart by the clock.
            if took >= timeout * 0.9:
                return _Problem(
                    "timeout",
                    f"{label}: {_hostport(spec)} accepted the connection but sent no SSH greeting within "
                    f"{timeout:.0f}s (sshd overloaded, or not sshd on that port)",
                )
            return _Problem(
                "error",
                f"{label}: {_hostport(spec)} closed the connection or does not speak SSH ({text}); fix: check "
                f"sshd's log on the node (MaxStartups? a firewall?) and the port in the inventory",
            )
        if "No existing session" in text:
            # paramiko's start_client() gives up silently at its timeout; connect() then finds no session.
            return _Problem(
                "timeout",
                f"{label}: {_hostport(spec)} accepted the connection but the SSH handshake did not finish "
                f"within {timeout:.0f}s (sshd overloaded or wedged, or not sshd on that port)",
            )
        if "timed out" in text.lower():
            return _Problem(
                "timeout", f"{label}: SSH negotiation with {_hostport(spec)} timed out after {timeout:.0f}s"
            )
        return _Problem("error", f"{label}: SSH to {_hostport(spec)} failed: {text}")

    def _tunnel(self, client: paramiko.SSHClient, jump: HostSpec, target: HostSpec, label: str):
        """A direct-tcpip channel from the jump host to the next hop, used as that hop's socket."""
        self.phase = f"opening a tunnel through {jump.name} to {_hostport(target)}"
        where = f"{self.host.name}: jump host {jump.name} could not reach {_hostport(target)}"
        try:
            chan = client.get_transport().open_channel(
                "direct-tcpip",
                (target.connect_to, target.port),
                ("127.0.0.1", 0),
                timeout=self._left(self.settings.connect_timeout),
            )
        except paramiko.ChannelException as e:
            reason = _one_line(e.text)
            if e.code == paramiko.common.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED:
                raise _Problem(
                    "error",
                    f"{where}: the jump host forbids TCP forwarding ({reason}); fix: AllowTcpForwarding yes",
                ) from None
            low = reason.lower()
            kind = (
                "refused"
                if "refused" in low
                else "dns"
                if "resolve" in low or "name or service" in low
                else "timeout"
                if "timed out" in low
                else "unreachable"
            )
            raise _Problem(
                kind,
                f"{where} ({reason}, as seen from the jump host): the node is down, nothing listens on port "
                f"{target.port}, or its name does not resolve there",
            ) from None
        except paramiko.SSHException as e:
            if self.aborted:
                raise _Problem("hung", f"{label}: aborted at the deadline while {self.phase}") from None
            raise _Problem("timeout", f"{where}: {_one_line(e)}") from None
        except (EOFError, OSError) as e:
            raise _Problem("error", f"{where}: {_one_line(e) or type(e).__name__}") from None
        return self._track(chan)

    # -- running the collector -------------------------------------------------------------------------

    def _run(self, client: paramiko.SSHClient) -> dict:
        s, name = self.settings, self.host.name
        command = f"{s.python} -"  # fixed: the job id travels inside the script, on stdin
        self.phase = "starting the collector"
        now = time.monotonic()
        end = min(now + s.command_timeout, self.deadline)
        limit = (
            f"within {s.command_timeout:.0f}s"
            if now + s.command_timeout <= self.deadline
            else f"by the deadline ({end - now:.0f}s left for it)"
        )
        hung = _Problem(
            "hung",
            f"{name}: the collector started but did not answer {limit} (node overloaded, or stuck in the "
            f"kernel: py-spy or /proc reads in D state?); fix: look at the node's console, or raise "
            f"command_timeout",
        )
        try:
            chan = self._track(client.get_transport().open_session(timeout=self._left(s.connect_timeout)))
            chan.settimeout(max(0.1, end - time.monotonic()))  # bounds sendall on a node that never reads
            chan.exec_command(command)
            chan.sendall(self.script)
            chan.shutdown_write()
        except TimeoutError:  # socket.timeout is TimeoutError
            raise hung from None
        except (paramiko.SSHException, EOFError, OSError) as e:
            if self.aborted:
                raise _Problem("hung", f"{name}: aborted at the deadline while {self.phase}") from None
            raise _Problem(
                "error", f"{name}: could not start {command!r}: {_one_line(e) or type(e).__name__}"
            ) from None

        self.phase = "running the collector"
        out = bytearray()
        err = bytearray()

        def drain() -> None:
            while chan.recv_stderr_ready():
                err.extend(chan.recv_stderr(CHUNK))
                if len(err) > STDERR_CAP:  # keep the tail: the last line is the one that explains
                    del err[: len(err) - STDERR_CAP]
            while chan.recv_ready():
                data = chan.recv(CHUNK)
                if not data:
                    break
                out.extend(data)
                if len(out) > s.max_output_bytes:
                    raise _Problem(
                        "too_large",
                        f"{name}: the node sent more than {s.max_output_bytes} bytes; reading stopped there. "
                        f"Fix: raise max_output_bytes, or look for a huge log file the collector picked up",
                    )

        while True:
            drain()
            if chan.eof_received or chan.closed:
                drain()
                break
            left = end - time.monotonic()
            if left <= 0:
                raise hung
            if self.aborted:
                raise _Problem("hung", f"{name}: aborted at the deadline while {self.phase}")
            select.select([chan], [], [], min(0.5, left))
        if self.aborted:  # abort() closed the channel under us: what was read is partial
            raise _Problem("hung", f"{name}: aborted at the deadline while {self.phase}")
        # EOF first, exit status right after: wait briefly for it.
        wait_end = min(end, time.monotonic() + 2.0)
        while not chan.exit_status_ready() and not chan.closed and time.monotonic() < wait_end:
            time.sleep(0.02)
        status = chan.recv_exit_status() if chan.exit_status_ready() else None
        drain()
        return self._document(bytes(out), bytes(err), status, command)

    def _document(self, out: bytes, err: bytes, status: int | None, command: str) -> dict:
        name = self.host.name
        err_lines = [ln.strip() for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
        last_err = _one_line(err_lines[-1]) if err_lines else None
        doc = _parse(out)
        noise = 0
        if doc is None:
            # A shell startup file (.bashrc) printing a banner before the collector's output. The document is
            # the last thing printed (a banner may itself hold the marker; inside the document it cannot
            # appear again, since JSON escapes every quote in a string).
            at = out.rfind(b'{"hangdx_collector"')
            if at > 0:
                doc, noise = _parse(out[at:]), at
        if doc is None:
            if not out.strip() and status is None:
                raise _Problem(
                    "error",
                    f"{name}: the connection closed before the collector answered, with no exit status "
                    f"(killed by a signal, out of memory, or sshd went away?)"
                    + (f"; stderr: {last_err}" if last_err else ""),
                )
            if not out.strip() and status != 0:
                if status == 127:
                    raise _Problem(
                        "error",
                        f"{name}: {command!r} failed: {self.settings.python} not found on the node ({last_err}); "
                        f"fix: install Python >= 3.8 there, or set the python setting to its path",
                    )
                raise _Problem(
                    "error",
                    f"{name}: {command!r} failed with exit status {status}: {last_err or 'no message'}"
                    f" (the node needs Python >= 3.8 as {self.settings.python!r})",
                )
            if not out.strip():
                raise _Problem(
                    "garbage",
                    f"{name}: the node answered nothing (exit status {status}"
                    + (f", stderr: {last_err})" if last_err else ")"),
                )
            raise _Problem(
                "garbage",
                f"{name}: the node answered something that is not a collector document ({len(out)} bytes, "
                f"exit status {status}), starting {_show(out[:200])}"
                + (f"; stderr: {last_err}" if last_err else "")
                + "; fix: check what the node runs for a non-interactive SSH command (ForceCommand, .bashrc)",
            )
        doc.setdefault("node_hostname", doc.get("host"))
        doc["host"] = name  # what the user called it, not what the node calls itself
        doc["transport"] = "ssh"
        if not isinstance(doc.get("errors"), list):
            doc["errors"] = []
        if noise:
            doc["errors"].append(
                {
                    "source": "ssh",
                    "message": f"{name}: the node printed {noise} bytes before the collector's output "
                    f"(a shell startup file writing to stdout?): ignored",
                }
            )
        if status not in (0, None):
            doc["errors"].append(
                {"source": "ssh", "message": f"{name}: the collector exited with status {status}: {last_err}"}
            )
        return doc


def _parse(out: bytes) -> dict | None:
    try:
        doc = json.loads(out)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and "hangdx_collector" in doc else None


def probe_host(host: HostSpec, settings: SshSettings, script: bytes, deadline: float) -> dict:
    """One collector document for `host`; `deadline` is a time.monotonic() instant. Never raises."""
    return _Probe(host, settings, script, deadline).run()


def _deadline_doc(probe: _Probe, settings: SshSettings) -> dict:
    name = probe.host.name
    if probe.phase == "waiting for its turn":
        message = f"{name}: not probed: the {settings.deadline:.0f}s deadline passed before its turn (raise concurrency or deadline)"
    else:
        message = (
            f"{name}: no answer by the {settings.deadline:.0f}s deadline while {probe.phase}; the node may be "
            f"hung or overloaded; fix: look at the node's console, or raise the deadline"
        )
    doc = problem_doc(name, "hung", message)
    doc["elapsed"] = settings.deadline
    return doc


def fan_out(
    hosts: list[HostSpec],
    settings: SshSettings,
    job_id: str,
    samples: int = 3,
    interval: float = 0.7,
    hardware: bool = True,
    progress: Callable[[int, int], None] | None = None,
    script: Callable[[HostSpec], bytes] | None = None,
) -> list[dict]:
    """One collector document per host, in input order, all hosts at once; never past the deadline.

    `progress(done, total)` is called as hosts report (from the fan-out's threads; keep it quick).
    `script(host)`, when given, is the program each host runs instead of the collector (`hangdx doctor`'s
    checks); like the collector, it prints one JSON document with a "hangdx_collector" key."""
    if not hosts:
        return []
    deadline = time.monotonic() + settings.deadline
    if script is None:

        def script(h: HostSpec) -> bytes:
            return collector_script(job_id, samples, interval, hardware, h.name)

    probes = [_Probe(h, settings, script(h), deadline) for h in hosts]
    results: list[dict | None] = [None] * len(hosts)
    lock = threading.Lock()
    queue = iter(range(len(hosts)))
    state = {"final": False}

    def worker() -> None:
        while True:
            with lock:
                i = None if state["final"] else next(queue, None)
            if i is None or time.monotonic() >= deadline:
                return
            doc = probes[i].run()
            with lock:
                if state["final"]:
                    return
                results[i] = doc
                done_count = sum(r is not None for r in results)
            if progress is not None:
                try:
                    progress(done_count, len(hosts))
                except Exception:  # noqa: BLE001 - a progress display must never stop a probe
                    pass

    threads = [
        threading.Thread(target=worker, name=f"hangdx-ssh-{k}", daemon=True)
        for k in range(max(1, min(settings.concurrency, len(hosts))))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        state["final"] = True  # from here on, late answers are dropped
        done = [r is not None for r in results]
    if not all(done):
        for probe, ok in zip(probes, done, strict=True):
            if not ok:
                probe.abort()
        grace_end = time.monotonic() + GRACE
        for t in threads:
            t.join(max(0.0, grace_end - time.monotonic()))
    with lock:
        return [
            r if r is not None else _deadline_doc(p, settings) for r, p in zip(results, probes, strict=True)
        ]
