// Context-parallel planner: decides, per call and on the host, the column block of the
// forward's state pass and how its sequences are split into segments. It only uses sizes
// the host knows without looking at device memory (N, the token count, H_v, the SM
// count), so planning never waits for the GPU and a captured CUDA graph stays valid. How
// long each sequence actually is (cu_seqlens) is applied on the device (plan_kernel), and
// whether a segment starts from a warm-up or from its exact entering state is decided on
// the device from the gates (segment_start in csrc/cuda/fwd_kernels.cuh).
//
// Auto mode picks the cheapest plan under a small cost model of the state pass
// (ForwardCost): a plan's time is, per launch, the larger of its critical path (the
// longest chain of chunk steps one block runs) and its total block-steps spread over the
// SMs. Splitting shortens the critical path at the price of warm-up chunks and, for heads
// whose gates do not forget within a warm-up, a summary pass over the segment (its
// transition and local state) and a sequential combine over the segments.
#pragma once

#include <algorithm>
#include <cstdint>

namespace flashgdn {

enum class CpMode { Auto, Off, On };

struct SegmentPlan {
  int64_t seg_chunks = 1;    // chunks per segment
  int64_t max_segments = 0;  // upper bound on the segments of all sequences (grid size)
  bool split = false;        // whether any sequence can be split
  int col_block = 32;        // value columns per block of the state pass: 16 or 32
                             //   (state_fwd_f16_kernel and the others), 128 (forward only:
                             //   state_fwd_cols_kernel, all columns of a head per block)
  bool cols = false;         // 128 was a candidate (SegmentQuery::allow_cols)
  double est_us = 0.0;       // the cost model's estimate of the state pass
  // the overlapped schedule (ForwardCost::overlap; host-made split plans at column block 128
  // only): the warm-started phase 0 beside the exact heads' chain, whose phase 0 runs as
  // nsub sub-segments
  bool overlap = false;
  int nsub = 1;
  // overlap past one wave of blocks, without sub-segments (ForwardCost::overlap_saturated)
  bool saturated = false;
  // the sequential schedule at column block 128 (host-made plans): phase 0 in blocks of
  // p0_merge segments (SegParams::p0_merge; best_p0_merge), phase 1 and the chain in the
  // plan's segments
  int p0_merge = 1;
  // exact segments' outputs by correction (SegParams::corr): phase 1 gives their local
  // outputs and effective queries, seg_correct_kernel adds Q_eff S_in after the combine, and
  // their phase 0 does not run (no sub-segments then)
  bool corr = false;
  // varlen Auto: the host does not know the lengths, so when a split may pay off it sizes
  // the grids for segments of seg_chunks (the shortest candidate) and the device
  // (plan_kernel) picks the segment length, or none, from the actual lengths.
  bool device_choice = false;
  // varlen Auto with several sequences: the host's column block assumed the worst case (one
  // sequence holding every token); the device picks 16 or 32 from the actual lengths, both
  // kernels are launched and the one not chosen returns at once. Also set with
  // device_choice (then the device picks the column block with the segment length).
  bool device_col_block = false;
  // device_choice at column block 128 where a split's blocks may fit in one wave beside
  // each other (at least N + 1 segments per head) and one sequence of all the tokens would
  // run overlapped (planner.cpp): the host launches the overlapped schedule's two streams,
  // with nsub sub-segments (none where that sequence's plan is the saturated one), and the
  // device picks the schedule with the split
  // (plan_kernel): a sequential split then runs every phase-0 block in the chain's launch
  // (the other returns at once) and no sub-segments. 16 and 32 columns only unsplit then.
  // Without it, the device's splits run sequentially. (H100, 2/8 heads, 6144 + 2048
  // tokens: sequential split 0.298 ms, overlapped 0.221.)
  bool device_overlap = false;
  // A sequential 128-column split in kReachSegChunks-chunk segments (ForwardCost::
  // reach_seg_longest): a segment whose warm-up would reach the sequence's start starts exact
  // from the chain instead of from h0 (SegParams::exact_reach)
  bool exact_reach = false;
  // device_col_block: the column blocks the device may pick (col_block_bit), the others'
  // kernels are not launched. A column block is left out when its least possible cost (the
  // work term at the fewest chunks the tokens make) exceeds a bound on the cost of what the
  // device will choose: its empty blocks would cost time (H100, 8/32 heads 8192 x 4:
  // 16- and 32-column kernels of ~6400 and ~12800 blocks that return at once took 0.11 ms).
  int device_col_blocks = 0;
  // device_choice made on the host from the caller's copy of cu_seqlens (launch.cu
  // plan_forward, the forward): the count of the chosen segments at those lengths (0:
  // unknown). The looped passes then launch that many slots, about a block per segment, in
  // place of a wave of slots walking the device's list (SegParams::host_slots). Buffers stay
  // sized by max_segments: a host copy that does not match cu_seqlens only slows the call.
  int64_t host_segments = 0;
  // ... and that choice also tried the lengths that cut the longest sequence into exactly m
  // segments (device_choice_on_host's exact_counts; state_pass_params presets the same one)
  bool host_exact = false;
};

// A column block's bit in SegmentPlan::device_col_blocks (16 -> 1, 32 -> 2, 128 -> 8).
inline constexpr int col_block_bit(int bw) { return bw / 16; }

struct SegmentQuery {
  int64_t N = 0;              // sequences
  int64_t total_chunks = 0;   // upper bound on the chunks of all sequences together
  int64_t fixed_chunks = -1;  // chunks of every sequence (fixed length), -1 for varlen
                              //   (a single packed sequence: pass its exact chunks here)
  int64_t Hv = 0;             // value heads
  int sms = 132;              // streaming multiprocessors
  CpMode mode = CpMode::Auto;
  int64_t forced_seg_chunks = 0;  // CpMode::On: chunks per segment (0: a quarter of the longest);
                                  //   CpMode::Auto: the only length tried (0: the candidates)
  int forced_col_block = 0;       // 16, 32 or 128 forces the column block (0: the planner picks;
                                  //   128 only where allowed)
  bool allow_cols = false;        // column block 128 (state_fwd_cols_kernel) is available
  // varlen: the caller's bound on the longest sequence in chunks (max_seqlen), -1 unknown.
  // Only the cost estimates read it (the longest sequence otherwise assumed to hold every
  // chunk); grid sizes and whether phase 1 runs never depend on it, so every plan stays
  // valid whatever the lengths are.
  int64_t longest_hint = -1;
  // packed sequences (varlen, N > 1): the device-choice plan (SegmentPlan::device_choice)
  // wherever a split is a candidate, also where the worst-case estimates (one sequence of
  // every chunk) keep them unsplit. For the caller who knows the lengths (launch.cu
  // host_split_plan: the host copy of cu_seqlens), who keeps that plan only where its choice at
  // the actual lengths is a split.
  bool device_choice_anyway = false;
};

// Shortest segment Auto mode creates: the warm-up (up to 16 chunks) must stay a
// small part of a segment's work. (Measured at 2/8 x 8192, column block 128: segments of
// 24 chunks 0.286 ms, 32 0.321, 16 0.311.)
constexpr int64_t kMinSegChunks = 24;
// ... and the sequential 128-column splits' shorter length (ForwardCost::reach_seg_longest)
constexpr int64_t kReachSegChunks = 16;
// ... and on the overlapped schedule, for sequences of at least kMinOverlapLongest chunks
// (H200, 2026-11-26, 2/8 heads: 8192 tokens in segments of 18 or 20 chunks 0.140 ms, of 24
// 0.152; 16384 tokens in 20 chunks 0.195, 24 0.197; segments of 16 no longer fit the
// overlapped schedule's wave there, 0.234)
constexpr int64_t kMinOverlapSegChunks = 18;
constexpr int64_t kMinOverlapLongest = 128;
// ... the forward's from 64 chunks (ForwardCost::short_seg_longest; H100, 2026-11-26, one
// sequence, CUDA graphs, ms, from 128 -> from 64: 16/16 x 4096 0.194 -> 0.156 (three segments
// of 22), 4/16 x 4096 0.171 -> 0.144, 8/24 x 4096 0.186 -> 0.165, 4/16 x 6144
// 0.187 -> 0.163, 2/8 x 7168 0.161 -> 0.132, 16/48 x 7168 0.393 -> 0.349; no row of 2/8 ..
// 16/64 x 3072 .. 16384 slower; the backward's passes keep kMinOverlapLongest, unmeasured)
constexpr int64_t kMinShortSegLongest = 64;
// ... and with exact outputs by correction (SegmentPlan::corr; candidates 12, 16, 24, ...)
constexpr int64_t kMinCorrSegChunks = 12;
// The value heads from which the forward's 128-column pass forms the WY part in its own
// warpgroup (state_fwd_tma_kernel's kWy, launch.cu cols_tma_wy), and from which it does so
// on the one-wave overlapped schedule too (there only in three or more segments): between the
// two the overlapped schedule runs wy_lean_kernel before a plain pass instead
// (ForwardCost::unfused_wy_us).
constexpr int64_t kTmaWyMinHeads = 16, kTmaWyOverlapHeads = 32;

// The cost model's constants, measured on H100 (docs/perf-notes.md, 2026-11-23).
struct ForwardCost {
  double step_us_bw16 = 3.3;     // one chunk step of a phase-0 block, 16 columns
  double step_us_bw32 = 4.1;     // ... 32 columns
  // ... 128 columns (state_fwd_cols_kernel; 4.0 until its ping-pong schedule, 3.6 since:
  // 1 x 4096 at 24 / 32 heads then splits at 128 columns, 10-12% faster on the H200, and
  // the packed rows it reaches are unchanged; docs/perf-notes.md version 33)
  double step_us_bw128 = 3.6;
  // The steps of 16- and 32-column blocks on the critical path of an unsplit pass whose
  // blocks all fit in one wave (N * H_v * 128 / BW <= SMs), for the forward's fp16 pass
  // (launch.cu plan_cost sets them; 0: step_us_bw16 / _bw32, which are the tf32 pass's of
  // version 5). The fp16 pass steps faster, and with the tf32 steps the planner took 128
  // columns where 32 win. H100, 2026-11-24, forward of one 2048-token sequence: 8/24 heads
  // 0.129 ms at 32 columns against 0.173 at 128 (4.0 us steps, so ~45 us besides the
  // pass): ~2.6 us; 16/16 heads 0.114 at 16 columns against 0.123 at 32: ~2.3 us. (CP off
  // at 2/8 x 32768, 64 blocks of 16 columns: ~1.05 ms of state pass for 512 steps, ~2.1 us.)
  // Three stages of copies (2026-11-24, session 22) made these steps ~10% faster (CP off:
  // 4/16 x 4096 0.195 -> 0.176 ms, 16/16 x 4096 0.212 -> 0.191): 2.3 -> 2.1 and 2.6 -> 2.35;
  // with the old 2.6, 8/24 x 4096 split at 128 columns (0.225 ms) where unsplit 32 (0.212)
  // won.
  double step_us_bw16_wave = 0.0;
  double step_us_bw32_wave = 0.0;
  // Only for sequences of at most kWaveChunks chunks, where they were measured: longer ones
  // compare with the 128-column split, whose estimate overstates its summary pass (H100,
  // 2/8 heads, 1024 + 7168 tokens: 16 columns unsplit 0.319 ms, the split 0.272).
  static constexpr double kFp16Bw16Wave = 2.1, kFp16Bw32Wave = 2.35;
  static constexpr double kWaveChunks = 64;
  double summary_factor = 0.75;  // a phase-1 (summary, no outputs) step relative to phase 0
  double warm_chunks = 5.0;      // warm-up chunks of a decaying head's segment
  double exact_share = 0.25;     // share of heads assumed to need exact entering states
  double combine_us = 3.3;       // seg_combine_kernel, per segment of a sequence (H100,
                                 //   2026-11-23: 50 us for 15 steps at 2/8 x 32768)
  double min_gain = 0.05;        // split only when it saves at least this share
  // The overlapped schedule of a split 128-column forward pass (launch.cu run_phases): the
  // phase 0 of segments that start from a warm-up runs beside the exact heads' chain, whose
  // own phase 0 is cut into nsub sub-segments after a parallel step of sub_start_us. A
  // candidate only where every block of it fits in one wave beside the others (H100,
  // 2026-11-23: 2/8 x 8192 0.247 -> 0.209 ms; where the blocks take two waves it lost, 2/8 x
  // 32768 0.426 -> 0.470). The model overstated its gain (state pass at 2/8 x 8192: 41%
  // predicted, ~19% measured; 2/8 x 16384: 29% predicted, ~4% measured), so the planner
  // takes it only when its estimate is at most overlap_margin of the best sequential plan's.
  // Since the chain's kernels are launched as programmatic dependents and sub_start_kernel
  // runs on tensor cores (2026-11-25; sub_start_us its time after the combine, 15-24 us
  // measured) the gains are larger (H100, 2/8 x 32768 in 13 segments: 0.381 -> 0.338 ms,
  // model 0.74 of sequential, measured 0.85 of the state pass; 4/16 x 16384 in 6: 0.358 ->
  // 0.342, model 0.87) and the margin went from 0.75 to 0.9.
  bool overlap = true;
  int nsub = 4;
  double sub_start_us = 15.0;
  double overlap_margin = 0.9;
  // The fit test's slack: the warm-started blocks and the exact segments' summaries may
  // exceed the SMs by this factor (the few blocks over start when the first summaries end;
  // H100, 2/8 heads 28672 + 4096 tokens in segments of 40: 88 + 48 blocks for 132 SMs,
  // 0.340 ms against 0.385 in the segments of 48 the exact test let the device take).
  double overlap_fit = 1.04;
  // The overlapped schedule where its blocks do not fit in one wave (no sub-segments:
  // estimate_saturated_overlap_us; the host's plans of known lengths and, since session 35,
  // the device's for packed sequences). History: opt-in (FLASHGDN_CP_SAT=1) until 2026-11-26.
  // With more blocks than SMs the pass is bound by its block-steps, and running the
  // warm-started blocks beside the exact chain lets them fill the SMs the chain leaves idle
  // (H200, 2026-11-25, forward, sequential -> saturated at the sequential plan's segments:
  // 4/16 heads x 32768 tokens 587 -> 565 us, 8/32 x 32768 1033 -> 1012, x 16384 571 -> 546,
  // 16/48 x 16384 884 -> 839, x 8192 462 -> 444, 16/64 x 4096 355 -> 330). Not the default:
  // where the warm-started blocks take the SMs the chain's scan levels and exact segments
  // then wait for (1 block per SM), it loses: 8/24 x 32768 811 -> 932, x 16384 474 -> 496,
  // 8/32 x 8192 336 -> 342, 16/64 x 8192 557 -> 599 (without PDL on the chain 542, but the
  // winners lose 2-6% then), and no rule in these sizes (segments, blocks, waves, the
  // chain's share) separates the two groups. sat_factor: measured over modelled block-steps
  // (0.98 and 1.08 on the first two rows); taken where its estimate is at most sat_margin
  // of the best sequential split's.
  // The default since 2026-11-26 (H200, session 35, with the walk on tensor cores and merged
  // phase-0 segments; sequential -> saturated, forward ms): taken where the estimate is at
  // most sat_margin = 0.95 of the sequential split's and the longest sequence has at least
  // sat_min_longest = 384 chunks, which keeps the measured winners, 4/16 x 32768 0.506 ->
  // 0.491 and 28672 + 4096 0.511 -> 0.497 (model 0.93 / 0.94), and leaves out the losers:
  // 8/24 x 32768 0.722 -> 0.807 (model 0.97), 8/32 x 8192 0.301 -> 0.328 and 16/32 x 8192
  // 0.322 -> 0.349 (0.92, 128 chunks); also out, 8/24 x 16384 0.410 -> 0.402 (0.90, 256
  // chunks). FLASHGDN_CP_SAT=1 (force_saturated) takes it at 0.99 of any length, =0 never.
  bool overlap_saturated = true;
  double sat_factor = 1.05;
  double sat_margin = 0.95;
  double sat_min_longest = 384;
  // Exact segments' outputs by correction (SegmentPlan::corr; host-made splits of the
  // forward's fp16 pass at 16 or 32 columns, estimate_corr_us): a phase-1 step with outputs
  // relative to a phase-0 step (H100, 2026-11-24, 2/8 x 4096, segments of 24 at 32 columns:
  // 3.1 us against the one-wave 2.6) and seg_correct_kernel's time.
  bool corr = false;
  double corr_step_factor = 1.2;
  // Phase 0 of a sequential 128-column split in merged segments (SegmentPlan::p0_merge, the
  // device's DeviceSegChoice::chosen[3]; best_p0_merge): taken where it saves p0_merge_gain
  // of phase 0's estimate.
  bool p0_merge = true;
  double p0_merge_gain = 0.03;
  // Phase 0's critical path for one sequence list-scheduled (list_schedule_steps: the last,
  // shorter block of each head fills the SMs a partial wave leaves) in place of whole waves;
  // the host's plans only (device_choice_params leaves it out), and only where its plan's
  // estimate is below p0_list_margin of the whole waves' plan, counted the same way
  // (plan_segments). The default since 2026-11-27 (session 50, H100, with the host copy, ms,
  // whole waves -> list, two rounds): 16/48 x 32768 1.285 -> 1.225, 1.279 -> 1.221 (model
  // 3.2% less), x 16384 0.723 -> 0.666, 0.726 -> 0.669 (5.4%); the margin keeps the whole
  // waves' plans of 16/48 x 8192 (model 0.7%, measured 0.396 -> 0.400), 8/24 x 16384 (1.8%,
  // 0.385 -> 0.387) and 8/24 x 32768 (the merge alone, 0%: 0.640 -> 0.646, 0.641 -> 0.638).
  // FLASHGDN_P0_LIST=0 leaves it out, =2 drops the margin.
  // Before (session 49), opt-in, without the margin. H100, 2026-11-27, with the host copy, ms whole waves
  // -> list: 16/48 x 32768 1.284 -> 1.227, x 16384 0.719 -> 0.668, but x 8192 0.392 -> 0.402,
  // 8/24 x 16384 0.374 -> 0.380, 16/16 x 16384 0.301 -> 0.304 (plans of one or two segments
  // fewer or more whose other terms, the summaries and the chain, the model counts too low).
  // Each block also pays p0_block_start there (added after those runs: it keeps the whole
  // waves' plans at 16, 32 and 64 heads and 8/24 x 8192, so of the plans measured above only
  // 16/48 x 32768, x 16384 (gains), x 8192, 8/24 x 32768, x 16384 (losses) change).
  bool p0_list = true;
  double p0_list_margin = 0.025;
  // A phase-0 block's start in chunk steps beside its chunks (its first stages' loads, the
  // initial state, the first chunk's P): exact_p0_merge's block cost. 2-4 orders the merges
  // of the 17 measured rows as the H100 did (2026-11-27); 0 picks merge 1 at 16/48 heads
  // 1024 + 7168 (0.426 ms against merge 3's 0.410).
  double p0_block_start = 3.0;
  // The host's own choice for packed sequences (device_choice_on_host's exact_counts) counts
  // every 128-column split's phase 0 as its blocks list-schedule (p0_exact_steps, the best
  // merge), not as whole waves, and takes that choice where its estimate is below
  // exact_p0_margin of the whole waves' choice (both counted from the blocks). The default
  // since 2026-11-27 (session 50, H100, ms, whole waves -> blocks, no margin): gains 16/48
  // 12288+4096 0.693 -> 0.665 (model 5.5% less), 6144+2048 0.427 -> 0.400 (10.8%), 8/32
  // 1024+7168 0.324 -> 0.318 (8.5%), 16/64 4096+28672 1.494 -> 1.434 (0.5%: left out by the
  // margin); losses 8/24 28672+4096 0.656 -> 0.675 (1.3%), 16384+16384 0.659 -> 0.681
  // (1.8%), 16/48 28672+4096 1.185 -> 1.257 (0.5%), each left out by the margin: the shorter
  // segments in merged threes it takes there cost more in the summaries and the chain than
  // the model counts. FLASHGDN_HOST_EXACT_P0=0 leaves it out, =2 drops the margin.
  bool exact_p0 = true;
  double exact_p0_margin = 0.04;
  double corr_us = 6.0;
  // 128-column segments under 32 chunks: candidates only for sequences of at least
  // short_seg_longest chunks (seg_candidate_for), the overlapped schedule's lengths down to
  // short_seg_min there (kMinOverlapSegChunks' measurements). Shorter sequences take 32+
  // (kMinShortSegLongest's measurements; docs/perf-notes.md version 47). The backward's
  // plan_cost sets kMinOverlapLongest. FLASHGDN_CP_SHORT_LONGEST / FLASHGDN_CP_SHORT_MIN
  // set them (forward; measurements).
  int64_t short_seg_longest = kMinShortSegLongest;
  int64_t short_seg_min = kMinOverlapSegChunks;
  // What the one-wave overlapped schedule pays at kTmaWyMinHeads .. kTmaWyOverlapHeads - 1
  // value heads for its WY part outside the pass (wy_lean_kernel, then the plain pass) where
  // the sequential and saturated ones form it inside (kWy): us per chunk and value head on
  // one SM (so x total chunks x heads / SMs). Without it the overlapped plan won the model
  // and lost the GPU at 16 heads from 192 chunks (H100, 2026-11-27, forward ms, overlapped ->
  // sequential: 4/16 x 16384 0.304 -> 0.271, 16/16 x 16384 0.329 -> 0.287, 4/16 28672 + 4096
  // 0.492 -> 0.426, 4096 + 28672 0.577 -> 0.424, 16/16 12288 + 4096 0.323 -> 0.286), while it
  // kept winning at 128 chunks and less (4/16 x 8192 0.192 against 0.202, x 4096 0.142
  // against 0.170 unsplit; 8/24 x 4096 0.165 against 0.202): the bounds that leaves are about
  // 1.1 to 3.8 us (model gaps / chunk-heads x 132), hence 2.0. launch.cu plan_cost sets 0
  // where kWy does not run (the backward, the tf32 passes, FLASHGDN_COLS_TMA or
  // FLASHGDN_FUSED set); FLASHGDN_UNFUSED_WY_US sets it (measurements).
  double unfused_wy_us = 2.0;
  // ... from this longest sequence (chunks) on: below it the overlapped plan measured faster
  // with its WY part outside (H100, 2026-11-27, 8/24 heads, 6144 + 2048 and 2048 + 6144 tokens
  // 0.248 ms overlapped against 0.260 sequential, 4096 + 4096 0.251 against 0.262 unsplit),
  // from it slower (8/24 x 8192 0.253 against 0.229 sequential)
  double unfused_wy_longest = 128;
  // The saturated schedule pays it too: the device's choices (device_choice_params), whose
  // launches take kWy only where the host planned that schedule itself (cols_tma_wy). H100,
  // 2026-11-27, forward ms, the device's saturated choice -> sequential: 4/16 28672 + 4096
  // 0.492 -> 0.426, 16/16 0.539 -> 0.452, 4/16 4096 + 28672 0.577 -> 0.424.
  bool saturated_unfused = false;
  // Whether the 128-column forward pass forms the WY part inside (kWy) at kTmaWyMinHeads ..
  // kTmaWyOverlapHeads - 1 value heads (launch.cu plan_cost clears it where it does not: the
  // backward, the tf32 passes, FLASHGDN_COLS_TMA or FLASHGDN_FUSED set). There the saturated
  // schedule is no candidate (sat_fused_wy false; FLASHGDN_CP_SAT=1 sets it): its own plan
  // measured no faster than the sequential one (H100, 2026-11-27, 1x32768: 4/16 0.445 against
  // 0.441, 16/16 0.475 against 0.468), and a packed batch whose worst case would be saturated
  // got the overlapped launches, whose passes take the plain pass (without the host copy,
  // CP_SAT=0: 4/16 28672+4096 0.508 -> 0.434 ms, 16384+16384 0.506 -> 0.425, 8192x4 0.505 ->
  // 0.423; 16/16 0.559 -> 0.466).
  bool fused_wy = true;
  bool sat_fused_wy = false;
  // Below kTmaWyMinHeads value heads, where kWy runs on every plan but the overlapped
  // schedule since session 57 (launch.cu cols_tma_wy), the one-wave overlapped schedule is
  // no candidate (with fused_wy) from few_heads_seq_work chunk-heads (all chunks x value
  // heads) on: the sequential split with kWy measured faster there, H100, 2026-11-27, 2/8
  // heads, ms, overlapped -> sequential (FLASHGDN_CP_OVERLAP=0): 1x32768 0.299 -> 0.276,
  // 28672+4096 0.301 -> 0.277, 24576+8192 0.297 -> 0.274, 16384+16384 0.296 -> 0.266,
  // 8192+24576 0.299 -> 0.273, 4096+28672 0.298 -> 0.276 (4096 chunk-heads); not at 2048
  // (1x16384 0.193 -> 0.194, 12288+4096 0.189 -> 0.202) or fewer (1x8192 0.132 -> 0.182,
  // 6144+2048 0.145 -> 0.190). The cost model's own estimates keep the overlapped schedule
  // there (1x32768: 202 against 272 us), its WY term (unfused_wy_term) counted only from
  // kTmaWyMinHeads. The saturated schedule likewise (unless sat_fused_wy), which FLASHGDN_CP_
  // OVERLAP=0 left out of those runs too. Measured at 8 heads only. Only where the longest
  // sequence is under few_heads_seq_longest chunks: 2/8 x 65536 (1024 chunks, before one-wave
  // overlapped) 0.515 -> 0.458 ms, 65536+65536 0.736 -> 0.740, but 2/8 x 131072 (2048 chunks,
  // before saturated) 0.727 -> 0.768 (H100, 2026-11-27).
  double few_heads_seq_work = 4096;
  double few_heads_seq_longest = 2048;
  // Sequential 128-column splits in segments of kReachSegChunks (below kMinSegChunks) where
  // the host knows the lengths and the longest sequence has at most reach_seg_longest chunks
  // (0: none), planned with SegmentPlan::exact_reach: the second segment's warm-up would
  // reach the sequence's start, which made it start from h0 and run those chunks again in
  // its phase-1 block, the chain's longest (16/32 x 8192 in 16-chunk segments: phase 1 86 us
  // as at 32-chunk ones; exact, 62 us). H100, 2026-11-27, forced 16-chunk segments with the
  // exact start against the default plan: 1x8192 at 16/16 heads 0.202 -> 0.171 ms, 4/16
  // 0.186 -> 0.161, 16/32 0.278 -> 0.262, 8/32 0.269 -> 0.255, 32/32 0.281 -> 0.264; 16/64 x
  // 4096 0.275 -> 0.250, the rows the cost model takes them on; 1x16384 (256 chunks) at
  // 4/16 and 16/16 heads, where the model would take them too, 1-2% slower: hence the bound.
  int64_t reach_seg_longest = 128;
};

#ifdef __CUDACC__
#define FLASHGDN_HD __host__ __device__
#else
#define FLASHGDN_HD
#endif

// Segments of a sequence of `chunks` chunks cut every `seg` chunks (at least one).
// Where both fit in 31 bits (every real length) the quotient comes from a 32-bit division:
// the same value, a fraction of a 64-bit division's dependent instructions on the GPU
// (plan_kernel runs it for every sequence and candidate length).
inline FLASHGDN_HD int64_t segments_of(int64_t chunks, int64_t seg) {
  if (chunks <= seg) return 1;
  if (((chunks | seg) >> 31) == 0)
    return (static_cast<uint32_t>(chunks) + static_cast<uint32_t>(seg) - 1u) /
           static_cast<uint32_t>(seg);
  return (chunks + seg - 1) / seg;
}

// Levels of the log-depth scan that forms the exact segments' entering states (the
// forward's seg_scan_kernel, launch.cu scan_levels) for a sequence of `longest` chunks cut
// every `seg` chunks: level l composes each step's prefix with the one 2^l steps before, so
// ceil(log2(steps)) levels (at least 1) cover the segments - 1 steps. 0 (the combine's walk
// instead) for a single step, or beyond max_levels.
inline int scan_levels_for(int64_t longest, int64_t seg, int max_levels) {
  const int64_t steps = segments_of(longest, seg > 0 ? seg : 1) - 1;
  if (steps < 2) return 0;
  int levels = 1;
  while ((int64_t{1} << levels) < steps) ++levels;
  return levels <= max_levels ? levels : 0;
}

// Column block of an unsplit sequential pass: 16 columns when 16-column blocks of all
// (sequence, head) pairs still fit in one wave of the SMs, else 32.
inline int unsplit_col_block(int64_t N, int64_t Hv, int sms) {
  return N * Hv * (128 / 16) <= sms ? 16 : 32;
}

// Whether the backward runs its two sequential passes (the recomputation and the reverse
// pass) in the one-block-per-head kernels (column block 128: state_fwd_cols_kernel and
// state_bwd_cols_kernel) rather than at 16 / 32 columns. The cost model is the forward's
// and does not predict the backward's passes (at 32 heads x 32768 tokens it estimates
// ~0.8 ms a pass; the recomputation takes ~1.0 and the reverse pass ~1.75), so this is
// a rule read off measurements (H100, 2026-11-24, fwd+bwd of 36 rows at 4 / 8 / 16 / 32
// value heads, 8k to 32k tokens in 1 to 4 sequences, docs/benchmarks.md "Session 23"):
// 128 columns win where the work (value
// heads x chunks, for 132 SMs) is large or one sequence is long, e.g. 32 heads x 16384
// tokens 4.81 -> 4.40 ms, 4 heads x 32768 1.74 -> 1.68, 32 heads x 4 x 4096 4.65 -> 3.74,
// and lose on short work, e.g. 4 heads x 8192 0.68 -> 1.04, 8 heads x 4 x 4096 1.27 ->
// 1.73. Of the measured rows the rule misses two: 8 heads x 12288 (1.44 at 32 columns, 1.34
// at 128) and 32 heads x 8192 in 4 sequences (2.50 against 2.54).
// Since the 128-column passes write their records in 16 bits by bulk stores (session 24,
// the 32 rows of docs/benchmarks.md "Session 24" both ways) they also win on long packed
// batches of few heads: 4 heads x 8 sequences of 32768 tokens in all (the longest 164
// chunks) 2.15 -> 1.37 ms, so a third condition: 480 chunks or more in all. Misses on those
// 32 rows: 16 heads x 8192 tokens in 1 and in 8 sequences (1.42 / 1.34 ms at 16 / 32
// columns, 1.40 / 1.23 at 128).
// Since the reverse pass runs on fp16 operands (session 25, 31 rows of 8192 to 16384 tokens
// both ways, docs/benchmarks.md "Session 25") 128 columns win on less work: at 16 heads x
// 8192 tokens (1 sequence 1.45 -> 1.20 ms, 8 sequences 1.34 -> 1.06; 2 and 4 sequences tie
// within 1.3 %), 16 heads x 16384 (2.88 -> 1.84), and with one sequence of >= 128 chunks
// from 8 heads x 8192 (0.99 -> 0.91) or 4 heads x 12288 (0.90 -> 0.81) on; not at 4 heads
// x 8192 (0.67 -> 0.74) nor at 4 heads x 4 x 4096 (0.79 -> 0.96). So the work threshold
// moves from 2560 to 2048, and a sequence of >= 128 chunks takes 128 columns from a work of
// 768 (heads x chunks, for 132 SMs). Ties left to either side: 4 heads x 16384 (1.020 /
// 1.021), 8 heads x 4 x 4096 (1.22 / 1.23), 8 heads x 8 packed sequences of 8192 tokens.
// longest: chunks of the longest sequence (or a bound on it).
inline bool backward_cols(int64_t Hv, int64_t total_chunks, int64_t longest, int sms) {
  const int64_t work = Hv * total_chunks * 132;  // for 132 SMs
  return work >= int64_t{2048} * sms || (longest >= 128 && work >= int64_t{768} * sms) ||
         longest >= 320 || total_chunks >= 480;
}

// The backward's short split's segments (chunks): backward_short_split, _avg.
constexpr int64_t kBackwardShortSeg = 12;
// The backward's short split: segments of kBackwardShortSeg chunks (0: none, the cost
// model's plan) for short work of long-enough sequences, where the reverse pass's steps,
// costlier than the forward's that the cost model counts, make shorter segments than it
// picks pay.
// Measured (H200, 2026-11-27, session 55; bwd ms, the cost model's plan -> 12-chunk segments
// in the 128-column passes, first forced by switches, then by this rule): 4/8 x 8k 0.654 ->
// 0.550, 2/4 x 8k 0.521 -> 0.461; forced, also 8/16 x 8k in four packed sequences 0.929 ->
// 0.839 and 2/4 x 8k in four 0.507 -> 0.440, which this rule does not reach (a packed
// batch's `total_chunks` is max_chunks, a partial chunk counted for every sequence: 129+).
// Forced outside the region it lost: 2/4 x 32k in eight sequences 0.805 -> 0.889, eight
// sequences of 8k tokens in all 0.363 -> 0.445, every 16/32-head row.
// `longest`: the longest sequence's chunks, known (0: unknown, no short split).
inline int64_t backward_short_split(int64_t Hv, int64_t total_chunks, int64_t longest) {
  return longest >= 32 && total_chunks <= 128 && Hv * total_chunks <= 2048 ? kBackwardShortSeg
                                                                          : 0;
}

// The short split's region by the token count and the average sequence (FLASHGDN_BWD_SHORT=2
// alone; with backward_short_split, the default): `token_chunks` = ceil(tokens / 64) of all
// sequences, n of them: at most 128 chunks of tokens, value heads x those <= 2048, and 32
// chunks or more a sequence on average. It needs no host lengths and takes the packed 8k rows
// in two and four sequences, which backward_short_split misses (a partial chunk counted per
// sequence); it leaves out eight sequences of 8k tokens in all (16 chunks on average), where
// the forced split lost. Measured (H200, 2026-11-27, session 56; bwd ms, two rounds
// alternated, backward_short_split alone -> this rule): 2/4 x 8k in 2 and 4 packed sequences
// 0.500 -> 0.482, 0.506 -> 0.443; 4/8 0.601 -> 0.572, 0.607 -> 0.538; 8/16 0.914 -> 0.864,
// 0.933 -> 0.836; the other 26 rows within 0.5% (docs/session56-bwd-short-h200.json).
inline int64_t backward_short_split_avg(int64_t Hv, int64_t token_chunks, int64_t n) {
  return n > 0 && token_chunks <= 128 && Hv * token_chunks <= 2048 && token_chunks >= 32 * n
             ? kBackwardShortSeg
             : 0;
}

// The short split for packed sequences of few value heads by the longest one (known: the
// host's cu_seqlens / max_seqlen): at most 128 chunks of tokens in all, value heads x those
// <= 1024, and the longest sequence 32 chunks or more, whatever the average. It takes eight
// packed sequences of 8192 tokens in all at 4 and 8 value heads (the longest 41 chunks),
// which the two rules above leave out (a partial chunk counted per sequence; 16 chunks on
// average). Measured (H100, 2026-11-28, session 60; bwd ms = fwd+bwd minus the forward, two
// rounds alternated, forced `FLASHGDN_CP=on FLASHGDN_CP_SEG=12 FLASHGDN_BWD_COLS=1` against
// the default plan, 16 / 32 columns unsplit): 4/8 heads 0.580 -> 0.476, 2/4 0.370 -> 0.362;
// at 8/16 heads it lost (0.733 -> 0.818), hence the 1024. Before the exact reach (session
// 55) the same forced split had lost at 2/4 (0.363 -> 0.445).
inline int64_t backward_short_split_packed(int64_t Hv, int64_t token_chunks, int64_t longest) {
  return longest >= 32 && token_chunks <= 128 && Hv * token_chunks <= 1024 ? kBackwardShortSeg
                                                                          : 0;
}

// The longest sequence's chunks as the backward's rules take them from a query: a bound
// (backward_cols: the hint where it is smaller than all chunks, else all of them), and the
// known count (the short split: fixed lengths and one packed sequence exactly, packed ones by
// the hint; 0 unknown).
inline int64_t longest_chunks_bound(const SegmentQuery& q) {
  if (q.longest_hint > 0) return std::min(q.total_chunks, q.longest_hint);
  return q.fixed_chunks >= 0 ? q.fixed_chunks : q.total_chunks;
}
inline int64_t longest_chunks_known(const SegmentQuery& q) {
  return q.fixed_chunks >= 0 ? q.fixed_chunks : std::max<int64_t>(0, q.longest_hint);
}

// FLASHGDN_BWD_SHORT's modes: 0 none, 1 backward_short_split, 2 backward_short_split_avg,
// kBackwardShortEither (the default of sessions 56-59) where either of those applies,
// kBackwardShortAll (unset, the default since session 60) where any of the three does
// (backward_short_split_packed too).
constexpr int kBackwardShortEither = 3;
constexpr int kBackwardShortAll = 4;
// The backward's short split for a query (its segment length, or 0) in `mode`
// (`token_chunks` = ceil(tokens / 64)); none where the query forces a mode or a length
// (FLASHGDN_CP, FLASHGDN_CP_SEG).
inline int64_t backward_short_seg(const SegmentQuery& q, int mode, int64_t token_chunks) {
  if (q.mode != CpMode::Auto || q.forced_seg_chunks != 0) return 0;
  const bool all = mode == kBackwardShortAll;
  const bool by_longest = mode == 1 || mode == kBackwardShortEither || all;
  const bool by_average = mode == 2 || mode == kBackwardShortEither || all;
  if (by_longest && backward_short_split(q.Hv, q.total_chunks, longest_chunks_known(q)) > 0)
    return kBackwardShortSeg;
  if (by_average && backward_short_split_avg(q.Hv, token_chunks, q.N) > 0)
    return kBackwardShortSeg;
  if (all && backward_short_split_packed(q.Hv, token_chunks, longest_chunks_known(q)) > 0)
    return kBackwardShortSeg;
  return 0;
}

// The backward's ready queue (launch.cu bwd_queue: the per-chunk gradients beside the reverse
// pass, each chunk taken as that pass completes its records) by default where value heads x
// chunks of tokens <= kReadyQueueWork. Measured (H100, 2026-11-28, session 60; bwd ms, the
// queue against FLASHGDN_BWD_QUEUE=0 and session 59's wheel, two rounds alternated): inside,
// every row of the 32 faster (2/4 x 8k 3.4-7.8%, 8/16 x 8k 2-11%, 4/8 x 8k 1.5-3%, 2/4 x 32k
// 0.6-2.8%); beyond, mixed at 16/32 x 8k and 4/8 x 32k and 2-5.5% slower on the 32k rows of
// 8/16 and 16/32 heads, where the reverse pass fills the SMs in waves.
constexpr int64_t kReadyQueueWork = 2048;
inline bool backward_ready_queue(int64_t Hv, int64_t token_chunks) {
  return Hv * token_chunks <= kReadyQueueWork;
}

// What the cost model needs of the sequences: the longest one's chunks, all chunks, and
// (split plans) the number of segments and the most segments of one sequence.
struct LoadStats {
  double longest = 0, total = 0, segs = 0, max_segs_per_seq = 1;
  // split plans whose segments are known (the device's choice): their count, each a block
  // per head of the 128-column pass; 0: the host's equivalent count of full segments
  double seg_blocks = 0;
  double seqs = 0;  // with seg_blocks: the sequences, whose first segments start from h0
};

// Smallest integer >= x, for x >= 0 (host and device).
inline FLASHGDN_HD double ceil_pos(double x) {
  const double f = static_cast<double>(static_cast<long long>(x));
  return f < x ? f + 1.0 : f;
}

// A chunk step of a bw-column block (ForwardCost::step_us_bw*), and the one-wave step of the
// fp16 pass's 16 and 32 columns (ForwardCost::step_us_bw*_wave; 0 where none, and for 128).
inline FLASHGDN_HD double step_us(const ForwardCost& c, int bw) {
  return bw == 16 ? c.step_us_bw16 : bw == 32 ? c.step_us_bw32 : c.step_us_bw128;
}
inline FLASHGDN_HD double wave_step_us(const ForwardCost& c, int bw) {
  return bw == 16 ? c.step_us_bw16_wave : bw == 32 ? c.step_us_bw32_wave : 0.0;
}

// ForwardCost::unfused_wy_us's term for `heads` value heads, s.total chunks, nsm SMs (0
// outside kTmaWyMinHeads .. kTmaWyOverlapHeads - 1 and below unfused_wy_longest).
inline FLASHGDN_HD double unfused_wy_term(const ForwardCost& c, const LoadStats& s, double heads,
                                          double nsm) {
  if (heads < kTmaWyMinHeads || heads >= kTmaWyOverlapHeads || s.longest < c.unfused_wy_longest)
    return 0.0;
  return c.unfused_wy_us * s.total * heads / nsm;
}

// Whether ForwardCost::few_heads_seq_work leaves the overlapped schedules out (the one-wave
// one; the saturated one too unless sat_fused_wy): the pass forms the WY part, under
// kTmaWyMinHeads value heads, from few_heads_seq_work chunk-heads, the longest sequence under
// few_heads_seq_longest chunks.
inline FLASHGDN_HD bool few_heads_sequential(const ForwardCost& c, const LoadStats& s,
                                             double heads) {
  return c.fused_wy && heads < kTmaWyMinHeads && s.total * heads >= c.few_heads_seq_work &&
         s.longest < c.few_heads_seq_longest;
}

// The terms of a split state pass's estimate shared by its schedules (estimate_state_pass_us,
// estimate_saturated_overlap_us): column block bw, segments of seg chunks (> 0).
struct SplitTerms {
  double t, nsm, len;
  double crit0;         // a warm-started segment's chunk steps (one wave)
  double blocks;        // 128 columns: the segments' blocks (one per SM); 0 otherwise
  double work, work0;   // block-steps over the SMs: all chunks once; phase 0 with warm-ups
  double crit1, work1;  // phase 1 (the exact heads' summaries): a segment, its block-steps
  double combine;
  double exact_blocks, warm_blocks;  // 128 columns: segments that start exact, the others
};
inline FLASHGDN_HD SplitTerms split_terms(const ForwardCost& c, const LoadStats& s, double heads,
                                          int sms, int bw, double seg) {
  SplitTerms r;
  r.t = step_us(c, bw);
  const double cbn = 128.0 / bw;
  r.nsm = sms > 0 ? sms : 1;
  r.work = s.total * heads * cbn * r.t / r.nsm;
  r.len = seg < s.longest ? seg : s.longest;
  r.crit0 = (r.len + c.warm_chunks) * r.t;
  r.blocks = 0.0;
  if (bw == 128) {
    // one block of 128 columns per SM (255 registers a thread): the segments run in waves
    // of nsm blocks, each wave as long as a full segment (packed sequences: counted as the
    // equivalent number of full segments, or their actual count where known)
    r.blocks = ceil_pos(s.total / r.len);
    r.blocks = (s.seg_blocks > r.blocks ? s.seg_blocks : r.blocks) * heads;
  }
  r.work0 = (s.total + c.warm_chunks * s.segs) * heads * cbn * r.t / r.nsm;
  const double ts = r.t * c.summary_factor;
  r.crit1 = r.len * ts;
  r.work1 = c.exact_share * 2.0 * r.work * c.summary_factor;
  r.combine = c.combine_us * s.max_segs_per_seq;
  // exact: a share of the segments, of those that do not start a sequence where the
  // segments are known
  r.exact_blocks =
      c.exact_share * (s.seg_blocks > 0 && s.seqs > 0 ? r.blocks - s.seqs * heads : r.blocks);
  r.warm_blocks = r.blocks - r.exact_blocks;
  return r;
}

// Phase 0 of a sequential 128-column split (r: split_terms at column block 128) whose blocks
// each run m segments (SegParams::p0_merge): the larger of the critical path (waves of
// blocks of m segments and a warm-up) and the block-steps over the SMs. m = 1 is the plan's
// own phase 0. Merging trades waves for longer blocks: H200, 2026-11-26, 4/16 heads x 32768
// tokens in 16 segments of 32 chunks, 256 blocks in two waves (phase 0 280 us, forward
// 0.519 ms) against 128 blocks of 64 chunks in one (269 us, 0.505 ms).
constexpr int kMaxP0Merge = 4;

// Blocks of len steps dispatched in order, each to the SM that frees first (one block an SM).
// The SMs are groups free from t[i], n[i] of them, t ascending, g groups (at most cap):
// dispatches `blocks` of them, the earliest group first, whose SMs rejoin the list at
// t[0] + len (merged with a group of that time) at once, so that later blocks may follow
// on them. Returns the blocks left undispatched: 0, unless max_steps group steps or the
// groups' capacity ran out first. (list_schedule_steps, p0_exact_steps)
inline FLASHGDN_HD double dispatch_blocks(double* t, double* n, int& g, int cap, double blocks,
                                          double len, int max_steps) {
  for (int it = 0; blocks > 0; ++it) {
    if (it >= max_steps || g == cap) return blocks;
    const double k = n[0] < blocks ? n[0] : blocks;  // the earliest group takes k blocks
    blocks -= k;
    const double tk = t[0] + len;
    n[0] -= k;
    if (n[0] <= 0) {  // drop the emptied group
      for (int i = 1; i < g; ++i) t[i - 1] = t[i], n[i - 1] = n[i];
      --g;
    }
    int i = 0;  // insert (tk, k) in time order, merged with an equal time
    while (i < g && t[i] < tk) ++i;
    if (i < g && t[i] == tk) {
      n[i] += k;
    } else {
      for (int j = g; j > i; --j) t[j] = t[j - 1], n[j] = n[j - 1];
      t[i] = tk, n[i] = k;
      ++g;
    }
  }
  return 0.0;
}

// The makespan, in chunk steps, of one-block-an-SM blocks dispatched in order, each to the SM
// that frees first: nf rounds of `heads` blocks of lf steps, then np rounds of lp (phase 0's
// blocks come a segment, all heads, at a time; a sequence's last block is the short one, and
// those are taken as one length, dispatched last). Equal lengths give whole waves,
// ceil(blocks / nsm) * lf; a last wave of short blocks, or short blocks filling the SMs a
// partial wave left free, cost less than a full wave (phase0_merged_us).
inline FLASHGDN_HD double list_schedule_steps(double heads, double nsm, double nf, double lf,
                                              double np, double lp) {
  constexpr int kGroups = 8;
  double t[kGroups], n[kGroups];  // groups of SMs free from t[i], n[i] of them, t ascending
  int g = 0;
  const double full = nf * heads;
  const double w = static_cast<double>(static_cast<long long>(full / nsm));
  const double rem = full - w * nsm;
  t[g] = w * lf, n[g++] = nsm - rem;
  if (rem > 0) t[g] = (w + 1) * lf, n[g++] = rem;
  const double left = dispatch_blocks(t, n, g, kGroups, np * heads, lp, 256);
  if (left > 0) {  // many short waves: the rest spread over the SMs
    const double tail = t[0] + ceil_pos(left / nsm) * lp;
    return tail > t[g - 1] ? tail : t[g - 1];
  }
  return g > 0 ? t[g - 1] : 0.0;
}

inline FLASHGDN_HD double phase0_merged_us(const ForwardCost& c, const LoadStats& s,
                                           const SplitTerms& r, double heads, int m) {
  const double len = m * r.len < s.longest ? m * r.len : s.longest;
  const double blocks = heads * ceil_pos(r.blocks / heads / m);
  double crit;
  if (blocks <= r.nsm) {
    crit = (len + c.warm_chunks) * r.t;
  } else if (c.p0_list && s.total <= s.longest + 1.0) {
    // one sequence (ForwardCost::p0_list): full blocks of len and the last, shorter one,
    // list-scheduled (whole waves count that block's wave as a full one: 16/48 x 16384 in
    // segments of 48, 240 blocks of 48 chunks and 48 of 17)
    const double nf = static_cast<double>(static_cast<long long>(s.longest / len));
    const double rest = s.longest - nf * len;
    const double w = c.warm_chunks + c.p0_block_start;
    crit = list_schedule_steps(heads, r.nsm, nf, len + w, rest > 0 ? 1.0 : 0.0, rest + w) * r.t;
  } else {
    // whole waves (packed sequences under p0_list too: where a sequence's last blocks lie is
    // not known here, and the average remainder as one length measured wrong, H100
    // 2026-11-27: 8/24 28672+4096 in merged pairs of 48, 0.665 -> 0.764 ms)
    crit = (len + c.warm_chunks) * r.t * ceil_pos(blocks / r.nsm);
  }
  const double work = (s.total + c.warm_chunks * s.segs / m) * heads * r.t / r.nsm;
  return crit > work ? crit : work;
}
// The merge factor (1 .. kMaxP0Merge) of the cheapest phase 0; 1 unless ForwardCost::p0_merge
// and a merge saves at least p0_merge_gain of phase 0.
inline FLASHGDN_HD int best_p0_merge(const ForwardCost& c, const LoadStats& s, const SplitTerms& r,
                                     double heads) {
  if (!c.p0_merge || r.blocks <= r.nsm) return 1;
  const double base = phase0_merged_us(c, s, r, heads, 1);
  int best = 1;
  double best_us = base * (1.0 - c.p0_merge_gain);
  for (int m = 2; m <= kMaxP0Merge; ++m) {
    const double us = phase0_merged_us(c, s, r, heads, m);
    if (us < best_us) {
      best = m;
      best_us = us;
    }
  }
  return best;
}

// The estimates of a split plan (column block bw, segments of seg > 0 chunks) that share one
// SplitTerms: the sequential schedule (per launch the larger of the critical path and the
// block-steps spread over the SMs, plus the summary pass and the combine; at column block
// 128 phase 0 in best_p0_merge's merged segments) and, for a split at column block 128, the
// overlapped schedule where its blocks fit in one wave (ForwardCost::overlap; kept only where
// it is the cheaper) and the saturated one where they do not (saturated_from_terms).
struct SplitEstimate {
  double sequential = 0;
  double overlapped = 1e300;  // 1e300: none, or not below the sequential one
  double saturated = 1e300;   // 1e300: none (estimate_saturated_overlap_us's conditions)
  int merge = 1;              // phase 0's merge factor in the sequential estimate
  double phase0 = 0;          // the sequential estimate's phase 0 (column block 128: merged)
};

// The saturated schedule's estimate from a 128-column split's terms (see
// estimate_saturated_overlap_us).
inline FLASHGDN_HD double saturated_from_terms(const ForwardCost& c, const LoadStats& s,
                                               const SplitTerms& r, double heads) {
  if (!c.overlap || !c.overlap_saturated || s.longest < c.sat_min_longest) return 1e300;
  if (c.fused_wy && !c.sat_fused_wy && heads >= kTmaWyMinHeads && heads < kTmaWyOverlapHeads)
    return 1e300;  // ForwardCost::fused_wy
  if (!c.sat_fused_wy && few_heads_sequential(c, s, heads)) return 1e300;
  if (r.warm_blocks + 2.0 * r.exact_blocks <= c.overlap_fit * r.nsm) return 1e300;  // one wave
  const double chain = r.crit1 + r.combine + r.len * r.t;
  const double bound = (r.work0 + r.work1) * c.sat_factor;
  const double m = chain > r.crit0 ? chain : r.crit0;
  return m > bound ? m : bound;
}

inline FLASHGDN_HD SplitEstimate estimate_split(const ForwardCost& c, const LoadStats& s,
                                                double heads, int sms, int bw, double seg) {
  SplitEstimate e;
  const SplitTerms r = split_terms(c, s, heads, sms, bw, seg);
  const double crit0 = r.crit0 * (r.blocks > r.nsm ? ceil_pos(r.blocks / r.nsm) : 1.0);
  double phase0 = crit0 > r.work0 ? crit0 : r.work0;
  if (bw == 128) {
    e.merge = best_p0_merge(c, s, r, heads);
    phase0 = phase0_merged_us(c, s, r, heads, e.merge);
    e.saturated = saturated_from_terms(c, s, r, heads);
    if (c.saturated_unfused && e.saturated < 1e300)
      e.saturated += unfused_wy_term(c, s, heads, r.nsm);
  }
  e.phase0 = phase0;
  e.sequential = phase0 + (r.crit1 > r.work1 ? r.crit1 : r.work1) + r.combine;
  // overlapped: beside the warm-started blocks run first the exact segments' summaries (2
  // blocks each: L and M), then their nsub sub-segments.
  const double ns = c.nsub > 1 ? c.nsub : 1.0;
  // The summaries must fit beside the warm-started blocks, and the sub-segments in a wave of
  // their own; where they do not fit beside the warm-started blocks as well, they start when
  // those end (H100, 2/8 heads x 16384 tokens, segments of 24 chunks: 66 warm-started blocks
  // and 20 exact segments of 4 sub-segments, 0.245 ms against 0.259 at segments of 32,
  // which fit beside each other)
  if (bw != 128 || !c.overlap || r.warm_blocks + 2.0 * r.exact_blocks > c.overlap_fit * r.nsm ||
      r.exact_blocks * ns > r.nsm)
    return e;
  if (few_heads_sequential(c, s, heads)) return e;
  double chain = r.crit1 + r.combine + (ns > 1.0 ? c.sub_start_us : 0.0);
  if (r.warm_blocks + r.exact_blocks * ns > r.nsm && chain < crit0) chain = crit0;
  chain += ceil_pos(r.len / ns) * r.t;
  const double crit = crit0 > chain ? crit0 : chain;
  double ov = crit > r.work0 + r.work1 ? crit : r.work0 + r.work1;
  ov += unfused_wy_term(c, s, heads, r.nsm);  // its WY part outside the pass
  if (ov < e.sequential) e.overlapped = ov;
  return e;
}

// Estimated time (us) of the state pass with column block bw, split into segments of seg
// chunks (seg = 0: unsplit; split: estimate_split's sequential schedule or, where cheaper, its
// one-wave overlapped one); *overlapped (if given) says whether the overlapped schedule is
// the cheaper, and the estimate returned.
inline FLASHGDN_HD double estimate_state_pass_us(const ForwardCost& c, const LoadStats& s,
                                                 double heads, int sms, int bw, double seg,
                                                 bool* overlapped = nullptr) {
  if (overlapped != nullptr) *overlapped = false;
  if (seg <= 0) {
    // unsplit, s.segs sequences: one wave of 16- or 32-column blocks (each alone on its
    // SM, so the longest sequence's blocks are the whole cost) steps faster than the
    // block-steps of a full GPU suggest
    const double t = step_us(c, bw), cbn = 128.0 / bw, nsm = sms > 0 ? sms : 1;
    const double work = s.total * heads * cbn * t / nsm;
    const double tw = wave_step_us(c, bw);
    if (tw > 0.0 && s.segs > 0 && s.segs * heads * cbn <= nsm &&
        s.longest <= ForwardCost::kWaveChunks)
      return s.longest * tw;
    return s.longest * t > work ? s.longest * t : work;
  }
  const SplitEstimate e = estimate_split(c, s, heads, sms, bw, seg);
  if (e.overlapped < e.sequential) {
    if (overlapped != nullptr) *overlapped = true;
    return e.overlapped;
  }
  return e.sequential;
}

// Estimated time (us) of a split 128-column pass on the overlapped schedule without
// sub-segments where its blocks exceed one wave (ForwardCost::overlap_saturated; 1e300 where
// it does not apply): the larger of the exact chain (summaries, combine, the exact segments'
// phase 0), a warm-started segment, and the block-steps of both phases spread over the SMs.
inline FLASHGDN_HD double estimate_saturated_overlap_us(const ForwardCost& c, const LoadStats& s,
                                                        double heads, int sms, double seg) {
  if (seg <= 0) return 1e300;
  return saturated_from_terms(c, s, split_terms(c, s, heads, sms, 128, seg), heads);
}

// FLASHGDN_CP_SAT=1: the saturated schedule wherever its estimate is at most 0.99 of the
// sequential split's, at any length (the opt-in of sessions 30-34).
inline void force_saturated(ForwardCost& c) {
  c.overlap_saturated = true;
  c.sat_fused_wy = true;
  c.sat_margin = 0.99;
  c.sat_min_longest = 0;
}

// Estimated time (us) of a split state pass whose exact segments' outputs come by correction
// (SegmentPlan::corr), column block bw (16 or 32), segments of seg chunks, n_seqs sequences:
// the warm-started and first segments' phase 0 runs beside the exact segments' chain (phase
// 1 with outputs, the combine, seg_correct_kernel), and every block of both must fit in one
// wave (else no estimate: 1e300).
inline double estimate_corr_us(const ForwardCost& c, const LoadStats& s, double heads,
                               double n_seqs, int sms, int bw, double seg) {
  if (!c.corr || (bw != 16 && bw != 32) || seg <= 0) return 1e300;
  const double tw = wave_step_us(c, bw);
  const double step = tw > 0.0 ? tw : step_us(c, bw), cbn = 128.0 / bw, nsm = sms > 0 ? sms : 1;
  const double len = seg < s.longest ? seg : s.longest;
  const double later = s.segs > n_seqs ? s.segs - n_seqs : 0.0;  // segments not first
  const double exact_blocks = heads * cbn * c.exact_share * later;
  const double warm_blocks = heads * cbn * s.segs - exact_blocks;
  if (warm_blocks + 2.0 * exact_blocks > nsm) return 1e300;
  const double crit0 = (len + c.warm_chunks) * step;
  const double chain = len * step * c.corr_step_factor + c.combine_us * s.max_segs_per_seq +
                       c.corr_us;
  return crit0 > chain ? crit0 : chain;
}

// The segment lengths Auto mode tries, from kMinSegChunks up: m 2^e for m = 4, 5, 6, 7, i.e.
// 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, ... (four a factor of two, so that plans of
// one block per SM can fill their wave: 2/8 heads x 32768 tokens, H100, 2026-11-25, the
// overlapped schedule in 13 segments of 40 chunks 0.338 ms, 12 of 43 0.348; the steps of
// 4/3 and 3/2 before, 24, 32, 48, 64, ..., had no length between 32 and 48).
// The power of two 2^b with seg = m 2^b, m in 1 .. 7 (m in 4 .. 7 for lengths of the grid),
// as b: m = seg >> b, a shift where a division would be a 64-bit division on the GPU.
inline FLASHGDN_HD int seg_scale_log2(int64_t seg) {
  int b = 0;
  while (seg >= (int64_t{8} << b)) ++b;
  return b;
}
inline FLASHGDN_HD int64_t next_seg_candidate(int64_t seg) {
  // seg = m e with m in 4 .. 7 (any other length: the next power of two up)
  const int b = seg_scale_log2(seg);
  const int64_t e = int64_t{1} << b, m = seg >> b;
  return m < 4 ? 4 * e : m < 7 ? (m + 1) * e : 8 * e;
}

// Whether column block bw tries segments of seg chunks when the longest sequence has
// `longest` chunks: 16 and 32 (several blocks per SM, measured at 32, 64, 128, ...) the
// powers of two; 128 every candidate, those below 32 chunks (where the model's warm-up and
// combine terms matter most) only for sequences of 128+ chunks, where they were measured.
// `fine`: the plan may take the overlapped schedule (the forward's), every length of
// next_seg_candidate; else (the backward's passes, FLASHGDN_CP_OVERLAP=0) only m = 4, 6,
// the lengths 24, 32, 48, 64, 96, ... their plans were measured at.
// short_longest: ForwardCost::short_seg_longest.
inline FLASHGDN_HD bool seg_candidate_for(int bw, int64_t seg, int64_t longest,
                                          bool fine = false,
                                          int64_t short_longest = kMinOverlapLongest) {
  if (bw != 128) return (seg & (seg - 1)) == 0;
  const int64_t m = seg >> seg_scale_log2(seg);
  if (!fine && m != 4 && m != 6) return false;
  return seg >= 32 || longest >= short_longest;
}

// The device's choice of plan for packed sequences (SegmentPlan::device_choice /
// device_col_block; plan_kernel's choose_plan, csrc/cuda/planner.cuh): the cost model on the
// actual lengths, over unsplit and min_seg and the longer candidates after it
// (next_seg_candidate). Its steps are host-device functions, so that the host makes the
// same choice from lengths it is given (device_choice_on_host: the caller's host copy of
// cu_seqlens, tests, flashgdn_plan --tokens).
struct DeviceChoiceParams {
  ForwardCost cost;             // cost.overlap: the overlapped schedule is a candidate
                                //   (SegmentPlan::device_overlap)
  double heads = 0;
  int sms = 0, col_block = 32;
  bool pick_col_block = false;  // also choose the column block (16, 32, or 128 if allow_cols)
  bool allow_cols = false;      // column block 128 (state_fwd_cols_kernel) is a candidate
  bool allow_split = true;      // false: only the column block is chosen (unsplit plan)
  int col_blocks = 0;           // the column blocks launched (SegmentPlan::device_col_blocks)
  int split_col_blocks = 0;     // the column blocks a split may take (0: any launched)
  int64_t min_seg = 0;
};

// Segment lengths the device tries at most (min_seg, then next_seg_candidate's steps: 32 of
// them reach 2^8 times min_seg), and its candidates: unsplit, then each length, x column
// blocks 16, 32, 128 (candidate i: column block device_bw(i), length i / 3 - 1, < 0
// unsplit).
constexpr int kMaxSegCandidates = 32;
constexpr int kMaxPlanCandidates = 3 * (1 + kMaxSegCandidates);
inline FLASHGDN_HD int device_bw(int i) { return i % 3 == 0 ? 16 : i % 3 == 1 ? 32 : 128; }

// The candidate lengths for sequences of at most `longest` chunks into seg[]; their count.
inline FLASHGDN_HD int device_seg_candidates(const DeviceChoiceParams& c, int64_t longest,
                                             int64_t* seg) {
  int n = 0;
  for (int64_t l = c.min_seg; c.allow_split && l > 0 && l < longest && n < kMaxSegCandidates;
       l = next_seg_candidate(l))
    seg[n++] = l;
  return n;
}

// Candidate i's estimates (SplitEstimate; unsplit: its sequential estimate only, 1e300 for
// column blocks or lengths the device does not try), the sequences (n_seqs of them, the
// longest `longest`, `total` chunks in all) cut into segs[k] segments at length seg[k].
inline FLASHGDN_HD SplitEstimate device_candidate(const DeviceChoiceParams& c, int i,
                                                  const int64_t* seg,
                                                  const unsigned long long* segs,
                                                  int64_t longest, int64_t total,
                                                  int64_t n_seqs) {
  const int bw = device_bw(i), k = i / 3 - 1;
  SplitEstimate e;
  e.sequential = 1e300;
  const bool candidate = !c.pick_col_block
                             ? bw == c.col_block
                             : (bw != 128 || c.allow_cols) && (c.col_blocks & col_block_bit(bw)) != 0;
  if (!candidate) return e;
  LoadStats st;
  st.longest = static_cast<double>(longest);
  st.total = static_cast<double>(total);
  st.segs = static_cast<double>(n_seqs);  // unsplit: one segment per sequence
  if (k < 0) {
    ForwardCost sequential = c.cost;
    sequential.overlap = false;
    e.sequential = estimate_state_pass_us(sequential, st, c.heads, c.sms, bw, 0.0);
    return e;
  }
  if (!seg_candidate_for(bw, seg[k], longest, c.cost.overlap, c.cost.short_seg_longest) ||
      (c.split_col_blocks != 0 && (c.split_col_blocks & col_block_bit(bw)) == 0))
    return e;
  st.segs = st.seg_blocks = static_cast<double>(segs[k]);
  st.seqs = static_cast<double>(n_seqs);
  st.max_segs_per_seq = static_cast<double>(segments_of(longest, seg[k]));
  // every schedule's estimate from one SplitTerms: the sequential one, its merge, the
  // one-wave overlapped and the saturated ones
  return estimate_split(c.cost, st, c.heads, c.sms, bw, static_cast<double>(seg[k]));
}

// The choice from the candidates' estimates (est[i] = sequential, overlapped, saturated;
// merge[i]): the cheapest unsplit column block; the best split where it beats that by
// min_gain, on the one-wave overlapped schedule where its estimate is at most overlap_margin
// of the best sequential split's (the host's rule, planner.cpp), else the best sequential
// split's segments on the saturated schedule where that is at most sat_margin of it
// (without sub-segments: cost.nsub <= 1). out = [chunks per segment (unsplit: total + 1, or
// seg_chunks where only the column block is chosen), column block, schedule (0 sequential
// split, 1 overlapped or unsplit), phase-0 merge of a sequential 128-column split, else 1].
inline FLASHGDN_HD void device_pick(const DeviceChoiceParams& c, int ncand,
                                    const double (*est)[3], const int* merge,
                                    const int64_t* seg, int64_t total, int64_t seg_chunks,
                                    int64_t* out) {
  int best_bw = c.col_block;
  double best = 1e300;
  for (int b = 0; b < 3; ++b)
    if (est[b][0] < best) best = est[b][0], best_bw = device_bw(b);
  int split = -1, overlapped = -1;  // the best sequential split, the best overlapped one
  for (int i = 3; i < ncand; ++i) {
    if (est[i][0] < (split < 0 ? 1e300 : est[split][0])) split = i;
    if (est[i][1] < (overlapped < 0 ? 1e300 : est[overlapped][1])) overlapped = i;
  }
  double split_us = split < 0 ? 1e300 : est[split][0];
  bool ov = false;
  if (overlapped >= 0 && split >= 0 && est[overlapped][1] <= c.cost.overlap_margin * split_us)
    split = overlapped, split_us = est[overlapped][1], ov = true;
  if (!ov && split >= 0 && device_bw(split) == 128 && c.cost.overlap &&
      c.cost.overlap_saturated && c.cost.nsub <= 1 &&
      est[split][2] <= c.cost.sat_margin * split_us)
    split_us = est[split][2], ov = true;
  int64_t best_seg = total + 1;  // unsplit: longer than any sequence
  int m = 1;
  if (split >= 0 && split_us < (1.0 - c.cost.min_gain) * best) {
    best_seg = seg[split / 3 - 1], best_bw = device_bw(split);
    if (!ov && best_bw == 128) m = merge[split];  // its phase 0 in merged segments
  } else {
    ov = true;  // unsplit: every segment starts from h0, the overlapped launch runs it
  }
  out[0] = c.allow_split ? best_seg : seg_chunks;
  out[1] = best_bw;
  out[2] = ov ? 1 : 0;
  out[3] = c.allow_split ? m : 1;
}

SegmentPlan plan_segments(const SegmentQuery& q, const ForwardCost& cost = ForwardCost{});

// FLASHGDN_CP = auto (default) | on | off, FLASHGDN_CP_SEG = chunks per segment when on (with
// auto: the only length the planner tries),
// FLASHGDN_FWD_BW = 16 | 32 | 128 forces the column block.
// The device's choice (device_pick's out) made on the host from the sequences' chunk counts,
// step for step as plan_kernel makes it.
// exact_counts (the host's own choice from the caller's copy, launch.cu host_plan_choice):
// also the lengths that cut the longest sequence into exactly m segments, which the device's
// candidates (next_seg_candidate's steps) may miss.
// exact_counts also re-picks a packed batch's phase-0 merge for a sequential 128-column split
// from the blocks it makes (exact_p0_merge).
void device_choice_on_host(const DeviceChoiceParams& c, const int64_t* chunks, int64_t n,
                           int64_t seg_chunks, int64_t out[4], bool exact_counts = false);
// Phase 0 of a sequential 128-column split of sequences of chunks[0 .. n) chunks in segments
// of seg, merged by m (SegParams::p0_merge; context_parallel.cuh for_each_segment_block): its
// makespan in chunk steps, the blocks dispatched in launch order (a group of m consecutive
// segments, all heads, at a time; a group's runs of one sequence one after the other in its
// block, each but a sequence's first with warm chunks of warm-up), each to the SM that frees
// first, one block an SM, each block `start` steps more (ForwardCost::p0_block_start); < 0
// where the groups number more than kMaxExactGroups.
constexpr int64_t kMaxExactGroups = 512;
double p0_exact_steps(const int64_t* chunks, int64_t n, int64_t seg, int m, double heads, int sms,
                      double warm, double start = 0.0);
// The merge (1 .. kMaxP0Merge) of the shortest p0_exact_steps, kept at `current` unless another
// saves cost.p0_merge_gain of its steps. H100, 2026-11-27, host copy, 8/24 heads, forward ms by
// merge 1 / 2 / 3 / 4 against the steps' order: 12288+4096 in segments of 24 0.388 / 0.364 /
// 0.448 / 0.513 (58 / 53 / 77 / 101 steps), 16384+16384 at 24 0.727 / 0.680 / 0.827 / 0.655
// (116 / 106 / 149 / 101), 24576+8192 at 48 0.645 / 0.622 (106 / 101), 28672+4096 at 50
// 0.664 / 0.655 / 0.798 / 0.959 (110 / 105 / 155 / 205); the whole waves of phase0_merged_us
// kept merge 1 for three of them and 2 for 16384+16384.
// steps_out (where given): that merge's p0_exact_steps (< 0: not known, current returned).
int exact_p0_merge(const ForwardCost& cost, const int64_t* chunks, int64_t n, int64_t seg,
                   double heads, int sms, int current, double* steps_out = nullptr);
// What launch.cu hands plan_kernel for a plan the device completes (device_choice or
// device_col_block): the cost model (cost: the pass's, forward = !backward), the schedule
// the launches allow (the overlapped launches: SegmentPlan::device_overlap unless forced
// off), the workspace's sub-segments, H_v and the SM count.
DeviceChoiceParams device_choice_params(const SegmentPlan& plan, ForwardCost cost, bool forward,
                                        bool device_schedule, int nsub, int64_t Hv, int sms);

CpMode cp_mode_from_env();
int64_t cp_seg_chunks_from_env();
int col_block_from_env();

}  // namespace flashgdn
