// Context-parallel planner: decides, per call and on the host, how the sequential
// state pass of the forward is split into segments. It only uses sizes the host
// knows without looking at device memory (N, the token count, H_v, the SM count), so
// planning never waits for the GPU and a captured CUDA graph stays valid. How long
// each sequence actually is (cu_seqlens) is applied on the device (plan_kernel),
// and whether a segment starts from a warm-up or from its predecessor's exact state
// is decided on the device from the gates (state_fwd_kernel).
#pragma once

#include <cstdint>

namespace flashgdn {

enum class CpMode { Auto, Off, On };

struct SegmentPlan {
  int64_t seg_chunks = 1;    // chunks per segment
  int64_t max_segments = 0;  // upper bound on the segments of all sequences (grid size)
  bool split = false;        // whether any sequence can be split
};

struct SegmentQuery {
  int64_t N = 0;              // sequences
  int64_t total_chunks = 0;   // upper bound on the chunks of all sequences together
  int64_t fixed_chunks = -1;  // chunks of every sequence (fixed length), -1 for varlen
  int64_t Hv = 0;             // value heads
  int col_blocks = 1;         // blocks per (segment, head)
  int sms = 132;              // streaming multiprocessors
  CpMode mode = CpMode::Auto;
  int64_t forced_seg_chunks = 0;  // CpMode::On: chunks per segment (0: a quarter of the longest)
};

// Shortest segment Auto mode creates: the warm-up (up to 16 chunks) must stay a
// small part of a segment's work.
constexpr int64_t kMinSegChunks = 32;

SegmentPlan plan_segments(const SegmentQuery& q);

// FLASHGDN_CP = auto (default) | on | off, FLASHGDN_CP_SEG = chunks per segment when on.
CpMode cp_mode_from_env();
int64_t cp_seg_chunks_from_env();

}  // namespace flashgdn
