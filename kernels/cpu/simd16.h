// V16: 16 float lanes, the one vector type forward_ops.h is written in, defined three times: 16 scalars
// (SIMD16_ISA 0), two AVX2 registers (1), one AVX-512 register (2). Every operation is lane-wise and performs the
// same IEEE float operation in every definition (a product is a product, an FMA an FMA: the files are compiled
// with -ffp-contract=off), and the two reductions have one fixed order (`tree_sum`; `max_all` is exact in any
// order), so code written in V16 gives the same bits on every instruction set.
//
// Included inside the namespace of its variant (after <cmath>, <cstring>, <cstdint>, and <immintrin.h> for 1, 2),
// with SIMD16_ISA defined.

#if SIMD16_ISA == 2

struct V16 {
  __m512 v;
};
struct M16 {
  __mmask16 m;
};
inline V16 v_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 v_load_n(const float* p, int n) { return {_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p)}; }
inline void v_store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline void v_store_n(float* p, V16 a, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a.v); }
inline V16 v_set1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 v_add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 v_sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 v_mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 v_div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 v_fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// lanes < n: a b + c; the others keep c
inline V16 v_fma_n(V16 a, V16 b, V16 c, int n) {
  return {_mm512_mask3_fmadd_ps(a.v, b.v, c.v, (__mmask16)((1u << n) - 1))};
}
inline V16 v_max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }  // a > b ? a : b
inline V16 v_abs(V16 a) { return {_mm512_abs_ps(a.v)}; }
inline V16 v_round(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline M16 v_lt(V16 a, V16 b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ)}; }
inline M16 v_gt(V16 a, V16 b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ)}; }
inline M16 v_isnan(V16 a) { return {_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)}; }
inline bool m_any(M16 m) { return m.m != 0; }
inline V16 v_select(M16 m, V16 a, V16 b) { return {_mm512_mask_blend_ps(m.m, b.v, a.v)}; }  // m ? a : b
// 2^n for lanes holding integers n in [-126, 127]
inline V16 v_pow2i(V16 n) {
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
  return {_mm512_castsi512_ps(e)};
}
// lanes holding integers in [-128, 127] to int8
inline void v_store_i8(int8_t* p, V16 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a.v)));
}
inline void v_halves(V16 a, __m256* lo, __m256* hi) {
  *lo = _mm512_castps512_ps256(a.v);
  *hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
}
inline float tree_sum(V16 a) {  // ((a0..7 + a8..15) -> 4: + 4 apart -> (c0 + c2) + (c1 + c3))
  __m256 lo, hi;
  v_halves(a, &lo, &hi);
  const __m256 b = _mm256_add_ps(lo, hi);
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));  // d0 = c0 + c2, d1 = c1 + c3
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}
inline float max_all(V16 a) { return _mm512_reduce_max_ps(a.v); }

#elif SIMD16_ISA == 1

struct V16 {
  __m256 lo, hi;
};
struct M16 {
  __m256 lo, hi;
};
inline __m256 mask_n(int n) {  // lanes < n all ones (n in 0..8)
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}
inline V16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 v_load_n(const float* p, int n) {
  const int a = n < 8 ? n : 8, b = n > 8 ? n - 8 : 0;
  return {_mm256_maskload_ps(p, _mm256_castps_si256(mask_n(a))),
          _mm256_maskload_ps(p + 8, _mm256_castps_si256(mask_n(b)))};
}
inline void v_store(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void v_store_n(float* p, V16 a, int n) {
  const int x = n < 8 ? n : 8, y = n > 8 ? n - 8 : 0;
  _mm256_maskstore_ps(p, _mm256_castps_si256(mask_n(x)), a.lo);
  _mm256_maskstore_ps(p + 8, _mm256_castps_si256(mask_n(y)), a.hi);
}
inline V16 v_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 v_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 v_sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 v_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 v_div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 v_fma(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 v_fma_n(V16 a, V16 b, V16 c, int n) {
  const V16 f = v_fma(a, b, c);
  const int x = n < 8 ? n : 8, y = n > 8 ? n - 8 : 0;
  return {_mm256_blendv_ps(c.lo, f.lo, mask_n(x)), _mm256_blendv_ps(c.hi, f.hi, mask_n(y))};
}
inline V16 v_max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 v_abs(V16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline V16 v_round(V16 a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline M16 v_lt(V16 a, V16 b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ)}; }
inline M16 v_gt(V16 a, V16 b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)}; }
inline M16 v_isnan(V16 a) {
  return {_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)};
}
inline bool m_any(M16 m) { return _mm256_movemask_ps(_mm256_or_ps(m.lo, m.hi)) != 0; }
inline V16 v_select(M16 m, V16 a, V16 b) { return {_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)}; }
inline __m256 pow2i8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 v_pow2i(V16 n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }
inline void v_store_i8(int8_t* p, V16 a) {
  const __m256i w = _mm256_packs_epi32(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi));  // [0-3 8-11 4-7 12-15]
  const __m256i o = _mm256_permute4x64_epi64(w, 0xD8);                                      // [0-7 8-15] as int16
  const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(o), _mm256_extracti128_si256(o, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
}
inline float tree_sum(V16 a) {
  const __m256 b = _mm256_add_ps(a.lo, a.hi);
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}
inline float max_all(V16 a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 c = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  c = _mm_max_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_max_ss(c, _mm_shuffle_ps(c, c, 1)));
}

#else  // 16 scalars

struct V16 {
  float f[16];
};
struct M16 {
  bool b[16];
};
#define V16_EACH(expr) \
  V16 r;               \
  for (int l = 0; l < 16; ++l) r.f[l] = (expr); \
  return r
#define M16_EACH(expr) \
  M16 r;               \
  for (int l = 0; l < 16; ++l) r.b[l] = (expr); \
  return r
inline V16 v_load(const float* p) { V16_EACH(p[l]); }
inline V16 v_load_n(const float* p, int n) { V16_EACH(l < n ? p[l] : 0.0f); }
inline void v_store(float* p, V16 a) {
  for (int l = 0; l < 16; ++l) p[l] = a.f[l];
}
inline void v_store_n(float* p, V16 a, int n) {
  for (int l = 0; l < n; ++l) p[l] = a.f[l];
}
inline V16 v_set1(float x) { V16_EACH(x); }
inline V16 v_add(V16 a, V16 b) { V16_EACH(a.f[l] + b.f[l]); }
inline V16 v_sub(V16 a, V16 b) { V16_EACH(a.f[l] - b.f[l]); }
inline V16 v_mul(V16 a, V16 b) { V16_EACH(a.f[l] * b.f[l]); }
inline V16 v_div(V16 a, V16 b) { V16_EACH(a.f[l] / b.f[l]); }
inline V16 v_fma(V16 a, V16 b, V16 c) { V16_EACH(std::fmaf(a.f[l], b.f[l], c.f[l])); }
inline V16 v_fma_n(V16 a, V16 b, V16 c, int n) { V16_EACH(l < n ? std::fmaf(a.f[l], b.f[l], c.f[l]) : c.f[l]); }
inline V16 v_max(V16 a, V16 b) { V16_EACH(a.f[l] > b.f[l] ? a.f[l] : b.f[l]); }
inline V16 v_abs(V16 a) { V16_EACH(std::fabs(a.f[l])); }
inline V16 v_round(V16 a) { V16_EACH(std::nearbyintf(a.f[l])); }
inline M16 v_lt(V16 a, V16 b) { M16_EACH(a.f[l] < b.f[l]); }
inline M16 v_gt(V16 a, V16 b) { M16_EACH(a.f[l] > b.f[l]); }
inline M16 v_isnan(V16 a) { M16_EACH(a.f[l] != a.f[l]); }
inline bool m_any(M16 m) {
  bool any = false;
  for (int l = 0; l < 16; ++l) any = any || m.b[l];
  return any;
}
inline V16 v_select(M16 m, V16 a, V16 b) { V16_EACH(m.b[l] ? a.f[l] : b.f[l]); }
inline V16 v_pow2i(V16 n) {
  V16 r;
  for (int l = 0; l < 16; ++l) {
    const uint32_t bits = (uint32_t)((int32_t)n.f[l] + 127) << 23;
    std::memcpy(&r.f[l], &bits, 4);
  }
  return r;
}
inline void v_store_i8(int8_t* p, V16 a) {
  for (int l = 0; l < 16; ++l) p[l] = (int8_t)(int32_t)a.f[l];
}
inline float tree_sum(V16 a) {
  float b[8], c[4];
  for (int i = 0; i < 8; ++i) b[i] = a.f[i] + a.f[i + 8];
  for (int i = 0; i < 4; ++i) c[i] = b[i] + b[i + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}
inline float max_all(V16 a) {
  float m = a.f[0];
  for (int l = 1; l < 16; ++l) m = a.f[l] > m ? a.f[l] : m;
  return m;
}
#undef V16_EACH
#undef M16_EACH

#endif
