"""The sealed corpus (tests/fixtures/sealed/, see its README) is well formed.

Only the form is checked here, never hangdx's answer: `python bench/accuracy.py --sealed` gives the counts. A failure
names the file, never what is in it, so that nobody who writes rules learns a sealed case from a failing test.
"""

from __future__ import annotations

from pathlib import Path

import yaml

SEALED = Path(__file__).resolve().parent.parent / "fixtures" / "sealed"
CATEGORIES = {
    "conditional_collective", "collective_mismatch", "rank_crashed", "dataloader_stall", "io_stall",
    "user_deadlock", "p2p_deadlock", "ddp_unused_parameters", "gpu_fault", "network_fault",
    "comm_init_failure", "straggler", "unknown",
}  # fmt: skip
REQUIRED = (
    "url", "title", "copied_from", "trimmed", "category", "culprit", "confirmed_cause", "confirmed_by",
    "belief_only", "reasoning",
)  # fmt: skip


def _problems(side: Path) -> list[str]:
    """What is wrong with one sidecar and its artifact, in words that quote nothing from either."""
    try:
        meta = yaml.safe_load(side.read_text())
    except yaml.YAMLError:
        return ["the sidecar is not valid YAML"]
    if not isinstance(meta, dict):
        return ["the sidecar is not a mapping"]
    out = [f"missing or empty key {k!r}" for k in REQUIRED if k not in meta or meta[k] in (None, "")]
    if not str(meta.get("url", "")).startswith("https://"):
        out.append("url is not https")
    if meta.get("category") not in CATEGORIES:
        out.append("unknown category")
    if not isinstance(meta.get("belief_only"), bool):
        out.append("belief_only is not a boolean")
    culprit = meta.get("culprit")
    if not isinstance(culprit, dict) or set(culprit) != {"ranks", "hosts"}:
        out.append("culprit must have exactly ranks and hosts")
    else:
        if not isinstance(culprit["ranks"], list) or not all(isinstance(r, int) for r in culprit["ranks"]):
            out.append("culprit ranks must be a list of integers")
        if not isinstance(culprit["hosts"], list) or not all(isinstance(h, str) for h in culprit["hosts"]):
            out.append("culprit hosts must be a list of strings")
    if side.stem.split("__", 1)[0] != meta.get("category"):
        out.append("the file name's category differs from the sidecar's")
    if "artifact_shows_cause" in meta:  # an annotator's judgement (README): YAML reads yes/no as booleans
        if meta["artifact_shows_cause"] not in (True, False, "yes", "partly", "no"):
            out.append("artifact_shows_cause is not yes, partly or no")
        if not meta.get("artifact_shows_cause_why"):
            out.append("artifact_shows_cause without artifact_shows_cause_why")
    log = side.with_suffix(".log")
    if not log.is_file() or not log.read_bytes().strip():
        out.append("the .log is missing or empty")
    return out


def test_every_sealed_sidecar_is_well_formed():
    sides = sorted(SEALED.glob("*.yaml"))
    assert sides, "no sealed cases"
    bad = {s.name: p for s in sides if (p := _problems(s))}
    assert not bad, bad


def test_every_sealed_artifact_has_its_sidecar_and_no_url_is_used_twice():
    logs = {p.stem for p in SEALED.glob("*.log")}
    sides = {p.stem for p in SEALED.glob("*.yaml")}
    assert logs == sides, sorted(f"{s}: only one of .log/.yaml" for s in logs ^ sides)
    urls: dict[str, str] = {}
    dup = []
    for side in sorted(SEALED.glob("*.yaml")):
        url = str((yaml.safe_load(side.read_text()) or {}).get("url", "")).split("#")[0]
        if url in urls:
            dup.append(f"{side.name} and {urls[url]} share a url")
        urls[url] = side.name
    assert not dup, dup


def test_no_sealed_url_is_also_in_the_real_corpus():
    real = Path(__file__).resolve().parent.parent / "fixtures" / "real"
    used = {
        str((yaml.safe_load(s.read_text()) or {}).get("url", "")).split("#")[0] for s in real.glob("*.yaml")
    }
    clash = [
        s.name
        for s in sorted(SEALED.glob("*.yaml"))
        if str((yaml.safe_load(s.read_text()) or {}).get("url", "")).split("#")[0] in used
    ]
    assert not clash, clash
