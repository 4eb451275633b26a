// Attention of a token pass (specdec/models/token_pass.py): each of N query tokens attends over
// its own slot's cached keys up to its own position, alone. One (token, head) pair is one task,
// computed by the same code whatever N is and whichever thread runs it, so a token's output never
// depends on the other tokens of its pass: the batch invariance speculation needs in bfloat16,
// for the cost of one call per layer rather than one per token.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> 16 float
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#endif

constexpr int64_t LANES = 16;  // partial sums per dot product, added in a fixed order: vectorisable and deterministic

inline float dot(const float* q, const uint16_t* k, int64_t hd) {
#if defined(__AVX512F__)
  if (hd % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc[LANES] = {0.f};
  int64_t d = 0;
  for (; d + LANES <= hd; d += LANES)
    for (int64_t l = 0; l < LANES; ++l) acc[l] += q[d + l] * bf16_to_float(k[d + l]);
  for (; d < hd; ++d) acc[d % LANES] += q[d] * bf16_to_float(k[d]);
  float s = 0.f;
  for (int64_t l = 0; l < LANES; ++l) s += acc[l];
  return s;
}

inline void axpy(float p, const uint16_t* v, float* out, int64_t hd) {  // out += p * v
#if defined(__AVX512F__)
  if (hd % 16 == 0) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t d = 0; d < hd; d += 16)
      _mm512_storeu_ps(out + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(out + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < hd; ++d) out[d] += p * bf16_to_float(v[d]);
}

#if defined(__AVX512F__)
// e^x for 16 lanes: 2^(n + f) with n = round(x log2 e), 2^f by a degree-6 polynomial (relative
// error ~2e-7, as good as expf for a softmax); a vector of these costs what one scalar expf does.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // in [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// scores[j] = e^(scores[j] - mx) for j < n; returns their sum (in a fixed order).
inline float exp_shifted(float* scores, int64_t n, float mx) {
  int64_t j = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), m));
    _mm512_storeu_ps(scores + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; j < n; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  return sum;
}

// q [hd] fp32 against keys [n, hd] bf16 (row stride ks) -> out [hd] fp32, over v likewise.
void attend_one(const float* q, const uint16_t* k, const uint16_t* v, int64_t n, int64_t hd, int64_t ks,
                float scale, float softcap, float* scores, float* out) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    float s = dot(q, k + j * ks, hd) * scale;
    if (softcap > 0.f) s = std::tanh(s / softcap) * softcap;
    scores[j] = s;
    mx = s > mx ? s : mx;
  }
  const float sum = exp_shifted(scores, n, mx);
  for (int64_t d = 0; d < hd; ++d) out[d] = 0.f;
  for (int64_t j = 0; j < n; ++j) axpy(scores[j], v + j * ks, out, hd);
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < hd; ++d) out[d] *= inv;
}

constexpr int64_t GRAIN = 4;  // (token, head) tasks per thread at least: waking a thread costs more than one

}  // namespace

// q [N, H, hd], k/v [N, Hkv, hd] (this pass's keys and values, written into the caches first),
// k_cache/v_cache [slots, Hkv, L, hd], meta [N, 2] int64 (slot, position). All bfloat16 but meta.
at::Tensor attend_tokens(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor meta, int64_t window, double scale, double softcap) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "attend_tokens runs on bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attend_tokens needs contiguous caches");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  meta = meta.to(at::kLong).contiguous();
  const int64_t N = q.size(0), H = q.size(1), hd = q.size(2), Hkv = k.size(1), L = k_cache.size(2);
  const int64_t group = H / Hkv;
  const int64_t* m = meta.data_ptr<int64_t>();
  auto* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  auto* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const auto* kn = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vn = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const int64_t slot_stride = Hkv * L * hd, head_stride = L * hd;
  int64_t longest = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t s = m[2 * i], p = m[2 * i + 1];
    TORCH_CHECK(s >= 0 && s < k_cache.size(0) && p >= 0 && p < L, "attend_tokens: slot or position out of range");
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(kc + s * slot_stride + h * head_stride + p * hd, kn + (i * Hkv + h) * hd, hd * sizeof(uint16_t));
      std::memcpy(vc + s * slot_stride + h * head_stride + p * hd, vn + (i * Hkv + h) * hd, hd * sizeof(uint16_t));
    }
    longest = std::max(longest, p + 1);
  }
  auto out = at::empty_like(q);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, N * H, GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(longest), qf(hd), of(hd);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / H, h = t % H;
      const int64_t s = m[2 * i], p = m[2 * i + 1];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p + 1 - window) : 0;
      for (int64_t d = 0; d < hd; ++d) qf[d] = bf16_to_float(qp[t * hd + d]);
      const int64_t base = s * slot_stride + (h / group) * head_stride + lo * hd;
      attend_one(qf.data(), kc + base, vc + base, p + 1 - lo, hd, hd, sc, cap, scores.data(), of.data());
      for (int64_t d = 0; d < hd; ++d) op[t * hd + d] = float_to_bf16(of[d]);
    }
  });
  return out;
}

TORCH_LIBRARY(specdec_attention, m) {
  m.def("attend_tokens(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor meta, "
        "int window, float scale, float softcap) -> Tensor");
  m.impl("attend_tokens", torch::kCPU, &attend_tokens);
}
