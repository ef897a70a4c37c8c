"""PID 1 of one simulated node: names the node, mounts its tools, starts its sshd and its ranks, reaps.

Run by sim.Cluster as `unshare --pid --mount --uts --fork --mount-proc --kill-child python node_init.py PLAN`,
so it is the first process of a fresh PID namespace (with its own /proc), mount namespace (private
propagation: nothing mounted here shows outside) and UTS namespace. Standard library only.

PLAN (JSON, written by sim.Cluster) says: name, node_dir, bashrc (or null), sshd_config (or
null = sshd down), ranks [{rank, local_rank, env, log}], cmd, workdir, nccl_file (NCCL_DEBUG_FILE pattern
or null), nccl_logs {local_rank: text}. This process writes `<node_dir>/ranks.json` once the ranks run
({"local_pids": {local_rank: pid}, "rank_pids": {rank: pid}, "sshd_pid": pid}, pids as this node sees
them) and `<node_dir>/exits.json` as ranks exit. It never exits by itself: SIGKILL from the root
namespace ends it, and the kernel then kills every process of the node.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import socket
import subprocess
import sys
import time

_PLACEHOLDER_HOST = "%HOST%"
_PLACEHOLDER_PID = re.compile(r"%PID(\d+)(?:\+(\d+))?%")


def _write_json(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)  # atomic: readers never see half a file


def _bind(src: str, dst: str) -> None:
    subprocess.run(["mount", "--bind", src, dst], check=True, stdin=subprocess.DEVNULL)


def _render_nccl(text: str, host: str, pids: dict[int, int]) -> str:
    """%HOST% -> the node's name; %PID<n>% -> local rank n's pid; %PID<n>+k% -> that pid + k (a thread id)."""

    def pid(m: re.Match) -> str:
        base = pids.get(int(m.group(1)))
        return m.group(0) if base is None else str(base + int(m.group(2) or 0))

    return _PLACEHOLDER_PID.sub(pid, text).replace(_PLACEHOLDER_HOST, host)


def main(plan_path: str) -> int:
    with open(plan_path) as f:
        plan = json.load(f)
    name, node_dir = plan["name"], plan["node_dir"]
    socket.sethostname(name)
    home = pwd.getpwnam("root").pw_dir
    if plan.get("bashrc") and os.path.exists(os.path.join(home, ".bashrc")):
        # sshd runs commands through bash, which reads root's .bashrc; the host's one puts pyenv shims
        # ahead of everything. The node's .bashrc puts the node's tools first, then the system's.
        _bind(plan["bashrc"], os.path.join(home, ".bashrc"))
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory

    sshd_pid = None
    if plan.get("sshd_config"):
        with open(os.path.join(node_dir, "sshd.log"), "wb") as log:
            sshd = subprocess.Popen(
                ["/usr/sbin/sshd", "-D", "-e", "-f", plan["sshd_config"]],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        sshd_pid = sshd.pid

    local_pids: dict[int, int] = {}
    rank_pids: dict[int, int] = {}
    rank_of_pid: dict[int, int] = {}
    for r in plan["ranks"]:
        env = {k: v for k, v in os.environ.items() if k not in plan.get("scrub_env", [])}
        env.update(r["env"])
        with open(r["log"], "wb") as log:
            proc = subprocess.Popen(
                plan["cmd"],
                env=env,
                cwd=plan["workdir"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        local_pids[r["local_rank"]] = proc.pid
        rank_pids[r["rank"]] = proc.pid
        rank_of_pid[proc.pid] = r["rank"]
    # NCCL would create its debug file at init; here the scenario's recorded log takes its place.
    if plan.get("nccl_file"):
        for r in plan["ranks"]:
            pid = local_pids[r["local_rank"]]
            path = plan["nccl_file"].replace("%h", name).replace("%p", str(pid))
            text = plan.get("nccl_logs", {}).get(str(r["local_rank"]), "")
            with open(path, "w") as f:
                f.write(_render_nccl(text, name, local_pids))
    _write_json(
        os.path.join(node_dir, "ranks.json"),
        {"local_pids": local_pids, "rank_pids": rank_pids, "sshd_pid": sshd_pid},
    )

    # PID 1 of the namespace: every orphan (a dead rank's DataLoader worker or fd holder) is ours to reap.
    exits: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            time.sleep(1.0)
            continue
        if pid in rank_of_pid:
            exits[rank_of_pid[pid]] = os.waitstatus_to_exitcode(status)
            _write_json(os.path.join(node_dir, "exits.json"), exits)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
