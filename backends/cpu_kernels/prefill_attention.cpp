// Attention of one prompt chunk over the paged KV cache on x86 CPUs (the chunk's own K/V
// already written), causal, with an optional sliding window; float32 arithmetic whatever the
// cache dtype (float32 or bfloat16), bf16 scores by `vdpbf16ps` where the CPU has AVX-512-BF16
// (products exact, summed in float32: 128- to 2048-token W1 prompts in 0.8x the time).
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
// vector and a block of rows shares each load of it. The online softmax (a row's max, its
// scalar correction, the horizontal sums) runs once a run: with runs of kWidth keys it was
// most of the kernel's time (32 keys: 128- / 512-token W1 prompts 0.77 -> 0.48 ms, 10.3 ->
// 6.0 ms on 2 AVX2 cores). With register blocks that fit AVX2 (see kScoreRows), keys
// transposed by shuffles and tiles of 64 rows, against torch's CPU flash attention (SDPA) in
// the same run: 128 tokens 0.81-0.85x -> 0.57-0.59x its time, 512 0.84-0.86x -> 0.59-0.60x,
// 2048 1.49-1.72x -> 0.97x.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "simd.h"
#include "work_shares.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using switchyard_work::parallel_shares;

using namespace switchyard_simd;

constexpr int64_t kTileRows = 64;  // query rows per work item
constexpr int64_t kRowGroup = 8;   // rows whose scores are weighed together
constexpr int64_t kRunKeys = 32;   // keys per softmax update (its max, exp and sums a row)
constexpr int64_t kRunVectors = kRunKeys / kWidth;
// Register blocks of the two inner loops, sized to the ISA's vector registers (16 on AVX2, 32
// on AVX-512): kScoreRows x kScorePieces score sums beside kScorePieces key vectors, and
// kValueRows x kValueChunk weighted-value sums beside kValueChunk value vectors. Blocks that
// spilled (8 x 8 value sums on AVX2) made a 2048-token W1 prompt 1.5-1.7x slower than SDPA.
constexpr int kScorePieces = 2;
constexpr int kScoreRows = kWidth == 16 ? 8 : 4;
constexpr int kValueRows = kWidth == 16 ? 4 : 2;
constexpr int kValueChunk = 4;

#if defined(SWITCHYARD_VNNI) && defined(__AVX512BF16__)
#define SWITCHYARD_KEY_PAIRS 1
constexpr bool kPairsBuilt = true;
#else
constexpr bool kPairsBuilt = false;
#endif
// bf16 keys whose scores `vdpbf16ps` takes by pairs of dimensions (exact products summed in
// float32): the run keeps them unwidened, and a score takes half the instructions.
template <typename T>
constexpr bool kKeyPairs = kPairsBuilt && std::is_same_v<T, c10::BFloat16>;

struct Chunk {
  int64_t rows, heads, kv_heads, block_size, context, window;  // window 0: none
};

// kRunKeys consecutive key positions: K as kRunVectors pieces of kWidth keys, each transposed
// [D, kWidth] (float32), or with kKeyPairs [D / 2, kWidth] (bf16 pairs); V [kRunKeys, D],
// float32.
template <int NV>
struct KeyRun {
  static constexpr int64_t kDim = NV * kWidth;
  float keys[kRunVectors * kDim * kWidth];
  uint32_t key_pairs[kRunVectors * kDim / 2 * kWidth];
  float values[kRunKeys * kDim];
};

// Keys j .. j + 7 of a run (null: past its end, zero) into their piece, transposed 8 x 8 at
// a time (a scalar copy was a fifth of a 2048-token prompt's time).
template <typename T, int NV>
void transpose_keys(const T* const* keys, int64_t j, KeyRun<NV>& run) {
  constexpr int64_t d = KeyRun<NV>::kDim;
  float* piece = run.keys + j / kWidth * d * kWidth + j % kWidth;
  for (int64_t i = 0; i < d; i += 8) {
    __m256 rows[8];
    for (int k = 0; k < 8; ++k) rows[k] = keys[k] ? load8(keys[k] + i) : _mm256_setzero_ps();
    transpose8(rows);
    for (int m = 0; m < 8; ++m) _mm256_storeu_ps(piece + (i + m) * kWidth, rows[m]);
  }
}

// The same for bf16 keys left unwidened: 32-bit pairs transposed as the floats are.
template <int NV>
void transpose_key_pairs(const c10::BFloat16* const* keys, int64_t j, KeyRun<NV>& run) {
  constexpr int64_t pairs = KeyRun<NV>::kDim / 2;
  uint32_t* piece = run.key_pairs + j / kWidth * pairs * kWidth + j % kWidth;
  for (int64_t i = 0; i < pairs; i += 8) {
    __m256 rows[8];
    for (int k = 0; k < 8; ++k) {
      rows[k] = keys[k] ? _mm256_loadu_ps(reinterpret_cast<const float*>(keys[k] + 2 * i))
                        : _mm256_setzero_ps();
    }
    transpose8(rows);
    for (int m = 0; m < 8; ++m) {
      _mm256_storeu_ps(reinterpret_cast<float*>(piece + (i + m) * kWidth), rows[m]);
    }
  }
}

template <typename T, int NV>
void gather_run(const Chunk& c, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t kv_head, int64_t first, int64_t count, KeyRun<NV>& run) {
  constexpr int64_t d = KeyRun<NV>::kDim;
  static_assert(d % 8 == 0 && kWidth % 8 == 0);
  const T* keys[kRunKeys];
  for (int64_t j = 0; j < kRunKeys; ++j) {
    float* value = run.values + j * d;
    if (j >= count) {
      keys[j] = nullptr;
      std::fill(value, value + d, 0.0f);
      continue;
    }
    const int64_t position = first + j;
    const int64_t offset =
        ((table[position / c.block_size] * c.kv_heads + kv_head) * c.block_size +
         position % c.block_size) * d;
    keys[j] = k_cache + offset;
    for (int v = 0; v < NV; ++v) store(value + v * kWidth, load(v_cache + offset + v * kWidth));
  }
  for (int64_t j = 0; j < kRunKeys; j += 8) {
    if constexpr (kKeyPairs<T>) transpose_key_pairs<NV>(keys + j, j, run);
    else transpose_keys<T, NV>(keys + j, j, run);
  }
}

// Per row of a tile: the running max, the sum of weights and the weighted sum of values.
template <int NV>
struct TileState {
  static constexpr int64_t kDim = NV * kWidth;
  float query[kTileRows * kDim];  // scaled; rows past the tile's end are zero
  uint32_t query_pairs[kTileRows * kDim / 2];  // with kKeyPairs instead: bf16 pairs, unscaled
  float acc[kTileRows * kDim];
  float max[kTileRows];
  float total[kTileRows];
};

// Scores of kRowGroup rows against one run: each row's scores for kWidth keys in one vector,
// each score a sum over the head's dimensions in order.
template <int NV>
void score_rows(const TileState<NV>& st, const KeyRun<NV>& run, int64_t row,
                float scores[kRowGroup][kRunKeys]) {
  constexpr int64_t d = KeyRun<NV>::kDim;
  static_assert(kRowGroup % kScoreRows == 0 && kRunVectors % kScorePieces == 0);
  for (int64_t group = 0; group < kRowGroup; group += kScoreRows) {
    const float* query = st.query + (row + group) * d;
    for (int64_t piece = 0; piece < kRunVectors; piece += kScorePieces) {
      const float* keys = run.keys + piece * d * kWidth;
      Vec sums[kScoreRows][kScorePieces];
      for (int g = 0; g < kScoreRows; ++g) {
        for (int p = 0; p < kScorePieces; ++p) sums[g][p] = zero();
      }
      for (int64_t i = 0; i < d; ++i) {
        Vec key[kScorePieces];
        for (int p = 0; p < kScorePieces; ++p) key[p] = load(keys + (p * d + i) * kWidth);
        for (int g = 0; g < kScoreRows; ++g) {
          const Vec q = splat(query[g * d + i]);
          for (int p = 0; p < kScorePieces; ++p) sums[g][p] = fmadd(q, key[p], sums[g][p]);
        }
      }
      for (int g = 0; g < kScoreRows; ++g) {
        for (int p = 0; p < kScorePieces; ++p) {
          store(scores[group + g] + (piece + p) * kWidth, sums[g][p]);
        }
      }
    }
  }
}

// score_rows for keys in bf16 pairs: `vdpbf16ps` sums, then the scale.
template <int NV>
void score_rows_by_pairs(const TileState<NV>& st, const KeyRun<NV>& run, int64_t row, float scale,
                         float scores[kRowGroup][kRunKeys]) {
#ifdef SWITCHYARD_KEY_PAIRS
  constexpr int64_t pairs = KeyRun<NV>::kDim / 2;
  for (int64_t group = 0; group < kRowGroup; group += kScoreRows) {
    const uint32_t* query = st.query_pairs + (row + group) * pairs;
    for (int64_t piece = 0; piece < kRunVectors; piece += kScorePieces) {
      const uint32_t* keys = run.key_pairs + piece * pairs * kWidth;
      Vec sums[kScoreRows][kScorePieces];
      for (int g = 0; g < kScoreRows; ++g) {
        for (int p = 0; p < kScorePieces; ++p) sums[g][p] = zero();
      }
      for (int64_t i = 0; i < pairs; ++i) {
        __m512bh key[kScorePieces];
        for (int p = 0; p < kScorePieces; ++p) {
          key[p] = (__m512bh)_mm512_loadu_si512(keys + (p * pairs + i) * kWidth);
        }
        for (int g = 0; g < kScoreRows; ++g) {
          const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(query[g * pairs + i]));
          for (int p = 0; p < kScorePieces; ++p) sums[g][p] = _mm512_dpbf16_ps(sums[g][p], q, key[p]);
        }
      }
      for (int g = 0; g < kScoreRows; ++g) {
        for (int p = 0; p < kScorePieces; ++p) {
          store(scores[group + g] + (piece + p) * kWidth, mul(sums[g][p], splat(scale)));
        }
      }
    }
  }
#endif
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
  st.total[row] = std::fma(st.total[row], correction, sum(total));  // one rounding, in any build
  st.max[row] = new_max;
  return correction;
}

// acc = acc * correction + weights . values for kValueRows rows, over value vectors
// [first, first + Chunk): each value vector is loaded once for all the rows, and each sum
// takes the run's keys in order.
template <int NV, int Chunk>
void accumulate_chunk(TileState<NV>& st, const KeyRun<NV>& run, int64_t row, int first,
                      const float weights[][kRunKeys], const float* corrections) {
  constexpr int64_t d = KeyRun<NV>::kDim;
  Vec out[kValueRows][Chunk];
  for (int g = 0; g < kValueRows; ++g) {
    const Vec correction = splat(corrections[g]);
    for (int c = 0; c < Chunk; ++c) {
      out[g][c] = mul(load(st.acc + (row + g) * d + (first + c) * kWidth), correction);
    }
  }
  for (int64_t j = 0; j < kRunKeys; ++j) {
    Vec values[Chunk];
    for (int c = 0; c < Chunk; ++c) values[c] = load(run.values + j * d + (first + c) * kWidth);
    for (int g = 0; g < kValueRows; ++g) {
      const Vec w = splat(weights[g][j]);
      for (int c = 0; c < Chunk; ++c) out[g][c] = fmadd(w, values[c], out[g][c]);
    }
  }
  for (int g = 0; g < kValueRows; ++g) {
    for (int c = 0; c < Chunk; ++c) store(st.acc + (row + g) * d + (first + c) * kWidth, out[g][c]);
  }
}

template <int NV>
void accumulate_rows(TileState<NV>& st, const KeyRun<NV>& run, int64_t row,
                     const float weights[][kRunKeys], const float* corrections) {
  constexpr int kChunk = NV < kValueChunk ? NV : kValueChunk;
  int first = 0;
  for (; first + kChunk <= NV; first += kChunk) {
    accumulate_chunk<NV, kChunk>(st, run, row, first, weights, corrections);
  }
  if constexpr (NV % kChunk != 0) {
    accumulate_chunk<NV, NV % kChunk>(st, run, row, first, weights, corrections);
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
    if constexpr (kKeyPairs<T>) {
      uint32_t* pairs = st.query_pairs + r * d / 2;
      if (r < rows) std::memcpy(pairs, row, d * sizeof(T));
      else std::fill(pairs, pairs + d / 2, 0u);
    } else {
      for (int64_t i = 0; i < d; ++i) st.query[r * d + i] = r < rows ? static_cast<float>(row[i]) * scale : 0.0f;
    }
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
      // A group whose rows all sit before the run attends none of it: it would add 0 x
      // values and scale its sums by 1.
      if (start + row_begin + std::min(r + kRowGroup, rows) - 1 < first) continue;
      if constexpr (kKeyPairs<T>) score_rows_by_pairs<NV>(st, run, r, scale, scores);
      else score_rows<NV>(st, run, r, scores);
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
  parallel_shares(c.heads * tiles, [&](int64_t item) {
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
