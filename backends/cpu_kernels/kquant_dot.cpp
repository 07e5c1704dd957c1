// GGUF's 5- and 6-bit formats (Q5_0, Q5_1, Q5_K, Q6_K, and Q4_K) multiplied on their own
// block layout, as the file stores them: nothing is repacked, a weight takes the file's bytes.
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
//
// `type` is ggml's id: Q5_0 = 6, Q5_1 = 7, Q4_K = 12, Q5_K = 13, Q6_K = 14.

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
  const float* sum;      // [M, Kp / 16]: sum of xq * dx over the group, natural order
  int64_t kp, groups;    // row strides of q and of dx / sum
};

template <typename T>
void quantize_row(const T* src, int64_t k, int64_t kp, int8_t* q, int8_t* rest, float* dx,
                  float* sum) {
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
  }
}

template <typename T>
QuantizedRows quantize_rows(const at::Tensor& x) {
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
                   sum + r * groups);
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

}  // namespace

at::Tensor switchyard::kquant_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                                     int64_t in_features) {
  return kquant_mm(x, blocks, type, in_features);
}

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("kquant_mm(Tensor x, Tensor blocks, int type, int in_features) -> Tensor");
  m.def("kquant_dequantize(Tensor blocks, int type, int in_features, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("kquant_mm", &kquant_mm);
  m.impl("kquant_dequantize", &kquant_dequantize);
}
