// The sampled verifier's per-row work over the vocabulary (specdec/sampling.py, rejection_sampler.py)
// in one or two passes a row. In torch the same transform is ~25 ops, each a pass over the
// 49k-wide row with its own allocation: ~0.6 ms of a ~7 ms sampled step here, the rejection
// sampler's draw another ~0.3 ms, against ~0.1 ms for a greedy step's argmax.
//
// probs: temperature, top-k and top-p as logits_to_probs applies them. Top-p needs the likeliest
// tokens in order only up to the nucleus: the exp pass also sums the mass of the tokens at or above
// three thresholds, and only those above the highest threshold holding top_p's mass are sorted.
// draw: one token per row by inverse CDF, optionally with one token left out (the rejected draft
// of a one-hot q): the row's mass in blocks, then a scan of the one block where the draw falls.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr float THRESHOLDS[3] = {1.f / 256, 1.f / 65536, 1.f / 16777216};  // of the row's likeliest token's mass

// The loops below are plain float code under `omp simd`, which lets the compiler vectorise them
// (reductions included) for whatever the CPU has: 16 lanes with AVX-512, 8 with AVX2.

// e^x for -87 <= x <= 0: 2^(n + f), n = round(x log2 e) (the add and subtract of 1.5 * 2^23
// rounds to nearest), 2^f by attention.cpp's exp16 polynomial, 2^n built in the exponent bits
inline float exp_neg(float x) {
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.f) - 12582912.f;
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// out[j] = (x[j] - max) * inv_t, x as logits_to_probs' nan_to_num leaves it (NaN -inf, -inf and
// +inf the lowest and largest float); false when the row has no finite logit (all NaN).
bool scaled(const float* x, float* out, int64_t V, float inv_t) {
  float top = -INFINITY;
#pragma omp simd reduction(max : top)
  for (int64_t j = 0; j < V; ++j) {
    const float c = x[j] < -FLT_MAX ? -FLT_MAX : (x[j] > FLT_MAX ? FLT_MAX : x[j]);
    out[j] = x[j] != x[j] ? -INFINITY : c;
    top = out[j] > top ? out[j] : top;
  }
  if (!std::isfinite(top)) return false;
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) out[j] = (out[j] - top) * inv_t;
  return true;
}

// keeps the k largest values of v (and all equal to the kth), the rest -inf
void keep_top_k(float* v, int64_t V, int64_t k, std::vector<float>& scratch) {
  scratch.assign(v, v + V);
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
  const float kth = scratch[k - 1];
  for (int64_t j = 0; j < V; ++j) v[j] = v[j] < kth ? -INFINITY : v[j];
}

// v[j] = e^v[j] for v <= 0, as 0 below -87 (where float's e^x leaves its normal range); returns
// the row's mass and, in above[t], the mass at or above THRESHOLDS[t]. The masses add in double: in
// float a lane holding the likeliest token's 1 drops every addend under half its ulp (2^-24), which
// on a row with a long tail lost 1/8 (AVX2) or 1/16 (AVX-512) of the tail, 1.8e-4 of the mass
// (tests/test_sampling_kernel.py's row of 49151 tokens at 2^-25).
double exps(float* v, int64_t V, double above[3]) {
  double sum = 0.0, a0 = 0.0, a1 = 0.0, a2 = 0.0;
#pragma omp simd reduction(+ : sum, a0, a1, a2)
  for (int64_t j = 0; j < V; ++j) {
    const float x = v[j];
    const float e = x > -87.f ? exp_neg(x) : 0.f;
    v[j] = e;
    sum += e;
    a0 += e >= THRESHOLDS[0] ? e : 0.f;
    a1 += e >= THRESHOLDS[1] ? e : 0.f;
    a2 += e >= THRESHOLDS[2] ? e : 0.f;
  }
  above[0] = a0, above[1] = a1, above[2] = a2;
  return sum;
}

// e (unnormalised, sum z) -> the nucleus: the likeliest tokens while the mass before them is
// under top_p, renormalised, the rest 0. Only tokens at or above a threshold whose mass reaches
// top_p can be in it, so only they are sorted.
void nucleus(float* e, int64_t V, double z, const double above[3], float top_p, std::vector<std::pair<float, int32_t>>& cand) {
  const double target = static_cast<double>(top_p) * z;
  float floor_e = 0.f;  // candidates: e >= floor_e (and e > 0)
  for (int t = 2; t >= 0; --t)
    if (above[t] >= target) floor_e = THRESHOLDS[t];
  cand.clear();
  for (int64_t j = 0; j < V; ++j)
    if (e[j] > 0.f && e[j] >= floor_e) cand.emplace_back(e[j], static_cast<int32_t>(j));
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  double before = 0.0;
  size_t kept = 0;
  while (kept < cand.size() && (kept == 0 || before < target)) before += cand[kept++].first;
  std::memset(e, 0, V * sizeof(float));
  const float inv = static_cast<float>(1.0 / before);
  for (size_t i = 0; i < kept; ++i) e[cand[i].second] = cand[i].first * inv;
}

void probs_row(const float* x, float* out, int64_t V, float inv_t, int64_t top_k, float top_p) {
  if (!scaled(x, out, V, inv_t)) {  // no finite logit (a broken model output): uniform, as logits_to_probs
    std::fill(out, out + V, 1.f / V);
    return;
  }
  thread_local std::vector<float> scratch;
  thread_local std::vector<std::pair<float, int32_t>> cand;
  if (top_k > 0 && top_k < V) keep_top_k(out, V, top_k, scratch);
  double above[3];
  const double z = exps(out, V, above);
  if (top_p < 1.f) return nucleus(out, V, z, above, top_p, cand);
  const float inv = static_cast<float>(1.0 / z);
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) out[j] *= inv;
}

constexpr int64_t BLOCK = 512;  // entries per partial sum of draw()

// the index where w * mass falls in row p's running sum, skipping index `skip`; -1 if the row has
// no finite positive mass. The last entry with mass when rounding leaves the draw past the end.
int64_t draw_row(const float* p, int64_t V, int64_t skip, double w) {
  const int64_t nb = (V + BLOCK - 1) / BLOCK;
  thread_local std::vector<double> sums;
  sums.assign(nb, 0.0);
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    double s = 0.0;
    for (int64_t j = b * BLOCK, e = std::min(V, j + BLOCK); j < e; ++j) s += j == skip ? 0.0 : p[j];
    sums[b] = s;
    total += s;
  }
  if (!(total > 0.0) || !std::isfinite(total)) return -1;
  const double at = w * total;
  double run = 0.0;
  int64_t last = -1;
  for (int64_t b = 0; b < nb; ++b) {
    if (run + sums[b] <= at && b + 1 < nb) {
      run += sums[b];
      continue;
    }
    for (int64_t j = b * BLOCK, e = std::min(V, j + BLOCK); j < e; ++j) {
      if (j == skip || !(p[j] > 0.f)) continue;
      last = j;
      run += p[j];
      if (run > at) return j;
    }
    if (last >= 0 && b + 1 == nb) return last;
  }
  return last;
}

at::Tensor probs(const at::Tensor& logits, const at::Tensor& inv_t, const at::Tensor& top_k, const at::Tensor& top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "sampling_probs: logits must be float32 [N, V]");
  const auto x = logits.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  const auto t = inv_t.to(at::kFloat).contiguous(), p = top_p.to(at::kFloat).contiguous();
  const auto k = top_k.to(at::kLong).contiguous();
  TORCH_CHECK(t.numel() == N && p.numel() == N && k.numel() == N, "sampling_probs: one parameter per row");
  auto out = at::empty({N, V}, x.options());
  const float *xs = x.data_ptr<float>(), *ts = t.data_ptr<float>(), *ps = p.data_ptr<float>();
  const int64_t* ks = k.data_ptr<int64_t>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) probs_row(xs + r * V, os + r * V, V, ts[r], ks[r], ps[r]);
  });
  return out;
}

// one token per (row, skip, w): row `rows[i]` of target [N, V] (float32 probabilities), without
// token skip[i] (-1: none), at uniform w[i] in [0, 1); -1 where that leaves no mass.
at::Tensor draw(const at::Tensor& target, const at::Tensor& rows, const at::Tensor& skip, const at::Tensor& w) {
  TORCH_CHECK(target.dim() == 2 && target.scalar_type() == at::kFloat, "sampling_draw: target must be float32 [N, V]");
  const auto p = target.contiguous();
  const auto r = rows.to(at::kLong).contiguous(), s = skip.to(at::kLong).contiguous();
  const auto u = w.to(at::kDouble).contiguous();
  const int64_t S = r.numel(), V = p.size(1);
  TORCH_CHECK(S == s.numel() && S == u.numel(), "sampling_draw: one skip and one w per row");
  TORCH_CHECK(S == 0 || (r.min().item<int64_t>() >= 0 && r.max().item<int64_t>() < p.size(0)), "sampling_draw: row out of range");
  auto out = at::empty({S}, r.options());
  for (int64_t i = 0; i < S; ++i)
    out.data_ptr<int64_t>()[i] = draw_row(p.data_ptr<float>() + r.data_ptr<int64_t>()[i] * V, V, s.data_ptr<int64_t>()[i], u.data_ptr<double>()[i]);
  return out;
}

// the first index of row x's largest value, as torch.argmax gives it: a NaN counts as the largest
// (its first), and ties go to the first. Torch's op spreads a row over the thread team, whose
// wake-up cost a greedy pass more than the row's 49k compares (one row after a matmul, by hand:
// 53-107 us against 19 us here; two rows 55 against 16-42).
int64_t argmax_row(const float* x, int64_t V, std::vector<float>& block_max) {
  constexpr int64_t BLOCK = 256;  // each block's maximum in one pass, then the first best block scanned
  const int64_t nb = (V + BLOCK - 1) / BLOCK;
  block_max.resize(nb);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t e = std::min(V, (b + 1) * BLOCK);
    float m = -INFINITY;
    int nans = 0;
#pragma omp simd reduction(max : m) reduction(+ : nans)
    for (int64_t j = b * BLOCK; j < e; ++j) {
      nans += x[j] != x[j];
      m = x[j] > m ? x[j] : m;
    }
    if (nans)  // no NaN before this block: its first NaN is the row's argmax
      for (int64_t j = b * BLOCK; j < e; ++j)
        if (x[j] != x[j]) return j;
    block_max[b] = m;
  }
  const int64_t best = std::max_element(block_max.begin(), block_max.end()) - block_max.begin();  // the first
  for (int64_t j = best * BLOCK;; ++j)
    if (x[j] == block_max[best]) return j;
}

std::vector<int64_t> argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "sampling_argmax: x must be float32 [N, V > 0]");
  const auto c = x.contiguous();
  const int64_t N = c.size(0), V = c.size(1);
  std::vector<int64_t> out(N);
  std::vector<float> block_max;
  for (int64_t r = 0; r < N; ++r) out[r] = argmax_row(c.data_ptr<float>() + r * V, V, block_max);
  return out;
}

std::string isa() {  // the vector width the loops above were compiled for
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(specdec_sampling, m) {
  m.def("sampling_isa() -> str", &isa);
  m.def("probs(Tensor logits, Tensor inv_t, Tensor top_k, Tensor top_p) -> Tensor");
  m.def("draw(Tensor target, Tensor rows, Tensor skip, Tensor w) -> Tensor");
  m.def("argmax(Tensor x) -> int[]");
  m.impl("probs", c10::DispatchKey::CPU, TORCH_FN(probs));
  m.impl("draw", c10::DispatchKey::CPU, TORCH_FN(draw));
  m.impl("argmax", c10::DispatchKey::CPU, TORCH_FN(argmax));
}
