// Weight-only-quantised CPU matmul (llama.cpp's Q4_1 x Q8_1 / Q8_0 x Q8_1 style), row-invariant.
//
// y[i, n] = sum over groups g of 32 inputs, in order g = 0, 1, ...:
//     t   = d[n, g] * float(isum)              isum = sum q[n, k] * xq[i, k]   (exact int32)
//     t   = fma(m[n, g], float(xsum), t)       xsum = sum xq[i, k]             (exact int32)
//     acc = fma(t, s[i, g], acc)               acc starts at +0.0f
// i.e. s * (d * isum + m * xsum) = d s sum(q xq) + m s sum(xq), with w = d q + m.
// Activations are quantised inside the op, per row and group of 32: s = max|x| / 127,
// xq = round-half-even(x / s) (s == 0 -> xq = 0). Every row goes through the very same float
// operations whatever the number of rows in the call, the row tile it falls in, or the ISA path
// (the integer sums are exact), so a row's result is bitwise independent of the rows beside it.
// Build with -ffp-contract=off: the compiler must not fuse the scalar path's mul and add.
//
// Packed weight layout ("tile" = 16 output columns, "group" = 32 inputs), bytes:
//   [N / 16 tiles][K / 32 groups][chunk bytes], chunk = 64 bytes = 16 columns x 4 consecutive k
//   (column j's 4 bytes at j * 4 .. j * 4 + 3, i.e. one int32 lane per column).
//   8 bits: 8 chunks per group (k = 4c .. 4c + 3 in chunk c), 512 bytes per group.
//   4 bits: 4 chunks per group; byte's low nibble belongs to chunk v, high nibble to chunk v + 4,
//   256 bytes per group.
// Scales and mins: fp16 [N / 16 tiles][K / 32 groups][16], as GGUF stores them (a Q4_1 group is
// 16 bytes of weights: fp32 scales and mins were a third of the bytes a pass reads).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WQ_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#define WQ_AVX2 1
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t TILE = 16;
constexpr int64_t CHUNK = 64;

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

inline int64_t group_bytes(int64_t bits) { return bits == 4 ? 4 * CHUNK : 8 * CHUNK; }

#if defined(__x86_64__) || defined(_M_X64)
// How far ahead in a weight's stream a tile loop asks for bytes. The hardware prefetcher alone
// kept a pass over the verifier's layers well under this machine's read bandwidth: asking 8 KB
// ahead took them from 2.18 to 1.89 ms for 1 row and from 2.34 to 1.89 ms for 2 (AVX-512; the
// AVX2 build 2.26 -> 1.70 and 2.84 -> 2.09 ms; 4 KB or 12-24 KB ahead gained less), and the
// 8-bit LM head from 0.58 to 0.50 ms.
constexpr int64_t PREFETCH_BYTES = 8192;

// asks for the group PREFETCH_BYTES after group g: its weight bytes, scales and mins (a prefetch
// never faults, so the loop asks past the end of its tile and of the tensor alike)
inline void prefetch_ahead(const uint8_t* wp, const uint16_t* sc, const uint16_t* mn, int64_t g, int64_t gb) {
  const int64_t ahead = g + PREFETCH_BYTES / gb;
  const char* q = reinterpret_cast<const char*>(wp + ahead * gb);
  for (int64_t o = 0; o < gb; o += 64) _mm_prefetch(q + o, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(sc + ahead * TILE), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(mn + ahead * TILE), _MM_HINT_T0);
}
#endif

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- activation quantisation: one row, K floats -> K int8, G scales, G (float) sums ----
void quantize_row(const float* x, int64_t K, int8_t* xq, float* s, float* xs) {
  const int64_t G = K / GROUP;
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = x + g * GROUP;
    int8_t* qg = xq + g * GROUP;
#if defined(WQ_VNNI)
    __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
#else
    float amax = 0.0f;
    for (int64_t k = 0; k < GROUP; ++k) amax = std::max(amax, std::fabs(xg[k]));
#endif
    const float sc = amax / 127.0f;
    s[g] = sc;
    if (sc == 0.0f) {
      std::memset(qg, 0, GROUP);
      xs[g] = 0.0f;
      continue;
    }
#if defined(WQ_VNNI)
    const __m512 vs = _mm512_set1_ps(sc);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i qa = _mm512_cvt_roundps_epi32(_mm512_div_ps(a, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i qb = _mm512_cvt_roundps_epi32(_mm512_div_ps(b, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qa = _mm512_min_epi32(_mm512_max_epi32(qa, lo), hi);
    qb = _mm512_min_epi32(_mm512_max_epi32(qb, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qg), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + 16), _mm512_cvtepi32_epi8(qb));
    xs[g] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
#else
    int32_t sum = 0;
    for (int64_t k = 0; k < GROUP; ++k) {
      // nearbyint rounds half to even in the default rounding mode, as the vector path does
      int32_t q = static_cast<int32_t>(std::nearbyint(xg[k] / sc));
      q = std::min(127, std::max(-127, q));
      qg[k] = static_cast<int8_t>(q);
      sum += q;
    }
    xs[g] = static_cast<float>(sum);
#endif
  }
}

// ---- per-tile kernels: R rows x 16 columns, all K; out[r * 16 + j] fp32 ----

#if defined(WQ_VNNI)
constexpr int MAX_R = 8;
constexpr int max_rows(int64_t) { return MAX_R; }

template <int R, int BITS>
inline void tile_kernel(const uint8_t* wp, const uint16_t* sc, const uint16_t* mn, const int8_t* xq, const float* s,
                        const float* xs, int64_t K, float* out) {
  const int64_t G = K / GROUP;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i m0f = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    prefetch_ahead(wp, sc, mn, g, group_bytes(BITS));
    __m512i w[8];
    if constexpr (BITS == 4) {
      const uint8_t* p = wp + g * 4 * CHUNK;
      for (int v = 0; v < 4; ++v) {
        __m512i b = _mm512_loadu_si512(p + v * CHUNK);
        w[v] = _mm512_and_si512(b, m0f);
        w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m0f);
      }
    } else {
      const uint8_t* p = wp + g * 8 * CHUNK;
      for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(p + c * CHUNK);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * TILE)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + g * TILE)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * K + g * GROUP;
      __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        ia = _mm512_dpbusd_epi32(ia, w[c], _mm512_set1_epi32(load_i32(xr + 4 * c)));
        ib = _mm512_dpbusd_epi32(ib, w[c + 1], _mm512_set1_epi32(load_i32(xr + 4 * c + 4)));
      }
      __m512 t = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(ia, ib)));
      t = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * G + g]), t);
      acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(s[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * TILE, acc[r]);
}

constexpr const char* ISA = "avx512-vnni";

#elif defined(WQ_AVX2)
// Rows per call of a row tile. A row holds one int16 sum per 8 columns for 4 bits; three or more
// rows of 8 bits take a half tile per sweep, two sums per row, so 6 rows and the unpacked weights
// fill the 16 registers (built here for Zen 3: a [576 -> 1536] weight, 5 rows of 4 bits in one call took
// 56 us against 75 as 4 + 1 rows in half tiles; the 8-bit LM head, cold, 4, 5 and 6 rows took
// 1.85, 2.11 and 2.72 ms in calls of up to 6 rows against 2.37, 2.99 and 3.51 in calls of up to 3).
constexpr int MAX_R = 6;
constexpr int max_rows(int64_t) { return MAX_R; }

// One sweep over the groups for H halves of 8 columns from half h0, R rows. Every row's int16
// sums take the weights unpacked once per chunk and one broadcast of its 4 activations for all H
// halves; the float sums wait in out, where registers would spill them anyway. 4 bits: a row's 8
// u4 x s8 pair sums per half stay within int16 (8 x 2 x 15 x 127 = 30480); 8 bits: each byte is
// two nibbles, q = 16 hi + lo, with a sum per nibble. The chunk loop stays rolled: unrolled, GCC
// hoisted every product ahead of its add and spilled them (4 rows: 81 us against 68, by hand).
template <int R, int BITS, int H>
inline void sweep(const uint8_t* wp, const uint16_t* sc, const uint16_t* mn, const int8_t* xq, const float* s,
                  const float* xs, int64_t K, float* out, int h0) {
  const int64_t G = K / GROUP;
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) _mm256_storeu_ps(out + r * TILE + (h0 + h) * 8, _mm256_setzero_ps());
  const __m256i m0f = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  constexpr int NA = BITS == 4 ? H : 2 * H;  // int16 sums per row
  constexpr int NC = BITS == 4 ? 4 : 8;      // 64-byte chunks per group
  for (int64_t g = 0; g < G; ++g) {
    if (h0 == 0) prefetch_ahead(wp, sc, mn, g, group_bytes(BITS));  // a second sweep reads the same lines
    __m256i a[R][NA];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NA; ++i) a[r][i] = _mm256_setzero_si256();
    const int8_t* x0 = xq + g * GROUP;
    const uint8_t* p = wp + g * NC * CHUNK + h0 * 32;
#pragma GCC unroll 1
    for (int c = 0; c < NC; ++c) {
      __m256i wl[H], wh[H];
      for (int h = 0; h < H; ++h) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * CHUNK + h * 32));
        wl[h] = _mm256_and_si256(b, m0f);
        wh[h] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m0f);
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xl = _mm256_set1_epi32(load_i32(x0 + r * K + 4 * c));
        // 4 bits: the high nibbles are k + 16; 8 bits: the high nibbles of the same k
        const __m256i xh = BITS == 4 ? _mm256_set1_epi32(load_i32(x0 + r * K + 4 * c + 16)) : xl;
        constexpr int hi = BITS == 4 ? 0 : H;  // where the high nibbles' sums go
        for (int h = 0; h < H; ++h) a[r][h] = _mm256_add_epi16(a[r][h], _mm256_maddubs_epi16(wl[h], xl));
        for (int h = 0; h < H; ++h) a[r][hi + h] = _mm256_add_epi16(a[r][hi + h], _mm256_maddubs_epi16(wh[h], xh));
      }
    }
    for (int h = 0; h < H; ++h) {
      const int64_t o = g * TILE + (h0 + h) * 8;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + o)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + o)));
      for (int r = 0; r < R; ++r) {
        __m256i isum = _mm256_madd_epi16(a[r][h], ones);
        if constexpr (BITS == 8) isum = _mm256_add_epi32(isum, _mm256_madd_epi16(a[r][H + h], sixteen));
        __m256 t = _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum));
        t = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * G + g]), t);
        float* acc = out + r * TILE + (h0 + h) * 8;
        _mm256_storeu_ps(acc, _mm256_fmadd_ps(t, _mm256_set1_ps(s[r * G + g]), _mm256_loadu_ps(acc)));
      }
    }
  }
}

// Three or more rows of 8 bits take a half tile per sweep: a whole tile's four int16 sums per row
// spill past 2 rows (5 rows of a [576 -> 4096] weight: 400 us in whole tiles, 351 in half tiles,
// by hand). Two rows fit: in one sweep the LM head, cold, took 1.03 ms for 2 rows, as for 1,
// against 1.38 in half tiles (a verify pass at K = 1).
template <int R, int BITS>
inline void tile_kernel(const uint8_t* wp, const uint16_t* sc, const uint16_t* mn, const int8_t* xq, const float* s,
                        const float* xs, int64_t K, float* out) {
  if constexpr (BITS == 4 || R <= 2) {
    sweep<R, BITS, 2>(wp, sc, mn, xq, s, xs, K, out, 0);
  } else {
    sweep<R, BITS, 1>(wp, sc, mn, xq, s, xs, K, out, 0);
    sweep<R, BITS, 1>(wp, sc, mn, xq, s, xs, K, out, 1);
  }
}

constexpr const char* ISA = "avx2";

#else
constexpr int MAX_R = 4;
constexpr int max_rows(int64_t) { return MAX_R; }

template <int R, int BITS>
inline void tile_kernel(const uint8_t* wp, const uint16_t* sc, const uint16_t* mn, const int8_t* xq, const float* s,
                        const float* xs, int64_t K, float* out) {
  const int64_t G = K / GROUP;
  float acc[R][TILE];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TILE; ++j) acc[r][j] = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = wp + g * group_bytes(BITS);
    for (int j = 0; j < TILE; ++j) {
      int32_t q[GROUP];
      for (int kk = 0; kk < GROUP; ++kk) {
        const int c = kk / 4, b = kk % 4;
        if constexpr (BITS == 4) {
          const uint8_t byte = p[(c % 4) * CHUNK + j * 4 + b];
          q[kk] = c < 4 ? (byte & 0x0F) : (byte >> 4);
        } else {
          q[kk] = p[c * CHUNK + j * 4 + b];
        }
      }
      const float d = half_to_float(sc[g * TILE + j]), m = half_to_float(mn[g * TILE + j]);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + g * GROUP;
        int32_t isum = 0;
        for (int kk = 0; kk < GROUP; ++kk) isum += q[kk] * static_cast<int32_t>(xr[kk]);
        float t = d * static_cast<float>(isum);
        t = std::fma(m, xs[r * G + g], t);
        acc[r][j] = std::fma(t, s[r * G + g], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TILE; ++j) out[r * TILE + j] = acc[r][j];
}

constexpr const char* ISA = "scalar";
#endif

#if defined(WQ_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define WQ_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

// ---- AMX-INT8 for several rows of 8-bit weights: the same exact integer sums, the same fold ----
// VNNI pays 8 dot instructions per row, group and tile; the tile unit takes a group's 32 inputs
// for up to 16 rows in one instruction, leaving the float fold per row, VNNI's op for op, so
// results stay bitwise the same. It pays for the 8-bit LM head (5 rows: 1.12x one row's time,
// cold, against VNNI's 1.35x); 4-bit weights would have to be widened to bytes in memory first for
// the tile loads, which cost more than VNNI's in-register unpacking saves (0.092 vs 0.083 ms for
// 5 rows of a 576x3072 weight), so they stay on VNNI.

constexpr int AMX_ROWS = 16;

std::atomic<bool> amx_allowed{true};  // wq_allow_amx: tests compare both paths

// Linux hands out the tile state only on request, once per process
bool amx_usable() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted && amx_allowed.load(std::memory_order_relaxed);
}

struct TileConfig {  // palette 1, as _tile_loadconfig reads it
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0/1: sums of groups g, g + 1 [R][16] int32; tmm2/3: their activations [R][32] int8;
// tmm4/5: their weights [8][64] (a chunk per row, as packed)
void configure_tiles(int R) {
  TileConfig c;
  for (int t = 0; t < 6; ++t) {
    c.rows[t] = t < 4 ? R : 8;
    c.colsb[t] = t == 2 || t == 3 ? 32 : 64;
  }
  _tile_loadconfig(&c);
}

// isum [G][R][16]: every group's exact sums, two groups in flight on alternate tiles. A group's
// sums go to tile C from its activations (tile A) and weights (tile B); tile numbers must be
// literals in the intrinsics (GCC pastes them into the assembly), hence a macro.
void tile_sums(const uint8_t* w8, const int8_t* xq, int64_t K, int64_t G, int R, int32_t* isum) {
#define WQ_DOT_GROUP(C, A, B, g)                    \
  _tile_zero(C);                                    \
  _tile_loadd(A, xq + (g) * GROUP, K);              \
  _tile_loadd(B, w8 + (g) * 8 * CHUNK, CHUNK);      \
  _tile_dpbsud(C, A, B);
  for (int64_t g = 0; g < G; g += 2) {
    WQ_DOT_GROUP(0, 2, 4, g)
    if (g + 1 < G) {
      WQ_DOT_GROUP(1, 3, 5, g + 1)
      _tile_stored(1, isum + (g + 1) * R * TILE, TILE * 4);
    }
    _tile_stored(0, isum + g * R * TILE, TILE * 4);
  }
#undef WQ_DOT_GROUP
}

template <int R>
void amx_tile(const uint8_t* w8, const uint16_t* sc, const uint16_t* mn, const int8_t* xq, const float* s,
              const float* xs, int64_t K, float* out) {
  const int64_t G = K / GROUP;
  thread_local std::vector<int32_t> isum_buf;
  if (static_cast<int64_t>(isum_buf.size()) < G * AMX_ROWS * TILE) isum_buf.resize(G * AMX_ROWS * TILE);
  int32_t* isum = isum_buf.data();
  tile_sums(w8, xq, K, G, R, isum);  // all sums first: the fold never waits on the tile unit
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {  // VNNI's fold, op for op
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * TILE)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + g * TILE)));
    for (int r = 0; r < R; ++r) {
      __m512 t = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_loadu_si512(isum + (g * R + r) * TILE)));
      t = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * G + g]), t);
      acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(s[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * TILE, acc[r]);
}

void run_amx_tile(int R, const uint8_t* w8, const uint16_t* sc, const uint16_t* mn, const int8_t* xq, const float* s,
                  const float* xs, int64_t K, float* out) {
  switch (R) {
#define WQ_AMX_CASE(n) \
  case n:              \
    return amx_tile<n>(w8, sc, mn, xq, s, xs, K, out);
    WQ_AMX_CASE(2) WQ_AMX_CASE(3) WQ_AMX_CASE(4) WQ_AMX_CASE(5) WQ_AMX_CASE(6) WQ_AMX_CASE(7) WQ_AMX_CASE(8)
    WQ_AMX_CASE(9) WQ_AMX_CASE(10) WQ_AMX_CASE(11) WQ_AMX_CASE(12) WQ_AMX_CASE(13) WQ_AMX_CASE(14)
    WQ_AMX_CASE(15) WQ_AMX_CASE(16)
#undef WQ_AMX_CASE
    default:
      TORCH_CHECK(false, "wq_matmul: bad AMX row tile ", R);
  }
}
#endif

template <int BITS>
void run_tile(int R, const uint8_t* wp, const uint16_t* sc, const uint16_t* mn, const int8_t* xq, const float* s,
              const float* xs, int64_t K, float* out) {
  switch (R) {
#define WQ_CASE(n)                                                  \
  case n:                                                           \
    if constexpr (n <= MAX_R) {                                     \
      tile_kernel<n, BITS>(wp, sc, mn, xq, s, xs, K, out);          \
      return;                                                       \
    }                                                               \
    break;
    WQ_CASE(1) WQ_CASE(2) WQ_CASE(3) WQ_CASE(4) WQ_CASE(5) WQ_CASE(6) WQ_CASE(7) WQ_CASE(8)
#undef WQ_CASE
    default:
      break;
  }
  TORCH_CHECK(false, "wq_matmul: bad row tile ", R);
}

template <typename T>
inline void store_row(T* dst, const float* src) {
  for (int j = 0; j < TILE; ++j) dst[j] = static_cast<T>(src[j]);
}

void check_args(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                int64_t bits, int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 8, "wq_matmul: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scales.device().is_cpu() && mins.device().is_cpu(),
              "wq_matmul: CPU tensors only");
  TORCH_CHECK(x.dim() == 2, "wq_matmul: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "wq_matmul: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t K = x.size(1);
  TORCH_CHECK(K % GROUP == 0, "wq_matmul: K (", K, ") must be a multiple of ", GROUP);
  TORCH_CHECK(n > 0 && n % TILE == 0, "wq_matmul: n (", n, ") must be a positive multiple of ", TILE);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "wq_matmul: packed must be contiguous uint8");
  TORCH_CHECK(packed.numel() == n * K * bits / 8, "wq_matmul: packed has ", packed.numel(), " bytes, expected ",
              n * K * bits / 8, " for n=", n, " K=", K, " bits=", bits);
  const int64_t G = K / GROUP;
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous(), "wq_matmul: scales/mins must be contiguous float16");
    TORCH_CHECK(t->numel() == n * G, "wq_matmul: scales/mins have ", t->numel(), " values, expected ", n * G);
  }
}

struct Acts {  // quantised activations: int8 [M][K], scales and sums [M][K / 32]
  const int8_t* xq;
  const float *s, *xs;
  Acts at(int64_t row, int64_t K) const { return {xq + row * K, s + row * (K / GROUP), xs + row * (K / GROUP)}; }
};

#if defined(WQ_AMX)
constexpr int ROWS_MAX = AMX_ROWS;
#else
constexpr int ROWS_MAX = MAX_R;
#endif

inline bool tile_unit(int64_t bits, int64_t rows) {
#if defined(WQ_AMX)
  return bits == 8 && rows > 1 && amx_usable();
#else
  return false;
#endif
}

// rows of the next call of a row tile: AMX's tiles take up to 16 rows of 8-bit weights where the
// machine has them (configured here, per thread); one row goes through VNNI (its reads dominate)
inline int rows_per_call(int64_t bits, int64_t left) {
#if defined(WQ_AMX)
  if (tile_unit(bits, left)) {
    const int R = static_cast<int>(std::min<int64_t>(AMX_ROWS, left));
    configure_tiles(R);
    return R;
  }
#endif
  return static_cast<int>(std::min<int64_t>(max_rows(bits), left));
}

struct Weights {  // a packed weight [n / 16 tiles][K / 32 groups][group bytes], scales and mins
  const uint8_t* packed;
  const uint16_t *scales, *mins;
  int64_t bits, K, n;

  // out [R][16] = rows a .. a + R of x times tile t's 16 columns
  void tile(int64_t t, int R, const Acts& a, float* out) const {
    const int64_t G = K / GROUP;
    const uint8_t* wt = packed + t * G * group_bytes(bits);
    const uint16_t *st = scales + t * G * TILE, *mt = mins + t * G * TILE;
#if defined(WQ_AMX)
    if (tile_unit(bits, R)) return run_amx_tile(R, wt, st, mt, a.xq, a.s, a.xs, K, out);
#endif
    if (bits == 4) return run_tile<4>(R, wt, st, mt, a.xq, a.s, a.xs, K, out);
    run_tile<8>(R, wt, st, mt, a.xq, a.s, a.xs, K, out);
  }
};

at::Tensor wq_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t bits, int64_t n) {
  check_args(x, packed, scales, mins, bits, n);
  const int64_t M = x.size(0), K = x.size(1), G = K / GROUP;
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;

  // quantise the activations, row by row (each row on its own: row-invariant by construction);
  // bfloat16 rows are widened here, a row at a time: x.to(float) was four ATen ops a call, ~0.3 ms
  // of a pass's 121 calls
  const at::Tensor xc = x.contiguous();
  const bool widen = xc.scalar_type() == at::kBFloat16;
  std::vector<int8_t> xq(M * K);
  std::vector<float> s(M * G), xs(M * G);
  std::vector<float> row(widen ? K : 0);
  for (int64_t i = 0; i < M; ++i) {
    const float* xr;
    if (widen) {
      const c10::BFloat16* xb = xc.data_ptr<c10::BFloat16>() + i * K;
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(xb[k]);  // exact
      xr = row.data();
    } else {
      xr = xc.data_ptr<float>() + i * K;
    }
    quantize_row(xr, K, xq.data() + i * K, s.data() + i * G, xs.data() + i * G);
  }

  const Weights w{packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                  reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()), bits, K, n};
  const Acts a{xq.data(), s.data(), xs.data()};
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  void* yp = y.data_ptr();
  // tasks of >= 64k weights: smaller ones cost more in fork/join than they save
  const int64_t grain = std::max<int64_t>(1, (4096 + K - 1) / K);
  at::parallel_for(0, n / TILE, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float out[ROWS_MAX * TILE];
    for (int64_t i0 = 0; i0 < M;) {
      const int R = rows_per_call(bits, M - i0);
      for (int64_t t = begin; t < end; ++t) {
        w.tile(t, R, a.at(i0, K), out);
        for (int r = 0; r < R; ++r) {
          if (bf16)
            store_row(static_cast<c10::BFloat16*>(yp) + (i0 + r) * n + t * TILE, out + r * TILE);
          else
            store_row(static_cast<float*>(yp) + (i0 + r) * n + t * TILE, out + r * TILE);
        }
      }
      i0 += R;
#if defined(WQ_AMX)
      if (tile_unit(bits, R)) _tile_release();
#endif
    }
  });
  return y;
}

// q: uint8 [N, K] (0..15 for bits 4, 0..255 for bits 8) -> packed uint8 [N / 16, K / 32, group bytes]
at::Tensor wq_pack(const at::Tensor& q_in, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "wq_pack: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(q_in.dim() == 2, "wq_pack: q must be [N, K], got ", q_in.sizes());
  const int64_t N = q_in.size(0), K = q_in.size(1);
  TORCH_CHECK(N % TILE == 0, "wq_pack: N (", N, ") must be a multiple of ", TILE);
  TORCH_CHECK(K % GROUP == 0, "wq_pack: K (", K, ") must be a multiple of ", GROUP);
  const at::Tensor q = q_in.to(at::kByte).contiguous();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  if (bits == 4) TORCH_CHECK(q.max().item<uint8_t>() <= 15, "wq_pack: 4-bit values must lie in 0..15");
  const int64_t G = K / GROUP, gb = group_bytes(bits);
  auto out = at::zeros({N / TILE, G, gb}, q.options());
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / TILE, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* dst = op + (t * G + g) * gb;
        for (int64_t j = 0; j < TILE; ++j) {
          const uint8_t* row = qp + (t * TILE + j) * K + g * GROUP;
          for (int64_t kk = 0; kk < GROUP; ++kk) {
            const int64_t c = kk / 4, b = kk % 4;
            if (bits == 8)
              dst[c * CHUNK + j * 4 + b] = row[kk];
            else if (c < 4)
              dst[c * CHUNK + j * 4 + b] = static_cast<uint8_t>((dst[c * CHUNK + j * 4 + b] & 0xF0) | row[kk]);
            else
              dst[(c - 4) * CHUNK + j * 4 + b] =
                  static_cast<uint8_t>((dst[(c - 4) * CHUNK + j * 4 + b] & 0x0F) | (row[kk] << 4));
          }
        }
      }
  });
  return out;
}

std::string wq_isa() {
#if defined(WQ_AMX)
  if (amx_usable()) return std::string(ISA) + "+amx-int8";
#endif
  return ISA;
}

// whether several rows of 8-bit weights may go through AMX (where the machine has it); returns
// whether they did before
bool wq_allow_amx(bool allow) {
#if defined(WQ_AMX)
  return amx_allowed.exchange(allow);
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(specdec_kernels, m) {
  m.def("wq_matmul(Tensor x, Tensor packed, Tensor scales, Tensor mins, int bits, int n) -> Tensor");
  m.def("wq_pack(Tensor q, int bits) -> Tensor");
  m.def("wq_isa() -> str", &wq_isa);
  m.def("wq_allow_amx(bool allow) -> bool", &wq_allow_amx);
  m.impl("wq_matmul", c10::DispatchKey::CPU, TORCH_FN(wq_matmul));
  m.impl("wq_pack", c10::DispatchKey::CPU, TORCH_FN(wq_pack));
}
