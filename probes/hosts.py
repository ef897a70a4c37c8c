"""Hosts to probe and how to reach them: what resolvers produce and transports consume."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hangdx.probes.rx import lazy

# user@host:port, host names, IPv4, [IPv6]: nothing a shell would read specially, and no leading `-`
# that a command line would read as an option.
_HOST = lazy(
    r"^(?:(?P<user>[A-Za-z0-9._-]{1,64})@)?(?P<host>[A-Za-z0-9][A-Za-z0-9._-]{0,252}|\[[0-9A-Fa-f:.]+\])(?::(?P<port>\d{1,5}))?$"
)


class HostError(ValueError):
    """A host name or inventory entry that cannot be used (bad usage: exit status 2)."""


@dataclass(frozen=True)
class HostSpec:
    """One node of a job and how to reach it over SSH."""

    name: str  # what the job and the user call it (Slurm node name, inventory key)
    address: str | None = None  # what to connect to, when it differs from name
    port: int = 22
    user: str | None = None
    key_file: str | None = None
    jump: HostSpec | None = None  # a bastion to go through

    @property
    def connect_to(self) -> str:
        return self.address or self.name


@dataclass
class SshSettings:
    """How to reach hosts: host keys are always verified, never added."""

    known_hosts: str = field(default_factory=lambda: os.path.expanduser("~/.ssh/known_hosts"))
    key_file: str | None = None
    use_agent: bool = True
    user: str | None = None
    connect_timeout: float = 10.0
    command_timeout: float = 60.0  # one host's collector run, after connecting
    deadline: float = 120.0  # the whole fan-out
    concurrency: int = 64
    max_output_bytes: int = 64 * 1024 * 1024  # a node answering 1 GB is cut here
    python: str = "python3"  # the interpreter on the nodes (a fixed word, never user text)


def parse_host(text: str, default_port: int = 22) -> HostSpec:
    """`gpu-node-03`, `admin@10.0.0.5:2222`, `[fe80::1]:22` -> HostSpec; HostError otherwise."""
    m = _HOST.match(text.strip())
    if not m:
        raise HostError(f"{text!r} is not a host (expected [user@]host[:port])")
    port = int(m.group("port")) if m.group("port") else default_port
    if not 0 < port < 65536:
        raise HostError(f"{text!r}: port {port} is out of range")
    host = m.group("host").strip("[]")
    return HostSpec(name=host, port=port, user=m.group("user"))


def parse_host_list(text: str) -> list[HostSpec]:
    """A comma-separated --hosts value."""
    hosts = [parse_host(h) for h in text.split(",") if h.strip()]
    if not hosts:
        raise HostError("--hosts names no host")
    return hosts
