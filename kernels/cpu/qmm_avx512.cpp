// The AVX-512 VNNI variant of qmm_common.h's matmul: 16 output rows of W (a tile) in one zmm, the codes of
// a 32-column group unpacked once into 8 chunk vectors (4 columns x 16 rows of bytes each: U, up to 8 bits, the
// TABLE types' values included) and multiplied by every row of x in the call (vpdpbusd: u8 codes x s8 activations,
// 4 products a lane, int32 sums).
#include <cmath>
#include <cstring>
#include <limits>

#include "forward.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,f16c")
#include <immintrin.h>

namespace qmm {
namespace {

// a group's codes p -> the 8 chunk vectors U[c] (byte 4 i + j: U of row i, column 4 c + j): the low plane's LB-bit
// fields, the high plane's above them; the TABLE types' 4-bit indices mapped to IQ4_VALUES by a byte shuffle
template <int TYPE>
inline void unpack(const uint8_t* p, __m512i* U) {
  constexpr TypeInfo ti = TYPES[TYPE];
  constexpr int LB = low_bits(ti.bits), HB = ti.bits - LB;
  const __m512i ml = _mm512_set1_epi8((char)((1 << LB) - 1));
#pragma GCC unroll 4
  for (int v = 0; v < LB; ++v) {
    const __m512i L = _mm512_loadu_si512(p + 64 * v);
#pragma GCC unroll 4
    for (int m = 0; m < 8 / LB; ++m)  // chunk v + LB m at bits LB m of each byte
      U[v + LB * m] = _mm512_and_si512(m == 0 ? L : _mm512_srli_epi16(L, LB * m), ml);
  }
  if constexpr (HB > 0) {
    const __m512i mh = _mm512_set1_epi8((char)(((1 << HB) - 1) << LB));
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i H = _mm512_loadu_si512(p + 64 * LB + 64 * (c % HB));
      const int shift = (c / HB) * HB;  // the chunk's field in H; moved to bits LB.. of each byte
      const __m512i hi = shift >= LB ? _mm512_srli_epi16(H, shift - LB) : _mm512_slli_epi16(H, LB - shift);
      U[c] = _mm512_or_si512(U[c], _mm512_and_si512(hi, mh));
    }
  }
  if constexpr (ti.table) {
    const __m512i values = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES)));
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) U[c] = _mm512_shuffle_epi8(values, U[c]);  // per 128-bit lane: index < 16
  }
}

// isum += codes (u8) x the 4 activation bytes at p (s8) broadcast to every lane, the broadcast folded into
// the product's memory operand (compilers load it into a register first: one more shuffle per product)
inline __m512i dot4(__m512i isum, __m512i codes, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(isum) : "v"(codes), "m"(*reinterpret_cast<const unaligned_i32*>(p)));
  return isum;
}

inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 load_i8x16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// groups of codes fetched ahead of the one being multiplied (measured on a 2-core AMD EPYC, Zen 4: 2, 4, 8 and
// 16 all 10-25% faster than none from 1 to 13 rows; 8 the best by a little)
constexpr int PREFETCH_GROUPS = 8;

// rows m0 .. m0 + MR - 1 of tile t (PREFETCH: the first pass over the tile, which fetches its codes)
template <int TYPE, int MR, bool PREFETCH>
void rows_tile(const Args& a, int64_t t, int64_t m0) {
  constexpr TypeInfo ti = TYPES[TYPE];
  constexpr int G = ti.group, GPK = 32 / G, CB = code_bytes(ti.bits), KPS = ti.superblock / 32;
  const int64_t K = a.K, nsb = K / ti.superblock, nkb = K / 32, ng = K / G;
  (void)KPS;
  // this tile's weights and these rows' activations, walked forward with k
  const uint8_t* __restrict codes = a.codes + t * nkb * CB;
  const uint16_t* __restrict da = a.da + t * nsb * 16;
  const uint16_t* __restrict db = ti.has_b ? a.db + t * nsb * 16 : nullptr;
  const int8_t* __restrict sa = ti.sub ? a.sa + t * ng * 16 : nullptr;
  const int8_t* __restrict sb = ti.sub && ti.has_b ? a.sb + t * ng * 16 : nullptr;
  const int64_t Q = a.Q;  // group-major activations: group kb's row r at (kb Q + r) 32, its scale at kb Q + r
  const int8_t* __restrict xq = a.xq + m0 * 32;
  const float* __restrict dx = a.dx + m0;
  const float* __restrict dsx = ti.has_b ? a.dsx + m0 : nullptr;
  const int32_t* __restrict osx = ti.has_b ? nullptr : a.osx + m0;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  __m512 Da = _mm512_setzero_ps(), Db = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < nkb; ++kb) {  // one loop over the column groups (a super-block's scales at its first)
    if (kb % KPS == 0) {
      Da = load_half16(da + (kb / KPS) * 16);
      if constexpr (ti.has_b) Db = load_half16(db + (kb / KPS) * 16);
    }
    __m512i U[8];
    if constexpr (PREFETCH) {  // the codes PREFETCH_GROUPS groups ahead, so that the next ones arrive while these multiply
      const char* ahead = reinterpret_cast<const char*>(codes + (kb + PREFETCH_GROUPS) * CB);
      for (int line = 0; line < CB; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    unpack<TYPE>(codes + kb * CB, U);
#pragma GCC unroll 2
    for (int h = 0; h < GPK; ++h) {
      const int64_t g = kb * GPK + h;
      __m512 av = Da, bv = Db;
      if constexpr (ti.sub) {
        av = _mm512_mul_ps(Da, load_i8x16(sa + g * 16));
        if constexpr (ti.has_b) bv = _mm512_mul_ps(Db, load_i8x16(sb + g * 16));
      }
      const int8_t* xg = xq + kb * Q * 32 + h * G;  // row r at xg + 32 r
      const float* dxg = dx + kb * Q;
      const int64_t gq = g * Q;
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const int8_t* xr = xg + r * 32;
        __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < G / 4; ++c) isum = dot4(isum, U[h * (G / 4) + c], xr + 4 * c);
        const __m512 ad = _mm512_mul_ps(av, _mm512_set1_ps(dxg[r]));
        if constexpr (ti.has_b) {
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), ad, acc[r]);
          acc[r] = _mm512_fmadd_ps(bv, _mm512_set1_ps(dsx[gq + r]), acc[r]);
        } else {
          const __m512i shifted = _mm512_add_epi32(isum, _mm512_set1_epi32(osx[gq + r]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(shifted), ad, acc[r]);
        }
      }
    }
  }
  const int64_t left = a.n - t * 16;
  const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(a.y + (m0 + r) * a.ldy + t * 16, mask, acc[r]);
}

template <int TYPE, int MR>
inline void pass(const Args& a, int64_t t, int64_t m) {  // the first pass over a tile fetches its codes
  if (m == 0) rows_tile<TYPE, MR, true>(a, t, m);
  else rows_tile<TYPE, MR, false>(a, t, m);
}

template <int TYPE>
void tiles(const Args& a, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    int64_t m = 0;  // rows 16 at a time, then the rest in one pass (its own instantiation: 1 .. 15 rows)
    for (; m + 16 <= a.M; m += 16) pass<TYPE, 16>(a, t, m);  // the first pass over a tile fetches it
    switch (a.M - m) {
      case 15: pass<TYPE, 15>(a, t, m); break;
      case 14: pass<TYPE, 14>(a, t, m); break;
      case 13: pass<TYPE, 13>(a, t, m); break;
      case 12: pass<TYPE, 12>(a, t, m); break;
      case 11: pass<TYPE, 11>(a, t, m); break;
      case 10: pass<TYPE, 10>(a, t, m); break;
      case 9: pass<TYPE, 9>(a, t, m); break;
      case 8: pass<TYPE, 8>(a, t, m); break;
      case 7: pass<TYPE, 7>(a, t, m); break;
      case 6: pass<TYPE, 6>(a, t, m); break;
      case 5: pass<TYPE, 5>(a, t, m); break;
      case 4: pass<TYPE, 4>(a, t, m); break;
      case 3: pass<TYPE, 3>(a, t, m); break;
      case 2: pass<TYPE, 2>(a, t, m); break;
      case 1: pass<TYPE, 1>(a, t, m); break;
      default: break;
    }
  }
}

}  // namespace

bool qmm_avx512(int type, const Args& a, int64_t t0, int64_t t1) { QMM_DISPATCH_TYPES(tiles, type, a, t0, t1) }

namespace avx512_ops {
#define SIMD16_ISA 2
#include "forward_ops.h"
#undef SIMD16_ISA
}  // namespace avx512_ops

const Ops& ops_avx512() { return avx512_ops::OPS; }

}  // namespace qmm
#pragma GCC pop_options
#else
namespace qmm {
bool qmm_avx512(int, const Args&, int64_t, int64_t) { return false; }
const Ops& ops_avx512() { return ops_scalar(); }
}  // namespace qmm
#endif
