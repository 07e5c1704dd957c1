// What our attention kernels share: float32 vectors of the build's width (AVX-512 with
// SWITCHYARD_VNNI, else AVX2), bfloat16 loads widened to float32, 8 x 8 transposes, exp for
// x <= 0, the checks on q and the caches, and the dispatch over dtype and head size.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace switchyard_simd {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Eight floats (bfloat16 widened) in a 256-bit vector, in either build: AVX2's `load`, and
// the 8 x 8 transposes of the prefill kernel's keys.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// rows[k] = 8 floats of row k -> rows[m] = float m of rows 0..7.
inline void transpose8(__m256 rows[8]) {
  __m256 lo[4], hi[4], mixed[8];
  for (int k = 0; k < 4; ++k) {
    lo[k] = _mm256_unpacklo_ps(rows[2 * k], rows[2 * k + 1]);
    hi[k] = _mm256_unpackhi_ps(rows[2 * k], rows[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) {
    mixed[4 * k] = _mm256_shuffle_ps(lo[2 * k], lo[2 * k + 1], 0x44);
    mixed[4 * k + 1] = _mm256_shuffle_ps(lo[2 * k], lo[2 * k + 1], 0xEE);
    mixed[4 * k + 2] = _mm256_shuffle_ps(hi[2 * k], hi[2 * k + 1], 0x44);
    mixed[4 * k + 3] = _mm256_shuffle_ps(hi[2 * k], hi[2 * k + 1], 0xEE);
  }
  for (int m = 0; m < 4; ++m) {
    rows[m] = _mm256_permute2f128_ps(mixed[m], mixed[m + 4], 0x20);
    rows[m + 4] = _mm256_permute2f128_ps(mixed[m], mixed[m + 4], 0x31);
  }
}

#ifdef SWITCHYARD_VNNI
using Vec = __m512;
constexpr int64_t kWidth = 16;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec splat(float x) { return _mm512_set1_ps(x); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec maximum(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float max_all(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec zero() { return _mm512_setzero_ps(); }
#else
using Vec = __m256;
constexpr int64_t kWidth = 8;
inline Vec load(const float* p) { return load8(p); }
inline Vec load(const c10::BFloat16* p) { return load8(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec splat(float x) { return _mm256_set1_ps(x); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec maximum(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float sum(Vec v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}
inline float max_all(Vec v) {
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}
inline Vec zero() { return _mm256_setzero_ps(); }
#endif

// exp(x) for x <= 0 (Cephes' polynomial, ~1 ulp); x below -87 gives 0, as -inf does. Eight
// lanes in either build (the float32 linear's SiLU), and the build's width.
// Inlined by force, as sigmoid below: left to GCC, the linears' SiLU epilogues called them
// through the PLT (-fPIC), spilling the tile's accumulators around each call.
constexpr float kExpPolynomial[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                    1.6666665459e-1f, 5.0000001201e-1f};
constexpr float kExpFirst = 1.9875691500e-4f;

[[gnu::always_inline]] inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 clamped = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(kExpFirst);
  for (float c : kExpPolynomial) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r);
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(_mm256_add_ps(p, _mm256_set1_ps(1.0f)),
                                 _mm256_castsi256_ps(bits));
  return _mm256_and_ps(e, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

#ifdef SWITCHYARD_VNNI
[[gnu::always_inline]] inline Vec exp_nonpositive(Vec x) {
  const Vec clamped = _mm512_max_ps(x, splat(-87.0f));
  const Vec n = _mm512_roundscale_ps(mul(clamped, splat(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(n, splat(0.693359375f), clamped);
  r = _mm512_fnmadd_ps(n, splat(-2.12194440e-4f), r);
  Vec p = splat(kExpFirst);
  for (float c : kExpPolynomial) p = fmadd(p, r, splat(c));
  p = fmadd(mul(p, r), r, r);
  const Vec e = _mm512_scalef_ps(add(p, splat(1.0f)), n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, splat(-87.0f), _CMP_GE_OQ), e);
}
#else
[[gnu::always_inline]] inline Vec exp_nonpositive(Vec x) { return exp_nonpositive8(x); }
#endif

// 1 / (1 + exp(-g)) from exp(-|g|), which cannot overflow; eight lanes in either build (the
// float32 linear's SiLU), and the build's width (the fused decode layers').
[[gnu::always_inline]] inline __m256 sigmoid8(__m256 g) {
  const __m256 e = exp_nonpositive8(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));  // -|g|
  const __m256 total = _mm256_add_ps(_mm256_set1_ps(1.0f), e);
  return _mm256_blendv_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), total), _mm256_div_ps(e, total),
                          _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
}

#ifdef SWITCHYARD_VNNI
[[gnu::always_inline]] inline Vec sigmoid(Vec g) {
  const Vec e = exp_nonpositive(sub(zero(), _mm512_abs_ps(g)));  // -|g|
  const Vec total = add(splat(1.0f), e);
  const __mmask16 negative = _mm512_cmp_ps_mask(g, zero(), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(negative, _mm512_div_ps(splat(1.0f), total),
                              _mm512_div_ps(e, total));
}
#else
[[gnu::always_inline]] inline Vec sigmoid(Vec g) { return sigmoid8(g); }
#endif

// Calls f(std::integral_constant<int, head_dim / kWidth>) for the head sizes compiled in (16,
// 32, 64, 80, 96, 128, 256: attention.KERNEL_HEAD_DIMS), so a row's vectors live in registers.
template <typename F>
void with_head_vectors(int64_t head_dim, F&& f) {
  switch (head_dim) {
    case 16: return f(std::integral_constant<int, 16 / kWidth>{});
    case 32: return f(std::integral_constant<int, 32 / kWidth>{});
    case 64: return f(std::integral_constant<int, 64 / kWidth>{});
    case 80: return f(std::integral_constant<int, 80 / kWidth>{});
    case 96: return f(std::integral_constant<int, 96 / kWidth>{});
    case 128: return f(std::integral_constant<int, 128 / kWidth>{});
    case 256: return f(std::integral_constant<int, 256 / kWidth>{});
    default: TORCH_CHECK(false, "attention kernels: head size ", head_dim, " not built in");
  }
}

template <typename T>
struct Dtype {
  using type = T;
};

// Calls f(Dtype<float or c10::BFloat16>, head vectors) for q's dtype and head size.
template <typename F>
void with_dtype_and_head_vectors(const at::Tensor& q, F&& f) {
  with_head_vectors(q.size(2), [&](auto nv) {
    if (q.scalar_type() == at::kFloat) {
      f(Dtype<float>{}, nv);
    } else {
      f(Dtype<c10::BFloat16>{}, nv);
    }
  });
}

// q [rows, H, D] and head-major caches [blocks, KVH, bs, D] of one dtype, float32 or bfloat16.
inline void check_query_and_caches(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), op,
              ": q [rows, H, D], caches [blocks, KVH, bs, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op,
              ": caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              op, ": q and the caches must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16");
}

}  // namespace switchyard_simd
