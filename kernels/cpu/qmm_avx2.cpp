// The AVX2 variant of qmm_common.h's matmul: a tile's 16 output rows as two halves of 8 (one ymm each).
// Products by vpmaddubsw (u8 codes x s8 activations, pairs summed in int16: exact for codes <= 63) and
// vpmaddwd (pairs into int32); 8-bit codes are multiplied as their two nibbles (16 hi + lo), which keeps
// every int16 pair sum exact; the TABLE types' values U = s + 128 as |s| times xq with s's sign (sum s xq, the
// integer sum U xq + OFF sum xq that the other variants form).
#include <cmath>
#include <cstring>
#include <limits>

#include "forward.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace qmm {
namespace {

// half `half` (bytes 32 half .. 32 half + 31 of each 64-byte vector) of a group's codes: lo[c] (the low plane's
// LB-bit fields) and, for BITS > LB, hi[c] (0 .. 2^(BITS-LB) - 1, not shifted)
template <int BITS>
inline void unpack(const uint8_t* p, int half, __m256i* lo, __m256i* hi) {
  constexpr int LB = low_bits(BITS), HB = BITS - LB;
  const __m256i ml = _mm256_set1_epi8((char)((1 << LB) - 1));
  for (int v = 0; v < LB; ++v) {
    const __m256i L = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * v + 32 * half));
    for (int m = 0; m < 8 / LB; ++m)  // chunk v + LB m at bits LB m of each byte
      lo[v + LB * m] = _mm256_and_si256(m == 0 ? L : _mm256_srli_epi16(L, LB * m), ml);
  }
  if constexpr (HB > 0) {
    const __m256i mh = _mm256_set1_epi8((char)((1 << HB) - 1));
    for (int c = 0; c < 8; ++c) {
      const __m256i H =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * LB + 64 * (c % HB) + 32 * half));
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(H, (c / HB) * HB), mh);
    }
  }
}

inline __m256i dot4(__m256i codes, int32_t x4) {  // per int32 lane: sum of 4 code x activation products
  const __m256i p = _mm256_maddubs_epi16(codes, _mm256_set1_epi32(x4));  // [16 x int16] exact (codes <= 63)
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// the TABLE types: per int32 lane the sum of 4 products s x of signed values s (-127..113, their signs in `sign`,
// their magnitudes in `mag`) and activations x: |s| x (sign of s) pairs summed in int16, |.| <= 2 127 128: exact
inline __m256i dot4_signed(__m256i mag, __m256i sign, int32_t x4) {
  const __m256i p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(_mm256_set1_epi32(x4), sign));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

inline __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 load_i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

constexpr int PREFETCH_GROUPS = 8;  // as the AVX-512 variant

template <int TYPE, int MR>
void rows_half(const Args& a, int64_t t, int half, int64_t m0, bool prefetch) {
  constexpr TypeInfo ti = TYPES[TYPE];
  constexpr int G = ti.group, GPK = 32 / G, CB = code_bytes(ti.bits), KPS = ti.superblock / 32;
  const int64_t K = a.K, nsb = K / ti.superblock, nkb = K / 32, ng = K / G;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* codes = a.codes + t * nkb * CB;
  const int64_t col = 8 * half;
  for (int64_t s = 0; s < nsb; ++s) {
    const __m256 Da = load_half8(a.da + (t * nsb + s) * 16 + col);
    __m256 Db = _mm256_setzero_ps();
    if constexpr (ti.has_b) Db = load_half8(a.db + (t * nsb + s) * 16 + col);
    for (int q = 0; q < KPS; ++q) {
      const int64_t kb = s * KPS + q;
      __m256i lo[8], hi[8];
      if (prefetch) {
        const char* ahead = reinterpret_cast<const char*>(codes + (kb + PREFETCH_GROUPS) * CB);
        for (int line = 0; line < CB; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
      unpack<ti.bits>(codes + kb * CB, half, lo, hi);
      if constexpr (ti.bits != low_bits(ti.bits) && ti.bits < 8) {
        for (int c = 0; c < 8; ++c)  // u <= 63
          lo[c] = _mm256_or_si256(lo[c], _mm256_slli_epi16(hi[c], low_bits(ti.bits)));
      }
      if constexpr (ti.table) {  // hi: the signed values s = U - 128 of the 4-bit indices, lo: |s|
        const __m256i values =
            _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_SIGNED)));
        for (int c = 0; c < 8; ++c) {
          hi[c] = _mm256_shuffle_epi8(values, lo[c]);  // per 128-bit lane: index < 16
          lo[c] = _mm256_abs_epi8(hi[c]);
        }
      }
      for (int h = 0; h < GPK; ++h) {
        const int64_t g = kb * GPK + h;
        __m256 av = Da, bv = Db;
        if constexpr (ti.sub) {
          av = _mm256_mul_ps(Da, load_i8x8(a.sa + (t * ng + g) * 16 + col));
          if constexpr (ti.has_b) bv = _mm256_mul_ps(Db, load_i8x8(a.sb + (t * ng + g) * 16 + col));
        }
        for (int r = 0; r < MR; ++r) {
          const int64_t m = m0 + r;
          const int8_t* xr = a.xq + (kb * a.Q + m) * 32 + h * G;
          __m256i isum = _mm256_setzero_si256();
          for (int c = 0; c < G / 4; ++c) {
            const int v = h * (G / 4) + c;
            if constexpr (ti.table)  // sum s xq = sum U xq + OFF sum xq (OFF = -128): the integer the others form
              isum = _mm256_add_epi32(isum, dot4_signed(lo[v], hi[v], load_i32(xr + 4 * c)));
            else
              isum = _mm256_add_epi32(isum, dot4(lo[v], load_i32(xr + 4 * c)));
          }
          if constexpr (ti.bits == 8) {
            __m256i ihi = _mm256_setzero_si256();
            for (int c = 0; c < G / 4; ++c)
              ihi = _mm256_add_epi32(ihi, dot4(hi[h * (G / 4) + c], load_i32(xr + 4 * c)));
            isum = _mm256_add_epi32(isum, _mm256_slli_epi32(ihi, 4));
          }
          const float d = a.dx[kb * a.Q + m];
          const __m256 ad = _mm256_mul_ps(av, _mm256_set1_ps(d));
          if constexpr (ti.has_b) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), ad, acc[r]);
            acc[r] = _mm256_fmadd_ps(bv, _mm256_set1_ps(a.dsx[g * a.Q + m]), acc[r]);
          } else if constexpr (ti.table) {  // isum is already sum U xq + OFF sum xq
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), ad, acc[r]);
          } else {
            const __m256i shifted = _mm256_add_epi32(isum, _mm256_set1_epi32(a.osx[g * a.Q + m]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(shifted), ad, acc[r]);
          }
        }
      }
    }
  }
  const int64_t left = a.n - t * 16 - col;
  for (int r = 0; r < MR; ++r) {
    float* out = a.y + (m0 + r) * a.ldy + t * 16 + col;
    if (left >= 8) {
      _mm256_storeu_ps(out, acc[r]);
    } else if (left > 0) {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, acc[r]);
      for (int i = 0; i < left; ++i) out[i] = tmp[i];
    }
  }
}

template <int TYPE>
void tiles(const Args& a, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    for (int half = 0; half < 2; ++half) {
      int64_t m = 0;  // rows 4 at a time, then the rest in one pass; the first pass over a tile fetches it
      for (; m + 4 <= a.M; m += 4) rows_half<TYPE, 4>(a, t, half, m, m == 0 && half == 0);
      switch (a.M - m) {
        case 3: rows_half<TYPE, 3>(a, t, half, m, m == 0 && half == 0); break;
        case 2: rows_half<TYPE, 2>(a, t, half, m, m == 0 && half == 0); break;
        case 1: rows_half<TYPE, 1>(a, t, half, m, m == 0 && half == 0); break;
        default: break;
      }
    }
  }
}

}  // namespace

bool qmm_avx2(int type, const Args& a, int64_t t0, int64_t t1) { QMM_DISPATCH_TYPES(tiles, type, a, t0, t1) }

namespace avx2_ops {
#define SIMD16_ISA 1
#include "forward_ops.h"
#undef SIMD16_ISA
}  // namespace avx2_ops

const Ops& ops_avx2() { return avx2_ops::OPS; }

}  // namespace qmm
#pragma GCC pop_options
#else
namespace qmm {
bool qmm_avx2(int, const Args&, int64_t, int64_t) { return false; }
const Ops& ops_avx2() { return ops_scalar(); }
}  // namespace qmm
#endif
