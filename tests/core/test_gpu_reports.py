"""What a GPU's own reports say: `nvidia-smi -q` (probes/nvidia_smi_q.py) and `dcgmi diag` (probes/dcgmi_diag.py),
read into the gpu_fault playbook (a memory error, a failed diagnostic) and the gpu_throttled one (a slow GPU).

The texts are real formats: the lines come from the fixtures in tests/fixtures/nvidia_smi_q/ and
tests/fixtures/dcgmi_diag/ (their README names each source), with hosts and bus ids changed where a test needs two GPUs.
"""

from __future__ import annotations

from pathlib import Path

from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths
from hangdx.probes.dcgmi_diag import _parse_json
from hangdx.probes.model import Evidence, Source

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _verdict(tmp_path, text: str, name: str = "paste.txt"):
    p = tmp_path / name
    p.write_text(text)
    ev = evidence_from_paths([str(p)])
    return ev, engine.run(ev)


def _fixture(kind: str, name: str):
    ev = evidence_from_paths([str(FIXTURES / kind / name)])
    return ev, engine.run(ev)


# -- nvidia-smi -q: memory errors ----------------------------------------------------------------------------


def test_a_pending_row_remap_in_nvidia_smi_q_is_a_gpu_fault_naming_that_gpu():
    # stas00/ml-engineering debug.md: the A100 report after an Xid 63
    _, v = _fixture("nvidia_smi_q", "q_a100_xid63_row_remap_pending.txt")
    rc = v.root_cause
    assert rc.category == "gpu_fault" and rc.culprit.gpus == ["0000:10:1c.0"]
    assert "row remap is pending" in rc.summary
    assert any(
        q.text.strip().startswith("Pending") and q.text.rstrip().endswith("Yes")
        for q in v.findings[0].evidence
    )


def test_uncorrectable_volatile_ecc_errors_are_a_severe_gpu_fault():
    _, v = _fixture("nvidia_smi_q", "q_ecc_sram_uncorrectable.txt")
    rc = v.root_cause
    assert rc.category == "gpu_fault" and rc.confidence >= 0.9
    assert "1 SRAM uncorrectable ECC error" in rc.summary and "5 in the GPU's lifetime" in rc.summary


def test_a_page_pending_retirement_and_a_failed_row_remap_are_gpu_faults(tmp_path):
    _, v = _fixture("nvidia_smi_q", "q_retired_pages_pending.txt")
    assert v.root_cause.category == "gpu_fault" and "pending retirement" in v.root_cause.summary
    # a report of two GPUs, the second one's remapping failed (lines of q_a10_550_clean_full.txt)
    text = (
        "Attached GPUs                             : 2\n"
        "GPU 00000000:06:00.0\n"
        "    Product Name                          : NVIDIA A10\n"
        "    Remapped Rows\n"
        "        Correctable Error                 : 0\n"
        "        Uncorrectable Error               : 0\n"
        "        Pending                           : No\n"
        "        Remapping Failure Occurred        : No\n"
        "GPU 00000000:07:00.0\n"
        "    Product Name                          : NVIDIA A10\n"
        "    Remapped Rows\n"
        "        Correctable Error                 : 0\n"
        "        Uncorrectable Error               : 8\n"
        "        Pending                           : No\n"
        "        Remapping Failure Occurred        : Yes\n"
    )
    ev, v = _verdict(tmp_path, text)
    assert [g.index for g in ev.gpus] == [0, 1]
    rc = v.root_cause
    assert rc.category == "gpu_fault" and rc.culprit.gpus == ["0000:07:00.0"] and rc.confidence >= 0.9


def test_a_clean_report_is_read_but_names_no_fault():
    ev, v = _fixture("nvidia_smi_q", "q_a10_550_clean_full.txt")
    (g,) = ev.gpus
    assert (g.bus_id, g.name, g.util_pct, g.mem_total_mib, g.power_w) == (
        "0000:06:00.0",
        "NVIDIA A10",
        0,
        23028,
        21.3,
    )
    assert g.uuid == "GPU-51ae0086-e1ac-4a20-f062-9caa44e4df6d"
    assert not ev.events and v.root_cause.category == "unknown"


def test_the_host_a_prompt_names_is_the_culprit_host(tmp_path):
    text = (
        "root@gpu-node-07:~# nvidia-smi -q\n"
        + (FIXTURES / "nvidia_smi_q" / "q_a100_xid63_row_remap_pending.txt").read_text()
    )
    _, v = _verdict(tmp_path, text)
    rc = v.root_cause
    assert rc.category == "gpu_fault" and rc.culprit.hosts == ["gpu-node-07"]
    assert rc.culprit.gpus == ["gpu-node-07:0000:10:1c.0"]


# -- nvidia-smi -q: a throttled GPU --------------------------------------------------------------------------

_CLOCKS = (
    "    Clocks Event Reasons\n"
    "        Idle                              : Not Active\n"
    "        Applications Clocks Setting       : Not Active\n"
    "        SW Power Cap                      : Not Active\n"
    "        HW Slowdown                       : {hw}\n"
    "            HW Thermal Slowdown           : Not Active\n"
    "            HW Power Brake Slowdown       : {brake}\n"
    "        Sync Boost                        : Not Active\n"
    "        SW Thermal Slowdown               : Not Active\n"
    "        Display Clock Setting             : Not Active\n"
)


def _gpu(bus: str, util: int, hw: str = "Not Active", brake: str = "Not Active") -> str:
    # the block layout of q_a10_550_clean_full.txt; the Active lines as in gpud's HWSlowdownQueryOutput and
    # the Dell C4130 report (HW Slowdown / HW Power Brake Slowdown : Active)
    return (
        f"GPU {bus}\n"
        "    Product Name                          : NVIDIA A10\n"
        + _CLOCKS.format(hw=hw, brake=brake)
        + "    Utilization\n"
        f"        Gpu                               : {util} %\n"
    )


def test_hw_slowdown_on_one_gpu_makes_it_the_straggler(tmp_path):
    text = "==============NVSMI LOG==============\n\nAttached GPUs                             : 3\n"
    text += _gpu("00000000:06:00.0", 100) + _gpu("00000000:07:00.0", 100, "Active", "Active")
    text += _gpu("00000000:08:00.0", 100)
    ev, v = _verdict(tmp_path, text)
    assert len(ev.gpus) == 3
    rc = v.root_cause
    assert rc.category == "straggler" and rc.culprit.gpus == ["0000:07:00.0"]
    assert "HW Slowdown, HW Power Brake Slowdown active" in rc.summary and "other 2 GPUs" in rc.summary
    assert v.status == "progressing"


def test_sw_power_cap_and_idle_are_not_throttling():
    ev, v = _fixture("nvidia_smi_q", "q_clocks_event_reasons_sw_power_cap.txt")
    assert not ev.events_of("gpu_throttled")
    ev, _ = _fixture("nvidia_smi_q", "q_clocks_throttle_reasons_grep.txt")
    assert not ev.events_of("gpu_throttled")


# -- dcgmi diag ----------------------------------------------------------------------------------------------


def test_a_failed_dcgmi_memory_test_is_a_gpu_fault_quoting_the_warning():
    # stas00/ml-engineering debug.md: `dcgmi diag -r 2` on a faulty node
    _, v = _fixture("dcgmi_diag", "r2_gpu_memory_fail_gpu0_thermal.txt")
    rc = v.root_cause
    assert rc.category == "gpu_fault" and rc.culprit.gpus == ["GPU 0"]
    assert "GPU 0 Thermal violations totaling 13.3 seconds started at 9.7 seconds" in rc.summary
    texts = [q.text for q in v.findings[0].evidence]
    assert any("Fail - GPU: 0" in t for t in texts) and any("| Warning" in t for t in texts)


def test_fail_all_with_warnings_naming_one_gpu_names_that_gpu():
    # NVIDIA/go-dcgm#52: GPU Memory `Fail - GPU: 0`, Diagnostic `Fail - All` with a warning for GPU 0
    ev, v = _fixture("dcgmi_diag", "r3_hardware_fail_gpu0_cuctxcreate.txt")
    fails = ev.events_of("dcgm_diag_fail")
    assert {(e.fields["test"], e.fields.get("gpu_index")) for e in fails} == {
        ("GPU Memory", 0),
        ("Diagnostic", 0),
        ("Targeted Stress", None),
    }
    rc = v.root_cause
    assert rc.category == "gpu_fault" and rc.culprit.gpus == ["GPU 0"] and rc.confidence >= 0.9
    assert "Unable to create CUDA context: 'CUDA-capable device(s) is/are busy or unavailable'" in rc.summary


def test_a_deployment_error_row_naming_a_gpu_is_its_fault():
    # stas00/ml-engineering debug.md: the report after a repeating Xid 64
    _, v = _fixture("dcgmi_diag", "deployment_error_gpu3_row_remap_pending.txt")
    rc = v.root_cause
    assert rc.category == "gpu_fault" and rc.culprit.gpus == ["GPU 3"]
    assert "GPU 3 has uncorrectable memory errors and row remappings are pending" in rc.summary


def test_a_passing_run_names_no_fault():
    # NVIDIA/DCGM#253 (DCGM 4.2.3: `GPU0: Pass` rows)
    ev, _ = _fixture("dcgmi_diag", "r_4x_software_pass_excerpt.txt")
    assert not ev.events


def test_a_4x_per_gpu_fail_row_and_the_host_of_a_pdsh_prefix(tmp_path):
    text = (
        "node17: +---------------------------+------------------------------------------------+\n"
        "node17: | Diagnostic                | Result                                         |\n"
        "node17: +===========================+================================================+\n"
        "node17: +-----  Hardware  ----------+------------------------------------------------+\n"
        "node17: | memory                    | Fail                                           |\n"
        "node17: |                           | GPU0: Pass                                     |\n"
        "node17: |                           | GPU1: Fail                                     |\n"
    )
    _, v = _verdict(tmp_path, text)
    rc = v.root_cause
    assert (
        rc.category == "gpu_fault" and rc.culprit.hosts == ["node17"] and rc.culprit.gpus == ["node17:GPU 1"]
    )


def test_dcgmi_diag_json_names_the_failed_gpu():
    # the `dcgmi diag -j` layout DCGM's nvvs documents (NvvsCommon.h) and NVIDIA/DCGM#139 shows
    text = (
        '{\n\t"DCGM GPU Diagnostic" : \n\t{\n\t\t"test_categories" : \n\t\t[\n\t\t\t{\n'
        '\t\t\t\t"category" : "Hardware",\n\t\t\t\t"tests" : \n\t\t\t\t[\n\t\t\t\t\t{\n'
        '\t\t\t\t\t\t"name" : "GPU Memory",\n\t\t\t\t\t\t"results" : \n\t\t\t\t\t\t[\n'
        '\t\t\t\t\t\t\t{\n\t\t\t\t\t\t\t\t"gpu_id" : "0",\n\t\t\t\t\t\t\t\t"status" : "Pass"\n\t\t\t\t\t\t\t},\n'
        '\t\t\t\t\t\t\t{\n\t\t\t\t\t\t\t\t"gpu_id" : "1",\n\t\t\t\t\t\t\t\t"status" : "Fail",\n'
        '\t\t\t\t\t\t\t\t"warnings" : \n\t\t\t\t\t\t\t\t[\n'
        '\t\t\t\t\t\t\t\t\t{\n\t\t\t\t\t\t\t\t\t\t"error_id" : 83,\n'
        '\t\t\t\t\t\t\t\t\t\t"warning" : "GPU 1 has uncorrectable memory errors and row remappings are pending"\n'
        "\t\t\t\t\t\t\t\t\t}\n\t\t\t\t\t\t\t\t]\n\t\t\t\t\t\t\t}\n\t\t\t\t\t\t]\n\t\t\t\t\t}\n\t\t\t\t]\n"
        '\t\t\t}\n\t\t],\n\t\t"version" : "3.3.1"\n\t}\n}\n'
    )
    ev = Evidence()
    _parse_json(text, Source("diag.json"), ev)
    (e,) = ev.events_of("dcgm_diag_fail")
    assert e.fields["gpu_index"] == 1 and e.fields["test"] == "GPU Memory"
    assert "row remappings are pending" in e.quote.text
    assert e.quote.text == text.split("\n")[e.quote.line - 1]


def test_a_bare_fail_row_outside_dcgms_box_is_not_a_gpu_fault(tmp_path):
    # a markdown table of test results pasted in a report is not dcgmi's
    text = "| test | result |\n|---|---|\n| test_allreduce | Fail |\n| test_broadcast | Pass |\n"
    ev, _ = _verdict(tmp_path, text)
    assert not ev.events_of("dcgm_diag_fail")


def test_an_absurdly_long_number_in_nvidia_smi_is_no_number_not_infinity():
    # A mutated table (found by tests/core/test_fuzz.py): float() of 400 digits is inf, which no playbook can round.
    from hangdx.playbooks import engine
    from hangdx.probes.bundle import evidence_from_paths

    row = "| N/A   45C    P0   " + "9" * 400 + "W / 400W |  79000MiB / 81920MiB |    100%      Default |\n"
    ev = evidence_from_paths(["-"], stdin=row.encode())
    assert all(g.power_w is None or g.power_w < 1e12 for g in ev.gpus)
    assert not [g for g in engine.run(ev).gaps if g.startswith("playbook ")]
