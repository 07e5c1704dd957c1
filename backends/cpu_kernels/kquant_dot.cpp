// GGUF's 5- and 6-bit formats (Q5_0, Q5_1, Q5_K, Q6_K, and Q4_K) multiplied two ways:
//   kquant_packed_mm on the blocks repacked once at load (kquant_pack; "The packed layout"
//     below: code planes in the lanes' order and the blocks' own scale bytes, ~the file's
//     bytes, no decoding per call; KQuantLinear's path), and
//   kquant_mm on the file's blocks as stored, each weight row decoded per call (the kernel
//     before the repacking, kept for bench/linear_kernels.py and the tests).
// Both compute the same sums described next; kquant_mm's decoding is:
//
// Every format decodes to the same form, one weight row at a time into the worker's L1:
// unsigned codes q in 0..63 per weight and, per 16 columns, w = scale * q + offset (Q6_K's
// sub-blocks are 16 wide; the others' 32-wide scales are stored twice). Input rows are
// quantized as int8_dot.cpp's fine inputs: per 32 columns, x ~ (xq + rest / 254) * dx with
// |xq|, |rest| <= 127 (one int8 pass was up to 4% of the largest logit off on the test
// models). A row's product is then  sum over 16-column groups g of
// scale_g * dx_g * (q . xq + q . rest / 254)_g  +  offset_g * sum(x)_g:
// the code dots are exact 8-bit multiply-adds (AVX-512 VNNI `vpdpbusd`, or AVX2's
// `vpmaddubsw`, whose pair sums stay within int16: 2 * 63 * 127 < 32767), converted to float
// per 4 columns and scaled per lane. The offset term takes the quantized input's sums, so the
// product is exactly that of the dequantized weights and the quantized input: the error is
// sum(w e), not sum(scale q e), whose codes all have one sign (10x larger on centred weights).
// A decoded row serves every input row of the call, so weights stream from memory once.
//
//   kquant_mm(x [M, K] float32 | bfloat16, blocks [N, row bytes] uint8, type, K) -> [M, N]
//   kquant_dequantize(blocks, type, K, dtype) -> [N, K]: the same values (w = scale q + offset)
//   kquant_pack(blocks, type, K) -> uint8 [N, packed row bytes] (this build variant's layout)
//   kquant_packed_mm(x, packed, type, K) -> [M, N];  kquant_packed_dequantize(packed, ...)
//   kquant_dense_mm(x, packed, type, K) -> [M, N]: prefill's, dequantized a slice at a time
//
// `type` is ggml's id: Q5_0 = 6, Q5_1 = 7, Q4_K = 12, Q5_K = 13, Q6_K = 14.

#include <ATen/Parallel.h>
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using switchyard_simd::load8;
using switchyard_work::parallel_shares;

constexpr int64_t kGroup = 16;  // columns per decoded scale and offset
constexpr int64_t kRowsPerItem = 8;  // weight rows per work item

struct Format {
  int64_t weights;  // per block
  int64_t bytes;    // per block
};

Format format_of(int64_t type) {
  switch (type) {
    case 6: return {32, 22};
    case 7: return {32, 24};
    case 12: return {256, 144};
    case 13: return {256, 176};
    case 14: return {256, 210};
    default: TORCH_CHECK(false, "kquant: ggml type ", type, " is not Q5_0, Q5_1, Q4_K, Q5_K or Q6_K");
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// 16 bytes -> 32 codes: low nibbles (weights 0..15), then high nibbles (16..31).
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

// Bit j of `bits` -> byte j: 0x10 where set (the fifth bit of a 5-bit code), else 0.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i set = _mm256_cmpeq_epi8(
      _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

inline void store32(uint8_t* q, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v); }

// Q5_0 (w = d (q - 16)) and Q5_1 (w = d q + m): fp16 d [, fp16 m], 4 bytes of fifth bits, 16 of
// nibbles. Each writes 32 codes and two groups' scale and offset.
inline void decode_q5_0(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  uint32_t high;
  std::memcpy(&high, b + 2, 4);
  store32(q, _mm256_or_si256(nibbles32(b + 6), fifth_bits(high)));
  const float d = half_at(b);
  scale[0] = scale[1] = d;
  offset[0] = offset[1] = -16.f * d;
}

inline void decode_q5_1(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  uint32_t high;
  std::memcpy(&high, b + 4, 4);
  store32(q, _mm256_or_si256(nibbles32(b + 8), fifth_bits(high)));
  scale[0] = scale[1] = half_at(b);
  offset[0] = offset[1] = half_at(b + 2);
}

// Q4_K / Q5_K's 6-bit scale and min of 32-weight sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K (144 bytes) and Q5_K (176): fp16 d, fp16 dmin, 12 bytes of scales and mins, [Q5_K: 32
// bytes of fifth bits], 128 of nibbles; w = d sc_j q - dmin m_j per 32 weights. Chunk c of 64
// weights: nibble byte l's low half is weight l, its high half weight l + 32; Q5_K's fifth
// bits of chunk c are bits 2c and 2c + 1 of byte l.
template <bool Five>
inline void decode_k(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* nibbles = b + (Five ? 48 : 16);
  const __m256i mask = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
  const __m256i high = Five ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16))
                            : _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + 32 * c));
    __m256i lo = _mm256_and_si256(bytes, mask);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    if constexpr (Five) {
      const __m256i bit_lo = _mm256_set1_epi8(static_cast<char>(1 << (2 * c)));
      const __m256i bit_hi = _mm256_set1_epi8(static_cast<char>(2 << (2 * c)));
      lo = _mm256_or_si256(lo, _mm256_and_si256(
          _mm256_cmpeq_epi8(_mm256_and_si256(high, bit_lo), bit_lo), fifth));
      hi = _mm256_or_si256(hi, _mm256_and_si256(
          _mm256_cmpeq_epi8(_mm256_and_si256(high, bit_hi), bit_hi), fifth));
    }
    store32(q + 64 * c, lo);
    store32(q + 64 * c + 32, hi);
  }
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(j, scales, &sc, &mn);
    scale[2 * j] = scale[2 * j + 1] = d * static_cast<float>(sc);
    offset[2 * j] = offset[2 * j + 1] = -dmin * static_cast<float>(mn);
  }
}

// Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one per
// 16 weights), fp16 d; w = d sc_g (q - 32). Half h of 128 weights: nibble bytes ql[l], ql[l +
// 32] and high byte qh[l] hold weights l, l + 32, l + 64, l + 96.
inline void decode_q6_k(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  const __m256i mask = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    uint8_t* out = q + 128 * h;
    store32(out, _mm256_or_si256(_mm256_and_si256(l0, mask),
                                 _mm256_and_si256(_mm256_slli_epi16(qh, 4), top)));
    store32(out + 32, _mm256_or_si256(_mm256_and_si256(l1, mask),
                                      _mm256_and_si256(_mm256_slli_epi16(qh, 2), top)));
    store32(out + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), mask),
                                      _mm256_and_si256(qh, top)));
    store32(out + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), mask),
                                      _mm256_and_si256(_mm256_srli_epi16(qh, 2), top)));
  }
  const float d = half_at(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int g = 0; g < 16; ++g) {
    scale[g] = d * static_cast<float>(sc[g]);
    offset[g] = -32.f * scale[g];
  }
}

// A segment is the columns whose 16-column groups fill one vector's int32 lanes: 16 groups
// (256 columns) on AVX-512, 8 (128) on AVX2. Within a segment codes and inputs are stored
// interleaved: vector t holds 4-column unit t of every group, so the 4 vectors' 8-bit dot
// products sum per lane = per group in int32, and a segment takes one conversion and one
// multiply-add per input row. Lane 4j + s holds group (lanes / 4) s + j (a 4 x 4 transpose
// of 32-bit units within each 128-bit lane); scales and input scales are stored in lane order.
#ifdef SWITCHYARD_VNNI
constexpr int64_t kSegment = 256;
#else
constexpr int64_t kSegment = 128;
#endif
constexpr int64_t kLanes = kSegment / kGroup;

inline int64_t lane_group(int64_t lane) { return (kLanes / 4) * (lane % 4) + lane / 4; }

inline int64_t padded(int64_t k) { return (k + kSegment - 1) / kSegment * kSegment; }

// The segment's 4 vectors of natural order -> interleaved, in place.
inline void interleave(void* segment) {
#ifdef SWITCHYARD_VNNI
  __m512i* v = reinterpret_cast<__m512i*>(segment);
  const __m512i a = _mm512_loadu_si512(v), b = _mm512_loadu_si512(v + 1);
  const __m512i c = _mm512_loadu_si512(v + 2), d = _mm512_loadu_si512(v + 3);
  const __m512i ab0 = _mm512_unpacklo_epi32(a, b), ab1 = _mm512_unpackhi_epi32(a, b);
  const __m512i cd0 = _mm512_unpacklo_epi32(c, d), cd1 = _mm512_unpackhi_epi32(c, d);
  _mm512_storeu_si512(v, _mm512_unpacklo_epi64(ab0, cd0));
  _mm512_storeu_si512(v + 1, _mm512_unpackhi_epi64(ab0, cd0));
  _mm512_storeu_si512(v + 2, _mm512_unpacklo_epi64(ab1, cd1));
  _mm512_storeu_si512(v + 3, _mm512_unpackhi_epi64(ab1, cd1));
#else
  __m256i* v = reinterpret_cast<__m256i*>(segment);
  const __m256i a = _mm256_loadu_si256(v), b = _mm256_loadu_si256(v + 1);
  const __m256i c = _mm256_loadu_si256(v + 2), d = _mm256_loadu_si256(v + 3);
  const __m256i ab0 = _mm256_unpacklo_epi32(a, b), ab1 = _mm256_unpackhi_epi32(a, b);
  const __m256i cd0 = _mm256_unpacklo_epi32(c, d), cd1 = _mm256_unpackhi_epi32(c, d);
  _mm256_storeu_si256(v, _mm256_unpacklo_epi64(ab0, cd0));
  _mm256_storeu_si256(v + 1, _mm256_unpackhi_epi64(ab0, cd0));
  _mm256_storeu_si256(v + 2, _mm256_unpacklo_epi64(ab1, cd1));
  _mm256_storeu_si256(v + 3, _mm256_unpackhi_epi64(ab1, cd1));
#endif
}

// A segment's per-group values (natural order) -> lane order, in place.
inline void to_lane_order(float* groups) {
  float natural[kLanes];
  std::copy(groups, groups + kLanes, natural);
  for (int64_t lane = 0; lane < kLanes; ++lane) groups[lane] = natural[lane_group(lane)];
}

// One weight row in its decoded form, in the worker's buffers; columns past K are zero codes.
struct DecodedRow {
  uint8_t* q;      // [Kp]
  float* scale;    // [Kp / 16]
  float* offset;   // [Kp / 16], natural order
};

// Interleaved for the products, or in natural order (dequantize).
DecodedRow decode_row(const uint8_t* row, int64_t type, int64_t k, bool interleaved) {
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<float> factors;
  const int64_t kp = padded(k), groups = kp / kGroup;
  if (static_cast<int64_t>(codes.size()) < kp) codes.resize(kp);
  if (static_cast<int64_t>(factors.size()) < 2 * groups) factors.resize(2 * groups);
  DecodedRow out{codes.data(), factors.data(), factors.data() + groups};
  const Format f = format_of(type);
  for (int64_t b = 0; b < k / f.weights; ++b) {
    const uint8_t* block = row + b * f.bytes;
    uint8_t* q = out.q + b * f.weights;
    float* s = out.scale + b * f.weights / kGroup;
    float* o = out.offset + b * f.weights / kGroup;
    switch (type) {
      case 6: decode_q5_0(block, q, s, o); break;
      case 7: decode_q5_1(block, q, s, o); break;
      case 12: decode_k<false>(block, q, s, o); break;
      case 13: decode_k<true>(block, q, s, o); break;
      default: decode_q6_k(block, q, s, o); break;
    }
  }
  std::memset(out.q + k, 0, kp - k);
  std::fill(out.scale + k / kGroup, out.scale + groups, 0.f);
  std::fill(out.offset + k / kGroup, out.offset + groups, 0.f);
  if (interleaved) {
    for (int64_t seg = 0; seg < kp; seg += kSegment) {
      interleave(out.q + seg);
      to_lane_order(out.scale + seg / kGroup);
    }
  }
  return out;
}

// Input rows quantized per 32 columns, padded to Kp with zeros, interleaved as the codes; in
// the calling thread's buffer.
struct QuantizedRows {
  const int8_t* q;       // [M, Kp]
  const int8_t* rest;    // [M, Kp]
  const float* dx;       // [M, Kp / 16]: the 32-column block's scale per group, lane order
  const float* sum;      // [M, Kp / 16]: sum of xq * dx over the group, natural order (the
                         // packed kernel's: lane order)
  int64_t kp, groups;    // row strides of q and of dx / sum
};

template <typename T>
void quantize_row(const T* src, int64_t k, int64_t kp, int8_t* q, int8_t* rest, float* dx,
                  float* sum, bool lane_sums) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  std::memset(q + k, 0, kp - k);
  std::memset(rest + k, 0, kp - k);
  std::fill(dx, dx + kp / kGroup, 0.f);
  std::fill(sum, sum + kp / kGroup, 0.f);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < k / 32; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = load8(src + 32 * b + 8 * c);
      amax = _mm256_max_ps(_mm256_and_ps(v[c], magnitude), amax);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    const float d = *std::max_element(lanes, lanes + 8) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    for (int c = 0; c < 4; ++c) {
      const __m256 scaled = _mm256_mul_ps(v[c], _mm256_set1_ps(inv));
      const __m256 rounded = _mm256_round_ps(scaled, kRound);
      const __m256 residue = _mm256_round_ps(
          _mm256_mul_ps(_mm256_sub_ps(scaled, rounded), _mm256_set1_ps(254.f)), kRound);
      alignas(32) int32_t ints[8], rests[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(ints), _mm256_cvtps_epi32(rounded));
      _mm256_store_si256(reinterpret_cast<__m256i*>(rests), _mm256_cvtps_epi32(residue));
      int32_t codes_sum = 0, rest_sum = 0;
      for (int i = 0; i < 8; ++i) {
        q[32 * b + 8 * c + i] = static_cast<int8_t>(ints[i]);
        rest[32 * b + 8 * c + i] = static_cast<int8_t>(rests[i]);
        codes_sum += ints[i];
        rest_sum += rests[i];
      }
      sum[2 * b + c / 2] += d * (static_cast<float>(codes_sum) +
                                 static_cast<float>(rest_sum) * (1.f / 254.f));
    }
    dx[2 * b] = dx[2 * b + 1] = d;
  }
  for (int64_t seg = 0; seg < kp; seg += kSegment) {
    interleave(q + seg);
    interleave(rest + seg);
    to_lane_order(dx + seg / kGroup);
    if (lane_sums) to_lane_order(sum + seg / kGroup);
  }
}

template <typename T>
QuantizedRows quantize_rows(const at::Tensor& x, bool lane_sums = false) {
  const int64_t m = x.size(0), k = x.size(1), kp = padded(k), groups = kp / kGroup;
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> factors;
  if (static_cast<int64_t>(codes.size()) < 2 * m * kp) codes.resize(2 * m * kp);
  if (static_cast<int64_t>(factors.size()) < 2 * m * groups) factors.resize(2 * m * groups);
  int8_t* q = codes.data();
  int8_t* rest = q + m * kp;
  float* dx = factors.data();
  float* sum = dx + m * groups;
  const T* src = x.const_data_ptr<T>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(src + r * k, k, kp, q + r * kp, rest + r * kp, dx + r * groups,
                   sum + r * groups, lane_sums);
  });
  return QuantizedRows{q, rest, dx, sum, kp, groups};
}

inline float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// The offsets' term: sum over groups of offset * sum(xq dx) (Kp / 16 is a multiple of 8).
inline float offset_term(const DecodedRow& w, const float* sum, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(w.offset + g), _mm256_loadu_ps(sum + g), acc);
  return sum8(acc);
}

constexpr int kRowTile = 4;  // input rows sharing a segment's loaded codes

#ifdef SWITCHYARD_VNNI

// A segment's codes against one row of int8 inputs: per group (lane), as float.
inline __m512 segment_dot(const __m512i codes[4], const int8_t* x) {
  __m512i dot0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[0], _mm512_loadu_si512(x));
  __m512i dot1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[1], _mm512_loadu_si512(x + 64));
  dot0 = _mm512_dpbusd_epi32(dot0, codes[2], _mm512_loadu_si512(x + 128));
  dot1 = _mm512_dpbusd_epi32(dot1, codes[3], _mm512_loadu_si512(x + 192));
  return _mm512_cvtepi32_ps(_mm512_add_epi32(dot0, dot1));
}

// A decoded weight row against input rows r0..r0 + Rows - 1: their products without offsets.
template <int Rows>
inline void rows_dot(const DecodedRow& w, const QuantizedRows& xq, int64_t r0, float* result) {
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t seg = 0; seg < xq.kp; seg += kSegment) {
    __m512i codes[4];
    for (int t = 0; t < 4; ++t) codes[t] = _mm512_loadu_si512(w.q + seg + 64 * t);
    const __m512 scale = _mm512_loadu_ps(w.scale + seg / kGroup);
    for (int r = 0; r < Rows; ++r) {
      const int64_t at = (r0 + r) * xq.kp + seg;
      const __m512 dot = _mm512_fmadd_ps(segment_dot(codes, xq.rest + at),
                                         _mm512_set1_ps(1.f / 254.f), segment_dot(codes, xq.q + at));
      const __m512 dx = _mm512_loadu_ps(xq.dx + (r0 + r) * xq.groups + seg / kGroup);
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, dx), acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) result[r] = _mm512_reduce_add_ps(acc[r]);
}

#else  // AVX2: `vpmaddubsw` pairs summed over two units still fit int16 (2 * 16002)

inline __m256 segment_dot(const __m256i codes[4], const int8_t* x8) {
  const __m256i* x = reinterpret_cast<const __m256i*>(x8);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i pairs01 = _mm256_add_epi16(_mm256_maddubs_epi16(codes[0], _mm256_loadu_si256(x)),
                                           _mm256_maddubs_epi16(codes[1], _mm256_loadu_si256(x + 1)));
  const __m256i pairs23 = _mm256_add_epi16(_mm256_maddubs_epi16(codes[2], _mm256_loadu_si256(x + 2)),
                                           _mm256_maddubs_epi16(codes[3], _mm256_loadu_si256(x + 3)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(pairs01, ones),
                                             _mm256_madd_epi16(pairs23, ones)));
}

template <int Rows>
inline void rows_dot(const DecodedRow& w, const QuantizedRows& xq, int64_t r0, float* result) {
  __m256 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t seg = 0; seg < xq.kp; seg += kSegment) {
    __m256i codes[4];
    for (int t = 0; t < 4; ++t)
      codes[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + seg + 32 * t));
    const __m256 scale = _mm256_loadu_ps(w.scale + seg / kGroup);
    for (int r = 0; r < Rows; ++r) {
      const int64_t at = (r0 + r) * xq.kp + seg;
      const __m256 dot = _mm256_fmadd_ps(segment_dot(codes, xq.rest + at),
                                         _mm256_set1_ps(1.f / 254.f), segment_dot(codes, xq.q + at));
      const __m256 dx = _mm256_loadu_ps(xq.dx + (r0 + r) * xq.groups + seg / kGroup);
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, dx), acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) result[r] = sum8(acc[r]);
}

#endif

int64_t check_blocks(const char* op, const at::Tensor& blocks, int64_t type, int64_t k) {
  const Format f = format_of(type);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              op, ": blocks must be contiguous uint8 [N, row bytes]");
  TORCH_CHECK(k > 0 && k % f.weights == 0 && blocks.size(1) == k / f.weights * f.bytes, op,
              ": ", k, " columns need rows of ", k / f.weights * f.bytes, " bytes (a multiple of ",
              f.weights, " columns), the blocks have ", blocks.size(1));
  return blocks.size(1);
}

template <typename T>
void all_rows(const uint8_t* blocks, int64_t row_bytes, int64_t type, int64_t k, int64_t n,
              const QuantizedRows& xq, int64_t m, T* out) {
  parallel_shares((n + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item) {
    const int64_t end = std::min(n, (item + 1) * kRowsPerItem);
    for (int64_t row = item * kRowsPerItem; row < end; ++row) {
      const DecodedRow w = decode_row(blocks + row * row_bytes, type, k, true);
      float dots[kRowTile];
      int64_t r0 = 0;
      for (; r0 + kRowTile <= m; r0 += kRowTile) {
        rows_dot<kRowTile>(w, xq, r0, dots);
        for (int r = 0; r < kRowTile; ++r)
          out[(r0 + r) * n + row] = static_cast<T>(
              dots[r] + offset_term(w, xq.sum + (r0 + r) * xq.groups, xq.groups));
      }
      for (; r0 < m; ++r0) {  // a row alone sums in the order it does in a tile
        rows_dot<1>(w, xq, r0, dots);
        out[r0 * n + row] = static_cast<T>(dots[0] + offset_term(w, xq.sum + r0 * xq.groups, xq.groups));
      }
    }
  });
}

at::Tensor kquant_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "kquant_mm: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.size(1) == k, "kquant_mm: x has ", x.size(1), " columns, the weight ", k);
  const int64_t row_bytes = check_blocks("kquant_mm", blocks, type, k);
  const int64_t m = x.size(0), n = blocks.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  const uint8_t* b = blocks.const_data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    all_rows(b, row_bytes, type, k, n, quantize_rows<float>(x), m, out.mutable_data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "kquant_mm: x must be float32 or bfloat16");
    all_rows(b, row_bytes, type, k, n, quantize_rows<c10::BFloat16>(x), m,
             out.mutable_data_ptr<c10::BFloat16>());
  }
  return out;
}

template <typename T>
void dequantize_rows(const uint8_t* blocks, int64_t row_bytes, int64_t type, int64_t k, int64_t n,
                     T* out) {
  parallel_shares(n, [&](int64_t row) {
    const DecodedRow w = decode_row(blocks + row * row_bytes, type, k, false);
    for (int64_t c = 0; c < k; ++c)
      out[row * k + c] = static_cast<T>(w.scale[c / kGroup] * w.q[c] + w.offset[c / kGroup]);
  });
}

at::Tensor kquant_dequantize(const at::Tensor& blocks, int64_t type, int64_t k,
                             at::ScalarType dtype) {
  const int64_t row_bytes = check_blocks("kquant_dequantize", blocks, type, k);
  const int64_t n = blocks.size(0);
  at::Tensor out = at::empty({n, k}, blocks.options().dtype(dtype));
  const uint8_t* b = blocks.const_data_ptr<uint8_t>();
  if (dtype == at::kFloat) {
    dequantize_rows(b, row_bytes, type, k, n, out.mutable_data_ptr<float>());
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "kquant_dequantize: dtype must be float32 or bfloat16");
    dequantize_rows(b, row_bytes, type, k, n, out.mutable_data_ptr<c10::BFloat16>());
  }
  return out;
}


// ---- The packed layout: repacked once at load, ~the file's bytes, no decoding per call ----
//
// A row is its full segments (kSegment columns each), then the columns past the last full
// segment as the file's own blocks (Q5_0 / Q5_1 only: the K-quants' rows are whole 256-column
// blocks). A segment holds the 4 interleaved code vectors (kVec bytes each, as `interleave`
// orders them) as planes the SIMD lanes take with shifts and masks, then the segment's factors:
//   low   [2 kVec]: byte j of the first half: codes[0][j] | codes[1][j] << 4; second half:
//                   codes[2][j] | codes[3][j] << 4 (each code's low 4 bits)
//   high  Q6_K [kVec]: byte j: bits 4..5 of codes[t][j] at bits 2t..2t+1
//         Q5_* [kVec / 2]: byte j: bit 4 of codes[t][j] at bit t, of codes[t][j + kVec / 2]
//                   at bit t + 4;  Q4_K: none
//   factors Q5_0: fp16 d per 32 columns; Q5_1: fp16 d per 32, then fp16 m per 32;
//         Q4_K / Q5_K: fp16 d, fp16 dmin, uint8 sc per 32, uint8 m per 32 (the 6-bit values);
//         Q6_K: fp16 d, int8 sc per 16.
// The kernel turns the factors into per-lane scale and offset with the exact float products
// the decoding gives (d * sc, -dmin * m, -16 d, -32 d sc), so products and dequantization are
// those of the file's blocks. The layout depends on the build variant (kSegment): the weight
// cache's entries are per variant.
constexpr int64_t kVec = kSegment / 4;  // bytes of one code vector

constexpr int64_t high_bytes(int64_t type) {
  return type == 14 ? kVec : type == 12 ? 0 : kVec / 2;
}

constexpr int64_t factor_bytes(int64_t type) {
  return type == 6 ? kLanes : type == 7 ? 2 * kLanes : type == 14 ? 2 + kLanes : 4 + kLanes;
}

constexpr int64_t segment_bytes(int64_t type) {
  return 2 * kVec + high_bytes(type) + factor_bytes(type);
}

int64_t packed_row_bytes(int64_t type, int64_t k) {
  const Format f = format_of(type);
  return k / kSegment * segment_bytes(type) + (k % kSegment) / f.weights * f.bytes;
}

void pack_row(const uint8_t* src, int64_t type, int64_t k, uint8_t* dst) {
  const Format f = format_of(type);
  const DecodedRow w = decode_row(src, type, k, true);
  const int64_t full = k / kSegment, bytes = segment_bytes(type);
  for (int64_t s = 0; s < full; ++s) {
    const uint8_t* c = w.q + s * kSegment;
    uint8_t* p = dst + s * bytes;
    for (int64_t j = 0; j < kVec; ++j) {
      const int c0 = c[j], c1 = c[kVec + j], c2 = c[2 * kVec + j], c3 = c[3 * kVec + j];
      p[j] = static_cast<uint8_t>((c0 & 15) | (c1 & 15) << 4);
      p[kVec + j] = static_cast<uint8_t>((c2 & 15) | (c3 & 15) << 4);
      if (type == 14)
        p[2 * kVec + j] = static_cast<uint8_t>((c0 >> 4) | (c1 >> 4) << 2 | (c2 >> 4) << 4 |
                                               (c3 >> 4) << 6);
    }
    if (high_bytes(type) == kVec / 2) {
      for (int64_t j = 0; j < kVec / 2; ++j) {
        int bits = 0;
        for (int t = 0; t < 4; ++t)
          bits |= ((c[t * kVec + j] >> 4) & 1) << t | ((c[t * kVec + j + kVec / 2] >> 4) & 1) << (t + 4);
        p[2 * kVec + j] = static_cast<uint8_t>(bits);
      }
    }
    uint8_t* fac = p + 2 * kVec + high_bytes(type);
    const int64_t col = s * kSegment;
    if (type == 6 || type == 7) {
      for (int64_t i = 0; i < kLanes / 2; ++i) {
        const uint8_t* block = src + (col / 32 + i) * f.bytes;
        std::memcpy(fac + 2 * i, block, 2);
        if (type == 7) std::memcpy(fac + kLanes + 2 * i, block + 2, 2);
      }
    } else if (type == 14) {
      const uint8_t* block = src + col / 256 * f.bytes;
      std::memcpy(fac, block + 208, 2);
      std::memcpy(fac + 2, block + 192 + col % 256 / 16, kLanes);
    } else {
      const uint8_t* block = src + col / 256 * f.bytes;
      std::memcpy(fac, block, 4);
      for (int64_t i = 0; i < kLanes / 2; ++i) {
        int sc, mn;
        scale_min_k4(static_cast<int>(col % 256 / 32 + i), block + 4, &sc, &mn);
        fac[4 + i] = static_cast<uint8_t>(sc);
        fac[4 + kLanes / 2 + i] = static_cast<uint8_t>(mn);
      }
    }
  }
  std::memcpy(dst + full * bytes, src + full * kSegment / f.weights * f.bytes,
              (k % kSegment) / f.weights * f.bytes);
}

at::Tensor kquant_pack(const at::Tensor& blocks, int64_t type, int64_t k) {
  const int64_t row_bytes = check_blocks("kquant_pack", blocks, type, k);
  const int64_t n = blocks.size(0), packed_bytes = packed_row_bytes(type, k);
  at::Tensor out = at::empty({n, packed_bytes}, blocks.options());
  const uint8_t* src = blocks.const_data_ptr<uint8_t>();
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  parallel_shares(n, [&](int64_t row) {
    pack_row(src + row * row_bytes, type, k, dst + row * packed_bytes);
  });
  return out;
}

// Lane -> index of its group's factor, per 16 columns (`group`) and per 32 (`pair`).
#ifdef SWITCHYARD_VNNI
using VecI = __m512i;
using VecF = __m512;
inline VecI load_i(const void* p) { return _mm512_loadu_si512(p); }
inline void store_i(void* p, VecI v) { _mm512_storeu_si512(p, v); }
inline VecF load_f(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline VecF zero_f() { return _mm512_setzero_ps(); }
inline VecF set_f(float v) { return _mm512_set1_ps(v); }
inline VecF mul_f(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF fmadd_f(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_f(VecF v) { return _mm512_reduce_add_ps(v); }
inline VecI and_i(VecI a, VecI b) { return _mm512_and_si512(a, b); }
inline VecI or_i(VecI a, VecI b) { return _mm512_or_si512(a, b); }
inline VecI set8_i(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
#define KQ_SLLI16 _mm512_slli_epi16
#define KQ_SRLI16 _mm512_srli_epi16
#else
using VecI = __m256i;
using VecF = __m256;
inline VecI load_i(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store_i(void* p, VecI v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline VecF load_f(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline VecF zero_f() { return _mm256_setzero_ps(); }
inline VecF set_f(float v) { return _mm256_set1_ps(v); }
inline VecF mul_f(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF fmadd_f(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce_f(VecF v) { return sum8(v); }
inline VecI and_i(VecI a, VecI b) { return _mm256_and_si256(a, b); }
inline VecI or_i(VecI a, VecI b) { return _mm256_or_si256(a, b); }
inline VecI set8_i(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
#define KQ_SLLI16 _mm256_slli_epi16
#define KQ_SRLI16 _mm256_srli_epi16
#endif

struct LaneIndex {
  VecI group, pair;
};

inline LaneIndex lane_index() {
  alignas(64) int32_t group[kLanes], pair[kLanes];
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    group[lane] = static_cast<int32_t>(lane_group(lane));
    pair[lane] = static_cast<int32_t>(lane_group(lane) / 2);
  }
  return LaneIndex{load_i(group), load_i(pair)};
}

// A segment's 4 code vectors from its planes.
template <int Type>
inline void segment_codes(const uint8_t* p, VecI c[4]) {
  const VecI mask = set8_i(0x0F);
  const VecI l0 = load_i(p), l1 = load_i(p + kVec);
  c[0] = and_i(l0, mask);
  c[1] = and_i(KQ_SRLI16(l0, 4), mask);
  c[2] = and_i(l1, mask);
  c[3] = and_i(KQ_SRLI16(l1, 4), mask);
  if constexpr (Type == 14) {
    const VecI h = load_i(p + 2 * kVec), top = set8_i(0x30);
    c[0] = or_i(c[0], and_i(KQ_SLLI16(h, 4), top));
    c[1] = or_i(c[1], and_i(KQ_SLLI16(h, 2), top));
    c[2] = or_i(c[2], and_i(h, top));
    c[3] = or_i(c[3], and_i(KQ_SRLI16(h, 2), top));
  } else if constexpr (Type != 12) {
    // Byte j's bit t (first half) and bit t + 4 (second half) -> bit t of byte j of the vector.
#ifdef SWITCHYARD_VNNI
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * kVec));
    const VecI bits = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 4), 1);
#else
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * kVec));
    const VecI bits = _mm256_set_m128i(_mm_srli_epi16(h, 4), h);
#endif
    const VecI fifth = set8_i(0x10);
    c[0] = or_i(c[0], and_i(KQ_SLLI16(bits, 4), fifth));
    c[1] = or_i(c[1], and_i(KQ_SLLI16(bits, 3), fifth));
    c[2] = or_i(c[2], and_i(KQ_SLLI16(bits, 2), fifth));
    c[3] = or_i(c[3], and_i(KQ_SLLI16(bits, 1), fifth));
  }
}

// A segment's per-lane scale and offset from its factors (lane order).
template <int Type>
inline void segment_factors(const uint8_t* f, const LaneIndex& idx, VecF& scale, VecF& offset) {
#ifdef SWITCHYARD_VNNI
  if constexpr (Type == 6 || Type == 7) {
    const __m512 d = _mm512_castps256_ps512(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f))));
    scale = _mm512_permutexvar_ps(idx.pair, d);
    if constexpr (Type == 6) {
      offset = _mm512_mul_ps(scale, _mm512_set1_ps(-16.f));
    } else {
      offset = _mm512_permutexvar_ps(idx.pair, _mm512_castps256_ps512(_mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(f + kLanes)))));
    }
  } else if constexpr (Type == 14) {
    const __m512 sc = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f + 2))));
    scale = _mm512_permutexvar_ps(idx.group, _mm512_mul_ps(sc, _mm512_set1_ps(half_at(f))));
    offset = _mm512_mul_ps(scale, _mm512_set1_ps(-32.f));
  } else {
    const __m256 sc = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f + 4))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(f + 4 + kLanes / 2))));
    scale = _mm512_permutexvar_ps(
        idx.pair, _mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_set1_ps(half_at(f)))));
    offset = _mm512_permutexvar_ps(
        idx.pair, _mm512_castps256_ps512(_mm256_mul_ps(mn, _mm256_set1_ps(-half_at(f + 2)))));
  }
#else
  if constexpr (Type == 6 || Type == 7) {
    const __m256 d = _mm256_castps128_ps256(
        _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f))));
    scale = _mm256_permutevar8x32_ps(d, idx.pair);
    if constexpr (Type == 6) {
      offset = _mm256_mul_ps(scale, _mm256_set1_ps(-16.f));
    } else {
      offset = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(f + kLanes)))), idx.pair);
    }
  } else if constexpr (Type == 14) {
    const __m256 sc = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f + 2))));
    scale = _mm256_permutevar8x32_ps(_mm256_mul_ps(sc, _mm256_set1_ps(half_at(f))), idx.group);
    offset = _mm256_mul_ps(scale, _mm256_set1_ps(-32.f));
  } else {
    int32_t sc4, mn4;
    std::memcpy(&sc4, f + 4, 4);
    std::memcpy(&mn4, f + 4 + kLanes / 2, 4);
    const __m128 sc = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(sc4)));
    const __m128 mn = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(mn4)));
    scale = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_mul_ps(sc, _mm_set1_ps(half_at(f)))), idx.pair);
    offset = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_mul_ps(mn, _mm_set1_ps(-half_at(f + 2)))), idx.pair);
  }
#endif
}

// The columns past the last full segment (Q5_0 / Q5_1), decoded per weight row: interleaved
// codes, zero past K, and lane-order scale and offset.
struct Tail {
  alignas(64) uint8_t q[kSegment];
  float scale[kLanes], offset[kLanes];
};

void decode_tail(const uint8_t* blocks, int64_t type, int64_t cols, Tail* tail, bool interleaved) {
  std::memset(tail->q, 0, kSegment);
  std::fill(tail->scale, tail->scale + kLanes, 0.f);
  std::fill(tail->offset, tail->offset + kLanes, 0.f);
  const Format f = format_of(type);
  for (int64_t b = 0; b < cols / f.weights; ++b) {
    if (type == 6)
      decode_q5_0(blocks + b * f.bytes, tail->q + 32 * b, tail->scale + 2 * b, tail->offset + 2 * b);
    else
      decode_q5_1(blocks + b * f.bytes, tail->q + 32 * b, tail->scale + 2 * b, tail->offset + 2 * b);
  }
  if (interleaved) {
    interleave(tail->q);
    to_lane_order(tail->scale);
    to_lane_order(tail->offset);
  }
}

#ifndef KQ_TILE
#define KQ_TILE 8
#endif
#ifndef KQ_WTILE
#define KQ_WTILE 1
#endif
constexpr int64_t kPrefetchAhead = 4096;  // bytes (as int8_dot.cpp's one-row paths)
constexpr int kPackedTile = KQ_TILE;   // input rows per pass over a weight row
constexpr int kWeightTile = KQ_WTILE;  // weight rows per pass, sharing each input vector loaded

// One chain of multiply-adds per lane (the tile's many products keep the core busy): a
// segment's codes against one row of int8 inputs, per group (lane), as float.
#ifdef SWITCHYARD_VNNI
inline __m512 chain_dot(const __m512i codes[4], const int8_t* x) {
  __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[0], _mm512_loadu_si512(x));
  dot = _mm512_dpbusd_epi32(dot, codes[1], _mm512_loadu_si512(x + 64));
  dot = _mm512_dpbusd_epi32(dot, codes[2], _mm512_loadu_si512(x + 128));
  dot = _mm512_dpbusd_epi32(dot, codes[3], _mm512_loadu_si512(x + 192));
  return _mm512_cvtepi32_ps(dot);
}
#else
inline __m256 chain_dot(const __m256i codes[4], const int8_t* x) { return segment_dot(codes, x); }
#endif

// Weight rows w[0..W) against input rows r0..r0 + Rows - 1: result[i * Rows + r]. Every
// (weight row, input row) product sums in one order, whatever the tile it is in.
template <int Type, int W, int Rows>
inline void packed_rows_dot(const uint8_t* const w[W], int64_t full, const Tail* const tail[W],
                            const QuantizedRows& xq, int64_t r0, const LaneIndex& idx,
                            float* result) {
  VecF acc[W][Rows];
  for (int i = 0; i < W; ++i)
    for (int r = 0; r < Rows; ++r) acc[i][r] = zero_f();
  const auto rows = [&](const VecI (&c)[W][4], const VecF (&scale)[W], const VecF (&offset)[W],
                        int64_t seg) {
    for (int r = 0; r < Rows; ++r) {
      const int64_t at = (r0 + r) * xq.kp + seg, g = (r0 + r) * xq.groups + seg / kGroup;
      const VecF dx = load_f(xq.dx + g), sum = load_f(xq.sum + g);
      for (int i = 0; i < W; ++i) {
        const VecF dot = fmadd_f(chain_dot(c[i], xq.rest + at), set_f(1.f / 254.f),
                                 chain_dot(c[i], xq.q + at));
        acc[i][r] = fmadd_f(dot, mul_f(scale[i], dx), acc[i][r]);
        acc[i][r] = fmadd_f(offset[i], sum, acc[i][r]);
      }
    }
  };
  for (int64_t s = 0; s < full; ++s) {
    VecI c[W][4];
    VecF scale[W], offset[W];
    if constexpr (Rows == 1) {  // a row alone streams the weights: ask for them ahead, into L2
      for (int i = 0; i < W; ++i)
        for (int64_t line = 0; line < segment_bytes(Type); line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w[i] + s * segment_bytes(Type) +
                                                     kPrefetchAhead + line), _MM_HINT_T1);
    }
    for (int i = 0; i < W; ++i) {
      const uint8_t* p = w[i] + s * segment_bytes(Type);
      segment_codes<Type>(p, c[i]);
      segment_factors<Type>(p + 2 * kVec + high_bytes(Type), idx, scale[i], offset[i]);
    }
    rows(c, scale, offset, s * kSegment);
  }
  if (tail[0] != nullptr) {
    VecI c[W][4];
    VecF scale[W], offset[W];
    for (int i = 0; i < W; ++i) {
      for (int t = 0; t < 4; ++t) c[i][t] = load_i(tail[i]->q + t * kVec);
      scale[i] = load_f(tail[i]->scale);
      offset[i] = load_f(tail[i]->offset);
    }
    rows(c, scale, offset, full * kSegment);
  }
  for (int i = 0; i < W; ++i)
    for (int r = 0; r < Rows; ++r) result[i * Rows + r] = reduce_f(acc[i][r]);
}

template <int Type, int W, int Rows, typename T>
inline void weight_tile(const uint8_t* packed, int64_t row_bytes, int64_t row, int64_t full,
                        const Tail* tails, const QuantizedRows& xq, int64_t r0, int64_t n,
                        const LaneIndex& idx, T* out) {
  const uint8_t* w[W];
  const Tail* tp[W];
  for (int i = 0; i < W; ++i) {
    w[i] = packed + (row + i) * row_bytes;
    tp[i] = tails == nullptr ? nullptr : tails + i;
  }
  float dots[W * Rows];
  packed_rows_dot<Type, W, Rows>(w, full, tp, xq, r0, idx, dots);
  for (int i = 0; i < W; ++i)
    for (int r = 0; r < Rows; ++r) out[(r0 + r) * n + row + i] = static_cast<T>(dots[i * Rows + r]);
}

// A work item's weight rows (8: ~1.2 KB each at K = 1536) against one tile of input rows at a
// time, so that a tile's quantized inputs stay in L1 across the item's rows.
template <int Type, int Rows, typename T>
inline void item_tile(const uint8_t* packed, int64_t row_bytes, int64_t begin, int64_t end,
                      int64_t full, const Tail* tails, const QuantizedRows& xq, int64_t r0,
                      int64_t n, const LaneIndex& idx, T* out) {
  for (int64_t row = begin; row < end; row += kWeightTile) {
    const Tail* tp = tails == nullptr ? nullptr : tails + (row - begin);
    if (row + kWeightTile <= end)
      weight_tile<Type, kWeightTile, Rows>(packed, row_bytes, row, full, tp, xq, r0, n, idx, out);
    else
      weight_tile<Type, 1, Rows>(packed, row_bytes, row, full, tp, xq, r0, n, idx, out);
  }
}

template <int Type, typename T>
void packed_all_rows(const uint8_t* packed, int64_t row_bytes, int64_t k, int64_t n,
                     const QuantizedRows& xq, int64_t m, T* out) {
  const int64_t full = k / kSegment, tail_cols = k % kSegment;
  parallel_shares((n + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item) {
    const LaneIndex idx = lane_index();
    Tail tails[kRowsPerItem];
    const int64_t begin = item * kRowsPerItem, end = std::min(n, begin + kRowsPerItem);
    if (tail_cols) {
      for (int64_t row = begin; row < end; ++row)
        decode_tail(packed + row * row_bytes + full * segment_bytes(Type), Type, tail_cols,
                    &tails[row - begin], true);
    }
    const Tail* tp = tail_cols ? tails : nullptr;
    int64_t r0 = 0;
    for (; r0 + kPackedTile <= m; r0 += kPackedTile)
      item_tile<Type, kPackedTile>(packed, row_bytes, begin, end, full, tp, xq, r0, n, idx, out);
    for (; r0 < m; ++r0)
      item_tile<Type, 1>(packed, row_bytes, begin, end, full, tp, xq, r0, n, idx, out);
  });
}

int64_t check_packed(const char* op, const at::Tensor& packed, int64_t type, int64_t k) {
  const Format f = format_of(type);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              op, ": packed must be contiguous uint8 [N, packed row bytes]");
  TORCH_CHECK(k > 0 && k % f.weights == 0 && packed.size(1) == packed_row_bytes(type, k), op,
              ": ", k, " columns need packed rows of ", packed_row_bytes(type, k),
              " bytes (a multiple of ", f.weights, " columns), the rows have ", packed.size(1));
  return packed.size(1);
}

template <typename T>
void packed_dispatch(const uint8_t* p, int64_t row_bytes, int64_t type, int64_t k, int64_t n,
                     const QuantizedRows& xq, int64_t m, T* out) {
  switch (type) {
    case 6: packed_all_rows<6>(p, row_bytes, k, n, xq, m, out); break;
    case 7: packed_all_rows<7>(p, row_bytes, k, n, xq, m, out); break;
    case 12: packed_all_rows<12>(p, row_bytes, k, n, xq, m, out); break;
    case 13: packed_all_rows<13>(p, row_bytes, k, n, xq, m, out); break;
    default: packed_all_rows<14>(p, row_bytes, k, n, xq, m, out); break;
  }
}

at::Tensor kquant_packed_mm(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                            int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(),
              "kquant_packed_mm: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.size(1) == k, "kquant_packed_mm: x has ", x.size(1), " columns, the weight ", k);
  const int64_t row_bytes = check_packed("kquant_packed_mm", packed, type, k);
  const int64_t m = x.size(0), n = packed.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  const uint8_t* p = packed.const_data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    packed_dispatch(p, row_bytes, type, k, n, quantize_rows<float>(x, true), m,
                    out.mutable_data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "kquant_packed_mm: x must be float32 or bfloat16");
    packed_dispatch(p, row_bytes, type, k, n, quantize_rows<c10::BFloat16>(x, true), m,
                    out.mutable_data_ptr<c10::BFloat16>());
  }
  return out;
}

// A packed row back to w = scale q + offset, in natural column order.
template <int Type, typename T>
void packed_dequantize_row(const uint8_t* w, int64_t k, T* out) {
  const LaneIndex idx = lane_index();
  const int64_t full = k / kSegment;
  alignas(64) uint8_t q[kSegment];
  alignas(64) float lane_scale[kLanes], lane_offset[kLanes];
  float scale[kLanes], offset[kLanes];
  for (int64_t s = 0; s < full; ++s) {
    const uint8_t* p = w + s * segment_bytes(Type);
    VecI c[4];
    segment_codes<Type>(p, c);
    for (int t = 0; t < 4; ++t) store_i(q + t * kVec, c[t]);
    interleave(q);  // a 4 x 4 transpose: its own inverse
    VecF sv, ov;
    segment_factors<Type>(p + 2 * kVec + high_bytes(Type), idx, sv, ov);
    store_f(lane_scale, sv);
    store_f(lane_offset, ov);
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      scale[lane_group(lane)] = lane_scale[lane];
      offset[lane_group(lane)] = lane_offset[lane];
    }
    T* o = out + s * kSegment;
    for (int64_t c2 = 0; c2 < kSegment; ++c2)
      o[c2] = static_cast<T>(scale[c2 / kGroup] * q[c2] + offset[c2 / kGroup]);
  }
  if (k % kSegment) {
    Tail tail;
    decode_tail(w + full * segment_bytes(Type), Type, k % kSegment, &tail, false);
    T* o = out + full * kSegment;
    for (int64_t c2 = 0; c2 < k % kSegment; ++c2)
      o[c2] = static_cast<T>(tail.scale[c2 / kGroup] * tail.q[c2] + tail.offset[c2 / kGroup]);
  }
}

template <typename T>
void packed_dequantize_rows(const uint8_t* p, int64_t row_bytes, int64_t type, int64_t k,
                            int64_t n, T* out) {
  parallel_shares(n, [&](int64_t row) {
    const uint8_t* w = p + row * row_bytes;
    T* o = out + row * k;
    switch (type) {
      case 6: packed_dequantize_row<6>(w, k, o); break;
      case 7: packed_dequantize_row<7>(w, k, o); break;
      case 12: packed_dequantize_row<12>(w, k, o); break;
      case 13: packed_dequantize_row<13>(w, k, o); break;
      default: packed_dequantize_row<14>(w, k, o); break;
    }
  });
}

at::Tensor kquant_packed_dequantize(const at::Tensor& packed, int64_t type, int64_t k,
                                    at::ScalarType dtype) {
  const int64_t row_bytes = check_packed("kquant_packed_dequantize", packed, type, k);
  const int64_t n = packed.size(0);
  at::Tensor out = at::empty({n, k}, packed.options().dtype(dtype));
  const uint8_t* p = packed.const_data_ptr<uint8_t>();
  if (dtype == at::kFloat) {
    packed_dequantize_rows(p, row_bytes, type, k, n, out.mutable_data_ptr<float>());
  } else {
    TORCH_CHECK(dtype == at::kBFloat16,
                "kquant_packed_dequantize: dtype must be float32 or bfloat16");
    packed_dequantize_rows(p, row_bytes, type, k, n, out.mutable_data_ptr<c10::BFloat16>());
  }
  return out;
}

// Prefill's product (dense_slices.h): x [M, K] times the packed weight, [M, N] in x's dtype.
at::Tensor kquant_dense_mm(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "kquant_dense_mm: x must be a contiguous float32 or bfloat16 [M, ", k, "] matrix");
  const int64_t row_bytes = check_packed("kquant_dense_mm", packed, type, k);
  const uint8_t* p = packed.const_data_ptr<uint8_t>();
  return switchyard_slices::dense_mm<switchyard_slices::Layout::kNK>(
      x, packed.size(0), 1, [&](int64_t first, int64_t count, auto* w) {
        packed_dequantize_rows(p + first * row_bytes, row_bytes, type, k, count, w);
      });
}

}  // namespace

at::Tensor switchyard::kquant_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                                     int64_t in_features) {
  return kquant_mm(x, blocks, type, in_features);
}

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("kquant_mm(Tensor x, Tensor blocks, int type, int in_features) -> Tensor");
  m.def("kquant_dequantize(Tensor blocks, int type, int in_features, ScalarType dtype) -> Tensor");
  m.def("kquant_pack(Tensor blocks, int type, int in_features) -> Tensor");
  m.def("kquant_packed_mm(Tensor x, Tensor packed, int type, int in_features) -> Tensor");
  m.def("kquant_packed_dequantize(Tensor packed, int type, int in_features, ScalarType dtype) -> Tensor");
  m.def("kquant_dense_mm(Tensor x, Tensor packed, int type, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("kquant_mm", &kquant_mm);
  m.impl("kquant_dequantize", &kquant_dequantize);
  m.impl("kquant_pack", &kquant_pack);
  m.impl("kquant_packed_mm", &kquant_packed_mm);
  m.impl("kquant_packed_dequantize", &kquant_packed_dequantize);
  m.impl("kquant_dense_mm", &kquant_dense_mm);
}
