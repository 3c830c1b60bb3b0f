// specdec's CPU matmul for quantized weights: the scalar variant (the portable one; the others must give its bits),
// the host's instruction set, and the scalar variant of the native forward's ops. See qmm_common.h; the matmul's
// entry point and the activations' quantization are forward.cpp's.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "forward.h"

namespace qmm {

// ---------------------------------------------------------------------------------------------- scalar
void qmm_scalar(int type, const Args& a, int64_t t0, int64_t t1) {
  const TypeInfo ti = TYPES[type];
  const int64_t K = a.K, nsb = K / ti.superblock, nkb = K / 32, ng = K / ti.group;
  const int cb = code_bytes(ti.bits), gpk = 32 / ti.group;
  std::vector<float> acc(16);
  uint8_t u[16][32];  // U of the tile's 16 rows x the group's 32 columns
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t m = 0; m < a.M; ++m) {
      for (int i = 0; i < 16; ++i) acc[i] = 0.0f;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const uint8_t* p = a.codes + (t * nkb + kb) * cb;
        for (int c = 0; c < 8; ++c)  // the chunk vector U_c: byte 4 i + j = u[i][4 c + j]
          for (int b = 0; b < 64; ++b) u[b / 4][4 * c + b % 4] = (uint8_t)code_at(ti, p, c, b);
        const int64_t s = kb * 32 / ti.superblock;
        for (int h = 0; h < gpk; ++h) {
          const int64_t g = kb * gpk + h;
          const float d = a.dx[kb * a.Q + m];
          const int8_t* xr = a.xq + (kb * a.Q + m) * 32 + h * ti.group;
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
              acc[i] = std::fmaf(bv, a.dsx[g * a.Q + m], acc[i]);
            } else {
              acc[i] = std::fmaf((float)(isum + a.osx[g * a.Q + m]), av * d, acc[i]);
            }
          }
        }
      }
      for (int i = 0; i < 16 && t * 16 + i < a.n; ++i) a.y[m * a.ldy + t * 16 + i] = acc[i];
    }
  }
}

int best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

namespace scalar_ops {
#define SIMD16_ISA 0
#include "forward_ops.h"
#undef SIMD16_ISA
}  // namespace scalar_ops

const Ops& ops_scalar() { return scalar_ops::OPS; }

}  // namespace qmm

using namespace qmm;

extern "C" {

// The best instruction set this host runs: 2 AVX-512 VNNI, 1 AVX2 + FMA, 0 scalar.
int specdec_qmm_isa(void) { return best_isa(); }

}  // extern "C"
