"""Per-kernel GPU time of flashgdn's forward or forward + backward on benchmark rows.

For each row (inputs as bench/bench_gdn.py draws them), runs the call a few times under
torch.profiler and prints, per CUDA kernel, the mean time per call and its share of the
call's kernel time. This is where docs/perf-notes.md's per-kernel figures come from.

    python bench/profile_kernels.py --mode fwd --models 2/8,16/32 --seqs 1x32768,8192x4
    python bench/profile_kernels.py --mode bwd --models 16/32 --seqs 32k_1seq

`--trace` instead captures the call in a CUDA graph (as the benchmarks time it), prints
the replay's median time and the timeline of one replay: each kernel's start (us from the
first kernel) and duration, which shows the gaps between kernels and what runs beside
what. `--cu-seqlens-cpu` hands flashgdn the host copy of cu_seqlens, as bench_gdn.py does;
`--keep-for-backward` times fwd + bwd with the forward keeping its records.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gdn as bg  # noqa: E402


def kernel_times(fn: Callable[[], Any], calls: int) -> List[Tuple[str, float]]:
    """[(kernel name, ms per call)], largest first, over `calls` calls after a warm-up."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total: Dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            name = ev.name.split("(")[0].split("<")[0].replace("void ", "").strip()
            total[name] += ev.device_time / 1e3  # us -> ms
    return sorted(((k, v / calls) for k, v in total.items()), key=lambda kv: -kv[1])


def graph_trace(fn: Callable[[], Any]) -> Tuple[float, List[Tuple[float, float, str]]]:
    """(median ms of graph replays as bench_gdn.py times them, [(start us, duration us,
    kernel)] of one replay under the profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    median_ms = bg.Timer(warmup=10, reps=100, max_seconds=0.3).time(fn)[0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                 key=lambda e: e.time_range.start)
    t0 = evs[0].time_range.start if evs else 0
    line = [(e.time_range.start - t0, e.time_range.end - e.time_range.start,
             e.name.split("(")[0].replace("void ", "").strip()) for e in evs]
    return median_ms, line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--models", default="2/8")
    ap.add_argument("--seqs", default="1x32768")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--trace", action="store_true", help="timeline of one CUDA-graph replay")
    ap.add_argument("--cu-seqlens-cpu", action="store_true",
                    help="hand flashgdn the host copy of cu_seqlens")
    ap.add_argument("--keep-for-backward", action="store_true",
                    help="bwd: the forward keeps its records for the backward")
    args = ap.parse_args()

    import torch
    import flashgdn

    for row in bg.build_rows(args.mode, args.models.split(","), args.seqs.split(","), seed=0):
        x = bg.make_inputs(row, seed=0)
        kw = dict(initial_state=x["h0"], output_final_state=True, cu_seqlens=x["cu64"])
        if args.cu_seqlens_cpu:
            kw["cu_seqlens_cpu"] = x["cu_cpu"]
        if args.keep_for_backward:
            kw["keep_for_backward"] = True
        if args.mode == "fwd":
            fn = lambda: flashgdn.chunk_gated_delta_rule(  # noqa: E731
                x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        else:
            leaves = [x[k].detach().clone().requires_grad_() for k in ("q", "k", "v", "g", "beta", "h0")]

            def fn() -> Any:
                q, k, v, g, beta, h0 = leaves
                o, ht = flashgdn.chunk_gated_delta_rule(
                    q, k, v, g, beta, **{**kw, "initial_state": h0})
                return torch.autograd.grad((o, ht), leaves, (x["do"], x["dht"]))
        if args.trace:
            ms, line = graph_trace(fn)
            print(f"\n## {args.mode} {row.model.key} {row.seq_label}: graph replay {ms:.3f} ms "
                  "(median); one replay's kernels (start us, duration us):")
            for start, dur, name in line:
                print(f"  {start:9.1f} {dur:8.1f}  {name}")
            continue
        rows = kernel_times(fn, args.calls)
        tot = sum(ms for _, ms in rows)
        print(f"\n## {args.mode} {row.model.key} {row.seq_label}: {tot:.3f} ms of kernels per call")
        print("| kernel | ms | share |\n|---|---|---|")
        for name, ms in rows:
            if ms >= 0.002:
                print(f"| {name} | {ms:.3f} | {100 * ms / tot:.0f}% |")


if __name__ == "__main__":
    main()
