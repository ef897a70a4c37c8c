"""Job resolvers without Slurm: --hosts lists, host ranges, YAML inventories (valid and broken)."""

from __future__ import annotations

import dataclasses
import os
import textwrap

import pytest

from hangdx.probes.hosts import HostError, HostSpec, SshSettings
from hangdx.probes.resolve import (
    ResolveError,
    check_job_id,
    expand_hostlist,
    from_hosts,
    from_inventory,
    from_slurm,
    resolve,
)

INVENTORY = """\
ssh:
  user: hangdx
  key_file: ~/.ssh/hangdx_ed25519
  known_hosts: keys/known_hosts
  jump: admin@bastion.example.com:2200
  connect_timeout: 5
  concurrency: 16
hosts:
  gpu-node-03: {address: 10.1.2.3, port: 2222, user: root}
  gpu-node-04: {jump: null, key_file: /etc/hangdx/node4.key}
jobs:
  "12345": {hosts: [gpu-node-01, gpu-node-02, gpu-node-03]}
  train-llama: {hosts: "gpu-node-[01-04]"}
  777: [gpu-node-05, "gpu-node-0[6-7]"]
"""


def write(tmp_path, text: str, name: str = "inventory.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# ---------------------------------------------------------------- --hosts and ranges


def test_hosts_list_keeps_users_ports_and_ipv6():
    hosts = from_hosts("gpu-node-01, admin@gpu-node-02:2222,[fe80::1]:22")
    assert [(h.name, h.user, h.port) for h in hosts] == [
        ("gpu-node-01", None, 22),
        ("gpu-node-02", "admin", 2222),
        ("fe80::1", None, 22),
    ]


def test_hosts_list_expands_slurm_ranges():
    hosts = from_hosts("gpu-node-[01-03,10],root@login[1-2]:2222")
    assert [h.name for h in hosts] == [
        "gpu-node-01",
        "gpu-node-02",
        "gpu-node-03",
        "gpu-node-10",
        "login1",
        "login2",
    ]
    assert {(h.user, h.port) for h in hosts[4:]} == {("root", 2222)}


def test_hostlist_padding_products_and_duplicates_follow_slurm():
    assert expand_hostlist("n[8-11]") == ["n8", "n9", "n10", "n11"]
    assert expand_hostlist("n[008-010]") == ["n008", "n009", "n010"]
    assert expand_hostlist("rack[1-2]-gpu[0-1]") == ["rack1-gpu0", "rack1-gpu1", "rack2-gpu0", "rack2-gpu1"]
    assert expand_hostlist("a,b,a,n[1-2],n1") == ["a", "b", "n1", "n2"]


@pytest.mark.parametrize(
    "text, says",
    [
        ("", "names no host"),
        (" , ,", "names no host"),
        ("gpu;rm -rf /", "is not a host"),
        ("gpu-node-01:99999", "out of range"),
        ("$(reboot)", "is not a host"),
        ("n[1-", "without ']'"),
        ("n1-]", "without '['"),
        ("n[5-1]", "runs backwards"),
        ("n[[1-2]]", "nested"),
        ("n[0-99999999]", "more than"),
        ("n[a-b]", "is not a host"),
    ],
)
def test_bad_hosts_give_one_line_host_errors(text, says):
    with pytest.raises(HostError) as e:
        from_hosts(text)
    assert says in str(e.value)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- inventory


def test_inventory_job_hosts_carry_per_host_and_default_ssh_settings(tmp_path):
    path = write(tmp_path, INVENTORY)
    hosts, overrides = from_inventory(path, "12345")
    assert [h.name for h in hosts] == ["gpu-node-01", "gpu-node-02", "gpu-node-03"]
    first, _, third = hosts
    key = os.path.expanduser("~/.ssh/hangdx_ed25519")
    bastion = HostSpec(name="bastion.example.com", port=2200, user="admin")
    assert first == HostSpec(name="gpu-node-01", user="hangdx", key_file=key, jump=bastion)
    assert (third.connect_to, third.port, third.user, third.key_file, third.jump) == (
        "10.1.2.3",
        2222,
        "root",
        key,
        bastion,
    )
    # Relative paths are relative to the inventory; the dict applies straight onto SshSettings.
    assert overrides == {
        "user": "hangdx",
        "key_file": key,
        "known_hosts": str(tmp_path / "keys" / "known_hosts"),
        "connect_timeout": 5.0,
        "concurrency": 16,
    }
    settings = dataclasses.replace(SshSettings(), **overrides)
    assert settings.connect_timeout == 5.0 and settings.known_hosts.endswith("keys/known_hosts")


def test_inventory_ranges_numeric_job_ids_and_jump_opt_out(tmp_path):
    path = write(tmp_path, INVENTORY)
    hosts, _ = from_inventory(path, "train-llama")
    assert [h.name for h in hosts] == ["gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04"]
    node4 = hosts[3]
    assert node4.jump is None and node4.key_file == "/etc/hangdx/node4.key" and node4.user == "hangdx"
    # `777:` is a YAML integer; the shorthand list form mixes names and ranges.
    hosts, _ = from_inventory(path, "777")
    assert [h.name for h in hosts] == ["gpu-node-05", "gpu-node-06", "gpu-node-07"]


def test_minimal_inventory_needs_only_jobs(tmp_path):
    path = write(tmp_path, "jobs:\n  '1': {hosts: [a, b]}\n")
    hosts, overrides = from_inventory(path, "1")
    assert hosts == [HostSpec(name="a"), HostSpec(name="b")]
    assert overrides == {}


def test_unknown_job_says_which_jobs_the_inventory_knows(tmp_path):
    path = write(tmp_path, INVENTORY)
    with pytest.raises(ResolveError) as e:
        from_inventory(path, "99999")
    msg = str(e.value)
    assert "'99999'" in msg and "12345, 777, train-llama" in msg and path in msg


@pytest.mark.parametrize(
    "text, says",
    [
        ("", "empty"),
        ("jobs: [1, 2]\n", "jobs: mapping"),
        ("- just\n- a list\n", "must be a mapping, not a list"),
        ("jobs:\n  '1': {hosts: [a]}\nfleet: {}\n", "unknown key 'fleet'"),
        ("ssh: {user: hangdx}\n", "jobs: mapping"),
        ("jobs:\n  '1': {hosts: [a]\n", "not valid YAML at line"),
        ("jobs: {'1': {hosts: [a]}}\nssh: {usr: x}\n", "unknown key 'usr'"),
        ("jobs: {'1': {hosts: [a]}}\nssh: {port: '22'}\n", "port must be a number"),
        ("jobs: {'1': {hosts: [a]}}\nssh: {port: 70000}\n", "port must be a number"),
        ("jobs: {'1': {hosts: [a]}}\nssh: {user: 'bob; rm -rf /'}\n", "is not a user name"),
        ("jobs: {'1': {hosts: [a]}}\nssh: {user: \"bob\\n\"}\n", "is not a user name"),
        ("jobs: {'1': {hosts: [a]}}\nssh: {connect_timeout: -1}\n", "seconds above 0"),
        ("jobs: {'1': {hosts: [a]}}\nssh: {use_agent: 'yes'}\n", "true or false"),
        ("jobs: {'1': {hosts: [a]}}\nssh: {jump: 'bad host!'}\n", "is not a host"),
        ("jobs: {'1': {hosts: [a]}}\nssh: {key_file: 5}\n", "expected a file path"),
        ("jobs: {'1': {hosts: [a]}}\nhosts: {a: {adress: 10.0.0.1}}\n", "unknown key 'adress'"),
        ("jobs: {'1': {hosts: [a]}}\nhosts: {a: {address: 'x y'}}\n", "is not a host name"),
        ("jobs: {'1': {hosts: [a]}}\nhosts: {'a;b': {}}\n", "is not a host name"),
        ("jobs: {'1': {hosts: [a]}}\nhosts: [a, b]\n", "hosts must be a mapping"),
        ("jobs: {'1': {hosts: []}}\n", "must be a host list"),
        ("jobs: {'1': {nodes: [a]}}\n", "unknown key 'nodes'"),
        ("jobs: {'1': {hosts: [a, 5]}}\n", "5 is not a host name"),
        ("jobs: {'1': {hosts: ['root@a:22']}}\n", "is not a host name"),
        ("jobs: {'1': {hosts: 'gpu-[01-'}}\n", "without ']'"),
        ("jobs: {'1': 42}\n", "must be a host list"),
        ("jobs: {true: [a]}\n", "is not a job id"),
    ],
)
def test_broken_inventories_give_one_line_host_errors(tmp_path, text, says):
    path = write(tmp_path, text)
    with pytest.raises(HostError) as e:
        from_inventory(path, "1")
    assert says in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert path in str(e.value)


def test_unreadable_and_non_text_inventories(tmp_path):
    with pytest.raises(HostError, match="cannot read it"):
        from_inventory(str(tmp_path / "missing.yaml"), "1")
    with pytest.raises(HostError, match="cannot read it"):
        from_inventory(str(tmp_path), "1")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01garbage\x80")
    with pytest.raises(HostError, match="not UTF-8"):
        from_inventory(str(binary), "1")


def test_inventory_never_constructs_python_objects(tmp_path):
    path = write(tmp_path, "jobs: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(HostError, match="not valid YAML"):
        from_inventory(path, "1")


# ---------------------------------------------------------------- resolve() and Slurm input checks


def test_resolve_dispatches_on_hangdx_resolver_syntax(tmp_path):
    path = write(tmp_path, INVENTORY)
    assert [h.name for h in resolve("12345", f"inventory:{path}")][-1] == "gpu-node-03"
    assert [h.name for h in resolve("x", "hosts:a,b")] == ["a", "b"]
    (local,) = resolve("x", "local")
    assert local.name and local.address is None
    with pytest.raises(ResolveError, match="not one of"):
        resolve("x", "ssh")


@pytest.mark.parametrize("job_id", ["123", "123_4", "123+1"])
def test_slurm_job_ids_accepted(job_id):
    assert check_job_id(job_id) == job_id


@pytest.mark.parametrize(
    "job_id", ["", "abc", "12 34", "1;reboot", "-1", "123_", "1_2_3", "--help", "1\n2", "123\n"]
)
def test_bad_slurm_job_ids_never_reach_scontrol(job_id):
    # A scontrol that would fail loudly if run: the id check must come first.
    with pytest.raises(ResolveError, match="is not a Slurm job id"):
        from_slurm(job_id, scontrol="/nonexistent/scontrol")


def test_missing_scontrol_is_a_one_line_resolve_error():
    with pytest.raises(ResolveError, match="not found"):
        from_slurm("123", scontrol="/nonexistent/scontrol")


def test_a_node_list_or_name_beginning_with_a_dash_never_reaches_scontrol_or_ssh(tmp_path):
    """Issue 10.9: a NodeList from scontrol beginning with '-' was passed on as an option."""
    log = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        'if [ "$3" = job ]; then echo "JobId=77 JobState=RUNNING NodeList=--local"; fi\n'
    )
    fake.chmod(0o755)
    with pytest.raises(ResolveError, match="a node list hangdx cannot read"):
        from_slurm("77", scontrol=str(fake))
    assert "hostnames" not in log.read_text()


def test_the_inventory_ssh_timeouts_hold_unless_a_flag_says_otherwise(tmp_path):
    """Issue 10.9: the inventory's connect_timeout and deadline were overridden by the command line's defaults."""
    from hangdx.bot.diagnosis import DiagnoseOptions, ssh_targets

    (tmp_path / "known_hosts").write_text("")
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        f"ssh:\n  known_hosts: {tmp_path / 'known_hosts'}\n  connect_timeout: 3\n  deadline: 400\n"
        "jobs:\n  '42': [node1]\n"
    )
    _, settings = ssh_targets("42", f"inventory:{inv}", DiagnoseOptions(how=f"inventory:{inv}"))
    assert (settings.connect_timeout, settings.deadline) == (3, 400)
    _, settings = ssh_targets("42", f"inventory:{inv}", DiagnoseOptions(how=f"inventory:{inv}", deadline=30))
    assert (settings.connect_timeout, settings.deadline) == (3, 30)
