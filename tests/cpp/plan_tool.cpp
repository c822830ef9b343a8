// flashgdn_plan: prints the host planner's plan (csrc/planner.h) of the forward's state pass
// for a shape, on any machine (no GPU): which column block, whether and how the sequences
// are split, the schedule and the cost model's estimate. The forward's fp16 pass's cost
// model, as launch.cu's plan_cost builds it; switches as flags rather than environment
// variables.
//
//   flashgdn_plan --hv 8 --chunks 256                 # 2/8 heads, one 16384-token sequence
//   flashgdn_plan --hv 16 --chunks 512 --sat          # FLASHGDN_CP_SAT=1
//   flashgdn_plan --hv 8 --chunks 449 --n 2 --varlen --hint 448   # 28672 + 4096, host copy
//
// Flags: --hv H_v, --chunks C (of each sequence; varlen: in all), --n N, --varlen (packed:
// the device then picks the segments), --hint longest chunks (cu_seqlens_cpu), --sms S,
// --seg L (FLASHGDN_CP_SEG with auto), --bw 16|32|128 (FLASHGDN_FWD_BW), --step128 us (the
// cost model's 128-column chunk step, ForwardCost::step_us_bw128), --combine us (the chain's
// cost a segment, ForwardCost::combine_us: FLASHGDN_COMBINE_US), --unfused-wy us (the
// overlapped schedule's WY part outside the pass, ForwardCost::unfused_wy_us:
// FLASHGDN_UNFUSED_WY_US), --no-overlap
// (FLASHGDN_CP_OVERLAP=0), --sat (FLASHGDN_CP_SAT=1), --no-sat (FLASHGDN_CP_SAT=0), --nsub n
// (FLASHGDN_CP_SUB), --no-merge (ForwardCost::p0_merge off: phase 0 in the plan's segments),
// --no-reach (ForwardCost::reach_seg_longest 0: FLASHGDN_REACH_SEG=0),
// --no-p0-list / --p0-list-any (ForwardCost::p0_list off / without its margin:
// FLASHGDN_P0_LIST=0 / =2), --no-exact-p0 / --exact-p0-any (ForwardCost::exact_p0:
// FLASHGDN_HOST_EXACT_P0=0 / =2), --plain-pass (no kWy: ForwardCost::fused_wy off),
// --no-corr (FLASHGDN_CP_CORR=0: no exact outputs by correction), --short-longest n,
// --short-min n (FLASHGDN_CP_SHORT_LONGEST / _MIN: ForwardCost::short_seg_longest / _min),
// --off, --on (FLASHGDN_CP).
//
// --tokens a,b,... (packed sequences of those token counts, in place of --chunks / --n /
// --varlen; the hint on the longest as cu_seqlens_cpu gives it, --no-hint drops it) also
// prints the device's choice for those lengths (device_choice_on_host: plan_kernel's steps
// on the host), e.g. flashgdn_plan --hv 16 --tokens 28672,4096; with the hint, also
// launch.cu host_split_plan's (--no-host-split: FLASHGDN_HOST_SPLIT=0) and, where the host's
// choice is a sequential split in the overlapped launches, plan_forward's host schedule
// (--no-host-schedule: FLASHGDN_HOST_SCHEDULE=0).
//
// --backward: the backward's plan (launch.cu plan_forward(p, true)) instead (and whether its
// ready queue is taken, planner.h backward_ready_queue): the cost model
// as plan_cost(true) builds it (no overlapped schedule, no correction, no kWy term, the tf32
// pass's wave steps), 128 columns where backward_cols allows them, and the short split
// (planner.h backward_short_seg) where it applies, e.g. flashgdn_plan --backward --hv 8
// --chunks 128 (4/8 heads x 8192 tokens: 12-chunk segments); --short-mode m as
// FLASHGDN_BWD_SHORT=m (0 none, 1 backward_short_split alone, 2 backward_short_split_avg
// alone, 3 either of those; default: any of them or backward_short_split_packed).
//
// --estimates also prints the plan's estimate with each schedule left out in turn (no
// overlapped schedule, no saturated one, without ForwardCost::unfused_wy_us): what the
// model puts each at, for calibrating it against bench_cp's switches.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "planner.h"

int main(int argc, char** argv) {
  using namespace flashgdn;
  SegmentQuery q;
  q.N = 1;
  q.allow_cols = true;
  int64_t chunks = 0;
  bool varlen = false, hint = true, host_split = true, host_schedule = true, estimates = false;
  std::vector<int64_t> seq_chunks;  // --tokens: each sequence's chunks
  bool backward = false;
  int short_mode = kBackwardShortAll;
  int64_t tokens = 0;  // --tokens: all of them
  for (int i = 1; i < argc; ++i) backward = backward || !std::strcmp(argv[i], "--backward");
  ForwardCost c;
  if (backward) {  // plan_cost(true)
    c.overlap = false;
    c.exact_p0 = c.p0_list = false;
    c.corr = false;
    c.unfused_wy_us = 0.0;
    c.fused_wy = false;
  } else {
    c.step_us_bw16_wave = ForwardCost::kFp16Bw16Wave;
    c.step_us_bw32_wave = ForwardCost::kFp16Bw32Wave;
    c.corr = true;  // plan_cost's default (FLASHGDN_CP_CORR unset, the fp16 pass)
  }
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const bool has_value = i + 1 < argc;
    auto value = [&]() { return std::atoll(argv[++i]); };
    if (!std::strcmp(a, "--hv") && has_value) q.Hv = value();
    else if (!std::strcmp(a, "--chunks") && has_value) chunks = value();
    else if (!std::strcmp(a, "--n") && has_value) q.N = value();
    else if (!std::strcmp(a, "--hint") && has_value) q.longest_hint = value();
    else if (!std::strcmp(a, "--sms") && has_value) q.sms = static_cast<int>(value());
    else if (!std::strcmp(a, "--seg") && has_value) q.forced_seg_chunks = value();
    else if (!std::strcmp(a, "--bw") && has_value) q.forced_col_block = static_cast<int>(value());
    else if (!std::strcmp(a, "--nsub") && has_value) c.nsub = static_cast<int>(value());
    else if (!std::strcmp(a, "--step128") && has_value) c.step_us_bw128 = std::atof(argv[++i]);
    else if (!std::strcmp(a, "--combine") && has_value) c.combine_us = std::atof(argv[++i]);
    else if (!std::strcmp(a, "--unfused-wy") && has_value) c.unfused_wy_us = std::atof(argv[++i]);
    else if (!std::strcmp(a, "--short-longest") && has_value) c.short_seg_longest = value();
    else if (!std::strcmp(a, "--short-min") && has_value) c.short_seg_min = value();
    else if (!std::strcmp(a, "--varlen")) varlen = true;
    else if (!std::strcmp(a, "--no-hint")) hint = false;
    else if (!std::strcmp(a, "--no-host-split")) host_split = false;
    else if (!std::strcmp(a, "--no-host-schedule")) host_schedule = false;
    else if (!std::strcmp(a, "--estimates")) estimates = true;
    else if (!std::strcmp(a, "--backward")) continue;  // (read above)
    else if (!std::strcmp(a, "--short-mode") && has_value) short_mode = static_cast<int>(value());
    else if (!std::strcmp(a, "--tokens") && has_value) {
      for (const char* t = argv[++i]; *t != '\0';) {
        char* end = nullptr;
        const long long n = std::strtoll(t, &end, 10);
        if (end == t || n <= 0) break;
        seq_chunks.push_back((n + 63) / 64);
        tokens += n;
        t = *end == ',' ? end + 1 : end;
      }
    }
    else if (!std::strcmp(a, "--no-overlap")) c.overlap = false;
    else if (!std::strcmp(a, "--sat")) force_saturated(c);
    else if (!std::strcmp(a, "--no-sat")) c.overlap_saturated = false;
    else if (!std::strcmp(a, "--plain-pass")) c.fused_wy = false;  // no kWy (FLASHGDN_COLS_TMA=0)
    else if (!std::strcmp(a, "--no-merge")) c.p0_merge = false;
    else if (!std::strcmp(a, "--no-reach")) c.reach_seg_longest = 0;
    else if (!std::strcmp(a, "--no-p0-list")) c.p0_list = false;
    else if (!std::strcmp(a, "--p0-list-any")) c.p0_list_margin = 0.0;
    else if (!std::strcmp(a, "--no-exact-p0")) c.exact_p0 = false;
    else if (!std::strcmp(a, "--exact-p0-any")) c.exact_p0_margin = 0.0;
    else if (!std::strcmp(a, "--no-corr")) c.corr = false;
    else if (!std::strcmp(a, "--off")) q.mode = CpMode::Off;
    else if (!std::strcmp(a, "--on")) q.mode = CpMode::On;
    else {
      std::fprintf(stderr, "flashgdn_plan: unknown or incomplete argument '%s' (see the "
                           "header of tests/cpp/plan_tool.cpp)\n", a);
      return 2;
    }
  }
  if (!seq_chunks.empty()) {  // packed sequences of known lengths
    varlen = true;
    q.N = static_cast<int64_t>(seq_chunks.size());
    chunks = q.N;  // total_chunks as Problem::max_chunks counts it (whole chunks here)
    for (const int64_t n : seq_chunks) chunks += n;
    if (q.N == 1) chunks = seq_chunks[0];  // one sequence: its exact chunks (fixed_chunks)
    if (hint) q.longest_hint = *std::max_element(seq_chunks.begin(), seq_chunks.end());
  }
  if (q.Hv <= 0 || chunks <= 0 || q.N <= 0) {
    std::fprintf(stderr, "flashgdn_plan: --hv and --chunks (and --n, if given) must be > 0\n");
    return 2;
  }
  q.total_chunks = varlen ? chunks : q.N * chunks;
  q.fixed_chunks = varlen && q.N > 1 ? -1 : chunks;
  if (backward) {  // launch.cu bwd_cols, bwd_short_seg and plan_forward_uncached
    const int64_t token_chunks = tokens > 0 ? (tokens + 63) / 64 : q.N * chunks;
    const int64_t short_seg = backward_short_seg(q, short_mode, token_chunks);
    q.allow_cols = short_seg > 0 ||
                   backward_cols(q.Hv, q.total_chunks, longest_chunks_bound(q), q.sms);
    if (short_seg > 0) {
      q.mode = CpMode::On;
      q.forced_seg_chunks = short_seg;
      std::printf("the backward's short split: segments of %lld chunks\n",
                  static_cast<long long>(short_seg));
    }
    host_split = host_schedule = false;  // the forward's host plans only
    // (launch.cu: with 128 columns allowed both passes run in the 128-column kernels on fp16
    // record blocks, whatever column block the plan's estimate counted)
    std::printf("the backward's passes: %s\n", q.allow_cols
                                                  ? "128-column kernels, fp16 record blocks"
                                                  : "16 / 32 columns, fp32 records");
    // launch.cu bwd_queue (FLASHGDN_BWD_QUEUE unset): the 128-column passes only
    if (q.allow_cols)
      std::printf("the ready queue: %s (value heads x chunks of tokens %lld, bound %lld)\n",
                  backward_ready_queue(q.Hv, token_chunks) ? "taken" : "not taken",
                  static_cast<long long>(q.Hv * token_chunks),
                  static_cast<long long>(kReadyQueueWork));
  }
  SegmentPlan p = plan_segments(q, c);
  // --tokens with the host copy (not --no-hint): launch.cu host_split_plan, the device-choice
  // plan where the worst-case estimates keep the sequences unsplit and the choice at these
  // lengths splits (--no-host-split: not tried, FLASHGDN_HOST_SPLIT=0)
  if (!seq_chunks.empty() && hint && host_split && q.mode == CpMode::Auto &&
      q.forced_seg_chunks == 0 && q.N > 1 && !p.split && !p.device_choice) {
    SegmentQuery anyway = q;
    anyway.device_choice_anyway = true;
    const SegmentPlan d = plan_segments(anyway, c);
    if (d.device_choice) {
      const DeviceChoiceParams dp = device_choice_params(d, c, true, d.device_overlap,
                                                         d.nsub > 1 ? d.nsub : 0, q.Hv, q.sms);
      int64_t out[4];
      device_choice_on_host(dp, seq_chunks.data(), q.N, d.seg_chunks, out, true);
      if (out[0] <= *std::max_element(seq_chunks.begin(), seq_chunks.end())) p = d;
    }
  }
  std::printf("H_v %lld, %lld x %lld chunks%s: col_block %d, %s, seg %lld (max segments %lld)",
              static_cast<long long>(q.Hv), static_cast<long long>(q.N),
              static_cast<long long>(varlen ? chunks / q.N : chunks), varlen ? " (packed)" : "",
              p.col_block, p.split ? "split" : "unsplit", static_cast<long long>(p.seg_chunks),
              static_cast<long long>(p.max_segments));
  if (p.split && !p.device_choice)
    std::printf(", %s%s, nsub %d, phase 0 merge %d",
                p.saturated ? "saturated" : p.overlap ? "overlapped" : "sequential",
                p.corr ? " with correction" : p.exact_reach ? " (exact reach)" : "", p.nsub,
                p.p0_merge);
  if (p.device_choice) std::printf(", the device picks the segments");
  if (p.device_overlap)
    std::printf(" and may take the overlapped schedule (nsub %d)", p.nsub);
  if (p.device_col_block) {
    std::printf(", the device picks the column block (of");
    for (int bw : {16, 32, 128})
      if (p.device_col_blocks & col_block_bit(bw)) std::printf(" %d", bw);
    std::printf(")");
  }
  std::printf(", estimate %.1f us\n", p.est_us);
  if (estimates) {  // the plan with one schedule left out at a time (the same query)
    auto show = [&](const char* what, ForwardCost v) {
      const SegmentPlan e = plan_segments(q, v);
      std::printf("  %-22s %s, col_block %d, seg %lld, %s, estimate %.1f us\n", what,
                  e.split ? "split" : "unsplit", e.col_block,
                  static_cast<long long>(e.seg_chunks),
                  e.device_choice ? "the device's choice"
                  : e.saturated   ? "saturated"
                  : e.overlap     ? "overlapped"
                                  : "sequential",
                  e.est_us);
    };
    ForwardCost v = c;
    v.overlap = false;
    show("no overlapped schedule", v);
    v = c;
    v.overlap_saturated = false;
    show("no saturated schedule", v);
    v = c;
    v.unfused_wy_us = 0.0;
    show("unfused_wy_us 0", v);
  }
  // --tokens with the host copy: plan_forward's host schedule (launch.cu), where the host's
  // making of the device's choice in the overlapped launches is a sequential split: the
  // launches are dropped and the choice made again without them
  if (!seq_chunks.empty() && hint && host_schedule && p.device_overlap) {
    const DeviceChoiceParams d = device_choice_params(p, c, true, true,
                                                      p.nsub > 1 ? p.nsub : 0, q.Hv, q.sms);
    int64_t out[4];
    device_choice_on_host(d, seq_chunks.data(), q.N, p.seg_chunks, out);
    if (out[2] == 0) {
      p.device_overlap = false;
      p.nsub = 1;
      std::printf("  the host schedule: a sequential choice, the overlapped launches dropped\n");
    }
  }
  if (!seq_chunks.empty() && (p.device_choice || p.device_col_block)) {
    // as launch.cu hands it to plan_kernel (the forward; the workspace's sub-segments)
    const DeviceChoiceParams d = device_choice_params(p, c, true, p.device_overlap,
                                                      p.nsub > 1 ? p.nsub : 0, q.Hv, q.sms);
    int64_t out[4];
    device_choice_on_host(d, seq_chunks.data(), q.N, p.seg_chunks, out);
    const bool split = out[0] <= *std::max_element(seq_chunks.begin(), seq_chunks.end()) &&
                       d.allow_split;
    std::printf("  the device's choice: col_block %lld, %s", static_cast<long long>(out[1]),
                split ? "split" : "unsplit");
    if (split)
      std::printf(", seg %lld, %s, phase 0 merge %lld", static_cast<long long>(out[0]),
                  out[2] ? "overlapped" : "sequential", static_cast<long long>(out[3]));
    std::printf("\n");
    // the host's own choice from the caller's copy (exact segment counts tried as well)
    device_choice_on_host(d, seq_chunks.data(), q.N, p.seg_chunks, out, /*exact_counts=*/true);
    std::printf("  the host's choice: col_block %lld, seg %lld, %s, phase 0 merge %lld\n",
                static_cast<long long>(out[1]), static_cast<long long>(out[0]),
                out[2] ? "overlapped or unsplit" : "sequential", static_cast<long long>(out[3]));
  }
  return 0;
}
