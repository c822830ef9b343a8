// GoogleTest for the C API (include/flashgdn/flashgdn.h) on the CPU backend: argument
// validation through error codes and messages, and a small forward against a
// double-precision token-by-token recurrence written here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "flashgdn/flashgdn.h"

namespace {

constexpr int D = 128;

flashgdn_tensor describe(void* data, flashgdn_dtype dtype, std::initializer_list<int64_t> shape) {
  flashgdn_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.device = FLASHGDN_DEVICE_CPU;
  t.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int j = t.ndim - 1; j >= 0; --j) {
    t.strides[j] = stride;
    stride *= t.shape[j];
  }
  return t;
}

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

float from_bf16(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// One sequence of T tokens, one q/k head, two value heads (grouped).
struct Inputs {
  int T = 70, Hqk = 1, Hv = 2;
  std::vector<uint16_t> q, k, v, o;
  std::vector<float> g, beta, h0, ht;
  explicit Inputs(unsigned seed) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> n01;
    auto fill = [&](std::vector<uint16_t>& x, size_t count, bool normalise) {
      x.resize(count);
      for (size_t r = 0; r < count / D; ++r) {
        float row[D], norm = 0.f;
        for (float& e : row) norm += (e = n01(gen)) * e;
        for (int c = 0; c < D; ++c) x[r * D + c] = to_bf16(normalise ? row[c] / std::sqrt(norm) : row[c]);
      }
    };
    fill(q, size_t(T) * Hqk * D, false);
    fill(k, size_t(T) * Hqk * D, true);
    fill(v, size_t(T) * Hv * D, false);
    o.assign(size_t(T) * Hv * D, 0);
    for (int i = 0; i < T * Hv; ++i) {
      g.push_back(i % Hv == 0 ? 0.f : -std::log1p(std::exp(-n01(gen))) / 4.f);  // head 0: g == 0
      beta.push_back(1.f / (1.f + std::exp(-n01(gen))));
    }
    for (int i = 0; i < Hv * D * D; ++i) h0.push_back(0.1f * n01(gen));
    ht.assign(h0.size(), 0.f);
  }
  flashgdn_fwd_args args() {
    flashgdn_fwd_args a{};
    a.q = describe(q.data(), FLASHGDN_DTYPE_BF16, {1, T, Hqk, D});
    a.k = describe(k.data(), FLASHGDN_DTYPE_BF16, {1, T, Hqk, D});
    a.v = describe(v.data(), FLASHGDN_DTYPE_BF16, {1, T, Hv, D});
    a.g = describe(g.data(), FLASHGDN_DTYPE_F32, {1, T, Hv});
    a.beta = describe(beta.data(), FLASHGDN_DTYPE_F32, {1, T, Hv});
    a.initial_state = describe(h0.data(), FLASHGDN_DTYPE_F32, {1, Hv, D, D});
    a.o = describe(o.data(), FLASHGDN_DTYPE_BF16, {1, T, Hv, D});
    a.final_state = describe(ht.data(), FLASHGDN_DTYPE_F32, {1, Hv, D, D});
    return a;
  }
};

TEST(CApi, ForwardMatchesDoubleRecurrence) {
  Inputs in(1);
  auto a = in.args();
  size_t ws = 123;
  ASSERT_EQ(flashgdn_fwd_workspace_size(&a, &ws), 0) << flashgdn_last_error();
  EXPECT_EQ(ws, 0u);  // the CPU backend needs no workspace
  ASSERT_EQ(flashgdn_fwd(&a), 0) << flashgdn_last_error();

  const double scale = 1.0 / std::sqrt(double(D));
  double err_o = 0, ref_o = 0, err_s = 0, ref_s = 0;
  for (int h = 0; h < in.Hv; ++h) {
    std::vector<double> S(in.h0.begin() + h * D * D, in.h0.begin() + (h + 1) * D * D);
    for (int t = 0; t < in.T; ++t) {
      const double decay = std::exp(double(in.g[t * in.Hv + h])), b = in.beta[t * in.Hv + h];
      const uint16_t* kt = &in.k[size_t(t) * D];
      const uint16_t* qt = &in.q[size_t(t) * D];
      const uint16_t* vt = &in.v[(size_t(t) * in.Hv + h) * D];
      for (double& s : S) s *= decay;
      for (int c = 0; c < D; ++c) {
        double pred = 0;
        for (int r = 0; r < D; ++r) pred += S[r * D + c] * from_bf16(kt[r]);
        const double u = b * (from_bf16(vt[c]) - pred);
        for (int r = 0; r < D; ++r) S[r * D + c] += from_bf16(kt[r]) * u;
      }
      for (int c = 0; c < D; ++c) {
        double o = 0;
        for (int r = 0; r < D; ++r) o += S[r * D + c] * from_bf16(qt[r]);
        o *= scale;
        const double got = from_bf16(in.o[(size_t(t) * in.Hv + h) * D + c]);
        err_o += (got - o) * (got - o);
        ref_o += o * o;
      }
    }
    for (int i = 0; i < D * D; ++i) {
      const double got = in.ht[h * D * D + i];
      err_s += (got - S[i]) * (got - S[i]);
      ref_s += S[i] * S[i];
    }
  }
  EXPECT_LT(std::sqrt(err_o / ref_o), 4.3e-3);  // bf16 output rounding dominates
  EXPECT_LT(std::sqrt(err_s / ref_s), 1e-5);    // fp32 state
}

TEST(CApi, MaxSeqlenHintIsCheckedAndChangesNothingOnTheCpu) {
  Inputs in(3);
  auto a = in.args();
  a.max_seqlen = -5;
  EXPECT_NE(flashgdn_fwd(&a), 0);
  EXPECT_NE(std::string(flashgdn_last_error()).find("max_seqlen must be >= 0"), std::string::npos);
  // a valid hint (here without cu_seqlens, where it is ignored) gives the same bits
  a.max_seqlen = 0;
  ASSERT_EQ(flashgdn_fwd(&a), 0) << flashgdn_last_error();
  const std::vector<uint16_t> o0 = in.o;
  a.max_seqlen = in.T;
  ASSERT_EQ(flashgdn_fwd(&a), 0) << flashgdn_last_error();
  EXPECT_EQ(in.o, o0);
}

// cu_seqlens_host (the host copy of cu_seqlens, a planning hint): checked like cu_seqlens,
// the errors naming it; on the CPU backend, which plans nothing, the same bits with it.
TEST(CApi, CuSeqlensHostIsCheckedAndChangesNothingOnTheCpu) {
  Inputs in(4);
  auto a = in.args();
  std::vector<int32_t> cu = {0, 30, in.T};
  a.cu_seqlens = describe(cu.data(), FLASHGDN_DTYPE_I32, {3});
  std::vector<float> ht2(size_t(2) * in.Hv * D * D);
  a.final_state = describe(ht2.data(), FLASHGDN_DTYPE_F32, {2, in.Hv, D, D});
  a.initial_state = flashgdn_tensor{};
  ASSERT_EQ(flashgdn_fwd(&a), 0) << flashgdn_last_error();
  const std::vector<uint16_t> o0 = in.o;
  const std::vector<float> ht0 = ht2;
  std::vector<int64_t> host = {0, 30, in.T};
  a.cu_seqlens_host = describe(host.data(), FLASHGDN_DTYPE_I64, {3});
  ASSERT_EQ(flashgdn_fwd(&a), 0) << flashgdn_last_error();
  EXPECT_EQ(in.o, o0);
  EXPECT_EQ(ht2, ht0);
  auto expect_error = [&](const flashgdn_fwd_args& bad, const char* what) {
    EXPECT_NE(flashgdn_fwd(&bad), 0) << what;
    EXPECT_NE(std::string(flashgdn_last_error()).find(what), std::string::npos)
        << flashgdn_last_error();
  };
  std::vector<int64_t> decreasing = {0, 50, 40}, short_total = {0, 30, 60}, two = {0, in.T};
  auto b = a;
  b.cu_seqlens_host = describe(decreasing.data(), FLASHGDN_DTYPE_I64, {3});
  expect_error(b, "cu_seqlens_host must be non-decreasing");
  b.cu_seqlens_host = describe(short_total.data(), FLASHGDN_DTYPE_I64, {3});
  expect_error(b, "cu_seqlens_host[-1] must equal the number of tokens");
  b.cu_seqlens_host = describe(two.data(), FLASHGDN_DTYPE_I64, {2});
  expect_error(b, "cu_seqlens_host must have the shape of cu_seqlens");
  b.cu_seqlens_host = describe(host.data(), FLASHGDN_DTYPE_F32, {3});
  expect_error(b, "cu_seqlens_host must have dtype");
  b.cu_seqlens_host = describe(host.data(), FLASHGDN_DTYPE_I64, {3});
  b.cu_seqlens_host.device = FLASHGDN_DEVICE_CUDA;
  expect_error(b, "cu_seqlens_host must be in host memory");
  b = a;
  b.cu_seqlens = flashgdn_tensor{};
  b.final_state = flashgdn_tensor{};
  expect_error(b, "cu_seqlens_host is the host copy of cu_seqlens; pass cu_seqlens too");
}

// keep_for_backward / kept_workspace (docs in flashgdn.h): the CPU backend keeps nothing and
// ignores both, with the same bits as without them and no workspace.
TEST(CApi, KeepForBackwardIsIgnoredOnTheCpu) {
  Inputs in(5);
  auto a = in.args();
  ASSERT_EQ(flashgdn_fwd(&a), 0) << flashgdn_last_error();
  const std::vector<uint16_t> o0 = in.o;
  const std::vector<float> ht0 = in.ht;
  a.keep_for_backward = 1;
  size_t ws = 123;
  ASSERT_EQ(flashgdn_fwd_workspace_size(&a, &ws), 0) << flashgdn_last_error();
  EXPECT_EQ(ws, 0u);
  ASSERT_EQ(flashgdn_fwd(&a), 0) << flashgdn_last_error();
  EXPECT_EQ(in.o, o0);
  EXPECT_EQ(in.ht, ht0);

  const int T = in.T, Hqk = in.Hqk, Hv = in.Hv;
  std::vector<uint16_t> d_o(size_t(T) * Hv * D), dq[2], dk[2], dv[2];
  std::vector<float> dht(in.h0.size()), dg[2], dbeta[2], dh0[2];
  std::mt19937 gen(7);
  std::normal_distribution<float> n01;
  for (auto& x : d_o) x = to_bf16(n01(gen));
  for (auto& x : dht) x = n01(gen);
  unsigned char not_a_workspace[16];
  for (int run = 0; run < 2; ++run) {
    dq[run].assign(size_t(T) * Hqk * D, 0);
    dk[run].assign(size_t(T) * Hqk * D, 0);
    dv[run].assign(size_t(T) * Hv * D, 0);
    dg[run].assign(size_t(T) * Hv, 0.f);
    dbeta[run].assign(size_t(T) * Hv, 0.f);
    dh0[run].assign(in.h0.size(), 0.f);
    flashgdn_bwd_args b{};
    b.q = a.q;
    b.k = a.k;
    b.v = a.v;
    b.g = a.g;
    b.beta = a.beta;
    b.initial_state = a.initial_state;
    b.d_o = describe(d_o.data(), FLASHGDN_DTYPE_BF16, {1, T, Hv, D});
    b.d_final_state = describe(dht.data(), FLASHGDN_DTYPE_F32, {1, Hv, D, D});
    b.dq = describe(dq[run].data(), FLASHGDN_DTYPE_BF16, {1, T, Hqk, D});
    b.dk = describe(dk[run].data(), FLASHGDN_DTYPE_BF16, {1, T, Hqk, D});
    b.dv = describe(dv[run].data(), FLASHGDN_DTYPE_BF16, {1, T, Hv, D});
    b.dg = describe(dg[run].data(), FLASHGDN_DTYPE_F32, {1, T, Hv});
    b.dbeta = describe(dbeta[run].data(), FLASHGDN_DTYPE_F32, {1, T, Hv});
    b.dh0 = describe(dh0[run].data(), FLASHGDN_DTYPE_F32, {1, Hv, D, D});
    if (run == 1) {  // a kept workspace the CPU must not read
      b.kept_workspace = not_a_workspace;
      b.kept_workspace_bytes = sizeof not_a_workspace;
    }
    size_t bws = 123;
    ASSERT_EQ(flashgdn_bwd_workspace_size(&b, &bws), 0) << flashgdn_last_error();
    EXPECT_EQ(bws, 0u);
    ASSERT_EQ(flashgdn_bwd(&b), 0) << flashgdn_last_error();
  }
  EXPECT_EQ(dq[0], dq[1]);
  EXPECT_EQ(dk[0], dk[1]);
  EXPECT_EQ(dv[0], dv[1]);
  EXPECT_EQ(dg[0], dg[1]);
  EXPECT_EQ(dbeta[0], dbeta[1]);
  EXPECT_EQ(dh0[0], dh0[1]);
  double norm = 0;
  for (float x : dh0[0]) norm += double(x) * x;
  EXPECT_GT(norm, 0.0);  // a real backward ran
}

TEST(CApi, RejectsBadShapesWithNamedArgument) {
  Inputs in(2);
  auto a = in.args();
  a.q.ndim = 3;
  EXPECT_NE(flashgdn_fwd(&a), 0);
  EXPECT_NE(std::string(flashgdn_last_error()).find("q must be 4-D"), std::string::npos);

  a = in.args();
  a.v.shape[3] = 64;
  EXPECT_NE(flashgdn_fwd(&a), 0);
  EXPECT_NE(std::string(flashgdn_last_error()).find("v.shape[-1] (head dim V) must be 128"),
            std::string::npos);

  a = in.args();
  a.g.dtype = FLASHGDN_DTYPE_I32;
  EXPECT_NE(flashgdn_fwd(&a), 0);
  EXPECT_NE(std::string(flashgdn_last_error()).find("g must have dtype"), std::string::npos);

  a = in.args();
  a.o.data = nullptr;
  EXPECT_NE(flashgdn_fwd(&a), 0);
  EXPECT_NE(std::string(flashgdn_last_error()).find("o is required"), std::string::npos);
}

TEST(CApi, RejectsCuSeqlensOutOfRange) {
  Inputs in(3);
  auto a = in.args();
  a.initial_state = flashgdn_tensor{};
  a.final_state = flashgdn_tensor{};
  int32_t cu[3] = {0, 30, in.T + 5};
  a.cu_seqlens = describe(cu, FLASHGDN_DTYPE_I32, {3});
  EXPECT_NE(flashgdn_fwd(&a), 0);
  EXPECT_NE(std::string(flashgdn_last_error()).find("cu_seqlens[-1] must equal"), std::string::npos);
  cu[2] = in.T;
  EXPECT_EQ(flashgdn_fwd(&a), 0) << flashgdn_last_error();
  EXPECT_STREQ(flashgdn_last_error(), "");
}

}  // namespace

// state_layout VK with bf16 states: the C API reads h0 transposed and widened, writes the
// final state transposed and rounded; o equals the KV/fp32 call bit for bit.
TEST(CApi, StateLayoutVkBf16MatchesKvFp32) {
  Inputs in(4);
  for (float& x : in.h0) x = from_bf16(to_bf16(x));  // representable in bf16
  auto a = in.args();
  ASSERT_EQ(a.state_layout, FLASHGDN_STATE_LAYOUT_KV);  // zero-initialised default
  ASSERT_EQ(flashgdn_fwd(&a), 0) << flashgdn_last_error();
  const std::vector<uint16_t> o_ref = in.o;
  const std::vector<float> ht_ref = in.ht;

  const size_t mats = static_cast<size_t>(in.Hv);
  std::vector<uint16_t> h0_vk(mats * D * D), ht_vk(mats * D * D, 0);
  for (size_t m = 0; m < mats; ++m)
    for (int i = 0; i < D; ++i)
      for (int j = 0; j < D; ++j) h0_vk[(m * D + j) * D + i] = to_bf16(in.h0[(m * D + i) * D + j]);
  std::fill(in.o.begin(), in.o.end(), 0);
  a = in.args();
  a.state_layout = FLASHGDN_STATE_LAYOUT_VK;
  a.initial_state = describe(h0_vk.data(), FLASHGDN_DTYPE_BF16, {1, in.Hv, D, D});
  a.final_state = describe(ht_vk.data(), FLASHGDN_DTYPE_BF16, {1, in.Hv, D, D});
  ASSERT_EQ(flashgdn_fwd(&a), 0) << flashgdn_last_error();
  EXPECT_EQ(in.o, o_ref);
  int mismatches = 0;
  for (size_t m = 0; m < mats; ++m)
    for (int i = 0; i < D; ++i)
      for (int j = 0; j < D; ++j)
        mismatches += ht_vk[(m * D + j) * D + i] != to_bf16(ht_ref[(m * D + i) * D + j]);
  EXPECT_EQ(mismatches, 0);

  a.state_layout = 5;
  EXPECT_NE(flashgdn_fwd(&a), 0);
  EXPECT_NE(std::string(flashgdn_last_error()).find("state_layout must be FLASHGDN_STATE_LAYOUT_KV"),
            std::string::npos);
  a.state_layout = FLASHGDN_STATE_LAYOUT_VK;
  a.initial_state.dtype = FLASHGDN_DTYPE_F64;
  EXPECT_NE(flashgdn_fwd(&a), 0);
  EXPECT_NE(std::string(flashgdn_last_error())
                .find("initial_state must have dtype float32 or bfloat16 or float16"),
            std::string::npos);
}
