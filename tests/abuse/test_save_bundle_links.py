"""Issue 10.1: `--save-bundle` must not let a local user make root write through a link.

The attack: a user creates a symbolic link where root will write the bundle (the README's example path is under
/tmp), pointing at a file only root may write; root then writes text that user controls (a rank's log line) into
it. Root runs these tests, as root runs hangdx on a node."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from hangdx.probes import bundle

DOC = {
    "host": "node1",
    "artifacts": [{"name": "rank0.log", "kind": "log", "data": "owned by the attacker\n"}],
}
NOBODY = 65534


def _save(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hangdx", "diagnose", "no-such-job-1", "--local", "--save-bundle", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_link_where_the_bundle_goes_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "shadow"
    target.write_text("root's file\n")
    link = tmp_path / "b"
    link.symlink_to(target)
    with pytest.raises(bundle.BundleRefused, match="symbolic link"):
        bundle.save([DOC], link, "j")
    assert target.read_text() == "root's file\n"
    r = _save(link)  # the command line: one line, exit 2, nothing written
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "symbolic link" in r.stderr, r.stderr
    assert target.read_text() == "root's file\n"


def test_a_link_to_a_folder_is_refused_too(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "b").symlink_to(tmp_path / "etc")
    with pytest.raises(bundle.BundleRefused):
        bundle.save([DOC], tmp_path / "b", "j")
    assert os.listdir(tmp_path / "etc") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder another user owns")
def test_a_folder_another_user_made_or_linked_through_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(bundle.BundleRefused, match="another user"):
        bundle.save([DOC], theirs, "j")
    # A parent folder that is a link another user owns: root could be steered anywhere below it.
    real = tmp_path / "real"
    real.mkdir()
    hop = tmp_path / "hop"
    hop.symlink_to(real)
    os.lchown(hop, NOBODY, NOBODY)
    with pytest.raises(bundle.BundleRefused, match="symbolic link"):
        bundle.save([DOC], hop / "b", "j")
    assert os.listdir(real) == []


def test_a_folder_with_other_things_in_it_is_not_hangdx_own(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".bashrc").write_text("x")
    with pytest.raises(bundle.BundleRefused, match="not empty"):
        bundle.save([DOC], tmp_path / "home", "j")


def test_a_bundle_is_private_and_can_be_saved_again(tmp_path):
    root = bundle.save([DOC], tmp_path / "b", "j")
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "node1").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "node1" / "rank0.log").st_mode) == 0o600
    again = dict(DOC, artifacts=[dict(DOC["artifacts"][0], data="second run\n")])
    bundle.save([again], root, "j")
    assert (root / "node1" / "rank0.log").read_text() == "second run\n"
    ev = bundle.evidence_from_paths([str(root)])
    assert ev.job_id == "j"


SWAPPER = """
import os, sys, time
parent, target, stop = sys.argv[1], sys.argv[2], sys.argv[3]
real, link = parent + ".real", parent + ".link"
while not os.path.exists(stop):
    os.symlink(target, link)
    os.lchown(link, 65534, 65534)  # the attacker's own link, put in place whole
    os.rename(parent, real)
    os.rename(link, parent)
    time.sleep(0.0003)
    os.unlink(parent)
    os.rename(real, parent)
    time.sleep(0.0003)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a link another user owns")
def test_a_parent_swapped_for_a_link_while_root_saves_never_lands_a_bundle_in_roots_folder(tmp_path):
    # Hardening 21.16: check-then-use. Another user swaps a parent folder of the bundle path for a link to a
    # folder of root's while root saves: 46 of 3,000 saves landed there before the path was walked by descriptor.
    roots = tmp_path / "roots"
    roots.mkdir(mode=0o700)
    users = tmp_path / "users"
    users.mkdir()
    (users / "p").mkdir()
    stop = tmp_path / "stop"
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(users / "p"), str(roots), str(stop)])
    saved = refused = 0
    try:
        end = time.monotonic() + 3  # some 20,000 saves: the unwalked path lost several every run
        i = 0
        while time.monotonic() < end:
            i += 1
            try:
                bundle.save([DOC], users / "p" / f"b{i}", "j")
                saved += 1
            except (bundle.BundleRefused, OSError):
                refused += 1
    finally:
        stop.write_text("")
        swapper.wait(timeout=30)
    assert os.listdir(roots) == [], f"{len(os.listdir(roots))} bundles landed in root's folder"
    assert saved > 0 and refused > 0  # the race was really run: some saves went through, some were refused
