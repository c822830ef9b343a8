"""A pass block's fixed cost: packed batches of short sequences with and without state I/O.

For each row (inputs as bench/bench_gdn.py draws them; `NxL` = N sequences of L tokens, e.g.
8x64 at 16/16 heads is one wave of 128 one-chunk blocks), times flashgdn's forward (CUDA
graph, median) four ways: the default; without the entering and final state
(`initial_state=None`, `output_final_state=False`); with the entering state only; and with
the cp.async 128-column pass (`FLASHGDN_COLS_TMA=0`) in place of the TMA pass. Growing L at a
fixed block count separates a block's fixed cost from its chunk steps (docs/perf-notes.md
version 52).

    python bench/bench_block_cost.py --models 16/16,8/32 --seqs 8x64,8x128,8x256,8x1024,8x4096
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gdn as bg  # noqa: E402
from bench_cp import env  # noqa: E402

VARIANTS: Tuple[Tuple[str, Dict[str, str], bool, bool], ...] = (
    ("default", {}, True, True),
    ("no state I/O", {}, False, False),
    ("entering state only", {}, True, False),
    ("COLS_TMA=0", {"FLASHGDN_COLS_TMA": "0"}, True, True),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="16/16,8/32")
    ap.add_argument("--seqs", default="8x64,8x128,8x256,8x1024,8x4096")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    import torch
    import flashgdn

    timer = bg.Timer(warmup=5, reps=args.reps, max_seconds=2.0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, flashgdn "
          f"{flashgdn.__version__}; us a call (CUDA graph, median)")
    print("| h_qk/h_v | sequences | " + " | ".join(v[0] for v in VARIANTS) + " |")
    print("|" + "---|" * (2 + len(VARIANTS)))
    for label in args.seqs.split(","):
        for model in args.models.split(","):
            row = bg.build_rows("fwd", [model], [label], seed=0)[0]
            x: Dict[str, Any] = bg.make_inputs(row, seed=0)
            cells = [model, label]
            for _, settings, with_h0, with_final in VARIANTS:
                with env(settings):  # bench_cp's: the FLASHGDN_* switches it knows, then these
                    def fwd() -> object:
                        return flashgdn.chunk_gated_delta_rule(
                            x["q"], x["k"], x["v"], x["g"], x["beta"],
                            initial_state=x["h0"] if with_h0 else None,
                            output_final_state=with_final, cu_seqlens=x["cu32"],
                            cu_seqlens_cpu=x["cu_cpu"])
                    fwd()
                    torch.cuda.synchronize()
                    cells.append(f"{timer.time(fwd)[0] * 1e3:.1f}")
            print("| " + " | ".join(cells) + " |", flush=True)
            del x
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
