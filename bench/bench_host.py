"""Host cost of one eager forward call: flashgdn beside FLA, in one process.

What a caller that does not replay a CUDA graph pays on the CPU per call (chunked prefill
run eagerly, a layer at a time): for each row, the median time to enqueue one call with the
GPU drained first (`enqueue`: the Python layer, argument checks, the planner, the launches),
and the wall time per call of 50 calls back to back (`eager`: the larger of the host's and
the GPU's time). Inputs as bench/bench_gdn.py (cu_seqlens and its host copy, an initial
state, the final state out); `graph` is bench_gdn's CUDA-graph median for reference.
FLASHGDN_PLAN_CACHE=0 adds flashgdn's columns without the plan cache (launch.cu).
`--decode-batch 1,64` also times decode (fused_recurrent_gated_delta_rule_update, one token
a sequence, a pool of twice the batch's slots) at each model's heads: flashgdn only.

    python bench/bench_host.py                                  # default rows
    python bench/bench_host.py --models 2/8,16/48 --seqs 1x2048,28672+4096
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gdn as bg  # noqa: E402

MODELS = ("2/8", "16/48")
ROWS = ("1x2048", "1x32768", "28672+4096", "1024x8")


def median_enqueue_us(fn: Callable[[], object], n: int) -> float:
    import torch
    ts: List[float] = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[n // 2] * 1e6


def eager_us(fn: Callable[[], object], n: int = 50) -> float:
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seqs", default=",".join(ROWS))
    ap.add_argument("--n", type=int, default=100, help="enqueues per median")
    ap.add_argument("--decode-batch", default="",
                    help="decode batch sizes to time as well, e.g. 1,64 (one token each)")
    args = ap.parse_args()

    import torch
    import flashgdn
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
    except Exception as exc:  # noqa: BLE001 - FLA is optional here
        fla_fn = None
        print(f"FLA not available ({exc}): no FLA columns")
    timer = bg.Timer(warmup=5, reps=30, max_seconds=2.0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, flashgdn "
          f"{flashgdn.__version__}; us a call")
    head = ["h_qk/h_v", "sequences", "flashgdn graph", "flashgdn enqueue", "flashgdn eager",
            "no plan cache: enqueue", "eager"]
    if fla_fn is not None:
        head += ["FLA graph", "FLA enqueue", "FLA eager"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in bg.build_rows("fwd", args.models.split(","), args.seqs.split(","), seed=0):
        x = bg.make_inputs(row, seed=0)

        def ours() -> object:
            return flashgdn.chunk_gated_delta_rule(
                x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                output_final_state=True, cu_seqlens=x["cu32"], cu_seqlens_cpu=x["cu_cpu"])

        cells: Dict[str, float] = {}
        for _ in range(3):
            ours()
        cells["g"] = timer.time(ours)[0] * 1e3
        cells["q"] = median_enqueue_us(ours, args.n)
        cells["e"] = eager_us(ours)
        os.environ["FLASHGDN_PLAN_CACHE"] = "0"
        try:
            cells["q0"] = median_enqueue_us(ours, args.n)
            cells["e0"] = eager_us(ours)
        finally:
            os.environ.pop("FLASHGDN_PLAN_CACHE", None)
        out = [row.model.key, row.seq_label] + [f"{cells[k]:.0f}" for k in
                                                ("g", "q", "e", "q0", "e0")]
        if fla_fn is not None:
            def fla() -> object:
                return fla_fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                              output_final_state=True, cu_seqlens=x["cu64"],
                              cu_seqlens_cpu=x["cu_cpu"])
            for _ in range(3):
                fla()
            out += [f"{timer.time(fla)[0] * 1e3:.0f}", f"{median_enqueue_us(fla, args.n):.0f}",
                    f"{eager_us(fla):.0f}"]
        print("| " + " | ".join(out) + " |", flush=True)
    batches = [int(b) for b in args.decode_batch.split(",") if b]
    if batches:
        print("\n| h_qk/h_v | decode batch | graph | enqueue | eager |\n|---|---|---|---|---|")
    for key in args.models.split(",") if batches else []:
        hq, hv = (int(x) for x in key.split("/"))
        for bsz in batches:
            gen = torch.Generator(device="cuda").manual_seed(0)

            def rnd(*shape: int) -> "torch.Tensor":
                return torch.randn(*shape, device="cuda", generator=gen)
            q, k = rnd(bsz, 1, hq, 128).bfloat16(), rnd(bsz, 1, hq, 128).bfloat16()
            v = rnd(bsz, 1, hv, 128).bfloat16()
            g, beta = -rnd(bsz, 1, hv).abs() / 16, rnd(bsz, 1, hv).sigmoid()
            pool = rnd(2 * bsz, hv, 128, 128) * 0.1
            idx = torch.arange(bsz, device="cuda", dtype=torch.int32) * 2

            def dec() -> object:
                return flashgdn.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta,
                                                                       pool, idx)
            for _ in range(3):
                dec()
            print(f"| {key} | {bsz} | {timer.time(dec)[0] * 1e3:.0f} | "
                  f"{median_enqueue_us(dec, args.n):.0f} | {eager_us(dec):.0f} |", flush=True)


if __name__ == "__main__":
    main()
