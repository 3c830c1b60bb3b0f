// specdec's CPU matmul for quantized weights: the C entry points, the activations' quantization, the
// threads, and the scalar variant (the portable one; the others must give its bits). See qmm_common.h.
#include <cmath>
#include <cstdlib>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "qmm_common.h"

namespace qmm {

// ---------------------------------------------------------------------------------------------- scalar
void qmm_scalar(int type, const Args& a, int64_t t0, int64_t t1) {
  const TypeInfo ti = TYPES[type];
  const int64_t K = a.K, nsb = K / ti.superblock, nkb = K / 32, ng = K / ti.group;
  const int cb = code_bytes(ti.bits), hb = ti.bits - 4, gpk = 32 / ti.group;
  std::vector<float> acc(16);
  uint8_t u[16][32];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t m = 0; m < a.M; ++m) {
      for (int i = 0; i < 16; ++i) acc[i] = 0.0f;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const uint8_t* p = a.codes + (t * nkb + kb) * cb;
        for (int c = 0; c < 8; ++c) {  // the chunk vector U_c: byte 4 i + j = u[i][4 c + j]
          for (int b = 0; b < 64; ++b) {
            const uint8_t lo = c < 4 ? (p[64 * c + b] & 15) : (p[64 * (c - 4) + b] >> 4);
            uint8_t hi = 0;
            if (hb > 0) hi = (p[256 + 64 * (c % hb) + b] >> ((c / hb) * hb)) & ((1 << hb) - 1);
            u[b / 4][4 * c + b % 4] = lo | (hi << 4);
          }
        }
        const int64_t s = kb * 32 / ti.superblock;
        for (int h = 0; h < gpk; ++h) {
          const int64_t g = kb * gpk + h;
          const float d = a.dx[m * nkb + kb];
          const int8_t* xr = a.xq + m * K + kb * 32 + h * ti.group;
          for (int i = 0; i < 16; ++i) {
            float av = half_to_float(a.da[(t * nsb + s) * 16 + i]);
            float bv = ti.has_b ? half_to_float(a.db[(t * nsb + s) * 16 + i]) : 0.0f;
            if (ti.sub) {
              av = av * (float)a.sa[(t * ng + g) * 16 + i];
              if (ti.has_b) bv = bv * (float)a.sb[(t * ng + g) * 16 + i];
            }
            int32_t isum = 0;
            for (int k = 0; k < ti.group; ++k) isum += (int32_t)u[i][h * ti.group + k] * (int32_t)xr[k];
            if (ti.has_b) {
              acc[i] = std::fmaf((float)isum, av * d, acc[i]);
              acc[i] = std::fmaf(bv, a.dsx[m * ng + g], acc[i]);
            } else {
              acc[i] = std::fmaf((float)(isum + a.osx[m * ng + g]), av * d, acc[i]);
            }
          }
        }
      }
      for (int i = 0; i < 16 && t * 16 + i < a.n; ++i) a.y[m * a.ldy + t * 16 + i] = acc[i];
    }
  }
}

// ------------------------------------------------------------------------------------ activations
// x [M, K] float32 (row stride ldx) -> xq int8 [M, K], dx [M, K/32] and the bias terms of type ti per group of
// G: dsx = dx * float(sx) (HAS_B) or osx = OFF * sx, sx the group's sum of xq. Per block of 32,
// dx = max |x| / 127, xq = nearbyint(x * (1 / dx)) (0 where dx is 0).
static void quantize_row(const float* x, int64_t K, const TypeInfo& ti, int8_t* xq, float* dx, float* dsx,
                         int32_t* osx) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t s0 = 0, s1 = 0;
    for (int j = 0; j < 32; ++j) {
      const int8_t q = (int8_t)std::nearbyint(xb[j] * id);
      xq[32 * b + j] = q;
      (j < 16 ? s0 : s1) += q;
    }
    dx[b] = d;
    const int32_t sums[2] = {s0, s1};
    for (int h = 0; h < 32 / ti.group; ++h) {
      const int32_t sx = ti.group == 32 ? s0 + s1 : sums[h];
      const int64_t g = b * (32 / ti.group) + h;
      if (ti.has_b) dsx[g] = d * (float)sx;
      else osx[g] = ti.off * sx;
    }
  }
}

static int best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

}  // namespace qmm

using namespace qmm;

extern "C" {

// The best instruction set this host runs: 2 AVX-512 VNNI, 1 AVX2 + FMA, 0 scalar.
int specdec_qmm_isa(void) { return best_isa(); }

// y [M, n] (row stride ldy) = x [M, K] (float32, row stride ldx) times the packed weight's transpose.
// isa: -1 the best this host runs, else 0/1/2 (an unsupported one is refused: returns 2).
// Returns 0, or 1 for a bad argument, 2 for an instruction set this host cannot run.
int specdec_qmm(int type, int isa, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* codes,
                const uint16_t* da, const uint16_t* db, const int8_t* sa, const int8_t* sb, int64_t T, float* y,
                int64_t ldy, int64_t n) {
  if (type < 0 || type >= NUM_TYPES || K % TYPES[type].superblock || M < 0 || n > 16 * T) return 1;
  const int host = best_isa();
  if (isa < 0) isa = host;
  if (isa > host) return 2;
  if (M == 0 || T == 0) return 0;
  const TypeInfo& ti = TYPES[type];
  const int64_t ng = K / ti.group;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * (K / 32)), dsx(ti.has_b ? M * ng : 0);
  std::vector<int32_t> osx(ti.has_b ? 0 : M * ng);
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * ldx, K, ti, xq.data() + m * K, dx.data() + m * (K / 32),
                 ti.has_b ? dsx.data() + m * ng : nullptr, ti.has_b ? nullptr : osx.data() + m * ng);
  const Args a{xq.data(), dx.data(), dsx.data(), osx.data(), M, K, T, codes, da, db, sa, sb, y, ldy, n};
#pragma omp parallel
  {
#ifdef _OPENMP
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
    const int64_t nt = 1, id = 0;
#endif
    const int64_t t0 = T * id / nt, t1 = T * (id + 1) / nt;  // contiguous tiles: each thread streams its own
    bool done = false;
    if (isa == 2) done = qmm_avx512(type, a, t0, t1);
    if (!done && isa >= 1) done = qmm_avx2(type, a, t0, t1);
    if (!done) qmm_scalar(type, a, t0, t1);
  }
  return 0;
}

}  // extern "C"
