// The context-parallel planner (csrc/planner.h): when it splits sequences into
// segments, how long the segments are, and the grid bound it reports.
#include <gtest/gtest.h>

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
  q.col_blocks = 4;
  q.sms = 132;
  return q;
}

}  // namespace

TEST(Planner, SplitsOneLongSequenceAtTp8) {
  // 2/8 heads, one 32768-token sequence: 32 blocks for 132 SMs -> 4 segments of 128 chunks
  const auto p = plan_segments(query(1, 512, 8));
  EXPECT_TRUE(p.split);
  EXPECT_EQ(p.seg_chunks, 128);
  EXPECT_EQ(p.max_segments, 4);
}

TEST(Planner, SplitsAtTp4IntoTwoSegments) {
  const auto p = plan_segments(query(1, 256, 16));  // 64 blocks -> 2 segments
  EXPECT_TRUE(p.split);
  EXPECT_EQ(p.seg_chunks, 128);
  EXPECT_EQ(p.max_segments, 2);
}

TEST(Planner, DeclinesWhenHeadsFillTheGpu) {
  const auto p = plan_segments(query(1, 512, 64));  // 256 blocks >= 132 SMs
  EXPECT_FALSE(p.split);
  EXPECT_EQ(p.max_segments, 1);
  EXPECT_GE(p.seg_chunks, 512);
}

TEST(Planner, DeclinesWhenSequencesFillTheGpu) {
  const auto p = plan_segments(query(8, 64, 8));  // 8 x 8 x 4 = 256 blocks
  EXPECT_FALSE(p.split);
  EXPECT_EQ(p.max_segments, 8);
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
  EXPECT_GE(p.seg_chunks, kMinSegChunks);
  const int64_t c0 = 448, c1 = 64;
  const int64_t need = (c0 + p.seg_chunks - 1) / p.seg_chunks + (c1 + p.seg_chunks - 1) / p.seg_chunks;
  EXPECT_LE(need, p.max_segments);
  EXPECT_LE(p.max_segments * 8 * 4, 2 * 132);  // about one wave of blocks
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
  q = query(1, 512, 8);
  q.mode = CpMode::Off;
  p = plan_segments(q);
  EXPECT_FALSE(p.split);
  EXPECT_EQ(p.max_segments, 1);
}

TEST(Planner, EmptyInputs) {
  auto p = plan_segments(query(0, 0, 8));
  EXPECT_FALSE(p.split);
  EXPECT_EQ(p.max_segments, 0);
  p = plan_segments(query(3, 0, 8));  // T = 0: one (empty) segment per sequence
  EXPECT_FALSE(p.split);
  EXPECT_EQ(p.max_segments, 3);
}
