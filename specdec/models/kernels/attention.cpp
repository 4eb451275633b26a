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

// G query heads q [G][hd] that share one key/value head (GQA), over keys/values [n, hd] ->
// out [G][hd]; scores [G][n] scratch. Each head's arithmetic is attend_one's, op for op; the keys
// and values are only loaded and widened once for all G.
void attend_group(const float* q, int64_t G, const uint16_t* k, const uint16_t* v, int64_t n, int64_t hd,
                  float scale, float softcap, float* scores, float* out) {
#if defined(__AVX512F__)
  if (hd % 16 == 0 && hd <= 256) {
    const int64_t nv = hd / 16;
    __m512 w[16];
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < nv; ++c) w[c] = load16(k + j * hd + c * 16);
      for (int64_t h = 0; h < G; ++h) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < nv; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * hd + c * 16), w[c], acc);
        float sc = _mm512_reduce_add_ps(acc) * scale;
        if (softcap > 0.f) sc = std::tanh(sc / softcap) * softcap;
        scores[h * n + j] = sc;
      }
    }
    std::vector<float> inv(G);
    for (int64_t h = 0; h < G; ++h) {
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) mx = scores[h * n + j] > mx ? scores[h * n + j] : mx;
      inv[h] = 1.f / exp_shifted(scores + h * n, n, mx);
      for (int64_t d = 0; d < hd; ++d) out[h * hd + d] = 0.f;
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < nv; ++c) w[c] = load16(v + j * hd + c * 16);
      for (int64_t h = 0; h < G; ++h) {
        const __m512 p = _mm512_set1_ps(scores[h * n + j]);
        float* o = out + h * hd;
        for (int64_t c = 0; c < nv; ++c)
          _mm512_storeu_ps(o + c * 16, _mm512_fmadd_ps(p, w[c], _mm512_loadu_ps(o + c * 16)));
      }
    }
    for (int64_t h = 0; h < G; ++h)
      for (int64_t d = 0; d < hd; ++d) out[h * hd + d] *= inv[h];
    return;
  }
#endif
  for (int64_t h = 0; h < G; ++h) attend_one(q + h * hd, k, v, n, hd, hd, scale, softcap, scores, out + h * hd);
}


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
  auto tasks = [&](int64_t begin, int64_t end) {  // task t: token t / Hkv, key/value head t % Hkv
    std::vector<float> scores(group * longest), qf(group * hd), of(group * hd);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / Hkv, g = t % Hkv;
      const int64_t s = m[2 * i], p = m[2 * i + 1];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p + 1 - window) : 0;
      const uint16_t* qi = qp + (i * H + g * group) * hd;  // this token's query heads g * group ..
      for (int64_t d = 0; d < group * hd; ++d) qf[d] = bf16_to_float(qi[d]);
      const int64_t base = s * slot_stride + g * head_stride + lo * hd;
      attend_group(qf.data(), group, kc + base, vc + base, p + 1 - lo, hd, sc, cap, scores.data(), of.data());
      uint16_t* oi = op + (i * H + g * group) * hd;
      for (int64_t d = 0; d < group * hd; ++d) oi[d] = float_to_bf16(of[d]);
    }
  };
  // always across the thread team, even for one token: run inline, a small call left the team's
  // threads to fall asleep, and waking them for the next matmul cost a 1-token pass ~3 ms here
  at::parallel_for(0, N * Hkv, 1, tasks);
  return out;
}

TORCH_LIBRARY(specdec_attention, m) {
  m.def("attend_tokens(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor meta, "
        "int window, float scale, float softcap) -> Tensor");
  m.impl("attend_tokens", torch::kCPU, &attend_tokens);
}
