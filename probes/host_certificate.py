"""OpenSSH host certificates, checked as `ssh` checks them against a known_hosts `@cert-authority` line.

paramiko verifies that the server holds the certified key (its handshake signature) but not the
certificate itself; this module does the rest: the certificate is a host certificate, signed by an
authority known_hosts lists for this host (and not `@revoked`), valid now, for a principal that names
the host, with no critical option it cannot honour. PROTOCOL.certkeys in OpenSSH's source is the format.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from dataclasses import dataclass, field

import paramiko

HOST_CERT = 2  # SSH2_CERT_TYPE_HOST; 1 is a user certificate
FOREVER = 0xFFFFFFFFFFFFFFFF

# The public numbers that stand between the nonce and the serial, per certified key type.
_KEY_FIELDS = {
    "ssh-ed25519-cert-v01@openssh.com": ("string",),
    "ecdsa-sha2-nistp256-cert-v01@openssh.com": ("string", "string"),
    "ecdsa-sha2-nistp384-cert-v01@openssh.com": ("string", "string"),
    "ecdsa-sha2-nistp521-cert-v01@openssh.com": ("string", "string"),
    "ssh-rsa-cert-v01@openssh.com": ("mpint", "mpint"),
}
CERT_KEY_TYPES = tuple(
    t
    for t in paramiko.Transport._key_info  # the host key algorithms paramiko can verify a handshake with
    if t.endswith("-cert-v01@openssh.com")
)


@dataclass
class Certificate:
    type_name: str
    serial: int
    cert_type: int
    key_id: str
    principals: list[str]
    valid_after: int
    valid_before: int
    critical_options: list[str]
    signature_key: bytes
    signature: bytes
    signed: bytes = field(repr=False)


def parse(blob: bytes) -> Certificate:
    """A certificate blob as the server sent it; ValueError when it is not one hangdx can read."""
    m = paramiko.Message(blob)
    try:
        type_name = m.get_text()
        kinds = _KEY_FIELDS.get(type_name)
        if kinds is None:
            raise ValueError(f"{type_name!r} is not a certificate type hangdx reads")
        m.get_string()  # nonce
        for kind in kinds:
            m.get_mpint() if kind == "mpint" else m.get_string()
        serial = m.get_int64()
        cert_type = m.get_int()
        key_id = m.get_text()
        principals = _strings(m.get_string())
        valid_after, valid_before = m.get_int64(), m.get_int64()
        critical = _strings(m.get_string())[::2]  # name, data pairs: the names
        m.get_string()  # extensions (none defined for host certificates)
        m.get_string()  # reserved
        signature_key = m.get_string()
        signed = m.get_so_far()
        signature = m.get_string()
    except (paramiko.SSHException, IndexError, UnicodeError, TypeError) as e:
        raise ValueError(f"a malformed certificate ({e})") from None
    if not signature_key or not signature:
        raise ValueError("a malformed certificate (cut short)")
    return Certificate(
        type_name, serial, cert_type, key_id, principals, valid_after, valid_before, critical,
        signature_key, signature, signed,
    )  # fmt: skip


def _strings(packed: bytes) -> list[str]:
    m, out = paramiko.Message(packed), []
    while m.get_remainder():
        out.append(m.get_text())
    return out


def pattern_matches(patterns: list[str], names: list[str]) -> bool:
    """known_hosts host patterns as OpenSSH matches them: `*` and `?`, `!` negation, hashed `|1|` entries."""
    hit = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern[1:] if negated else pattern
        if any(_one(pattern, name) for name in names):
            if negated:
                return False
            hit = True
    return hit


def _one(pattern: str, name: str) -> bool:
    if pattern.startswith("|1|"):
        try:
            salt, digest = (base64.b64decode(p) for p in pattern[3:].split("|", 1))
        except ValueError:
            return False
        return hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), digest)
    # OpenSSH's match_pattern(): `*` is any run and `?` any one character; nothing else is special (a `[host]:port`
    # pattern is literal brackets, not an fnmatch character class).
    wild = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.fullmatch(wild, name.lower(), re.DOTALL) is not None


def check(
    key: paramiko.PKey,
    principals: list[str],
    authorities: list[paramiko.PKey],
    revoked: set[tuple[str, str]],
    now: float | None = None,
) -> str | None:
    """Why the host certificate `key` carries is not good for a host named `principals`, or None when it is.

    `authorities` are the CA keys of the `@cert-authority` lines that cover this host; `revoked`, the
    (type, base64) of every `@revoked` key.
    """
    blob = getattr(key, "public_blob", None)
    if blob is None:
        return "the server offered a plain host key, not a certificate"
    try:
        cert = parse(blob.key_blob)
    except ValueError as e:
        return str(e)
    if cert.cert_type != HOST_CERT:
        return f"its certificate (id {cert.key_id!r}) is not a host certificate"
    ca = next((a for a in authorities if a.asbytes() == cert.signature_key), None)
    if ca is None:
        return (
            f"its certificate (id {cert.key_id!r}) is signed by {_fingerprint(cert.signature_key)}, which no "
            f"@cert-authority line lists for this host"
        )
    if (ca.get_name(), ca.get_base64()) in revoked:
        return f"its certificate authority {ca.fingerprint} is marked @revoked"
    if not ca.verify_ssh_sig(cert.signed, paramiko.Message(cert.signature)):
        return f"its certificate (id {cert.key_id!r}) does not verify against {ca.fingerprint}: forged or damaged"
    now = time.time() if now is None else now
    if now < cert.valid_after:
        return f"its certificate (id {cert.key_id!r}) is not valid yet (from {_when(cert.valid_after)})"
    if cert.valid_before != FOREVER and now >= cert.valid_before:
        return f"its certificate (id {cert.key_id!r}) expired at {_when(cert.valid_before)}"
    if cert.critical_options:
        return f"its certificate (id {cert.key_id!r}) has critical options hangdx cannot honour: {cert.critical_options}"
    wanted = {p.lower() for p in principals}
    if not wanted & {p.lower() for p in cert.principals}:
        named = ", ".join(cert.principals) or "no host"
        return f"its certificate (id {cert.key_id!r}) names {named}, not {' or '.join(principals)}"
    return None


def _fingerprint(blob: bytes) -> str:
    """As `ssh-keygen -l` prints a key: SHA256 of its blob, base64 without padding."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _when(epoch: int) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))
    except (OverflowError, OSError, ValueError):
        return str(epoch)
