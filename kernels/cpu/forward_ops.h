// The native forward's element-wise and attention ops, written once and compiled once per instruction set: each
// variant's file (qmm.cpp scalar, qmm_avx2.cpp, qmm_avx512.cpp) includes this inside its own namespace under its
// own target pragma, and exports the table `OPS` (forward.h's Ops).
//
// Every reduction is written lane by lane: LANES = 16 partial sums, element d going to lane d % 16 in the order of
// d, then the 16 lanes added in one fixed tree; products are explicit `fmaf`s and the files are compiled with
// -ffp-contract=off, so whatever vector width the compiler picks for a target, every variant performs the same
// float operations in the same order: the same bits on every instruction set. No function here depends on
// anything but its own row (or query) and its arguments: nothing on the batch, T, the thread, or the ISA.
//
// Non-finite values propagate: a NaN or infinity in an activation block gives that block's scale NaN
// (quantize_row), and every op below passes NaN through (the maxima are taken with `>`, which never picks NaN, and
// the NaN then enters through the sums), so a non-finite anywhere in a forward reaches its logits.
//
// (No include guard and no namespace of its own: the including file puts it in qmm::<isa>.)

constexpr int LANES = 16;

// the 16 lanes' sum in a fixed tree
inline float reduce_lanes(const float* a) {
  float b[8], c[4];
  for (int i = 0; i < 8; ++i) b[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) c[i] = b[i] + b[i + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// sum over d < n of x[d] y[d]: lane d % 16, in the order of d
inline float dot(const float* __restrict x, const float* __restrict y, int64_t n) {
  float acc[LANES] = {};
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] = fmaf(x[d + l], y[d + l], acc[l]);
  for (int l = 0; d + l < n; ++l) acc[l] = fmaf(x[d + l], y[d + l], acc[l]);
  return reduce_lanes(acc);
}

// exp(x) for every float x: Cephes' expf (range reduction by ln 2 in two parts, a degree-6 polynomial, 2^n
// built in the exponent bits); 0 below -87, exp(88) above 88, NaN for NaN. Only +, *, fmaf, a rounding to an
// integer and bit moves: the same bits in every lane of every variant.
inline float exp_f(float x) {
  const bool nan = x != x;
  float c = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  c = nan ? 0.0f : c;
  const float n = nearbyintf(c * 1.44269504088896341f);
  float r = fmaf(n, -0.693359375f, c);
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  p = fmaf(p, r * r, r) + 1.0f;
  const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, 4);
  const float y = x < -87.0f ? 0.0f : p * scale;
  return nan ? x : y;
}

// HF's RMSNorm of one row: y = (x * (1 / sqrt(mean(x^2) + eps))) * w   (w may be null: no scale)
inline void rms_norm(const float* __restrict x, const float* __restrict w, int64_t n, float eps,
                     float* __restrict y) {
  const float ss = dot(x, x, n);
  const float inv = 1.0f / std::sqrt(ss / (float)n + eps);
  if (w) {
    for (int64_t d = 0; d < n; ++d) y[d] = (x[d] * inv) * w[d];
  } else {
    for (int64_t d = 0; d < n; ++d) y[d] = x[d] * inv;
  }
}

// y[j] = silu(gate[j]) * up[j], silu(g) = g / (1 + exp(-g))
inline void silu_mul(const float* __restrict gate, const float* __restrict up, int64_t n, float* __restrict y) {
  for (int64_t j = 0; j < n; ++j) y[j] = (gate[j] / (1.0f + exp_f(-gate[j]))) * up[j];
}

// one row of activations x [K] -> int8 xq [K], a float32 scale per block of 32 (dx = max |x| / 127, xq =
// nearbyint(x * (1 / dx)), 0 where dx is 0) and the sums of xq over each group of 16 (sx16 [K / 16]). A block
// holding a NaN or an infinity gets dx = NaN and codes 0: every output it enters is NaN.
inline void quantize_row(const float* __restrict x, int64_t K, int8_t* __restrict xq, float* __restrict dx,
                         int32_t* __restrict sx16) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < 32; ++j) {
      const float a = std::fabs(xb[j]);
      amax = a > amax ? a : amax;
      finite = finite && (xb[j] - xb[j] == 0.0f);  // false for NaN and for +-inf
    }
    const float d = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const float id = finite && d != 0.0f ? 1.0f / d : 0.0f;
    int32_t s0 = 0, s1 = 0;
    for (int j = 0; j < 32; ++j) {
      const int8_t q = (int8_t)(int32_t)nearbyintf(xb[j] * id);  // |x * id| <= 127.5: in range (finite blocks)
      xq[32 * b + j] = finite ? q : 0;
      (j < 16 ? s0 : s1) += finite ? q : 0;
    }
    dx[b] = d;
    sx16[2 * b] = s0;
    sx16[2 * b + 1] = s1;
  }
}

// RoPE of one head x [D] in place at one position: cos/sin [R] the table's row (rotate-half: pairs (i, i + R/2),
// the tables' halves equal; interleaved: pairs (2i, 2i + 1)); dimensions past R pass through. Each product rounds,
// then the sum: numerics.rotate's x * cos + x[perm] * (sign * sin).
inline void rope(float* __restrict x, const float* __restrict cs, const float* __restrict sn, int64_t R,
                 bool interleaved) {
  if (interleaved) {
    for (int64_t i = 0; i < R; i += 2) {
      const float x0 = x[i], x1 = x[i + 1];
      const float a0 = x0 * cs[i], b0 = x1 * sn[i];
      const float a1 = x1 * cs[i + 1], b1 = x0 * sn[i + 1];
      x[i] = a0 - b0;
      x[i + 1] = a1 + b1;
    }
  } else {
    const int64_t h = R / 2;
    for (int64_t i = 0; i < h; ++i) {
      const float x0 = x[i], x1 = x[i + h];
      const float a0 = x0 * cs[i], b0 = x1 * sn[i];
      const float a1 = x1 * cs[i + h], b1 = x0 * sn[i + h];
      x[i] = a0 - b0;
      x[i + h] = a1 + b1;
    }
  }
}

// Attention of G query heads q [G][D] (row stride qs, pre-scaled by 1/sqrt(D)) over one KV head's keys
// first..last (inclusive) of one cache row (k, v: [C][D] with row stride ks), into out [G][D] (row stride os).
// The keys go in chunks of CHUNK from `first` (chunk c: the row's keys first + CHUNK c ...), each chunk's scores,
// maximum, exponentials and sums in key order, the chunks combined in order (online softmax): a query's output
// depends on nothing but its own q and its row's keys first..last. scratch: CHUNK floats + D floats.
constexpr int64_t CHUNK = 64;

inline void attend(const float* __restrict q, int64_t qs, int G, const float* __restrict k,
                   const float* __restrict v, int64_t ks, int64_t first, int64_t last, int64_t D,
                   float* __restrict out, int64_t os, float* __restrict scratch) {
  float* p = scratch;            // [CHUNK] a chunk's scores, then their exponentials
  float* part = scratch + CHUNK;  // [D] a chunk's sum of p v
  for (int g = 0; g < G; ++g) {
    const float* qg = q + g * qs;
    float* o = out + g * os;
    float m = 0.0f, l = 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    for (int64_t c0 = first; c0 <= last; c0 += CHUNK) {
      const int64_t n = (last - c0 + 1) < CHUNK ? (last - c0 + 1) : CHUNK;
      float mc = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        p[i] = dot(qg, k + (c0 + i) * ks, D);
        mc = p[i] > mc ? p[i] : mc;
      }
      const bool opening = c0 == first;
      const float mn = opening || mc > m ? mc : m;
      const float alpha = opening ? 0.0f : exp_f(m - mn);
      float sum = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        p[i] = exp_f(p[i] - mn);
        sum += p[i];
      }
      for (int64_t d = 0; d < D; ++d) part[d] = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        const float* vr = v + (c0 + i) * ks;
        const float pi = p[i];
        for (int64_t d = 0; d < D; ++d) part[d] = fmaf(pi, vr[d], part[d]);
      }
      for (int64_t d = 0; d < D; ++d) o[d] = fmaf(o[d], alpha, part[d]);
      l = fmaf(l, alpha, sum);
      m = mn;
    }
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < D; ++d) o[d] = o[d] * inv;
  }
}

// the table of this variant (forward.h)
const Ops OPS = {dot, rms_norm, silu_mul, quantize_row, rope, attend};
