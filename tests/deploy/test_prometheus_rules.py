"""deploy/prometheus/: the alerting rules pass Prometheus's own `promtool check rules`, and their unit tests
(`promtool test rules`, deploy/prometheus/tests/) pass. Every alert has a test where it fires and one where it
does not, and every alert that fires names the training job (`hangdx_job_id`) for /alerts.

promtool comes with Debian's `prometheus` package (.ci/run installs it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = RULES_DIR / "hangdx-rules.yml"
UNIT_TESTS = sorted((RULES_DIR / "tests").glob("*.test.yml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)"
)


def _alerts() -> dict[str, dict]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def _alert_tests() -> list[dict]:
    out = []
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            out.extend(case.get("alert_rule_test", []))
    return out


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=RULES_DIR)


@needs_promtool
def test_promtool_check_rules_accepts_the_rule_file():
    out = _promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    rules = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    assert f"SUCCESS: {rules} rules found" in out.stdout + out.stderr


@needs_promtool
def test_promtool_unit_tests_of_every_rule_pass():
    assert UNIT_TESTS, "no unit tests in deploy/prometheus/tests/"
    out = _promtool("test", "rules", *map(str, UNIT_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert (out.stdout + out.stderr).count("SUCCESS") == len(UNIT_TESTS)


def test_every_alert_is_tested_firing_and_not_firing():
    tests = _alert_tests()
    for name in _alerts():
        mine = [t for t in tests if t["alertname"] == name]
        assert any(t.get("exp_alerts") for t in mine), f"{name}: no unit test where it fires"
        assert any(not t.get("exp_alerts") for t in mine), f"{name}: no unit test where it does not fire"


def test_every_firing_alert_names_the_training_job_and_asks_for_a_diagnosis():
    fired = [a for t in _alert_tests() for a in t.get("exp_alerts") or []]
    assert fired
    for alert in fired:
        assert alert["exp_labels"].get("hangdx_job_id"), alert
        assert alert["exp_labels"].get("hangdx") == "diagnose", alert
    for name, rule in _alerts().items():
        assert "hangdx_job_id" in rule["annotations"]["summary"], name
        assert rule["labels"]["hangdx"] == "diagnose", name


def test_the_readme_section_the_rules_file_points_to_exists():
    """Issue 22 item 7: the rules file once pointed to a deploy/README section that did not exist."""
    import re

    head = RULES.read_text().split("groups:", 1)[0]
    m = re.search(r'(README\.md|deploy/README\.md), "([^"]+)"', " ".join(head.replace("#", " ").split()))
    assert m, "the rules file names no README section"
    readme = RULES_DIR.parents[1] / m.group(1)
    headings = [ln.lstrip("#").strip() for ln in readme.read_text().splitlines() if ln.startswith("#")]
    assert m.group(2) in headings, (m.groups(), headings)
