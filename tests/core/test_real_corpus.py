"""The real-world corpus: artifacts copied from public bug reports (tests/fixtures/real/, see its README).

Each case's sidecar names the category the thread confirmed and the culprit a careful reader of the artifact alone
could name; `hangdx analyze` on the artifact must find them. `python bench/accuracy.py --real` prints the table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths
from hangdx.probes.normalise import same_host

REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real"
CASES = sorted(REAL.glob("*.yaml"))
CATEGORIES = {
    "conditional_collective", "collective_mismatch", "rank_crashed", "dataloader_stall", "io_stall",
    "user_deadlock", "p2p_deadlock", "ddp_unused_parameters", "gpu_fault", "network_fault",
    "comm_init_failure", "straggler", "unknown",
}  # fmt: skip


def _meta(side: Path) -> dict:
    return yaml.safe_load(side.read_text())


# Dev cases that hangdx still gets wrong, each with why: the evidence that names the cause is not in any
# emitter's format (a rule for it would fit that one case), or the artifact holds only the waiting side and the
# cause is in the thread's context (hangdx's `unknown`, with the usual cause and how to confirm it, is the honest
# answer). Strict: a case that becomes right fails here until it is taken off this list. bench/accuracy.py --real
# counts them as wrong.
KNOWN_MISSES = {
    "collective_mismatch__ROCm-rccl-429": "category right: two processes' NCCL lines disagree at one opCount "
    "(AllReduce vs AllGather), one each side, so no majority names the odd one; that DDP's backward issues "
    "all-reduces, making rank 2's all-gather the odd one, is knowledge of the program, not in the lines",
    "conditional_collective__deepspeedai-DeepSpeed-5066": "every rank shown times out in the same ZeRO-3 all-gather: "
    "the waiting side only (read: unknown); that MoE experts got no tokens on some ranks is the thread's",
    "comm_init_failure__vllm-project-vllm-3688": "a vLLM worker's ncclUnhandledCudaError whose last error is "
    "'Cuda failure invalid argument' (read: nothing names a cause); that it was NCCL 2.18's own bug in setting up "
    "its channels is the thread's",
    "conditional_collective__lucidrains-audiolm-pytorch-279": "rank 6's lone BROADCAST timeout after the main "
    "process's own `0: saving to .../results` line (read: unknown); that only the main process ran the sampling "
    "forward pass is the thread's",
    "network_fault__NVIDIA-nccl-2383": "`mlnx_qos` and the sysfs traffic class (PFC on one priority only): a NIC's "
    "QoS configuration is not read, and nothing in it shows the QPs on the lossy class",
    "rank_crashed__verl-project-verl-1964": "category and node right; rank 7 is only in verl's actor name "
    "(`WorkerDict_0:7`), which is not read as a rank",
    "collective_mismatch__KempnerInstitute-KempnerForge-104": "two markdown bullets describing the stacks in prose "
    "(two threads of a rank each in a collective): no stack or log line to read",
    "comm_init_failure__NVIDIA-nccl-tests-217": "a one-GPU nccl-tests run whose loopback socket is `closed by remote "
    "peer` (read: a peer died); that the only peer is the process itself, so something on the host closed it, is not "
    "weighed",
    "dataloader_stall__bigscience-workshop-bigscience-tr11-chronicles": "category right; the host is named only in a "
    "digest of first frames per trace file (`trace-jean-zay-iam52` then frame names), which is not read",
    "p2p_deadlock__horovod-horovod-2601": "Horovod trace lines and one gdb thread spinning in WaitForEvents: no rank "
    "named, and the NCCL 2.8.3 alltoall bug is the maintainer's",
    "p2p_deadlock__meta-pytorch-torchcomms-3095": "inductor's SIMPLE_OVERLAP scheduler lines (a compiler's log): "
    "not an emitter hangdx reads",
    "conditional_collective__huggingface-transformers-35234": "rank 0's watchdog lines only: the waiting side (read: "
    "unknown); that the other ranks never issued the all-gather of a rank-0-only state_dict is the thread's",
    "rank_crashed__sql-machine-learning-elasticdl-897": "ElasticDL's own pod watcher line ('Got event MODIFIED, phase "
    "Failed for pod: ...-worker-0'): an application's message, not catalogued",
    "gpu_fault__facebookresearch-Detectron-219": "two of Detectron's json_stats progress lines and then silence: no "
    "emitter's line; the driver deadlock is the maintainer's",
    "collective_mismatch__bghira-SimpleTuner-3099": "one rank's watchdog timeout on an ALLGATHER, wrapped: the waiting "
    "side only (read: unknown); the ranks' diverging data sources are the thread's",
    "gpu_fault__vllm-project-vllm-9920": "a clean two-GPU NCCL set-up (SHM channels) and a generate() at 0%: nothing "
    "names the PCIe ACS/IOMMU path the thread found",
    "network_fault__horovod-horovod-147": "NCCL 2.1's lines (no `NCCL` word; read now): a socket reset inside NCCL's "
    "IB transport whose trace runs through bootstrap.cu and init.cu, read as set-up failing (comm_init_failure, what "
    "the trace says); the thread's broken IB stack is belief only",
    "conditional_collective__CarperAI-trlx-373": "one rank's watchdog timeout: the waiting side only (read: unknown)",
    "rank_crashed__NVIDIA-nccl-863": "three gdb frames of a process stuck in ncclCommAbort's commReclaim (read as a "
    "wait in the process's own teardown, user_deadlock); that a killed peer blocks that NCCL release's reclaim is "
    "the thread's",
    "conditional_collective__pytorch-pytorch-77562": "one rank's watchdog timeout in an all-gather: the waiting "
    "side only (read: unknown, a rank that never joined the usual cause)",
    "conditional_collective__tenstorrent-tt-metal-38695": "the app's own per-rank lines: rank 1 waits for rank 0 "
    "to build a weight cache on NFS while rank 0 converts; that the ranks then issue different collectives is "
    "the thread's",
    "conditional_collective__allenai-allennlp-5088": "a stack the program dumped of itself ('######### "
    "ProcessID=..., ThreadID=...', 'File: \"...\", line N, in f'), read now, but cut above the frame that waits "
    "(read: unknown)",
    "conditional_collective__sgl-project-sglang-22607": "two py-spy stacks pasted without their process and thread "
    "lines: the category is right (two collectives called from different places), but the culprit is named only in "
    "the poster's prose ('TP0 stuck forever in:', 'TP1-3 ... waiting in:')",
    "rank_crashed__haotian-liu-LLaVA-447": "watchdog timeouts with ranks 6 and 7 three collectives behind the others "
    "(read: conditional_collective [6, 7], what the text shows); the device-side assert on a rank that then died "
    "is the thread's",
    "conditional_collective__jundot-omlx-3521": "one py-spy dump of one process of an MLX ring job, idle in the "
    "app's own generation step: no rank, no collective, nothing of the other rank",
    "conditional_collective__uccl-project-uccl-940": "DeepEP's dispatch CPU timeout on rank 0: the waiting side "
    "(read: unknown, a peer that never joined the dispatch the usual cause); the zero-token early return is the PR's",
    "conditional_collective__vllm-project-vllm-28774": "gloo's preamble size check (8 vs 4 bytes) read as ranks "
    "disagreeing on a collective (collective_mismatch): the same words come from ranks in two different "
    "collectives, which the thread found",
    "gpu_fault__determined-ai-determined-8915": "the first collective's watchdog timeout and a traceback in "
    "wrap_model (read: unknown, a transport that does not work as likely as a rank that never got there); which "
    "two GPUs could not talk is the maintainer's reading of later experiments",
    "comm_init_failure__sgl-project-sglang-3794": "eight TP schedulers start SGLang's NCCL communicator and one "
    "reports an exception two minutes later, its traceback cut at its first line: that the exception came from "
    "the set-up (a firewall on NCCL's ports) is the thread's",
    "rank_crashed__ray-project-ray-41973": "Ray Data's split coordinator waiting for clients that never read, and one "
    "rank's broadcast timeout: the waiting side; that a worker died of an error is the maintainer's reading",
    "straggler__hiyouga-LlamaFactory-2656": "one tokenizer progress bar, still advancing: that the other ranks timed "
    "out waiting for it is the thread's",
    "dataloader_stall__dmlc-dgl-2315": "DistDGL's own per-trainer progress lines ('Part 0 | Epoch 00019 | Step 00020 "
    "...') only: no emitter's line, and that the sampler's worker processes hung is the thread's (num_workers 0 fixed it)",
    "comm_init_failure__pytorch-pytorch-52916": "category right; the culprit rank 1 is named only by the program's "
    "own print '[ 10330 ] world_size = 2, rank = 1' tying pid 10330 to rank 1 (NCCL's lines name the pid)",
    "io_stall__marin-community-marin-8534": "a timeline the poster wrote by hand ('task 12 still reading'): no "
    "emitter's line",
    "conditional_collective__pytorch-pytorch-141069": "only the waiting side's watchdog timeouts on a 1-element "
    "allreduce (read: unknown, a rank that never reached it the usual cause)",
    "ddp_unused_parameters__pytorch-pytorch-19791": "a TypeError inside an old PyTorch's DDP _queue_reduction; that "
    "it means a gradient never arrived is knowledge of that release's reducer, not in the text",
    "rank_crashed__pytorch-pytorch-101463": "one surviving process's watchdog thread in cudaGetLastError; the rank "
    "that was killed is in the description",
    "comm_init_failure__wenet-e2e-wenet-812": "only the program's own 'training on multiple gpus, this gpu N' lines; "
    "that they precede init_process_group is wenet's code, and the gloo back-end at 64 ranks is the thread's",
    "conditional_collective__horovod-horovod-2640": "one stall warning with no shutdown and no line after it, the "
    "shape of the straggler case horovod-159; which side took the other path (the node with different code) is "
    "the thread's",
    "conditional_collective__jpata-particleflow-390": "rank 0's own prediction progress bars only: that the other "
    "ranks went on to a collective without it is the thread's (no collective, no timeout in the artifact)",
    "user_deadlock__facebookresearch-fairseq-4619": "a Ctrl-C traceback cut in the frame that would show the "
    "parent joining its spawned worker (torch/multiprocessing/spa...)",
    "user_deadlock__mosaicml-streaming-145": "a config dump and the poster's own `<HANGED>`: no emitter's line",
    "comm_init_failure__horovod-horovod-212": "mpirun launch lines and the test program's own 'Hello' prints: that the "
    "two-host run printed one greeting and stopped is in the prose, no emitter's line says so",
    "comm_init_failure__pytorch-pytorch-81313": "two torchrun launch lines and a plain DDP script (read: nothing in "
    "it diverges); the wrong NCCL socket interface is the thread's",
    "conditional_collective__sgl-project-sglang-26921": "a code excerpt cut in the middle of the `if` whose early "
    "return skips the all_reduce: not enough of it to parse",
    "ddp_unused_parameters__pytorch-pytorch-20125": "only the launch recipe (read as a launch command); the unused "
    "parameters of --adaptive are the thread's",
    "comm_init_failure__horovod-horovod-2568": "the only line is Python's leaked-semaphores warning at shutdown (read: "
    "the processes were torn down); that the launch hung for want of --network-interface is the thread's",
    "conditional_collective__Lightning-AI-pytorch-lightning-18148": "the pasted script stops at the @rank_zero_only "
    "decorator, before the hook's body: the collective inside it (trainer.log_dir) is not in the artifact",
    "collective_mismatch__pytorch-pytorch-97066": "only the program's own prints ('Rank N completed') say the other "
    "ranks left the all_reduce rank 0 times out in; a rank that skipped it would print the same, and that rank 0 "
    "passed a bigger tensor is in the reproducer's code",
    "conditional_collective__deepspeedai-DeepSpeed-2022": "two spinning GPUs in nvidia-smi are the waiting side "
    "only; which rank left the generate loop, and why, is in the poster's prose",
    "conditional_collective__horovod-horovod-1407": "the culprit rank is named only by the program's own "
    "per-rank batch counts",
    "conditional_collective__kyuz0-amd-strix-halo-llm-finetuning-6": "the artifact says only that rank 0's peer "
    "closed its connection (read as a peer that left, suggestive); that it left because it skipped a rank-0-only "
    "save is the PR's prose",
    "conditional_collective__lightseekorg-TorchSpec-126": "the lagging rank's counters are quoted as the reporter "
    "retyped them ('last completed 21936'), not as ProcessGroupNCCL prints them; its own format is read "
    "(idle ranks, sequence_divergence)",
    "conditional_collective__rwth-i6-returnn-1454": "start-up lines of a 4-rank job only (the program's own "
    "'Torch distributed initialized' prints); the rank-0-only evaluation is the thread's",
    "dataloader_stall__NVIDIA-Megatron-LM-5241": "a stack summarised by hand ('get_batch -> ... -> queues.py:113 get "
    "(blocked)'), not any emitter's format",
    "rank_crashed__NVIDIA-Megatron-LM-878": "PyTorch's 'DataLoader worker ... is killed by signal: Bus error' is read "
    "as the data loader's fault (dataloader_stall), as two other dev cases with the same message are labelled; this "
    "one's label puts the rank that died of it under rank_crashed: a convention of the labels, not of the text",
    "io_stall__NVIDIA-NeMo-Automodel-1038": "only the waiting side (two 60 s timeouts in a 1-element all-gather, "
    "said as a short timeout a slow rank trips); that the missing rank was consolidating a checkpoint is the thread's",
    "io_stall__instructlab-instructlab-3321": "one watchdog timeout, the waiting side only; the full disk under "
    "the checkpoint write is the thread's",
    "io_stall__meta-pytorch-torchtune-2093": "only torchrun's teardown (a SIGABRT exit, SIGTERMs): the waiting "
    "side; the 16-minute checkpoint save is the thread's",
    "p2p_deadlock__NVIDIA-nccl-479": "the poster's prose describing the call order, not any emitter's output",
    "p2p_deadlock__hpcaitech-ColossalAI-3383": "a hand-written debug print log, not any library's format",
    "rank_crashed__modelscope-FunASR-2006": "the host is named only through NCCL's local ranks; mapping one to a "
    "global rank would be a guess",
    "straggler__huggingface-accelerate-223": "one watchdog timeout and the waiting ranks' tracebacks: the "
    "waiting side only; that rank 0 was evaluating is the reporter's words",
    "straggler__huggingface-finetrainers-114": "one rank's watchdog timeout, the waiting side only; the "
    "validation on one GPU is the maintainer's explanation",
}


@pytest.mark.parametrize(
    "side",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[c.stem]))
        if c.stem in KNOWN_MISSES
        else c
        for c in CASES
    ],
    ids=[c.stem for c in CASES],
)
def test_a_real_case_gets_the_category_and_culprit_its_thread_confirmed(side):
    meta = _meta(side)
    v = engine.run(evidence_from_paths([str(side.with_suffix(".log"))]))
    rc = v.root_cause
    assert rc is not None
    assert rc.category == meta["category"], f"{meta['url']}: {rc.summary}"
    culprit = meta.get("culprit") or {}
    if culprit.get("ranks"):
        assert sorted(set(rc.culprit.ranks)) == sorted(set(culprit["ranks"])), rc.summary
    if culprit.get("hosts"):
        assert all(any(same_host(h, g) for g in rc.culprit.hosts) for h in culprit["hosts"]), rc.summary


@pytest.mark.parametrize("side", CASES, ids=[c.stem for c in CASES])
def test_no_playbook_fails_on_a_real_case(side):
    # A playbook that raises, or whose template does not render, is turned into a gap so that the verdict still
    # comes: on real evidence that gap is a finding lost without a word, so none may happen here.
    v = engine.run(evidence_from_paths([str(side.with_suffix(".log"))]))
    assert not [g for g in v.gaps if g.startswith("playbook ")], v.gaps


def test_every_known_miss_is_a_case():
    assert set(KNOWN_MISSES) <= {c.stem for c in CASES}


def test_every_case_has_its_artifact_a_source_and_a_confirmed_cause():
    assert CASES
    logs = {p.stem for p in REAL.glob("*.log")}
    assert logs == {c.stem for c in CASES}, logs ^ {c.stem for c in CASES}  # no artifact without its sidecar
    for side in CASES:
        meta = _meta(side)
        assert str(meta["url"]).startswith("https://"), side
        assert meta["category"] in CATEGORIES, side
        assert meta.get("confirmed_cause") and meta.get("confirmed_by"), side
        assert isinstance(meta.get("belief_only"), bool), side


def test_the_command_line_reads_a_real_paste_from_standard_input():
    side = next(s for s in CASES if _meta(s)["category"] != "unknown")
    r = subprocess.run(
        [sys.executable, "-m", "hangdx", "analyze", "-", "--json"],
        input=side.with_suffix(".log").read_bytes(),
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["root_cause"]["category"] == _meta(side)["category"]
