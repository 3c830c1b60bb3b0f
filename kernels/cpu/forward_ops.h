// The native forward's element-wise and attention ops, written once in simd16.h's V16 (16 float lanes) and compiled
// once per instruction set: each variant's file (qmm.cpp scalar, qmm_avx2.cpp, qmm_avx512.cpp) includes this inside
// its own namespace under its own target pragma, with SIMD16_ISA set, and exports the table `OPS` (forward.h's Ops).
//
// Every op is lane-wise V16 arithmetic plus simd16.h's two fixed reductions: element d of a sum goes to lane
// d % 16 in the order of d (a tail through the masked forms, which leave the other lanes as they are), then the 16
// lanes are added in one tree. So every variant performs the same float operations in the same order: the same
// bits on every instruction set. No op depends on anything but its own row (or query) and its arguments: nothing
// on the batch, T, the thread, or the ISA.
//
// Non-finite values propagate: a NaN or infinity in an activation block gives that block's scale NaN
// (quantize_row), and every op here passes NaN on (the maxima never pick a NaN, which then enters through the
// sums), so a non-finite anywhere in a forward reaches its logits.

#include "simd16.h"

constexpr int64_t CHUNK = ATTN_CHUNK;  // forward.h's: attention's keys reduced together, from each row's first key

// sum over d < n of x[d] y[d]
inline float dot(const float* __restrict x, const float* __restrict y, int64_t n) {
  V16 acc = v_set1(0.0f);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) acc = v_fma(v_load(x + d), v_load(y + d), acc);
  if (d < n) acc = v_fma_n(v_load_n(x + d, (int)(n - d)), v_load_n(y + d, (int)(n - d)), acc, (int)(n - d));
  return tree_sum(acc);
}

// exp(x) lane-wise: Cephes' expf (range reduction by ln 2 in two parts, a degree-6 polynomial, 2^n in the exponent
// bits); 0 below -87, exp(88) above 88, NaN for NaN
inline V16 v_exp(V16 x) {
  const M16 nan = v_isnan(x), low = v_lt(x, v_set1(-87.0f));
  V16 c = v_select(low, v_set1(-87.0f), v_select(v_gt(x, v_set1(88.0f)), v_set1(88.0f), x));
  c = v_select(nan, v_set1(0.0f), c);
  const V16 n = v_round(v_mul(c, v_set1(1.44269504088896341f)));
  V16 r = v_fma(n, v_set1(-0.693359375f), c);
  r = v_fma(n, v_set1(2.12194440e-4f), r);
  V16 p = v_set1(1.9875691500e-4f);
  p = v_fma(p, r, v_set1(1.3981999507e-3f));
  p = v_fma(p, r, v_set1(8.3334519073e-3f));
  p = v_fma(p, r, v_set1(4.1665795894e-2f));
  p = v_fma(p, r, v_set1(1.6666665459e-1f));
  p = v_fma(p, r, v_set1(5.0000001201e-1f));
  p = v_add(v_fma(p, v_mul(r, r), r), v_set1(1.0f));
  const V16 y = v_select(low, v_set1(0.0f), v_mul(p, v_pow2i(n)));
  return v_select(nan, x, y);
}

inline float exp1(float x) {  // exp of one value, as every lane of v_exp computes it
  float t[16];
  v_store(t, v_exp(v_set1(x)));
  return t[0];
}

// HF's RMSNorm of one row: y = (x * (1 / sqrt(mean(x^2) + eps))) * w   (in place allowed)
inline void rms_norm(const float* x, const float* __restrict w, int64_t n, float eps, float* y) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / (float)n + eps);
  const V16 vi = v_set1(inv);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) v_store(y + d, v_mul(v_mul(v_load(x + d), vi), v_load(w + d)));
  if (d < n) {
    const int m = (int)(n - d);
    v_store_n(y + d, v_mul(v_mul(v_load_n(x + d, m), vi), v_load_n(w + d, m)), m);
  }
}

inline V16 v_silu_mul(V16 g, V16 u) {
  return v_mul(v_div(g, v_add(v_set1(1.0f), v_exp(v_sub(v_set1(0.0f), g)))), u);
}

// y[j] = silu(gate[j]) * up[j], silu(g) = g / (1 + exp(-g))
inline void silu_mul(const float* __restrict gate, const float* __restrict up, int64_t n, float* __restrict y) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) v_store(y + j, v_silu_mul(v_load(gate + j), v_load(up + j)));
  if (j < n) {
    const int m = (int)(n - j);
    v_store_n(y + j, v_silu_mul(v_load_n(gate + j, m), v_load_n(up + j, m)), m);
  }
}

// one row of activations x [K] -> int8 codes, a float32 scale per block of 32 (dx = max |x| / 127, xq =
// nearbyint(x * (1 / dx)), 0 where dx is 0: llama.cpp's Q8_0 rule) and the sums of xq over each group of 16
// (sx16 [K / 16]); block b's 32 codes at xq + b * xs, its scale at dx[b * ds] (the group-major layout of
// qmm_common.h's Args). A block holding a NaN or an infinity gets dx = NaN and codes 0: every output it enters is
// NaN.
inline void quantize_row(const float* __restrict x, int64_t K, int8_t* __restrict xq, int64_t xs,
                         float* __restrict dx, int64_t ds, int32_t* __restrict sx16) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const V16 a0 = v_load(x + 32 * b), a1 = v_load(x + 32 * b + 16);
    const bool finite = !m_any(v_isnan(v_sub(a0, a0))) && !m_any(v_isnan(v_sub(a1, a1)));  // x - x: NaN for inf
    if (!finite) {
      dx[b * ds] = std::numeric_limits<float>::quiet_NaN();
      std::memset(xq + b * xs, 0, 32);
      sx16[2 * b] = sx16[2 * b + 1] = 0;
      continue;
    }
    const float amax = max_all(v_max(v_abs(a0), v_abs(a1)));
    const float d = amax / 127.0f;
    const V16 id = v_set1(d != 0.0f ? 1.0f / d : 0.0f);
    const V16 q0 = v_round(v_mul(a0, id)), q1 = v_round(v_mul(a1, id));  // integers in [-127, 127]
    v_store_i8(xq + b * xs, q0);
    v_store_i8(xq + b * xs + 16, q1);
    dx[b * ds] = d;
    sx16[2 * b] = (int32_t)tree_sum(q0);  // integer sums below 2^11: exact in any order
    sx16[2 * b + 1] = (int32_t)tree_sum(q1);
  }
}

// RoPE of one head x [D] in place at one position: cos/sin [R] the table's row (rotate-half: pairs (i, i + R/2),
// the table's halves equal; interleaved: pairs (2i, 2i + 1)); dimensions past R pass through. Each product rounds,
// then the sum: numerics.rotate's x * cos + x[perm] * (sign * sin).
inline void rope(float* __restrict x, const float* __restrict cs, const float* __restrict sn, int64_t R,
                 bool interleaved) {
  if (interleaved) {  // GLM-4's: lane-wise in every variant as written (scalar pairs)
    for (int64_t i = 0; i < R; i += 2) {
      const float x0 = x[i], x1 = x[i + 1];
      const float a0 = x0 * cs[i], b0 = x1 * sn[i];
      const float a1 = x1 * cs[i + 1], b1 = x0 * sn[i + 1];
      x[i] = a0 - b0;
      x[i + 1] = a1 + b1;
    }
    return;
  }
  const int64_t h = R / 2;
  for (int64_t i = 0; i < h; i += 16) {
    const int m = (int)(h - i < 16 ? h - i : 16);
    const V16 x0 = v_load_n(x + i, m), x1 = v_load_n(x + i + h, m);
    const V16 out0 = v_sub(v_mul(x0, v_load_n(cs + i, m)), v_mul(x1, v_load_n(sn + i, m)));
    const V16 out1 = v_add(v_mul(x1, v_load_n(cs + i + h, m)), v_mul(x0, v_load_n(sn + i + h, m)));
    v_store_n(x + i, out0, m);
    v_store_n(x + i + h, out1, m);
  }
}

// Attention of G query heads q [G][D] (row stride qs, pre-scaled by 1/sqrt(D)) over one KV head's keys
// first..last (inclusive) of one cache row (k, v: [C][D] with row stride ks), into out [G][D] (row stride os).
// The keys go in chunks of CHUNK from `first` (chunk c: the row's keys first + CHUNK c ...): each chunk's scores,
// their maximum, exponentials and sum, and its p-weighted sum of values, then the chunks combined in order (online
// softmax): a query's output depends on nothing but its q and its row's keys first..last.
// scratch: CHUNK + D floats.
inline void attend(const float* __restrict q, int64_t qs, int G, const float* __restrict k,
                   const float* __restrict v, int64_t ks, int64_t first, int64_t last, int64_t D,
                   float* __restrict out, int64_t os, float* __restrict scratch) {
  float* p = scratch;  // [CHUNK] a chunk's scores, then their exponentials (padded to 16 with -inf)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int g = 0; g < G; ++g) {
    const float* qg = q + g * qs;
    float* o = out + g * os;
    float m = 0.0f, l = 0.0f;
    for (int64_t c0 = first; c0 <= last; c0 += CHUNK) {
      const int64_t n = (last - c0 + 1) < CHUNK ? (last - c0 + 1) : CHUNK;
      const int64_t padded = (n + 15) / 16 * 16;
      for (int64_t i = 0; i < n; ++i) p[i] = dot(qg, k + (c0 + i) * ks, D);
      for (int64_t i = n; i < padded; ++i) p[i] = neg_inf;
      V16 vm = v_set1(neg_inf);
      for (int64_t i = 0; i < padded; i += 16) vm = v_max(v_load(p + i), vm);  // a NaN score is never picked
      const float mc = max_all(vm);
      const bool opening = c0 == first;
      const float mn = opening || mc > m ? mc : m;
      const float alpha = opening ? 0.0f : exp1(m - mn);
      V16 vs = v_set1(0.0f);
      for (int64_t i = 0; i < padded; i += 16) {
        const V16 e = v_exp(v_sub(v_load(p + i), v_set1(mn)));
        v_store(p + i, e);
        vs = v_add(vs, e);
      }
      const float sum = tree_sum(vs);
      const V16 va = v_set1(alpha);
      for (int64_t d = 0; d < D; d += 16) {
        const int w = (int)(D - d < 16 ? D - d : 16);
        V16 part = v_set1(0.0f);
        for (int64_t i = 0; i < n; ++i) part = v_fma(v_set1(p[i]), v_load_n(v + (c0 + i) * ks + d, w), part);
        const V16 prev = opening ? v_set1(0.0f) : v_load_n(o + d, w);
        v_store_n(o + d, v_fma(prev, va, part), w);
      }
      l = std::fmaf(l, alpha, sum);
      m = mn;
    }
    const V16 inv = v_set1(1.0f / l);
    for (int64_t d = 0; d < D; d += 16) {
      const int w = (int)(D - d < 16 ? D - d : 16);
      v_store_n(o + d, v_mul(v_load_n(o + d, w), inv), w);
    }
  }
}

// the table of this variant (forward.h)
const Ops OPS = {dot, rms_norm, silu_mul, quantize_row, rope, attend};
