// Context-parallel planner (see planner.h).
#include "planner.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace flashgdn {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t longest_chunks(const SegmentQuery& q) {
  // varlen: the host does not know the lengths; the total bounds the longest
  return q.fixed_chunks >= 0 ? q.fixed_chunks : q.total_chunks;
}

// The longest sequence the cost model plans for: longest_chunks, or the caller's smaller
// bound (SegmentQuery::longest_hint). Never used to size a grid.
int64_t longest_estimate(const SegmentQuery& q) {
  const int64_t bound = longest_chunks(q);
  return q.fixed_chunks < 0 && q.longest_hint > 0 && q.longest_hint < bound ? q.longest_hint
                                                                            : bound;
}

SegmentPlan unsplit(const SegmentQuery& q, int col_block) {
  SegmentPlan p;
  // one segment per sequence: longer than any sequence can be
  p.seg_chunks = std::max<int64_t>(1, longest_chunks(q));
  p.max_segments = q.N;
  p.split = false;
  p.col_block = col_block;
  return p;
}

SegmentPlan with_length(const SegmentQuery& q, int64_t seg, int col_block) {
  SegmentPlan p;
  p.seg_chunks = std::max<int64_t>(1, seg);
  p.col_block = col_block;
  if (q.fixed_chunks >= 0) {
    p.max_segments = q.N * segments_of(q.fixed_chunks, p.seg_chunks);
    p.split = q.fixed_chunks > p.seg_chunks;
  } else {
    // sum over sequences of max(1, ceil(c_n / seg)) <= total / seg + N
    p.max_segments = q.total_chunks / p.seg_chunks + q.N;
    p.split = q.total_chunks > p.seg_chunks;
  }
  return p;
}

// The shortest segment length any allowed column block tries (kMinSegChunks with column
// block 128, else the first power of two after it).
int64_t shortest_candidate(const SegmentQuery& q) {
  int64_t seg = kMinSegChunks;
  while (!q.allow_cols && !seg_candidate_for(32, seg, longest_estimate(q)))
    seg = next_seg_candidate(seg);
  return seg;
}

// What the cost model needs of the sequences under plan p, lengths as the host sees them.
LoadStats load_stats(const SegmentQuery& q, const SegmentPlan& p) {
  LoadStats s;
  const int64_t longest = longest_estimate(q);
  s.longest = static_cast<double>(longest);
  s.total = static_cast<double>(q.total_chunks);
  s.segs = static_cast<double>(p.max_segments);
  s.max_segs_per_seq = static_cast<double>(segments_of(longest, p.seg_chunks));
  return s;
}

// The cost model's estimate for plan p (csrc/planner.h); with `overlapped`, for a split plan
// whether the overlapped schedule is the cheaper (the estimate returned is then its own).
double estimate_us(const SegmentQuery& q, const SegmentPlan& p, const ForwardCost& c,
                   bool* overlapped = nullptr) {
  return estimate_state_pass_us(c, load_stats(q, p), static_cast<double>(q.Hv), q.sms,
                                p.col_block, p.split ? static_cast<double>(p.seg_chunks) : 0.0,
                                overlapped);
}

// estimate_us, setting the plan's schedule: the overlapped one (with its sub-segments)
// where the model finds it cheaper.
double estimate_schedule_us(const SegmentQuery& q, SegmentPlan& p, const ForwardCost& c) {
  bool overlapped = false;
  const double us = estimate_us(q, p, c, &overlapped);
  p.overlap = overlapped;
  p.nsub = overlapped && c.nsub > 1 ? c.nsub : 1;
  return us;
}

// A host-made sequential split at column block 128: its phase 0's merge factor
// (SegmentPlan::p0_merge, best_p0_merge); 1 for every other plan.
void set_p0_merge(const SegmentQuery& q, SegmentPlan& p, const ForwardCost& c) {
  p.p0_merge = 1;
  if (!p.split || p.overlap || p.corr || p.col_block != 128 || p.device_choice) return;
  const LoadStats s = load_stats(q, p);
  const double heads = static_cast<double>(q.Hv);
  p.p0_merge = best_p0_merge(c, s, split_terms(c, s, heads, q.sms, 128,
                                               static_cast<double>(p.seg_chunks)), heads);
}

// The column blocks the device may pick for packed sequences (SegmentPlan::device_col_blocks):
// those whose least cost, the work term at ceil(tokens / 64) chunks (any split only adds),
// does not exceed `bound`, an upper bound on the cost of the device's choice. unsplit_only:
// the device picks among unsplit plans only, whose critical path is the longest sequence,
// at least the average one (tokens / 64 / N chunks) at the block's fastest step: with N
// sequences of about equal length the blocks that cannot win are not launched (H100, 2/8
// heads 4096 + 4096 tokens: 16 columns unsplit, but the 32- and 128-column kernels were
// launched as well and returned at once, 0.196 ms against 0.175 with the host's choice).
int device_col_blocks(const SegmentQuery& q, const ForwardCost& c, double bound,
                      bool unsplit_only) {
  LoadStats least;
  least.total = static_cast<double>(q.total_chunks - q.N);  // varlen: total_chunks adds N
  const double longest = q.N > 0 ? static_cast<double>((q.total_chunks - q.N) / q.N) : 0.0;
  int mask = 0;
  for (int bw : {16, 32, 128}) {
    if (bw == 128 && !q.allow_cols) continue;
    double cost = estimate_state_pass_us(c, least, static_cast<double>(q.Hv), q.sms, bw, 0.0);
    if (unsplit_only) {
      const double t = step_us(c, bw), tw = wave_step_us(c, bw);
      const double step = tw > 0.0 && tw < t ? tw : t;
      cost = std::max(cost, longest * step);
    }
    if (cost <= bound) mask |= col_block_bit(bw);
  }
  return mask;
}

// A column choice left to the device where only the plan's own block can win (the mask of
// device_col_blocks holds it alone): the plan's block, no choice on the device. Then the
// passes that need the planner's own column block run (the 128-column pass converting bf16
// k and q itself, launch.cu kq_in_pass; H100, 2026-11-26, forward ms with cu_seqlens_cpu:
// 32/32 heads 28672 + 4096 1.188 -> 0.969, 16384 + 16384 1.186 -> 0.986; 16/16 heads 28672 +
// 4096 0.657 -> 0.544), and no kernel is launched only to return at once.
void settle_single_col_block(SegmentPlan& p) {
  if (p.device_col_block && p.device_col_blocks == col_block_bit(p.col_block)) {
    p.device_col_block = false;
    p.device_col_blocks = 0;
  }
}

// Whether a split of q's packed sequences could run the overlapped schedule in one wave: a
// split makes at least N + 1 segments, each a block per head, and the exact share of those
// that do not start a sequence runs as max(nsub, 2) blocks beside the others. This is the
// fit test estimate_state_pass_us had before 2026-11-24 (d43a23c); that estimate now
// allows more (summaries beside the warm-started blocks, sub-segments after them), so this
// bound is the stricter one for packed sequences and was kept as measured.
bool overlap_may_fit(const SegmentQuery& q, const ForwardCost& c) {
  const double ns = c.nsub > 2 ? c.nsub : 2.0, hv = static_cast<double>(q.Hv);
  return static_cast<double>(q.N + 1) * hv + c.exact_share * hv * (ns - 1.0) <= q.sms;
}

}  // namespace

static SegmentPlan plan_segments_any(const SegmentQuery& q, const ForwardCost& given);

// The host's plan for one sequence of q's tokens (varlen total_chunks counts a partial chunk
// per sequence on top of the tokens' chunks). Packed sequences take the overlapped launches
// (SegmentPlan::device_overlap) only where it is overlapped: where the
// device then picks the sequential split, the overlapped launches' empty blocks (sized for
// nsub sub-segments of the shortest segments) and the second stream cost time (H100, 2/8
// heads, 28672 + 4096 tokens: 0.402 -> 0.419 ms, 8192 x 4: 0.377 -> 0.393), while every
// measured gain was on fewer chunks (2/8 1024 + 7168: 0.294 -> 0.220).
static SegmentPlan plan_as_one_sequence(const SegmentQuery& q, const ForwardCost& given) {
  SegmentQuery one = q;
  one.N = 1;
  one.fixed_chunks = one.total_chunks = std::max<int64_t>(1, q.total_chunks - q.N);
  one.longest_hint = -1;
  return plan_segments_any(one, given);
}

// The plan among the column blocks q allows (see plan_segments).
static SegmentPlan plan_segments_any(const SegmentQuery& q, const ForwardCost& given) {
  // the overlapped schedule is the host's to choose: not where the device picks the split
  ForwardCost cost = given;
  if (q.fixed_chunks < 0 && q.N > 1) cost.overlap = false;
  const int fb = q.forced_col_block;
  const int forced_bw = fb == 16 || fb == 32 || (fb == 128 && q.allow_cols) ? fb : 0;
  if (q.N <= 0 || q.Hv <= 0 || q.mode == CpMode::Off) {
    // unsplit: 16 columns when the (sequence, head) pairs leave SMs idle at 32; 128 when
    // the cost model prefers it
    int bw = forced_bw ? forced_bw : unsplit_col_block(q.N, q.Hv, q.sms);
    SegmentPlan u = unsplit(q, bw);
    u.est_us = q.N > 0 && q.Hv > 0 ? estimate_us(q, u, cost) : 0.0;
    if (!forced_bw && q.allow_cols && q.N > 0 && q.Hv > 0) {
      SegmentPlan c = unsplit(q, 128);
      c.est_us = estimate_us(q, c, cost);
      if (c.est_us < u.est_us) u = c;
    }
    return u;
  }
  const int64_t longest = longest_chunks(q), longest_est = longest_estimate(q);
  if (q.mode == CpMode::On) {
    const int64_t seg = q.forced_seg_chunks > 0 ? q.forced_seg_chunks : ceil_div(longest, 4);
    SegmentPlan s = with_length(q, seg, forced_bw ? forced_bw : 32);
    s.est_us = estimate_us(q, s, cost);
    set_p0_merge(q, s, cost);
    return s;
  }
  // Auto: the cheapest of the unsplit plans and the splits into segments of 32, 64, 128, ...
  // chunks, for each column block; a split must save at least min_gain.
  SegmentPlan best_unsplit, best_split, best_overlapped, best_corr, best_saturated;
  best_unsplit.est_us = best_split.est_us = best_overlapped.est_us = best_corr.est_us =
      best_saturated.est_us = 1e300;
  // exact outputs by correction: host-made splits only (not the device's, packed sequences),
  // and only with the overlapped schedule (its estimate runs phase 0 beside the chain)
  const bool corr = cost.corr && cost.overlap && !(q.fixed_chunks < 0 && q.N > 1);
  ForwardCost sequential = cost;
  sequential.overlap = false;
  for (int bw : {16, 32, 128}) {
    if ((forced_bw && bw != forced_bw) || (bw == 128 && !q.allow_cols)) continue;
    SegmentPlan u = unsplit(q, bw);
    u.est_us = estimate_us(q, u, cost);
    if (u.est_us < best_unsplit.est_us) best_unsplit = u;
    // overlapped_only: a length below kMinSegChunks, whose sequential plan is not a candidate
    // sequential_only: a kReachSegChunks split (exact_reach), no overlapped estimate
    auto consider = [&](int64_t seg, bool overlapped_only = false, bool sequential_only = false) {
      SegmentPlan s = with_length(q, seg, bw);
      if (!s.split) return;
      s.exact_reach = sequential_only;
      s.est_us = estimate_us(q, s, sequential);
      if (!overlapped_only && s.est_us < best_split.est_us) best_split = s;
      if (!cost.overlap || sequential_only) return;
      s.est_us = estimate_schedule_us(q, s, cost);
      if (s.overlap && s.est_us < best_overlapped.est_us) best_overlapped = s;
    };
    // FLASHGDN_CP_SEG with auto (q.forced_seg_chunks): that length alone, every schedule the
    // model allows it (for measurements: the planner's lengths are the candidates below)
    if (q.forced_seg_chunks > 0) {
      consider(q.forced_seg_chunks);
      continue;
    }
    for (int64_t seg = kMinSegChunks; seg < longest_est; seg = next_seg_candidate(seg))
      if (seg_candidate_for(bw, seg, longest_est, cost.overlap, cost.short_seg_longest))
        consider(seg);
    // lengths the host knows, 128 columns, sequences of at most reach_seg_longest chunks:
    // the sequential split in kReachSegChunks-chunk segments, started exactly where a
    // warm-up would reach the sequence's start (ForwardCost::reach_seg_longest)
    if (bw == 128 && q.fixed_chunks > 0 && longest_est > kReachSegChunks &&
        longest_est <= cost.reach_seg_longest)
      consider(kReachSegChunks, /*overlapped_only=*/false, /*sequential_only=*/true);
    // lengths the host knows (fixed length, one packed sequence), 128 columns (one block per
    // SM), plans that may run overlapped (seg_candidate_for's `fine`): also the length of
    // every segment count, the shortest that cuts the sequence into n segments, so that a
    // plan's blocks can fill their wave exactly (H100, 4/16 heads x 16384 tokens, 256
    // chunks, overlapped: 6 segments of 43 chunks 0.342 ms, of 52 0.361; 48, the candidate
    // above, makes 6 as well, the longest 48); for sequences of short_seg_longest+ chunks
    // (kMinOverlapLongest) below kMinSegChunks too, down to short_seg_min
    // (kMinOverlapSegChunks), on the overlapped schedule only
    // (its warm-ups run beside the exact heads' chain, which shorter segments shorten)
    if (bw == 128 && q.fixed_chunks > 0 && cost.overlap) {
      const int64_t shortest =
          longest_est >= cost.short_seg_longest ? cost.short_seg_min : kMinSegChunks;
      for (int64_t n = 2; ceil_div(longest_est, n) >= shortest; ++n) {
        const int64_t seg = ceil_div(longest_est, n);
        if (seg < kMinSegChunks)
          consider(seg, /*overlapped_only=*/true);
        else if (seg_candidate_for(bw, seg, longest_est, /*fine=*/true, cost.short_seg_longest))
          consider(seg);
      }
    }
    // corr: 16 and 32 columns, segments from kMinCorrSegChunks (its chain has no warm-up,
    // and every block must fit in one wave anyway)
    for (int64_t seg = kMinCorrSegChunks; corr && bw != 128 && seg < longest_est;
         seg = next_seg_candidate(seg)) {
      SegmentPlan k = with_length(q, seg, bw);
      if (!k.split) continue;
      k.corr = true;
      k.overlap = true;  // its phase 0 beside the chain; no sub-segments
      k.est_us = estimate_corr_us(cost, load_stats(q, k), static_cast<double>(q.Hv),
                                  static_cast<double>(q.N), q.sms, bw, static_cast<double>(seg));
      if (k.est_us < best_corr.est_us) best_corr = k;
    }
  }
  // the overlapped schedule where the model's gain over the best sequential split is large
  // enough to survive its overstatement (ForwardCost::overlap_margin)
  if (best_overlapped.est_us <= cost.overlap_margin * best_split.est_us)
    best_split = best_overlapped;
  // More blocks than one wave: the best sequential split's segments on the overlapped
  // schedule without sub-segments (ForwardCost::overlap_saturated; lengths the host knows
  // only, the device's choice for packed sequences stays its own). Only at those segments:
  // where fewer, longer segments would make the exact chain the bound, the estimate is
  // unmeasured.
  if (cost.overlap && best_split.split && !best_split.overlap && best_split.col_block == 128 &&
      q.fixed_chunks > 0 && !best_split.exact_reach) {
    best_saturated = best_split;
    best_saturated.est_us = estimate_saturated_overlap_us(
        cost, load_stats(q, best_split), static_cast<double>(q.Hv), q.sms,
        static_cast<double>(best_split.seg_chunks));
    best_saturated.overlap = true;
    best_saturated.saturated = true;
    best_saturated.nsub = 1;
    if (best_saturated.est_us <= cost.sat_margin * best_split.est_us) best_split = best_saturated;
  }
  if (best_corr.est_us < best_split.est_us) best_split = best_corr;
  const bool lengths_unknown = q.fixed_chunks < 0 && q.N > 1 && !forced_bw;
  // The host's estimates take the worst case (one sequence holding every chunk, the most
  // segments), so they bound the plans' costs at the actual lengths; the device picks a
  // split only when it saves min_gain over the best unsplit plan, so its choice costs at
  // most the best unsplit estimate and at most the best split's over (1 - min_gain).
  const double bound = std::min(best_unsplit.est_us, best_split.est_us / (1.0 - cost.min_gain));
  const bool split_wins =
      best_split.split && best_split.est_us < (1.0 - cost.min_gain) * best_unsplit.est_us;
  const bool anyway = q.device_choice_anyway && best_split.split && q.fixed_chunks < 0 && q.N > 1;
  if (split_wins || anyway) {
    if (q.fixed_chunks < 0 && q.N > 1) {
      // varlen: the estimate took the total as the longest sequence; size the grids for the
      // shortest segments and let the device choose from the actual lengths
      SegmentPlan d = with_length(q, shortest_candidate(q), best_split.col_block);
      d.est_us = best_split.est_us;
      d.device_choice = true;
      d.device_col_block = lengths_unknown;
      // Where one sequence of all the chunks would take the saturated schedule (no
      // sub-segments) the device may pick it too (choose_plan): the overlapped launches
      // without sub-segments, unless the caller's hint on the longest sequence rules it out
      // (the overlapped launches cost the device's sequential choice ~1%: H200, 4/16 heads,
      // 16384 + 16384 0.500 -> 0.506 ms, 8192 x 4 0.500 -> 0.507)
      // (that sequence's plan with ForwardCost::unfused_wy_us from twice unfused_wy_longest:
      // the worst case's one sequence of every chunk is at least two in a packed batch, so
      // its term from 128 chunks took the overlapped launches from 8/24 6144+2048, whose
      // overlapped choice measured faster (0.248 against 0.260 ms); from 256 it keeps them
      // there and drops them for 16 heads x 256 chunks, whose sequential choice then takes
      // kWy: without the host copy (CP_OVERLAP=0, H100 2026-11-27) 4/16 12288+4096 0.325 ->
      // 0.278, 2x8192 0.326 -> 0.279, 16/16 0.351 -> 0.295, 0.351 -> 0.296; the device's
      // choice at the actual lengths counts the term as it is). Where the caller's hint puts
      // the longest sequence under unfused_wy_longest the term cannot apply to that choice,
      // so the launches are planned without it (16 heads, 6144 + 6144 + 4096 tokens: the
      // overlapped choice in segments of 48 kept)
      ForwardCost launches = given;
      launches.unfused_wy_longest = 2 * given.unfused_wy_longest;
      if (q.longest_hint > 0 && static_cast<double>(q.longest_hint) < given.unfused_wy_longest)
        launches.unfused_wy_us = 0.0;
      const SegmentPlan one = plan_as_one_sequence(q, launches);
      const bool sat_ruled_out = one.saturated && q.longest_hint > 0 &&
                                 static_cast<double>(q.longest_hint) < given.sat_min_longest;
      d.device_overlap = given.overlap && d.col_block == 128 && overlap_may_fit(q, given) &&
                         one.overlap && !sat_ruled_out;
      d.nsub = d.device_overlap && given.nsub > 1 && !one.saturated ? given.nsub : 1;
      if (lengths_unknown)
        d.device_col_blocks =
            device_col_blocks(q, cost, bound, false) | col_block_bit(d.col_block);
      settle_single_col_block(d);
      return d;
    }
    set_p0_merge(q, best_split, cost);
    return best_split;
  }
  // 16 columns only pay when one long sequence is the critical path, which the host
  // cannot tell for packed sequences: the device decides (likewise between 128 and the
  // others: 128 pays when the total work, not one sequence, bounds the pass)
  best_unsplit.device_col_block = lengths_unknown && (best_unsplit.col_block == 16 || q.allow_cols);
  if (best_unsplit.device_col_block) {
    best_unsplit.device_col_blocks =
        device_col_blocks(q, cost, bound, true) | col_block_bit(best_unsplit.col_block);
    settle_single_col_block(best_unsplit);
  }
  return best_unsplit;
}

SegmentPlan plan_segments(const SegmentQuery& q, const ForwardCost& cost) {
  SegmentPlan p = plan_segments_any(q, cost);
  if (cost.p0_list && cost.p0_list_margin > 0.0 && q.mode == CpMode::Auto &&
      q.forced_seg_chunks == 0) {
    // ForwardCost::p0_list_margin: the list-scheduled plan only where the list schedule puts
    // it below p0_list_margin of the whole waves' plan (at the same length, merge and
    // schedule, as the list schedule counts it)
    ForwardCost waves_cost = cost;
    waves_cost.p0_list = false;
    const SegmentPlan w = plan_segments_any(q, waves_cost);
    if (w.split != p.split || w.seg_chunks != p.seg_chunks || w.col_block != p.col_block ||
        w.p0_merge != p.p0_merge || w.overlap != p.overlap || w.saturated != p.saturated ||
        w.device_choice != p.device_choice) {
      double theirs = w.est_us;
      if (w.split && !w.device_choice) {
        SegmentQuery at = q;
        at.forced_seg_chunks = w.seg_chunks;
        at.forced_col_block = w.col_block;
        const SegmentPlan wl = plan_segments_any(at, cost);
        if (wl.split && wl.seg_chunks == w.seg_chunks) theirs = wl.est_us;
      }
      if (!(p.est_us < (1.0 - cost.p0_list_margin) * theirs)) p = w;
    }
  }
  p.cols = q.allow_cols;
  return p;
}

// device_pick's estimate of the choice `out` it made from est (the unsplit column block's, or
// the split candidate's at out's length and column block, on out's schedule)
static double picked_estimate(int ncand, const double (*est)[3], const int64_t* seg,
                              const int64_t* out) {
  for (int i = 3; i < ncand; ++i)
    if (seg[i / 3 - 1] == out[0] && device_bw(i) == out[1])
      return out[2] != 0 ? std::min(est[i][1], est[i][2]) : est[i][0];
  for (int b = 0; b < 3; ++b)
    if (device_bw(b) == out[1]) return est[b][0];
  return 1e300;
}

void device_choice_on_host(const DeviceChoiceParams& c, const int64_t* chunks, int64_t n,
                           int64_t seg_chunks, int64_t out[4], bool exact_counts) {
  int64_t longest = 0, total = 0;
  for (int64_t i = 0; i < n; ++i) {
    longest = std::max(longest, chunks[i]);
    total += chunks[i];
  }
  int64_t seg[kMaxSegCandidates];
  unsigned long long segs[kMaxSegCandidates] = {};
  int nk = device_seg_candidates(c, longest, seg);
  if (exact_counts && nk > 0 && !c.cost.overlap) {
    // the shortest length that cuts the longest sequence into m segments, for every m the
    // candidates' range allows (as the host's plans of one sequence try them): a split
    // whose blocks fill their wave exactly (H100, 2026-11-26, 32 heads, 1024 + 7168 tokens:
    // the device's lengths give 3 segments of 48 for the 112-chunk sequence where 38 make 3;
    // forward 0.422 -> 0.365 ms). Sequential splits only: where the overlapped launches are
    // made the device's candidates are every m 2^e (m = 4 .. 7) already, and the exact counts
    // measured no better (2/8 heads 16384 + 16384: 37 chunks 0.317 ms against 40's 0.306).
    std::vector<int64_t> all(seg, seg + nk);
    for (int64_t m = 2; m <= longest; ++m) {
      const int64_t l = ceil_div(longest, m);
      if (l < c.min_seg) break;
      if (l < longest) all.push_back(l);
    }
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    // at most kMaxSegCandidates: the shortest ones kept (the longer lengths are the device's
    // own, a factor of 2^(1/4) apart)
    nk = static_cast<int>(std::min<size_t>(all.size(), kMaxSegCandidates));
    std::copy(all.begin(), all.begin() + nk, seg);
  }
  for (int k = 0; k < nk; ++k)
    for (int64_t i = 0; i < n; ++i)
      segs[k] += static_cast<unsigned long long>(segments_of(chunks[i], seg[k]));
  const bool exact_p0 = exact_counts && c.cost.exact_p0 && n >= 2;
  double est[kMaxPlanCandidates][3], est_waves[kMaxPlanCandidates][3];
  int merge[kMaxPlanCandidates], merge_waves[kMaxPlanCandidates];
  const int ncand = 3 * (1 + nk);
  for (int i = 0; i < ncand; ++i) {
    const SplitEstimate e = device_candidate(c, i, seg, segs, longest, total, n);
    est[i][0] = est_waves[i][0] = e.sequential;
    est[i][1] = est_waves[i][1] = e.overlapped;
    est[i][2] = est_waves[i][2] = e.saturated;
    merge[i] = merge_waves[i] = e.merge;
    // ForwardCost::exact_p0: a 128-column split's phase 0 from its blocks, at its best merge
    const int k = i / 3 - 1;
    if (exact_p0 && k >= 0 && device_bw(i) == 128 &&
        e.sequential < 1e300) {
      double steps = -1.0;
      const int m = c.cost.p0_merge
                        ? exact_p0_merge(c.cost, chunks, n, seg[k], c.heads, c.sms, e.merge, &steps)
                        : 1;
      if (!c.cost.p0_merge)
        steps = p0_exact_steps(chunks, n, seg[k], 1, c.heads, c.sms, c.cost.warm_chunks,
                               c.cost.p0_block_start);
      if (steps >= 0) {
        est[i][0] = e.sequential - e.phase0 + steps * c.cost.step_us_bw128;
        merge[i] = m;
      }
    }
  }
  device_pick(c, ncand, exact_p0 ? est_waves : est, exact_p0 ? merge_waves : merge, seg, total,
              seg_chunks, out);
  if (exact_p0) {
    // ForwardCost::exact_p0: the choice with every 128-column split's phase 0 from its blocks
    // (its merge from them too), taken over the whole waves' choice where it is the same
    // split or the blocks' estimate of it is below exact_p0_margin of theirs of the other
    int64_t ex[4];
    device_pick(c, ncand, est, merge, seg, total, seg_chunks, ex);
    const bool same = ex[0] == out[0] && ex[1] == out[1] && ex[2] == out[2];
    if (same || picked_estimate(ncand, est, seg, ex) <
                    (1.0 - c.cost.exact_p0_margin) * picked_estimate(ncand, est, seg, out)) {
      std::copy(ex, ex + 4, out);
      return;
    }
  }
  // the host's own choice for packed sequences: the merge from the blocks the split makes
  if (exact_counts && n >= 2 && out[1] == 128 && out[2] == 0 && out[0] < longest &&
      c.cost.p0_merge)
    out[3] = exact_p0_merge(c.cost, chunks, n, out[0], c.heads, c.sms, static_cast<int>(out[3]));
}

double p0_exact_steps(const int64_t* chunks, int64_t n, int64_t seg, int m, double heads, int sms,
                      double warm, double start) {
  // the groups' lengths in launch order
  std::vector<double> groups;
  int in_group = 0;
  int64_t run_seq = -1;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t segs = segments_of(chunks[s], seg);
    for (int64_t j = 0; j < segs; ++j) {
      const double len = static_cast<double>(std::min(seg, chunks[s] - j * seg));
      if (in_group == 0) {
        groups.push_back(start);
        run_seq = -1;
      }
      // a new run (this sequence's first segment in the group) pays its warm-up unless it
      // starts the sequence
      if (run_seq != s && j > 0) groups.back() += warm;
      run_seq = s;
      groups.back() += len;
      in_group = (in_group + 1) % m;
      if (static_cast<int64_t>(groups.size()) > kMaxExactGroups) return -1.0;
    }
  }
  // SMs as (free from, count) in time order; each group's `heads` blocks take the earliest.
  // At most one group a distinct time, so sms + 1 places never run out (nor does the step
  // budget).
  std::vector<double> t(static_cast<size_t>(sms) + 1), cnt(static_cast<size_t>(sms) + 1);
  int g = 1;
  t[0] = 0.0, cnt[0] = static_cast<double>(sms);
  for (const double len : groups)
    dispatch_blocks(t.data(), cnt.data(), g, sms + 1, heads, len, std::numeric_limits<int>::max());
  return t[static_cast<size_t>(g) - 1];
}

int exact_p0_merge(const ForwardCost& cost, const int64_t* chunks, int64_t n, int64_t seg,
                   double heads, int sms, int current, double* steps_out) {
  const int cur = std::clamp(current, 1, kMaxP0Merge);
  const double base =
      p0_exact_steps(chunks, n, seg, cur, heads, sms, cost.warm_chunks, cost.p0_block_start);
  if (steps_out != nullptr) *steps_out = base;
  if (base < 0) return current;
  int best = cur;
  double best_steps = base * (1.0 - cost.p0_merge_gain);
  for (int m = 1; m <= kMaxP0Merge; ++m) {
    if (m == cur) continue;
    const double steps =
        p0_exact_steps(chunks, n, seg, m, heads, sms, cost.warm_chunks, cost.p0_block_start);
    if (steps >= 0 && steps < best_steps) best = m, best_steps = steps;
  }
  if (steps_out != nullptr && best != cur) *steps_out = best_steps;
  return best;
}

DeviceChoiceParams device_choice_params(const SegmentPlan& plan, ForwardCost cost, bool forward,
                                        bool device_schedule, int nsub, int64_t Hv, int sms) {
  DeviceChoiceParams c;
  c.cost = cost;
  // the device's split runs sequentially unless the overlapped launches are made for it
  c.cost.overlap = device_schedule;
  c.cost.nsub = nsub > 1 ? nsub : 1;  // the sub-segments the workspace holds
  // its phase-0 merge (chosen[3]) for the forward alone; the recomputation's plan as before
  c.cost.p0_merge = forward;
  // its saturated choice runs the WY part outside the pass (ForwardCost::saturated_unfused)
  c.cost.saturated_unfused = true;
  // the device's choices of one sequence as whole waves (ForwardCost::p0_list: measured with
  // the host's plans only)
  c.cost.p0_list = false;
  c.split_col_blocks = device_schedule ? col_block_bit(128) : 0;
  c.heads = static_cast<double>(Hv);
  c.sms = sms;
  c.col_block = plan.col_block;
  c.pick_col_block = plan.device_col_block;
  c.allow_cols = plan.cols;
  c.col_blocks = plan.device_col_block ? plan.device_col_blocks : col_block_bit(plan.col_block);
  c.allow_split = plan.device_choice;
  c.min_seg = plan.seg_chunks;
  return c;
}

CpMode cp_mode_from_env() {
  const char* v = std::getenv("FLASHGDN_CP");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return CpMode::Auto;
  if (std::strcmp(v, "0") == 0 || std::strcmp(v, "off") == 0) return CpMode::Off;
  if (std::strcmp(v, "1") == 0 || std::strcmp(v, "on") == 0) return CpMode::On;
  return CpMode::Auto;
}

int64_t cp_seg_chunks_from_env() {
  const char* v = std::getenv("FLASHGDN_CP_SEG");
  if (v == nullptr || *v == '\0') return 0;
  const long long x = std::atoll(v);
  return x > 0 ? static_cast<int64_t>(x) : 0;
}

int col_block_from_env() {
  const char* v = std::getenv("FLASHGDN_FWD_BW");
  if (v == nullptr || *v == '\0') return 0;
  const int x = std::atoi(v);
  return x == 16 || x == 32 || x == 128 ? x : 0;
}

}  // namespace flashgdn
