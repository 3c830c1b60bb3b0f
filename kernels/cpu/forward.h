// specdec's native CPU forward (forward.cpp): a decoder-only transformer whose linear layers are qmm_common.h's
// packed quantized blocks, run as one call for the whole stack of layers, the final norm and the head.
#pragma once
#include <cstdint>
#include <vector>

#include "qmm_common.h"

namespace qmm {

constexpr int64_t ATTN_CHUNK = 64;  // attention's keys reduced together, from each row's first key (forward_ops.h)

// the element-wise and attention ops of one instruction set (forward_ops.h, compiled once per variant)
struct Ops {
  float (*dot)(const float*, const float*, int64_t);
  void (*rms_norm)(const float* x, const float* w, int64_t n, float eps, float* y);
  void (*silu_mul)(const float* gate, const float* up, int64_t n, float* y);
  void (*quantize_row)(const float* x, int64_t K, int8_t* xq, int64_t xs, float* dx, int64_t ds, int32_t* sx16);
  void (*rope)(float* x, const float* cos, const float* sin, int64_t R, bool interleaved);
  void (*attend)(const float* q, int64_t qs, int G, const float* k, const float* v, int64_t ks, int64_t first,
                 int64_t last, int64_t D, float* out, int64_t os, float* scratch);
};
const Ops& ops_scalar();
const Ops& ops_avx2();
const Ops& ops_avx512();

// one block-type part of a linear layer's weight: output rows row0 .. row0 + n - 1
struct Part {
  int type = -1;
  int64_t row0 = 0, n = 0, tiles = 0;
  const uint8_t* codes = nullptr;
  const uint16_t* da = nullptr;
  const uint16_t* db = nullptr;
  const int8_t* sa = nullptr;
  const int8_t* sb = nullptr;
  const float* bias = nullptr;  // [n] or null
};

struct Linear {
  std::vector<Part> parts;  // in row order, covering rows 0 .. N - 1
  int64_t N = 0, K = 0;
};

struct Layer {
  const float* attn_norm = nullptr;   // [E]
  const float* mlp_norm = nullptr;    // [E]
  const float* q_norm = nullptr;      // [D] (Qwen3)
  const float* k_norm = nullptr;      // [D]
  const float* attn_post = nullptr;   // [E] GLM-4's post_self_attn_layernorm
  const float* mlp_post = nullptr;    // [E] GLM-4's post_mlp_layernorm
  Linear qkv, o, gate_up, down;       // q/k/v rows [(H + 2 H_kv) D, E]; gate rows then up rows [2 I, E]
};

// what a forward needs room for, sized by the largest call so far (no allocation once the sizes have been seen)
struct Workspace {
  std::vector<float> h, x, qkv, attn, y, gu, act;  // [M, E], [M, E], [M, (H + 2 H_kv) D], [M, H D], [M, max], ...
  // the quantized rows, group-major (qmm_common.h's Args): M row slots
  std::vector<int8_t> xq;                            // [max K / 32, M, 32]
  std::vector<float> dx;                             // [max K / 32, M]
  std::vector<int32_t> sx16;                         // [M, max K / 16]
  std::vector<float> terms_f;                        // per part: [K / G, M] dx * float(sx)  (HAS_B)
  std::vector<int32_t> terms_i;                      // per part: [K / G, M] OFF * sx          (otherwise)
  std::vector<int64_t> pos, col;                     // [M]
  std::vector<float> scratch;                        // [threads, CHUNK + D]
  double seconds[4] = {};                            // the last forward's clock readings
};

struct Model {
  int64_t E = 0, H = 0, Hkv = 0, D = 0, I = 0, L = 0, V = 0, R = 0;
  float eps = 1e-6f;
  bool interleaved = false;
  std::vector<Layer> layers;
  const float* final_norm = nullptr;
  Linear head;         // [V, E]
  Linear embed;        // the embedding as packed blocks [V, E] (or:)
  const float* embed_float = nullptr;  // [V, E] float32
  Workspace ws;
  double timings[4] = {};  // the last forward's seconds (embedding, layers, head) and threads (specdec_model_timings)
};

}  // namespace qmm
