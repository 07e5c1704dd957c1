// Dense float32 linears with AVX2 FMA, at every row count: out[M, N] = x[M, K] . w[N, K]^T
// (+ bias), each output a float32 sum in k order.
//
// The weight is packed once, at load, into [N / 16, K, 16]: blocks of 16 output columns, each
// k of a block one 64-byte line, so a block streams in address order. A tile is up to 6 rows x
// 16 columns (12 accumulators, two weight registers and a broadcast: 15 of AVX2's 16): per k,
// two weight loads and up to six broadcast inputs feed twelve FMAs. Threads take blocks (and
// row chunks where blocks are few); the rows loop inside, so a block's weights come from memory
// once, for the first row tile, which also asks for the line kPrefetchK ahead into L2. The
// block's later row tiles (their weights in L2 already) ask for the thread's next block, spread
// over their k loops, so that its first tile does not wait on memory either: on a 2-core AVX2
// EPYC, W1's linears over weights from memory went from ~172 to ~186 GFLOP/s at 64 rows and
// ~130 to ~150 at 16 (the kernel's peak with weights in cache: ~194), unchanged at 512.
// bench/roofline.py, 49 W1 linears over weights from memory, before that: 0.64-0.75x oneDNN's
// time at 1-64 rows, 0.92x at 2048 (oneDNN reached ~50% of the FMA peak at 16 rows).
//
//   f32_linear(x [.., K], packed [N / 16, K, 16], bias [N]?) -> [.., N]   all float32
//   f32_silu_mul_linear(x [.., K], packed [N / 16, K, 16]) -> [.., N / 2]
//
// The second is an MLP's gate / up projection packed with gate's and up's columns side by
// side (cpu_linear.pack_for_f32_silu_mul): a tile's two halves are 8 gate and the same 8 up
// sums, and it stores silu(gate) * up, so the [M, N] projection never goes to memory and back.
// 12 W1 layers' gate / up and SiLU, distinct weights, against the linear then inductor's SiLU
// in one compiled graph (alternating, same process): 0.89x the time at 16 rows, 0.97x at 64
// and 512. The sums are the first form's, bit for bit.
//
// The accumulators are two arrays indexed by constants after unrolling, and the prefetch test
// a template argument: with one [Rows][2] array and the test in the loop, GCC kept them on the
// stack (2x slower than oneDNN).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"
#include "work_shares.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using switchyard_work::parallel_shares;

constexpr int64_t kColumns = 16;   // output columns per packed block
constexpr int kRowTile = 6;
constexpr int64_t kPrefetchK = 32;  // lines ahead: 2 KB; 16-32 measured alike, none 10% slower

struct Problem {
  const float* x;     // [M, K]
  const float* w;     // [N / 16, K, 16]
  const float* bias;  // [N] or null
  float* out;         // [M, N], or [M, N / 2] with silu_mul
  int64_t m, k, n;
  bool silu_mul;      // each block's columns 0-7 gate, 8-15 up: out = silu(gate) * up
};

// How a tile helps the memory ahead of it. kAhead: the first row tile of a block, whose weights
// come from memory, asks for its own line kPrefetchK ahead. kNextBlock: a later row tile (its
// block already in L2) asks for `count` lines of the thread's next block, one every `stride`
// k, so that the next block's first tile finds its weights in L2 too.
enum class Prefetch { kNone, kAhead, kNextBlock };

struct NextLines {
  const float* first = nullptr;  // the first line this tile asks for
  int64_t count = 0;
  int64_t stride = 1;  // a power of two
};

template <int Rows, Prefetch Mode>
void tile(const Problem& p, int64_t row, int64_t block, NextLines next) {
  const int64_t k_size = p.k;
  const float* w = p.w + block * k_size * kColumns;
  const float* x = p.x + row * k_size;
  __m256 low[Rows], high[Rows];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) low[r] = high[r] = _mm256_setzero_ps();
  const int64_t next_end = next.count * next.stride;
  for (int64_t k = 0; k < k_size; ++k) {
    if constexpr (Mode == Prefetch::kAhead) {  // past a block's end: the next block, no fault
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchK) * kColumns), _MM_HINT_T1);
    } else if constexpr (Mode == Prefetch::kNextBlock) {
      if (k < next_end && (k & (next.stride - 1)) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(next.first + k / next.stride * kColumns),
                     _MM_HINT_T1);
      }
    }
    const __m256 w0 = _mm256_loadu_ps(w + k * kColumns);
    const __m256 w1 = _mm256_loadu_ps(w + k * kColumns + 8);
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const __m256 input = _mm256_broadcast_ss(x + r * k_size + k);
      low[r] = _mm256_fmadd_ps(input, w0, low[r]);
      high[r] = _mm256_fmadd_ps(input, w1, high[r]);
    }
  }
  if (p.silu_mul) {  // 8 outputs a block
    float* out = p.out + row * (p.n / 2) + block * (kColumns / 2);
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const __m256 silu = _mm256_mul_ps(low[r], switchyard_simd::sigmoid8(low[r]));
      _mm256_storeu_ps(out + r * (p.n / 2), _mm256_mul_ps(silu, high[r]));
    }
    return;
  }
  const int64_t column = block * kColumns;
  const __m256 bias0 = p.bias ? _mm256_loadu_ps(p.bias + column) : _mm256_setzero_ps();
  const __m256 bias1 = p.bias ? _mm256_loadu_ps(p.bias + column + 8) : _mm256_setzero_ps();
  float* out = p.out + row * p.n + column;
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
    _mm256_storeu_ps(out + r * p.n, _mm256_add_ps(low[r], bias0));
    _mm256_storeu_ps(out + r * p.n + 8, _mm256_add_ps(high[r], bias1));
  }
}

template <int Rows>
void tile(const Problem& p, int64_t row, int64_t block, Prefetch mode, NextLines next) {
  switch (mode) {
    case Prefetch::kNone: return tile<Rows, Prefetch::kNone>(p, row, block, next);
    case Prefetch::kAhead: return tile<Rows, Prefetch::kAhead>(p, row, block, next);
    case Prefetch::kNextBlock: return tile<Rows, Prefetch::kNextBlock>(p, row, block, next);
  }
}

void rows_remainder(const Problem& p, int64_t row, int64_t block, int64_t count,
                    Prefetch mode, NextLines next) {
  switch (count) {
    case 1: return tile<1>(p, row, block, mode, next);
    case 2: return tile<2>(p, row, block, mode, next);
    case 3: return tile<3>(p, row, block, mode, next);
    case 4: return tile<4>(p, row, block, mode, next);
    case 5: return tile<5>(p, row, block, mode, next);
    default: return;
  }
}

// The lines of `next_block` (null: none) that row tile `index` of `tiles` asks for: the
// later tiles share them out in order, each spreading its share over its k loop.
NextLines next_lines(const Problem& p, const float* next_block, int64_t index, int64_t tiles) {
  if (next_block == nullptr || index == 0) return {};
  const int64_t share = (p.k + tiles - 2) / (tiles - 1);
  const int64_t first = (index - 1) * share;
  const int64_t count = std::min(share, p.k - first);
  int64_t stride = 1;
  while (count > 0 && count * stride * 2 <= p.k) stride *= 2;
  return {next_block + first * kColumns, std::max<int64_t>(count, 0), stride};
}

// Rows [first, last) against one block; its later row tiles fetch `next_block` into L2.
void row_range(const Problem& p, int64_t block, int64_t first, int64_t last,
               const float* next_block) {
  const int64_t tiles = (last - first + kRowTile - 1) / kRowTile;
  int64_t row = first;
  for (int64_t index = 0; index < tiles; ++index, row += kRowTile) {
    const Prefetch mode = index == 0 ? Prefetch::kAhead
        : next_block ? Prefetch::kNextBlock : Prefetch::kNone;
    const NextLines next = next_lines(p, next_block, index, tiles);
    if (row + kRowTile <= last) tile<kRowTile>(p, row, block, mode, next);
    else rows_remainder(p, row, block, last - row, mode, next);
  }
}

// Work items are (block, row chunk), a block's chunks consecutive so that a thread reads a
// block's weights once. Rows are split only where blocks alone are too few for the threads.
void run(const Problem& p) {
  const int64_t blocks = p.n / kColumns;
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t chunks =
      std::clamp<int64_t>((wanted + blocks - 1) / blocks, 1, (p.m + kRowTile - 1) / kRowTile);
  const int64_t chunk_rows = ((p.m + chunks - 1) / chunks + kRowTile - 1) / kRowTile * kRowTile;
  const int64_t items = blocks * chunks;
  parallel_shares(items, [&](int64_t item) {
    const int64_t block = item / chunks, first = (item % chunks) * chunk_rows;
    const int64_t last = std::min(p.m, first + chunk_rows);
    // The thread's next item as a rule (unless another thread takes it), where it starts
    // another block: its weights are fetched early.
    const bool next_is_new = item + 1 < items && (item + 1) % chunks == 0;
    const float* next_block = next_is_new ? p.w + (block + 1) * p.k * kColumns : nullptr;
    if (first < last) row_range(p, block, first, last, next_block);
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const std::optional<at::Tensor>& bias, bool silu_mul) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "f32_linear: x and the packed weight must be float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kColumns && packed.is_contiguous(),
              "f32_linear: packed must be contiguous [N / 16, K, 16]");
  const int64_t k = x.size(-1), n = packed.size(0) * kColumns;
  TORCH_CHECK(packed.size(1) == k, "f32_linear: x has ", k, " features, the weight ",
              packed.size(1));
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n &&
                    bias->is_contiguous(),
                "f32_linear: bias must be contiguous float32 [", n, "]");
  }
  const at::Tensor rows = x.reshape({-1, k}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = silu_mul ? n / 2 : n;
  at::Tensor out = at::empty({rows.size(0), shape.back()}, x.options());
  if (rows.size(0) > 0) {
    run(Problem{rows.const_data_ptr<float>(), packed.const_data_ptr<float>(),
                bias.has_value() ? bias->const_data_ptr<float>() : nullptr,
                out.mutable_data_ptr<float>(), rows.size(0), k, n, silu_mul});
  }
  return out.view(shape);
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias) {
  return linear(x, packed, bias, false);
}

// silu(gate) * up of a gate / up projection packed by cpu_linear.pack_for_f32_silu_mul:
// block b holds gate columns 8b..8b+7, then up's.
at::Tensor f32_silu_mul_linear(const at::Tensor& x, const at::Tensor& packed) {
  return linear(x, packed, std::nullopt, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("f32_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("f32_silu_mul_linear(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("f32_linear", &f32_linear);
  m.impl("f32_silu_mul_linear", &f32_silu_mul_linear);
}
