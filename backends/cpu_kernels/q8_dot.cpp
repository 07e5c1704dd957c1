// 8-bit weights (GGUF Q8_0: w = q * scale, q in -128..127, one scale per 32 input columns)
// times int16-quantized activations, with AVX2's `vpmaddwd` or AVX-512 VNNI's `vpdpwssd`: each
// 32-column block of an input row becomes int16 with its own scale (x ~ q16 * d, |q16| <= 32767:
// as fine as q4_mm's two int8 passes), and a block's dot products are exact int32 sums of 16-bit
// products, one multiply-add instruction per 16 (AVX2) or 32 (VNNI) weights, no second pass.
//
// Packed per block of 16 output rows ("lanes") and 4 input columns: 64 bytes, lane l's 4 bytes
// columns k..k+3:   packed [N / 16, K / 4, 16, 4] int8,   scales [N / 16, K / 32, 16] float16.
// (backends/quantized/q8_linear.py packs them.) Rows loop inside a lane block (VNNI: 8-row
// tiles share each widened line), so its weights come from memory once.
//
//   q8_mm(x [M, K] float32 | bfloat16, packed, scales) -> [M, N] in x's dtype
//   q8_dense_mm(x, packed, scales) -> [M, N]: prefill's, dequantized a slice at a time
//   q8_dequantize(packed, scales, dtype) -> [N, K]

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "dense_slices.h"
#include "work_shares.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
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

#ifdef SWITCHYARD_VNNI
// AVX-512 VNNI: a 64-byte line (16 lanes x 4 columns) widens to two vectors of int16, lanes
// 0-7 and 8-15, and `vpdpwssd` adds each lane's pairs of products into two int32 partial sums
// (columns k, k+1 and k+2, k+3). Up to kRowTile rows share each widened line.
constexpr int kRowTile = 8;

// Lanes 0-7 in `lo`, 8-15 in `hi`, two partial sums a lane: the 16 totals in lane order.
inline __m512i lane_totals(__m512i lo, __m512i hi) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_epi32(_mm512_permutex2var_epi32(lo, even, hi),
                          _mm512_permutex2var_epi32(lo, odd, hi));
}

template <int Rows, typename Out>
void row_tile(const int8_t* packed, const uint16_t* scales, const QuantizedRows& xq, int64_t row0,
              int64_t k, Out* out, int64_t n) {
  const int64_t blocks = k / kBlock;
  const int16_t* x = xq.q + row0 * k;
  const float* dx = xq.scale + row0 * blocks;
  __m512 total[Rows];
  for (int r = 0; r < Rows; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* lines = packed + b * (kBlock / kStep) * 64;
    if constexpr (Rows == 1) {
      for (int line = 0; line < 8; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(lines + kPrefetchAhead + 64 * line), _MM_HINT_T1);
    }
    __m512i lo[Rows], hi[Rows];
    for (int r = 0; r < Rows; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
    for (int64_t t = 0; t < kBlock / kStep; ++t) {
      const __m512i bytes = _mm512_loadu_si512(lines + 64 * t);
      const __m512i w_lo = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(bytes));
      const __m512i w_hi = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(bytes, 1));
      for (int r = 0; r < Rows; ++r) {
        int64_t four;
        std::memcpy(&four, x + r * k + b * kBlock + t * kStep, sizeof(four));
        const __m512i xs = _mm512_set1_epi64(four);
        lo[r] = _mm512_dpwssd_epi32(lo[r], w_lo, xs);
        hi[r] = _mm512_dpwssd_epi32(hi[r], w_hi, xs);
      }
    }
    const __m512 scale = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + b * kLanes)));
    for (int r = 0; r < Rows; ++r)
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lane_totals(lo[r], hi[r])),
                                 _mm512_mul_ps(scale, _mm512_set1_ps(dx[r * blocks + b])), total[r]);
  }
  for (int r = 0; r < Rows; ++r) {
    alignas(64) float lanes[kLanes];
    _mm512_store_ps(lanes, total[r]);
    for (int64_t l = 0; l < kLanes; ++l) out[(row0 + r) * n + l] = static_cast<Out>(lanes[l]);
  }
}

template <typename Out>
void rows_of_lane_block(const int8_t* packed, const uint16_t* scales, const QuantizedRows& xq,
                        int64_t m, int64_t k, Out* out, int64_t n) {
  int64_t row = 0;
  for (; row + kRowTile <= m; row += kRowTile)
    row_tile<kRowTile>(packed, scales, xq, row, k, out, n);
  if (m - row >= 4) row_tile<4>(packed, scales, xq, row, k, out, n), row += 4;
  if (m - row >= 2) row_tile<2>(packed, scales, xq, row, k, out, n), row += 2;
  if (m - row >= 1) row_tile<1>(packed, scales, xq, row, k, out, n);
}

#else
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

// Rows one at a time: a lane block's weights come from L1 / L2 after the first.
template <typename Out>
void rows_of_lane_block(const int8_t* packed, const uint16_t* scales, const QuantizedRows& xq,
                        int64_t m, int64_t k, Out* out, int64_t n) {
  for (int64_t row = 0; row < m; ++row)
    lane_block_row(packed, scales, xq, row, k, out + row * n);
}
#endif

template <typename Out>
void all_lane_blocks(const int8_t* packed, const uint16_t* scales, const QuantizedRows& xq,
                     int64_t m, int64_t k, int64_t lane_blocks, Out* out) {
  const int64_t n = lane_blocks * kLanes;
  const int64_t packed_stride = k / kStep * 64, scale_stride = k / kBlock * kLanes;
  parallel_shares(lane_blocks, [&](int64_t nb) {
    rows_of_lane_block(packed + nb * packed_stride, scales + nb * scale_stride, xq, m, k,
                       out + nb * kLanes, n);
  });
}

// The weight dequantized in `Out`: [N, K] (the tied embedding's rows, tests), or [K, n] for a
// slice of n = 16 * count output rows (prefill's product): there a packed line's 4 columns x
// 16 lanes become 4 rows of the slice, without a transpose.
#ifdef SWITCHYARD_VNNI
inline __m256i to_bf16(__m512 v) {  // round to nearest even (weights hold no NaN)
  __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

template <typename Out>
inline void store_line(const int8_t* line, const uint16_t* lane_scales, Out* dst, int64_t stride) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_scales)));
  const __m512i bytes = _mm512_loadu_si512(line);
  for (int c = 0; c < kStep; ++c) {  // byte c of each lane's 4
    const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(bytes, 24 - 8 * c), 24);
    const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale);
    if constexpr (std::is_same_v<Out, float>)
      _mm512_storeu_ps(dst + c * stride, w);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * stride), to_bf16(w));
  }
}
#else
template <typename Out>
inline void store_line(const int8_t* line, const uint16_t* lane_scales, Out* dst, int64_t stride) {
  float scale[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) scale[l] = c10::Half(lane_scales[l], c10::Half::from_bits());
  for (int64_t c = 0; c < kStep; ++c)
    for (int64_t l = 0; l < kLanes; ++l)
      dst[c * stride + l] = static_cast<Out>(static_cast<float>(line[l * kStep + c]) * scale[l]);
}
#endif

// Lane blocks [0, count) as [K, 16 count].
template <typename Out>
void dequantize_kn(const int8_t* packed, const uint16_t* scales, int64_t k, int64_t count,
                   Out* out) {
  const int64_t n = count * kLanes, packed_stride = k / kStep * 64, scale_stride = k / kBlock * kLanes;
  parallel_shares(count, [&](int64_t nb) {
    for (int64_t line = 0; line < k / kStep; ++line)
      store_line(packed + nb * packed_stride + line * 64,
                 scales + nb * scale_stride + line * kStep / kBlock * kLanes,
                 out + line * kStep * n + nb * kLanes, n);
  });
}

void check_operands(const char* op, const at::Tensor& x, const at::Tensor& packed,
                    const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [M, K] matrix");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kLanes &&
                  packed.size(3) == kStep && packed.is_contiguous(),
              op, ": packed must be contiguous int8 [N / 16, K / 4, 16, 4]");
  const int64_t k = x.size(1), lane_blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) * kStep == k && k % kBlock == 0,
              op, ": x has ", k, " columns, the weight ", packed.size(1) * kStep,
              " (a multiple of 32 needed)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == lane_blocks && scales.size(1) == k / kBlock &&
                  scales.size(2) == kLanes,
              op, ": scales must be contiguous float16 [N / 16, K / 32, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16");
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  check_operands("q8_mm", x, packed, scales);
  const int64_t m = x.size(0), k = x.size(1), lane_blocks = packed.size(0);
  at::Tensor out = at::empty({m, lane_blocks * kLanes}, x.options());
  const int8_t* p = packed.const_data_ptr<int8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::Half>());
  if (x.scalar_type() == at::kFloat) {
    all_lane_blocks(p, s, quantize_rows<float>(x), m, k, lane_blocks, out.mutable_data_ptr<float>());
  } else {
    all_lane_blocks(p, s, quantize_rows<c10::BFloat16>(x), m, k, lane_blocks,
                    out.mutable_data_ptr<c10::BFloat16>());
  }
  return out;
}

// Prefill's product (dense_slices.h).
at::Tensor q8_dense_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  check_operands("q8_dense_mm", x, packed, scales);
  const int64_t k = x.size(1), packed_stride = k / kStep * 64, scale_stride = k / kBlock * kLanes;
  const int8_t* p = packed.const_data_ptr<int8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::Half>());
  return switchyard_slices::dense_mm<switchyard_slices::Layout::kKN>(
      x, packed.size(0) * kLanes, kLanes, [&](int64_t first, int64_t count, auto* w) {
        const int64_t block = first / kLanes;
        dequantize_kn(p + block * packed_stride, s + block * scale_stride, k, count / kLanes, w);
      });
}

at::Tensor q8_dequantize(const at::Tensor& packed, const at::Tensor& scales,
                         at::ScalarType dtype) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous() &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "q8_dequantize: packed int8 [N / 16, K / 4, 16, 4], scales float16");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "q8_dequantize: float32 or bfloat16 out");
  const int64_t lane_blocks = packed.size(0), k = packed.size(1) * kStep;
  at::Tensor kn = at::empty({k, lane_blocks * kLanes}, packed.options().dtype(dtype));
  const int8_t* p = packed.const_data_ptr<int8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::Half>());
  if (dtype == at::kFloat)
    dequantize_kn(p, s, k, lane_blocks, kn.mutable_data_ptr<float>());
  else
    dequantize_kn(p, s, k, lane_blocks, kn.mutable_data_ptr<c10::BFloat16>());
  return kn.t().contiguous();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("q8_mm(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("q8_dequantize(Tensor packed, Tensor scales, ScalarType dtype) -> Tensor");
  m.def("q8_dense_mm(Tensor x, Tensor packed, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("q8_mm", &q8_mm);
  m.impl("q8_dequantize", &q8_dequantize);
  m.impl("q8_dense_mm", &q8_dense_mm);
}
