// Attention of one prompt chunk over the paged KV cache on x86 CPUs (the chunk's own K/V
// already written), causal, with an optional sliding window; float32 arithmetic whatever the
// cache dtype (float32 or bfloat16).
//
//   q            [n, H, D]                  queries at positions context - n .. context - 1
//   k/v_cache    [num_blocks, KVH, bs, D]   head-major blocks (attention.KVCache)
//   block_table  [>= ceil(context / bs)] int64
//   context, window (0: none), scale
//   -> [n, H, D]
//
// A query at position p attends keys [max(0, p - window + 1), p]. Work is split over (query
// head, tile of rows); keys are taken kRunKeys positions at a time, gathered from their blocks
// into float32 pieces of kWidth keys transposed, so that a row's scores for a piece are one
// vector and eight rows share each load of it. The online softmax (a row's max, its scalar
// correction, the horizontal sums) runs once a run: with runs of kWidth keys it was most of
// the kernel's time (32 keys: 128- / 512-token W1 prompts 0.77 -> 0.48 ms, 10.3 -> 6.0 ms, on
// 2 AVX2 cores, where torch's CPU flash attention takes 0.6 / 6.8 ms; runs of 64 keys or
// tiles of 64 rows measured no better).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using namespace switchyard_simd;

constexpr int64_t kTileRows = 32;  // query rows per work item
constexpr int64_t kRowGroup = 8;   // rows scored together (their sums in registers)
constexpr int64_t kValueRows = 4;  // rows whose weighted values are summed together
constexpr int64_t kRunKeys = 32;   // keys per softmax update (its max, exp and sums a row)
constexpr int64_t kRunVectors = kRunKeys / kWidth;

struct Chunk {
  int64_t rows, heads, kv_heads, block_size, context, window;  // window 0: none
};

// kRunKeys consecutive key positions: K as kRunVectors pieces of kWidth keys, each transposed
// [D, kWidth]; V [kRunKeys, D]; float32.
template <int NV>
struct KeyRun {
  static constexpr int64_t kDim = NV * kWidth;
  float keys[kRunVectors * kDim * kWidth];
  float values[kRunKeys * kDim];
};

template <typename T, int NV>
void gather_run(const Chunk& c, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t kv_head, int64_t first, int64_t count, KeyRun<NV>& run) {
  constexpr int64_t d = KeyRun<NV>::kDim;
  for (int64_t j = 0; j < kRunKeys; ++j) {
    float* value = run.values + j * d;
    float* keys = run.keys + j / kWidth * d * kWidth + j % kWidth;
    if (j >= count) {
      for (int64_t i = 0; i < d; ++i) keys[i * kWidth] = 0.0f;
      std::fill(value, value + d, 0.0f);
      continue;
    }
    const int64_t position = first + j;
    const int64_t offset =
        ((table[position / c.block_size] * c.kv_heads + kv_head) * c.block_size +
         position % c.block_size) * d;
    const T* key = k_cache + offset;
    for (int64_t i = 0; i < d; ++i) keys[i * kWidth] = static_cast<float>(key[i]);
    for (int v = 0; v < NV; ++v) store(value + v * kWidth, load(v_cache + offset + v * kWidth));
  }
}

// Per row of a tile: the running max, the sum of weights and the weighted sum of values.
template <int NV>
struct TileState {
  static constexpr int64_t kDim = NV * kWidth;
  float query[kTileRows * kDim];  // scaled; rows past the tile's end are zero
  float acc[kTileRows * kDim];
  float max[kTileRows];
  float total[kTileRows];
};

// Scores of kRowGroup rows against one run, kWidth keys at a time: each row's scores for
// them in one vector.
template <int NV>
void score_rows(const TileState<NV>& st, const KeyRun<NV>& run, int64_t row,
                float scores[kRowGroup][kRunKeys]) {
  constexpr int64_t d = KeyRun<NV>::kDim;
  for (int64_t piece = 0; piece < kRunVectors; ++piece) {
    const float* keys = run.keys + piece * d * kWidth;
    Vec sums[kRowGroup];
    for (int g = 0; g < kRowGroup; ++g) sums[g] = zero();
    for (int64_t i = 0; i < d; ++i) {
      const Vec key = load(keys + i * kWidth);
      for (int g = 0; g < kRowGroup; ++g) {
        sums[g] = fmadd(splat(st.query[(row + g) * d + i]), key, sums[g]);
      }
    }
    for (int g = 0; g < kRowGroup; ++g) store(scores[g] + piece * kWidth, sums[g]);
  }
}

// Scores -> weights for one row over one run whose positions start at `first` (online
// softmax: against the new running max); returns the factor the row's sums so far take (1,
// with weights all 0, when the run holds nothing this row attends).
template <int NV>
float weigh_row(const Chunk& c, TileState<NV>& st, int64_t row, int64_t position, int64_t first,
                float* scores) {
  const int64_t lowest = c.window ? std::max<int64_t>(0, position - c.window + 1) : 0;
  if (first > position || first + kRunKeys <= lowest) {
    std::fill(scores, scores + kRunKeys, 0.0f);
    return 1.0f;
  }
  if (first < lowest || first + kRunKeys - 1 > position) {
    for (int64_t j = 0; j < kRunKeys; ++j) {
      if (first + j < lowest || first + j > position) scores[j] = kNegInf;
    }
  }
  Vec largest = load(scores);
  for (int64_t v = 1; v < kRunVectors; ++v) largest = maximum(largest, load(scores + v * kWidth));
  const float new_max = std::max(st.max[row], max_all(largest));
  const float correction = std::exp(st.max[row] - new_max);  // 0 when max was -inf
  Vec total = zero();
  for (int64_t v = 0; v < kRunVectors; ++v) {
    const Vec weights = exp_nonpositive(sub(load(scores + v * kWidth), splat(new_max)));
    store(scores + v * kWidth, weights);
    total = add(total, weights);
  }
  st.total[row] = st.total[row] * correction + sum(total);
  st.max[row] = new_max;
  return correction;
}

// acc = acc * correction + weights . values for kValueRows rows at once: each value vector is
// loaded once for all of them, and their kValueRows * NV sums are independent chains.
template <int NV>
void accumulate_rows(TileState<NV>& st, const KeyRun<NV>& run, int64_t row,
                     const float weights[][kRunKeys], const float* corrections) {
  constexpr int64_t d = KeyRun<NV>::kDim;
  Vec out[kValueRows][NV];
  for (int g = 0; g < kValueRows; ++g) {
    const Vec correction = splat(corrections[g]);
    for (int v = 0; v < NV; ++v) out[g][v] = mul(load(st.acc + (row + g) * d + v * kWidth), correction);
  }
  for (int64_t j = 0; j < kRunKeys; ++j) {
    Vec values[NV];
    for (int v = 0; v < NV; ++v) values[v] = load(run.values + j * d + v * kWidth);
    for (int g = 0; g < kValueRows; ++g) {
      const Vec w = splat(weights[g][j]);
      for (int v = 0; v < NV; ++v) out[g][v] = fmadd(w, values[v], out[g][v]);
    }
  }
  for (int g = 0; g < kValueRows; ++g) {
    for (int v = 0; v < NV; ++v) store(st.acc + (row + g) * d + v * kWidth, out[g][v]);
  }
}

template <typename T, int NV>
void attend_tile(const Chunk& c, const T* q, const T* k_cache, const T* v_cache,
                 const int64_t* table, float scale, int64_t head, int64_t row_begin, T* out) {
  constexpr int64_t d = KeyRun<NV>::kDim;
  const int64_t rows = std::min(kTileRows, c.rows - row_begin);
  const int64_t kv_head = head / (c.heads / c.kv_heads);
  const int64_t start = c.context - c.rows;  // position of the chunk's row 0
  thread_local TileState<NV> st;
  thread_local KeyRun<NV> run;
  for (int64_t r = 0; r < kTileRows; ++r) {
    const T* row = q + ((row_begin + r) * c.heads + head) * d;
    for (int64_t i = 0; i < d; ++i) st.query[r * d + i] = r < rows ? static_cast<float>(row[i]) * scale : 0.0f;
    std::fill(st.acc + r * d, st.acc + (r + 1) * d, 0.0f);
    st.max[r] = kNegInf;
    st.total[r] = 0.0f;
  }
  const int64_t last = start + row_begin + rows - 1;  // the tile's last position
  const int64_t lowest = c.window ? std::max<int64_t>(0, start + row_begin - c.window + 1) : 0;
  float scores[kRowGroup][kRunKeys];
  for (int64_t first = lowest / kRunKeys * kRunKeys; first <= last; first += kRunKeys) {
    gather_run<T, NV>(c, k_cache, v_cache, table, kv_head, first,
                      std::min<int64_t>(kRunKeys, last + 1 - first), run);
    for (int64_t r = 0; r < rows; r += kRowGroup) {
      score_rows<NV>(st, run, r, scores);
      float corrections[kRowGroup];
      for (int64_t g = 0; g < kRowGroup; ++g) {  // rows past the tile's end: weights 0
        corrections[g] = r + g < rows
            ? weigh_row<NV>(c, st, r + g, start + row_begin + r + g, first, scores[g])
            : (std::fill(scores[g], scores[g] + kRunKeys, 0.0f), 1.0f);
      }
      for (int64_t g = 0; g < kRowGroup; g += kValueRows) {
        accumulate_rows<NV>(st, run, r + g, scores + g, corrections + g);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = st.total[r] > 0.0f ? 1.0f / st.total[r] : 0.0f;
    T* row = out + ((row_begin + r) * c.heads + head) * d;
    for (int64_t i = 0; i < d; ++i) row[i] = static_cast<T>(st.acc[r * d + i] * inverse);
  }
}

template <typename T, int NV>
void run_chunk(const Chunk& c, const at::Tensor& q, const at::Tensor& k_cache,
               const at::Tensor& v_cache, const at::Tensor& table, float scale, at::Tensor& out) {
  const int64_t tiles = (c.rows + kTileRows - 1) / kTileRows;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = table.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  parallel_strided(c.heads * tiles, [&](int64_t item) {
    attend_tile<T, NV>(c, qp, kp, vp, tp, scale, item % c.heads, item / c.heads * kTileRows, op);
  });
}

at::Tensor paged_prefill_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& table_in,
                                   int64_t context, int64_t window, double scale) {
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = table_in.contiguous();
  check_query_and_caches("paged_prefill_attention", q, k_cache, v_cache);
  const Chunk c{q.size(0), q.size(1), k_cache.size(1), k_cache.size(2), context, window};
  TORCH_CHECK(c.heads % c.kv_heads == 0 && q.size(2) == k_cache.size(3),
              "paged_prefill_attention: heads or head size differ from the cache's");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 1 &&
                  table.size(0) * c.block_size >= context && c.rows <= context && window >= 0,
              "paged_prefill_attention: the block table must cover the context, which holds "
              "the chunk");
  at::Tensor out = at::empty(q.sizes(), q.options());
  with_dtype_and_head_vectors(q, [&](auto dtype, auto nv) {
    run_chunk<typename decltype(dtype)::type, decltype(nv)::value>(c, q, k_cache, v_cache, table,
                                                                    scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int context, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
