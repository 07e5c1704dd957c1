// 8-bit weights (GGUF Q8_0: w = q * scale, q in -128..127, one scale per 32 input columns)
// times int16-quantized activations, with AVX2's `vpmaddwd`: each 32-column block of an input
// row becomes int16 with its own scale (x ~ q16 * d, |q16| <= 32767: as fine as q4_mm's two
// int8 passes), and a block's dot products are exact int32 sums of 16-bit products, one
// multiply-add instruction per 16 weights with no second pass.
//
// Packed per block of 16 output rows ("lanes") and 4 input columns: 64 bytes, lane l's 4 bytes
// columns k..k+3:   packed [N / 16, K / 4, 16, 4] int8,   scales [N / 16, K / 32, 16] float16.
// (backends/quantized/q8_linear.py packs them.) Rows loop inside a lane block, so its weights
// come from memory once and from L1 for the rows after the first.
//
//   q8_mm(x [M, K] float32 | bfloat16, packed, scales) -> [M, N] in x's dtype

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "work_shares.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using switchyard_work::parallel_shares;

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 32;   // input columns per activation and weight scale
constexpr int64_t kStep = 4;     // input columns per packed line
constexpr int64_t kPrefetchAhead = 4096;  // bytes, into L2 (as q4_mm's one-row path)

struct QuantizedRows {
  const int16_t* q;    // [M, K]
  const float* scale;  // [M, K / 32]
};

// In a buffer of the calling thread, reused across calls.
template <typename T>
QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kBlock;
  thread_local std::vector<int16_t> values;
  thread_local std::vector<float> scales;
  if (static_cast<int64_t>(values.size()) < m * k) values.resize(m * k);
  if (static_cast<int64_t>(scales.size()) < m * blocks) scales.resize(m * blocks);
  const T* src = x.const_data_ptr<T>();
  int16_t* q = values.data();
  float* scale = scales.data();
  at::parallel_for(0, m * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* block = src + i * kBlock;  // row-major [M, K]: blocks are contiguous
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(static_cast<float>(block[j])));
      const float d = amax / 32767.f, inv = d > 0.f ? 1.f / d : 0.f;
      for (int64_t j = 0; j < kBlock; ++j)
        q[i * kBlock + j] = static_cast<int16_t>(std::nearbyint(static_cast<float>(block[j]) * inv));
      scale[i] = d;
    }
  });
  return QuantizedRows{q, scale};
}

// Lanes 4j..4j+3 hold two partial sums each in `acc[j]`; the 8 lanes' totals in lane order.
inline __m256i lane_totals(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xD8);
}

template <typename Out>
void lane_block_row(const int8_t* packed, const uint16_t* scales, const QuantizedRows& xq,
                    int64_t row, int64_t k, Out* out) {
  const int64_t blocks = k / kBlock;
  const int16_t* x = xq.q + row * k;
  const float* dx = xq.scale + row * blocks;
  __m256 total0 = _mm256_setzero_ps(), total1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* lines = packed + b * (kBlock / kStep) * 64;
    for (int line = 0; line < 8; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(lines + kPrefetchAhead + 64 * line), _MM_HINT_T1);
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                      _mm256_setzero_si256()};
    for (int64_t t = 0; t < kBlock / kStep; ++t) {
      int64_t four;
      std::memcpy(&four, x + b * kBlock + t * kStep, sizeof(four));
      const __m256i xs = _mm256_set1_epi64x(four);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m128i w8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lines + 64 * t + 16 * j));
        acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_cvtepi8_epi16(w8), xs));
      }
    }
    const uint16_t* s = scales + b * kLanes;
    const __m256 d = _mm256_set1_ps(dx[b]);
    const __m256 scale0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    const __m256 scale1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8)));
    total0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane_totals(acc[0], acc[1])),
                             _mm256_mul_ps(scale0, d), total0);
    total1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane_totals(acc[2], acc[3])),
                             _mm256_mul_ps(scale1, d), total1);
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, total0);
  _mm256_store_ps(lanes + 8, total1);
  for (int64_t l = 0; l < kLanes; ++l) out[l] = static_cast<Out>(lanes[l]);
}

template <typename Out>
void all_lane_blocks(const int8_t* packed, const uint16_t* scales, const QuantizedRows& xq,
                     int64_t m, int64_t k, int64_t lane_blocks, Out* out) {
  const int64_t n = lane_blocks * kLanes;
  const int64_t packed_stride = k / kStep * 64, scale_stride = k / kBlock * kLanes;
  parallel_shares(lane_blocks, [&](int64_t nb) {
    for (int64_t row = 0; row < m; ++row)
      lane_block_row(packed + nb * packed_stride, scales + nb * scale_stride, xq, row, k,
                     out + row * n + nb * kLanes);
  });
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "q8_mm: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kLanes &&
                  packed.size(3) == kStep && packed.is_contiguous(),
              "q8_mm: packed must be contiguous int8 [N / 16, K / 4, 16, 4]");
  const int64_t m = x.size(0), k = x.size(1), lane_blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) * kStep == k && k % kBlock == 0,
              "q8_mm: x has ", k, " columns, the weight ", packed.size(1) * kStep,
              " (a multiple of 32 needed)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == lane_blocks && scales.size(1) == k / kBlock &&
                  scales.size(2) == kLanes,
              "q8_mm: scales must be contiguous float16 [N / 16, K / 32, 16]");
  at::Tensor out = at::empty({m, lane_blocks * kLanes}, x.options());
  const int8_t* p = packed.const_data_ptr<int8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::Half>());
  if (x.scalar_type() == at::kFloat) {
    all_lane_blocks(p, s, quantize_rows<float>(x), m, k, lane_blocks, out.mutable_data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "q8_mm: x must be float32 or bfloat16");
    all_lane_blocks(p, s, quantize_rows<c10::BFloat16>(x), m, k, lane_blocks,
                    out.mutable_data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("q8_mm(Tensor x, Tensor packed, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("q8_mm", &q8_mm); }
