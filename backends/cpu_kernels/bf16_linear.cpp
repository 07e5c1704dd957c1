// Dense bf16 linears on CPUs with AVX-512-BF16, at every row count:
// out[M, N] = x[M, K] . w[N, K]^T (+ bias), float32 sums rounded to bf16 once, at the end.
//
// `vdpbf16ps` multiplies two bf16 pairs per float32 lane. The weight is packed once, at load,
// into [N / 16, K / 2, 16, 2]: blocks of 16 output columns, each k-pair of a block one 64-byte
// line, so a block streams in address order. A tile is up to 8 rows x 2 blocks (16
// accumulators): per k-pair, two weight loads and up to eight broadcast input pairs feed
// sixteen `vdpbf16ps`. Threads take pairs of blocks (and row chunks where pairs are few); the
// rows loop inside, so a pair's weights come from memory once and from cache for every further
// row tile (bench/roofline.py: oneDNN overlaps that read less with the arithmetic at decode
// row counts).
//
//   bf16_linear_built() -> bool          whether this build has the kernel (AVX-512-BF16)
//   bf16_linear(x [.., K], packed [N / 16, K / 2, 16, 2], bias [N]?) -> [.., N]   all bf16
//   bf16_silu_mul_linear(x [.., K], packed [N / 16, K / 2, 16, 2]) -> [.., N / 2]
//
// The second is an MLP's gate / up projection packed with gate's and up's columns in
// alternate blocks (cpu_linear.pack_for_bf16_silu_mul): a tile's two blocks are 16 gate and
// the same 16 up sums, and it stores silu(gate) * up from the float32 sums, rounded once, so
// the [M, N] projection is never written and read back.
//
// build.py compiles this file with -mavx512bf16 where the CPU has it; elsewhere the operator
// exists and refuses to run (the engine then keeps oneDNN).

#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "dense_slices.h"
#include "kernel_entry_points.h"
#include "simd.h"
#include "work_shares.h"

#include <algorithm>
#include <type_traits>
#include <cstdint>
#include <vector>

namespace {

using switchyard_work::parallel_shares;

constexpr int64_t kColumns = 16;  // output columns per packed block
constexpr int kRowTile = 8;
// The first row tile of a block pair reads the pair's weights from memory; asking for the line
// this many k-pairs ahead (into L2) keeps more of them in flight than the hardware prefetcher
// does: 49 W1 linears 7-13% faster at 8-16 rows, 3-5% at 32-64, level at 1-4
// (bench/roofline.py). Later tiles find the weights in L2 and ask for nothing.
constexpr int64_t kPrefetchPairs = 64;

bool bf16_linear_built() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512BF16__

struct Problem {
  const int32_t* x;      // [M, K / 2] bf16 pairs
  const uint16_t* w;     // [N / 16, K / 2, 16, 2]
  const uint16_t* bias;  // [N] or null
  uint16_t* out;         // [M, N], or [M, N / 2] with silu_mul
  int64_t m, pairs, n;
  bool silu_mul;         // blocks 2j, 2j + 1: gate's and up's columns 16j..16j + 15
};

inline void store_bf16(uint16_t* out, __m512 sums) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(sums));
}

// Rows [row, row + Rows) x blocks [block, block + Blocks).
template <int Rows, int Blocks>
void tile(const Problem& p, int64_t row, int64_t block, bool prefetch) {
  __m512 acc[Rows][Blocks];
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_ps();
  const int32_t* x = p.x + row * p.pairs;
  const uint16_t* w = p.w + block * p.pairs * 2 * kColumns;
  const int64_t block_stride = p.pairs * 2 * kColumns;
  for (int64_t k = 0; k < p.pairs; ++k) {
    __m512bh weights[Blocks];
    for (int b = 0; b < Blocks; ++b)
      weights[b] = (__m512bh)_mm512_loadu_si512(w + b * block_stride + k * 2 * kColumns);
    if (prefetch) {  // past a block's end this is the next block's start: never a fault
      for (int b = 0; b < Blocks; ++b) {
        _mm_prefetch(reinterpret_cast<const char*>(
                         w + b * block_stride + (k + kPrefetchPairs) * 2 * kColumns),
                     _MM_HINT_T1);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(x[r * p.pairs + k]);
      for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], pair, weights[b]);
    }
  }
  if constexpr (Blocks == 2) {
    if (p.silu_mul) {  // 16 outputs a block pair
      uint16_t* out = p.out + row * (p.n / 2) + block / 2 * kColumns;
      for (int r = 0; r < Rows; ++r) {
        const __m512 silu = _mm512_mul_ps(acc[r][0], switchyard_simd::sigmoid(acc[r][0]));
        store_bf16(out + r * (p.n / 2), _mm512_mul_ps(silu, acc[r][1]));
      }
      return;
    }
  }
  for (int b = 0; b < Blocks; ++b) {
    const int64_t column = (block + b) * kColumns;
    __m512 bias = _mm512_setzero_ps();
    if (p.bias != nullptr) {  // bf16 -> float32 is a 16-bit shift
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.bias + column));
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int r = 0; r < Rows; ++r) {
      store_bf16(p.out + (row + r) * p.n + column, _mm512_add_ps(acc[r][b], bias));
    }
  }
}

template <int Blocks>
void rows_remainder(const Problem& p, int64_t row, int64_t block, int64_t count, bool prefetch) {
  switch (count) {
    case 1: return tile<1, Blocks>(p, row, block, prefetch);
    case 2: return tile<2, Blocks>(p, row, block, prefetch);
    case 3: return tile<3, Blocks>(p, row, block, prefetch);
    case 4: return tile<4, Blocks>(p, row, block, prefetch);
    case 5: return tile<5, Blocks>(p, row, block, prefetch);
    case 6: return tile<6, Blocks>(p, row, block, prefetch);
    case 7: return tile<7, Blocks>(p, row, block, prefetch);
    default: return;
  }
}

// Rows [first, last) against blocks [block, block + Blocks).
template <int Blocks>
void row_range(const Problem& p, int64_t block, int64_t first, int64_t last) {
  int64_t row = first;
  for (; row + kRowTile <= last; row += kRowTile) {
    tile<kRowTile, Blocks>(p, row, block, row == first);
  }
  rows_remainder<Blocks>(p, row, block, last - row, row == first);
}

// Work items are (pair of blocks, row chunk), a pair's chunks consecutive so that a thread
// reads a pair's weights once. Rows are split only where the pairs alone are too few to keep
// every thread busy (few output columns, many threads).
void run(const Problem& p) {
  const int64_t blocks = p.n / kColumns, pairs = (blocks + 1) / 2;
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t chunks =
      std::clamp<int64_t>((wanted + pairs - 1) / pairs, 1, (p.m + kRowTile - 1) / kRowTile);
  const int64_t chunk_rows = ((p.m + chunks - 1) / chunks + kRowTile - 1) / kRowTile * kRowTile;
  parallel_shares(pairs * chunks, [&](int64_t item) {
    const int64_t pair = item / chunks, first = (item % chunks) * chunk_rows;
    const int64_t last = std::min(p.m, first + chunk_rows);
    if (first >= last) return;
    if (2 * pair + 1 < blocks) row_range<2>(p, 2 * pair, first, last);
    else row_range<1>(p, 2 * pair, first, last);
  });
}

// Where the CPU has AMX, oneDNN's bf16 matmul (AMX tiles) ran a 128-row prefill of a ~1.5B
// model's linears ~6x faster than these tiles (gate / up 17920 x 1536: 5.3 vs 32.5 ms): from
// kAmxMinRows rows the packed blocks are unpacked a slice at a time (dense_slices.h) for it.
// Its sums round to bf16 before silu(gate) * up, where the tiles round once.
constexpr int64_t kAmxMinRows = 64;

bool onednn_has_amx() {
  static const bool amx = [] {
    const auto capabilities = at::cpu::get_cpu_capabilities();
    const auto found = capabilities.find("amx_bf16");
    return found != capabilities.end() && found->second.isBool() && found->second.toBool();
  }();
  return amx;
}

// Blocks [first / 16, (first + count) / 16) as [K, count]: a k-pair's line holds both rows.
void unpack_kn(const uint16_t* packed, int64_t pairs, int64_t first, int64_t count, uint16_t* out) {
  parallel_shares(count / kColumns, [&](int64_t b) {
    const uint16_t* block = packed + (first / kColumns + b) * pairs * 2 * kColumns;
    for (int64_t k = 0; k < pairs; ++k) {
      const __m512i line = _mm512_loadu_si512(block + k * 2 * kColumns);
      uint16_t* even = out + 2 * k * count + b * kColumns;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(even), _mm512_cvtepi32_epi16(line));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + count),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(line, 16)));
    }
  });
}

at::Tensor onednn_linear(const at::Tensor& rows, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, bool silu_mul) {
  const int64_t m = rows.size(0), pairs = packed.size(1), n = packed.size(0) * kColumns;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.const_data_ptr<c10::BFloat16>());
  at::Tensor product = switchyard_slices::dense_mm<switchyard_slices::Layout::kKN>(
      rows, n, kColumns, [&](int64_t first, int64_t count, auto* out) {
        if constexpr (std::is_same_v<std::remove_pointer_t<decltype(out)>, c10::BFloat16>)
          unpack_kn(w, pairs, first, count, reinterpret_cast<uint16_t*>(out));
      }, bias);
  if (!silu_mul) return product;
  const at::Tensor blocks = product.view({m, n / (2 * kColumns), 2, kColumns});  // gate, up
  return at::mul(at::silu(blocks.select(2, 0)), blocks.select(2, 1)).reshape({m, n / 2});
}

#endif

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const std::optional<at::Tensor>& bias, bool silu_mul) {
  TORCH_CHECK(bf16_linear_built(),
              "bf16_linear: this build has no AVX-512-BF16 code (the CPU lacks it)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_linear: x and the packed weight must be bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kColumns && packed.size(3) == 2 &&
                  packed.is_contiguous(),
              "bf16_linear: packed must be contiguous [N / 16, K / 2, 16, 2]");
  const int64_t k = x.size(-1), n = packed.size(0) * kColumns;
  TORCH_CHECK(packed.size(1) * 2 == k, "bf16_linear: x has ", k, " features, the weight ",
              packed.size(1) * 2);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 &&
                    bias->size(0) == n && bias->is_contiguous(),
                "bf16_linear: bias must be contiguous bfloat16 [", n, "]");
  }
  const at::Tensor rows = x.reshape({-1, k}).contiguous();
  TORCH_CHECK(!silu_mul || packed.size(0) % 2 == 0,
              "bf16_silu_mul_linear: packed must hold pairs of gate / up blocks");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = silu_mul ? n / 2 : n;
#ifdef __AVX512BF16__
  if (rows.size(0) >= kAmxMinRows && onednn_has_amx())
    return onednn_linear(rows, packed, bias, silu_mul).view(shape);
#endif
  at::Tensor out = at::empty({rows.size(0), shape.back()}, x.options());
#ifdef __AVX512BF16__
  if (rows.size(0) > 0) {
    const Problem p{reinterpret_cast<const int32_t*>(rows.const_data_ptr<c10::BFloat16>()),
                    reinterpret_cast<const uint16_t*>(packed.const_data_ptr<c10::BFloat16>()),
                    bias.has_value()
                        ? reinterpret_cast<const uint16_t*>(bias->const_data_ptr<c10::BFloat16>())
                        : nullptr,
                    reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>()),
                    rows.size(0), k / 2, n, silu_mul};
    run(p);
  }
#endif
  return out.view(shape);
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias) {
  return linear(x, packed, bias, false);
}

// silu(gate) * up of a gate / up projection packed by cpu_linear.pack_for_bf16_silu_mul.
at::Tensor bf16_silu_mul_linear(const at::Tensor& x, const at::Tensor& packed) {
  return linear(x, packed, std::nullopt, true);
}

}  // namespace

at::Tensor switchyard::bf16_matmul(const at::Tensor& x, const at::Tensor& packed, bool silu_mul) {
  return linear(x, packed, std::nullopt, silu_mul);
}

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("bf16_linear_built() -> bool");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("bf16_silu_mul_linear(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CompositeExplicitAutograd, m) {
  m.impl("bf16_linear_built", &bf16_linear_built);
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_silu_mul_linear", &bf16_silu_mul_linear);
}
