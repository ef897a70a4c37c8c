"""Where the GPUs' own side holds a job: a process asleep inside the NVIDIA driver, a Fabric Manager that is not
running, nccl-tests whose first collective never finishes on one host; and the lines that name who (a launcher's
exit report, a syslog header, a bus id), read as their emitters print them."""

from __future__ import annotations

from hangdx.playbooks import engine
from hangdx.probes import reader
from hangdx.probes.model import Evidence, Source


def verdict(text: str):
    ev = Evidence()
    reader.read_text([text.encode()], Source("paste.log"), ev)
    return engine.run(ev)


# /proc/PID/stack as the kernel prints it (openucx/ucx#8328's shape: a peer-memory callback waiting on the driver).
IN_DRIVER = """\
$ sudo cat /proc/52994/stack
[<0>] ib_invalidate_peer_memory+0x61/0xc0 [ib_core]
[<0>] nv_get_p2p_free_callback+0x59/0x110 [nv_peer_mem]
[<0>] nv_p2p_mem_info_free_callback+0x19/0x30 [nvidia]
[<0>] 0xffffffffffffffff
"""

IN_NFS = """\
$ sudo cat /proc/1533/stack
[<0>] rpc_wait_bit_killable+0x1e/0xa0 [sunrpc]
[<0>] nfs_start_io_read+0x1a/0x40 [nfs]
[<0>] nfs_file_read+0x3f/0xa0 [nfs]
[<0>] 0xffffffffffffffff
"""


def test_a_process_asleep_inside_the_nvidia_driver_is_the_driver_not_its_peers():
    rc = verdict(IN_DRIVER).root_cause
    assert rc.category == "gpu_fault" and rc.culprit.processes == ["pid 52994"], rc
    assert "NVIDIA driver" in rc.summary and ("reset" in rc.fix or "reboot" in rc.fix)
    # The same wait in a file system's modules is storage's.
    assert verdict(IN_NFS).root_cause.category == "io_stall"


def test_a_fabric_manager_that_exited_means_the_nvswitch_fabric_is_not_set_up():
    text = (
        "$ sudo systemctl status nvidia-fabricmanager\n"
        "     Active: failed (Result: exit-code) since Mon 2024-07-01 14:43:57 UTC; 5s ago\n"
        "    Process: 444114 ExecStart=/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg "
        "(code=exited, status=1/FAILURE)\n"
    )
    rc = verdict(text).root_cause
    assert rc.category == "gpu_fault" and "Fabric Manager" in rc.fix and "version" in rc.fix
    ok = text.replace("status=1/FAILURE", "status=0/SUCCESS").replace(
        "failed (Result: exit-code)", "inactive"
    )
    assert verdict(ok).root_cause.category != "gpu_fault"  # a clean stop says nothing


NCCL_TESTS_HEAD = """\
# nThread 1 nGpus 2 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  21284 on      node1 device  0 [0x2f] NVIDIA A100-SXM4-80GB
#  Rank  1 Group  0 Pid  21284 on      node1 device  1 [0x03] NVIDIA A100-SXM4-80GB
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
"""
ROW = "           8             2     float     sum      -1    18.52    0.00    0.00      0    18.13    0.00    0.00      0\n"


def test_nccl_tests_that_never_print_a_size_on_one_host_point_at_the_peer_to_peer_path():
    rc = verdict(NCCL_TESTS_HEAD).root_cause
    assert rc.category == "gpu_fault" and rc.culprit.hosts == ["node1"] and rc.confidence < 0.5, rc
    assert "NCCL_P2P_DISABLE=1" in rc.fix
    # A row printed: the first collective finished; one GPU: no peer to talk to.
    assert verdict(NCCL_TESTS_HEAD + ROW).root_cause.category != "gpu_fault"
    one_gpu = "".join(ln for ln in NCCL_TESTS_HEAD.splitlines(keepends=True) if "Rank  1" not in ln)
    assert verdict(one_gpu).root_cause.category != "gpu_fault"


# NCCL 1.x's tests (nvidia/nccl test/single/*.cu): one process drives every GPU of its host and names no host.
NCCL1_TESTS_HEAD = """\
# Using devices
#   Rank  0 uses device  0 [0x05] Tesla M40 24GB
#   Rank  1 uses device  1 [0x08] Tesla M40 24GB
#   Rank  2 uses device  2 [0x83] Tesla M40 24GB

#                                                 out-of-place                    in-place
#      bytes             N    type      op     time  algbw  busbw      res     time  algbw  busbw      res
"""


def test_nccl_1_tests_stopped_at_their_header_point_at_the_peer_to_peer_path_of_their_one_host():
    rc = verdict(NCCL1_TESTS_HEAD).root_cause
    assert rc.category == "gpu_fault" and rc.culprit.hosts == [] and "3 GPUs of one host" in rc.summary
    # The same text pasted as a markdown quote, its `#` lost.
    quoted = "".join("> " + ln.lstrip("#") + "\n" for ln in NCCL1_TESTS_HEAD.splitlines())
    assert verdict(quoted).root_cause.category == "gpu_fault"
    row = "           8             2   float     sum    0.045    0.00    0.00    0e+00    0.044    0.00    0.00    0e+00\n"
    assert verdict(NCCL1_TESTS_HEAD + row).root_cause.category != "gpu_fault"


def test_horovods_launcher_names_the_rank_that_died_and_loopback_names_no_host():
    # horovod/runner/gloo_run.py's exit report; the survivors' gloo errors name their peer on 127.0.0.1.
    text = (
        "[1]<stderr>:  what():  [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error "
        "[127.0.0.1]:3977: Connection reset by peer\n"
        "[1]<stderr>:Aborted (core dumped)\n"
        "Process 0 exit with status code 137.\n"
        "Process 1 exit with status code 134.\n"
    )
    rc = verdict(text).root_cause
    assert rc.category == "rank_crashed" and rc.culprit.ranks == [0], rc  # 134: the waiting side's abort
    assert "127.0.0.1" not in rc.culprit.hosts


def test_a_lost_gpu_takes_the_host_whose_kernel_log_names_its_bus_id():
    # pytorch/pytorch#43685's shape: nvidia-smi names the lost GPU's bus id, the node's syslog names the same GPU.
    text = (
        "Unable to determine the device handle for GPU 0000:17:00.0: GPU is lost.  Reboot the system to recover "
        "this GPU\n"
        "Aug 26 15:28:16 ailcm-ai1 kernel: [87474.832707] NVRM: GPU at PCI:0000:17:00: "
        "GPU-f114b259-1fd6-a53b-8882-7d59735e0271\n"
    )
    rc = verdict(text).root_cause
    assert rc.category == "gpu_fault" and rc.culprit.hosts == ["ailcm-ai1"], rc


def test_two_processes_that_disagree_at_one_call_number_are_a_mismatch_naming_neither():
    text = (
        "h1:45006:45006 [0] NCCL INFO AllReduce: opCount 28c sendbuff 0x7f5dd32b2100 recvbuff 0x7f5dd32b2100 count "
        "9984512 datatype 7 op 0 root 0 comm 0x55bef0201370 [nranks=4] stream 0x55bef0208bd0\n"
        "h1:45012:45012 [2] NCCL INFO AllGather: opCount 28c sendbuff 0x7f1fd894af00 recvbuff 0x7f1ed1c00100 count "
        "59205120 datatype 0 op 0 root 0 comm 0x559c24b55610 [nranks=4] stream 0x559c248a3630\n"
    )
    rc = verdict(text).root_cause
    assert rc.category == "collective_mismatch" and rc.culprit.ranks == [], rc
