// Attention of a token pass (specdec/models/token_pass.py): each of N query tokens attends over
// its own slot's cached keys up to its own position, alone. A query's arithmetic is fixed by its own
// keys and positions (key blocks and chunks at absolute positions, partial sums merged in chunk
// order), never by which tokens share its task or pass, so its output is the same bits in any pass:
// the batch invariance speculation needs in bfloat16, for the cost of one call per layer.
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
#include <atomic>
#include <string>
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

// ---- 16 float lanes: one AVX-512 register, or two AVX2 ones ----
// The runs below are written once over `vf`. Each op acts lane by lane, and the cross-lane sums
// (sum16, vsum) take the same tree on both, so AVX2 gives the bits AVX-512 gives.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ATT_VEC 1
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
using vf = __m512;
inline vf load16(const uint16_t* p) {  // 16 bfloat16 -> 16 float
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c, rounded once
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p 2^n for whole n
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float vmax_of(vf x) { return _mm512_reduce_max_ps(x); }
#elif defined(ATT_VEC)
struct vf {
  __m256 lo, hi;  // lanes 0-7 and 8-15
};
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vf load16(const uint16_t* p) { return {load8(p), load8(p + 8)}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x.lo), _mm256_storeu_ps(p + 8, x.hi); }
inline vf vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vfma(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf vround(vf x) {
  return {_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// p 2^n for whole n in [-126, 127] (exp16's range): 2^n is exact from its exponent bits, so the
// product rounds as AVX-512's scalef does
inline __m256 scale8(__m256 p, __m256 n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline vf vscale2(vf p, vf n) { return {scale8(p.lo, n.lo), scale8(p.hi, n.hi)}; }
inline float vsum(vf x) {  // AVX-512's reduce_add, step by step: halves, quarters, pairs, lanes
  const __m256 h = _mm256_add_ps(x.hi, x.lo);
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  const __m128 r = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(r) + _mm_cvtss_f32(_mm_shuffle_ps(r, r, 1));
}
inline float vmax_of(vf x) {  // exact in any order
  const __m256 h = _mm256_max_ps(x.lo, x.hi);
  __m128 q = _mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  q = _mm_max_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(q), _mm_cvtss_f32(_mm_shuffle_ps(q, q, 1)));
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

#if defined(ATT_VEC)
// e^x for 16 lanes: 2^(n + f) with n = round(x log2 e), 2^f by a degree-6 polynomial (relative
// error ~2e-7, as good as expf for a softmax); a vector of these costs what one scalar expf does.
inline vf exp16(vf x) {
  x = vmax(x, vset1(-87.f));
  const vf t = vmul(x, vset1(1.44269504088896341f));
  const vf n = vround(t);
  const vf f = vsub(t, n);  // in [-0.5, 0.5]
  vf p = vset1(1.535336188319500e-4f);
  p = vfma(p, f, vset1(1.339887440266574e-3f));
  p = vfma(p, f, vset1(9.618437357674640e-3f));
  p = vfma(p, f, vset1(5.550332471162809e-2f));
  p = vfma(p, f, vset1(2.402264791363012e-1f));
  p = vfma(p, f, vset1(6.931472028550421e-1f));
  p = vfma(p, f, vset1(1.f));
  return vscale2(p, n);
}
#endif

// the largest of x[0 .. n): exact in any order, so taken 16 at a time
inline float max_of(const float* x, int64_t n) {
  int64_t j = 0;
  float mx = -INFINITY;
#if defined(ATT_VEC)
  vf acc = vset1(-INFINITY);
  for (; j + 16 <= n; j += 16) acc = vmax(acc, vload(x + j));
  mx = vmax_of(acc);
#endif
  for (; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

// scores[j] = e^(scores[j] - mx) for j < n; returns their sum (in a fixed order).
inline float exp_shifted(float* scores, int64_t n, float mx) {
  int64_t j = 0;
  float sum = 0.f;
#if defined(ATT_VEC)
  const vf m = vset1(mx);
  vf acc = vset1(0.f);
  for (; j + 16 <= n; j += 16) {
    const vf e = exp16(vsub(vload(scores + j), m));
    vstore(scores + j, e);
    acc = vadd(acc, e);
  }
  sum = vsum(acc);
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



#if defined(ATT_VEC)
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
constexpr int64_t SPAN = 128;  // keys per task: a long context spreads over the threads

// a[0..15]: 16 vectors of partial sums -> lane j holds the sum of a[j]'s lanes, by one fixed tree
#if defined(__AVX512F__)
inline vf sum16(vf* a) {
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
#else
// The same tree on halves: the unpacks act within 128-bit quarters on both, and AVX-512's
// shuffles of quarters become permutes of the halves' quarters.
inline __m256 add_quarters(__m256 lo, __m256 hi) {  // 16 lanes in quarters q0..q3 -> [q0 + q1, q2 + q3]
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
inline __m256 add_pairs(__m256 x, __m256 y) {
  const __m256d u = _mm256_castps_pd(x), v = _mm256_castps_pd(y);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(u, v)), _mm256_castpd_ps(_mm256_unpackhi_pd(u, v)));
}
inline vf sum16(vf* a) {
  vf b[8], c[4];
  for (int i = 0; i < 8; ++i) {
    const vf &x = a[2 * i], &y = a[2 * i + 1];
    b[i] = {_mm256_add_ps(_mm256_unpacklo_ps(x.lo, y.lo), _mm256_unpackhi_ps(x.lo, y.lo)),
            _mm256_add_ps(_mm256_unpacklo_ps(x.hi, y.hi), _mm256_unpackhi_ps(x.hi, y.hi))};
  }
  for (int i = 0; i < 4; ++i) c[i] = {add_pairs(b[2 * i].lo, b[2 * i + 1].lo), add_pairs(b[2 * i].hi, b[2 * i + 1].hi)};
  const vf e0 = {add_quarters(c[0].lo, c[0].hi), add_quarters(c[1].lo, c[1].hi)};
  const vf e1 = {add_quarters(c[2].lo, c[2].hi), add_quarters(c[3].lo, c[3].hi)};
  return {add_quarters(e0.lo, e0.hi), add_quarters(e1.lo, e1.hi)};
}
#endif

struct Run {  // what one task reads and writes
  const float* q;        // [Q][hd] fp32 queries, Q = T * G (token-major)
  const int64_t* lo;     // [T] first key each token sees
  const int64_t* hi;     // [T] one past its last key
  const uint16_t *k, *v;  // this slot and head's keys/values [L][hd]
  int64_t T, G, hd, L;
  float scale, softcap;
  const int64_t* rows;   // rows[j - rows_from]: the row holding position j >= rows_from (a tree's)
  int64_t rows_from, rows_len;
  const uint16_t* qb;    // the queries packed for the tile unit (pack_queries), or null: none here
  int64_t row(int64_t j) const { return j >= rows_from && j < rows_from + rows_len ? rows[j - rows_from] : j; }
};

// How far ahead of the block being widened a run asks for keys or values. The hardware
// prefetcher alone left a long context's cache reads short of the machine's bandwidth: asking
// 4 KB ahead took a 1-token pass after 1500 tokens from 4.26 to 3.95 ms and after 3000 from
// 6.45 to 5.75 ms, a 5-token pass from 8.05 to 7.52 and 13.1 to 12.1 ms (after 200: 2.89 to
// 2.84; 8 or 16 KB ahead gained no more; by hand, AVX-512).
constexpr int64_t KV_PREFETCH_BYTES = 4096;

// keys/values at positions base .. base + 16 of [L][hd] bf16 -> fp32 [16][hd], positions past L zero
inline void widen_block(const Run& R, const uint16_t* src, int64_t base, float* dst) {
  const int64_t hd = R.hd;
  // the rows KV_PREFETCH_BYTES on, by position (a tree's own rows lie after its sequence's anyway)
  for (int64_t j = base + KV_PREFETCH_BYTES / (2 * hd), end = std::min(j + BLOCK, R.L); j < end; ++j)
    for (int64_t o = 0; o < 2 * hd; o += 64) _mm_prefetch(reinterpret_cast<const char*>(src + j * hd) + o, _MM_HINT_T0);
  for (int64_t j = 0; j < BLOCK; ++j) {
    float* d = dst + j * hd;
    if (base + j >= R.L) {
      std::memset(d, 0, hd * sizeof(float));
      continue;
    }
    const uint16_t* s = src + R.row(base + j) * hd;
    for (int64_t c = 0; c < hd; c += 16) vstore(d + c, load16(s + c));
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
      vf q[NV], acc[BLOCK];
      for (int c = 0; c < NV; ++c) q[c] = vload(R.q + r * NV * 16 + c * 16);
      for (int j = 0; j < BLOCK; ++j) {
        acc[j] = vmul(q[0], vload(kf + j * NV * 16));
        for (int c = 1; c < NV; ++c) acc[j] = vfma(q[c], vload(kf + j * NV * 16 + c * 16), acc[j]);
      }
      float* out = scores + r * span + (b0 - base);
      vstore(out, vmul(sum16(acc), vset1(R.scale)));
      if (R.softcap > 0.f)
        for (int64_t j = 0; j < BLOCK; ++j) out[j] = std::tanh(out[j] / R.softcap) * R.softcap;
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define ATT_AMX 1
}  // namespace
#include <sys/syscall.h>
#include <unistd.h>
namespace {

// ---- AMX-BF16 for the scores: 16 keys x 16 queries x 32 dimensions in one instruction ----
// Each score is its own key row times its own query column, summed by the tile unit in one fixed
// way whatever the other rows and columns hold, so a token keeps its bits alone or in a run.

constexpr int QMAX_AMX = 64;  // queries a run may have here: four result tiles of 16

bool tiles_granted() {  // Linux hands out the tile state only on request, once per process
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

struct ScoreTiles {  // palette 1: tmm0-3 scores [16 keys][16 queries] fp32, tmm4 keys, tmm5 queries
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  ScoreTiles() {
    for (int t = 0; t < 6; ++t) rows[t] = 16, colsb[t] = 64;
  }
};

std::atomic<bool> tiles_allowed{true};  // attend_allow_tiles: tests compare both paths

bool use_tiles(int64_t queries, int64_t hd) {
  return tiles_allowed.load(std::memory_order_relaxed) && queries <= QMAX_AMX && hd % 32 == 0 && hd <= 256 && tiles_granted();
}
void tiles_on() {
  const ScoreTiles cfg;
  _tile_loadconfig(&cfg);
}
void tiles_off() { _tile_release(); }

// queries [Q][hd] fp32 (bfloat16 values) -> qb [groups of 16][hd / 32][16 dimension pairs][16 queries x 2]:
// a query's 32 dimensions become one column of a tile, a pair of them per row
void pack_queries(const float* q, int64_t Q, int64_t hd, uint16_t* qb) {
  const int64_t groups = (Q + 15) / 16, nc = hd / 32;
  std::memset(qb, 0, groups * nc * 512 * sizeof(uint16_t));
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(64));
  for (int64_t r = 0; r < Q; ++r)
    for (int64_t c = 0; c < nc; ++c) {
      const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + r * hd + c * 32 + 16),
                                                         _mm512_loadu_ps(q + r * hd + c * 32));
      _mm512_i32scatter_epi32(qb + (r / 16 * nc + c) * 512 + (r % 16) * 2, rows, pairs, 1);
    }
}

// scores[r][j - base] for every query r and key j of the blocks [base, end); false where the tile
// unit is missing or the run has more queries than four tiles hold (then score_run does it)
bool score_run_amx(const Run& R, int64_t base, int64_t end, float* scores, int64_t span) {
  const int64_t Q = R.T * R.G, hd = R.hd, nc = hd / 32, groups = (Q + 15) / 16;
  if (R.qb == nullptr) return false;
  const uint16_t* qb = R.qb;
  alignas(64) uint16_t kb[BLOCK * 256];
  alignas(64) float cb[QMAX_AMX / 16][BLOCK * 16];
  for (int64_t b0 = base; b0 < end; b0 += BLOCK) {
    const uint16_t* kp = R.k + b0 * hd;  // the block's keys in place, unless a tree's rows or the cache's end intervene
    const bool plain = b0 + BLOCK <= R.L && (b0 + BLOCK <= R.rows_from || b0 >= R.rows_from + R.rows_len);
    if (!plain) {
      for (int64_t j = 0; j < BLOCK; ++j) {
        if (b0 + j >= R.L) std::memset(kb + j * hd, 0, hd * sizeof(uint16_t));
        else std::memcpy(kb + j * hd, R.k + R.row(b0 + j) * hd, hd * sizeof(uint16_t));
      }
      kp = kb;
    }
#define ATT_SCORE_GROUP(C)                                            \
  if ((C) < groups) {                                                 \
    _tile_zero(C);                                                    \
    for (int64_t c = 0; c < nc; ++c) {                                \
      _tile_loadd(4, kp + c * 32, hd * sizeof(uint16_t));             \
      _tile_loadd(5, qb + ((C) * nc + c) * 512, 64);                  \
      _tile_dpbf16ps(C, 4, 5);                                        \
    }                                                                 \
    _tile_stored(C, cb[C], 64);                                       \
  }
    ATT_SCORE_GROUP(0) ATT_SCORE_GROUP(1) ATT_SCORE_GROUP(2) ATT_SCORE_GROUP(3)
#undef ATT_SCORE_GROUP
    for (int64_t r = 0; r < Q; ++r) {
      const int64_t t = r / R.G;
      if (R.hi[t] <= b0 || R.lo[t] >= b0 + BLOCK) continue;
      float* out = scores + r * span + (b0 - base);
      const float* col = cb[r / 16] + r % 16;
      for (int64_t j = 0; j < BLOCK; ++j) out[j] = col[j * 16] * R.scale;
      if (R.softcap > 0.f)
        for (int64_t j = 0; j < BLOCK; ++j) out[j] = std::tanh(out[j] / R.softcap) * R.softcap;
    }
  }
  return true;
}

// values [32 keys from position j0][hd] -> vb [hd / 16][16 key pairs][16 dimensions x 2], as the
// tile unit's second operand wants them; positions past L are zero
void pack_values(const Run& R, int64_t j0, uint16_t* vb) {
  const int64_t hd = R.hd, nt = hd / 16;
  alignas(64) static const uint16_t order[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(order);  // keys a and b of a pair, dimension by dimension
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t p = 0; p < 16; ++p) {
    const int64_t ja = j0 + 2 * p, jb = ja + 1;
    const uint16_t *va = ja < R.L ? R.v + R.row(ja) * hd : nullptr, *vb2 = jb < R.L ? R.v + R.row(jb) * hd : nullptr;
    for (int64_t h = 0; h < hd / 32; ++h) {
      const __m512i a = va ? _mm512_loadu_si512(va + h * 32) : _mm512_setzero_si512();
      const __m512i b = vb2 ? _mm512_loadu_si512(vb2 + h * 32) : _mm512_setzero_si512();
      _mm512_storeu_si512(vb + ((2 * h) * 16 + p) * 32, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(vb + ((2 * h + 1) * 16 + p) * 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// out[r] = sum of p[r][j] v[j] over each query's keys, on the tile unit: p rounded to bfloat16, as
// flash attention does on GPUs, the sums in fp32, 32 keys at a time from a multiple of 32 (base)
bool weigh_run_amx(const Run& R, int64_t base, int64_t end, const float* scores, int64_t span, float* out) {
  const int64_t Q = R.T * R.G, hd = R.hd, nt = hd / 16, steps = (end - base + 31) / 32, groups = (Q + 15) / 16;
  if (R.qb == nullptr || hd % 32 != 0 || base % 32 != 0 || steps * 32 > span) return false;
  thread_local std::vector<uint16_t> vbuf, pbuf;
  vbuf.resize(steps * nt * 512);
  pbuf.resize(groups * steps * 512);
  for (int64_t st = 0; st < steps; ++st) pack_values(R, base + 32 * st, vbuf.data() + st * nt * 512);
  std::fill(pbuf.begin(), pbuf.end(), 0);
  for (int64_t r = 0; r < Q; ++r) {  // each query's weights over exactly its keys, zero elsewhere
    const int64_t t = r / R.G, a = R.lo[t] - base, b = R.hi[t] - base;
    for (int64_t st = 0; st < steps; ++st) {
      const int64_t k0 = 32 * st;
      if (b <= k0 || a >= k0 + 32) continue;
      const uint32_t keep = (b - k0 >= 32 ? 0xffffffffu : (1u << (b - k0)) - 1u) & (a <= k0 ? 0xffffffffu : ~((1u << (a - k0)) - 1u));
      const __m512 w0 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep), scores + r * span + k0);
      const __m512 w1 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep >> 16), scores + r * span + k0 + 16);
      _mm512_storeu_si512(pbuf.data() + ((r / 16) * steps + st) * 512 + (r % 16) * 32, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
  }
  alignas(64) float cb[4][256];
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t d0 = 0; d0 < nt; d0 += 4) {  // up to four result tiles of 16 dimensions at a time
      const int64_t n = std::min<int64_t>(4, nt - d0);
#define ATT_WEIGH_TILE(C)                                                      \
  if ((C) < n) {                                                               \
    _tile_loadd(5, vbuf.data() + (st * nt + d0 + (C)) * 512, 64);              \
    _tile_dpbf16ps(C, 4, 5);                                                   \
  }
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t st = 0; st < steps; ++st) {
        _tile_loadd(4, pbuf.data() + (g * steps + st) * 512, 64);
        ATT_WEIGH_TILE(0) ATT_WEIGH_TILE(1) ATT_WEIGH_TILE(2) ATT_WEIGH_TILE(3)
      }
#undef ATT_WEIGH_TILE
      _tile_stored(0, cb[0], 64); _tile_stored(1, cb[1], 64); _tile_stored(2, cb[2], 64); _tile_stored(3, cb[3], 64);
      for (int64_t qi = 0; qi < 16 && g * 16 + qi < Q; ++qi)
        for (int64_t c = 0; c < n; ++c)
          std::memcpy(out + (g * 16 + qi) * hd + (d0 + c) * 16, cb[c] + qi * 16, 16 * sizeof(float));
    }
  return true;
}
#else
bool use_tiles(int64_t, int64_t) { return false; }
void pack_queries(const float*, int64_t, int64_t, uint16_t*) {}
void tiles_on() {}
void tiles_off() {}
bool score_run_amx(const Run&, int64_t, int64_t, float*, int64_t) { return false; }
bool weigh_run_amx(const Run&, int64_t, int64_t, const float*, int64_t, float*) { return false; }
#endif

// o[h] += p[h][j] v[j] for j = j0 .. j1 - 1, h < heads (1 or 2): two heads at once keep twice the
// independent sums in flight; each head's sum runs over the keys in the same order either way
template <int NV>
inline void weigh_block(const float* vals, const float* p, int64_t span, int64_t j0, int64_t j1, int heads, float* o) {
  vf a[NV], a2[NV];
  for (int c = 0; c < NV; ++c) a[c] = vload(o + c * 16), a2[c] = vload(o + (heads - 1) * NV * 16 + c * 16);
  const float* p2 = p + (heads - 1) * span;
  for (int64_t j = j0; j < j1; ++j) {
    const vf pj = vset1(p[j]), pj2 = vset1(p2[j]);
    for (int c = 0; c < NV; ++c) {
      const vf vj = vload(vals + j * NV * 16 + c * 16);
      a[c] = vfma(pj, vj, a[c]);
      a2[c] = vfma(pj2, vj, a2[c]);
    }
  }
  for (int c = 0; c < NV; ++c) vstore(o + (heads - 1) * NV * 16 + c * 16, a2[c]);
  for (int c = 0; c < NV; ++c) vstore(o + c * 16, a[c]);
}

// out[r] = sum of p[r][j] v[j] over each query's keys, in ascending order
template <int NV>
void weigh_run(const Run& R, int64_t base, int64_t end, float* vf, const float* scores, int64_t span, float* out) {
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
}

// one chunk of the run's keys (R.lo/R.hi already cut to it): per query its scores' maximum m, the
// sum l of e^(s - m) and the unnormalised output o [hd]; a query with no key here gets l = 0
template <int NV>
void attend_part(const Run& R, std::vector<float>& buf, float* m, float* l, float* o) {
  const int64_t Q = R.T * R.G;
  int64_t base = INT64_MAX, end = 0;
  for (int64_t t = 0; t < R.T; ++t)
    if (R.lo[t] < R.hi[t]) base = std::min(base, R.lo[t]), end = std::max(end, R.hi[t]);
  if (end == 0) {
    for (int64_t r = 0; r < Q; ++r) m[r] = -INFINITY, l[r] = 0.f;
    return;
  }
  base -= base % (2 * BLOCK);  // the tile unit sums values 32 keys at a time, from a multiple of 32
  const int64_t span = (end - base + 2 * BLOCK - 1) / (2 * BLOCK) * (2 * BLOCK);
  buf.resize(BLOCK * R.hd + Q * span);
  float *kf = buf.data(), *scores = kf + BLOCK * R.hd;
  if (!score_run_amx(R, base, end, scores, span)) score_run<NV>(R, base, end, kf, scores, span);
  for (int64_t r = 0; r < Q; ++r) {
    const int64_t t = r / R.G;
    float* s = scores + r * span + (R.lo[t] - base);
    const int64_t n = R.hi[t] - R.lo[t];
    const float mx = max_of(s, n);
    m[r] = mx;
    l[r] = n > 0 ? exp_shifted(s, n, mx) : 0.f;
  }
  if (!weigh_run_amx(R, base, end, scores, span, o)) weigh_run<NV>(R, base, end, kf, scores, span, o);
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
  int64_t d = 0;
#if defined(ATT_VEC)
  for (; d + 16 <= P.G * P.hd; d += 16) vstore(dst + d, load16(qi + d));
#endif
  for (; d < P.G * P.hd; ++d) dst[d] = bf16_to_float(qi[d]);
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

#if defined(ATT_VEC)
// tokens i0 .. i0 + T of a run, head g: each query's partial sums over `chunks` chunks (parts, one
// per stride: m, l, o as attend_part leaves them), merged in ascending order into its output:
// sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c, M the largest m_c
void merge_chunks(const Pass& P, int64_t i0, int64_t T, int64_t g, const float* parts, int64_t chunks, int64_t stride,
                  int64_t QR, float* of) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < P.G; ++h) {
      const int64_t q = t * P.G + h;
      float mx = -INFINITY, sum = 0.f, *o = of + h * P.hd;
      for (int64_t c = 0; c < chunks; ++c)
        if (parts[c * stride + QR + q] > 0.f) mx = std::max(mx, parts[c * stride + q]);
      std::fill(o, o + P.hd, 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* pc = parts + c * stride;
        if (!(pc[QR + q] > 0.f)) continue;
        const float w = std::exp(pc[q] - mx);
        sum += w * pc[QR + q];
        for (int64_t d = 0; d < P.hd; ++d) o[d] += w * pc[2 * QR + q * P.hd + d];
      }
      for (int64_t d = 0; d < P.hd; ++d) o[d] /= sum;
    }
    narrow_out(P, i0 + t, g, of);
  }
}

// A task is (run of a slot's consecutive tokens, key/value head, chunk of SPAN keys). A run is a
// chain, each token the child of the one before, so its tokens read the same row at each position.
// Chunks sit at fixed absolute positions, so a query's partial sums and their merge (in chunk
// order) are the same whatever else shares its pass; they spread a long context over the threads.
struct Task {
  int64_t run, head, chunk, part;  // part: this task's slot in the partial sums
};

struct Runs {  // a pass cut into runs, and the runs into tasks
  std::vector<int64_t> starts;  // run r: tokens starts[r] .. starts[r + 1]
  std::vector<std::vector<int64_t>> rows;  // each run's path rows, from its last token
  std::vector<int64_t> rows_from, chunks;  // and its number of chunks
  std::vector<Task> tasks;
  int64_t count() const { return static_cast<int64_t>(starts.size()) - 1; }
};

Runs plan_runs(const Pass& P) {
  Runs u;
  for (int64_t i = 0; i < P.N; ++i)
    if (i == 0 || P.parent(i) != i - 1 || i - u.starts.back() == RUN) u.starts.push_back(i);
  u.starts.push_back(P.N);
  const int64_t runs = u.count();
  u.rows.resize(runs), u.rows_from.assign(runs, 0), u.chunks.resize(runs);
  for (int64_t r = 0; r < runs; ++r) {
    P.path_rows(u.starts[r + 1] - 1, u.rows[r], &u.rows_from[r]);
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t i = u.starts[r]; i < u.starts[r + 1]; ++i) lo = std::min(lo, P.lo(i)), hi = std::max(hi, P.pos(i) + 1);
    const int64_t first = lo / SPAN;
    u.chunks[r] = (hi - 1) / SPAN + 1 - first;
    for (int64_t g = 0; g < P.Hkv; ++g)
      for (int64_t c = 0; c < u.chunks[r]; ++c) u.tasks.push_back({r, g, first + c, static_cast<int64_t>(u.tasks.size())});
  }
  return u;
}

void attend_by_runs(const Pass& P) {
  const Runs u = plan_runs(P);
  const auto &starts = u.starts, &chunks = u.chunks, &rows_from = u.rows_from;
  const auto& rows = u.rows;
  const auto& tasks = u.tasks;
  const int64_t runs = u.count(), QR = RUN * P.G, stride = QR * (P.hd + 2);
  bool one_chunk = true;  // then each task finishes its queries itself
  for (int64_t r = 0; r < runs; ++r) one_chunk &= chunks[r] == 1;
  thread_local std::vector<float> keep;  // the caller's: the team's threads reach it through `parts`
  keep.resize(std::max<size_t>(keep.size(), tasks.size() * stride));
  float* const parts = keep.data();  // per task and query: m, l, o [hd]
  const bool tiles = use_tiles(P.G * RUN, P.hd);  // by the model's shape only: every token takes one path
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf, qf(QR * P.hd), of(P.G * P.hd);
    std::vector<uint16_t> qb(tiles ? (QR + 15) / 16 * P.hd / 32 * 512 : 0);
    int64_t lo[RUN], hi[RUN], have = -1;  // have: the run and head whose queries qf holds
    if (tiles) tiles_on();
    for (int64_t k = begin; k < end; ++k) {
      const Task& tk = tasks[k];
      const int64_t r = tk.run, g = tk.head, i0 = starts[r], T = starts[r + 1] - i0;
      const int64_t cs = tk.chunk * SPAN, ce = cs + SPAN;
      if (have != r * P.Hkv + g) {
        for (int64_t t = 0; t < T; ++t) widen_queries(P, i0 + t, g, qf.data() + t * P.G * P.hd);
        if (tiles) pack_queries(qf.data(), T * P.G, P.hd, qb.data());
        have = r * P.Hkv + g;
      }
      for (int64_t t = 0; t < T; ++t)
        lo[t] = std::max(P.lo(i0 + t), cs), hi[t] = std::max(lo[t], std::min(P.pos(i0 + t) + 1, ce));
      const Run R{qf.data(), lo, hi, P.kc + P.base(i0, g), P.vc + P.base(i0, g), T, P.G, P.hd, P.L, P.scale, P.softcap,
                  rows[r].data(), rows_from[r], static_cast<int64_t>(rows[r].size()), tiles ? qb.data() : nullptr};
      float *m = parts + tk.part * stride, *l = m + QR, *o = l + QR;
      switch (P.hd) {
        case 64: attend_part<4>(R, buf, m, l, o); break;
        case 96: attend_part<6>(R, buf, m, l, o); break;
        case 128: attend_part<8>(R, buf, m, l, o); break;
        default: attend_part<16>(R, buf, m, l, o); break;
      }
      if (one_chunk) merge_chunks(P, i0, T, g, m, 1, stride, QR, of.data());
    }
    if (tiles) tiles_off();
  });
  if (one_chunk) return;
  std::vector<int64_t> run_part(runs);  // the part of run r's head 0, chunk 0; head g's follow
  for (int64_t r = 0, k = 0; r < runs; k += P.Hkv * chunks[r], ++r) run_part[r] = k;
  at::parallel_for(0, runs * P.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> of(P.G * P.hd);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / P.Hkv, g = task % P.Hkv;
      merge_chunks(P, starts[r], starts[r + 1] - starts[r], g, parts + (run_part[r] + g * chunks[r]) * stride,
                   chunks[r], stride, QR, of.data());
    }
  });
}
#endif

// write the pass's keys and values (token i's at kn + i * ks, vn + i * vs) at their (slot, row);
// returns the longest context
int64_t write_caches(const Pass& P, const uint16_t* kn, int64_t ks, const uint16_t* vn, int64_t vs, uint16_t* kc,
                     uint16_t* vc, int64_t slots) {
  int64_t longest = 0;
  for (int64_t i = 0; i < P.N; ++i) {
    const int64_t s = P.slot(i), p = P.pos(i), row = P.row(i), a = P.parent(i);
    TORCH_CHECK(s >= 0 && s < slots && p >= 0 && row >= p && row < P.L, "attend_tokens: slot, position or row out of range");
    TORCH_CHECK(a < i && (a < 0 || (P.slot(a) == s && P.pos(a) == p - 1)), "attend_tokens: a parent is an earlier token one position before");
    for (int64_t g = 0; g < P.Hkv; ++g) {
      std::memcpy(kc + P.base(i, g) + row * P.hd, kn + i * ks + g * P.hd, P.hd * sizeof(uint16_t));
      std::memcpy(vc + P.base(i, g) + row * P.hd, vn + i * vs + g * P.hd, P.hd * sizeof(uint16_t));
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
  // keys and values are read a token's row at a time: a row may sit in a wider tensor (v is a
  // view of the fused qkv matmul's output), which saves a copy per layer in a pass of 2+ tokens
  const auto rows_apart = [](const at::Tensor& t) { return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2); };
  if (!rows_apart(k)) k = k.contiguous();
  if (!rows_apart(v)) v = v.contiguous();
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
  const int64_t longest = write_caches(P, bits(k), k.stride(0), bits(v), v.stride(0), kc, vc, k_cache.size(0));
  // always across the thread team, even for one token: run inline, a small call left the team's
  // threads to fall asleep, and waking them for the next matmul cost a 1-token pass ~3 ms here
#if defined(ATT_VEC)
  if (P.hd == 64 || P.hd == 96 || P.hd == 128 || P.hd == 256) {  // the head sizes of the families served
    attend_by_runs(P);
    return out;
  }
#endif
  attend_per_token(P, longest);
  return out;
}

// whether runs may use the tile unit (where the machine has it); returns the previous setting
bool attend_allow_tiles(bool allow) {
#if defined(ATT_AMX)
  return tiles_allowed.exchange(allow);
#else
  return false;
#endif
}

// the ISA the runs' scores and weighted sums take here
std::string attend_isa() {
#if defined(ATT_AMX)
  if (use_tiles(1, 64)) return "amx-bf16";
#endif
#if defined(__AVX512F__)
  return "avx512";
#elif defined(ATT_VEC)
  return "avx2";
#else
  return "scalar";
#endif
}

TORCH_LIBRARY(specdec_attention, m) {
  m.def("attend_allow_tiles(bool allow) -> bool", &attend_allow_tiles);
  m.def("attend_isa() -> str", &attend_isa);
  m.def("attend_tokens(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor meta, "
        "int window, float scale, float softcap) -> Tensor");
  m.impl("attend_tokens", torch::kCPU, &attend_tokens);
}
