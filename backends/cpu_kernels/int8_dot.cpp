// 4-bit weights times int8-quantized activations on x86 CPUs, llama.cpp's approach: each
// 32-column block of an input row is quantized to int8 with its own scale, and a block's dot
// products run on 8-bit integer multiply-adds (AVX-512 VNNI `vpdpbusd`, or AVX2's
// `vpmaddubsw` + `vpmaddwd`), 64 (32) multiply-adds an instruction, where float kernels do 16.
//
// Weights w[n, k] = q[n, k] * scale[n, g] + zero[n, g] (q in 0..15, g = k / group_size).
// Packed per block of 16 output rows (a "lane" each) and 8 columns: 64 bytes, lane l's 4
// bytes hold columns k..k+3 in their low nibbles and k+4..k+7 in their high ones:
//   packed [N / 16, K / 8, 16, 4] uint8,  scale_zero [N / 16, K / group, 2, 16] float16.
// Built by backends/cpu_kernels/build.py with either SWITCHYARD_VNNI (AVX-512 VNNI) or AVX2
// code; the layout is the same (backends/quantized/int8_dot_layout.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernel_entry_points.h"
#include "simd.h"
#include "work_shares.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using switchyard_work::parallel_shares;

constexpr int64_t kLanes = 16;     // output rows per packed block
constexpr int64_t kBlock = 32;     // input columns per activation scale
constexpr int64_t kRowTile = 8;    // input rows sharing one unpacked weight block

// In a buffer of the calling thread, reused across calls (a decode step makes ~120 of them).
struct QuantizedRows {
  int8_t* q;      // [M, K]
  int8_t* rest;   // [M, K]: x ~ (q + rest / 254) * scale (filled when `fine`)
  float* scale;   // [M, K / 32]
  float* sum;     // [M, K / 32]: the block's sum of x, for the zero term
};

using switchyard_simd::load8;

inline float horizontal(__m256 v, __m128 (*op)(__m128, __m128)) {
  __m128 r = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = op(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(op(r, _mm_movehdup_ps(r)));
}

inline __m128 max4(__m128 a, __m128 b) { return _mm_max_ps(a, b); }
inline __m128 add4(__m128 a, __m128 b) { return _mm_add_ps(a, b); }

// Four vectors of whole numbers in -128..127 -> 32 int8 in order.
inline void store_int8(int8_t* out, const __m256 v[4]) {
  const __m256i words0 = _mm256_packs_epi32(_mm256_cvtps_epi32(v[0]), _mm256_cvtps_epi32(v[1]));
  const __m256i words1 = _mm256_packs_epi32(_mm256_cvtps_epi32(v[2]), _mm256_cvtps_epi32(v[3]));
  const __m256i bytes = _mm256_packs_epi16(words0, words1);  // 4-byte groups 0 2 4 6 1 3 5 7
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// One 32-column block: scale = amax / 127, q = round(x / scale) (to nearest, ties to even, as
// std::nearbyint), rest = round((x / scale - q) * 254); returns the block's sum of x. A scalar
// loop here cost ~3 us a call at the default model's 576 columns (~0.35 ms of a batch-1 step).
template <typename T>
inline float quantize_block(const T* row, bool fine, int8_t* q, int8_t* rest, float* scale) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    v[c] = load8(row + 8 * c);
    amax = _mm256_max_ps(_mm256_and_ps(v[c], magnitude), amax);  // a NaN keeps amax
    total = _mm256_add_ps(total, v[c]);
  }
  const float d = horizontal(amax, max4) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  __m256 scaled[4], rounded[4], residue[4];
  for (int c = 0; c < 4; ++c) {
    scaled[c] = _mm256_mul_ps(v[c], _mm256_set1_ps(inv));
    rounded[c] = _mm256_round_ps(scaled[c], kRound);
    if (fine)
      residue[c] = _mm256_round_ps(
          _mm256_mul_ps(_mm256_sub_ps(scaled[c], rounded[c]), _mm256_set1_ps(254.f)), kRound);
  }
  store_int8(q, rounded);
  if (fine) store_int8(rest, residue);
  *scale = d;
  return horizontal(total, add4);
}

template <typename T>
QuantizedRows quantize_rows(const at::Tensor& x, bool fine) {
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kBlock;
  thread_local std::vector<float> storage;
  const int64_t floats = 2 * m * blocks + (2 * m * k + 3) / 4;
  if (static_cast<int64_t>(storage.size()) < floats) storage.resize(floats);
  QuantizedRows out{};
  out.scale = storage.data();
  out.sum = out.scale + m * blocks;
  out.q = reinterpret_cast<int8_t*>(out.sum + m * blocks);
  out.rest = out.q + m * k;
  const T* src = x.data_ptr<T>();
  at::parallel_for(0, m * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // blocks are contiguous: row-major [M, K]
      out.sum[i] = quantize_block(src + i * kBlock, fine, out.q + i * kBlock,
                                  out.rest + i * kBlock, out.scale + i);
    }
  });
  return out;
}

template <typename Out>
inline void store(const float* lanes, int count, Out* out) {
  for (int i = 0; i < count; ++i) out[i] = static_cast<Out>(lanes[i]);  // bf16: nearest even
}

// A row read alone asks for the lines this far ahead, into L2: over the default model's 121
// linears from memory, 0.87-0.93x the time of asking 1 KB ahead into L1 (two alternating runs;
// 2-6 KB measured alike), which was ~5% faster than the hardware prefetcher alone.
constexpr int64_t kPrefetchAhead = 4096;  // bytes: sixteen 32-column blocks

#ifdef SWITCHYARD_VNNI

// One 32-column block of 16 lanes against one row: int32 dot products per lane.
inline __m512i block_dot(const __m512i w[8], const int8_t* x) {
  const int32_t* x4 = reinterpret_cast<const int32_t*>(x);
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
  for (int t = 0; t < 4; ++t) {
    lo = _mm512_dpbusd_epi32(lo, w[2 * t], _mm512_set1_epi32(x4[2 * t]));
    hi = _mm512_dpbusd_epi32(hi, w[2 * t + 1], _mm512_set1_epi32(x4[2 * t + 1]));
  }
  return _mm512_add_epi32(lo, hi);
}

inline void unpack_block(const uint8_t* p, __m512i w[8]) {
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    const __m512i bytes = _mm512_loadu_si512(p + 64 * t);
    w[2 * t] = _mm512_and_si512(bytes, low_mask);
    w[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_mask);
  }
}

// Rows [m0, m0 + rows) of lane block `nb`: out[m, 16 nb + l] for every lane l.
template <int Rows, bool Fine, typename Out>
void lane_block(const uint8_t* packed, const uint16_t* sz, const QuantizedRows& xq, int64_t m0,
                int64_t k, int64_t group, Out* out, int64_t n) {
  const int64_t blocks = k / kBlock;
  const int8_t* q = xq.q + m0 * k;
  const int8_t* rest = xq.rest + m0 * k;
  const float* d = xq.scale + m0 * blocks;
  const float* s = xq.sum + m0 * blocks;
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  __m512i w[8];
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (Rows == 1) {
      for (int line = 0; line < 4; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(packed + b * 4 * 64 + kPrefetchAhead + 64 * line),
                     _MM_HINT_T1);
    }
    unpack_block(packed + b * 4 * 64, w);
    const uint16_t* g = sz + (b * kBlock / group) * 2 * kLanes;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
    const __m512 zero =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + kLanes)));
    for (int r = 0; r < Rows; ++r) {
      __m512 dot = _mm512_cvtepi32_ps(block_dot(w, q + r * k + b * kBlock));
      if constexpr (Fine)
        dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dot(w, rest + r * k + b * kBlock)),
                              _mm512_set1_ps(1.f / 254.f), dot);
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(d[r * blocks + b])),
                               acc[r]);
      acc[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(s[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    alignas(64) float lanes[kLanes];
    _mm512_store_ps(lanes, acc[r]);
    store(lanes, kLanes, out + (m0 + r) * n);
  }
}

#else  // AVX2: a lane block is two halves of 8 lanes

inline __m256i half_dot(const __m256i w[8], const int8_t* x) {
  const int32_t* x4 = reinterpret_cast<const int32_t*>(x);
  // Products of 0..15 and -128..127: pairs sum to at most 3810, eight such to 30480 (int16).
  __m256i sum16 = _mm256_setzero_si256();
  for (int t = 0; t < 8; ++t)
    sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(w[t], _mm256_set1_epi32(x4[t])));
  return _mm256_madd_epi16(sum16, _mm256_set1_epi16(1));
}

inline void unpack_half(const uint8_t* p, int half, __m256i w[8]) {
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    const __m256i bytes =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * t + 32 * half));
    w[2 * t] = _mm256_and_si256(bytes, low_mask);
    w[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
  }
}

// One input row (decode at batch 1) against all 16 lanes at once: both halves share the row's
// broadcasts and give the core two independent chains, the weights unpacked where they are
// used. 0.90x the time of two half passes over the default model's 121 linears (2 threads).
template <bool Fine>
inline void dot_16_lanes(const uint8_t* p, const int8_t* x, const int8_t* xr, __m256i& s0,
                         __m256i& s1, __m256i& r0, __m256i& r1) {
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const int32_t* x4 = reinterpret_cast<const int32_t*>(x);
  const int32_t* r4 = reinterpret_cast<const int32_t*>(xr);
  s0 = s1 = r0 = r1 = _mm256_setzero_si256();
  for (int t = 0; t < 4; ++t) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * t));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * t + 32));
    const __m256i lo0 = _mm256_and_si256(b0, low_mask), lo1 = _mm256_and_si256(b1, low_mask);
    const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(b0, 4), low_mask);
    const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(b1, 4), low_mask);
    const __m256i xl = _mm256_set1_epi32(x4[2 * t]), xh = _mm256_set1_epi32(x4[2 * t + 1]);
    s0 = _mm256_add_epi16(s0, _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl),
                                               _mm256_maddubs_epi16(hi0, xh)));
    s1 = _mm256_add_epi16(s1, _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl),
                                               _mm256_maddubs_epi16(hi1, xh)));
    if constexpr (Fine) {
      const __m256i rl = _mm256_set1_epi32(r4[2 * t]), rh = _mm256_set1_epi32(r4[2 * t + 1]);
      r0 = _mm256_add_epi16(r0, _mm256_add_epi16(_mm256_maddubs_epi16(lo0, rl),
                                                 _mm256_maddubs_epi16(hi0, rh)));
      r1 = _mm256_add_epi16(r1, _mm256_add_epi16(_mm256_maddubs_epi16(lo1, rl),
                                                 _mm256_maddubs_epi16(hi1, rh)));
    }
  }
}

template <bool Fine>
inline __m256 block_value(__m256i sum, __m256i rest) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
  if constexpr (Fine)
    dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(rest, ones)),
                          _mm256_set1_ps(1.f / 254.f), dot);
  return dot;
}

template <bool Fine, typename Out>
void lane_block_one_row(const uint8_t* packed, const uint16_t* sz, const QuantizedRows& xq,
                        int64_t m0, int64_t k, int64_t group, Out* out, int64_t n) {
  const int64_t blocks = k / kBlock;
  const int8_t* q = xq.q + m0 * k;
  const int8_t* rest = xq.rest + m0 * k;
  const float* d = xq.scale + m0 * blocks;
  const float* s = xq.sum + m0 * blocks;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i s0, s1, r0, r1;
    for (int line = 0; line < 4; ++line)  // past the lane block's end: the next one's lines
      _mm_prefetch(reinterpret_cast<const char*>(packed + b * 4 * 64 + kPrefetchAhead + 64 * line),
                   _MM_HINT_T1);
    dot_16_lanes<Fine>(packed + b * 4 * 64, q + b * kBlock, rest + b * kBlock, s0, s1, r0, r1);
    const uint16_t* g = sz + (b * kBlock / group) * 2 * kLanes;
    const __m256 db = _mm256_set1_ps(d[b]), sb = _mm256_set1_ps(s[b]);
    const __m256 scale0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    const __m256 scale1 =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 8)));
    const __m256 zero0 =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + kLanes)));
    const __m256 zero1 =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + kLanes + 8)));
    // lane_block's order: a row alone gets the bits it gets inside a tile
    acc0 = _mm256_fmadd_ps(block_value<Fine>(s0, r0), _mm256_mul_ps(scale0, db), acc0);
    acc0 = _mm256_fmadd_ps(zero0, sb, acc0);
    acc1 = _mm256_fmadd_ps(block_value<Fine>(s1, r1), _mm256_mul_ps(scale1, db), acc1);
    acc1 = _mm256_fmadd_ps(zero1, sb, acc1);
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, acc0);
  _mm256_store_ps(lanes + 8, acc1);
  store(lanes, 16, out + m0 * n);
}

template <int Rows, bool Fine, typename Out>
void lane_block(const uint8_t* packed, const uint16_t* sz, const QuantizedRows& xq, int64_t m0,
                int64_t k, int64_t group, Out* out, int64_t n) {
  const int64_t blocks = k / kBlock;
  const int8_t* q = xq.q + m0 * k;
  const int8_t* rest = xq.rest + m0 * k;
  const float* d = xq.scale + m0 * blocks;
  const float* s = xq.sum + m0 * blocks;
  for (int half = 0; half < 2; ++half) {
    __m256 acc[Rows];
    for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
    __m256i w[8];
    for (int64_t b = 0; b < blocks; ++b) {
      unpack_half(packed + b * 4 * 64, half, w);
      const uint16_t* g = sz + (b * kBlock / group) * 2 * kLanes + 8 * half;
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
      const __m256 zero =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + kLanes)));
      for (int r = 0; r < Rows; ++r) {
        __m256 dot = _mm256_cvtepi32_ps(half_dot(w, q + r * k + b * kBlock));
        if constexpr (Fine)
          dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half_dot(w, rest + r * k + b * kBlock)),
                                _mm256_set1_ps(1.f / 254.f), dot);
        acc[r] = _mm256_fmadd_ps(
            dot, _mm256_mul_ps(scale, _mm256_set1_ps(d[r * blocks + b])), acc[r]);
        acc[r] = _mm256_fmadd_ps(zero, _mm256_set1_ps(s[r * blocks + b]), acc[r]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r]);
      store(lanes, 8, out + (m0 + r) * n + 8 * half);
    }
  }
}

#endif

template <bool Fine, typename Out>
void rows_of_lane_block(const uint8_t* packed, const uint16_t* sz, const QuantizedRows& xq,
                        int64_t m, int64_t k, int64_t group, Out* out, int64_t n) {
  int64_t m0 = 0;
  for (; m0 + kRowTile <= m; m0 += kRowTile)
    lane_block<kRowTile, Fine>(packed, sz, xq, m0, k, group, out, n);
#ifdef SWITCHYARD_VNNI
  for (; m0 < m; ++m0) lane_block<1, Fine>(packed, sz, xq, m0, k, group, out, n);
#else
  for (; m0 < m; ++m0) lane_block_one_row<Fine>(packed, sz, xq, m0, k, group, out, n);
#endif
}

template <typename Out>
void all_lane_blocks(const uint8_t* p, const uint16_t* sz, const QuantizedRows& xq, int64_t m,
                     int64_t k, int64_t group, bool fine, Out* o, int64_t lane_blocks) {
  const int64_t n = lane_blocks * kLanes;
  const int64_t packed_stride = k / 8 * 64, sz_stride = k / group * 2 * kLanes;
  parallel_shares(lane_blocks, [&](int64_t nb) {
    const uint8_t* lanes = p + nb * packed_stride;
    const uint16_t* lane_sz = sz + nb * sz_stride;
    if (fine)
      rows_of_lane_block<true>(lanes, lane_sz, xq, m, k, group, o + nb * kLanes, n);
    else
      rows_of_lane_block<false>(lanes, lane_sz, xq, m, k, group, o + nb * kLanes, n);
  });
}

at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zero,
                 int64_t group_size, bool fine) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "q4_mm: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(2) == 16 &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              "q4_mm: packed must be contiguous uint8 [N / 16, K / 8, 16, 4]");
  const int64_t m = x.size(0), k = x.size(1), lane_blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) * 8 == k && k % kBlock == 0, "q4_mm: K mismatch or not a multiple of 32");
  TORCH_CHECK(group_size % kBlock == 0 && k % group_size == 0, "q4_mm: bad group size");
  TORCH_CHECK(scale_zero.scalar_type() == at::kHalf && scale_zero.is_contiguous() &&
                  scale_zero.dim() == 4 && scale_zero.size(0) == lane_blocks &&
                  scale_zero.size(1) == k / group_size && scale_zero.size(2) == 2 &&
                  scale_zero.size(3) == kLanes,
              "q4_mm: scale_zero must be contiguous float16 [N / 16, K / group, 2, 16]");
  QuantizedRows xq;
  if (x.scalar_type() == at::kFloat) {
    xq = quantize_rows<float>(x, fine);
  } else if (x.scalar_type() == at::kBFloat16) {
    xq = quantize_rows<c10::BFloat16>(x, fine);
  } else {
    TORCH_CHECK(false, "q4_mm: x must be float32 or bfloat16");
  }
  at::Tensor out = at::empty({m, lane_blocks * kLanes}, x.options());
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scale_zero.data_ptr<at::Half>());
  if (x.scalar_type() == at::kFloat)
    all_lane_blocks(p, sz, xq, m, k, group_size, fine, out.data_ptr<float>(), lane_blocks);
  else
    all_lane_blocks(p, sz, xq, m, k, group_size, fine, out.data_ptr<c10::BFloat16>(),
                    lane_blocks);
  return out;
}

}  // namespace

at::Tensor switchyard::q4_matmul(const at::Tensor& x, const at::Tensor& packed,
                                 const at::Tensor& scale_zero, int64_t group_size, bool fine) {
  return q4_mm(x, packed, scale_zero, group_size, fine);
}

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("q4_mm(Tensor x, Tensor packed, Tensor scale_zero, int group_size, bool fine) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("q4_mm", &q4_mm); }
