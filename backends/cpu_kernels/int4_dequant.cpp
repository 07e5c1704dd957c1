// The int8-dot layout's 4-bit weights dequantized into a dense [K, N] matrix (float32 or
// bfloat16), for prefill's dequantize + matmul. Written in torch ops the same unpacking took
// ~150 ms of a 16-prompt prefill of the default model (one strided copy per nibble plane, then
// addcmul); here each 64-byte block is read once and its 8 output rows written whole.
//
// Layout (see int8_dot.cpp, backends/quantized/int8_dot_layout.py): packed [N / 16, K / 8,
// 16, 4] uint8, lane l's 4 bytes hold columns k..k+3 (low nibbles) and k+4..k+7 (high);
// scale_zero [N / 16, K / group, 2, 16] float16; w = q * scale + zero.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dense_slices.h"

namespace {

constexpr int64_t kLanes = 16;

inline void halves_to_floats(const uint16_t* src, float* dst) {
#ifdef __AVX512F__
  _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
#else
  for (int i = 0; i < kLanes; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
}

// Round to nearest even; the values are finite (q <= 15, finite float16 scale and zero).
inline uint16_t to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline void store(const float* values, float* out) { std::memcpy(out, values, kLanes * 4); }

inline void store(const float* values, uint16_t* out) {
  for (int l = 0; l < kLanes; ++l) out[l] = to_bf16_bits(values[l]);
}

// Output rows 8t..8t+7 of lane block b: 16 columns each.
template <typename Out>
inline void dequantize_block(const uint8_t* block, const float* scale, const float* zero,
                             Out* out, int64_t n) {
  uint32_t words[kLanes];
  std::memcpy(words, block, sizeof(words));
  float low[kLanes], high[kLanes];
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < kLanes; ++l) {
      const uint32_t byte = words[l] >> (8 * j);
      low[l] = static_cast<float>(byte & 15u) * scale[l] + zero[l];
      high[l] = static_cast<float>((byte >> 4) & 15u) * scale[l] + zero[l];
    }
    store(low, out + j * n);
    store(high, out + (4 + j) * n);
  }
}

template <typename Out>
void dequantize_all(const uint8_t* packed, const uint16_t* sz, int64_t lane_blocks, int64_t k,
                    int64_t group, Out* out) {
  const int64_t n = lane_blocks * kLanes, steps = k / 8, groups = k / group;
  // Each thread takes a run of 8-row steps across every lane block: whole output rows.
  at::parallel_for(0, steps, 4, [&](int64_t begin, int64_t end) {
    float scale[kLanes], zero[kLanes];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t * 8 / group;
      for (int64_t b = 0; b < lane_blocks; ++b) {
        const uint16_t* block_sz = sz + (b * groups + g) * 2 * kLanes;
        halves_to_floats(block_sz, scale);
        halves_to_floats(block_sz + kLanes, zero);
        dequantize_block(packed + (b * steps + t) * 64, scale, zero, out + t * 8 * n + b * kLanes,
                         n);
      }
    }
  });
}

void check_operands(const char* op, const at::Tensor& packed, const at::Tensor& scale_zero,
                    int64_t group_size) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(2) == 16 &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              op, ": packed must be contiguous uint8 [N / 16, K / 8, 16, 4]");
  const int64_t lane_blocks = packed.size(0), k = packed.size(1) * 8;
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && k % group_size == 0,
              op, ": bad group size");
  TORCH_CHECK(scale_zero.scalar_type() == at::kHalf && scale_zero.is_contiguous() &&
                  scale_zero.dim() == 4 && scale_zero.size(0) == lane_blocks &&
                  scale_zero.size(1) == k / group_size && scale_zero.size(2) == 2 &&
                  scale_zero.size(3) == kLanes,
              op, ": scale_zero must be contiguous float16 [N / 16, K / group, 2, 16]");
}

at::Tensor q4_dequantize_kn(const at::Tensor& packed, const at::Tensor& scale_zero,
                            int64_t group_size, at::ScalarType dtype) {
  check_operands("q4_dequantize_kn", packed, scale_zero, group_size);
  const int64_t lane_blocks = packed.size(0), k = packed.size(1) * 8;
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "q4_dequantize_kn: dtype must be float32 or bfloat16");
  at::Tensor out = at::empty({k, lane_blocks * kLanes}, packed.options().dtype(dtype));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scale_zero.data_ptr<at::Half>());
  if (dtype == at::kFloat)
    dequantize_all(p, sz, lane_blocks, k, group_size, out.data_ptr<float>());
  else
    dequantize_all(p, sz, lane_blocks, k, group_size,
                   reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()));
  return out;
}

// Prefill's product (dense_slices.h): x [M, K] times the weight, [M, N] in x's dtype.
at::Tensor q4_dense_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zero,
                       int64_t group_size) {
  check_operands("q4_dense_mm", packed, scale_zero, group_size);
  const int64_t k = packed.size(1) * 8;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "q4_dense_mm: x must be a contiguous float32 or bfloat16 [M, ", k, "] matrix");
  const uint8_t* p = packed.const_data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scale_zero.const_data_ptr<at::Half>());
  const int64_t packed_stride = k / 8 * 64, sz_stride = k / group_size * 2 * kLanes;
  return switchyard_slices::dense_mm<switchyard_slices::Layout::kKN>(
      x, packed.size(0) * kLanes, kLanes, [&](int64_t first, int64_t count, auto* w) {
        const uint8_t* lanes = p + first / kLanes * packed_stride;
        const uint16_t* lane_sz = sz + first / kLanes * sz_stride;
        if constexpr (std::is_same_v<std::remove_pointer_t<decltype(w)>, float>)
          dequantize_all(lanes, lane_sz, count / kLanes, k, group_size, w);
        else
          dequantize_all(lanes, lane_sz, count / kLanes, k, group_size,
                         reinterpret_cast<uint16_t*>(w));
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("q4_dequantize_kn(Tensor packed, Tensor scale_zero, int group_size, ScalarType dtype) "
        "-> Tensor");
  m.def("q4_dense_mm(Tensor x, Tensor packed, Tensor scale_zero, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("q4_dequantize_kn", &q4_dequantize_kn);
  m.impl("q4_dense_mm", &q4_dense_mm);
}
