// specdec's CPU matmul for quantized weights: what every instruction-set variant shares.
//
// y[m, n] = sum_k x[m, k] w[n, k] with W held as models/ggml_blocks.py's packed tiles (16 output rows a tile,
// 32 input columns a group of codes): w = a u + b per group, a = Da sa, b = Db sb (or OFF a), u an unsigned
// BITS-bit code stored as a low nibble plane and a BITS - 4 bit high plane. x is quantized a row at a time
// to int8 in blocks of 32 (dx = max |x| / 127, xq = nearbyint(x / dx), llama.cpp's Q8_0 rule with a float32
// scale); the codes times xq are summed in int32 (exact), and each group adds
//     acc = fma(float(isum), a * dx, acc); acc = fma(b, dx * float(sum xq), acc)        (HAS_B)
//     acc = fma(float(isum + OFF * sum xq), a * dx, acc)                                (otherwise)
// in the order of k. Every variant (scalar, AVX2, AVX-512 VNNI) performs exactly these float operations per
// output, whatever M is, whichever row block or thread computes it: a row's bits never depend on what else
// is in the call, the number of threads, or the instruction set.
#pragma once
#include <cstdint>
#include <cstring>

namespace qmm {

struct TypeInfo {
  int bits, group, superblock;
  bool sub, has_b;
  int off;
};

// index = the type id of models/ggml_blocks.py's TYPES
constexpr TypeInfo TYPES[8] = {
    {4, 32, 32, false, false, -8},     // Q4_0
    {4, 32, 32, false, true, 0},       // Q4_1
    {5, 32, 32, false, false, -16},    // Q5_0
    {5, 32, 32, false, true, 0},       // Q5_1
    {8, 32, 32, false, false, -128},   // Q8_0
    {4, 32, 256, true, true, 0},       // Q4_K
    {5, 32, 256, true, true, 0},       // Q5_K
    {6, 16, 256, true, false, -32},    // Q6_K
};
constexpr int NUM_TYPES = 8;

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

constexpr int code_bytes(int bits) { return 256 + 64 * (bits - 4); }

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
  }                                                                      \
  return false;

// the instruction-set variants (each in its own file, compiled for its target)
void qmm_scalar(int type, const Args& a, int64_t t0, int64_t t1);
bool qmm_avx2(int type, const Args& a, int64_t t0, int64_t t1);
bool qmm_avx512(int type, const Args& a, int64_t t0, int64_t t1);

}  // namespace qmm
