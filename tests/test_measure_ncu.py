"""Nsight Compute: the command we build and the parser, on the captured H200 anchors."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab.measure import ncu
from attnlab.shapes import AttentionShape

DATA = Path(__file__).parent / "data"
H1 = DATA / "h200-ncu-n4096-d128-h1.csv"
H32 = DATA / "h200-ncu-n4096-d128-h32.csv"

RAW_SAMPLE = '''==PROF== Connected to process 1234 (/usr/bin/python3)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum","launch__registers_per_thread","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"
"","","","","","","","","","","","byte","byte","ns","register/thread","inst"
"0","1234","python3","gpu","void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>(Flash_fwd_params)","1","7","(128, 1, 1)","(32, 1, 32)","0","9.0","104,766,208","27664896","786784","255","1.25"
"1","1234","python3","gpu","cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","100862208","22015488","416928","168","n/a"
==PROF== Disconnected from process 1234
'''


def test_anchor_csvs_parse_to_every_kernel():
    h1, h32 = ncu.parse_csv(H1), ncu.parse_csv(H32)
    assert len(h1) == 21 and len(h32) == 19
    cudnn = next(k for k in h32 if k.case == "sdpa_cudnn|causal=False|H=32")
    assert cudnn.name.startswith("cudnn_generated_fort_native_sdpa_sm90_flash_fprop")
    assert (cudnn.dram_bytes_read, cudnn.dram_bytes_write) == (100862208, 22015488)
    assert cudnn.duration_ns == 416928
    assert cudnn.grid == (132, 1, 1) and cudnn.grid_size == 132 and cudnn.threads == 384
    # the input-generation kernels ran outside any case
    assert [k.case for k in h1[:3]] == [None, None, None]


def test_cases_group_kernels_in_launch_order():
    cases = ncu.group_by_case(ncu.parse_csv(H1))
    assert list(cases) == ["eager|causal=False|H=1", "sdpa_flash|causal=False|H=1",
                           "sdpa_cudnn|causal=False|H=1", "eager|causal=True|H=1",
                           "sdpa_flash|causal=True|H=1", "sdpa_cudnn|causal=True|H=1"]
    eager = cases["eager|causal=False|H=1"]
    assert [k.name[:15] for k in eager] == ["nvjet_sm90_hsh_", "void at::native",
                                            "void at::native", "nvjet_sm90_hsh_"]
    assert sum(k.dram_bytes_read for k in eager) == 2119168 + 33561856 + 33570304 + 34620672
    flash = cases["sdpa_flash|causal=False|H=1"]
    assert [k.grid for k in flash] == [(64, 4, 1), (1024, 1, 1)]  # split-KV, then combine


def test_long_format_round_trips(tmp_path):
    kernels = ncu.parse_csv(H32)
    path = tmp_path / "again.csv"
    ncu.write_long_csv(kernels, path)
    again = ncu.parse_csv(path)
    assert [(k.id, k.name, k.case, k.grid, k.block, k.metrics) for k in again] == \
        [(k.id, k.name, k.case, k.grid, k.block, k.metrics) for k in kernels]


def test_raw_page_csv_with_units_row_and_log_lines():
    kernels = ncu.parse_csv(RAW_SAMPLE)
    assert [k.id for k in kernels] == [0, 1]
    flash, cudnn = kernels
    assert flash.dram_bytes_read == 104766208      # thousands separators removed
    assert flash.metrics["dram__bytes_read.sum"] == (104766208.0, "byte")
    assert flash.grid == (32, 1, 32) and flash.block == (128, 1, 1)
    assert flash.warp_stalls == {"long_scoreboard": 1.25}
    assert cudnn.warp_stalls == {}                 # n/a is absent, not zero
    assert cudnn.summary()["registers_per_thread"] == 168


def test_details_page_csv():
    text = ('"ID","Kernel Name","Grid Size","Block Size","Section Name","Metric Name",'
            '"Metric Unit","Metric Value"\n'
            '"0","k1","(4, 1, 1)","(32, 1, 1)","Command line profiler metrics",'
            '"dram__bytes_read.sum","byte","1,024"\n'
            '"0","k1","(4, 1, 1)","(32, 1, 1)","Command line profiler metrics",'
            '"gpu__time_duration.sum","ns","2048"\n')
    (kernel,) = ncu.parse_csv(text)
    assert (kernel.name, kernel.dram_bytes_read, kernel.duration_ns, kernel.grid_size) == \
        ("k1", 1024, 2048.0, 4)


def test_unknown_csv_is_refused():
    with pytest.raises(ValueError, match="not an ncu CSV"):
        ncu.parse_csv("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="no ncu raw-page header"):
        ncu.parse_raw_csv("x\n")


def test_profile_command_never_touches_clocks():
    command = ncu.profile_command("ncu", "/tmp/r", ["python", "-m", "attnlab.measure.ncu"])
    assert command[command.index("--clock-control") + 1] == "none"
    assert command[command.index("--cache-control") + 1] == "all"
    assert "--profile-from-start" in command and "--nvtx" in command
    metrics = command[command.index("--metrics") + 1].split(",")
    for needed in ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum",
                   "sm__warps_active.avg.pct_of_peak_sustained_active",
                   "launch__registers_per_thread", "smsp__inst_executed.sum",
                   "launch__grid_size", ncu.stall_metric("long_scoreboard")):
        assert needed in metrics
    assert command[-3:] == ["python", "-m", "attnlab.measure.ncu"]
    one_step = ncu.csv_command("ncu", ["python", "x.py"])
    assert one_step[:3] == ["ncu", "--clock-control", "none"] and "--csv" in one_step
    assert ncu.import_command("ncu", "r.ncu-rep", nvtx_names=True)[-1] == "kernel"
    assert "--set" not in command
    full = ncu.profile_command("ncu", "/tmp/r", ["python"], section_set="full")
    assert full[full.index("--set") + 1] == "full" and "--metrics" in full
    assert full[full.index("--clock-control") + 1] == "none"


def test_case_labels_round_trip():
    shape = AttentionShape(batch=2, query_heads=32, kv_heads=8, seqlen_q=1, seqlen_k=65536,
                           dtype="bf16", causal=True, window=(128, 0))
    label = ncu.case_label("sdpa_flash", "decode", shape)
    assert "/" not in label
    assert ncu.parse_case_label(label) == ("sdpa_flash", "decode", shape)
    with pytest.raises(ValueError, match="not an attnlab case label"):
        ncu.parse_case_label("eager|causal=False|H=1")


def test_cases_attach_from_renamed_names_whatever_the_decoration():
    shape = AttentionShape(seqlen_q=1024, seqlen_k=1024)
    label = ncu.case_label("eager", "prefill", shape)
    kernels = [ncu.NcuKernel(0, "gemm_a", None, None, None),
               ncu.NcuKernel(1, "softmax_b", None, None, None),
               ncu.NcuKernel(2, "stray", None, None, None)]
    renamed = [ncu.NcuKernel(0, f"{label}/", None, None, None),
               ncu.NcuKernel(1, f"default@{label}", None, None, None),
               ncu.NcuKernel(2, "stray", None, None, None)]
    ncu.attach_cases(kernels, renamed, [label])
    assert [k.case for k in kernels] == [label, label, None]
    # Outside our ranges, a name ncu spells differently in the renamed import (demangled
    # there) is no case: it would end a fwd+bwd case's unnamed backward tail.
    kernels = [ncu.NcuKernel(3, "fill_kernel", None, None, None)]
    ncu.attach_cases(kernels, [ncu.NcuKernel(3, "void fill<int>(int, T2, T3)/void fill",
                                             None, None, None)], [label])
    assert kernels[0].case is None
    # as parsed from a CSV, "label/" arrives already split into case and an empty name
    kernels = [ncu.NcuKernel(0, "gemm_a", None, None, None)]
    ncu.attach_cases(kernels, ncu.parse_raw_csv(
        '"ID","Kernel Name"\n"0","' + label + '/"\n'), [label])
    assert kernels[0].case == label


def test_launch_order_fallback_only_when_counts_add_up():
    kernels = [ncu.NcuKernel(i, f"k{i}", None, None, None) for i in range(5)]
    assert not ncu.assign_by_launch_order(kernels, [("a", 4), ("b", 2)])
    assert all(k.case is None for k in kernels)
    assert ncu.assign_by_launch_order(kernels, [("a", 4), ("b", 1)])
    assert [k.case for k in kernels] == ["a", "a", "a", "a", "b"]


def test_run_ncu_without_ncu_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NCU", raising=False)
    if ncu.find_ncu() is not None:
        pytest.skip("this machine has ncu installed in a standard folder")
    with pytest.raises(RuntimeError, match="ncu .* is not on PATH"):
        ncu.run_ncu([], tmp_path)


# ----- run_ncu end to end, with a stand-in for the ncu binary -------------------------------
FAKE_NCU = '''#!{python}
"""Stands in for ncu: runs the target for real, then serves a raw-page CSV on --import."""
import json, subprocess, sys
from pathlib import Path

args = sys.argv[1:]
if "--import" in args:
    kernels = json.loads(Path(args[args.index("--import") + 1]).read_text())
    renamed = args[args.index("--print-nvtx-rename") + 1] == "kernel"
    print('"ID","Process ID","Kernel Name","Block Size","Grid Size","dram__bytes_read.sum",'
          '"dram__bytes_write.sum"')
    print('"","","","","","byte","byte"')
    for k in kernels:
        name = k["case"] + "/" if renamed else k["name"]
        print(f'"{{k["id"]}}","1","{{name}}","(128, 1, 1)","(132, 1, 1)","{{k["read"]}}",'
              f'"{{k["write"]}}"')
    sys.exit(0)
metrics = args[args.index("--metrics") + 1]
if "stalled" in metrics and {reject_full}:
    print("==ERROR== Failed to find metric smsp__average_warps_issue_stalled_x", file=sys.stderr)
    sys.exit(1)
target = args[args.index("--force-overwrite") + 1:]
done = subprocess.run(target)
cases = json.loads(Path(target[3]).read_text())
status = json.loads(Path(target[4]).read_text())
kernels = []
for case in cases:
    if status.get(case["label"]) != "ok":
        continue
    for name, read, write in {fake_kernels}.get(case["provider"], []):
        kernels.append({{"id": len(kernels), "name": name, "case": case["label"],
                        "read": read, "write": write}})
Path(args[args.index("--export") + 1] + ".ncu-rep").write_text(json.dumps(kernels))
sys.exit(done.returncode)
'''


def fake_ncu(tmp_path, *, reject_full: bool, kernels: dict) -> str:
    import sys

    path = tmp_path / "ncu"
    path.write_text(FAKE_NCU.format(python=sys.executable, reject_full=reject_full,
                                    fake_kernels=repr(kernels)))
    path.chmod(0o755)
    return str(path)


def test_run_ncu_orchestrates_profile_import_and_join(tmp_path):
    from attnlab.measure.compare import compare_case, predict

    shape = AttentionShape(query_heads=2, kv_heads=2, seqlen_q=32, seqlen_k=32, head_dim=16,
                           dtype="fp32")
    predicted = predict("eager", shape)
    names = ["nvjet_sm90_hsh_fake", "void at::native::vectorized_elementwise_kernel<(int)8, "
             "at::native::AUnaryFunctor<float, float, float, at::native::MulFunctor<float>>>",
             "void at::native::<unnamed>::cunn_SoftMaxForward<float>", "nvjet_sm90_hsh_fake2"]
    kernels = {"eager": [(n, k.read_bytes, k.write_bytes)
                         for n, k in zip(names, predicted, strict=True)]}
    binary = fake_ncu(tmp_path, reject_full=True, kernels=kernels)
    cases = [("eager", "prefill", shape), ("sdpa_flash", "prefill", shape)]
    run = ncu.run_ncu(cases, tmp_path / "out", ncu=binary, timeout_s=120, device="cpu")
    # the full metric list was rejected, so the core set was measured, and that is said
    assert run.metrics == ncu.CORE_METRICS and "core set" in run.notes[0]
    # the CPU stand-in cannot run sdpa_flash: the target records why, the others still ran
    eager_label = ncu.case_label("eager", "prefill", shape)
    assert list(run.failed_cases) == [ncu.case_label("sdpa_flash", "prefill", shape)]
    assert "needs a CUDA GPU" in next(iter(run.failed_cases.values()))
    assert [k.case for k in run.kernels] == [eager_label] * 4
    assert not any("launch order" in note for note in run.notes)  # joined by NVTX names
    assert run.long_csv.exists() and run.raw_csv.exists()
    saved = ncu.parse_csv(run.long_csv)
    assert [(k.case, k.dram_bytes_read) for k in saved] == \
        [(eager_label, p.read_bytes) for p in predicted]
    comparison = compare_case("eager", shape, ncu.group_by_case(saved)[eager_label])
    assert comparison.kernels_match and comparison.relative_error == 0.0


def test_only_a_fwd_bwd_case_takes_the_unnamed_kernels_after_it():
    forward = ncu.case_label("attnlab", "prefill", AttentionShape(seqlen_q=64, seqlen_k=64))
    training = ncu.case_label("attnlab", ncu.FWDBWD_PHASE, AttentionShape(seqlen_q=64,
                                                                          seqlen_k=64))
    kernels = [ncu.NcuKernel(0, "before", None, None, None),
               ncu.NcuKernel(1, "_attn_fwd", forward, None, None),
               ncu.NcuKernel(2, "flush", None, None, None),
               ncu.NcuKernel(3, "_attn_fwd", training, None, None),
               ncu.NcuKernel(5, "_attn_bwd_dq", None, None, None),
               ncu.NcuKernel(4, "_attn_bwd_dkdv", None, None, None)]
    joined = ncu.join_preceding_case(kernels)
    assert [k.case for k in sorted(joined, key=lambda k: k.id)] == \
        [None, forward, None, training, training, training]
