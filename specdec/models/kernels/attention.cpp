// Attention of a token pass (specdec/models/token_pass.py): each of N query tokens attends over
// its own slot's cached keys up to its own position, alone. One (token, head) pair is one task,
// computed by the same code whatever N is and whichever thread runs it, so a token's output never
// depends on the other tokens of its pass: the batch invariance speculation needs in bfloat16,
// for the cost of one call per layer rather than one per token.
//
// Token trees: a token's keys and values are written at its cache row, which is its position
// except in a draft tree, whose nodes share positions (siblings) and so take rows after the
// sequence's. A token's parent (an earlier token of the pass, or -1) says where its ancestors'
// keys lie: position j < p reads row j up to the first ancestor with no parent, and the rows of
// its ancestors above that. Keys are summed by position, never by row, so a node's result is the
// bits the same tokens give as a plain sequence.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
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



#if defined(__AVX512F__)
// ---- runs: a sequence's consecutive tokens share each key's load and conversion ----
//
// A verify pass's K + 1 tokens all read the same keys; a task takes a run of up to RUN tokens of one
// slot with one key/value head's G query heads and reads each key block once for all of them. Each
// query's arithmetic stays its own: keys in blocks of 16 aligned to absolute positions (a key's
// partial sums always sit in the same lanes and go through the same reduction tree), its softmax
// over exactly its own keys, its output summed over its keys in ascending order. So a token's
// result is the same bits alone or in a run of any length.

constexpr int64_t RUN = 8;     // tokens per task: a verify pass's K + 1, prefill in chunks
constexpr int64_t BLOCK = 16;  // keys per block

// a[0..15]: 16 vectors of partial sums -> lane j holds the sum of a[j]'s lanes, by one fixed tree
inline __m512 sum16(__m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

struct Run {  // what one task reads and writes
  const float* q;        // [Q][hd] fp32 queries, Q = T * G (token-major)
  const int64_t* lo;     // [T] first key each token sees
  const int64_t* hi;     // [T] one past its last key
  const uint16_t *k, *v;  // this slot and head's keys/values [L][hd]
  int64_t T, G, hd, L;
  float scale, softcap;
  const int64_t* rows;   // rows[j - rows_from]: the row holding position j >= rows_from (a tree's)
  int64_t rows_from, rows_len;
  int64_t row(int64_t j) const { return j >= rows_from && j < rows_from + rows_len ? rows[j - rows_from] : j; }
};

// keys/values at positions base .. base + 16 of [L][hd] bf16 -> fp32 [16][hd], positions past L zero
inline void widen_block(const Run& R, const uint16_t* src, int64_t base, float* dst) {
  const int64_t hd = R.hd;
  for (int64_t j = 0; j < BLOCK; ++j) {
    float* d = dst + j * hd;
    if (base + j >= R.L) {
      std::memset(d, 0, hd * sizeof(float));
      continue;
    }
    const uint16_t* s = src + R.row(base + j) * hd;
    for (int64_t c = 0; c < hd; c += 16) _mm512_storeu_ps(d + c, load16(s + c));
  }
}

// scores[r][j - base] for every query r and every key j of the blocks it sees; NV = hd / 16
template <int NV>
void score_run(const Run& R, int64_t base, int64_t end, float* kf, float* scores, int64_t span) {
  for (int64_t b0 = base; b0 < end; b0 += BLOCK) {
    widen_block(R, R.k, b0, kf);
    for (int64_t r = 0; r < R.T * R.G; ++r) {
      const int64_t t = r / R.G;
      if (R.hi[t] <= b0 || R.lo[t] >= b0 + BLOCK) continue;
      __m512 q[NV], acc[BLOCK];
      for (int c = 0; c < NV; ++c) q[c] = _mm512_loadu_ps(R.q + r * NV * 16 + c * 16);
      for (int j = 0; j < BLOCK; ++j) {
        acc[j] = _mm512_mul_ps(q[0], _mm512_loadu_ps(kf + j * NV * 16));
        for (int c = 1; c < NV; ++c) acc[j] = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(kf + j * NV * 16 + c * 16), acc[j]);
      }
      float* out = scores + r * span + (b0 - base);
      _mm512_storeu_ps(out, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(R.scale)));
      if (R.softcap > 0.f)
        for (int64_t j = 0; j < BLOCK; ++j) out[j] = std::tanh(out[j] / R.softcap) * R.softcap;
    }
  }
}

// o[h] += p[h][j] v[j] for j = j0 .. j1 - 1, h < heads (1 or 2): two heads at once keep twice the
// independent sums in flight; each head's sum runs over the keys in the same order either way
template <int NV>
inline void weigh_block(const float* vf, const float* p, int64_t span, int64_t j0, int64_t j1, int heads, float* o) {
  __m512 a[NV], a2[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm512_loadu_ps(o + c * 16), a2[c] = _mm512_loadu_ps(o + (heads - 1) * NV * 16 + c * 16);
  const float* p2 = p + (heads - 1) * span;
  for (int64_t j = j0; j < j1; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]), pj2 = _mm512_set1_ps(p2[j]);
    for (int c = 0; c < NV; ++c) {
      const __m512 vj = _mm512_loadu_ps(vf + j * NV * 16 + c * 16);
      a[c] = _mm512_fmadd_ps(pj, vj, a[c]);
      a2[c] = _mm512_fmadd_ps(pj2, vj, a2[c]);
    }
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + (heads - 1) * NV * 16 + c * 16, a2[c]);
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + c * 16, a[c]);
}

// out[r] = inv[r] * sum of p[r][j] v[j] over each query's keys, in ascending order
template <int NV>
void weigh_run(const Run& R, int64_t base, int64_t end, float* vf, const float* scores, int64_t span,
               const float* inv, float* out) {
  const int64_t Q = R.T * R.G;
  for (int64_t i = 0; i < Q * NV * 16; ++i) out[i] = 0.f;
  for (int64_t b0 = base; b0 < end; b0 += BLOCK) {
    widen_block(R, R.v, b0, vf);
    for (int64_t r = 0, heads; r < Q; r += heads) {
      const int64_t t = r / R.G;
      heads = r + 1 < Q && (r + 1) / R.G == t ? 2 : 1;  // a pair sees the same keys: one token's heads
      const int64_t j0 = std::max(R.lo[t], b0) - b0, j1 = std::min(R.hi[t], b0 + BLOCK) - b0;
      if (j0 < j1)
        weigh_block<NV>(vf, scores + r * span + (b0 - base), span, j0, j1, static_cast<int>(heads), out + r * NV * 16);
    }
  }
  for (int64_t r = 0; r < Q; ++r) {
    const __m512 s = _mm512_set1_ps(inv[r]);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + r * NV * 16 + c * 16, _mm512_mul_ps(_mm512_loadu_ps(out + r * NV * 16 + c * 16), s));
  }
}

// the run's attention: out [Q][hd] fp32
template <int NV>
void attend_run(const Run& R, std::vector<float>& buf, float* out) {
  const int64_t Q = R.T * R.G;
  int64_t base = R.lo[0], end = R.hi[0];
  for (int64_t t = 1; t < R.T; ++t) base = std::min(base, R.lo[t]), end = std::max(end, R.hi[t]);
  base -= base % BLOCK;
  const int64_t span = (end - base + BLOCK - 1) / BLOCK * BLOCK;
  buf.resize(BLOCK * R.hd + Q * span + Q);
  float *kf = buf.data(), *scores = kf + BLOCK * R.hd, *inv = scores + Q * span;
  score_run<NV>(R, base, end, kf, scores, span);
  for (int64_t r = 0; r < Q; ++r) {
    const int64_t t = r / R.G;
    float* s = scores + r * span + (R.lo[t] - base);
    const int64_t n = R.hi[t] - R.lo[t];
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
    inv[r] = 1.f / exp_shifted(s, n, mx);
  }
  weigh_run<NV>(R, base, end, kf, scores, span, inv, out);
}
#endif

}  // namespace

namespace {

struct Pass {  // one call's shapes and pointers
  const uint16_t *q, *kc, *vc;
  uint16_t* out;
  const int64_t* meta;  // [N][4] (slot, position, row, parent)
  int64_t N, H, Hkv, G, hd, L, window;
  float scale, softcap;
  bool tree;  // some token's row is not its position
  int64_t slot(int64_t i) const { return meta[4 * i]; }
  int64_t pos(int64_t i) const { return meta[4 * i + 1]; }
  int64_t row(int64_t i) const { return meta[4 * i + 2]; }
  int64_t parent(int64_t i) const { return meta[4 * i + 3]; }
  int64_t base(int64_t i, int64_t g) const { return (slot(i) * Hkv + g) * L * hd; }  // slot i's head g
  int64_t lo(int64_t i) const { return window > 0 ? std::max<int64_t>(0, pos(i) + 1 - window) : 0; }
  // the rows of token i's path, by position from *from (empty: every position is its own row)
  void path_rows(int64_t i, std::vector<int64_t>& rows, int64_t* from) const {
    rows.clear();
    if (!tree) return;
    bool moved = false;
    for (int64_t a = i; a >= 0; a = parent(a)) rows.push_back(row(a)), moved |= row(a) != pos(a), *from = pos(a);
    if (!moved) rows.clear();
    std::reverse(rows.begin(), rows.end());
  }
};

// token i's query heads of key/value head g -> fp32 [G][hd]
inline void widen_queries(const Pass& P, int64_t i, int64_t g, float* dst) {
  const uint16_t* qi = P.q + (i * P.H + g * P.G) * P.hd;
  for (int64_t d = 0; d < P.G * P.hd; ++d) dst[d] = bf16_to_float(qi[d]);
}

inline void narrow_out(const Pass& P, int64_t i, int64_t g, const float* src) {
  uint16_t* oi = P.out + (i * P.H + g * P.G) * P.hd;
  for (int64_t d = 0; d < P.G * P.hd; ++d) oi[d] = float_to_bf16(src[d]);
}

// one task per (token, key/value head): any ISA
void attend_per_token(const Pass& P, int64_t longest) {
  at::parallel_for(0, P.N * P.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(P.G * longest), qf(P.G * P.hd), of(P.G * P.hd);
    std::vector<uint16_t> kg, vg;  // a tree node's keys/values gathered by position
    std::vector<int64_t> rows;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / P.Hkv, g = t % P.Hkv, lo = P.lo(i), n = P.pos(i) + 1 - lo;
      widen_queries(P, i, g, qf.data());
      const int64_t b = P.base(i, g);
      const uint16_t *k = P.kc + b + lo * P.hd, *v = P.vc + b + lo * P.hd;
      int64_t from = 0;
      P.path_rows(i, rows, &from);
      if (!rows.empty()) {
        kg.resize(n * P.hd), vg.resize(n * P.hd);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t p = lo + j, r = p >= from ? rows[p - from] : p;
          std::memcpy(&kg[j * P.hd], P.kc + b + r * P.hd, P.hd * sizeof(uint16_t));
          std::memcpy(&vg[j * P.hd], P.vc + b + r * P.hd, P.hd * sizeof(uint16_t));
        }
        k = kg.data(), v = vg.data();
      }
      attend_group(qf.data(), P.G, k, v, n, P.hd, P.scale, P.softcap, scores.data(), of.data());
      narrow_out(P, i, g, of.data());
    }
  });
}

#if defined(__AVX512F__)
// one task per (run of a slot's consecutive tokens, key/value head): a run is a chain, each token
// the child of the one before, so all of its tokens read the same row at each position
void attend_by_runs(const Pass& P) {
  std::vector<int64_t> starts;  // run r: tokens starts[r] .. starts[r + 1]
  for (int64_t i = 0; i < P.N; ++i)
    if (i == 0 || P.parent(i) != i - 1 || i - starts.back() == RUN) starts.push_back(i);
  starts.push_back(P.N);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
  std::vector<std::vector<int64_t>> rows(runs);  // each run's path rows, from its last token
  std::vector<int64_t> rows_from(runs, 0);
  for (int64_t r = 0; r < runs; ++r) P.path_rows(starts[r + 1] - 1, rows[r], &rows_from[r]);
  at::parallel_for(0, runs * P.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf, qf(RUN * P.G * P.hd), of(RUN * P.G * P.hd);
    int64_t lo[RUN], hi[RUN];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / P.Hkv, g = task % P.Hkv, i0 = starts[r], T = starts[r + 1] - i0;
      for (int64_t t = 0; t < T; ++t) {
        lo[t] = P.lo(i0 + t), hi[t] = P.pos(i0 + t) + 1;
        widen_queries(P, i0 + t, g, qf.data() + t * P.G * P.hd);
      }
      const Run R{qf.data(), lo, hi, P.kc + P.base(i0, g), P.vc + P.base(i0, g), T, P.G, P.hd, P.L, P.scale, P.softcap,
                  rows[r].data(), rows_from[r], static_cast<int64_t>(rows[r].size())};
      switch (P.hd) {
        case 64: attend_run<4>(R, buf, of.data()); break;
        case 96: attend_run<6>(R, buf, of.data()); break;
        case 128: attend_run<8>(R, buf, of.data()); break;
        default: attend_run<16>(R, buf, of.data()); break;
      }
      for (int64_t t = 0; t < T; ++t) narrow_out(P, i0 + t, g, of.data() + t * P.G * P.hd);
    }
  });
}
#endif

// write the pass's keys and values at their (slot, row); returns the longest context
int64_t write_caches(const Pass& P, const uint16_t* kn, const uint16_t* vn, uint16_t* kc, uint16_t* vc, int64_t slots) {
  int64_t longest = 0;
  for (int64_t i = 0; i < P.N; ++i) {
    const int64_t s = P.slot(i), p = P.pos(i), row = P.row(i), a = P.parent(i);
    TORCH_CHECK(s >= 0 && s < slots && p >= 0 && row >= p && row < P.L, "attend_tokens: slot, position or row out of range");
    TORCH_CHECK(a < i && (a < 0 || (P.slot(a) == s && P.pos(a) == p - 1)), "attend_tokens: a parent is an earlier token one position before");
    for (int64_t g = 0; g < P.Hkv; ++g) {
      std::memcpy(kc + P.base(i, g) + row * P.hd, kn + (i * P.Hkv + g) * P.hd, P.hd * sizeof(uint16_t));
      std::memcpy(vc + P.base(i, g) + row * P.hd, vn + (i * P.Hkv + g) * P.hd, P.hd * sizeof(uint16_t));
    }
    longest = std::max(longest, p + 1);
  }
  return longest;
}

}  // namespace

inline const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

// q [N, H, hd], k/v [N, Hkv, hd] (this pass's keys and values, written into the caches first),
// k_cache/v_cache [slots, Hkv, L, hd], meta [N, 4] int64 (slot, position, row, parent). All bfloat16 but meta.
at::Tensor attend_tokens(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor meta, int64_t window, double scale, double softcap) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "attend_tokens runs on bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attend_tokens needs contiguous caches");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  meta = meta.to(at::kLong).contiguous();
  TORCH_CHECK(meta.dim() == 2 && meta.size(1) == 4, "attend_tokens: meta is [N, 4] (slot, position, row, parent)");
  auto out = at::empty_like(q);
  auto* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  auto* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int64_t H = q.size(1), Hkv = k.size(1);
  Pass P{bits(q), kc, vc, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), meta.data_ptr<int64_t>(),
               q.size(0), H, Hkv, H / Hkv, q.size(2), k_cache.size(2), window, static_cast<float>(scale),
               static_cast<float>(softcap), false};
  for (int64_t i = 0; i < P.N && !P.tree; ++i) P.tree = P.row(i) != P.pos(i);
  const int64_t longest = write_caches(P, bits(k), bits(v), kc, vc, k_cache.size(0));
  // always across the thread team, even for one token: run inline, a small call left the team's
  // threads to fall asleep, and waking them for the next matmul cost a 1-token pass ~3 ms here
#if defined(__AVX512F__)
  if (P.hd == 64 || P.hd == 96 || P.hd == 128 || P.hd == 256) {  // the head sizes of the families served
    attend_by_runs(P);
    return out;
  }
#endif
  attend_per_token(P, longest);
  return out;
}

TORCH_LIBRARY(specdec_attention, m) {
  m.def("attend_tokens(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor meta, "
        "int window, float scale, float softcap) -> Tensor");
  m.impl("attend_tokens", torch::kCPU, &attend_tokens);
}
