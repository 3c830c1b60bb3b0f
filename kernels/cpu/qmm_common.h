// specdec's CPU matmul for quantized weights: what every instruction-set variant shares.
//
// y[m, n] = sum_k x[m, k] w[n, k] with W held as models/ggml_blocks.py's packed tiles (16 output rows a tile,
// 32 input columns a group of codes): w = a U + b per group, a = Da sa, b = Db sb (or OFF a), U = u an unsigned
// BITS-bit code stored as a low plane of LB bits (LB = 4, or 2 for the 2- and 3-bit codes of Q2_K and Q3_K) and a
// high plane of BITS - LB bits (64 BITS bytes per 16 rows x 32 columns: models/ggml_blocks.py's docstring gives the
// layout), or for the TABLE types (IQ4_NL, IQ4_XS) U = IQ4_VALUES[u] of a 4-bit index u (llama.cpp's non-linear
// values + 128, OFF = -128: mapped by a byte shuffle where the codes are unpacked). x is quantized a row at a time
// to int8 in blocks of 32 (dx = max |x| / 127, xq = nearbyint(x / dx), llama.cpp's Q8_0 rule with a float32
// scale); U times xq is summed in int32 over the group (exact), and each group adds
//     acc = fma(float(isum), a * dx, acc); acc = fma(b, dx * float(sum xq), acc)        (HAS_B)
//     acc = fma(float(isum + OFF * sum xq), a * dx, acc)                                (otherwise)
// in the order of k. Every variant (scalar, AVX2, AVX-512 VNNI) performs exactly these float operations per
// output, whatever M is, whichever row block or thread computes it: a row's bits never depend on what else
// is in the call, the number of threads, or the instruction set. (The integer isum + OFF * sum xq may be
// formed another way where it is the same integer: AVX2 sums (U - 128) xq for the TABLE types.)
#pragma once
#include <cstdint>
#include <cstring>

namespace qmm {

struct TypeInfo {
  int bits, group, superblock;
  bool sub, has_b;
  int off;
  bool table;  // U = IQ4_VALUES[u] (u a 4-bit index); else U = u
};

// index = the type id of models/ggml_blocks.py's TYPES
constexpr TypeInfo TYPES[12] = {
    {4, 32, 32, false, false, -8, false},     // Q4_0
    {4, 32, 32, false, true, 0, false},       // Q4_1
    {5, 32, 32, false, false, -16, false},    // Q5_0
    {5, 32, 32, false, true, 0, false},       // Q5_1
    {8, 32, 32, false, false, -128, false},   // Q8_0
    {4, 32, 256, true, true, 0, false},       // Q4_K
    {5, 32, 256, true, true, 0, false},       // Q5_K
    {6, 16, 256, true, false, -32, false},    // Q6_K
    {2, 16, 256, true, true, 0, false},       // Q2_K
    {3, 16, 256, true, false, -4, false},     // Q3_K
    {4, 32, 32, false, false, -128, true},    // IQ4_NL
    {4, 32, 256, true, false, -128, true},    // IQ4_XS
};
constexpr int NUM_TYPES = 12;

// llama.cpp's kvalues_iq4nl + 128 (models/ggml_blocks.py's IQ4_VALUES), and the signed values themselves
alignas(16) constexpr uint8_t IQ4_VALUES[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                                129, 141, 153, 166, 181, 197, 217, 241};
alignas(16) constexpr int8_t IQ4_SIGNED[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

struct Args {
  // the activations group-major (a column group's rows side by side: row r of a group at a constant offset), rows
  // 0 .. M - 1 of Q >= M slots
  const int8_t* xq;    // [K / 32, Q, 32] as int8
  const float* dx;     // [K / 32, Q] their scales
  // per group of G columns and row, from sx = the sum of xq over the group: the bias term's factor
  const float* dsx;    // [K / G, Q] dx * float(sx)   (HAS_B)
  const int32_t* osx;  // [K / G, Q] OFF * sx         (otherwise)
  int64_t M, K, T;     // rows, in features, tiles of 16 output rows
  int64_t Q;           // row slots of the activations' layout
  const uint8_t* codes;  // [T, K / 32, CB]
  const uint16_t* da;    // [T, K / SB, 16] float16
  const uint16_t* db;    // [T, K / SB, 16] float16 (HAS_B)
  const int8_t* sa;      // [T, K / G, 16] (SUB)
  const int8_t* sb;      // [T, K / G, 16] (SUB and HAS_B)
  float* y;              // [M, n] out, row stride ldy
  int64_t ldy, n;
};

constexpr int code_bytes(int bits) { return 64 * bits; }  // per 16 rows x 32 columns
constexpr int low_bits(int bits) { return bits >= 4 ? 4 : 2; }  // LB: the low plane's bits a code

// chunk c's code of byte b (row b / 4, column 4 c + b % 4) in a group's codes p: the low plane's field, the high
// plane's above it (models/ggml_blocks.py's layout), then U (the TABLE types' value)
inline int code_at(const TypeInfo& ti, const uint8_t* p, int c, int b) {
  const int lb = low_bits(ti.bits), hb = ti.bits - lb;
  int u = (p[64 * (c % lb) + b] >> ((c / lb) * lb)) & ((1 << lb) - 1);
  if (hb > 0) u |= ((p[64 * lb + 64 * (c % hb) + b] >> ((c / hb) * hb)) & ((1 << hb) - 1)) << lb;
  return ti.table ? IQ4_VALUES[u] : u;
}


inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

typedef int32_t __attribute__((may_alias, aligned(1))) unaligned_i32;

inline int32_t load_i32(const int8_t* p) { return *reinterpret_cast<const unaligned_i32*>(p); }

// a variant's entry point: runs TILES<type>(a, t0, t1) for a run-time type id and returns true (false: no such type)
#define QMM_DISPATCH_TYPES(TILES, type, a, t0, t1)                       \
  switch (type) {                                                        \
    case 0: TILES<0>(a, t0, t1); return true;                            \
    case 1: TILES<1>(a, t0, t1); return true;                            \
    case 2: TILES<2>(a, t0, t1); return true;                            \
    case 3: TILES<3>(a, t0, t1); return true;                            \
    case 4: TILES<4>(a, t0, t1); return true;                            \
    case 5: TILES<5>(a, t0, t1); return true;                            \
    case 6: TILES<6>(a, t0, t1); return true;                            \
    case 7: TILES<7>(a, t0, t1); return true;                            \
    case 8: TILES<8>(a, t0, t1); return true;                            \
    case 9: TILES<9>(a, t0, t1); return true;                            \
    case 10: TILES<10>(a, t0, t1); return true;                          \
    case 11: TILES<11>(a, t0, t1); return true;                          \
  }                                                                      \
  return false;

// the best instruction set this host runs: 2 AVX-512 VNNI, 1 AVX2 + FMA, 0 scalar (qmm.cpp)
int best_isa();

// the instruction-set variants (each in its own file, compiled for its target)
void qmm_scalar(int type, const Args& a, int64_t t0, int64_t t1);
bool qmm_avx2(int type, const Args& a, int64_t t0, int64_t t1);
bool qmm_avx512(int type, const Args& a, int64_t t0, int64_t t1);

}  // namespace qmm
