"""Fan-out speed: probe N simulated nodes and time until all evidence is in, against clush and pdsh.

    python bench/fanout.py [--nodes 4,16,64] [--repeat 3]

Each node is a real sshd in its own PID/mount/UTS namespace on 127.0.0.x (tests/cluster/sim.py), with
recorded-output stand-ins for nvidia-smi, ibstat and dmesg. All three tools run the same hangdx
collector on every node (hardware probes on, one stack sample, no job processes) over the same SSH
keys, with the same fan-out width (64):

- hangdx: probes/ssh.fan_out (paramiko, one thread per host, the collector sent on stdin)
- clush (ClusterShell): `clush -f 64 -w NODES -l root -o "<ssh options>" python3 SCRIPT`
- pdsh: `pdsh -R ssh -f 64 -w NODES python3 SCRIPT` with the same ssh options

Printed: nodes, seconds from starting the command until every node's document is in (median of
--repeat; Python start-up and imports included for hangdx and clush), and the peak memory
of the process that drove the fan-out (hangdx: the Python process; clush/pdsh: their own process tree
as reported by wait4). Needs root (namespaces), OpenSSH's sshd, `pip install ClusterShell`, `apt-get
install pdsh time`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hangdx.probes import ssh  # noqa: E402
from tests.cluster.sim import Cluster, NodeSpec, unavailable_reason  # noqa: E402

HANGDX_DRIVER = """
import json, sys, time
from hangdx.probes import ssh
from hangdx.probes.hosts import HostSpec, SshSettings
cfg = json.load(sys.stdin)
hosts = [HostSpec(name=n, address=a, port=cfg["port"], user="root") for n, a in cfg["hosts"]]
settings = SshSettings(known_hosts=cfg["known_hosts"], key_file=cfg["key"], use_agent=False, concurrency=64)
t0 = time.monotonic()
docs = ssh.fan_out(hosts, settings, "bench-no-job", samples=1, interval=0.0)
elapsed = time.monotonic() - t0
ok = sum(1 for d in docs if not d.get("problem") and d.get("artifacts"))
print(json.dumps({"seconds": elapsed, "ok": ok}))
"""


def ssh_options(c: Cluster) -> list[str]:
    return [
        "-F", "/dev/null", "-i", c.key_file, "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none",
        "-o", f"UserKnownHostsFile={c.known_hosts}", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
        "-o", "LogLevel=ERROR", "-p", str(c.port),
    ]  # fmt: skip


def run_measured(
    cmd: list[str], stdin: bytes | None = None, env: dict | None = None
) -> tuple[float, float, bytes]:
    """(seconds, peak MB, stdout) of a command, its peak taken by GNU time (a fork from this Python
    would otherwise inherit this process's resident size as its high-water mark)."""
    with tempfile.NamedTemporaryFile() as mem:
        t0 = time.monotonic()
        r = subprocess.run(
            ["/usr/bin/time", "-f", "%M", "-o", mem.name, *cmd],
            input=stdin or b"",
            capture_output=True,
            env=env,
        )
        seconds = time.monotonic() - t0
        kb = int((Path(mem.name).read_text().split() or ["0"])[-1])
    return seconds, kb / 1024, r.stdout


def count_docs(stdout: bytes) -> int:
    """How many whole collector documents came back (printed one after another, no host prefix)."""
    text, n, i = stdout.decode(errors="replace"), 0, 0
    decoder = json.JSONDecoder()
    while True:
        i = text.find('{"hangdx_collector"', i)
        if i < 0:
            return n
        try:
            _, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        n, i = n + 1, end


def bench(n: int, repeat: int) -> dict:
    specs = {i: NodeSpec() for i in range(n)}
    rows: dict[str, list[tuple[float, float, int]]] = {"hangdx": [], "clush": [], "pdsh": []}
    with Cluster(n, 0, node_specs=specs) as c:
        script = Path(c.root) / "collector.py"
        script.write_bytes(ssh.collector_script("bench-no-job", samples=1, interval=0.0))
        addrs = [c.addresses[h] for h in c.hosts]
        cfg = json.dumps(
            {
                "hosts": [[h, c.addresses[h]] for h in c.hosts],
                "port": c.port,
                "known_hosts": c.known_hosts,
                "key": c.key_file,
            }
        ).encode()
        opts = " ".join(ssh_options(c))
        for _ in range(repeat):
            s, mb, out = run_measured([sys.executable, "-c", HANGDX_DRIVER], stdin=cfg)
            r = json.loads(out)
            rows["hangdx"].append((s, mb, r["ok"]))  # wall time of the whole command, like the others
            if shutil.which("clush"):
                s, mb, out = run_measured(
                    ["clush", "-N", "-f", "64", "-w", ",".join(addrs), "-l", "root", "-o", opts, "-O", "ssh_path=ssh",
                     f"python3 {script}"]
                )  # fmt: skip
                rows["clush"].append((s, mb, count_docs(out)))
            if shutil.which("pdsh"):
                env = dict(os.environ, PDSH_SSH_ARGS=f"{opts} -l %u %h", PDSH_RCMD_TYPE="ssh")
                s, mb, out = run_measured(
                    [
                        "pdsh",
                        "-R",
                        "ssh",
                        "-f",
                        "64",
                        "-l",
                        "root",
                        "-w",
                        ",".join(addrs),
                        f"python3 {script}",
                    ],
                    env=env,
                )
                rows["pdsh"].append((s, mb, count_docs(out)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="4,16,64")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"fanout: cannot build the simulated cluster here: {reason}", file=sys.stderr)
        return 2
    print(f"{'nodes':>5}  {'tool':8} {'seconds (median)':>17} {'peak MB':>8} {'docs in':>8}")
    print("-" * 54)
    for n in (int(x) for x in args.nodes.split(",")):
        rows = bench(n, args.repeat)
        for tool, runs in rows.items():
            if not runs:
                print(f"{n:>5}  {tool:8} {'not installed':>17}")
                continue
            secs = statistics.median(r[0] for r in runs)
            peak = max(r[1] for r in runs)
            docs = min(r[2] for r in runs)
            print(f"{n:>5}  {tool:8} {secs:17.2f} {peak:8.1f} {docs:>5}/{n}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
