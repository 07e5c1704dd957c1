// Scalar stand-ins for the AVX-512 intrinsics our SWITCHYARD_VNNI kernel code uses, so that
// code (the 16-lane Vec paths of simd.h, the VNNI lane blocks of int8_dot.cpp, the BF16 linear)
// runs on a CPU without AVX-512: tests/native/test_avx512_code_on_stand_ins.py force-includes
// this header (-include) before each kernel source and builds with -DSWITCHYARD_VNNI and AVX2
// flags only. It checks the 16-lane code's indexing, tails and masks on any x86-64 CPU; the
// real instructions run in the rest of the suite on AVX-512 machines. Semantics follow Intel's
// pseudo-code; the reductions follow GCC 12's order. An intrinsic used in new 16-lane code and
// missing here fails that build with an "AVX-512 not enabled" error: add its stand-in.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#define __AVX512BF16__ 1  // bf16_linear.cpp's kernel, on these stand-ins

namespace avx512_stand_ins {
struct F { float v[16]; };
struct I { int32_t v[16]; };
#define FI static inline __attribute__((always_inline))
FI F f(__m512 x) { F r; std::memcpy(&r, &x, 64); return r; }
FI __m512 m(const F& x) { __m512 r; std::memcpy(&r, &x, 64); return r; }
FI I fi(__m512i x) { I r; std::memcpy(&r, &x, 64); return r; }
FI __m512i mi(const I& x) { __m512i r; std::memcpy(&r, &x, 64); return r; }

FI __m512 loadu_ps(const void* p) { F r; std::memcpy(&r, p, 64); return m(r); }
FI void storeu_ps(void* p, __m512 v) { std::memcpy(p, &v, 64); }
FI void store_ps(void* p, __m512 v) {
  if (reinterpret_cast<uintptr_t>(p) % 64) __builtin_trap();  // alignment, as vmovaps
  std::memcpy(p, &v, 64);
}
FI __m512i loadu_si512(const void* p) { I r; std::memcpy(&r, p, 64); return mi(r); }
FI __m512 set1_ps(float x) { F r; for (float& e : r.v) e = x; return m(r); }
FI __m512 setzero_ps() { return set1_ps(0.f); }
FI __m512i set1_epi32(int32_t x) { I r; for (auto& e : r.v) e = x; return mi(r); }
FI __m512i set1_epi8(char x) { uint8_t b[64]; std::memset(b, (uint8_t)x, 64); __m512i r; std::memcpy(&r, b, 64); return r; }
FI __m512i setzero_si512() { return set1_epi32(0); }
#define BIN(name, expr) FI __m512 name(__m512 a_, __m512 b_) { F a = f(a_), b = f(b_), r; \
  for (int i = 0; i < 16; ++i) r.v[i] = (expr); return m(r); }
BIN(add_ps, a.v[i] + b.v[i])
BIN(sub_ps, a.v[i] - b.v[i])
BIN(mul_ps, a.v[i] * b.v[i])
BIN(div_ps, a.v[i] / b.v[i])
// vmaxps: the second operand where either is NaN or both are zeros
BIN(max_ps, a.v[i] > b.v[i] ? a.v[i] : b.v[i])
BIN(scalef_ps, std::ldexp(a.v[i], (int)std::floor(b.v[i])))
#undef BIN
FI __m512 fmadd_ps(__m512 a_, __m512 b_, __m512 c_) { F a = f(a_), b = f(b_), c = f(c_), r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return m(r); }
FI __m512 fnmadd_ps(__m512 a_, __m512 b_, __m512 c_) { F a = f(a_), b = f(b_), c = f(c_), r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::fma(-a.v[i], b.v[i], c.v[i]); return m(r); }
FI __m512 roundscale_ps(__m512 a_, int imm) {
  if (imm != (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)) __builtin_trap();
  F a = f(a_), r; for (int i = 0; i < 16; ++i) r.v[i] = std::nearbyint(a.v[i]); return m(r); }
FI __m512 abs_ps(__m512 a_) { F a = f(a_), r; for (int i = 0; i < 16; ++i) r.v[i] = std::fabs(a.v[i]); return m(r); }
FI __mmask16 cmp_ps_mask(__m512 a_, __m512 b_, int pred) { F a = f(a_), b = f(b_); unsigned k = 0;
  for (int i = 0; i < 16; ++i) {
    bool bit;
    if (pred == _CMP_GE_OQ) bit = a.v[i] >= b.v[i];
    else if (pred == _CMP_LT_OQ) bit = a.v[i] < b.v[i];
    else __builtin_trap();
    k |= (unsigned)bit << i;
  }
  return (__mmask16)k; }
FI __m512 maskz_mov_ps(__mmask16 k, __m512 a_) { F a = f(a_), r;
  for (int i = 0; i < 16; ++i) r.v[i] = (k >> i) & 1 ? a.v[i] : 0.f; return m(r); }
FI __m512 mask_blend_ps(__mmask16 k, __m512 a_, __m512 b_) { F a = f(a_), b = f(b_), r;
  for (int i = 0; i < 16; ++i) r.v[i] = (k >> i) & 1 ? b.v[i] : a.v[i]; return m(r); }
// GCC 12's __MM512_REDUCE_OP order
#define RED(name, OP) FI float name(__m512 a_) { F a = f(a_); float t3[8], t6[4];                 \
  for (int i = 0; i < 8; ++i) t3[i] = OP(a.v[8 + i], a.v[i]);                                  \
  for (int i = 0; i < 4; ++i) t6[i] = OP(t3[4 + i], t3[i]);                                    \
  float t8_0 = OP(t6[0], t6[2]), t8_1 = OP(t6[1], t6[3]); return OP(t8_0, t8_1); }
#define PLUS(x, y) ((x) + (y))
#define MAXOP(x, y) ((x) > (y) ? (x) : (y))
RED(reduce_add_ps, PLUS)
RED(reduce_max_ps, MAXOP)
#undef RED
FI __m512i cvtepu16_epi32(__m256i a) { uint16_t s[16]; std::memcpy(s, &a, 32); I r;
  for (int i = 0; i < 16; ++i) r.v[i] = s[i]; return mi(r); }
FI __m512i slli_epi32(__m512i a_, unsigned n) { I a = fi(a_), r;
  for (int i = 0; i < 16; ++i) r.v[i] = n > 31 ? 0 : (int32_t)((uint32_t)a.v[i] << n); return mi(r); }
FI __m512 castsi512_ps(__m512i a) { __m512 r; std::memcpy(&r, &a, 64); return r; }
FI __m512i add_epi32(__m512i a_, __m512i b_) { I a = fi(a_), b = fi(b_), r;
  for (int i = 0; i < 16; ++i) r.v[i] = (int32_t)((uint32_t)a.v[i] + (uint32_t)b.v[i]); return mi(r); }
FI __m512i and_si512(__m512i a, __m512i b) { uint8_t x[64], y[64]; std::memcpy(x, &a, 64); std::memcpy(y, &b, 64);
  for (int i = 0; i < 64; ++i) x[i] &= y[i]; __m512i r; std::memcpy(&r, x, 64); return r; }
FI __m512i srli_epi16(__m512i a, unsigned n) { uint16_t x[32]; std::memcpy(x, &a, 64);
  for (auto& e : x) e = n > 15 ? 0 : (uint16_t)(e >> n); __m512i r; std::memcpy(&r, x, 64); return r; }
FI __m512i dpbusd_epi32(__m512i src, __m512i a, __m512i b) { I s = fi(src); uint8_t u[64]; int8_t v[64];
  std::memcpy(u, &a, 64); std::memcpy(v, &b, 64);
  for (int j = 0; j < 16; ++j) { int32_t t = 0; for (int k = 0; k < 4; ++k) t += (int32_t)u[4 * j + k] * v[4 * j + k];
    s.v[j] = (int32_t)((uint32_t)s.v[j] + (uint32_t)t); }
  return mi(s); }
FI __m512 cvtepi32_ps(__m512i a_) { I a = fi(a_); F r; for (int i = 0; i < 16; ++i) r.v[i] = (float)a.v[i]; return m(r); }
FI __m512 cvtph_ps(__m256i a) { F r;
  _mm256_storeu_ps(r.v, _mm256_cvtph_ps(_mm256_castsi256_si128(a)));
  _mm256_storeu_ps(r.v + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1))); return m(r); }
FI float bf(uint16_t b) { uint32_t u = (uint32_t)b << 16; float x; std::memcpy(&x, &u, 4); return x; }
// vdpbf16ps: src += a.odd * b.odd, then += a.even * b.even (Intel SDM), products exact
FI __m512 dpbf16_ps(__m512 src, __m512bh a, __m512bh b) { F s = f(src); uint16_t x[32], y[32];
  std::memcpy(x, &a, 64); std::memcpy(y, &b, 64);
  for (int i = 0; i < 16; ++i) { s.v[i] += bf(x[2 * i + 1]) * bf(y[2 * i + 1]); s.v[i] += bf(x[2 * i]) * bf(y[2 * i]); }
  return m(s); }
FI __m256bh cvtneps_pbh(__m512 a_) { F a = f(a_); uint16_t o[16];
  for (int i = 0; i < 16; ++i) { uint32_t u; std::memcpy(&u, &a.v[i], 4);
    o[i] = std::isnan(a.v[i]) ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); }
  __m256bh r; std::memcpy(&r, o, 32); return r; }
#undef FI
}  // namespace avx512_stand_ins

#define _mm512_loadu_ps avx512_stand_ins::loadu_ps
#define _mm512_storeu_ps avx512_stand_ins::storeu_ps
#define _mm512_store_ps avx512_stand_ins::store_ps
#define _mm512_loadu_si512 avx512_stand_ins::loadu_si512
#define _mm512_set1_ps avx512_stand_ins::set1_ps
#define _mm512_setzero_ps avx512_stand_ins::setzero_ps
#define _mm512_set1_epi32 avx512_stand_ins::set1_epi32
#define _mm512_set1_epi8 avx512_stand_ins::set1_epi8
#define _mm512_setzero_si512 avx512_stand_ins::setzero_si512
#define _mm512_add_ps avx512_stand_ins::add_ps
#define _mm512_sub_ps avx512_stand_ins::sub_ps
#define _mm512_mul_ps avx512_stand_ins::mul_ps
#define _mm512_div_ps avx512_stand_ins::div_ps
#define _mm512_max_ps avx512_stand_ins::max_ps
#define _mm512_scalef_ps avx512_stand_ins::scalef_ps
#define _mm512_fmadd_ps avx512_stand_ins::fmadd_ps
#define _mm512_fnmadd_ps avx512_stand_ins::fnmadd_ps
#define _mm512_roundscale_ps avx512_stand_ins::roundscale_ps
#define _mm512_abs_ps avx512_stand_ins::abs_ps
#define _mm512_cmp_ps_mask avx512_stand_ins::cmp_ps_mask
#define _mm512_maskz_mov_ps avx512_stand_ins::maskz_mov_ps
#define _mm512_mask_blend_ps avx512_stand_ins::mask_blend_ps
#define _mm512_reduce_add_ps avx512_stand_ins::reduce_add_ps
#define _mm512_reduce_max_ps avx512_stand_ins::reduce_max_ps
#define _mm512_cvtepu16_epi32 avx512_stand_ins::cvtepu16_epi32
#define _mm512_slli_epi32 avx512_stand_ins::slli_epi32
#define _mm512_castsi512_ps avx512_stand_ins::castsi512_ps
#define _mm512_add_epi32 avx512_stand_ins::add_epi32
#define _mm512_and_si512 avx512_stand_ins::and_si512
#define _mm512_srli_epi16 avx512_stand_ins::srli_epi16
#define _mm512_dpbusd_epi32 avx512_stand_ins::dpbusd_epi32
#define _mm512_cvtepi32_ps avx512_stand_ins::cvtepi32_ps
#define _mm512_cvtph_ps avx512_stand_ins::cvtph_ps
#define _mm512_dpbf16_ps avx512_stand_ins::dpbf16_ps
#define _mm512_cvtneps_pbh avx512_stand_ins::cvtneps_pbh
