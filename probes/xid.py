"""NVIDIA Xid codes: what each means, the usual action, how bad it is, and who is usually to blame.

Condensed from NVIDIA's "Xid Errors" document and its Xid catalog
(docs.nvidia.com/deploy/xid-errors/), with the operational advice that fleets
commonly apply. Severity: critical (drain the node: the GPU is unusable or
untrustworthy until reset/replaced), error (the GPU or job needs a reset),
warning (usually the application's own fault; the GPU is fine), info.
"""

from __future__ import annotations

from hangdx.probes.rx import lazy

# code -> (meaning, action, severity)
XID_TABLE: dict[int, tuple[str, str, str]] = {
    8: (
        "GPU stopped processing (channel idle timeout)",
        "Restart the job; if it recurs on this GPU, reset the GPU and check driver/firmware",
        "error",
    ),
    13: (
        "Graphics engine exception (an out-of-range access or illegal instruction in a kernel)",
        "Usually the application's fault: run it under compute-sanitizer; "
        "if it recurs with different programs, run GPU diagnostics (dcgmi diag -r 3)",
        "warning",
    ),
    31: (
        "GPU memory page fault (MMU fault: a kernel touched an invalid address)",
        "Usually the application's fault (illegal address): debug the program; "
        "if it recurs across jobs on this GPU, run GPU diagnostics",
        "warning",
    ),
    32: (
        "Invalid or corrupted push buffer stream (DMA/PCIe corruption)",
        "Check PCIe health (AER errors), reset the GPU; reseat it if it recurs",
        "error",
    ),
    38: ("Driver firmware error", "Reset the GPU or reboot; update the driver if it recurs", "error"),
    43: (
        "GPU stopped processing: a channel was reset after an application fault",
        "The GPU is healthy; restart the job (look for the application error that came first)",
        "warning",
    ),
    44: (
        "Graphics engine fault during a context switch",
        "Reset the GPU or reboot; update the driver if it recurs",
        "error",
    ),
    45: (
        "Preemptive cleanup after a previous error or a killed process",
        "Informational: look at the Xid or process kill that came just before",
        "info",
    ),
    46: (
        "GPU stopped processing",
        "Drain the node and reset the GPU; contact support if it recurs",
        "critical",
    ),
    48: (
        "Double-bit (uncorrectable) ECC error in GPU memory",
        "Drain the node, reset the GPU or reboot; RMA the GPU if it recurs",
        "critical",
    ),
    54: ("Auxiliary power is not connected to the GPU board", "Check the GPU's power cabling", "critical"),
    56: ("Display engine error", "Reset the GPU; update the driver if it recurs", "error"),
    57: (
        "Error programming the video memory interface",
        "Reset the GPU; RMA if it recurs",
        "critical",
    ),
    58: ("Unstable video memory interface", "Reset the GPU; RMA if it recurs", "critical"),
    61: (
        "Internal micro-controller breakpoint/warning",
        "Reset the GPU or reboot; contact support if it persists",
        "error",
    ),
    62: (
        "Internal micro-controller halt",
        "Drain the node, reset the GPU or reboot; check cooling; RMA if it recurs",
        "critical",
    ),
    63: (
        "ECC page retirement or row remapping recorded",
        "Reset the GPU (or reboot) when convenient so the remapping takes effect; watch for Xid 64",
        "info",
    ),
    64: (
        "ECC page retirement or row remapping failed",
        "Drain the node, reset the GPU; RMA if it recurs",
        "critical",
    ),
    65: ("Video processor exception", "Restart the job; reset the GPU if it recurs", "error"),
    68: (
        "Video decoder (NVDEC) exception",
        "Restart the job; update the driver and reset the GPU if it recurs",
        "warning",
    ),
    69: (
        "Graphics engine class error (illegal method or class)",
        "Restart the job; update the driver; reset the GPU if it recurs",
        "error",
    ),
    74: (
        "NVLink error",
        "Drain the node and reset the GPU; check links (nvidia-smi nvlink -e, NVSwitch/fabric manager); "
        "RMA if it persists",
        "critical",
    ),
    79: (
        "GPU has fallen off the bus (no longer reachable over PCIe)",
        "Drain the node and reboot; reseat or replace the GPU; check power supply/cables and the PCIe "
        "slot or riser",
        "critical",
    ),
    92: (
        "High single-bit ECC error rate",
        "Monitor; reset the GPU when convenient; RMA if the rate stays high",
        "warning",
    ),
    94: (
        "Contained ECC error (uncorrectable, confined to the application that hit it)",
        "Restart the affected job; reset the GPU so the bad row is remapped",
        "error",
    ),
    95: (
        "Uncontained ECC error (uncorrectable; every application on the GPU is affected)",
        "Drain the node, reset the GPU or reboot; RMA if it recurs",
        "critical",
    ),
    109: (
        "Context switch timeout",
        "Restart the job; reset the GPU if it recurs (can also follow a hung kernel)",
        "error",
    ),
    110: ("Security fault error", "Reset the GPU; contact support if it recurs", "critical"),
    119: (
        "GSP RPC timeout (the GPU System Processor firmware stopped answering)",
        "Reset the GPU or reboot; update the driver; contact support if it recurs",
        "critical",
    ),
    120: (
        "GSP error (GPU System Processor firmware error)",
        "Reset the GPU or reboot; update the driver",
        "critical",
    ),
    140: ("Unrecovered ECC error", "Drain the node, reset the GPU; RMA if it recurs", "critical"),
    154: (
        "GPU recovery action changed (the driver names what the GPU now needs)",
        "Do what the line says (GPU reset, node reboot, drain and reset)",
        "error",
    ),
}

# Who is usually at fault; the playbook weighs a GPU fault against a bug in the job.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})
HARDWARE_XIDS = frozenset({32, 46, 48, 54, 57, 58, 62, 63, 64, 74, 79, 92, 94, 95, 140})
DRIVER_XIDS = frozenset({38, 44, 56, 61, 65, 68, 69, 109, 119, 120})

_UNKNOWN = ("Xid %d (not in hangdx's table)", "Look it up in NVIDIA's Xid catalog", "error")


def describe(code: int) -> tuple[str, str, str]:
    """(meaning, action, severity) for an Xid code; a generic entry for codes not in the table."""
    if code in XID_TABLE:
        return XID_TABLE[code]
    return (_UNKNOWN[0] % code, _UNKNOWN[1], _UNKNOWN[2])


def likely_cause(code: int) -> str:
    """application | hardware | driver | unknown."""
    if code in APPLICATION_XIDS:
        return "application"
    if code in HARDWARE_XIDS:
        return "hardware"
    if code in DRIVER_XIDS:
        return "driver"
    return "unknown"


_BUS = lazy(r"(?:PCI:)?(?:([0-9A-Fa-f]{4,8}):)?([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})(?:\.([0-7]))?")


def normalize_bus_id(text: str | None) -> str | None:
    """`00000000:3B:00.0`, `PCI:0000:3b:00` or `3b:00.0` -> `0000:3b:00.0` (None when not a bus id)."""
    if not text:
        return None
    m = _BUS.fullmatch(text.strip())
    if not m:
        return None
    domain = (m.group(1) or "0000")[-4:]
    return f"{domain}:{m.group(2)}:{m.group(3)}.{m.group(4) or '0'}".lower()
