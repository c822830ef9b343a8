"""Per-kernel GPU time of flashgdn's forward or forward + backward on benchmark rows.

For each row (inputs as bench/bench_gdn.py draws them), runs the call a few times under
torch.profiler and prints, per CUDA kernel, the mean time per call and its share of the
call's kernel time. This is where docs/perf-notes.md's per-kernel figures come from.

    python bench/profile_kernels.py --mode fwd --models 2/8,16/32 --seqs 1x32768,8192x4
    python bench/profile_kernels.py --mode bwd --models 16/32 --seqs 32k_1seq
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--models", default="2/8")
    ap.add_argument("--seqs", default="1x32768")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()

    import torch
    import flashgdn

    for row in bg.build_rows(args.mode, args.models.split(","), args.seqs.split(","), seed=0):
        x = bg.make_inputs(row, seed=0)
        kw = dict(initial_state=x["h0"], output_final_state=True, cu_seqlens=x["cu64"])
        if args.mode == "fwd":
            fn = lambda: flashgdn.chunk_gated_delta_rule(  # noqa: E731
                x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        else:
            leaves = [x[k].detach().clone().requires_grad_() for k in ("q", "k", "v", "g", "beta", "h0")]

            def fn() -> Any:
                q, k, v, g, beta, h0 = leaves
                o, ht = flashgdn.chunk_gated_delta_rule(
                    q, k, v, g, beta, initial_state=h0, output_final_state=True,
                    cu_seqlens=x["cu64"])
                return torch.autograd.grad((o, ht), leaves, (x["do"], x["dht"]))
        rows = kernel_times(fn, args.calls)
        tot = sum(ms for _, ms in rows)
        print(f"\n## {args.mode} {row.model.key} {row.seq_label}: {tot:.3f} ms of kernels per call")
        print("| kernel | ms | share |\n|---|---|---|")
        for name, ms in rows:
            if ms >= 0.002:
                print(f"| {name} | {ms:.3f} | {100 * ms / tot:.0f}% |")


if __name__ == "__main__":
    main()
