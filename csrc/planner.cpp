// Context-parallel planner (see planner.h).
#include "planner.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace flashgdn {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

SegmentPlan unsplit(const SegmentQuery& q) {
  SegmentPlan p;
  // one segment per sequence: longer than any sequence can be
  p.seg_chunks = std::max<int64_t>(1, q.fixed_chunks >= 0 ? q.fixed_chunks : q.total_chunks);
  p.max_segments = q.N;
  p.split = false;
  return p;
}

SegmentPlan with_length(const SegmentQuery& q, int64_t seg) {
  SegmentPlan p;
  p.seg_chunks = std::max<int64_t>(1, seg);
  if (q.fixed_chunks >= 0) {
    p.max_segments = q.N * std::max<int64_t>(1, ceil_div(q.fixed_chunks, p.seg_chunks));
    p.split = q.fixed_chunks > p.seg_chunks;
  } else {
    // sum over sequences of max(1, ceil(c_n / seg)) <= total / seg + N
    p.max_segments = q.total_chunks / p.seg_chunks + q.N;
    p.split = q.total_chunks > p.seg_chunks;
  }
  return p;
}

}  // namespace

SegmentPlan plan_segments(const SegmentQuery& q) {
  if (q.N <= 0 || q.Hv <= 0 || q.mode == CpMode::Off) return unsplit(q);
  const int64_t longest = q.fixed_chunks >= 0 ? q.fixed_chunks : q.total_chunks;
  if (q.mode == CpMode::On) {
    const int64_t seg = q.forced_seg_chunks > 0 ? q.forced_seg_chunks : ceil_div(longest, 4);
    return with_length(q, seg);
  }
  // Auto: split only when the (sequence, head, column block) blocks leave SMs idle,
  // into as many segments as one wave of blocks can hold.
  const int64_t per_segment = q.Hv * q.col_blocks;
  const int64_t slots = q.sms / per_segment;  // segments that fit in one wave
  if (q.N * per_segment >= q.sms || slots <= q.N) return unsplit(q);
  int64_t seg;
  if (q.fixed_chunks >= 0) {
    const int64_t per_seq = slots / q.N;
    if (per_seq < 2) return unsplit(q);
    seg = ceil_div(q.fixed_chunks, per_seq);
  } else {
    seg = ceil_div(q.total_chunks, slots - q.N);
  }
  if (seg < kMinSegChunks) seg = kMinSegChunks;
  if (longest <= seg) return unsplit(q);
  return with_length(q, seg);
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

}  // namespace flashgdn
