// Intra-card context parallelism of the sequential passes (docs/algorithm.md; the plan
// comes from csrc/planner.h and plan_kernel): the segments a sequence is split into, where
// the state entering each one comes from, which block of a pass runs which segment, and
// the kernels between the passes' phases.
//
// A segment that does not start the sequence starts from a warm-up of a few chunks from a
// zero state when the product of the skipped chunks' bounds exp(sum Lb) is below
// exp(kLogEps), else from its exact entering state seg_in (segment_start). Exact states take
// three launches: phase 1 of a pass gives each segment that an exact one follows its
// summary (the state leaving it from its own start, L, and, if it is exact itself, its
// transition M: the same pass run on the identity without inputs, no outputs);
// seg_combine_kernel chains the summaries, S_in(j+1) = M_j S_in(j) + L_j (the forward takes
// that chain on tensor cores, seg_walk_kernel, or with FLASHGDN_CP_WALK=0 as a log-depth
// scan, seg_scan_kernel, where the plan allows: launch.cu walk_cols, scan_levels); phase 0
// then runs every segment with outputs (a sequential 128-column split's phase 0 possibly
// several segments a block: SegParams::p0_merge). The backward's reverse pass does the same
// last to first.
// The overlapped schedule (launch.cu run_phases; the planner's choice where its blocks fit
// in one wave, FLASHGDN_CP_OVERLAP overrides) runs the phase 0 of segments that do not
// start exact beside the exact chain on a second stream (SegParams::starts); sub-segments
// (FLASHGDN_CP_SUB overrides the plan's count) cut the phase 0 of exact segments into
// pieces started from recorded states (sub_record, sub_start_kernel).
// The chain's kernels after phase 1 are launched as programmatic dependents (launch.cu
// launch_kernel, FLASHGDN_PDL): their blocks start under the previous kernel's tail and
// wait for it (pdl_wait) only where they read what the chain wrote.
//
// Exact outputs by correction (SegParams::corr) replace the exact segments' phase 0 by phase
// 1's local outputs plus Q_eff S_in, added by seg_correct_kernel after the combine.
//
// seg_combine_kernel  grid (sequence slots, H_v, 128 / kCombineCols): see its definition.
// seg_walk_kernel     grid (sequence slots, H_v, 128 / kWalkCols): likewise.
// sub_start_kernel    grid (segments x (nsub - 1), H_v, 128 / kSubCols): likewise.
// seg_scan_kernel     grid (segments, 4, H_v / kScanHeads), one launch per level: likewise.
// seg_correct_kernel  grid (chunks, H_v): likewise.
#pragma once

#include "../planner.h"
#include "common.cuh"
#include "mma.cuh"

namespace flashgdn {
namespace cuda {

constexpr float kLogEps = -16.f;  // warm-up accepted when the bound is below e^-16 ~ 1.1e-7
constexpr int kWarmupMax = 16;    // most chunks of warm-up a segment may use

// Sequences, heads and the segments of the context-parallel sequential passes: shared by
// the forward's state pass (FwdParams) and the backward's reverse pass (BwdParams).
struct SegParams {
  SeqLayout seqs;
  int64_t Hqk, Hv;
  float* Lb;                      // [max_chunks, Hv] warm-up bound of every chunk (wy_kernel)
  int64_t seg_chunks;             // chunks per segment (when seg_chunks_dev is null)
  const int64_t* seg_chunks_dev;  // varlen, device-chosen segment length (plan_kernel)
  int64_t segs_per_seq;           // fixed-length inputs: segments of every sequence
  const int64_t* seg_offsets;     // varlen: [N + 1] first segment of each sequence
  const int64_t* split_seqs;      // varlen split plans: [0] R, [1 + r] the r-th sequence
                                  //   of more than one segment (plan_kernel), else null
  const int64_t* seg_items;       // varlen split plans: [0] count, [1 + i] the segments of
                                  //   those sequences (phase 1's work, plan_kernel)
  bool looped;  // the sequential passes' blocks walk segments (for_each_segment_block):
                //   split plans of several packed sequences without sub-segments; else
                //   one block per segment
  int64_t host_slots;  // looped: slots to launch (host only; SegmentPlan::host_segments),
                       //   0: a wave in phase 0, four in phase 1 (launch.cu for_each_z_slice)
  float* seg_L;   // [segments, Hv, D, D] state (or dS) leaving a segment, from its own start
                  //   (zero for an exact segment, else h0 / dht / warm-up)
  float* seg_M;   // [segments, Hv, D, D] transition of an exact segment
  float* seg_in;  // [segments, Hv, D, D] exact state (or dS) entering an exact segment
  int phase;      // sequential passes: 0 outputs, 1 segment summaries (L, M)
  int64_t z_base; // the first segment (grid z) of this launch: launches of at most 65535
  int starts;     // phase 0: 0 every segment, 1 only those that do not start exact (h0, dht
                  //   or a warm-up), 2 only those that do (seg_in): the two halves of a
                  //   forward phase 0 on two streams (launch.cu, FLASHGDN_CP_OVERLAP)
  // Sub-segments (FLASHGDN_CP_SUB, forward, column block 128 only): with nsub > 1 phase 1
  // records the local state and the transition of every exact segment at the starts of its
  // nsub sub-segments of ceil(seg / nsub) chunks, sub_start_kernel turns the local states
  // into the sub-segments' entering states (M_c S_in + L_c), and phase 0 runs each
  // sub-segment of an exact segment as its own block (grid z = segments x nsub).
  int nsub;
  float* sub_L;  // [segments, Hv, nsub - 1, D, D] local states, then entering states
  float* sub_M;  // [segments, Hv, nsub - 1, D, D] transitions
  const int64_t* col_block_dev;  // varlen: the device-chosen column block; the kernel of the
                                 //   other column block returns at once (null: host's choice)
  const int64_t* schedule_dev;   // SegmentPlan::device_overlap: the device's schedule, 1
                                 //   overlapped (or unsplit), 0 sequential: the starts = 1
                                 //   launch returns at once, the starts = 2 one runs every
                                 //   segment, and no sub-segments (null: the host's schedule)
  // Exact segments' outputs by correction (SegmentPlan::corr, forward only, no
  // sub-segments): phase 1 runs every exact segment from a zero state with outputs, its
  // local outputs O_loc (the L block) and, on the identity, Q_eff = scale M_t^T q_t per token
  // (the M block: o_t = O_loc,t + Q_eff,t^T S_in for the segment's exact entering state
  // S_in); seg_correct_kernel adds the second term after the combine, which also forms the
  // final state of a sequence whose last segment is exact (corr_ht); phase 0 skips exact
  // segments. Their chain loses its third link (phase 0 over the segment after the combine).
  bool corr;
  float* o_loc;      // [Hv, D, corr_ld] fp32, value-major (token index fastest)
  float* q_eff;      // [Hv, D, corr_ld] fp32, key-major
  int64_t corr_ld;   // tokens of the packed input (TT)
  float* corr_ht;    // [N, Hv, D, D] final states (the forward's ht) or null
  // Phase 0 in merged segments (launch.cu p0_merge: the sequential schedule of the
  // 128-column forward pass, no correction): the block of segment j, j a multiple of
  // p0_merge, runs segments j .. j + p0_merge - 1 from j's start (their entering states
  // past j are formed but not read); the others return at once. Looped launches walk
  // groups of p0_merge consecutive segments instead, a run of a group's segments of one
  // sequence a block (for_each_segment_block). Phase 1 and the chain keep the plan's short
  // segments, phase 0 makes fewer, longer blocks: one wave where the plan's took two.
  int p0_merge;
  // The passes that look their segment up by a whole warp (segment_block's kWarp): the
  // binary search over seg_offsets instead of the warp's 32-way one, and no look-up ahead of
  // the block's first barrier (FLASHGDN_DEBUG & 4096: timing only, the same blocks). In
  // p0_merge's padding: the other fields keep their offsets.
  bool slow_lookup;
  const int64_t* p0_merge_dev;  // the device's merge (its plan's, DeviceSegChoice::chosen[3]),
                                //   in place of p0_merge; null: the host's
  // A segment whose warm-up walk reaches the sequence's start (the reverse pass: its end)
  // without the gates forgetting: false, it starts from h0 at chunk 0 (dht at the last
  // chunk; up to kWarmupMax chunks beyond it, run again by its phase-1 and phase-0 blocks);
  // true (launch.cu state_pass_params), it starts exact from the chain like the segments
  // after it (segment_start_of).
  bool exact_reach;
};

// Phase 0's merge factor (SegParams::p0_merge, p0_merge_dev), at least 1.
__device__ __forceinline__ int64_t p0_merge_of(const SegParams& p) {
  const int64_t m = p.p0_merge_dev != nullptr ? *p.p0_merge_dev : p.p0_merge;
  return m > 1 ? m : 1;
}

// Whether the device chose the sequential schedule under launches made for the overlapped
// one (SegParams::schedule_dev).
__device__ __forceinline__ bool device_sequential(const SegParams& p) {
  return p.schedule_dev != nullptr && *p.schedule_dev == 0;
}

// Whether a sequential pass compiled for column block BW runs in this call.
template <int BW>
__device__ __forceinline__ bool col_block_chosen(const SegParams& p) {
  return p.col_block_dev == nullptr || *p.col_block_dev == BW;
}

// Whether a pass compiled for column block BW has nothing to do in this call: cu_seqlens
// invalid (the planner's flag) or the other column block chosen. Both flags are loaded in one
// round trip (`||` would load the second after the first).
template <int BW>
__device__ __forceinline__ bool pass_skipped(const SegParams& p) {
  const bool failed = p.seqs.failed();
  const bool other = !col_block_chosen<BW>(p);
  return failed | other;
}

// Where the state entering a segment comes from (context parallelism; docs/algorithm.md).
// The backward's reverse pass walks the chunks last first: its segments "enter" at their
// last chunk, from the dS of the segment after them, and H0 stands for dht there.
enum class SegSource {
  H0,      // the sequence's initial state (forward) or dht (reverse): exact
  Warmup,  // zero, a few chunks before the segment: the gates forget what came earlier
  Exact,   // seg_in, formed by seg_combine_kernel from the neighbours' L and M
};
struct SegStart {
  SegSource src;
  int64_t c_first;  // first chunk the pass processes (the last one, for the reverse pass)
};

__device__ __forceinline__ int64_t seg_chunks(const SegParams& p) {
  return p.seg_chunks_dev != nullptr ? *p.seg_chunks_dev : p.seg_chunks;
}

// Segment j of a sequence with nch chunks whose first chunk (in the Lb table) is chunk0.
// A warm-up is accepted when the product of the bounds of the chunks it runs before the
// segment, exp(sum Lb), is below exp(kLogEps) within kWarmupMax chunks (the bound holds for
// a chunk's transition and for its transpose alike); reaching the sequence's end first
// means starting from h0 (forward) or dht (reverse), which is exact.
// The kWarmupMax bounds are loaded at once, then summed in the walk's order: the walk was a
// chain of up to 16 dependent loads (~3 us where every bound is 0, the exact heads), paid
// at the start of every block of an exact head's chain (twice in phase 1: its own start and
// its neighbour's) and of the combine's decisions. Same sums in the same order.
// seg: the segment length (seg_chunks(p), loaded once by the caller).
__device__ __forceinline__ SegStart segment_start_of(const SegParams& p, int64_t seg,
                                                     int64_t chunk0, int64_t nch, int64_t h,
                                                     int64_t j, bool reverse) {
  if (!reverse) {
    const int64_t c_begin = j * seg;
    if (j == 0) return {SegSource::H0, 0};
    float lb[kWarmupMax];  // lb[i]: chunk c_begin - 1 - i
#pragma unroll
    for (int i = 0; i < kWarmupMax; ++i)
      lb[i] = c_begin - 1 - i >= 0 ? p.Lb[(chunk0 + c_begin - 1 - i) * p.Hv + h] : 0.f;
    float bound = 0.f;
    int64_t c = c_begin;
#pragma unroll
    for (int i = 0; i < kWarmupMax; ++i) {
      if (c > 0 && bound > kLogEps) {
        --c;
        bound += lb[i];
      }
    }
    if (bound <= kLogEps) return {c == 0 ? SegSource::H0 : SegSource::Warmup, c};
    if (c == 0 && !p.exact_reach) return {SegSource::H0, 0};
    return {SegSource::Exact, c_begin};
  }
  const int64_t c_last = (j + 1) * seg < nch ? (j + 1) * seg - 1 : nch - 1;
  if (c_last == nch - 1) return {SegSource::H0, c_last};
  float lb[kWarmupMax];  // lb[i]: chunk c_last + 1 + i
#pragma unroll
  for (int i = 0; i < kWarmupMax; ++i)
    lb[i] = c_last + 1 + i <= nch - 1 ? p.Lb[(chunk0 + c_last + 1 + i) * p.Hv + h] : 0.f;
  float bound = 0.f;
  int64_t c = c_last;
#pragma unroll
  for (int i = 0; i < kWarmupMax; ++i) {
    if (c < nch - 1 && bound > kLogEps) {
      ++c;
      bound += lb[i];
    }
  }
  if (bound <= kLogEps) return {c == nch - 1 ? SegSource::H0 : SegSource::Warmup, c};
  if (c == nch - 1 && !p.exact_reach) return {SegSource::H0, c};
  return {SegSource::Exact, c_last};
}
__device__ __forceinline__ SegStart segment_start(const SegParams& p, int64_t chunk0,
                                                  int64_t nch, int64_t h, int64_t j,
                                                  bool reverse = false) {
  return segment_start_of(p, seg_chunks(p), chunk0, nch, h, j, reverse);
}

// Chunks per sub-segment of an exact segment, and where sub-segment s (1 .. nsub - 1) of
// segment z of head h keeps its record.
__device__ __forceinline__ int64_t sub_chunks(const SegParams& p) {
  return (seg_chunks(p) + p.nsub - 1) / p.nsub;
}
__device__ __forceinline__ size_t sub_offset(const SegParams& p, int64_t z, int64_t h, int s) {
  return static_cast<size_t>((z * p.Hv + h) * (p.nsub - 1) + (s - 1)) * D * D;
}

// Segments of sequence n: the first one's index z0 and their count.
__device__ __forceinline__ void sequence_segments(const SegParams& p, int64_t n, int64_t& z0,
                                                  int64_t& count) {
  if (p.seg_offsets != nullptr) {
    z0 = p.seg_offsets[n];
    count = p.seg_offsets[n + 1] - z0;
  } else {
    z0 = n * p.segs_per_seq;
    const int64_t nch = (p.seqs.seq_len(n) + C - 1) / C;
    count = segments_of(nch, seg_chunks(p));
  }
}

// The sequence n and segment j of block z of a sequential pass (grid z = segments);
// false when z is past the last segment.
__device__ __forceinline__ bool locate_segment(const SegParams& p, int64_t z, int64_t& n,
                                               int64_t& j) {
  if (p.seg_offsets != nullptr) {
    if (z >= p.seg_offsets[p.seqs.N]) return false;
    int64_t lo = 0, hi = p.seqs.N - 1;  // last n with seg_offsets[n] <= z
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (p.seg_offsets[mid] <= z) lo = mid; else hi = mid - 1;
    }
    n = lo;
    j = z - p.seg_offsets[n];
    return true;
  }
  n = z / p.segs_per_seq;
  j = z % p.segs_per_seq;
  return n < p.seqs.N;
}

// locate_segment by a whole warp (every lane calls it, with the same z), total =
// seg_offsets[N] loaded by the caller: each round compares 32 of seg_offsets spread over the
// remaining range, so one round trip finds n among up to 32 sequences (the binary search
// takes log2 N dependent loads). Same n and j.
__device__ __forceinline__ bool locate_segment_warp(const SegParams& p, int64_t z, int64_t total,
                                                    int64_t& n, int64_t& j) {
  if (p.seg_offsets == nullptr) return locate_segment(p, z, n, j);
  if (z >= total) return false;
  const int lane = lane_id();
  int64_t lo = 0, hi = p.seqs.N - 1;  // seg_offsets[lo] <= z (seg_offsets[0] = 0)
  for (;;) {
    const int64_t stride = (hi - lo + 32) / 32;  // ceil((hi - lo + 1) / 32)
    const int64_t idx = lo + lane * stride;
    const int64_t v = idx <= hi ? p.seg_offsets[idx] : z + 1;
    // the lanes whose entry is <= z: a prefix (seg_offsets rises), lane 0 among them
    const unsigned m = __ballot_sync(0xffffffffu, v <= z);
    const int k = 31 - __clz(m);
    lo += k * stride;
    if (stride == 1) {
      n = lo;
      j = z - __shfl_sync(0xffffffffu, v, k);
      return true;
    }
    hi = lo + stride - 1 < hi ? lo + stride - 1 : hi;
  }
}

// One block of a context-parallel sequential pass, grid (D / BW [x 2 in phase 1], H_v,
// segments): head h (q/k head hq), segment j of sequence n (tokens from `start`, nch chunks,
// the first at chunk0 in the chunk tables), its chunks [c_begin, c_end), where its state
// (or dS) comes from, its value columns vb .. vb + BW. Phase 1 forms a segment's summary only
// where the neighbour in pass order (the next segment forward, the previous one in reverse)
// starts exactly from it: blocks x < D / BW its local state, blocks x >= D / BW (identity) the
// columns of its transition, from I, for exact segments. False: this block has nothing to do.
struct SegmentBlock {
  int64_t h, hq, z, n, j, start, len, nch, chunk0, c_begin, c_end;
  SegStart ss;
  int vb;
  bool identity;
  int sub;  // phase 0 with sub-segments: which sub-segment of an exact segment (0: its start)
};
// run > 0 (looped phase 0 with merged segments): the block runs segments j .. j + run - 1
// of the sequence (for_each_segment_block); 0: one segment, or p0_merge's (a multiple of it).
// kFlat (for_each_segment_block's flat walk): the head is h, else blockIdx.y.
// kWarp: called by every lane of a warp (the same z): the plan's scalars (schedule, segment
// length, merge, seg_offsets[N]) loaded in one round trip ahead of the decisions, and the
// sequence found by locate_segment_warp. The look-up was ~10 dependent round trips, ~6-8 k
// cycles at a block's start (bench/probe_first_chunk.patch, version 52); same block.
template <int BW, bool kFlat = false, bool kWarp = false>
__device__ __forceinline__ bool segment_block(const SegParams& p, bool reverse, int64_t z,
                                              SegmentBlock& b, int64_t run = 0,
                                              int64_t h = 0) {
  constexpr int CBN = D / BW;
  if constexpr (kFlat) b.h = h;
  else b.h = blockIdx.y;
  b.hq = b.h / (p.Hv / p.Hqk);
  b.z = z;
  b.sub = 0;
  // kWarp: the plan's scalars together (no branch between the loads)
  int64_t w_sched = 1, w_seg = 0, w_merge = 1, w_total = 0;
  if constexpr (kWarp) {
    w_sched = p.schedule_dev != nullptr ? *p.schedule_dev : 1;
    w_seg = p.seg_chunks_dev != nullptr ? *p.seg_chunks_dev : p.seg_chunks;
    w_merge = p.p0_merge_dev != nullptr ? *p.p0_merge_dev : p.p0_merge;
    w_total = p.seg_offsets != nullptr ? p.seg_offsets[p.seqs.N] : 0;
  }
  // sub-segments: the 128-column forward kernel only, the grid's (grid z = segments x
  // nsub in phase 0) unless the device chose the sequential schedule
  const bool sequential = kWarp ? w_sched == 0 : device_sequential(p);
  const bool grid_subs = BW == D && p.nsub > 1, subs = grid_subs && !sequential;
  const int starts = sequential ? (p.starts == 1 ? -1 : 0) : p.starts;
  int sub = 0;
  if (grid_subs && p.phase == 0) {
    sub = static_cast<int>(b.z % p.nsub);
    b.z /= p.nsub;
    if (!subs && sub != 0) return false;
  }
  if (p.phase == 0 && starts < 0) return false;  // the chain's launch runs this one
  if (kWarp && !p.slow_lookup) {
    if (!locate_segment_warp(p, b.z, w_total, b.n, b.j)) return false;
  } else if (!locate_segment(p, b.z, b.n, b.j)) {
    return false;
  }
  b.start = p.seqs.seq_start(b.n);
  b.len = p.seqs.seq_len(b.n);
  b.nch = (b.len + C - 1) / C;
  b.chunk0 = p.seqs.first_chunk(b.n);
  const int64_t seg = kWarp ? w_seg : seg_chunks(p);
  b.c_begin = b.j * seg;
  if (b.j > 0 && b.c_begin >= b.nch) return false;
  b.c_end = b.c_begin + seg < b.nch ? b.c_begin + seg : b.nch;
  b.ss = kWarp ? segment_start_of(p, seg, b.chunk0, b.nch, b.h, b.j, reverse)
               : segment_start(p, b.chunk0, b.nch, b.h, b.j, reverse);
  b.vb = (static_cast<int>(blockIdx.x) % CBN) * BW;
  b.identity = false;
  if (p.phase == 1) {
    // summaries where the neighbour in pass order starts exactly from this segment, and
    // with sub-segments or corr also for every exact segment (the records of its
    // sub-segments; corr: its outputs and the final state)
    const bool own = (subs || p.corr) && b.ss.src == SegSource::Exact;
    const bool last = reverse ? b.j == 0 : b.c_end >= b.nch;  // no neighbour
    const int64_t nb = reverse ? b.j - 1 : b.j + 1;
    if (!own &&
        (last || (kWarp ? segment_start_of(p, seg, b.chunk0, b.nch, b.h, nb, reverse)
                        : segment_start(p, b.chunk0, b.nch, b.h, nb, reverse))
                         .src != SegSource::Exact))
      return false;
    b.identity = static_cast<int>(blockIdx.x) >= CBN;
    if (b.identity && b.ss.src != SegSource::Exact) return false;
  } else if (static_cast<int>(blockIdx.x) >= CBN) {
    return false;
  } else if (p.corr && b.ss.src == SegSource::Exact) {
    return false;  // its outputs: seg_correct_kernel
  } else if (starts != 0 && (b.ss.src == SegSource::Exact) != (starts == 2)) {
    return false;
  } else if (subs) {
    if (b.ss.src != SegSource::Exact) return sub == 0;  // the whole segment in one block
    const int64_t cb = b.c_begin + sub * sub_chunks(p);
    if (cb >= b.c_end) return false;
    b.c_begin = b.ss.c_first = cb;
    if (cb + sub_chunks(p) < b.c_end) b.c_end = cb + sub_chunks(p);
    b.sub = sub;
  } else if (run > 1 || (run == 0 && (kWarp ? w_merge : p0_merge_of(p)) > 1)) {
    // segments j .. j + run - 1
    if (run == 0) {
      run = kWarp ? w_merge : p0_merge_of(p);
      if (b.j % run != 0) return false;
    }
    const int64_t ce = b.c_begin + run * seg;
    b.c_end = ce < b.nch ? ce : b.nch;
  }
  return true;
}

// A segment block looked up ahead of its block's first barrier by one warp
// (lookup_segment_block), for the block's roles to read after it (for_each_segment_block's
// pre): the roles' own look-ups (one chain each, after the barrier) took ~6-8 k cycles.
struct PreSegmentBlock {
  SegmentBlock b;
  int ok;
};
// Whether a kernel's launch may look its segment up ahead (one segment block a block).
__device__ __forceinline__ bool lookup_ahead(const SegParams& p) {
  return !p.looped && !p.slow_lookup;
}
// By every lane of one warp of a block whose launch is lookup_ahead: its segment block.
template <int BW>
__device__ __forceinline__ void lookup_segment_block(const SegParams& p, bool reverse,
                                                     PreSegmentBlock* out) {
  SegmentBlock b;
  const bool ok = segment_block<BW, false, true>(p, reverse, blockIdx.z + p.z_base, b);
  if (lane_id() == 0) {
    out->b = b;
    out->ok = ok;
  }
}

// Runs body(b) for the segment blocks of this block of a sequential pass, grid (D / BW [x 2
// in phase 1], H_v, slots). One block per segment (grid z = segments, from z_base) unless
// p.looped: several packed sequences, whose lengths the host does not know, so it sizes the
// grid for the most segments they could make and most of those blocks would have nothing
// to do (H100, 16/32 heads, 1024 x 512 tokens where the device split nothing: 87k phase-1
// blocks of 167 KB, one per SM, ~0.8 ms of blocks returning at once). Looped, slot z walks
// the items z, z + gridDim.z, ... of the device's list: in phase 1 the segments of split
// sequences (seg_items), in phase 0 every segment (seg_offsets[N]); the host launches a
// wave of slots in phase 0, four in phase 1 (launch.cu for_each_z_slice). Between items
// every cp.async has landed and every thread has passed a barrier, so the next item may
// refill shared memory.
// kFlat (looped phase 0 of the 128-column forward without the host's slot count; launch.cu
// launch_state_cols): grid y = 1, and slot z walks the pairs t = z, z + gridDim.z, ... of
// (segment group t / H_v, head t % H_v), so one wave of slots fills every SM at any head
// count (a wave of slots a head took 120 SMs at 24 heads, 96 at 48). A template flag, not a
// runtime one: a runtime head in this inlined walk made every plan's pass spill (version 50).
// kWarp: every lane of each calling warp walks (segment_block's kWarp). pre (not looped
// only): the block's segment as one warp looked it up ahead of the block's first barrier
// (lookup_segment_block), read from shared memory instead of looked up again.
template <int BW, bool kFlat = false, bool kWarp = false, typename Body>
__device__ __forceinline__ void for_each_segment_block(const SegParams& p, bool reverse,
                                                       Body&& body,
                                                       const PreSegmentBlock* pre = nullptr) {
  // one call site of body (it is inlined): not looped, the single item is blockIdx.z
  const bool listed = p.looped && p.phase == 1;
  const int64_t items = !p.looped ? blockIdx.z + 1 : listed ? p.seg_items[0]
                                                            : p.seg_offsets[p.seqs.N];
  // looped phase 0 with merged segments: the slots walk groups of `merge` consecutive
  // segments, and within a group each run of one sequence's segments is one segment block
  const int64_t merge =
      BW == D && p.looped && p.phase == 0 && !reverse ? p0_merge_of(p) : 1;
  const int64_t stride = p.looped ? gridDim.z * merge : 1;
  int64_t t = blockIdx.z;      // kFlat: the (group, head) pair
  int64_t h = 0;               // kFlat: its head
  int64_t g0 = t * merge;      // the group's first item (merge 1: the item)
  if constexpr (kFlat) {
    h = t % p.Hv;
    g0 = t / p.Hv * merge;
  }
  for (int64_t i = g0; i < items;) {
    const int64_t g_end = g0 + merge < items ? g0 + merge : items;
    const int64_t z = !p.looped ? i + p.z_base : listed ? p.seg_items[1 + i] : i;
    const int64_t hz = h;  // kFlat: this item's head, before the walk moves on
    int64_t run = 0, end = i + 1;
    if (merge > 1) {  // the run from item i: to the group's end or its sequence's last segment
      int64_t n, j;
      locate_segment(p, z, n, j);
      end = p.seg_offsets[n + 1] < g_end ? p.seg_offsets[n + 1] : g_end;
      run = end - i;
    }
    if (end >= g_end) {
      if constexpr (kFlat) {
        t += gridDim.z;
        h = t % p.Hv;
        g0 = t / p.Hv * merge;
      } else {
        g0 += stride;
      }
      i = g0;
    } else {
      i = end;
    }
    SegmentBlock b;
    if (pre != nullptr) {
      if (!pre->ok) continue;
      b = pre->b;
    } else if (!segment_block<BW, kFlat, kWarp>(p, reverse, z, b, run, hz)) {
      continue;
    }
    body(b);
    if (p.looped) {
      cp_async_wait<0>();
      __syncthreads();
    }
  }
}

// Phase 1 with sub-segments: where an exact segment's block records the state entering
// chunk ci (the start of a sub-segment), else null.
__device__ __forceinline__ float* sub_record(const SegParams& p, const SegmentBlock& b,
                                             int64_t ci) {
  if (p.nsub <= 1 || p.phase != 1 || b.ss.src != SegSource::Exact || ci <= b.c_begin ||
      device_sequential(p))
    return nullptr;
  const int64_t r = sub_chunks(p), k = ci - b.c_begin;
  if (k % r != 0) return nullptr;
  return (b.identity ? p.sub_M : p.sub_L) + sub_offset(p, b.z, b.h, static_cast<int>(k / r));
}

// ---------------------------------------------------------------------------------------
// seg_combine_kernel  grid (sequence slots, H_v, 128 / kCombineCols), 256 threads, 139 KB smem
//   Walks the segments of a sequence in pass order (first to last for the forward,
//   last to first for the backward's reverse pass, `reverse`) for kCombineCols state
//   columns of one head and forms the exact state entering every segment that starts from
//   its neighbour (SegSource::Exact): S_in(next) = M_prev S_in(prev) + L_prev when the
//   previous segment is exact itself, else L_prev (what it leaves from its own start:
//   h0 / dht or a warm-up). fp32 FMA.
//   reads  Lb, seg_L, seg_M, split_seqs     writes seg_in; with corr_ht (SegParams::corr)
//   also the final state of a sequence whose last segment is exact, one step more
//   Sequences: fixed-length inputs, slot x walks sequence x (grid x = N). Packed inputs
//   walk only the sequences the device split (split_seqs, plan_kernel), slot x the x-th,
//   x + gridDim.x-th, ... of them, and the host launches about four waves of blocks: a
//   block of 139 KB is alone on its SM, so a grid of one block per packed sequence (H100,
//   16/32 heads, 1024 x 512 tokens: 524k blocks, most of them with nothing to walk) cost
//   1.97 ms where the device split nothing.
//   The walk is a chain of dependent steps, so each step's loads are issued one step ahead:
//   whether each segment starts exact is decided for up to 256 steps at once
//   (one per thread; segment_start's warm-up test reads up to kWarmupMax bounds), then the
//   next step's M (64 KB, cp.async into the other of two
//   buffers) and L (registers) load while the current step multiplies. 8 columns per
//   block: 16 blocks a head (2/8 heads: 128 for 132 SMs).
//   Thread t owns row t % 128 and the 4 columns 4 (t / 128) .. + 3, M's rows are kMLd
//   floats apart: each M element is read by 2 threads (128 KB a step) and a warp's 32 rows
//   fall in distinct banks. The earlier layout (4 rows of one column a thread) read every
//   M element from 8 threads with 4-way bank conflicts, ~5100 shared-memory cycles a step,
//   the ~4.2 us a step ncu showed (0.25 instructions issued per cycle and scheduler);
//   H100, 2/8 x 32768: combine 63 -> 50 us, forward 0.413 -> 0.399 ms, bit-identical (the
//   same FMAs in the same order). 16 warps of 2 rows each were 1-2% slower.

constexpr int kCombineCols = 8;
constexpr int kCombineThreads = NT;
constexpr int kMLd = D + 4;
constexpr size_t kCombineSmem = sizeof(float) * (2 * D * kMLd + D * kCombineCols);

// acc[c] += (M S)[row][c0 + c], c < 4, for M [D][kMLd] and S's kCombineCols columns
// [D][kCombineCols] in shared memory, fp32 FMA over k in order (the combine's product).
__device__ __forceinline__ void add_m_times_s_wide(float (&acc)[4], const float* Ms,
                                                   const float* Sc, int row, int c0) {
  for (int k = 0; k < D; k += 4) {
    const float4 m = *reinterpret_cast<const float4*>(Ms + row * kMLd + k);
    const float4 s0 = *reinterpret_cast<const float4*>(Sc + (k + 0) * kCombineCols + c0);
    const float4 s1 = *reinterpret_cast<const float4*>(Sc + (k + 1) * kCombineCols + c0);
    const float4 s2 = *reinterpret_cast<const float4*>(Sc + (k + 2) * kCombineCols + c0);
    const float4 s3 = *reinterpret_cast<const float4*>(Sc + (k + 3) * kCombineCols + c0);
    acc[0] = fmaf(m.x, s0.x, fmaf(m.y, s1.x, fmaf(m.z, s2.x, fmaf(m.w, s3.x, acc[0]))));
    acc[1] = fmaf(m.x, s0.y, fmaf(m.y, s1.y, fmaf(m.z, s2.y, fmaf(m.w, s3.y, acc[1]))));
    acc[2] = fmaf(m.x, s0.z, fmaf(m.y, s1.z, fmaf(m.z, s2.z, fmaf(m.w, s3.z, acc[2]))));
    acc[3] = fmaf(m.x, s0.w, fmaf(m.y, s1.w, fmaf(m.z, s2.w, fmaf(m.w, s3.w, acc[3]))));
  }
}

// The steps of sequence n's chain of segment summaries for head h, as both walks take them
// (combine_sequence, walk_sequence_tc): step u goes from segment prev(u) to next(u) in pass
// order (last to first for the reverse pass), reads that segment's summaries at base(u) and
// writes the state entering next(u), or with SegParams::corr one step more from the last
// segment to the sequence's final state (taken where the last segment is exact: phase 0
// does not run it then). Steps go in batches of up to NT, whose decisions which segments
// start exact flags() makes at once, a thread a step.
struct ChainSteps {
  const SegParams& p;
  bool reverse;
  int64_t n, h, z0, count, chunk0, nch, steps;
  __device__ __forceinline__ ChainSteps(const SegParams& p_, bool reverse_, int64_t n_,
                                        int64_t h_)
      : p(p_), reverse(reverse_), n(n_), h(h_) {
    sequence_segments(p, n, z0, count);
    chunk0 = p.seqs.first_chunk(n);
    nch = (p.seqs.seq_len(n) + C - 1) / C;
    steps = count - 1 + (p.corr_ht != nullptr ? 1 : 0);
  }
  __device__ __forceinline__ int64_t prev(int64_t u) const { return reverse ? count - 1 - u : u; }
  __device__ __forceinline__ size_t base(int64_t u) const {
    return static_cast<size_t>((z0 + prev(u)) * p.Hv + h) * D * D;
  }
  __device__ __forceinline__ float* out(int64_t u) const {
    const int64_t next = reverse ? prev(u) - 1 : prev(u) + 1;
    return u == count - 1 ? p.corr_ht + static_cast<size_t>(n * p.Hv + h) * D * D
                          : p.seg_in + static_cast<size_t>((z0 + next) * p.Hv + h) * D * D;
  }
  // exact[1 + i]: step t0 + i (< t_end) goes to a segment that starts exact (the sequence's
  // end, for the corr step: its last segment is exact); exact[0] = last, the same for the
  // step before the batch; then a barrier. Every thread of the block calls it.
  __device__ __forceinline__ void flags(int64_t t0, int64_t t_end, bool last,
                                        bool* exact) const {
    const int64_t t = t0 + threadIdx.x;
    if (t < t_end) {
      const int64_t pv = prev(t), next = reverse ? pv - 1 : pv + 1;
      exact[1 + threadIdx.x] =
          segment_start(p, chunk0, nch, h, t == count - 1 ? pv : next, reverse).src ==
          SegSource::Exact;
    }
    if (threadIdx.x == 0) exact[0] = last;
    __syncthreads();
  }
};

// The sequences whose chains slot blockIdx.x of seg_combine_kernel / seg_walk_kernel walks:
// fixed-length inputs, sequence blockIdx.x; packed ones, the device's split sequences
// (split_seqs) blockIdx.x, blockIdx.x + gridDim.x, ...
template <typename Body>
__device__ __forceinline__ void for_each_chain_sequence(const SegParams& p, Body&& body) {
  const int64_t walks = p.split_seqs != nullptr ? p.split_seqs[0] : p.seqs.N;  // sequences
  for (int64_t r = blockIdx.x; r < walks; r += gridDim.x)
    body(p.split_seqs != nullptr ? p.split_seqs[1 + r] : r);
}

// The chain of sequence n (seg_combine_kernel): columns vb .. vb + kCombineCols of head h.
__device__ __forceinline__ void combine_sequence(const SegParams& p, bool reverse, int64_t n,
                                                 int64_t h, int vb, float* Mbuf, float* Sc,
                                                 bool* exact) {
  static_assert(kCombineThreads == 2 * D && kCombineThreads == NT && kCombineCols == 8,
                "two threads a row, 4 columns each; a thread a step of a batch");
  const ChainSteps cs(p, reverse, n, h);
  const int row = threadIdx.x % D, c0 = (threadIdx.x / D) * 4;
  bool last_flag = false;  // the first segment's S_in (h0 / dht) is inside its L
  for (int64_t t0 = 0; t0 < cs.steps; t0 += NT) {
    const int64_t t_end = t0 + NT < cs.steps ? t0 + NT : cs.steps;
    cs.flags(t0, t_end, last_flag, exact);
    pdl_wait();  // phase 1's summaries (seg_M, seg_L) are complete from here on
    auto needs = [&](int64_t u) { return exact[1 + u - t0]; };
    auto needs_m = [&](int64_t u) { return exact[1 + u - t0] && exact[u - t0]; };
    auto load_m = [&](int64_t u) {  // step u's M into buffer u % 2 (one commit group)
      if (needs_m(u)) {
        float* dst = Mbuf + (u & 1) * D * kMLd;
        const float* src = p.seg_M + cs.base(u);
        for (int e = threadIdx.x; e < D * D / 4; e += kCombineThreads)
          cp_async16(dst + (e / (D / 4)) * kMLd + 4 * (e % (D / 4)), src + 4 * e, true);
      }
      cp_async_commit();
    };
    auto load_l = [&](int64_t u, float (&l)[4]) {
      if (!needs(u)) return;
      const float4 v =
          __ldcg(reinterpret_cast<const float4*>(p.seg_L + cs.base(u) + row * D + vb + c0));
      l[0] = v.x;
      l[1] = v.y;
      l[2] = v.z;
      l[3] = v.w;
    };
    float lnext[4];
    load_m(t0);
    load_l(t0, lnext);
    for (int64_t u = t0; u < t_end; ++u) {
      float acc[4] = {lnext[0], lnext[1], lnext[2], lnext[3]};
      if (u + 1 < t_end) {
        load_m(u + 1);  // into the buffer step u - 1 read (it ended with a barrier)
        load_l(u + 1, lnext);
      } else {
        cp_async_commit();  // an empty group: the wait below always leaves one pending
      }
      if (!needs(u)) continue;
      if (needs_m(u)) {
        cp_async_wait<1>();
        __syncthreads();  // every thread's part of M has landed
        add_m_times_s_wide(acc, Mbuf + (u & 1) * D * kMLd, Sc, row, c0);
        __syncthreads();  // Sc read (and M: its buffer is refilled for step u + 2)
      }
      float* out = cs.out(u);
      const float4 v = make_float4(acc[0], acc[1], acc[2], acc[3]);
      *reinterpret_cast<float4*>(Sc + row * kCombineCols + c0) = v;
      __stcg(reinterpret_cast<float4*>(out + row * D + vb + c0), v);
      __syncthreads();
    }
    cp_async_wait<0>();
    last_flag = exact[t_end - t0];
    __syncthreads();  // exact[] is rewritten for the next batch of steps (or sequence)
  }
}

__global__ void __launch_bounds__(kCombineThreads) seg_combine_kernel(SegParams p, bool reverse) {
  PdlCompletion pdl_completion;  // see its definition (mma.cuh)
  pdl_trigger();  // the chain's next kernel may start its blocks' prologues now
  if (p.seqs.failed()) return;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* Mbuf = reinterpret_cast<float*>(smem_raw);  // [2][D][kMLd] M of the previous segment
  float* Sc = Mbuf + 2 * D * kMLd;                  // [D][kCombineCols] its S_in
  __shared__ bool exact[kCombineThreads + 1];
  for_each_chain_sequence(p, [&](int64_t n) {
    combine_sequence(p, reverse, n, blockIdx.y, blockIdx.z * kCombineCols, Mbuf, Sc, exact);
  });
}

// seg_walk_kernel  grid (sequence slots, H_v, 128 / kWalkCols), 256 threads, ~153 KB smem
//   (16 columns; 168 KB at 32), one block per SM
//   The combine's walk (seg_combine_kernel: the same steps in pass order, the same decisions
//   which segments start exact, the same outputs, slots as there) with its product
//   M_prev S_in(prev) on fp16 m16n8k16 tensor cores at fp32's accuracy: the two-term splits
//   of both operands, M S = Ml Sh + Mh Sl + Mh Sh up to the Ml Sl term, as add_split_product.
//   kWalkCols state columns a block (128 / kWalkCols blocks a head): warp w holds rows (keys)
//   16 w .. + 15 in m16n8 accumulators started from L_prev (loaded a step ahead). M (64 KB
//   fp32, contiguous) comes by one bulk copy a step into two stages (three: kStages, opt-in),
//   issued that many steps ahead by thread 0 and completing on the stage's mbarrier: a
//   step's loads are off its chain
//   (loading M's A fragments from global memory a step ahead into registers, each block
//   spent ~2.2 us a step on them, whatever its columns; H200 2026-11-26). The state a step
//   forms is restaged in shared memory as hi / lo tiles (two buffers, one barrier a step)
//   for the next step's B fragments.
//   M's tile is unpadded, so its A fragments are read as float4 under a permutation of each
//   k16 step's keys that both operands share: slot s of the step (the mma's k) is key
//   4 ((s & 7) >> 1) + (s & 1) + 2 (s >> 3), so that a thread's a0 / a2 pairs (slots 2t,
//   2t + 1, 2t + 8, 2t + 9) are keys 4t .. 4t + 3, one float4; the restaged state puts key q
//   of a step in row walk_slot(q).
//   Odd g read the two k16 steps of a pair in the other order, so a quarter warp's float4
//   loads fill all 32 banks once.
//   reads  Lb, seg_L, seg_M, split_seqs     writes seg_in (and corr_ht, as seg_combine_kernel)
// kWalkCols: 16 (the default, launch.cu walk_cols) or 32
template <int COLS>
constexpr int walk_ld() { return COLS + 8; }  // rows 48 / 80 B apart: ldmatrix conflict-free
// bytes: M's STAGES stages (2; 3, opt-in FLASHGDN_CP_WALK_STAGES=3, at 16 columns only), then
// the state's [2 buffers][hi, lo][D][walk_ld] tiles, then the stages' mbarriers
template <int COLS, int STAGES = 2>
constexpr size_t walk_smem() {
  return sizeof(float) * STAGES * D * D + sizeof(__half) * 4 * D * walk_ld<COLS>() +
         STAGES * sizeof(uint64_t);
}
static_assert(walk_smem<16, 3>() <= 227 * 1024, "three stages of M fit at 16 columns");
// The row of key q (0 .. 15 within its k16 step) in the restaged state: the inverse of the
// slot -> key permutation s -> 4 ((s & 7) >> 1) + (s & 1) + 2 (s >> 3).
__device__ __forceinline__ int walk_slot(int q) {
  return 2 * (q >> 2) + (q & 1) + 8 * ((q >> 1) & 1);
}

// The chain of sequence n (seg_walk_kernel): columns vb .. vb + kWalkCols of head h. Mst: M's
// stages [kStages][D][D]; Sbuf: [2 buffers][hi, lo][D][walk_ld]; step u reads state buffer
// u % 2 and writes the other, and its M is in stage u % kStages (issued kStages steps
// ahead), whose mbarrier's phase parity is that bit of `phases` (kept across the sequences
// a block walks).
template <int kWalkCols, int kStages>
__device__ __forceinline__ void walk_sequence_tc(const SegParams& p, bool reverse, int64_t n,
                                                 int64_t h, int vb, float* Mst, __half* Sbuf,
                                                 uint64_t* full, uint32_t& phases, bool* exact) {
  constexpr int kLd = walk_ld<kWalkCols>(), kTile = D * kLd;
  constexpr int kNT = kWalkCols / 8;  // n8 tiles of the warp's rows
  const ChainSteps cs(p, reverse, n, h);
  const int g = lane_id() >> 2, t = lane_id() & 3, r0 = 16 * (threadIdx.x >> 5);
  bool last_flag = false;  // the first segment's S_in (h0 / dht) is inside its L
  for (int64_t t0 = 0; t0 < cs.steps; t0 += NT) {
    const int64_t t_end = t0 + NT < cs.steps ? t0 + NT : cs.steps;
    cs.flags(t0, t_end, last_flag, exact);
    pdl_wait();  // phase 1's summaries (seg_M, seg_L) are complete from here on
    auto needs = [&](int64_t u) { return exact[1 + u - t0]; };
    auto needs_m = [&](int64_t u) { return exact[1 + u - t0] && exact[u - t0]; };
    auto issue_m = [&](int64_t u) {  // thread 0: step u's M into stage u % kStages
      if (threadIdx.x == 0 && u < t_end && needs_m(u)) {
        const int st = static_cast<int>(kStages == 2 ? (u & 1) : u % kStages);
        bulk_load(Mst + st * D * D, p.seg_M + cs.base(u), sizeof(float) * D * D, full + st);
      }
    };
    float2 lnext[kNT][2];  // L's accumulator pairs: [n8 tile][row g, g + 8]
    auto load_l = [&](int64_t u) {
      if (!needs(u)) return;
      const float* L = p.seg_L + cs.base(u);
#pragma unroll
      for (int jn = 0; jn < kNT; ++jn)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          lnext[jn][hf] = __ldcg(reinterpret_cast<const float2*>(
              L + (r0 + g + 8 * hf) * D + vb + 8 * jn + 2 * t));
    };
#pragma unroll
    for (int k = 0; k < kStages; ++k) issue_m(t0 + k);
    load_l(t0);
    for (int64_t u = t0; u < t_end; ++u) {
      if (!needs(u)) {  // S_in(next) is not read: nothing was loaded for u
        if (u + 1 < t_end) load_l(u + 1);
        issue_m(u + kStages);  // stage u % kStages was not used by step u
        continue;
      }
      float acc[kNT][4];
#pragma unroll
      for (int jn = 0; jn < kNT; ++jn) {
        acc[jn][0] = lnext[jn][0].x;
        acc[jn][1] = lnext[jn][0].y;
        acc[jn][2] = lnext[jn][1].x;
        acc[jn][3] = lnext[jn][1].y;
      }
      if (u + 1 < t_end) load_l(u + 1);  // in flight under this step's product
      if (needs_m(u)) {
        const int ms = static_cast<int>(kStages == 2 ? (u & 1) : u % kStages);
        mbar_wait(full + ms, (phases >> ms) & 1u);
        phases ^= 1u << ms;
        const float* Mt = Mst + ms * D * D;
        const __half* Sh = Sbuf + (u & 1) * 2 * kTile;  // S_in(prev), formed by step u - 1
        const __half* Sl = Sh + kTile;
        const int odd = g & 1;
        // three independent accumulations (Mh Sh from L; the small terms Ml Sh, Mh Sl from 0,
        // added at the end): chains of 8 mma, not 24
        float xlh[kNT][4], xhl[kNT][4];
#pragma unroll
        for (int jn = 0; jn < kNT; ++jn)
#pragma unroll
          for (int e = 0; e < 4; ++e) xlh[jn][e] = xhl[jn][e] = 0.f;
#pragma unroll
        for (int kp = 0; kp < D / 16; kp += 2) {
          // rows g and g + 8 of k16 steps kp + odd, kp + 1 - odd (keys 4t .. 4t + 3 of each)
          const float* m0 = Mt + (r0 + g) * D + 4 * t;
          const float4 x0 = *reinterpret_cast<const float4*>(m0 + 16 * (kp + odd));
          const float4 x1 = *reinterpret_cast<const float4*>(m0 + 8 * D + 16 * (kp + odd));
          const float4 y0 = *reinterpret_cast<const float4*>(m0 + 16 * (kp + 1 - odd));
          const float4 y1 = *reinterpret_cast<const float4*>(m0 + 8 * D + 16 * (kp + 1 - odd));
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int kk = kp + e;
            const float4 r = (e != odd) ? y0 : x0, q = (e != odd) ? y1 : x1;
            uint32_t ah[4], al[4];
            split_half2(r.x, r.y, ah[0], al[0]);  // row g, slots 2t, 2t + 1
            split_half2(q.x, q.y, ah[1], al[1]);  // row g + 8
            split_half2(r.z, r.w, ah[2], al[2]);  // row g, slots 2t + 8, 2t + 9
            split_half2(q.z, q.w, ah[3], al[3]);
#pragma unroll
            for (int jp = 0; jp < kNT / 2; ++jp) {
              uint32_t bh0[2], bh1[2], bl0[2], bl1[2];
              frag_b16_trans2(bh0, bh1, Sh, kLd, 16 * jp, 16 * kk);
              frag_b16_trans2(bl0, bl1, Sl, kLd, 16 * jp, 16 * kk);
              mma_f16(xlh[2 * jp], al, bh0);
              mma_f16(xhl[2 * jp], ah, bl0);
              mma_f16(acc[2 * jp], ah, bh0);
              mma_f16(xlh[2 * jp + 1], al, bh1);
              mma_f16(xhl[2 * jp + 1], ah, bl1);
              mma_f16(acc[2 * jp + 1], ah, bh1);
            }
          }
        }
#pragma unroll
        for (int jn = 0; jn < kNT; ++jn)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[jn][e] += xlh[jn][e] + xhl[jn][e];
      }
      float* out = cs.out(u);
      __half* Wh = Sbuf + ((u + 1) & 1) * 2 * kTile;  // read by step u + 1
      __half* Wl = Wh + kTile;
#pragma unroll
      for (int jn = 0; jn < kNT; ++jn)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = r0 + g + 8 * hf, col = 8 * jn + 2 * t;
          __stcg(reinterpret_cast<float2*>(out + row * D + vb + col),
                 make_float2(acc[jn][2 * hf], acc[jn][2 * hf + 1]));
          uint32_t hi, lo;
          split_half2(acc[jn][2 * hf], acc[jn][2 * hf + 1], hi, lo);
          const int srow = r0 + walk_slot(g + 8 * hf);
          *reinterpret_cast<uint32_t*>(Wh + srow * kLd + col) = hi;
          *reinterpret_cast<uint32_t*>(Wl + srow * kLd + col) = lo;
        }
      __syncthreads();  // the restaged state is complete; M's stage and buffer u % 2 are read
      issue_m(u + kStages);
    }
    last_flag = exact[t_end - t0];
    __syncthreads();  // exact[] is rewritten for the next batch of steps (or sequence)
  }
}

template <int kWalkCols, int kStages = 2>
__global__ void __launch_bounds__(NT, 1) seg_walk_kernel(SegParams p, bool reverse) {
  PdlCompletion pdl_completion;  // see its definition (mma.cuh)
  pdl_trigger();  // the chain's next kernel may start its blocks' prologues now
  if (p.seqs.failed()) return;
  extern __shared__ __align__(16) unsigned char smem_raw[];  // bulk copies: 16-byte aligned
  float* Mst = reinterpret_cast<float*>(smem_raw);                // [kStages][D][D]
  __half* Sbuf = reinterpret_cast<__half*>(Mst + kStages * D * D);  // [2][2][D][walk_ld]
  uint64_t* full = reinterpret_cast<uint64_t*>(Sbuf + 4 * D * walk_ld<kWalkCols>());
  __shared__ bool exact[NT + 1];
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < kStages; ++k) mbar_init(full + k, 1);
    fence_mbar_init();
  }
  __syncthreads();
  uint32_t phases = 0;
  for_each_chain_sequence(p, [&](int64_t n) {
    walk_sequence_tc<kWalkCols, kStages>(p, reverse, n, blockIdx.y, blockIdx.z * kWalkCols,
                                         Mst, Sbuf, full, phases, exact);
  });
}

// sub_start_kernel  grid (segments x (nsub - 1), H_v, 128 / kSubCols), 256 threads,
//   72 KB smem (2 blocks per SM)
//   Sub-segments (FLASHGDN_CP_SUB): the state entering sub-segment s >= 1 of an exact
//   segment, S = M_s S_in + L_s, for kSubCols state columns (S_in from seg_combine_kernel,
//   M_s and L_s recorded by phase 1), written over L_s. Every block is independent (no
//   chain). Tensor cores at fp32's accuracy: m16n8k16 fp16 products with fp32 accumulators
//   on the two-term split of both operands (split_half2), M_s S_in = Ml Sh + Mh Sl + Mh Sh
//   up to the Ml Sl term (~2^-22 of the product). Warp w: rows (keys) 16 w .. + 15 of the
//   result, M_s's A fragments straight from global memory into registers; S_in's columns
//   staged in shared memory as hi and lo tiles [key][kSubLd] (B fragments by
//   ldmatrix.trans); the accumulators start from L_s.
//   Launched as the combine's programmatic dependent (launch.cu launch_kernel): the blocks
//   of segments that do not start exact (most of the grid: the decaying heads') return
//   before pdl_wait, under the combine's walk.
//   reads  Lb, seg_in, sub_M, sub_L     writes sub_L
//   History (H100, 2/8 heads): fp32 FMA on 32 columns a block took 29 us of the exact
//   heads' chain at x 16384 and 42 us at x 32768 in segments of 43 (2026-11-25), mostly
//   waves of blocks returning after segment_start; with PDL and tensor cores it ends 14 us
//   (x 16384) to 24 us (x 32768, 13 segments) after the combine: its working blocks get
//   only the SMs the warm-started blocks leave. Forming the state in the sub-segment's own phase-0
//   block instead (no kernel between) was slower: those blocks, alone on their SMs, then
//   waited for SMs in two waves beside the warm-started blocks (x 16384 224 -> 231 us).
constexpr int kSubCols = 64;
constexpr int kSubLd = kSubCols + 8;  // rows 144 B apart: ldmatrix's 8 rows in distinct banks
constexpr int kSubXLd = kSubCols + 4;  // X's fp32 staging [key][kSubXLd]
// Xh, Xl (fp16 [D][kSubLd] each), then X's fp32 staging
constexpr size_t kSubStartSmem = 2 * sizeof(__half) * D * kSubLd + sizeof(float) * D * kSubXLd;

// acc += A X[:, x0 .. x0 + kSubCols) for A, X fp32 [D][D] in global memory (rows D apart), on
// fp16 m16n8k16 tensor cores at fp32's accuracy: the two-term splits (split_half2) of both
// operands, A X = Al Xh + Ah Xl + Ah Xh up to the Al Xl term (~2^-22 of the product), fp32
// accumulators. Warp w holds rows 16 w .. + 15 of the result (acc[n8 tile][4], the m16n8
// accumulator layout). A's fragments go from global memory straight into registers; X's
// columns are staged in shared memory as hi and lo tiles Xh, Xl [key][kSubLd] (B fragments by
// ldmatrix.trans), after X's fp32 columns came in by cp.async into Xf [key][kSubXLd] while
// A's loads were in flight: one round trip to L2 (the loop of plain loads before, each
// converted and stored before the next, waited on each of its 8 in turn). Every thread of the
// block calls it (two barriers; the caller's barrier must close earlier reads of Xh, Xl).
// sub_start_kernel's and seg_scan_kernel's product.
__device__ __forceinline__ void add_split_product(float (&acc)[kSubCols / 8][4], const float* A,
                                                  const float* X, int x0, __half* Xh,
                                                  __half* Xl) {
  const int warp = threadIdx.x >> 5, g = lane_id() >> 2, t = lane_id() & 3, r0 = 16 * warp;
  float* Xf = reinterpret_cast<float*>(Xl + D * kSubLd);
  for (int e = threadIdx.x; e < D * kSubCols / 4; e += NT) {
    const int row = e / (kSubCols / 4), c4 = 4 * (e % (kSubCols / 4));
    cp_async16(Xf + row * kSubXLd + c4, X + row * D + x0 + c4, true);
  }
  cp_async_commit();
  // A's fragments, fp32: i = 0..3 are a0..a3 (rows g, g + 8; keys 2t, 2t + 8 of step kk)
  float2 ma[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      ma[kk][i] = __ldcg(reinterpret_cast<const float2*>(A + (r0 + g + (i & 1) * 8) * D +
                                                         16 * kk + 2 * t + (i >> 1) * 8));
  cp_async_wait<0>();
  __syncthreads();
  for (int e = threadIdx.x; e < D * kSubCols / 4; e += NT) {
    const int row = e / (kSubCols / 4), c4 = 4 * (e % (kSubCols / 4));
    const float4 x = *reinterpret_cast<const float4*>(Xf + row * kSubXLd + c4);
    uint2 hi, lo;
    split_half2(x.x, x.y, hi.x, lo.x);
    split_half2(x.z, x.w, hi.y, lo.y);
    *reinterpret_cast<uint2*>(Xh + row * kSubLd + c4) = hi;
    *reinterpret_cast<uint2*>(Xl + row * kSubLd + c4) = lo;
  }
  __syncthreads();
  constexpr int kNT = kSubCols / 8;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t ah[4], al[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) split_half2(ma[kk][i].x, ma[kk][i].y, ah[i], al[i]);
#pragma unroll
    for (int jp = 0; jp < kNT / 2; ++jp) {
      uint32_t bh0[2], bh1[2], bl0[2], bl1[2];
      frag_b16_trans2(bh0, bh1, Xh, kSubLd, 16 * jp, 16 * kk);
      frag_b16_trans2(bl0, bl1, Xl, kSubLd, 16 * jp, 16 * kk);
      mma_f16(acc[2 * jp], al, bh0);  // the small terms first
      mma_f16(acc[2 * jp], ah, bl0);
      mma_f16(acc[2 * jp], ah, bh0);
      mma_f16(acc[2 * jp + 1], al, bh1);
      mma_f16(acc[2 * jp + 1], ah, bl1);
      mma_f16(acc[2 * jp + 1], ah, bh1);
    }
  }
}

// The warp's rows of a [D][D] fp32 matrix's columns x0 .. x0 + kSubCols in (load) or out of
// (store) the accumulator layout of add_split_product.
__device__ __forceinline__ void load_cols_acc(float (&acc)[kSubCols / 8][4], const float* src,
                                              int x0) {
  const int g = lane_id() >> 2, t = lane_id() & 3, r0 = 16 * (threadIdx.x >> 5);
#pragma unroll
  for (int jn = 0; jn < kSubCols / 8; ++jn)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float2 l = __ldcg(reinterpret_cast<const float2*>(src + (r0 + g + 8 * hf) * D + x0 +
                                                              8 * jn + 2 * t));
      acc[jn][2 * hf] = l.x;
      acc[jn][2 * hf + 1] = l.y;
    }
}
__device__ __forceinline__ void store_cols_acc(const float (&acc)[kSubCols / 8][4], float* dst,
                                               int x0) {
  const int g = lane_id() >> 2, t = lane_id() & 3, r0 = 16 * (threadIdx.x >> 5);
#pragma unroll
  for (int jn = 0; jn < kSubCols / 8; ++jn)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      __stcg(reinterpret_cast<float2*>(dst + (r0 + g + 8 * hf) * D + x0 + 8 * jn + 2 * t),
             make_float2(acc[jn][2 * hf], acc[jn][2 * hf + 1]));
}

__global__ void __launch_bounds__(NT, 2) sub_start_kernel(SegParams p) {
  PdlCompletion pdl_completion;  // see its definition (mma.cuh)
  pdl_trigger();
  if (p.seqs.failed() || p.nsub <= 1 || !col_block_chosen<D>(p) || device_sequential(p)) return;
  const int64_t h = blockIdx.y, z = blockIdx.x / (p.nsub - 1);
  const int s = 1 + static_cast<int>(blockIdx.x % (p.nsub - 1));
  int64_t n, j;
  if (!locate_segment(p, z, n, j)) return;
  const int64_t nch = (p.seqs.seq_len(n) + C - 1) / C, seg = seg_chunks(p);
  const int64_t c_begin = j * seg, c_end = c_begin + seg < nch ? c_begin + seg : nch;
  if (c_begin + s * sub_chunks(p) >= c_end) return;  // no such sub-segment
  if (segment_start(p, p.seqs.first_chunk(n), nch, h, j).src != SegSource::Exact) return;
  pdl_wait();  // the combine's seg_in (and phase 1's records before it) are complete
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* Sh = reinterpret_cast<__half*>(smem_raw);  // [D keys][kSubLd] S_in's columns, hi
  __half* Sl = Sh + D * kSubLd;                      // ... lo
  const int vb = blockIdx.z * kSubCols;
  float* L = p.sub_L + sub_offset(p, z, h, s);
  float acc[kSubCols / 8][4];  // from L_s
  load_cols_acc(acc, L, vb);
  add_split_product(acc, p.sub_M + sub_offset(p, z, h, s),
                    p.seg_in + static_cast<size_t>(z * p.Hv + h) * D * D, vb, Sh, Sl);
  store_cols_acc(acc, L, vb);
}

// seg_scan_kernel  grid (segments, 4, H_v / kScanHeads), 256 threads, 72 KB smem (2 blocks
//   per SM), one launch per level of a log-depth scan (launch.cu launch_seg_scan; the
//   forward's replacement of seg_combine_kernel's walk where the plan has at most
//   kScanMaxLevels levels)
//   The combine's chain S_in(j + 1) = A_j(S_in(j)), A_j(S) = M_j S + L_j where segment j
//   starts exact, else the constant L_j (segment 0: from h0, inside L_0), is a composition of
//   affine maps: S_in(j + 1) = A_j o ... o A_0. Level ell (offset d = 2^ell) replaces each
//   P_j (the composition of A over [j - d + 1, j], as far as 0) by P_j o P_{j-d}, a Hillis-
//   Steele scan: ceil(log2(segments - 1)) levels of independent products instead of
//   segments - 1 dependent steps. P is constant (no M) once its range holds segment 0 or a
//   segment that does not start exact; a constant P_j is S_in(j + 1) and goes to seg_in
//   (where segment j + 1 starts exact: only then is it read), the others ping-pong between
//   (src_M, src_L) and (dst_M, dst_L) (level 0 reads phase 1's seg_M, seg_L).
//   Block (z, part, head group): segment z's step j (sequence n, to its segment j + 1) for
//   kScanHeads heads in turn; part 0, 1: columns 0..63, 64..127 of the new M_j = M_j M_{j-d},
//   part 2, 3: of the new L_j = M_j L_{j-d} + L_j. Which segments start exact (segment_start,
//   a thread each over the 2d + 1 segments the level looks at, for every head of the block)
//   decides what it does for each head; most heads' steps (the decaying heads') need
//   nothing. Heads by groups, not a block each: a block a head took ~10 us a level at 2/8
//   heads x 16384 tokens (H100, 2026-11-25: 352 blocks, most returning after segment_start,
//   in ~3 waves of the SMs the warm-started blocks leave), the walk's 4.5 us a step the
//   same 45 us. Products on tensor cores at fp32's accuracy (add_split_product).
//   Each level is its predecessor's programmatic dependent (launch.cu launch_kernel).
//   reads  Lb, seg_L, seg_M (level 0), src_M, src_L, seg_in (constant P of earlier levels)
//   writes dst_M, dst_L, seg_in
constexpr int kScanMaxLevels = 7;  // offsets up to 64
constexpr int kScanHeads = 4;      // value heads a block takes

__global__ void __launch_bounds__(NT, 2)
    seg_scan_kernel(SegParams p, int level, const float* src_M, const float* src_L, float* dst_M,
                    float* dst_L) {
  PdlCompletion pdl_completion;  // see its definition (mma.cuh)
  pdl_trigger();
  if (p.seqs.failed()) return;
  const int64_t z = blockIdx.x, d = int64_t{1} << level;
  const int part = static_cast<int>(blockIdx.y);
  const int64_t h0 = static_cast<int64_t>(blockIdx.z) * kScanHeads;
  const int nh = static_cast<int>(p.Hv - h0 < kScanHeads ? p.Hv - h0 : kScanHeads);
  int64_t n, j, z0, count;
  if (!locate_segment(p, z, n, j)) return;
  sequence_segments(p, n, z0, count);
  if (j >= count - 1) return;  // the last segment: no step after it
  // P_j's range [j - d + 1, j] holds segment 0: constant since an earlier level (levels past
  // what a sequence's segments need, e.g. the host's bound for packed sequences, return here)
  if (level > 0 && j + 1 <= d) return;
  const int64_t chunk0 = p.seqs.first_chunk(n), nch = (p.seqs.seq_len(n) + C - 1) / C;
  // per head of the block: [0] segment j + 1 starts exact (else S_in(j + 1) is not needed,
  // nor P_j by a later step), [1] a segment of P_j's range [j - d + 1, j] does not (or the
  // range holds segment 0: P_j is constant), [2] the same for P_{j-d}'s [j - 2d + 1, j - d]
  __shared__ int flags[3][kScanHeads];
  if (threadIdx.x < 3 * kScanHeads) flags[threadIdx.x / kScanHeads][threadIdx.x % kScanHeads] = 0;
  __syncthreads();
  const int span = static_cast<int>(2 * d + 1);  // segments j + 1 - u, u = 0 .. 2d
  for (int e = threadIdx.x; e < nh * span; e += NT) {
    const int hh = e / span, u = e % span;
    const int64_t i = j + 1 - u;
    const bool ex = i >= 1 && segment_start(p, chunk0, nch, h0 + hh, i).src == SegSource::Exact;
    if (u == 0 ? ex : !ex) atomicOr(&flags[u == 0 ? 0 : u <= d ? 1 : 2][hh], 1);
  }
  __syncthreads();
  const size_t mat = static_cast<size_t>(D) * D;
  const int x0 = (part & 1) * kSubCols;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* Xh = reinterpret_cast<__half*>(smem_raw);  // [D keys][kSubLd], hi
  __half* Xl = Xh + D * kSubLd;                      // ... lo
  for (int hh = 0; hh < nh; ++hh) {  // block-uniform branches: flags are shared
    if (!flags[0][hh]) continue;
    const bool cur_const = flags[1][hh] != 0, prev_const = flags[2][hh] != 0;
    const int64_t h = h0 + hh;
    auto at = [&](int64_t i) { return static_cast<size_t>((z0 + i) * p.Hv + h) * mat; };
    float* out_in = p.seg_in + at(j + 1);
    if (cur_const) {  // final since an earlier level; level 0 copies the constant A_j = L_j
      if (level != 0 || part < 2) continue;
      pdl_wait();
      for (int e = threadIdx.x; e < D * kSubCols / 4; e += NT) {
        const int row = e / (kSubCols / 4), c4 = x0 + 4 * (e % (kSubCols / 4));
        __stcg(reinterpret_cast<float4*>(out_in + row * D + c4),
               __ldcg(reinterpret_cast<const float4*>(src_L + at(j) + row * D + c4)));
      }
      continue;
    }
    // P_j o P_{j-d}: M_j (M_{j-d}, L_{j-d}) + (0, L_j); with P_{j-d} constant only the L
    // part, and the result is final. P_{j-d}'s constant value: seg_in (level 0: phase 1's L)
    if (prev_const && part < 2) continue;
    pdl_wait();  // the previous level's (or phase 1's) results are complete from here on
    const float* X = part < 2      ? src_M + at(j - d)
                     : !prev_const ? src_L + at(j - d)
                     : level == 0  ? src_L + at(j - 1)
                                   : p.seg_in + at(j - d + 1);
    float acc[kSubCols / 8][4];
    if (part < 2) {
#pragma unroll
      for (int jn = 0; jn < kSubCols / 8; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[jn][e] = 0.f;
    } else {
      load_cols_acc(acc, src_L + at(j), x0);
    }
    add_split_product(acc, src_M + at(j), X, x0, Xh, Xl);
    store_cols_acc(acc, prev_const ? out_in : (part < 2 ? dst_M : dst_L) + at(j), x0);
    __syncthreads();  // Xh, Xl are restaged for the next head
  }
}

// seg_correct_kernel  grid (max_chunks, H_v), 256 threads, 104 KB smem (2 blocks per SM)
//   SegParams::corr: the outputs of one chunk of an exact segment, o_t = O_loc,t + Q_eff,t^T
//   S_in for its tokens t (phase 1's local outputs and effective queries, the combine's
//   entering state), written to o in the input dtype. Blocks of chunks whose segment does
//   not start exact return after segment_start. The product O^T = S_in^T Q_eff^T (128
//   values x 64 tokens, k = 128 keys) on TF32 mma.sync (both operands rounded to nearest: the
//   fp16 state pass's 10-bit mantissa), fp32 accumulation; warp w the values 16 w .. + 15.
//   reads  Lb, seg_in, o_loc, q_eff     writes o
constexpr int kCorrSLd = D + 8;   // S_in [key][kCorrSLd]: the A fragments' 32 lanes in 32 banks
constexpr int kCorrQLd = C + 8;   // Q_eff^T [key][kCorrQLd] (idem for B), later O [C][kCorrOLd]
constexpr int kCorrOLd = D + 4;
constexpr size_t kCorrSmem = sizeof(float) * (D * kCorrSLd + D * kCorrQLd);
static_assert(C * kCorrOLd <= D * kCorrQLd, "O staging fits in the Q_eff tile");

template <typename In>
__global__ void __launch_bounds__(NT, 2) seg_correct_kernel(SegParams p, void* out) {
  if (p.seqs.failed()) return;
  const ChunkRef cr = locate_chunk(p.seqs, blockIdx.x);
  if (cr.L == 0) return;
  const int64_t h = blockIdx.y, n = cr.seq;
  const int64_t chunk0 = p.seqs.first_chunk(n), nch = (p.seqs.seq_len(n) + C - 1) / C;
  const int64_t c = blockIdx.x - chunk0, j = c / seg_chunks(p);
  if (j == 0 || segment_start(p, chunk0, nch, h, j).src != SegSource::Exact) return;
  int64_t z0, count;
  sequence_segments(p, n, z0, count);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* Ss = reinterpret_cast<float*>(smem_raw);  // [D keys][kCorrSLd] S_in
  float* Qs = Ss + D * kCorrSLd;                   // [D keys][kCorrQLd] Q_eff^T
  // every load in flight at once (cp.async; a loop of plain loads waited on each: H100, 2/8
  // x 32768, 109 us for the kernel), rounded to tf32 at the fragments
  const float* S_in = p.seg_in + static_cast<size_t>((z0 + j) * p.Hv + h) * D * D;
  for (int e = threadIdx.x; e < D * D / 4; e += NT)
    cp_async16(Ss + (e / (D / 4)) * kCorrSLd + 4 * (e % (D / 4)), S_in + 4 * e, true);
  const int L = cr.L;
  const size_t col0 = static_cast<size_t>(h) * D * p.corr_ld + cr.tok0;  // (h, key 0, token 0)
  for (int e = threadIdx.x; e < D * C; e += NT) {
    const int key = e / C, tok = e % C;
    if (tok < L) cp_async4(Qs + key * kCorrQLd + tok, p.q_eff + col0 + key * p.corr_ld + tok);
    else Qs[key * kCorrQLd + tok] = 0.f;
  }
  cp_async_commit();
  const int warp = threadIdx.x >> 5, g = lane_id() >> 2, t = lane_id() & 3, m0 = 16 * warp;
  float loc[8][4];  // O_loc at this thread's accumulator places, loaded under the product
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = m0 + g + (e >= 2 ? 8 : 0), tok = 8 * nt + 2 * t + (e & 1);
      loc[nt][e] = tok < L ? __ldcg(p.o_loc + col0 + v * p.corr_ld + tok) : 0.f;
    }
  cp_async_wait<0>();
  __syncthreads();
  auto tf = [](float x) { return __float_as_uint(round_tf32(x)); };
  float acc[8][4] = {};
#pragma unroll 4
  for (int k0 = 0; k0 < D; k0 += 8) {
    uint32_t a[4];  // A[m][k] = S_in[k][m]
    a[0] = tf(Ss[(k0 + t) * kCorrSLd + m0 + g]);
    a[1] = tf(Ss[(k0 + t) * kCorrSLd + m0 + g + 8]);
    a[2] = tf(Ss[(k0 + t + 4) * kCorrSLd + m0 + g]);
    a[3] = tf(Ss[(k0 + t + 4) * kCorrSLd + m0 + g + 8]);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      uint32_t b[2];  // B[k][n] = Q_eff^T[key k][token n]
      b[0] = tf(Qs[(k0 + t) * kCorrQLd + 8 * nt + g]);
      b[1] = tf(Qs[(k0 + t + 4) * kCorrQLd + 8 * nt + g]);
      mma_tf32(acc[nt], a, b);
    }
  }
  __syncthreads();  // Qs read: it stages O [token][value] next
  float* Os = Qs;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = m0 + g + (e >= 2 ? 8 : 0), tok = 8 * nt + 2 * t + (e & 1);
      Os[tok * kCorrOLd + v] = acc[nt][e] + loc[nt][e];
    }
  __syncthreads();
  In* o = static_cast<In*>(out);
  for (int e = threadIdx.x; e < C * (D / 4); e += NT) {
    const int tok = e / (D / 4), v = 4 * (e % (D / 4));
    if (tok >= L) break;
    const float4 x = *reinterpret_cast<const float4*>(Os + tok * kCorrOLd + v);
    In q4[4] = {from_f<In>(x.x), from_f<In>(x.y), from_f<In>(x.z), from_f<In>(x.w)};
    *reinterpret_cast<uint2*>(o + ((cr.tok0 + tok) * p.Hv + h) * D + v) =
        *reinterpret_cast<const uint2*>(q4);
  }
}

}  // namespace cuda
}  // namespace flashgdn
