// specdec's native CPU forward: the whole decoder stack, the final norm and the head in one call, for every T and
// every cache layout (forward.h; the Python side is kernels/forward_cpu.py and models/native.py).
//
// A step feeds T tokens to each of B rows (M = B T token rows, m = b T + t). Row b holds its logical token i at
// cache column start[b] + i and has length[b] tokens cached; num_new[b] of its T tokens are real (the rest padding:
// on the left in the left-padded layout, on the right in the ragged one), exactly as kernels/positions.py's
// step_plan: token t is logical index length[b] + t (- (T - num_new[b]) left-padded), written at column
// start[b] + index and rotated at position max(index, 0); it attends to columns start[b] .. its own (a padding
// token left of start[b] attends to nothing and gets zeros).
//
// Per layer, in one OpenMP region (phases separated by barriers):
//   norm + quantize the rows once (int8 per block of 32, shared by every part of q/k/v) -> q/k/v matmul (the tiles
//   of all parts split between the threads by bytes) -> bias, q/k norm, RoPE, K and V into the cache -> attention
//   (per row, token and KV head; forward_ops.h's fixed chunks from each row's first key) -> quantize -> o matmul
//   -> residual (GLM-4: normed first) -> norm + quantize -> gate/up matmul -> SiLU * up + quantize -> down matmul
//   -> residual.
// Every op is row-local in a fixed order (qmm_common.h, forward_ops.h) and the thread split decides only who
// computes a value, never how: a token's logits are the same bits alone, in any batch, at any T, at any thread
// count and on every instruction set.
#include "forward.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>  // std::nothrow
#ifdef _OPENMP
#include <omp.h>
#endif

namespace qmm {

template <typename T>
void ensure(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

namespace {

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr int MAX_PARTS = 8;        // block-type parts of one linear layer

// the bytes of one tile of a part (its share of a matmul's reads): codes (64 BITS bytes a group of 32 columns, every
// type), float16 da (and db) per super-block, int8 sa (and sb) per group
int64_t tile_bytes(const Part& p, int64_t K) {
  const TypeInfo& ti = TYPES[p.type];
  int64_t bytes = (K / 32) * code_bytes(ti.bits) + (K / ti.superblock) * 16 * 2 * (ti.has_b ? 2 : 1);
  if (ti.sub) bytes += (K / ti.group) * 16 * (ti.has_b ? 2 : 1);
  return bytes;
}

// row r of a packed part, dequantized as models/ggml_blocks.py's dequantize does: w = a U + b in float32 (U: the
// code, or the TABLE types' value of it; qmm_common.h's code_at reads the planes of every BITS)
void dequantize_row(const Part& p, int64_t r, int64_t K, float* out) {
  const TypeInfo ti = TYPES[p.type];
  const int64_t nsb = K / ti.superblock, nkb = K / 32, ng = K / ti.group, t = r / 16;
  const int i = (int)(r % 16), cb = code_bytes(ti.bits);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const uint8_t* c = p.codes + (t * nkb + kb) * cb;
    const int64_t s = kb * 32 / ti.superblock;
    const float da = half_to_float(p.da[(t * nsb + s) * 16 + i]);
    const float db = ti.has_b ? half_to_float(p.db[(t * nsb + s) * 16 + i]) : 0.0f;
    for (int ch = 0; ch < 8; ++ch) {
      for (int j = 0; j < 4; ++j) {
        const int64_t k = kb * 32 + 4 * ch + j, g = k / ti.group;
        const float a = ti.sub ? da * (float)p.sa[(t * ng + g) * 16 + i] : da;
        float bv;
        if (ti.has_b) bv = ti.sub ? db * (float)p.sb[(t * ng + g) * 16 + i] : db;
        else bv = (float)ti.off * a;
        out[k] = a * (float)code_at(ti, c, ch, 4 * i + j) + bv;
      }
    }
  }
}


void run_tiles(int isa, int type, const Args& a, int64_t t0, int64_t t1) {
  bool done = false;
  if (isa == 2) done = qmm_avx512(type, a, t0, t1);
  if (!done && isa >= 1) done = qmm_avx2(type, a, t0, t1);
  if (!done) qmm_scalar(type, a, t0, t1);
}

// rows [lo, hi) of x [., K] (row stride ldx): quantized once into the workspace's M row slots (xq, dx group-major;
// forward_ops.h's quantize_row), then every part's bias terms from them (dx * float(sum over a group) with HAS_B,
// else OFF * sum: qmm_common.h's Args), laid out [K / G, M] per part
void quantize_rows(const Ops& ops, Workspace& w, int64_t M, const float* x, int64_t ldx, const Linear& lin,
                   int64_t lo, int64_t hi) {
  const int64_t K = lin.K, n16 = K / 16;
  for (int64_t m = lo; m < hi; ++m) {
    int32_t* s16 = w.sx16.data() + m * n16;
    const float* d = w.dx.data() + m;  // block b's scale at d[b M]
    ops.quantize_row(x + m * ldx, K, w.xq.data() + m * 32, M * 32, w.dx.data() + m, M, s16);
    for (size_t pi = 0; pi < lin.parts.size(); ++pi) {
      const TypeInfo& ti = TYPES[lin.parts[pi].type];
      const int64_t ng = K / ti.group;
      float* f = w.terms_f.data() + pi * M * n16 + m;  // group g's at [g M]
      int32_t* o = w.terms_i.data() + pi * M * n16 + m;
      for (int64_t g = 0; g < ng; ++g) {
        const int32_t sx = ti.group == 32 ? s16[2 * g] + s16[2 * g + 1] : s16[g];
        if (ti.has_b) f[g * M] = d[(g * ti.group / 32) * M] * (float)sx;
        else o[g * M] = ti.off * sx;
      }
    }
  }
}

// y [rows, lin.N] (row stride ldy) = the quantized rows 0 .. rows - 1 times lin's weight, no bias: this thread's
// tiles (every part's tiles in order, split between the threads by their bytes: each streams its own range)
void matmul(int isa, Workspace& w, int64_t M, const Linear& lin, int64_t rows, float* y, int64_t ldy, int tid,
            int nt) {
  const int64_t K = lin.K, n16 = K / 16;
  int64_t total = 0;
  for (const Part& p : lin.parts) total += p.tiles * tile_bytes(p, K);
  const int64_t lo = total * tid / nt, hi = total * (tid + 1) / nt;  // this thread's bytes
  int64_t at = 0;
  for (size_t pi = 0; pi < lin.parts.size(); ++pi) {
    const Part& p = lin.parts[pi];
    const int64_t tb = tile_bytes(p, K), end = at + p.tiles * tb;
    // the tiles whose first byte lies in [lo, hi)
    const int64_t t0 = lo <= at ? 0 : (lo - at + tb - 1) / tb;
    const int64_t t1 = hi >= end ? p.tiles : (hi - at + tb - 1) / tb;
    at = end;
    if (t0 >= t1) continue;
    const Args a{w.xq.data(), w.dx.data(), w.terms_f.data() + pi * M * n16, w.terms_i.data() + pi * M * n16,
                 rows, K, p.tiles, M, p.codes, p.da, p.db, p.sa, p.sb, y + p.row0, ldy, p.n};
    run_tiles(isa, p.type, a, t0, t1);
  }
}

// room in the workspace for M rows of inputs up to K wide, quantized for linears of up to MAX_PARTS parts
void ensure_quantized(Workspace& w, int64_t M, int64_t K) {
  ensure(w.xq, M * K), ensure(w.dx, M * K / 32), ensure(w.sx16, M * K / 16);
  ensure(w.terms_f, MAX_PARTS * M * K / 16), ensure(w.terms_i, MAX_PARTS * M * K / 16);
}

struct Step {
  Model& md;
  const Ops& ops;
  int isa;
  int64_t B, T, M;
  const int64_t* start;
  float* kv;
  const int64_t* kvs;  // strides of kv in elements: layer, K/V, row, head, column (D contiguous)
  const float* cos_t;  // [rows, R] the RoPE table, by position
  const float* sin_t;
  int64_t layers;      // the layers to run (all but for checks: the cache's first layers)

  void quantize_rows(const float* x, const Linear& lin, int64_t lo, int64_t hi) {
    qmm::quantize_rows(ops, md.ws, M, x, lin.K, lin, lo, hi);
  }

  void matmul(const Linear& lin, int64_t rows, float* y, int64_t ldy, int tid, int nt) {
    qmm::matmul(isa, md.ws, M, lin, rows, y, ldy, tid, nt);
  }

  // y [m, :] += every part's bias, rows [lo, hi)
  static void add_bias(const Linear& lin, float* y, int64_t ldy, int64_t lo, int64_t hi) {
    for (const Part& p : lin.parts) {
      if (!p.bias) continue;
      for (int64_t m = lo; m < hi; ++m)
        for (int64_t j = 0; j < p.n; ++j) y[m * ldy + p.row0 + j] += p.bias[j];
    }
  }

  float* cache_at(int64_t layer, int which, int64_t b, int64_t head, int64_t column) const {
    return kv + layer * kvs[0] + which * kvs[1] + b * kvs[2] + head * kvs[3] + column * kvs[4];
  }

  void run(int tid, int nt) {
    Model& m = md;
    Workspace& w = m.ws;
    const int64_t E = m.E, H = m.H, Hkv = m.Hkv, D = m.D, I = m.I, NQ = (H + 2 * Hkv) * D;
    const int G = (int)(H / Hkv);
    const float scale = 1.0f / std::sqrt((float)D);
    int64_t r0, r1;  // this thread's token rows
    r0 = M * tid / nt;
    r1 = M * (tid + 1) / nt;
    float* h = w.h.data();
    float* x = w.x.data();
    float* scratch = w.scratch.data() + tid * (ATTN_CHUNK + D);
    for (int64_t l = 0; l < layers; ++l) {
      const Layer& ly = m.layers[l];
      // norm + quantize for q/k/v
      for (int64_t r = r0; r < r1; ++r) ops.rms_norm(h + r * E, ly.attn_norm, E, m.eps, x + r * E);
      quantize_rows(x, ly.qkv, r0, r1);
#pragma omp barrier
      matmul(ly.qkv, M, w.qkv.data(), NQ, tid, nt);
#pragma omp barrier
      // bias, q/k norm, RoPE; K and V into the cache
      for (int64_t r = r0; r < r1; ++r) {
        float* row = w.qkv.data() + r * NQ;
        add_bias(ly.qkv, w.qkv.data(), NQ, r, r + 1);
        const int64_t b = r / T;
        const float* cs = cos_t + w.pos[r] * m.R;
        const float* sn = sin_t + w.pos[r] * m.R;
        for (int64_t hd = 0; hd < H + Hkv; ++hd) {
          float* v = row + hd * D;
          if (m.layers[l].q_norm) ops.rms_norm(v, hd < H ? ly.q_norm : ly.k_norm, D, m.eps, v);
          ops.rope(v, cs, sn, m.R, m.interleaved);
          if (hd < H)
            for (int64_t d = 0; d < D; ++d) v[d] = v[d] * scale;
        }
        for (int64_t g = 0; g < Hkv; ++g) {
          std::memcpy(cache_at(l, 0, b, g, w.col[r]), row + (H + g) * D, D * sizeof(float));
          std::memcpy(cache_at(l, 1, b, g, w.col[r]), row + (H + Hkv + g) * D, D * sizeof(float));
        }
      }
#pragma omp barrier
      // attention: tasks (row, token, KV head)
      {
        const int64_t tasks = M * Hkv, a0 = tasks * tid / nt, a1 = tasks * (tid + 1) / nt;
        for (int64_t task = a0; task < a1; ++task) {
          const int64_t r = task / Hkv, g = task % Hkv, b = r / T;
          float* out = w.attn.data() + r * H * D + g * G * D;
          const int64_t first = start[b], last = w.col[r];
          if (last < first) {  // a padding token left of the row's first key: it sees nothing
            std::memset(out, 0, G * D * sizeof(float));
            continue;
          }
          ops.attend(w.qkv.data() + r * NQ + g * G * D, D, G, cache_at(l, 0, b, g, 0), cache_at(l, 1, b, g, 0),
                     kvs[4], first, last, D, out, D, scratch);
        }
      }
      quantize_rows_after_barrier(w.attn.data(), ly.o, r0, r1);
#pragma omp barrier
      matmul(ly.o, M, w.y.data(), E, tid, nt);
#pragma omp barrier
      residual(ly.o, ly.attn_post, r0, r1);
      for (int64_t r = r0; r < r1; ++r) ops.rms_norm(h + r * E, ly.mlp_norm, E, m.eps, x + r * E);
      quantize_rows(x, ly.gate_up, r0, r1);
#pragma omp barrier
      matmul(ly.gate_up, M, w.gu.data(), 2 * I, tid, nt);
#pragma omp barrier
      add_bias(ly.gate_up, w.gu.data(), 2 * I, r0, r1);
      for (int64_t r = r0; r < r1; ++r)
        ops.silu_mul(w.gu.data() + r * 2 * I, w.gu.data() + r * 2 * I + I, I, w.act.data() + r * I);
      quantize_rows(w.act.data(), ly.down, r0, r1);
#pragma omp barrier
      matmul(ly.down, M, w.y.data(), E, tid, nt);
#pragma omp barrier
      residual(ly.down, ly.mlp_post, r0, r1);
    }
  }

  // the attention output rows [lo, hi) quantized for o: every thread's attention tasks must be done first
  void quantize_rows_after_barrier(const float* a, const Linear& lin, int64_t lo, int64_t hi) {
#pragma omp barrier
    quantize_rows(a, lin, lo, hi);
  }

  // h += bias + y (GLM-4: h += norm(y + bias)), rows [lo, hi)
  void residual(const Linear& lin, const float* post_norm, int64_t lo, int64_t hi) {
    Workspace& w = md.ws;
    const int64_t E = md.E;
    add_bias(lin, w.y.data(), E, lo, hi);
    for (int64_t r = lo; r < hi; ++r) {
      float* y = w.y.data() + r * E;
      if (post_norm) ops.rms_norm(y, post_norm, E, md.eps, y);
      float* hr = w.h.data() + r * E;
      for (int64_t d = 0; d < E; ++d) hr[d] = hr[d] + y[d];
    }
  }
};

const Ops& ops_for(int isa) {
  if (isa == 2) return ops_avx512();
  if (isa == 1) return ops_avx2();
  return ops_scalar();
}

bool check_linear(const Linear& lin, int64_t N, int64_t K) {
  if (lin.K != K || lin.parts.empty() || lin.parts.size() > MAX_PARTS) return false;
  int64_t row = 0;
  for (const Part& p : lin.parts) {
    if (p.row0 != row || p.n <= 0 || p.tiles != (p.n + 15) / 16 || !p.codes || !p.da) return false;
    const TypeInfo& ti = TYPES[p.type];
    if (K % ti.superblock) return false;
    if ((ti.has_b && !p.db) || (ti.sub && !p.sa) || (ti.sub && ti.has_b && !p.sb)) return false;
    row += p.n;
  }
  return row == N;
}

}  // namespace

}  // namespace qmm

using namespace qmm;

extern "C" {

// y [M, n] (row stride ldy) = x [M, K] (float32, row stride ldx) times the packed weight's transpose (one part).
// isa: -1 the best this host runs, else 0/1/2 (an unsupported one is refused: returns 2); threads >= 1.
// Returns 0, or 1 for a bad argument, 2 for an instruction set this host cannot run.
int specdec_qmm(int type, int isa, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* codes,
                const uint16_t* da, const uint16_t* db, const int8_t* sa, const int8_t* sb, int64_t T, float* y,
                int64_t ldy, int64_t n, int threads) {
  if (type < 0 || type >= NUM_TYPES || K <= 0 || K % TYPES[type].superblock || M < 0 || T < 0 || n <= 16 * (T - 1) ||
      n > 16 * T || ldx < K || ldy < n || threads < 1)
    return 1;
  const TypeInfo& ti = TYPES[type];
  if (!codes || !da || (ti.has_b && !db) || (ti.sub && !sa) || (ti.sub && ti.has_b && !sb)) return 1;
  const int host = best_isa();
  if (isa < 0) isa = host;
  if (isa > host) return 2;
  if (M == 0 || T == 0) return 0;
  Linear lin;
  Part p;
  p.type = type, p.n = n, p.tiles = T, p.codes = codes, p.da = da, p.db = db, p.sa = sa, p.sb = sb;
  lin.parts.push_back(p);
  lin.N = n, lin.K = K;
  Workspace w;  // the standalone kernel's: one call's
  ensure_quantized(w, M, K);
  const Ops& ops = ops_for(isa);
#pragma omp parallel num_threads(threads) if (threads > 1 && M * K * 4 + T * tile_bytes(p, K) >= (1 << 16))
  {
#ifdef _OPENMP
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int tid = 0, nt = 1;
#endif
    quantize_rows(ops, w, M, x, ldx, lin, M * tid / nt, M * (tid + 1) / nt);
#pragma omp barrier
    matmul(isa, w, M, lin, M, y, ldy, tid, nt);
  }
  return 0;
}

// A model of L layers: dims = {E, H, H_kv, D, I, L, V, R, interleaved}; returns a handle (null: bad dims).
void* specdec_model_new(const int64_t* dims, float eps) {
  const int64_t E = dims[0], H = dims[1], Hkv = dims[2], D = dims[3], I = dims[4], L = dims[5], V = dims[6],
                R = dims[7];
  if (E <= 0 || H <= 0 || Hkv <= 0 || H % Hkv || D <= 0 || I <= 0 || L <= 0 || V <= 0 || R < 0 || R > D || R % 2)
    return nullptr;
  Model* m = new (std::nothrow) Model();
  if (!m) return nullptr;
  m->E = E, m->H = H, m->Hkv = Hkv, m->D = D, m->I = I, m->L = L, m->V = V, m->R = R;
  m->interleaved = dims[8] != 0;
  m->eps = eps;
  m->layers.resize(L);
  return m;
}

void specdec_model_free(void* handle) { delete static_cast<Model*>(handle); }

// Appends a part to linear `slot` of layer `layer` (slots 0 q/k/v, 1 o, 2 gate/up, 3 down; layer -1: 4 the head,
// 5 the embedding). Returns 0, or 1 for a bad argument.
int specdec_model_add_part(void* handle, int64_t layer, int slot, int type, int64_t row0, int64_t n, int64_t K,
                           const uint8_t* codes, const uint16_t* da, const uint16_t* db, const int8_t* sa,
                           const int8_t* sb, const float* bias) {
  Model* m = static_cast<Model*>(handle);
  if (!m || type < 0 || type >= NUM_TYPES) return 1;
  Linear* lin = nullptr;
  if (layer >= 0 && layer < m->L && slot >= 0 && slot < 4) {
    Layer& ly = m->layers[layer];
    lin = slot == 0 ? &ly.qkv : slot == 1 ? &ly.o : slot == 2 ? &ly.gate_up : &ly.down;
  } else if (layer == -1 && slot == 4) {
    lin = &m->head;
  } else if (layer == -1 && slot == 5) {
    lin = &m->embed;
  }
  if (!lin || lin->parts.size() >= (size_t)MAX_PARTS || K <= 0) return 1;
  Part p;
  p.type = type, p.row0 = row0, p.n = n, p.tiles = (n + 15) / 16;
  p.codes = codes, p.da = da, p.db = db, p.sa = sa, p.sb = sb, p.bias = bias;
  lin->parts.push_back(p);
  lin->K = K;
  lin->N = row0 + n;
  return 0;
}

// Sets a float vector: slots 0 attn norm [E], 1 mlp norm [E], 2 q norm [D], 3 k norm [D], 4 GLM-4's post-attention
// norm [E], 5 its post-MLP norm [E] of layer `layer`; layer -1: 6 the final norm [E], 7 a float32 embedding [V, E].
int specdec_model_set_vector(void* handle, int64_t layer, int slot, const float* p) {
  Model* m = static_cast<Model*>(handle);
  if (!m) return 1;
  if (layer >= 0 && layer < m->L && slot >= 0 && slot < 6) {
    Layer& ly = m->layers[layer];
    const float** dst[6] = {&ly.attn_norm, &ly.mlp_norm, &ly.q_norm, &ly.k_norm, &ly.attn_post, &ly.mlp_post};
    *dst[slot] = p;
    return 0;
  }
  if (layer == -1 && slot == 6) return m->final_norm = p, 0;
  if (layer == -1 && slot == 7) return m->embed_float = p, 0;
  return 1;
}

// 0 when every weight the forward reads is bound with consistent shapes; else the failing item: 1 + 10 layer + k
// (k 0 q/k/v, 1 o, 2 gate/up, 3 down, 4 norms), or 2 for the final norm, 3 the head, 4 the embedding.
int specdec_model_check(void* handle) {
  Model* m = static_cast<Model*>(handle);
  if (!m) return 5;
  const int64_t E = m->E, NQ = (m->H + 2 * m->Hkv) * m->D;
  for (int64_t l = 0; l < m->L; ++l) {
    const Layer& ly = m->layers[l];
    const int base = 10 + 10 * (int)l;
    if (!check_linear(ly.qkv, NQ, E)) return base + 0;
    if (!check_linear(ly.o, E, m->H * m->D)) return base + 1;
    if (!check_linear(ly.gate_up, 2 * m->I, E)) return base + 2;
    if (!check_linear(ly.down, E, m->I)) return base + 3;
    if (!ly.attn_norm || !ly.mlp_norm || (!ly.q_norm) != (!ly.k_norm) || (!ly.attn_post) != (!ly.mlp_post))
      return base + 4;
  }
  for (int64_t l = 1; l < m->L; ++l)
    if ((!m->layers[l].q_norm) != (!m->layers[0].q_norm)) return 10 + 10 * (int)l + 4;
  if (!m->final_norm) return 2;
  if (m->head.N < 1 || !check_linear(m->head, m->head.N, E)) return 3;  // the vocabulary, or a subset of it
  if (!m->embed_float && !check_linear(m->embed, m->V, E)) return 4;
  return 0;
}

// One forward of B rows of T tokens (see the top of this file). ids [B, T]; start, length, num_new [B]; kv the
// cache storage of the rows (strides kvs: layer, K/V, row, head, column; D contiguous), `capacity` columns a row;
// cos/sin [table_rows, R] the RoPE table by position. logits_mode 0 none, 1 every token [B, T, N], 2 each row's last
// real token [B, N] (N: the head's rows, the vocabulary or a subset of it); hidden_mode 0 none, 1 the last layer's
// output (before the final norm) of every token [B, T, E], 2 of the tokens the logits are for. isa -1 the
// host's best; threads >= 1; layers: the first `layers` layers only (<= 0: all), which write their K/V and nothing
// else (invariant checks). Returns 0; 1 bad argument (a token id, a column or a position out of range); 2 an
// instruction set this host cannot run.
int specdec_model_forward(void* handle, const int64_t* ids, int64_t B, int64_t T, const int64_t* start,
                          const int64_t* length, const int64_t* num_new, int left_padded, float* kv,
                          const int64_t* kvs, int64_t capacity, const float* cos_t, const float* sin_t,
                          int64_t table_rows, int logits_mode, float* logits, int hidden_mode, float* hidden,
                          int isa, int threads, int64_t layers) {
  Model* mp = static_cast<Model*>(handle);
  if (!mp || B < 0 || T < 1 || threads < 1 || logits_mode < 0 || logits_mode > 2 || hidden_mode < 0 ||
      hidden_mode > 2)
    return 1;
  Model& m = *mp;
  m.ws.seconds[3] = wall_seconds();
  const int host = best_isa();
  if (isa < 0) isa = host;
  if (isa > host) return 2;
  const int64_t M = B * T, E = m.E, D = m.D, I = m.I, V = m.V;
  if (M == 0) return 0;
  Workspace& w = m.ws;
  ensure(w.pos, M), ensure(w.col, M);
  for (int64_t b = 0; b < B; ++b) {
    if (num_new[b] < 0 || num_new[b] > T) return 1;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t index = length[b] + t - (left_padded ? T - num_new[b] : 0);
      const int64_t col = start[b] + index, pos = index > 0 ? index : 0;
      if (col < 0 || col >= capacity || pos >= table_rows) return 1;
      w.pos[b * T + t] = pos, w.col[b * T + t] = col;
    }
    if (start[b] < 0) return 1;
  }
  for (int64_t r = 0; r < M; ++r)
    if (ids[r] < 0 || ids[r] >= V) return 1;
  const int64_t kmax = std::max(std::max(E, m.H * D), I);  // the widest input a linear layer quantizes
  const int64_t NQ = (m.H + 2 * m.Hkv) * D;
  ensure(w.h, M * E), ensure(w.x, M * E), ensure(w.qkv, M * NQ), ensure(w.attn, M * m.H * D);
  ensure(w.y, M * E), ensure(w.gu, M * 2 * I), ensure(w.act, M * I);
  ensure_quantized(w, M, kmax);
  ensure(w.scratch, (size_t)threads * (ATTN_CHUNK + D));
  // the embedding
  for (int64_t r = 0; r < M; ++r) {
    float* hr = w.h.data() + r * E;
    if (m.embed_float) {
      std::memcpy(hr, m.embed_float + ids[r] * E, E * sizeof(float));
    } else {
      for (const Part& p : m.embed.parts)
        if (ids[r] >= p.row0 && ids[r] < p.row0 + p.n) dequantize_row(p, ids[r] - p.row0, E, hr);
    }
  }
  const Ops& ops = ops_for(isa);
  if (layers <= 0 || layers > m.L) layers = m.L;
  if (layers < m.L && (logits_mode || hidden_mode)) return 1;  // a partial forward writes the cache alone
  Step step{m, ops, isa, B, T, M, start, kv, kvs, cos_t, sin_t, layers};
  w.seconds[0] = wall_seconds();
  // the rows the head reads: every token, or each row's last real one (ragged: num_new - 1; left-padded: T - 1)
  const bool last = logits_mode == 2;
  const int64_t out_rows = last ? B : M;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef _OPENMP
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int tid = 0, nt = 1;
#endif
    step.run(tid, nt);
#pragma omp barrier
    if (tid == 0) w.seconds[1] = wall_seconds(), m.timings[3] = nt;
    const int64_t o0 = out_rows * tid / nt, o1 = out_rows * (tid + 1) / nt;
    for (int64_t o = o0; o < o1; ++o) {
      int64_t r = o;
      if (last) {
        int64_t t = left_padded ? T - 1 : num_new[o] - 1;
        r = o * T + (t < 0 ? T - 1 : t);
      }
      std::memcpy(w.x.data() + o * E, w.h.data() + r * E, E * sizeof(float));  // x is free after the layers
    }
    if (hidden_mode == 1) {  // every token's
      for (int64_t r = M * tid / nt; r < M * (tid + 1) / nt; ++r)
        std::memcpy(hidden + r * E, w.h.data() + r * E, E * sizeof(float));
    } else if (hidden_mode == 2) {  // where the logits are
      for (int64_t o = o0; o < o1; ++o) std::memcpy(hidden + o * E, w.x.data() + o * E, E * sizeof(float));
    }
    if (logits_mode) {
      for (int64_t o = o0; o < o1; ++o) ops.rms_norm(w.x.data() + o * E, m.final_norm, E, m.eps, w.x.data() + o * E);
      step.quantize_rows(w.x.data(), m.head, o0, o1);
#pragma omp barrier
      step.matmul(m.head, out_rows, logits, m.head.N, tid, nt);
#pragma omp barrier
      Step::add_bias(m.head, logits, m.head.N, o0, o1);
    }
  }
  w.seconds[2] = wall_seconds();
  m.timings[0] = w.seconds[0] - w.seconds[3];  // the embedding (and the step's checks)
  m.timings[1] = w.seconds[1] - w.seconds[0];  // the layers
  m.timings[2] = w.seconds[2] - w.seconds[1];  // the final norm and the head
  return 0;
}

// The last forward's seconds: [0] the embedding (and the step's checks), [1] the layers, [2] the final norm and the
// head (bench/native_forward.py's split of a step); [3] the threads it ran on.
void specdec_model_timings(void* handle, double* out) {
  const Model* m = static_cast<const Model*>(handle);
  for (int i = 0; i < 4; ++i) out[i] = m->timings[i];
}

}  // extern "C"
