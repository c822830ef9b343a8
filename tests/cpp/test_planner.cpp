// The context-parallel planner (csrc/planner.h): when it splits sequences into
// segments, how long the segments are, the column block, and the grid bound it reports.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "planner.h"

using flashgdn::CpMode;
using flashgdn::kMinSegChunks;
using flashgdn::plan_segments;
using flashgdn::SegmentQuery;

namespace {

SegmentQuery query(int64_t N, int64_t chunks_per_seq, int64_t Hv, bool varlen = false) {
  SegmentQuery q;
  q.N = N;
  q.total_chunks = varlen ? N * chunks_per_seq + N : N * chunks_per_seq;
  q.fixed_chunks = varlen ? -1 : chunks_per_seq;
  q.Hv = Hv;
  q.sms = 132;
  return q;
}

// The forward fp16 pass's cost model (launch.cu plan_cost): its one-wave narrow steps.
flashgdn::ForwardCost fp16_cost() {
  flashgdn::ForwardCost c;
  c.step_us_bw16_wave = flashgdn::ForwardCost::kFp16Bw16Wave;
  c.step_us_bw32_wave = flashgdn::ForwardCost::kFp16Bw32Wave;
  return c;
}

}  // namespace

TEST(Planner, SplitsOneLongSequenceAtTp8) {
  // 2/8 heads, one 32768-token sequence: unsplit, 64 blocks of 16 columns run 512 steps
  // each; 8 segments of 64 chunks at 32 columns fill the SMs with 2 waves
  const auto q = query(1, 512, 8);
  const auto p = plan_segments(q);
  EXPECT_TRUE(p.split);
  EXPECT_EQ(p.col_block, 32);
  EXPECT_EQ(p.seg_chunks, 64);
  EXPECT_EQ(p.max_segments, 8);
  auto off = q;
  off.mode = CpMode::Off;
  const auto u = plan_segments(off);
  EXPECT_FALSE(u.split);
  EXPECT_EQ(u.col_block, 16);  // unsplit, 32 columns would leave 100 SMs idle
  EXPECT_GT(p.est_us, 0.0);
  EXPECT_LT(p.est_us, 0.6 * u.est_us);  // the model expects the split to save 40%+
}

TEST(Planner, SplitsAtTp4) {
  const auto p = plan_segments(query(1, 512, 16));  // 4/16 heads, 32768 tokens
  EXPECT_TRUE(p.split);
  EXPECT_EQ(p.seg_chunks, 128);
  EXPECT_EQ(p.max_segments, 4);
}

TEST(Planner, DeclinesWhenHeadsFillTheGpu) {
  for (int64_t hv : {32, 48, 64}) {  // 128+ blocks of 32 columns already fill 132 SMs
    const auto p = plan_segments(query(1, 512, hv));
    EXPECT_FALSE(p.split) << hv;
    EXPECT_EQ(p.max_segments, 1);
    EXPECT_GE(p.seg_chunks, 512);
    EXPECT_EQ(p.col_block, 32);
  }
}

TEST(Planner, DeclinesWhenSequencesFillTheGpu) {
  const auto p = plan_segments(query(4, 128, 8));  // 8192 x 4 at 2/8: 4 x 8 x 4 = 128 blocks
  EXPECT_FALSE(p.split);
  EXPECT_EQ(p.max_segments, 4);
  EXPECT_EQ(plan_segments(query(8, 64, 8)).split, false);
}

TEST(Planner, DeclinesShortSequences) {
  const auto p = plan_segments(query(1, kMinSegChunks, 8));  // no segment below the minimum
  EXPECT_FALSE(p.split);
  EXPECT_EQ(p.max_segments, 1);
}

TEST(Planner, VarlenBoundCoversEverySplit) {
  // 28672 + 4096 tokens: the device decides the per-sequence split; the bound must cover
  // sum_n max(1, ceil(c_n / seg)) for any lengths with the same total.
  auto q = query(2, 256, 8, /*varlen=*/true);
  const auto p = plan_segments(q);
  EXPECT_TRUE(p.split);
  EXPECT_TRUE(p.device_choice);  // lengths unknown here: plan_kernel picks the length
  EXPECT_EQ(p.seg_chunks, 32);  // grids sized for the shortest candidate of 16/32 columns
  auto qc = q;
  qc.allow_cols = true;  // column block 128 also tries kMinSegChunks (24)
  EXPECT_EQ(plan_segments(qc).seg_chunks, kMinSegChunks);
  EXPECT_FALSE(plan_segments(query(1, 512, 8)).device_choice);  // fixed length: known
  for (int64_t c0 : {448, 256, 500, 1}) {
    const int64_t c1 = 512 - c0;
    const int64_t need = std::max<int64_t>(1, (c0 + p.seg_chunks - 1) / p.seg_chunks) +
                         std::max<int64_t>(1, (c1 + p.seg_chunks - 1) / p.seg_chunks);
    EXPECT_LE(need, p.max_segments) << c0;
  }
}

TEST(Planner, DeviceChoosesColumnBlockForPackedSequences) {
  // 8 x 1024 tokens at 16/16 heads: under the host's worst case (one sequence of all 128
  // chunks) 16 columns would win, so the device picks from the actual lengths
  const auto p = plan_segments(query(8, 16, 16, /*varlen=*/true));
  EXPECT_FALSE(p.split);
  EXPECT_TRUE(p.device_col_block);
  EXPECT_FALSE(plan_segments(query(1, 128, 16, /*varlen=*/true)).device_col_block);  // N = 1
  EXPECT_FALSE(plan_segments(query(8, 16, 16)).device_col_block);  // fixed length: known
  auto q = query(8, 16, 16, /*varlen=*/true);
  q.forced_col_block = 16;
  EXPECT_FALSE(plan_segments(q).device_col_block);  // forced
  EXPECT_TRUE(plan_segments(query(2, 256, 8, /*varlen=*/true)).device_col_block);  // split too
}

TEST(Planner, ForcedModes) {
  auto q = query(1, 512, 64);
  q.mode = CpMode::On;
  q.forced_seg_chunks = 3;
  auto p = plan_segments(q);
  EXPECT_TRUE(p.split);
  EXPECT_EQ(p.seg_chunks, 3);
  EXPECT_EQ(p.max_segments, 171);  // ceil(512 / 3)
  q.forced_seg_chunks = 0;          // default: a quarter of the longest sequence
  p = plan_segments(q);
  EXPECT_EQ(p.seg_chunks, 128);
  q.forced_col_block = 16;
  EXPECT_EQ(plan_segments(q).col_block, 16);
  q = query(1, 512, 8);
  q.mode = CpMode::Off;
  p = plan_segments(q);
  EXPECT_FALSE(p.split);
  EXPECT_EQ(p.max_segments, 1);
  q.mode = CpMode::Auto;
  q.forced_col_block = 16;  // Auto with a forced column block still plans the split
  p = plan_segments(q);
  EXPECT_EQ(p.col_block, 16);
  EXPECT_TRUE(p.split);
}

TEST(Planner, CostModelPrefersFewerBlocksWhenWorkDominates) {
  // 8/32 heads: 128 blocks of 32 columns already fill the SMs; a forced split costs more.
  auto q = query(1, 512, 32);
  const auto p = plan_segments(q);
  EXPECT_FALSE(p.split);
  q.mode = CpMode::On;
  q.forced_seg_chunks = 64;
  const auto s = plan_segments(q);
  EXPECT_TRUE(s.split);
  EXPECT_GT(s.est_us, p.est_us);
}

TEST(Planner, EmptyInputs) {
  auto p = plan_segments(query(0, 0, 8));
  EXPECT_FALSE(p.split);
  EXPECT_EQ(p.max_segments, 0);
  p = plan_segments(query(3, 0, 8));  // T = 0: one (empty) segment per sequence
  EXPECT_FALSE(p.split);
  EXPECT_EQ(p.max_segments, 3);
}

TEST(Planner, ColumnBlock128WhereAllowed) {
  // The forward's f16 pass may run state_fwd_cols_kernel (128 columns, one block per head):
  // a quarter of the block-steps of 32 columns, so it wins wherever the total work, not
  // one sequence's chain of steps, bounds the pass; split segments supply the blocks.
  auto q = query(1, 512, 32);  // 16/32 heads, 32768 tokens
  q.allow_cols = true;
  auto p = plan_segments(q);
  EXPECT_EQ(p.col_block, 128);
  EXPECT_TRUE(p.cols);
  EXPECT_TRUE(p.split);
  EXPECT_EQ(p.seg_chunks, 64);
  q = query(1, 512, 8);  // 2/8 heads: 16 segments of 32, sequential (kWy; see FewHeads...),
  q.allow_cols = true;    // on the plain pass 13 segments of 40 chunks, overlapped (below)
  p = plan_segments(q);
  EXPECT_EQ(p.col_block, 128);
  EXPECT_EQ(p.seg_chunks, 32);
  EXPECT_FALSE(p.overlap);
  flashgdn::ForwardCost plain_pass;  // ForwardCost::fused_wy off (FLASHGDN_COLS_TMA=0)
  plain_pass.fused_wy = false;
  p = plan_segments(q, plain_pass);
  EXPECT_EQ(p.col_block, 128);
  EXPECT_EQ(p.seg_chunks, 40);
  EXPECT_TRUE(p.overlap);
  // 2/8 and 4/16 heads, 8192 tokens, sequential schedule: segments of 24 chunks (6 x 8 or
  // 6 x 16 blocks, one wave; measured on H100: 0.286 ms vs 0.321 at 32 chunks, 4/16: 0.333
  // vs 0.366). (The overlapped one is taken there by default: OverlappedSchedule... below.)
  // (Without the kReachSegChunks candidate, ForwardCost::reach_seg_longest: ReachSegments.)
  flashgdn::ForwardCost sequential;
  sequential.overlap = false;
  sequential.reach_seg_longest = 0;
  for (int64_t hv : {8, 16}) {
    q = query(1, 128, hv);
    q.allow_cols = true;
    p = plan_segments(q, sequential);
    EXPECT_EQ(p.col_block, 128) << hv;
    EXPECT_EQ(p.seg_chunks, 24) << hv;
    EXPECT_EQ(p.max_segments, 6) << hv;
  }
  // 4/16 heads, 16384 tokens: 24 chunks would need 11 x 16 = 176 blocks, two waves of one
  // block per SM; sequential, 32 chunks fill one (measured 0.514 ms vs 0.598, 2026-11-23);
  // the overlapped schedule took 6 segments of 43 (96 blocks and 24 exact summaries in a
  // wave; H100, 2026-11-25: 0.342 ms against 0.358 sequential in segments of 32). Since the
  // sequential pass forms the WY part inside (kWy) and the overlapped one does not
  // (ForwardCost::unfused_wy_us), sequential wins (H100, 2026-11-27: 0.271 against 0.304)
  q = query(1, 256, 16);
  q.allow_cols = true;
  EXPECT_EQ(plan_segments(q, sequential).seg_chunks, 32);
  EXPECT_EQ(plan_segments(q).seg_chunks, 32);
  EXPECT_FALSE(plan_segments(q).overlap);
  flashgdn::ForwardCost fused_everywhere;
  fused_everywhere.unfused_wy_us = 0.0;
  EXPECT_EQ(plan_segments(q, fused_everywhere).seg_chunks, 43);
  EXPECT_TRUE(plan_segments(q, fused_everywhere).overlap);
  // 128 chunks at 16 heads stayed overlapped (4/16 x 8192: 0.192 against 0.202 sequential);
  // since ForwardCost::reach_seg_longest sequential in 16-chunk segments (ReachSegments)
  q = query(1, 128, 16);
  q.allow_cols = true;
  flashgdn::ForwardCost no_reach;
  no_reach.reach_seg_longest = 0;
  EXPECT_TRUE(plan_segments(q, no_reach).overlap);
  EXPECT_TRUE(plan_segments(q).exact_reach);
  q = query(1, 32, 8);  // 2/8 heads, 2048 tokens: too short to split, 16 columns fill more SMs
  q.allow_cols = true;
  EXPECT_EQ(plan_segments(q).col_block, 16);
  q = query(1, 512, 32);  // not allowed (the backward's recomputation): never 128
  q.forced_col_block = 128;
  p = plan_segments(q);
  EXPECT_NE(p.col_block, 128);
  EXPECT_FALSE(p.cols);
  q.allow_cols = true;  // allowed and forced
  EXPECT_EQ(plan_segments(q).col_block, 128);
  auto v = query(8, 16, 16, /*varlen=*/true);  // packed, 128 a candidate: a split at 128
  v.allow_cols = true;                          // wins at any lengths, the device picks
  const auto pv = plan_segments(v);             // its segments (or none) only
  EXPECT_EQ(pv.col_block, 128);
  EXPECT_TRUE(pv.device_choice);
  EXPECT_FALSE(pv.device_col_block);
}

TEST(Planner, SegmentCandidatesAndWaves) {
  // m 2^e for m = 4 .. 7: 24, 28, 32, 40, 48, 56, 64, 80, ...
  int64_t seg = flashgdn::kMinSegChunks;
  const int64_t expect[] = {24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256};
  for (int64_t e : expect) {
    EXPECT_EQ(seg, e);
    seg = flashgdn::next_seg_candidate(seg);
  }
  // 16/32 columns keep the powers of two; 128 tries 24 only for sequences of 128+ chunks
  EXPECT_FALSE(flashgdn::seg_candidate_for(32, 24, 512));
  EXPECT_TRUE(flashgdn::seg_candidate_for(32, 64, 512));
  EXPECT_TRUE(flashgdn::seg_candidate_for(128, 24, 128));
  EXPECT_FALSE(flashgdn::seg_candidate_for(128, 24, 127));
  EXPECT_TRUE(flashgdn::seg_candidate_for(128, 48, 64));
  // the lengths with m = 5, 7 only for plans that may take the overlapped schedule
  EXPECT_FALSE(flashgdn::seg_candidate_for(128, 40, 512));
  EXPECT_TRUE(flashgdn::seg_candidate_for(128, 40, 512, /*fine=*/true));
  EXPECT_TRUE(flashgdn::seg_candidate_for(128, 96, 512));
  // one block of 128 columns per SM: 129 blocks take two waves, 132 one (phase 0 in the
  // plan's segments: with merged segments, best_p0_merge, the 144 fit one wave again)
  flashgdn::ForwardCost c;
  c.p0_merge = false;
  flashgdn::LoadStats s;
  s.longest = s.total = 512;
  s.segs = 16;
  s.max_segs_per_seq = 16;
  const double one_wave = flashgdn::estimate_state_pass_us(c, s, 8, 132, 128, 32);  // 128 blocks
  const double two_waves = flashgdn::estimate_state_pass_us(c, s, 9, 132, 128, 32); // 144 blocks
  EXPECT_GT(two_waves - one_wave, 0.9 * (32 + c.warm_chunks) * c.step_us_bw128);
  flashgdn::ForwardCost merged;
  EXPECT_LT(flashgdn::estimate_state_pass_us(merged, s, 9, 132, 128, 32), two_waves);
  EXPECT_EQ(flashgdn::estimate_state_pass_us(merged, s, 8, 132, 128, 32), one_wave);
}

// Phase 0 of a sequential 128-column split in merged segments (SegmentPlan::p0_merge): where
// the plan's segments take two waves of blocks and blocks of two segments fit one (H200,
// 2026-11-26, 4/16 heads x 32768 tokens: 0.519 -> 0.505 ms); not on the overlapped schedule,
// not where one wave holds the plan's blocks, not for the device's choice.
TEST(Planner, PhaseZeroMergesSegmentsWhereTwoWavesBecomeOne) {
  auto q = query(1, 512, 16);
  q.allow_cols = true;
  flashgdn::ForwardCost c;
  c.overlap_saturated = false;  // (the default takes the saturated schedule here)
  const auto p = plan_segments(q, c);
  EXPECT_TRUE(p.split && !p.overlap);
  EXPECT_EQ(p.col_block, 128);
  EXPECT_EQ(p.seg_chunks, 32);
  EXPECT_EQ(p.p0_merge, 2);
  c.p0_merge = false;
  const auto u = plan_segments(q, c);
  EXPECT_EQ(u.p0_merge, 1);
  EXPECT_EQ(u.seg_chunks, p.seg_chunks);
  EXPECT_LT(p.est_us, u.est_us);
  flashgdn::ForwardCost d;
  q = query(1, 256, 8);  // 2/8 x 16384: overlapped, one wave
  q.allow_cols = true;
  const auto o = plan_segments(q, d);
  EXPECT_TRUE(o.overlap);
  EXPECT_EQ(o.p0_merge, 1);
  q = query(1, 128, 16);  // 4/16 x 8192: one wave
  q.allow_cols = true;
  EXPECT_EQ(plan_segments(q, d).p0_merge, 1);
  q = query(2, 512, 16);  // packed: the device picks the segments, no merge
  q.fixed_chunks = -1;
  q.total_chunks = 513;
  q.allow_cols = true;
  const auto v = plan_segments(q, d);
  EXPECT_TRUE(v.device_choice);
  EXPECT_EQ(v.p0_merge, 1);
}

TEST(Planner, PackedSequencesLaunchOnlyColumnBlocksThatCanWin) {
  using flashgdn::col_block_bit;
  // 8192 x 4 at 8/32 and 16/32 heads: 512 chunks of 32 heads are 3300+ us of 16-column and
  // 2000+ us of 32-column work whatever the lengths, against ~1000 us for 128 columns split
  // at the worst case: only the 128-column kernel can win, so the plan takes it and the
  // device picks no column block (the passes that need the planner's own 128 columns run:
  // launch.cu kq_in_pass; H100 2026-11-26, 32/32 heads 28672 + 4096 1.188 -> 0.969 ms)
  for (int64_t hv : {16, 32}) {
    auto q = query(4, 128, hv, /*varlen=*/true);
    q.allow_cols = true;
    const auto p = plan_segments(q);
    EXPECT_TRUE(p.device_choice) << hv;
    EXPECT_EQ(p.col_block, 128) << hv;
    EXPECT_FALSE(p.device_col_block) << hv;
    EXPECT_EQ(p.device_col_blocks, 0) << hv;
  }
  // 8 x 1024 tokens at 16/16 heads without 128 columns (the backward's plans): one
  // sequence of all 128 chunks would run best at 16 columns, 8 short ones at 32: both stay
  auto q = query(8, 16, 16, /*varlen=*/true);
  auto p = plan_segments(q);
  EXPECT_TRUE(p.device_col_block);
  EXPECT_EQ(p.device_col_blocks, col_block_bit(16) | col_block_bit(32));
  // with 128 columns: a split at 128 beats 16 and 32 columns at any lengths, so the plan
  // takes 128 and the device picks only its segments
  q.allow_cols = true;
  p = plan_segments(q);
  EXPECT_EQ(p.col_block, 128);
  EXPECT_TRUE(p.device_choice);
  EXPECT_FALSE(p.device_col_block);
}

TEST(Planner, OverlappedScheduleOnlyWhereItFitsOneWave) {
  // 2/8 heads x 8192 tokens (128 chunks): the split's blocks, the summaries and the
  // sub-segments fit beside each other on 132 SMs; the overlapped schedule shortens the
  // exact heads' chain and is chosen, with 4 sub-segments
  auto q = query(1, 128, 8);
  q.allow_cols = true;
  flashgdn::ForwardCost sequential;
  sequential.overlap = false;
  const auto p = plan_segments(q), s = plan_segments(q, sequential);
  EXPECT_TRUE(p.split && p.overlap);
  EXPECT_EQ(p.col_block, 128);
  EXPECT_EQ(p.nsub, 4);
  EXPECT_TRUE(s.split && !s.overlap);
  EXPECT_EQ(s.nsub, 1);
  EXPECT_LT(p.est_us, s.est_us);
  // 32768 tokens (512 chunks): in 16 segments 128 blocks of 128 columns already fill the
  // SMs and the schedule's extra blocks would take a second wave (measured slower); in 13
  // segments of 40 chunks (78 warm-started blocks beside 24 exact segments' 48 summaries)
  // it fits, and since its chain's kernels start as programmatic dependents it wins
  // (H100, 2026-11-25: 0.338 ms against 0.381 sequential in 16 segments) on the plain pass;
  // with kWy in the sequential split (the default since session 57) that one wins instead
  // (ForwardCost::few_heads_seq_work)
  q = query(1, 512, 8);
  q.allow_cols = true;
  flashgdn::ForwardCost plain_pass;
  plain_pass.fused_wy = false;
  EXPECT_TRUE(plan_segments(q, plain_pass).overlap);
  EXPECT_EQ(plan_segments(q, plain_pass).seg_chunks, 40);
  EXPECT_FALSE(plan_segments(q).overlap);
  q = query(1, 512, 16);  // 4/16 heads: 6 segments of 86 overlapped, 0.611 against 0.616:
  q.allow_cols = true;    // the model does not take it (with sub-segments, in one wave);
  flashgdn::ForwardCost no_sat;  // since session 35 the saturated schedule at 32 chunks
  no_sat.overlap_saturated = false;
  EXPECT_FALSE(plan_segments(q, no_sat).overlap);
  EXPECT_EQ(plan_segments(q, no_sat).seg_chunks, 32);
  EXPECT_EQ(plan_segments(q).seg_chunks, 32);
  EXPECT_EQ(plan_segments(q).nsub, 1);
  // packed sequences whose lengths the device sees: never the host's schedule (the device
  // picks it: DeviceOverlapForFewPackedSequences)
  q = query(4, 512, 8, /*varlen=*/true);
  q.allow_cols = true;
  EXPECT_FALSE(plan_segments(q).overlap);
  // 16 or 32 columns: never, the same estimate with or without the candidate
  bool ov = true;
  flashgdn::LoadStats st;
  st.longest = st.total = 128;
  st.segs = st.max_segs_per_seq = 4;
  const double e32 = flashgdn::estimate_state_pass_us(flashgdn::ForwardCost{}, st, 8, 132, 32,
                                                       32, &ov);
  EXPECT_FALSE(ov);
  EXPECT_EQ(e32, flashgdn::estimate_state_pass_us(sequential, st, 8, 132, 32, 32));
}

TEST(Planner, LongestHintPlansPackedShortSequencesWithoutASplit) {
  // 1024 packed sequences of 512 tokens (8 chunks) at 32 heads: without a hint the host
  // must allow for one sequence holding every chunk (a split chosen on the device, whose
  // launches are mostly empty blocks); with max_seqlen known no sequence can be split
  auto q = query(1024, 8, 32, /*varlen=*/true);
  q.allow_cols = true;
  const auto blind = plan_segments(q);
  EXPECT_TRUE(blind.split && blind.device_choice);
  q.longest_hint = 8;
  const auto hinted = plan_segments(q);
  EXPECT_FALSE(hinted.split);
  EXPECT_FALSE(hinted.device_choice);
  // sizes never depend on the hint: one segment per sequence, as long as all chunks
  EXPECT_EQ(hinted.max_segments, 1024);
  EXPECT_GE(hinted.seg_chunks, q.total_chunks);
  // 4 x 8192 tokens at 32 heads: 128 blocks of 128 columns fill the SMs unsplit
  q = query(4, 128, 32, /*varlen=*/true);
  q.allow_cols = true;
  EXPECT_TRUE(plan_segments(q).split);
  q.longest_hint = 128;
  EXPECT_FALSE(plan_segments(q).split);
  // 2/8 heads, 4 x 8192: a split still pays and is left to the device (the hint bounds the
  // longest sequence, not the others), sized from the total as without the hint
  q = query(4, 128, 8, /*varlen=*/true);
  q.allow_cols = true;
  const auto blind8 = plan_segments(q);
  q.longest_hint = 128;
  const auto hinted8 = plan_segments(q);
  EXPECT_TRUE(hinted8.split && hinted8.device_choice);
  EXPECT_EQ(hinted8.max_segments, blind8.max_segments);
}

TEST(Planner, PlansStayValidWhateverTheHint) {
  // random packed queries, with and without a longest_hint (any value, also below the true
  // longest): an unsplit plan's segment is as long as all chunks together (the device never
  // cuts a sequence the plan did not size for), a split plan's grid holds total / seg + N
  // segments and runs phase 1 whenever any sequence can be longer than a segment, and the
  // overlapped schedule is never taken where the device picks the split
  std::mt19937 rng(7);
  for (int it = 0; it < 20000; ++it) {
    auto q = query(1 + rng() % 2000, 1, 1 << (rng() % 7), /*varlen=*/true);
    q.total_chunks = 1 + rng() % 20000 + q.N;
    q.allow_cols = rng() % 2;
    q.longest_hint = rng() % 3 == 0 ? -1 : 1 + static_cast<int64_t>(rng() % q.total_chunks);
    const auto p = plan_segments(q);
    if (!p.split) {
      EXPECT_GE(p.seg_chunks, q.total_chunks) << it;
    } else {
      EXPECT_GE(p.max_segments, q.total_chunks / p.seg_chunks + q.N) << it;
      EXPECT_GT(q.total_chunks, p.seg_chunks) << it;
    }
    if (q.N > 1) {
      EXPECT_FALSE(p.overlap) << it;
    }
  }
}

TEST(Planner, OneWaveOfNarrowBlocksForShortSequencesOfTheFp16Pass) {
  // The forward's fp16 pass (launch.cu plan_cost): where every 16- or 32-column block of an
  // unsplit pass has an SM to itself, its steps are the one-wave ones. H100: 8/24 heads x
  // 2048 tokens ran 0.129 ms at 32 columns against 0.173 at 128; 16/16 heads 0.114 at 16
  // against 0.123 at 32.
  flashgdn::ForwardCost fp16 = fp16_cost();
  auto q = query(1, 32, 24);
  q.allow_cols = true;
  EXPECT_EQ(plan_segments(q).col_block, 128);  // the tf32-era steps: 128 columns
  auto p = plan_segments(q, fp16);
  EXPECT_FALSE(p.split);
  EXPECT_EQ(p.col_block, 32);  // 96 blocks of 32 columns: one wave
  q.Hv = 16;
  EXPECT_EQ(plan_segments(q, fp16).col_block, 16);  // 128 blocks of 16 columns: one wave
  // long sequences still split at 128 columns: one wave of narrow blocks is 512 steps long
  auto tp8 = query(1, 512, 8);
  tp8.allow_cols = true;
  p = plan_segments(tp8, fp16);
  EXPECT_TRUE(p.split);
  EXPECT_EQ(p.col_block, 128);
}

TEST(Planner, DeviceOverlapForFewPackedSequences) {
  // Packed sequences at few heads: the host launches the overlapped schedule (4
  // sub-segments) and the device picks it or the sequential one with the split. Only where
  // a split's N + 1 segments can fit in a wave beside the exact ones' sub-segments,
  // (N + 1) H_v + 0.25 H_v (4 - 1) <= 132, and one sequence of all the chunks would run
  // overlapped.
  auto q = query(2, 64, 8, /*varlen=*/true);  // 2/8 heads, 2 sequences
  q.allow_cols = true;
  auto p = plan_segments(q);
  EXPECT_TRUE(p.split && p.device_choice && p.device_overlap);
  EXPECT_FALSE(p.overlap);  // not the host's
  EXPECT_EQ(p.nsub, 4);
  EXPECT_EQ(p.col_block, 128);
  q.N = 14;  // 15 x 8 + 6 = 126
  EXPECT_TRUE(plan_segments(q).device_overlap);
  q.N = 15;  // 16 x 8 + 6 = 134
  EXPECT_FALSE(plan_segments(q).device_overlap);
  EXPECT_EQ(plan_segments(q).nsub, 1);
  q = query(2, 256, 8, /*varlen=*/true);  // 28672 + 4096 tokens: fits, and one sequence of
  q.allow_cols = true;                     // 514 chunks runs overlapped on the plain pass:
  flashgdn::ForwardCost plain_pass;        // launched; with kWy sequential, not launched
  plain_pass.fused_wy = false;             // (ForwardCost::few_heads_seq_work)
  EXPECT_TRUE(plan_segments(q, plain_pass).device_choice);
  EXPECT_TRUE(plan_segments(q, plain_pass).device_overlap);
  EXPECT_TRUE(plan_segments(q).device_choice);
  EXPECT_FALSE(plan_segments(q).device_overlap);
  q = query(4, 24, 16, /*varlen=*/true);  // 4/16 heads, 4 sequences: 5 x 16 + 12 = 92
  q.allow_cols = true;
  EXPECT_TRUE(plan_segments(q).device_overlap);
  flashgdn::ForwardCost sequential;  // FLASHGDN_CP_OVERLAP=0 (launch.cu plan_cost)
  sequential.overlap = false;
  EXPECT_FALSE(plan_segments(q, sequential).device_overlap);
  q.allow_cols = false;  // no 128-column pass (the tf32 passes, the backward)
  EXPECT_FALSE(plan_segments(q).device_overlap);
  q = query(1, 512, 8, /*varlen=*/true);  // one packed sequence: the host's own plan
  q.fixed_chunks = q.total_chunks = 512;
  q.allow_cols = true;
  EXPECT_FALSE(plan_segments(q).device_overlap);
}

TEST(Planner, OverlapEstimateFromTheDevicesSegments) {
  // The device knows its segments (LoadStats::seg_blocks, seqs): the first segment of a
  // sequence starts from h0, so only the others count towards the exact share. 4/16 heads,
  // 160 + 32 chunks at segments of 32: 7 segments, 112 blocks; exact 0.25 x 5 x 16 = 20,
  // their summaries (2 blocks each) beside 92 warm-started blocks: 132 fit in a wave.
  // Counted as a share of all 112 blocks: 84 + 2 x 28 = 140 do not.
  flashgdn::ForwardCost c;
  flashgdn::LoadStats st;
  st.longest = 160;
  st.total = 192;
  st.segs = 7;
  st.max_segs_per_seq = 5;
  st.seg_blocks = 7;
  bool ov = false;
  flashgdn::estimate_state_pass_us(c, st, 16, 132, 128, 32, &ov);
  EXPECT_FALSE(ov);
  st.seqs = 2;
  flashgdn::estimate_state_pass_us(c, st, 16, 132, 128, 32, &ov);
  EXPECT_TRUE(ov);
}

TEST(Planner, SubSegmentsWaitForTheWarmStartedBlocks) {
  // 2/8 heads, one sequence of 256 chunks: at segments of 24 (11 segments, 88 blocks) the
  // 66 warm-started blocks and the 22 exact segments' summaries fit in a wave, their 88
  // sub-segments only after the warm-started blocks: the estimate waits for those (29
  // chunk steps) and still beats segments of 32 (H100: 0.245 ms against 0.259). Since
  // 2026-11-26 the overlapped schedule also tries lengths below 24: 13 segments of 20
  // (H200: 0.195 ms against 0.197 at 24; OverlapTriesShorterSegments).
  auto q = query(1, 256, 8);
  q.allow_cols = true;
  const auto p = plan_segments(q);
  EXPECT_TRUE(p.split && p.overlap);
  EXPECT_EQ(p.seg_chunks, 20);
  EXPECT_EQ(p.col_block, 128);
  flashgdn::ForwardCost c;
  flashgdn::LoadStats st;
  st.longest = st.total = 256;
  st.segs = st.max_segs_per_seq = 11;
  bool ov = false;
  const double t = flashgdn::estimate_state_pass_us(c, st, 8, 132, 128, 24, &ov);
  EXPECT_TRUE(ov);
  EXPECT_GE(t, (24 + c.warm_chunks) * c.step_us_bw128 + 6 * c.step_us_bw128);
}

TEST(Planner, ExactOutputsByCorrectionForShortTpSequences) {
  // The forward's fp16 pass with exact outputs by correction (ForwardCost::corr): at 2/8
  // heads x 4096 tokens (64 chunks) the unsplit pass is 64 steps of 16-column blocks; a
  // split into segments of 24 at 32 columns (112 blocks, one wave) runs its exact heads'
  // chain as phase 1 with outputs, the combine and seg_correct_kernel. H100, 2026-11-24:
  // 0.167 -> 0.129 ms (segments of 16: 152 blocks, two waves, 0.130; of 32: 0.144).
  flashgdn::ForwardCost fp16 = fp16_cost();
  auto q = query(1, 64, 8);
  q.allow_cols = true;
  // without corr: unsplit, or (kMinShortSegLongest) the overlapped 128-column split
  const auto no_corr = plan_segments(q, fp16);
  EXPECT_FALSE(no_corr.corr);
  EXPECT_TRUE(!no_corr.split || (no_corr.col_block == 128 && no_corr.overlap));
  fp16.corr = true;
  auto p = plan_segments(q, fp16);
  EXPECT_TRUE(p.split);
  EXPECT_TRUE(p.corr);
  EXPECT_TRUE(p.overlap);
  EXPECT_EQ(p.nsub, 1);
  EXPECT_EQ(p.col_block, 32);
  EXPECT_EQ(p.seg_chunks, 24);
  // every block of a corr plan must fit in one wave: at 64 heads none does
  auto wide = q;
  wide.Hv = 16 * 4;
  EXPECT_FALSE(plan_segments(wide, fp16).corr);
  // packed sequences (the device's split): never
  auto packed = query(2, 32, 8, /*varlen=*/true);
  packed.allow_cols = true;
  EXPECT_FALSE(plan_segments(packed, fp16).corr);
  // without the overlapped schedule (FLASHGDN_CP_OVERLAP=0): no corr
  auto no_overlap = fp16;
  no_overlap.overlap = false;
  EXPECT_FALSE(plan_segments(q, no_overlap).corr);
  // forced off (FLASHGDN_CP=off) and forced on without corr asked: no corr
  auto off = q;
  off.mode = CpMode::Off;
  EXPECT_FALSE(plan_segments(off, fp16).corr);
  auto on = q;
  on.mode = CpMode::On;
  EXPECT_FALSE(plan_segments(on, fp16).corr);
}

TEST(Planner, EqualPackedSequencesNeedNoDeviceChoice) {
  // 2 packed sequences of 4096 tokens (64 chunks each) with max_seqlen known: the longest is
  // at least the average, 64 chunks, so the 32- and 128-column kernels cannot beat 16
  // columns' one wave (64 x 2.1 us) at 2/8 heads, nor 128 columns 32 at 4/16: the host's
  // choice, no kernels launched that would return at once
  flashgdn::ForwardCost fp16 = fp16_cost();
  for (int64_t hv : {8, 16}) {
    auto q = query(2, 64, hv, /*varlen=*/true);
    q.allow_cols = true;
    q.longest_hint = 64;
    const auto p = plan_segments(q, fp16);
    EXPECT_FALSE(p.split) << hv;
    EXPECT_FALSE(p.device_col_block) << hv;
    EXPECT_EQ(p.col_block, hv == 8 ? 16 : 32) << hv;
    // a looser hint leaves room for a longer and a shorter sequence: the device picks (the
    // column block, or at 4/16 heads, where only 128 columns can win, the segments)
    q.longest_hint = 100;
    const auto loose = plan_segments(q, fp16);
    EXPECT_TRUE(loose.device_col_block || (loose.device_choice && loose.col_block == 128)) << hv;
  }
}

TEST(Planner, BackwardColumnBlockRule) {
  using flashgdn::backward_cols;
  // (value heads, chunks of all sequences, chunks of the longest): the rows measured on
  // H100 (2026-11-24) where 128 columns won ...
  const int64_t win[][3] = {{32, 512, 512}, {4, 512, 512},  {4, 516, 428},  {32, 260, 64},
                            {32, 256, 256}, {16, 192, 192}, {8, 384, 384},  {2 * 2, 384, 384},
                            {8, 322, 256},  {16, 322, 256}, {32, 128, 128}, {16, 260, 64},
                            // session 24 (16-bit records): long packed batches of few heads
                            {4, 517, 164},  {8, 517, 164},
                            // session 25 (fp16 reverse pass): less work, or one long sequence
                            {16, 128, 128}, {16, 132, 41},  {16, 256, 256}, {16, 256, 64},
                            {8, 128, 128},  {8, 192, 192},  {8, 256, 256},  {8, 256, 128},
                            {4, 192, 192},  {4, 256, 128}};
  for (const auto& r : win) EXPECT_TRUE(backward_cols(r[0], r[1], r[2], 132)) << r[0] << " " << r[1];
  // ... and where 16 / 32 columns did (session 25's measurements where they differ from
  // session 23's: 8 heads x 4 x 4096 and 4 heads x 16384 now tie, 16 heads x 8192 in 2 and
  // 4 sequences too; those are left out)
  const int64_t lose[][3] = {{4, 128, 128}, {4, 260, 64}, {4, 256, 64}, {8, 129, 68},
                             {4, 129, 68},  {4, 132, 41}};
  for (const auto& r : lose) EXPECT_FALSE(backward_cols(r[0], r[1], r[2], 132)) << r[0] << " " << r[1];
  // fewer SMs: the same work fills them sooner
  EXPECT_FALSE(backward_cols(8, 160, 64, 132));
  EXPECT_TRUE(backward_cols(8, 160, 64, 66));
}

TEST(Planner, BackwardShortSplitRule) {
  using flashgdn::backward_short_split;
  // (value heads, chunks of all sequences, chunks of the longest): 8192 tokens of 4, 8 or 16
  // value heads in sequences of 32 chunks or more (session 55, H200: 12-chunk segments won
  // on such rows when forced) ...
  const int64_t win[][3] = {{4, 128, 128}, {4, 128, 64}, {4, 128, 32}, {8, 128, 128},
                            {8, 128, 64},  {8, 128, 32}, {16, 128, 64}, {16, 128, 32}};
  for (const auto& r : win) EXPECT_EQ(backward_short_split(r[0], r[1], r[2]), 12) << r[0];
  // ... and where they lost or were not measured: eight sequences of 16 chunks, 32768 tokens,
  // 32 heads, an unknown longest sequence (0)
  const int64_t lose[][3] = {{4, 128, 16}, {4, 512, 64}, {4, 512, 512}, {32, 128, 128},
                             {16, 512, 512}, {8, 128, 0}};
  for (const auto& r : lose) EXPECT_EQ(backward_short_split(r[0], r[1], r[2]), 0) << r[0];
}

TEST(Planner, BackwardShortSplitFromQuery) {
  using flashgdn::SegmentQuery;
  SegmentQuery q;  // one sequence of 128 chunks, 8 value heads
  q.N = 1;
  q.Hv = 8;
  q.total_chunks = q.fixed_chunks = 128;
  EXPECT_EQ(flashgdn::longest_chunks_known(q), 128);
  EXPECT_EQ(flashgdn::longest_chunks_bound(q), 128);
  EXPECT_EQ(flashgdn::backward_short_seg(q, 1, 128), flashgdn::kBackwardShortSeg);
  EXPECT_EQ(flashgdn::backward_short_seg(q, 0, 128), 0);
  q.forced_seg_chunks = 20;  // FLASHGDN_CP_SEG: the planner does not choose
  EXPECT_EQ(flashgdn::backward_short_seg(q, 1, 128), 0);
  q.forced_seg_chunks = 0;
  q.mode = flashgdn::CpMode::Off;
  EXPECT_EQ(flashgdn::backward_short_seg(q, 1, 128), 0);
  q.mode = flashgdn::CpMode::Auto;
  // two packed sequences (max_chunks counts a partial chunk each): without a hint the
  // longest is unknown (no short split by the default rule; the average rule needs none)
  q.N = 2;
  q.fixed_chunks = -1;
  q.total_chunks = 66;
  EXPECT_EQ(flashgdn::longest_chunks_known(q), 0);
  EXPECT_EQ(flashgdn::longest_chunks_bound(q), 66);
  EXPECT_EQ(flashgdn::backward_short_seg(q, 1, 64), 0);
  EXPECT_EQ(flashgdn::backward_short_seg(q, 2, 64), flashgdn::kBackwardShortSeg);
  q.longest_hint = 40;  // cu_seqlens_cpu / max_seqlen
  EXPECT_EQ(flashgdn::longest_chunks_known(q), 40);
  EXPECT_EQ(flashgdn::longest_chunks_bound(q), 40);
  EXPECT_EQ(flashgdn::backward_short_seg(q, 1, 64), flashgdn::kBackwardShortSeg);
}

TEST(Planner, BackwardShortSplitEitherRule) {
  using flashgdn::SegmentQuery;
  constexpr int kEither = flashgdn::kBackwardShortEither;  // FLASHGDN_BWD_SHORT unset
  SegmentQuery q;
  q.Hv = 8;
  // four packed sequences of 8192 tokens in all, no hint: max_chunks 131 (> 128), the
  // longest unknown; only the average rule takes them
  q.N = 4;
  q.fixed_chunks = -1;
  q.total_chunks = 131;
  EXPECT_EQ(flashgdn::backward_short_seg(q, 1, 128), 0);
  EXPECT_EQ(flashgdn::backward_short_seg(q, 2, 128), flashgdn::kBackwardShortSeg);
  EXPECT_EQ(flashgdn::backward_short_seg(q, kEither, 128), flashgdn::kBackwardShortSeg);
  EXPECT_EQ(flashgdn::backward_short_seg(q, 0, 128), 0);
  // eight of them: 16 chunks a sequence on average, neither rule
  q.N = 8;
  q.total_chunks = 135;
  EXPECT_EQ(flashgdn::backward_short_seg(q, kEither, 128), 0);
  // two sequences of 2000 tokens (32 chunks each, 63 chunks of tokens: < 32 on average):
  // only the longest-sequence rule takes them, by the hint
  q.N = 2;
  q.total_chunks = 64;
  q.longest_hint = 32;
  EXPECT_EQ(flashgdn::backward_short_seg(q, 2, 63), 0);
  EXPECT_EQ(flashgdn::backward_short_seg(q, 1, 63), flashgdn::kBackwardShortSeg);
  EXPECT_EQ(flashgdn::backward_short_seg(q, kEither, 63), flashgdn::kBackwardShortSeg);
  // 32/32 heads x 8192 tokens: too much work for either
  q.Hv = 32;
  q.N = 1;
  q.fixed_chunks = q.total_chunks = 128;
  q.longest_hint = 0;
  EXPECT_EQ(flashgdn::backward_short_seg(q, kEither, 128), 0);
}

TEST(Planner, BackwardShortSplitByAverageRule) {
  using flashgdn::backward_short_split_avg;
  // (value heads, ceil(tokens / 64), sequences): the session-55 H200 rows the forced 12-chunk
  // split won, packed ones included (8192 tokens in 1, 2 or 4 sequences; 4, 8, 16 heads) ...
  const int64_t win[][3] = {{4, 128, 1}, {4, 128, 2}, {4, 128, 4}, {8, 128, 2},
                            {8, 128, 4}, {16, 128, 4}, {8, 40, 1}};
  for (const auto& r : win) EXPECT_EQ(backward_short_split_avg(r[0], r[1], r[2]), 12) << r[0];
  // ... and where it lost or was not measured: eight sequences of 8k tokens in all, 32k
  // tokens, 32 heads, 16 chunks of tokens
  const int64_t lose[][3] = {{4, 128, 8}, {16, 128, 8}, {4, 512, 1}, {32, 128, 1}, {8, 16, 1}};
  for (const auto& r : lose) EXPECT_EQ(backward_short_split_avg(r[0], r[1], r[2]), 0) << r[0];
}

TEST(Planner, BackwardShortSplitPackedRule) {
  using flashgdn::backward_short_split_packed;
  // (value heads, ceil(tokens / 64), the longest sequence's chunks): eight packed sequences of
  // 8192 tokens in all, the longest 41 chunks, at 4 and 8 value heads (session 60, H100:
  // the forced 12-chunk split won there) ...
  const int64_t win[][3] = {{4, 128, 41}, {8, 128, 41}, {8, 128, 32}, {2, 64, 32}};
  for (const auto& r : win) EXPECT_EQ(backward_short_split_packed(r[0], r[1], r[2]), 12) << r[0];
  // ... and where it lost or was not measured: 16 value heads (lost), the longest under 32
  // chunks or unknown (0), 32768 tokens
  const int64_t lose[][3] = {{16, 128, 41}, {8, 128, 31}, {8, 128, 0}, {4, 512, 41}};
  for (const auto& r : lose) EXPECT_EQ(backward_short_split_packed(r[0], r[1], r[2]), 0) << r[0];
  // through the query: eight sequences, 135 chunks counted (a partial one each), the hint 41;
  // the default mode takes them, sessions 56-59's (FLASHGDN_BWD_SHORT=3) did not
  flashgdn::SegmentQuery q;
  q.Hv = 8;
  q.N = 8;
  q.fixed_chunks = -1;
  q.total_chunks = 135;
  q.longest_hint = 41;
  EXPECT_EQ(flashgdn::backward_short_seg(q, flashgdn::kBackwardShortAll, 128),
            flashgdn::kBackwardShortSeg);
  EXPECT_EQ(flashgdn::backward_short_seg(q, flashgdn::kBackwardShortEither, 128), 0);
  q.longest_hint = 0;  // no host lengths: no rule knows the longest
  EXPECT_EQ(flashgdn::backward_short_seg(q, flashgdn::kBackwardShortAll, 128), 0);
}

TEST(Planner, BackwardReadyQueueRule) {
  using flashgdn::backward_ready_queue;
  // (value heads, chunks of tokens): session 60's rows where the queue won (H100): 2/4 x 8k and
  // x 32k, 4/8 and 8/16 x 8k ...
  const int64_t win[][2] = {{4, 128}, {4, 512}, {8, 128}, {16, 128}, {1, 2048}};
  for (const auto& r : win) EXPECT_TRUE(backward_ready_queue(r[0], r[1])) << r[0] << " " << r[1];
  // ... and where it was mixed or lost: 16/32 x 8k, 4/8 x 32k, 8/16 and 16/32 x 32k
  const int64_t lose[][2] = {{32, 128}, {8, 512}, {16, 512}, {32, 512}, {4, 513}};
  for (const auto& r : lose) EXPECT_FALSE(backward_ready_queue(r[0], r[1])) << r[0] << " " << r[1];
}

// The forward's log-depth scan (seg_scan_kernel): ceil(log2(segments - 1)) levels, the walk
// (0) for one step or more levels than allowed.
TEST(Planner, SaturatedOverlapAtTheSequentialSegments) {
  // 4/16 heads x 32768 tokens: the sequential split's 16 segments of 32 (256 blocks, two
  // waves) run overlapped without sub-segments (H200, 2026-11-25: state pass 434 -> 410 us)
  // (FLASHGDN_CP_SAT=1: force_saturated, at 0.99 of the sequential estimate, any length)
  auto q = query(1, 512, 16);
  q.allow_cols = true;
  flashgdn::ForwardCost off, on;
  off.overlap_saturated = false;
  flashgdn::force_saturated(on);
  off.p0_merge = on.p0_merge = false;  // the sequential estimate of the segments' own phase 0
  const auto seq = plan_segments(q, off), p = plan_segments(q, on);
  EXPECT_TRUE(seq.split && !seq.overlap);
  EXPECT_TRUE(p.split && p.overlap);
  EXPECT_EQ(p.seg_chunks, seq.seg_chunks);
  EXPECT_EQ(p.nsub, 1);
  EXPECT_EQ(p.col_block, 128);
  EXPECT_LT(p.est_us, seq.est_us);
  // 8/32 x 32768: 8 segments of 64 (706 against 729 us)
  q = query(1, 512, 32);
  q.allow_cols = true;
  EXPECT_TRUE(plan_segments(q, on).overlap);
  EXPECT_EQ(plan_segments(q, on).nsub, 1);
  EXPECT_EQ(plan_segments(q, on).seg_chunks, plan_segments(q, off).seg_chunks);
  // 16/64 x 32768: the block-steps (the warm-up chunks of 64 heads and the summaries) exceed
  // the sequential estimate; sequential
  q = query(1, 512, 64);
  q.allow_cols = true;
  EXPECT_FALSE(plan_segments(q, on).overlap);
  // where the plan fits one wave the one-wave schedule is unchanged (2/8 x 32768: 13
  // segments of 40, 4 sub-segments) on the plain pass
  q = query(1, 512, 8);
  q.allow_cols = true;
  flashgdn::ForwardCost on_plain = on;
  on_plain.fused_wy = false;
  EXPECT_EQ(plan_segments(q, on_plain).nsub, 4);
  // packed sequences: the device's choice, never the host's saturated schedule
  q = query(2, 256, 16, /*varlen=*/true);
  q.allow_cols = true;
  EXPECT_FALSE(plan_segments(q, on).overlap);
  // the default (ForwardCost::sat_margin 0.95, sat_min_longest 384 chunks, measured on the
  // H200 2026-11-26): 4/16 x 32768 saturated (model 0.93 of sequential), 8/32 x 32768 (0.97)
  // and 8/24 x 32768 (0.97, measured 12% slower) sequential, and 8/32 x 8192 (128 chunks,
  // measured 9% slower) sequential
  // (at 16-31 value heads only where the pass forms the WY part outside: ForwardCost::fused_wy;
  // with it, 4/16 x 32768 is sequential, H100 2026-11-27: 0.441 against 0.445 saturated)
  flashgdn::ForwardCost plain_pass;
  plain_pass.fused_wy = false;
  q = query(1, 512, 16);
  q.allow_cols = true;
  EXPECT_TRUE(plan_segments(q, plain_pass).overlap);
  EXPECT_TRUE(plan_segments(q, plain_pass).saturated);
  EXPECT_EQ(plan_segments(q, plain_pass).nsub, 1);
  EXPECT_TRUE(plan_segments(q).split);
  EXPECT_FALSE(plan_segments(q).overlap);
  EXPECT_TRUE(plan_segments(q, on).saturated);  // FLASHGDN_CP_SAT=1 (force_saturated)
  q = query(1, 512, 8);  // the one-wave overlapped plan is not the saturated one (the plain
  q.allow_cols = true;   // pass; with kWy neither: ForwardCost::few_heads_seq_work)
  EXPECT_TRUE(plan_segments(q, plain_pass).overlap);
  EXPECT_FALSE(plan_segments(q, plain_pass).saturated);
  EXPECT_FALSE(plan_segments(q).overlap);
  EXPECT_FALSE(plan_segments(q).saturated);
  for (const int hv : {32, 24}) {
    q = query(1, 512, hv);
    q.allow_cols = true;
    EXPECT_TRUE(plan_segments(q).split) << hv;
    EXPECT_FALSE(plan_segments(q).overlap) << hv;
  }
  q = query(1, 128, 32);
  q.allow_cols = true;
  EXPECT_FALSE(plan_segments(q).overlap);
  EXPECT_TRUE(plan_segments(q).exact_reach);  // (ReachSegments: never made saturated)
  EXPECT_FALSE(plan_segments(q, on).overlap);
  flashgdn::ForwardCost on_no_reach = on;
  on_no_reach.reach_seg_longest = 0;
  EXPECT_TRUE(plan_segments(q, on_no_reach).overlap);
  // packed, 4/16 heads: one sequence of all the chunks would take it, so the device may
  // (the overlapped launches without sub-segments), unless the hint on the longest sequence
  // is below 384 chunks (8192 x 4: the device's sequential split, looped)
  // (with the plain pass; with kWy at 16 heads no overlapped launches: the device's
  // sequential choice then takes kWy, CP_SAT=0 without the host copy 4/16 16384+16384 0.506
  // -> 0.425 ms)
  q = query(2, 256, 16, /*varlen=*/true);
  q.allow_cols = true;
  auto d = plan_segments(q, plain_pass);
  EXPECT_TRUE(d.device_choice && d.device_overlap);
  EXPECT_EQ(d.nsub, 1);
  EXPECT_FALSE(plan_segments(q).device_overlap);
  q.longest_hint = 128;
  d = plan_segments(q, plain_pass);
  EXPECT_TRUE(d.device_choice);
  EXPECT_FALSE(d.device_overlap);
  // the estimate itself: no value where the blocks fit one wave, and never below the block-
  // steps of both phases
  flashgdn::ForwardCost c = on;
  flashgdn::LoadStats st;
  st.longest = st.total = 512;
  st.segs = st.max_segs_per_seq = 16;
  EXPECT_GT(flashgdn::estimate_saturated_overlap_us(c, st, 2.0, 132, 32.0), 1e299);
  const double sat = flashgdn::estimate_saturated_overlap_us(c, st, 16.0, 132, 32.0);
  const double work0 = (512.0 + c.warm_chunks * 16) * 16 * c.step_us_bw128 / 132;
  EXPECT_GE(sat, work0);
  EXPECT_LT(sat, 1e299);
}

TEST(Planner, ScanLevels) {
  using flashgdn::scan_levels_for;
  EXPECT_EQ(scan_levels_for(24, 24, 7), 0);    // one segment
  EXPECT_EQ(scan_levels_for(48, 24, 7), 0);    // two: one step, the walk
  EXPECT_EQ(scan_levels_for(49, 24, 7), 1);    // three: steps 0, 1 in one level
  EXPECT_EQ(scan_levels_for(96, 24, 7), 2);    // four: three steps
  EXPECT_EQ(scan_levels_for(120, 24, 7), 2);   // five: four steps
  EXPECT_EQ(scan_levels_for(121, 24, 7), 3);   // six: five steps
  EXPECT_EQ(scan_levels_for(256, 24, 7), 4);   // 2/8 x 16384: 11 segments, 10 steps
  EXPECT_EQ(scan_levels_for(512, 40, 7), 4);   // 2/8 x 32768: 13 segments
  EXPECT_EQ(scan_levels_for(512, 64, 7), 3);   // 4/16 x 32768: 8 segments
  EXPECT_EQ(scan_levels_for(129, 1, 7), 7);    // 129 segments: 128 steps
  EXPECT_EQ(scan_levels_for(130, 1, 7), 0);    // 129 steps: past 7 levels
  EXPECT_EQ(scan_levels_for(130, 1, 8), 8);
  EXPECT_EQ(scan_levels_for(100, 0, 7), 7);    // seg 0 taken as 1: 99 steps
  // every level count covers its steps and no fewer would
  for (int64_t segs = 3; segs <= 129; ++segs) {
    const int l = scan_levels_for(segs, 1, 7);
    EXPECT_GE(int64_t{1} << l, segs - 1) << segs;
    EXPECT_LT(int64_t{1} << (l - 1), segs - 1) << segs;
  }
}

TEST(Planner, OverlapTriesShorterSegments) {
  // The overlapped schedule runs the warm-started segments beside the exact heads' chain,
  // so segments shorter than kMinSegChunks shorten that chain without the warm-ups' cost
  // on it: for sequences of kMinOverlapLongest+ chunks the planner also tries the lengths
  // of every segment count down to kMinOverlapSegChunks, on that schedule only. H200,
  // 2026-11-26, 2/8 heads x 8192 tokens: 7 segments of 19 chunks 0.138 ms, 6 of 24 0.152.
  auto q = query(1, 128, 8);
  q.allow_cols = true;
  auto p = plan_segments(q);
  EXPECT_TRUE(p.split && p.overlap);
  EXPECT_EQ(p.col_block, 128);
  EXPECT_EQ(p.seg_chunks, 19);
  EXPECT_GE(p.seg_chunks, flashgdn::kMinOverlapSegChunks);
  // the sequential schedule never goes below kMinSegChunks but for the kReachSegChunks
  // splits (ReachSegments), from at most reach_seg_longest chunks
  flashgdn::ForwardCost sequential;
  sequential.overlap = false;
  for (int64_t chunks : {128, 192, 256, 512}) {
    q = query(1, chunks, 8);
    q.allow_cols = true;
    p = plan_segments(q, sequential);
    if (p.split && !p.exact_reach) EXPECT_GE(p.seg_chunks, kMinSegChunks) << chunks;
    if (p.exact_reach) EXPECT_EQ(p.seg_chunks, flashgdn::kReachSegChunks) << chunks;
    if (chunks > sequential.reach_seg_longest) EXPECT_FALSE(p.exact_reach) << chunks;
  }
  // from kMinShortSegLongest (64) chunks as well (H100, 2026-11-26, 2/8 x 7168 tokens: 0.161
  // -> 0.132 ms); shorter sequences keep kMinSegChunks
  q = query(1, 112, 8);
  q.allow_cols = true;
  p = plan_segments(q);
  EXPECT_TRUE(p.split && p.overlap);
  EXPECT_LT(p.seg_chunks, kMinSegChunks);
  EXPECT_GE(p.seg_chunks, flashgdn::kMinOverlapSegChunks);
  q = query(1, 63, 8);
  q.allow_cols = true;
  p = plan_segments(q);
  if (p.split && !p.exact_reach) EXPECT_GE(p.seg_chunks, kMinSegChunks);
}

TEST(Planner, ShortSegmentsFromAnotherLength) {
  // ForwardCost::short_seg_longest / short_seg_min (FLASHGDN_CP_SHORT_LONGEST / _MIN): from
  // which sequence length 128-column segments under 32 chunks are tried, and down to which.
  // 16 heads x 64 chunks: from kMinOverlapLongest (128, the default until 2026-11-26) never
  // under kMinSegChunks (here: 16 columns unsplit, H100 0.194 ms); by default
  // (kMinShortSegLongest, 64) three overlapped segments of 22 (0.165 ms on 4/16 heads: 0.144);
  // down to 16, four segments of 16.
  auto q = query(1, 64, 16);
  q.allow_cols = true;
  flashgdn::ForwardCost c = fp16_cost();
  c.corr = true;  // as launch.cu plan_cost (the forward's fp16 pass)
  EXPECT_EQ(c.short_seg_longest, flashgdn::kMinShortSegLongest);
  auto p = plan_segments(q, c);
  EXPECT_TRUE(p.split && p.overlap);
  EXPECT_EQ(p.col_block, 128);
  EXPECT_EQ(p.seg_chunks, 22);
  c.short_seg_longest = flashgdn::kMinOverlapLongest;
  p = plan_segments(q, c);
  EXPECT_TRUE(!p.split || p.seg_chunks >= kMinSegChunks) << p.seg_chunks;
  c.short_seg_longest = 64;
  c.short_seg_min = 16;
  p = plan_segments(q, c);
  EXPECT_TRUE(p.split && p.overlap);
  EXPECT_EQ(p.col_block, 128);
  EXPECT_EQ(p.seg_chunks, 16);
  EXPECT_EQ(p.max_segments, 4);
  // sequences under short_seg_longest stay at kMinSegChunks+, whatever short_seg_min says
  q = query(1, 63, 16);
  q.allow_cols = true;
  p = plan_segments(q, c);
  EXPECT_TRUE(!p.split || p.seg_chunks >= kMinSegChunks) << p.seg_chunks;
  // 128-column candidates under 32 follow short_seg_longest
  EXPECT_FALSE(flashgdn::seg_candidate_for(128, 24, 64));  // kMinOverlapLongest
  EXPECT_TRUE(flashgdn::seg_candidate_for(128, 24, 64, false, 64));
  EXPECT_FALSE(flashgdn::seg_candidate_for(128, 24, 63, false, 64));
}

TEST(Planner, AutoWithForcedSegmentLength) {
  // FLASHGDN_CP_SEG with FLASHGDN_CP=auto (SegmentQuery::forced_seg_chunks in Auto mode):
  // that length alone, on whichever schedule the model prefers for it (a measurement knob)
  auto q = query(1, 256, 8);
  q.allow_cols = true;
  q.forced_seg_chunks = 22;
  auto p = plan_segments(q);
  EXPECT_TRUE(p.split);
  EXPECT_EQ(p.seg_chunks, 22);
  EXPECT_TRUE(p.overlap);
  q.forced_seg_chunks = 64;
  p = plan_segments(q);
  EXPECT_EQ(p.seg_chunks, 64);
}

TEST(Planner, FourThousandTokensAtManyHeadsSplitAtTheFasterStep) {
  // The 128-column step at 3.6 us (the ping-pong schedule; ForwardCost::step_us_bw128): one
  // 4096-token sequence at 24 or 32 value heads splits in two 32-chunk segments at 128
  // columns, overlapped, where 4.0 us kept it unsplit at 32 columns. H200, 2026-11-26: 8/32
  // 0.209 -> 0.185 ms, 16/32 0.218 -> 0.196, 8/24 0.202 -> 0.177, 32/32 0.236 -> 0.215.
  // (Segments under 32 from 128 chunks, as then: kMinOverlapLongest; since
  // kMinShortSegLongest three of 22, below.)
  flashgdn::ForwardCost fp16 = fp16_cost();
  EXPECT_DOUBLE_EQ(fp16.step_us_bw128, 3.6);
  for (int64_t hv : {24, 32}) {
    auto q = query(1, 64, hv);
    q.allow_cols = true;
    const auto now = plan_segments(q, fp16);
    EXPECT_TRUE(now.split) << hv;
    EXPECT_EQ(now.col_block, 128) << hv;
    // 32 heads: the kReachSegChunks split since ForwardCost::reach_seg_longest (H100,
    // 2026-11-27: 16/32 0.182 -> 0.173 ms, 8/32 0.178 -> 0.168, 32/32 0.184 -> 0.176)
    EXPECT_EQ(now.overlap, hv == 24) << hv;
    EXPECT_EQ(now.seg_chunks, hv == 24 ? 22 : flashgdn::kReachSegChunks) << hv;
  }
  fp16.reach_seg_longest = 0;  // (the plans before it)
  for (int64_t hv : {24, 32}) {
    auto q = query(1, 64, hv);
    q.allow_cols = true;
    EXPECT_TRUE(plan_segments(q, fp16).overlap) << hv;
    EXPECT_EQ(plan_segments(q, fp16).seg_chunks, 22) << hv;
  }
  fp16.short_seg_longest = flashgdn::kMinOverlapLongest;
  fp16.unfused_wy_us = 0.0;  // as then (24 heads: before ForwardCost::unfused_wy_us)
  for (int64_t hv : {24, 32}) {
    auto q = query(1, 64, hv);
    q.allow_cols = true;
    const auto p = plan_segments(q, fp16);
    EXPECT_TRUE(p.split) << hv;
    EXPECT_EQ(p.col_block, 128) << hv;
    EXPECT_EQ(p.seg_chunks, 32) << hv;
    EXPECT_TRUE(p.overlap) << hv;
    flashgdn::ForwardCost old = fp16;
    old.step_us_bw128 = 4.0;
    const auto before = plan_segments(q, old);
    EXPECT_FALSE(before.split) << hv;
    EXPECT_EQ(before.col_block, 32) << hv;
  }
  // issue 4's 2/8 x 16384 keeps its plan
  auto tp8 = query(1, 256, 8);
  tp8.allow_cols = true;
  flashgdn::ForwardCost old = fp16;
  old.step_us_bw128 = 4.0;
  const auto a = plan_segments(tp8, fp16), b = plan_segments(tp8, old);
  EXPECT_EQ(a.col_block, b.col_block);
  EXPECT_EQ(a.seg_chunks, b.seg_chunks);
  EXPECT_EQ(a.overlap, b.overlap);
}

// estimate_split (the device's choice evaluates a candidate with it once) against the
// host's entry points: the state pass's estimate is its sequential one or, where cheaper, its
// overlapped one (and says so), its saturated one is estimate_saturated_overlap_us's, its
// merge best_p0_merge's, over column blocks, heads, lengths and the cost switches.
TEST(Planner, SplitEstimateAgreesWithTheEstimates) {
  int checked = 0, overlapped_seen = 0, saturated_seen = 0, merged_seen = 0;
  for (const bool overlap : {false, true})
    for (const int nsub : {1, 4})
      for (const double heads : {2.0, 8.0, 16.0, 32.0, 64.0})
        for (const int bw : {16, 32, 128})
          for (const double longest : {64.0, 256.0, 448.0, 512.0, 2048.0})
            for (const double seg : {12.0, 24.0, 32.0, 40.0, 64.0, 200.0}) {
              flashgdn::ForwardCost c;
              c.overlap = overlap;
              c.nsub = nsub;
              flashgdn::LoadStats s;
              s.longest = s.total = longest;
              s.segs = s.max_segs_per_seq =
                  static_cast<double>(flashgdn::segments_of(static_cast<int64_t>(longest),
                                                            static_cast<int64_t>(seg)));
              const auto e = flashgdn::estimate_split(c, s, heads, 132, bw, seg);
              bool ov = false;
              const double t = flashgdn::estimate_state_pass_us(c, s, heads, 132, bw, seg, &ov);
              EXPECT_EQ(ov, e.overlapped < e.sequential);
              EXPECT_EQ(t, ov ? e.overlapped : e.sequential);
              if (bw == 128) {
                EXPECT_EQ(e.saturated,
                          flashgdn::estimate_saturated_overlap_us(c, s, heads, 132, seg));
                EXPECT_EQ(e.merge, flashgdn::best_p0_merge(
                                       c, s, flashgdn::split_terms(c, s, heads, 132, bw, seg),
                                       heads));
                saturated_seen += e.saturated < 1e299;
                merged_seen += e.merge > 1;
              } else {
                EXPECT_GT(e.saturated, 1e299);
                EXPECT_EQ(e.merge, 1);
              }
              overlapped_seen += ov;
              ++checked;
            }
  EXPECT_EQ(checked, 1800);
  // the grid reaches every schedule
  EXPECT_GT(overlapped_seen, 0);
  EXPECT_GT(saturated_seen, 0);
  EXPECT_GT(merged_seen, 0);
}

// The device's choice made on the host (device_choice_on_host: plan_kernel's steps) for the
// packed rows session 35 measured on the H200, from the host's plan as launch.cu hands it on
// (device_choice_params; cu_seqlens_cpu's hint on the longest sequence).
namespace {
struct DeviceChoice {
  flashgdn::SegmentPlan plan;
  int64_t out[4];
};
DeviceChoice device_choice_for(int64_t Hv, const std::vector<int64_t>& chunks,
                               bool exact_counts = false, bool anyway = false,
                               bool exact_p0 = true, bool plain_pass = false) {
  int64_t total = 0, longest = 0;
  for (const int64_t n : chunks) total += n, longest = std::max(longest, n);
  auto q = query(static_cast<int64_t>(chunks.size()), 1, Hv, /*varlen=*/true);
  q.total_chunks = total + q.N;
  q.longest_hint = longest;
  q.allow_cols = true;
  q.device_choice_anyway = anyway;
  DeviceChoice d;
  flashgdn::ForwardCost cost = fp16_cost();
  cost.exact_p0 = exact_p0;
  if (plain_pass) cost.fused_wy = false;  // FLASHGDN_COLS_TMA=0 (launch.cu plan_cost)
  d.plan = flashgdn::plan_segments(q, cost);
  const auto params = flashgdn::device_choice_params(
      d.plan, cost, /*forward=*/true, d.plan.device_overlap,
      d.plan.nsub > 1 ? d.plan.nsub : 0, Hv, 132);
  flashgdn::device_choice_on_host(params, chunks.data(), q.N, d.plan.seg_chunks, d.out,
                                  exact_counts);
  return d;
}
}  // namespace

TEST(Planner, HostChoiceTriesExactSegmentCounts) {
  // 32 heads, 1024 + 7168 tokens (16 + 112 chunks), a sequential split: the device's lengths
  // (24, 32, 48, 64, ...) cut the long sequence into 5 segments of 24 (phase 0 merged in
  // pairs; 48 before kMinShortSegLongest made 24 a candidate below 128 chunks: H100,
  // 2026-11-26, 32/32 0.377 -> 0.323 ms, 16/32 0.367 -> 0.316); the host's choice
  // (exact_counts) takes 38, 3 segments (H100, 2026-11-26: 0.422 -> 0.365 ms; 0.316 in the
  // later run), with phase 0 as whole waves; with it from its blocks (ForwardCost::exact_p0,
  // the default since 2026-11-27) 32, 4 segments (0.324 -> 0.318 ms, H100, 2026-11-27)
  auto dev = device_choice_for(32, {16, 112});
  auto host = device_choice_for(32, {16, 112}, /*exact_counts=*/true, false, /*exact_p0=*/false);
  EXPECT_FALSE(dev.plan.device_overlap);
  EXPECT_EQ(dev.out[0], 24);
  EXPECT_EQ(host.out[0], 38);
  EXPECT_EQ(host.out[1], 128);
  EXPECT_EQ(host.out[2], 0);
  host = device_choice_for(32, {16, 112}, /*exact_counts=*/true);
  EXPECT_EQ(host.out[0], 32);
  EXPECT_EQ(host.out[1], 128);
  EXPECT_EQ(host.out[2], 0);
  // where the overlapped launches are made the device's candidates are the host's: 2/8
  // heads, 16384 + 16384 tokens on the plain pass, segments of 40 either way (with kWy the
  // sequential split, no overlapped launches: ForwardCost::few_heads_seq_work)
  dev = device_choice_for(8, {256, 256}, false, false, true, /*plain_pass=*/true);
  host = device_choice_for(8, {256, 256}, /*exact_counts=*/true, false, true, true);
  EXPECT_TRUE(dev.plan.device_overlap);
  EXPECT_EQ(host.out[0], dev.out[0]);
  EXPECT_FALSE(device_choice_for(8, {256, 256}).plan.device_overlap);
}

TEST(Planner, DeviceChoiceAnywayForKnownLengths) {
  // launch.cu host_split_plan: 16 heads, 2 x 4096 tokens (64 + 64 chunks). The worst-case
  // estimates (one sequence of 128 chunks) keep the batch unsplit at 32 columns; planned as
  // the device's choice anyway, the choice at these lengths is 24-chunk segments on the
  // overlapped schedule (H100, 2026-11-26: 0.251 -> 0.206 ms). At 32 heads the choice stays
  // unsplit, so host_split_plan keeps the plain plan (no measured gain there).
  auto plain = device_choice_for(16, {64, 64});
  EXPECT_FALSE(plain.plan.split);
  EXPECT_FALSE(plain.plan.device_choice);
  auto d = device_choice_for(16, {64, 64}, /*exact_counts=*/true, /*anyway=*/true);
  EXPECT_TRUE(d.plan.device_choice);
  EXPECT_TRUE(d.plan.device_overlap);
  EXPECT_EQ(d.out[0], 24);
  EXPECT_EQ(d.out[1], 128);
  EXPECT_EQ(d.out[2], 1);
  d = device_choice_for(32, {64, 64}, true, true);
  EXPECT_GT(d.out[0], 64);  // unsplit: longer than any sequence
  // a fixed length or a single sequence ignores the flag
  auto q = query(1, 64, 16);
  q.allow_cols = true;
  q.device_choice_anyway = true;
  EXPECT_FALSE(flashgdn::plan_segments(q, fp16_cost()).device_choice);
}

TEST(Planner, DeviceChoiceOfMeasuredPackedRows) {
  // 4/16 heads, 28672 + 4096 tokens: 16 segments of 32, the overlapped launches without
  // sub-segments. The device's saturated choice (0.514 -> 0.504 ms, H200, 2026-11-26) runs
  // its WY part outside the pass (ForwardCost::saturated_unfused), so the sequential split
  // in merged pairs is the choice (H100, 2026-11-27: 0.492 -> 0.426 ms)
  // With kWy at 16 heads (ForwardCost::fused_wy) no saturated schedule, so no overlapped
  // launches for it either: the device's sequential choice in the plain launches.
  auto d = device_choice_for(16, {448, 64});
  EXPECT_TRUE(d.plan.device_choice);
  EXPECT_FALSE(d.plan.device_overlap);
  EXPECT_EQ(d.plan.nsub, 1);
  EXPECT_EQ(d.out[0], 32);
  EXPECT_EQ(d.out[1], 128);
  EXPECT_EQ(d.out[2], 0);
  EXPECT_EQ(d.out[3], 2);
  // 16384 + 16384: the longest (256 chunks) is under sat_min_longest, so no overlapped
  // launches; the sequential split in merged pairs (0.504 ms)
  d = device_choice_for(16, {256, 256});
  EXPECT_FALSE(d.plan.device_overlap);
  EXPECT_EQ(d.out[0], 32);
  EXPECT_EQ(d.out[2], 0);
  EXPECT_EQ(d.out[3], 2);
  // 2/8 heads, 28672 + 4096: on the plain pass the one-wave overlapped schedule in segments
  // of 40, four sub-segments (0.315 ms, 2.74x FLA); with kWy (session 57) the sequential
  // split in segments of 32 (H100, 2026-11-27: 0.301 -> 0.277 ms under FLASHGDN_CP_OVERLAP=0)
  d = device_choice_for(8, {448, 64}, false, false, true, /*plain_pass=*/true);
  EXPECT_TRUE(d.plan.device_overlap);
  EXPECT_EQ(d.plan.nsub, 4);
  EXPECT_EQ(d.out[0], 40);
  EXPECT_EQ(d.out[2], 1);
  d = device_choice_for(8, {448, 64});
  EXPECT_FALSE(d.plan.device_overlap);
  EXPECT_EQ(d.plan.nsub, 1);
  EXPECT_EQ(d.out[0], 32);
  EXPECT_EQ(d.out[1], 128);
  EXPECT_EQ(d.out[2], 0);
  // 8/24 heads, 28672 + 4096: segments of 24, sequential, merged pairs (0.914 ms against
  // 0.722 for one sequence of 32768 in 11 of 47: perf-notes version 35's open question)
  d = device_choice_for(24, {448, 64});
  EXPECT_EQ(d.out[0], 24);
  EXPECT_EQ(d.out[2], 0);
  EXPECT_EQ(d.out[3], 2);
  // a short packed pair the host keeps unsplit at 16 columns: no device choice
  d = device_choice_for(8, {64, 64});
  EXPECT_FALSE(d.plan.device_choice);
}

TEST(Planner, UnfusedWyTermBetweenSixteenAndThirtyTwoHeads) {
  // ForwardCost::unfused_wy_us: the one-wave overlapped schedule (and the device's saturated
  // choice) pays for its WY part outside the pass only at 16 .. 31 value heads, where the
  // sequential pass forms it inside (launch.cu cols_tma_wy)
  flashgdn::ForwardCost c;
  flashgdn::LoadStats s;
  s.total = s.longest = 256;
  EXPECT_DOUBLE_EQ(flashgdn::unfused_wy_term(c, s, 8, 132), 0.0);
  EXPECT_DOUBLE_EQ(flashgdn::unfused_wy_term(c, s, 32, 132), 0.0);
  EXPECT_NEAR(flashgdn::unfused_wy_term(c, s, 16, 132), 2.0 * 256 * 16 / 132, 1e-9);
  s.longest = 96;  // under unfused_wy_longest (128): none
  EXPECT_DOUBLE_EQ(flashgdn::unfused_wy_term(c, s, 16, 132), 0.0);
  // 8/24 heads, 6144 + 2048 tokens with the host copy: the device's choice stays overlapped
  // (0.248 ms against 0.260 sequential), one 8192-token sequence goes sequential (0.253 ->
  // 0.229)
  auto d = device_choice_for(24, {96, 32});
  EXPECT_TRUE(d.plan.device_overlap);
  EXPECT_EQ(d.out[2], 1);
  auto one = query(1, 128, 24);
  one.allow_cols = true;
  EXPECT_FALSE(plan_segments(one).overlap);
  EXPECT_TRUE(plan_segments(one).split);
  // 2/8 heads x 16384 tokens keeps the overlapped plan (0.194 against 0.213 sequential)
  auto q = query(1, 256, 8);
  q.allow_cols = true;
  EXPECT_TRUE(plan_segments(q).overlap);
  // 16/16 x 4096 keeps its three overlapped segments of 22 (0.156 against 0.194)
  q = query(1, 64, 16);
  q.allow_cols = true;
  auto p = plan_segments(q);
  EXPECT_TRUE(p.split && p.overlap);
  EXPECT_EQ(p.seg_chunks, 22);
  // the device's saturated choice pays it, the host's own saturated plan (kWy) does not
  // (both with the saturated schedule a candidate at 16 heads: FLASHGDN_CP_SAT=1)
  c.sat_fused_wy = true;
  flashgdn::ForwardCost dev = c;
  dev.saturated_unfused = true;
  s.longest = s.total = 512;
  s.segs = s.seg_blocks = 16;
  s.seqs = 1;
  s.max_segs_per_seq = 16;
  const auto host_e = flashgdn::estimate_split(c, s, 16, 132, 128, 32);
  const auto dev_e = flashgdn::estimate_split(dev, s, 16, 132, 128, 32);
  ASSERT_LT(host_e.saturated, 1e300);
  EXPECT_NEAR(dev_e.saturated - host_e.saturated, 2.0 * 512 * 16 / 132, 1e-6);
  EXPECT_DOUBLE_EQ(dev_e.sequential, host_e.sequential);
}

TEST(Planner, FusedWyLaunchesForPackedBatches) {
  // Packed batches without the host copy: the overlapped launches are made where one
  // sequence of every chunk would take an overlapped plan, counting ForwardCost::unfused_wy_us
  // from twice unfused_wy_longest there. 16 heads, 2 x 128 chunks: sequential, so the
  // device's sequential choice takes kWy (CP_OVERLAP=0, H100 2026-11-27: 4/16 2x8192 0.326 ->
  // 0.279 ms); 24 heads, 2 x 64 chunks keeps them (8/24 6144+2048: overlapped 0.248 against
  // 0.260); 8 heads (no kWy) keeps them at 2 x 128
  auto q = query(2, 128, 16, /*varlen=*/true);
  q.allow_cols = true;
  auto d = plan_segments(q);
  EXPECT_TRUE(d.device_choice);
  EXPECT_FALSE(d.device_overlap);
  flashgdn::ForwardCost plain_pass;
  plain_pass.fused_wy = false;
  plain_pass.unfused_wy_us = 0.0;
  EXPECT_TRUE(plan_segments(q, plain_pass).device_overlap);  // as before session 48
  // with the caller's hint on the longest sequence under unfused_wy_longest the launches are
  // planned without the term (the device's choice there cannot count it)
  q.longest_hint = 96;
  EXPECT_TRUE(plan_segments(q).device_overlap);
  q = query(2, 64, 24, true);
  q.allow_cols = true;
  EXPECT_TRUE(plan_segments(q).device_overlap);
  q = query(2, 128, 8, true);
  q.allow_cols = true;
  EXPECT_TRUE(plan_segments(q).device_overlap);
}

TEST(Planner, ListScheduledPhaseZero) {
  using flashgdn::list_schedule_steps;
  // equal blocks: whole waves (288 blocks of 10 steps on 132 SMs: three)
  EXPECT_DOUBLE_EQ(list_schedule_steps(48, 132, 6, 10, 0, 0), 30.0);
  EXPECT_DOUBLE_EQ(list_schedule_steps(24, 132, 5, 10, 0, 0), 10.0);  // 120 blocks: one
  // 16/48 x 257 chunks in segments of 48 (+ 5 warm-up chunks): 240 blocks of 53 steps, then
  // 48 of 22; 132 + 108 long ones, the 24 SMs left free take 24 short ones at 53 and again
  // at 75, under the second wave's end (106); whole waves would count three (159)
  EXPECT_DOUBLE_EQ(list_schedule_steps(48, 132, 5, 53, 1, 22), 106.0);
  // 8/24 x 256 chunks in merged pairs of 48 (+5): 120 of 53, then 24 of 21: 12 beside the
  // long ones, 12 after them on the same SMs (42), within the 53
  EXPECT_DOUBLE_EQ(list_schedule_steps(24, 132, 5, 53, 1, 21), 53.0);
  // 4 SMs, 2 long blocks (10) and 6 short (3): the two free SMs take the short ones two at a
  // time at 0, 3 and 6 (done at 9), under the long ones' 10
  EXPECT_DOUBLE_EQ(list_schedule_steps(2, 4, 1, 10, 3, 3), 10.0);
  // more short blocks than fit beside: 4 SMs, 2 long (10), 14 short (3): two SMs run 0..9
  // (6 blocks), then at 9 and 10 the four SMs share the other 8: 9-12, 9-12, 10-13, 10-13,
  // 12-15, 12-15, 13-16, 13-16 -> 16
  EXPECT_DOUBLE_EQ(list_schedule_steps(2, 4, 1, 10, 7, 3), 16.0);

  // ForwardCost::p0_list (the default since 2026-11-27): 16/48 x 16384 takes segments of 48
  // (0.666 ms against 0.723 for the whole waves' 33 on the H100 with the host copy; 32 here)
  auto q = query(1, 256, 48);
  q.allow_cols = true;
  flashgdn::ForwardCost c;
  c.p0_list = false;
  EXPECT_EQ(plan_segments(q, c).seg_chunks, 32);
  const auto p = plan_segments(q);
  EXPECT_EQ(p.seg_chunks, 48);
  EXPECT_EQ(p.p0_merge, 1);
  // ... only past p0_list_margin of the whole waves' plan as the list counts it: 16/48 x 8192
  // (128 chunks) keeps the whole waves' segments (the list's 24 measured 0.396 -> 0.400 ms,
  // a gain of 0.7% in the model), and so does 8/24 x 16384 (1.8%; 0.384 -> 0.386); 16/48 x
  // 32768 takes the list's merged pairs of 47 (3.2%; 1.285 -> 1.225)
  q = query(1, 128, 48);
  q.allow_cols = true;
  const auto waves = plan_segments(q, c);
  EXPECT_TRUE(waves.split);
  EXPECT_EQ(plan_segments(q).seg_chunks, waves.seg_chunks);
  c.p0_list = true;
  c.p0_list_margin = 0.0;
  EXPECT_NE(plan_segments(q, c).seg_chunks, waves.seg_chunks);
  q = query(1, 256, 24);
  q.allow_cols = true;
  EXPECT_EQ(plan_segments(q).seg_chunks, 26);
  q = query(1, 512, 48);
  q.allow_cols = true;
  EXPECT_EQ(plan_segments(q).seg_chunks, 47);
  EXPECT_EQ(plan_segments(q).p0_merge, 2);
}

TEST(Planner, ExactPhaseZeroMergeForPackedSequences) {
  using flashgdn::p0_exact_steps;
  // 8/24 heads, 12288 + 4096 tokens (192 + 64 chunks) in segments of 24 (+5 warm-up chunks
  // but for a sequence's first): merged pairs make 24 blocks of 48, 72 of 53, 24 of 48 and 24
  // of 21; 120 of them fill the first wave beside 12 short ones, whose SMs take the other 12
  // at 21: 53 steps against merge 1's 58 (two waves of 29) and merge 3's 77
  const int64_t a[] = {192, 64};
  EXPECT_DOUBLE_EQ(p0_exact_steps(a, 2, 24, 1, 24, 132, 5), 58.0);
  EXPECT_DOUBLE_EQ(p0_exact_steps(a, 2, 24, 2, 24, 132, 5), 53.0);
  EXPECT_DOUBLE_EQ(p0_exact_steps(a, 2, 24, 3, 24, 132, 5), 77.0);
  // more heads than SMs: a group's blocks in turns (200 heads, one 10-chunk segment: 2 turns)
  const int64_t b[] = {10, 10};
  EXPECT_DOUBLE_EQ(p0_exact_steps(b, 1, 24, 1, 200, 132, 5), 20.0);
  // the host's choice (exact counts) takes the merge from these steps; the device's keeps
  // phase0_merged_us's whole waves (H100, 2026-11-27, forward ms by merge 1 / 2: 8/24
  // 12288+4096 0.388 / 0.364, 24576+8192 0.645 / 0.622; 16384+16384 by merge 2 / 4 0.680 /
  // 0.655)
  flashgdn::ForwardCost c;
  EXPECT_EQ(flashgdn::exact_p0_merge(c, a, 2, 24, 24, 132, 1), 2);
  const int64_t d[] = {256, 256};
  EXPECT_EQ(flashgdn::exact_p0_merge(c, d, 2, 24, 24, 132, 2), 4);
  const int64_t e[] = {192, 64};  // 16 heads in segments of 32: merge 1 (37 steps against 69)
  EXPECT_EQ(flashgdn::exact_p0_merge(c, e, 2, 32, 16, 132, 1), 1);
  // 16/48 heads, 1024 + 7168 tokens in segments of 24: merge 3 kept (96 blocks in one wave);
  // without ForwardCost::p0_block_start merge 1's 288 blocks look shorter (66 steps against
  // 69), and measured slower (0.426 ms against 0.410)
  const int64_t f[] = {16, 112};
  EXPECT_EQ(flashgdn::exact_p0_merge(c, f, 2, 24, 48, 132, 3), 3);
  EXPECT_DOUBLE_EQ(p0_exact_steps(f, 2, 24, 1, 48, 132, 5), 66.0);
  EXPECT_DOUBLE_EQ(p0_exact_steps(f, 2, 24, 3, 48, 132, 5), 69.0);
  c.p0_block_start = 0.0;
  EXPECT_EQ(flashgdn::exact_p0_merge(c, f, 2, 24, 48, 132, 3), 1);
  // ForwardCost::exact_p0 (opt-in FLASHGDN_HOST_EXACT_P0=1): every 128-column split's phase 0
  // from its blocks, so the segment length changes too: 16/48 heads 12288 + 4096 tokens
  // (192 + 64 chunks) from segments of 32 to 48 (the same plan measured 0.690 -> 0.662 ms on
  // the H100, 2026-11-27), 6144 + 2048 (96 + 32) from unsplit to segments of 24 (0.425 ->
  // 0.400)
  {
    auto q = query(2, 1, 48, /*varlen=*/true);
    const std::vector<int64_t> chunks = {192, 64};
    q.total_chunks = 256 + 2;
    q.longest_hint = 192;
    q.allow_cols = true;
    flashgdn::ForwardCost cost = fp16_cost();
    cost.exact_p0 = false;
    const auto plan = flashgdn::plan_segments(q, cost);
    int64_t out[4];
    auto params = flashgdn::device_choice_params(plan, cost, true, plan.device_overlap,
                                                 plan.nsub > 1 ? plan.nsub : 0, 48, 132);
    flashgdn::device_choice_on_host(params, chunks.data(), 2, plan.seg_chunks, out, true);
    EXPECT_EQ(out[0], 32);
    params.cost.exact_p0 = true;
    flashgdn::device_choice_on_host(params, chunks.data(), 2, plan.seg_chunks, out, true);
    EXPECT_EQ(out[0], 48);
    EXPECT_EQ(out[3], 1);
    // ... past exact_p0_margin only: 8/24 heads 28672 + 4096 (448 + 64 chunks) keeps the whole
    // waves' segments of 50 (the blocks' 32 in merged threes, 1.3% less in the model,
    // measured 0.656 -> 0.675 ms)
    const std::vector<int64_t> long_short = {448, 64};
    auto waves = device_choice_for(24, long_short, true, false, /*exact_p0=*/false);
    auto blocks = device_choice_for(24, long_short, true);
    EXPECT_EQ(waves.out[0], 50);
    EXPECT_EQ(blocks.out[0], 50);
    EXPECT_EQ(blocks.out[3], waves.out[3]);
  }
  auto host = device_choice_for(24, {192, 64}, /*exact_counts=*/true);
  auto dev = device_choice_for(24, {192, 64});
  EXPECT_EQ(host.out[0], 24);
  EXPECT_EQ(host.out[3], 2);
  EXPECT_EQ(dev.out[3], 1);
}

TEST(Planner, ListScheduleManyShortWaves) {
  // past 256 steps of the loop the rest of the short blocks are spread over the SMs: 4 SMs,
  // one long block (100 steps) and 1000 short ones (1 step): three SMs run 300 of them
  // beside it, the four the other 700 from 100 on: 275 (the list schedule's own figure);
  // 2000 short ones: 525
  EXPECT_DOUBLE_EQ(flashgdn::list_schedule_steps(1, 4, 1, 100, 1000, 1), 275.0);
  EXPECT_DOUBLE_EQ(flashgdn::list_schedule_steps(1, 4, 1, 100, 2000, 1), 525.0);
}

TEST(Planner, FewHeadsSequentialWithTheWyWarpgroup) {
  // Below kTmaWyMinHeads value heads the pass forms the WY part inside (kWy) on every plan
  // but the overlapped schedule (launch.cu cols_tma_wy, session 57), so from
  // ForwardCost::few_heads_seq_work chunk-heads the overlapped (and saturated) schedules are
  // no candidates and the sequential split is the plan, for sequences under
  // few_heads_seq_longest chunks. H100, 2026-11-27, 2/8 heads, ms,
  // overlapped -> sequential: 1x32768 0.299 -> 0.276, 16384+16384 0.296 -> 0.266; at 256
  // chunks (2048 chunk-heads) not: 1x16384 0.193 -> 0.194, 12288+4096 0.189 -> 0.202.
  flashgdn::ForwardCost plain_pass;
  plain_pass.fused_wy = false;
  auto q = query(1, 512, 8);
  q.allow_cols = true;
  auto p = plan_segments(q);
  EXPECT_TRUE(p.split);
  EXPECT_FALSE(p.overlap);
  EXPECT_FALSE(p.saturated);
  EXPECT_EQ(p.col_block, 128);
  EXPECT_TRUE(plan_segments(q, plain_pass).overlap);
  q = query(1, 256, 8);  // 2048 chunk-heads: overlapped as before
  q.allow_cols = true;
  EXPECT_TRUE(plan_segments(q).overlap);
  q = query(1, 1024, 4);  // 4096 chunk-heads at 4 heads: the same rule (unmeasured there)
  q.allow_cols = true;
  EXPECT_FALSE(plan_segments(q).overlap);
  q = query(1, 1024, 8);  // 65536 tokens: sequential (0.515 -> 0.458 ms)
  q.allow_cols = true;
  EXPECT_TRUE(plan_segments(q).split);
  EXPECT_FALSE(plan_segments(q).overlap);
  // from few_heads_seq_longest (2048 chunks) on, the plan as before: 131072 tokens saturated
  // (0.727 ms against 0.768 sequential)
  q = query(1, 2048, 8);
  q.allow_cols = true;
  EXPECT_TRUE(plan_segments(q).overlap);
  EXPECT_TRUE(plan_segments(q).saturated);
  // the device's choice at the actual lengths: 12288 + 4096 (258 chunks) keeps the
  // overlapped launches; 8192 x 4 (516) runs sequential, as measured
  EXPECT_TRUE(device_choice_for(8, {192, 64}).plan.device_overlap);
  const auto d = device_choice_for(8, {128, 128, 128, 128});
  EXPECT_FALSE(d.plan.device_overlap);
  EXPECT_EQ(d.out[2], 0);
}

TEST(Planner, ReachSegments) {
  // ForwardCost::reach_seg_longest: host-known lengths of at most 128 chunks, 128 columns,
  // the sequential split in kReachSegChunks-chunk segments with SegmentPlan::exact_reach where
  // the cost model takes it (H100, 2026-11-27, forced 16-chunk segments with the exact start
  // against the default plan: 1x8192 at 16/16 heads 0.202 -> 0.171 ms, 16/32 0.278 -> 0.262,
  // 16/64 x 4096 0.275 -> 0.250); never at 256 chunks (4/16, 16/16 x 16384 1-2% slower).
  for (const int64_t hv : {16, 32}) {
    auto q = query(1, 128, hv);
    q.allow_cols = true;
    const auto p = plan_segments(q);
    EXPECT_TRUE(p.split && p.exact_reach) << hv;
    EXPECT_FALSE(p.overlap || p.saturated) << hv;
    EXPECT_EQ(p.col_block, 128) << hv;
    EXPECT_EQ(p.seg_chunks, flashgdn::kReachSegChunks) << hv;
    q = query(1, 256, hv);
    q.allow_cols = true;
    EXPECT_FALSE(plan_segments(q).exact_reach) << hv;
  }
  auto q = query(1, 64, 64);  // 16/64 x 4096
  q.allow_cols = true;
  EXPECT_TRUE(plan_segments(q).exact_reach);
  EXPECT_EQ(plan_segments(q).seg_chunks, flashgdn::kReachSegChunks);
  // not where the model keeps the other plans (2/8 x 8192: overlapped in 19-chunk segments),
  // not for packed sequences the host does not know, and never off (reach_seg_longest 0)
  q = query(1, 128, 8);
  q.allow_cols = true;
  EXPECT_FALSE(plan_segments(q).exact_reach);
  q = query(4, 128, 32, /*varlen=*/true);
  q.allow_cols = true;
  EXPECT_FALSE(plan_segments(q).exact_reach);
  q = query(1, 128, 32);
  q.allow_cols = true;
  flashgdn::ForwardCost off;
  off.reach_seg_longest = 0;
  EXPECT_FALSE(plan_segments(q, off).exact_reach);
  EXPECT_GE(plan_segments(q, off).seg_chunks, kMinSegChunks);
}
