"""One flashgdn forward call (or forward + backward, `--mode bwd`) on a benchmark row under
Nsight Compute, summarised per kernel.

Runs `ncu` on a child process that makes one eager forward call (inputs as bench_gdn.py
draws them, after two warm-up calls outside the profiled range) and prints, for each kernel
whose name matches `--kernels`, its duration, DRAM / L2 traffic, instruction count, issue
and occupancy figures, tensor-pipe instructions and the warp stall reasons, largest first.
ncu locks the clocks and serialises the kernels (no overlap between streams or programmatic
dependents), so durations are longer than the CUDA-graph timings of bench_gdn.py; compare
kernels with each other, not with those timings.

    python bench/ncu_summary.py --model 4/16 --seqs 1x32768 --kernels "wy_batched|seg_scan"
    python bench/ncu_summary.py --csv saved.csv        # summarise a saved ncu CSV again
    python bench/ncu_summary.py --mode bwd --model 16/32 --seqs 8k_1seq --kernels grad_chunk

`--source` instead profiles one launch of the first matching kernel (`--launch-skip` the
launches before it) with ncu's source counters and prints where its warps wait, per
instruction (SASS): the stall reasons' shares, the shares by opcode and the most-sampled
instructions with the ones before them (docs/perf-notes.md version 33: the 128-column
step's mbarrier wait, a scan level's flags). `--source-csv` re-reads a saved export.

    python bench/ncu_summary.py --source --kernels state_fwd_cols --launch-skip 1
    FLASHGDN_COLS_STAGES=3 python bench/ncu_summary.py --source --kernels state_fwd_cols \
        --launch-skip 1 --save-source s3.csv

docs/perf-notes.md version 32 quotes its figures for wy_batched_kernel, the 128-column pass
and seg_scan_kernel.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from collections import OrderedDict
from typing import Dict, List, Tuple

STALLS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle",
          "long_scoreboard", "math_pipe_throttle", "membar", "mio_throttle", "misc",
          "no_instruction", "not_selected", "selected", "short_scoreboard", "sleeping",
          "tex_throttle", "wait")
STALL_PREFIX = "smsp__average_warp_latency_issue_stalled_"
METRICS = [
    "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_bytes.sum",
    "sm__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed_pipe_tensor.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "sm__cycles_elapsed.avg",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
] + [f"{STALL_PREFIX}{s}.ratio" for s in STALLS]

CHILD = """
import sys, torch, flashgdn
sys.path.insert(0, {bench!r})
import bench_gdn as bg
row = bg.build_rows({mode!r}, [{model!r}], [{seqs!r}], seed=0)[0]
x = bg.make_inputs(row, seed=0)
def fwd():
    return flashgdn.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
        initial_state=x["h0"], output_final_state=True, cu_seqlens=x["cu32"],
        cu_seqlens_cpu=x["cu_cpu"])
names = ("q", "k", "v", "g", "beta", "h0")
leaves = {{n: x[n].clone().requires_grad_() for n in names}} if {mode!r} == "bwd" else {{}}
gen = torch.Generator(device="cuda").manual_seed(1)
def bwd():  # forward + backward through (o, final state), cotangents as bench_gdn.py's
    o, ht = flashgdn.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"],
        leaves["g"], leaves["beta"], initial_state=leaves["h0"], output_final_state=True,
        cu_seqlens=x["cu32"], cu_seqlens_cpu=x["cu_cpu"])
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, device="cuda", generator=gen) / 8
    return torch.autograd.grad((o, ht), [leaves[n] for n in names], (do, dht))
call = {mode}
for _ in range(2):
    call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
"""


def parse(lines: List[str]) -> "OrderedDict[Tuple[str, str], Dict[str, Tuple[str, str]]]":
    """ncu --csv rows (one metric a row) -> {(launch id, kernel): {metric: (value, unit)}}."""
    rows = csv.DictReader(line for line in lines if line.startswith('"'))
    out: "OrderedDict[Tuple[str, str], Dict[str, Tuple[str, str]]]" = OrderedDict()
    for r in rows:
        key = (r["ID"], r["Kernel Name"].split("(")[0].replace("void ", ""))
        out.setdefault(key, {})[r["Metric Name"]] = (r["Metric Value"], r["Metric Unit"])
    return out


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def report(kernels: "OrderedDict[Tuple[str, str], Dict[str, Tuple[str, str]]]") -> None:
    for (launch, name), m in kernels.items():
        def get(metric: str) -> float:
            return number(m.get(metric, ("nan", ""))[0])
        print(f"== launch {launch}: {name}")
        print(f"   time {get('gpu__time_duration.sum') / 1e3:.1f} us, "
              f"DRAM read {get('dram__bytes_read.sum') / 1e6:.1f} MB, "
              f"write {get('dram__bytes_write.sum') / 1e6:.1f} MB "
              f"({get('dram__throughput.avg.pct_of_peak_sustained_elapsed'):.0f}% of peak), "
              f"L2 {get('lts__t_bytes.sum') / 1e6:.1f} MB")
        print(f"   {get('sm__inst_executed.sum') / 1e6:.2f} M warp instructions, issue active "
              f"{get('smsp__issue_active.avg.pct_of_peak_sustained_active'):.0f}%, warps active "
              f"{get('sm__warps_active.avg.pct_of_peak_sustained_active'):.0f}%, tensor "
              f"{get('smsp__inst_executed_pipe_tensor.sum') / 1e6:.2f} M, shared bank conflicts "
              f"{get('l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum') / 1e6:.2f} M")
        # shared-memory wavefronts: one an SM a cycle at most (the SMs the kernel ran on)
        sms = get("sm__cycles_elapsed.avg")
        print(f"   shared wavefronts {get('l1tex__data_pipe_lsu_wavefronts_mem_shared.sum') / 1e6:.1f} M "
              f"({get('l1tex__data_pipe_lsu_wavefronts_mem_shared.sum') / (132 * sms) * 100:.0f}% "
              f"of one a cycle on 132 SMs), tensor pipe (HMMA) active "
              f"{get('sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'):.0f}%")
        stalls = sorted(((get(f"{STALL_PREFIX}{s}.ratio"), s) for s in STALLS), reverse=True)
        print("   stalls (cycles a warp instruction): " +
              ", ".join(f"{s} {v:.0f}" for v, s in stalls[:8] if v == v and v > 0))


def source_rows(lines: List[str]) -> Tuple[List[str], List[List[str]]]:
    """ncu --page source --csv (after its kernel-name line) -> header, rows."""
    rows = list(csv.reader(line for line in lines if line.startswith('"')))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[start], rows[start + 1:]


def source_report(lines: List[str], top: int = 20, context: int = 6) -> None:
    """Where the warps of a source-counter profile wait: stall reasons, opcodes, lines."""
    hdr, data = source_rows(lines)
    ix = {h: i for i, h in enumerate(hdr)}
    samples_col = "Warp Stall Sampling (All Samples)"
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    samples = [number(r[ix[samples_col]]) if r[ix[samples_col]] else 0.0 for r in data]
    total = sum(samples) or 1.0
    print(f"{int(total)} warp samples over {len(data)} SASS instructions")
    by_reason = {c: sum(number(r[ix[c]]) for r in data if r[ix[c]]) for c in stall_cols}
    print("   stalls: " + ", ".join(f"{c[6:]} {v / total * 100:.1f}%" for c, v in
                                    sorted(by_reason.items(), key=lambda kv: -kv[1])[:10]))
    by_op: Dict[str, float] = {}
    for r, s in zip(data, samples):
        words = r[ix["Source"]].split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (
            words[0] if words else "?")
        by_op[op.split(".")[0]] = by_op.get(op.split(".")[0], 0.0) + s
    print("   by opcode: " + ", ".join(f"{o} {v / total * 100:.1f}%" for o, v in
                                       sorted(by_op.items(), key=lambda kv: -kv[1])[:12]))
    order = sorted(range(len(data)), key=lambda i: -samples[i])
    print(f"   the {top} most-sampled instructions (share, executions, SASS, top reasons):")
    for i in order[:top]:
        r = data[i]
        reasons = sorted(((number(r[ix[c]]) if r[ix[c]] else 0.0, c[6:]) for c in stall_cols),
                         reverse=True)[:3]
        print(f"   {samples[i] / total * 100:5.2f}% {r[ix['Instructions Executed']]:>9} "
              f"{r[ix['Source']][:64]:64s} " + " ".join(f"{c}={v:.0f}" for v, c in reasons if v))
    for i in order[:3]:
        print(f"   -- before the instruction at {data[i][ix['Address']]}:")
        for r in data[max(0, i - context):i + 1]:
            print(f"      {r[ix[samples_col]]:>6} {r[ix['Instructions Executed']]:>9} "
                  f"{r[ix['Source']][:80]}")


def run_source(args: argparse.Namespace, child: str) -> None:
    """One launch under ncu's source counters, exported as the source page's CSV."""
    with tempfile.TemporaryDirectory() as tmp:
        rep = os.path.join(tmp, "source")
        cmd = [args.ncu, "--profile-from-start", "off", "-k", f"regex:{args.kernels}",
               "--launch-skip", str(args.launch_skip), "--launch-count", "1",
               "--section", "SourceCounters", "--section", "WarpStateStats",
               "--import-source", "no", "-f", "-o", rep, sys.executable, "-c", child]
        ran = subprocess.run(cmd, capture_output=True, text=True)
        if ran.returncode != 0:
            sys.exit(f"ncu failed ({ran.returncode}):\n{ran.stderr[-2000:]}")
        out = subprocess.run([args.ncu, "--import", rep + ".ncu-rep", "--page", "source",
                              "--csv", "--print-source", "sass"], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"ncu export failed ({out.returncode}):\n{out.stderr[-2000:]}")
    if args.save_source:
        with open(args.save_source, "w") as f:
            f.write(out.stdout)
    source_report(out.stdout.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="4/16", help="h_qk/h_v, e.g. 2/8")
    ap.add_argument("--seqs", default="1x32768", help="a bench_gdn.py sequence label")
    ap.add_argument("--kernels", default="wy_batched|seg_scan|state_fwd_cols",
                    help="regular expression on kernel names")
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="fwd",
                    help="bwd: one forward + backward call (a backward row's label, e.g. 8k_1seq)")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--save", default=None, help="also write ncu's CSV here")
    ap.add_argument("--csv", default=None, help="summarise this saved CSV instead of running")
    ap.add_argument("--source", action="store_true",
                    help="source counters of one launch: where its warps wait, per instruction")
    ap.add_argument("--launch-skip", type=int, default=0,
                    help="--source: matching launches to skip before the profiled one")
    ap.add_argument("--save-source", default=None, help="--source: also write the export here")
    ap.add_argument("--source-csv", default=None,
                    help="summarise this saved source-page export instead of running")
    args = ap.parse_args()
    if args.source_csv:
        with open(args.source_csv) as f:
            source_report(f.read().splitlines())
        return
    if args.csv:
        with open(args.csv) as f:
            report(parse(f.read().splitlines()))
        return
    child = CHILD.format(bench=os.path.dirname(os.path.abspath(__file__)), model=args.model,
                         seqs=args.seqs, mode=args.mode)
    if args.source:
        run_source(args, child)
        return
    cmd = [args.ncu, "--profile-from-start", "off", "-k", f"regex:{args.kernels}",
           "--metrics", ",".join(METRICS), "--csv", sys.executable, "-c", child]
    ran = subprocess.run(cmd, capture_output=True, text=True)
    if ran.returncode != 0:
        sys.exit(f"ncu failed ({ran.returncode}):\n{ran.stderr[-2000:]}")
    if args.save:
        with open(args.save, "w") as f:
            f.write(ran.stdout)
    report(parse(ran.stdout.splitlines()))


if __name__ == "__main__":
    main()
