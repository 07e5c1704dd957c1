// Every decoder layer of a bf16 Llama-shaped model whose linears run our bf16 kernel
// (bf16_linear.cpp), for one decode step, in one call: decode_layers.cpp's chain for bf16. As
// compiled regions, each layer cost its graph's Python wrapper, four inductor kernels through
// pybind and five dispatcher calls (~0.1 ms a layer, a tenth of W1's 16-row step). A layer is
//
//   h = rms_norm(x) * w1;  q, k, v = split(bf16_linear(h));  [Qwen3: rms_norm each q, k head]
//   rotate q, k;  write k, v to the cache
//   x = x + bf16_linear(paged_decode_attention(q));  h = rms_norm(x) * w2
//   x = x + bf16_linear(bf16_silu_mul_linear(h))
//
// with the compiled graph's roundings: float32 arithmetic between bf16 tensors, rounded to
// bf16 (nearest even) where the graph stores a bf16 tensor: the norm's x / rms (its .to())
// and its product with the weight, each rotated q / k, each residual sum. Sums may associate
// differently from inductor's loops (last-ulp in float32, now and then one bf16 ulp).
//
//   x [B, E], cos / sin [B, (1,) D] all bf16, slot_blocks / slot_offsets [B] int64,
//   block_tables [B, nb] int64, mask [B, nb * bs] float32, caches [blocks, KVH, bs, D] bf16,
//   weights: 6 a layer (input norm [E], qkv packed, o packed, post-attention norm [E],
//   gate_up packed for silu_mul, down packed), with qk_norm 8 (then q norm [D], k norm [D],
//   normalizing each head with the layers' eps; D a multiple of 16) -> [B, E]
//
// build.py compiles this file with -mavx512bf16 where the CPU has it (as bf16_linear.cpp);
// elsewhere the operator exists and refuses to run.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernel_entry_points.h"

namespace {

constexpr int64_t kWeightsPerLayer = 6, kQkNormWeights = 2;

int64_t weights_per_layer(bool qk_norm) {
  return kWeightsPerLayer + (qk_norm ? kQkNormWeights : 0);
}

bool bf16_decode_layers_built() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512BF16__

constexpr int64_t kLanes = 16;

struct Dims {
  int64_t rows, hidden, heads, kv_heads, head_dim;
  float eps, scale;
  bool qk_norm;
};

inline __m512 load16(const uint16_t* p) {  // bf16 -> float32 is a 16-bit shift
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m512 rounded(__m512 v) {  // to bf16 and back: the value a bf16 tensor would hold
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// The first lanes of `mask` only (a head's half may be 8 values).
inline __m512 load16(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

inline void store16(uint16_t* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

inline uint16_t* bits(const at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>());
}

// out[r] = w * bf16(x[r] / sqrt(mean(x[r]^2) + eps)), as RMSNorm.forward in bf16; n a
// multiple of 16.
void rms_norm(const uint16_t* x, const uint16_t* w, int64_t rows, int64_t n, float eps,
              uint16_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * n;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += kLanes) {
      const __m512 v = load16(xr + i);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(n);
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
    for (int64_t i = 0; i < n; i += kLanes) {
      const __m512 normed = rounded(_mm512_mul_ps(load16(xr + i), inv));  // the .to(bf16)
      store16(out + r * n + i, _mm512_mul_ps(load16(w + i), normed));
    }
  }
}

// x * cos + rotate_half(x) * sin over one head (rotate_half(x) = [-x2, x1]), to bf16.
void rotate(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t d,
            uint16_t* out) {
  const int64_t half = d / 2;
  const __m512i sign = _mm512_set1_epi32(INT32_MIN);
  for (int64_t j = 0; j < half; j += kLanes) {
    const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(kLanes, half - j)) - 1);
    const __m512 low = load16(x + j, m), high = load16(x + half + j, m);
    const __m512 low_rotated =  // -x2
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(high), sign));
    store16(out + j, _mm512_add_ps(_mm512_mul_ps(low, load16(cos + j, m)),
                                   _mm512_mul_ps(low_rotated, load16(sin + j, m))), m);
    store16(out + half + j, _mm512_add_ps(_mm512_mul_ps(high, load16(cos + half + j, m)),
                                          _mm512_mul_ps(low, load16(sin + half + j, m))), m);
  }
}

// One head as the rotary takes it: itself, or with a per-head norm (`norm` not null) its
// rms_norm in `scratch` [D] (bf16, as the eager norm's output).
const uint16_t* head_in(const uint16_t* head, const uint16_t* norm, const Dims& s,
                        uint16_t* scratch) {
  if (norm == nullptr) return head;
  rms_norm(head, norm, 1, s.head_dim, s.eps, scratch);
  return scratch;
}

// q [B, H, D] (normed per head where q_norm is given, then) rotated out of qkv; k likewise into
// the cache and v copied there, at each row's slot.
void project_rows(const Dims& s, const uint16_t* qkv, const uint16_t* cos, const uint16_t* sin,
                  const int64_t* slot_blocks, const int64_t* slot_offsets, at::Tensor& k_cache,
                  at::Tensor& v_cache, const uint16_t* q_norm, const uint16_t* k_norm,
                  uint16_t* scratch, uint16_t* q) {
  const int64_t d = s.head_dim, width = (s.heads + 2 * s.kv_heads) * d;
  const int64_t block_stride = k_cache.stride(0), head_stride = k_cache.stride(1);
  uint16_t* kc = bits(k_cache);
  uint16_t* vc = bits(v_cache);
  for (int64_t b = 0; b < s.rows; ++b) {
    const uint16_t* row = qkv + b * width;
    for (int64_t h = 0; h < s.heads; ++h) {
      rotate(head_in(row + h * d, q_norm, s, scratch), cos + b * d, sin + b * d, d,
             q + (b * s.heads + h) * d);
    }
    const int64_t slot = slot_blocks[b] * block_stride + slot_offsets[b] * d;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      rotate(head_in(row + (s.heads + h) * d, k_norm, s, scratch), cos + b * d, sin + b * d, d,
             kc + slot + h * head_stride);
      const uint16_t* v = row + (s.heads + s.kv_heads + h) * d;
      std::copy(v, v + d, vc + slot + h * head_stride);
    }
  }
}

// x = bf16(x + delta), elementwise over `count` values.
void add_into(uint16_t* x, const at::Tensor& delta, int64_t count) {
  const uint16_t* d = bits(delta);
  for (int64_t i = 0; i < count; i += kLanes) {
    store16(x + i, _mm512_add_ps(load16(x + i), load16(d + i)));
  }
}

struct Buffers {
  at::Tensor x, normed, q, head;
};

void run_layer(const Dims& s, const at::Tensor* w, const at::Tensor& cos, const at::Tensor& sin,
               const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
               const at::Tensor& block_tables, const at::Tensor& mask, at::Tensor k_cache,
               at::Tensor v_cache, Buffers& buf) {
  uint16_t* x = bits(buf.x);
  const int64_t hidden = s.rows * s.hidden;
  rms_norm(x, bits(w[0]), s.rows, s.hidden, s.eps, bits(buf.normed));
  const at::Tensor qkv = switchyard::bf16_matmul(buf.normed, w[1], false);
  const uint16_t* q_norm = s.qk_norm ? bits(w[6]) : nullptr;
  const uint16_t* k_norm = s.qk_norm ? bits(w[7]) : nullptr;
  project_rows(s, bits(qkv), bits(cos), bits(sin), slot_blocks.data_ptr<int64_t>(),
               slot_offsets.data_ptr<int64_t>(), k_cache, v_cache, q_norm, k_norm,
               bits(buf.head), bits(buf.q));
  const at::Tensor attention =
      switchyard::decode_attention(buf.q, k_cache, v_cache, block_tables, mask, s.scale);
  add_into(x, switchyard::bf16_matmul(attention.view({s.rows, s.heads * s.head_dim}), w[2],
                                      false),
           hidden);
  rms_norm(x, bits(w[3]), s.rows, s.hidden, s.eps, bits(buf.normed));
  const at::Tensor act = switchyard::bf16_matmul(buf.normed, w[4], true);
  add_into(x, switchyard::bf16_matmul(act, w[5], false), hidden);
}

#endif

void check_inputs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                  at::TensorList k_caches, at::TensorList v_caches, at::TensorList weights,
                  int64_t head_dim, bool qk_norm) {
  const int64_t rows = x.size(0), layers = static_cast<int64_t>(k_caches.size());
  const int64_t per_layer = weights_per_layer(qk_norm);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) % 16 == 0,
              "bf16_decode_layers: x bf16 [B, E], E a multiple of 16");
  TORCH_CHECK(head_dim % 2 == 0, "bf16_decode_layers: an even head size");
  TORCH_CHECK(!qk_norm || head_dim % 16 == 0,
              "bf16_decode_layers: qk_norm needs a head size that is a multiple of 16");
  TORCH_CHECK(cos.numel() == rows * head_dim && sin.numel() == rows * head_dim &&
                  cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "bf16_decode_layers: cos / sin bf16 [B, D]");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.numel() == rows && slot_offsets.numel() == rows,
              "bf16_decode_layers: slots int64 [B]");
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == layers * per_layer,
              "bf16_decode_layers: a K and a V cache and 6 weights a layer (8 with qk_norm)");
  for (int64_t i = 0; i < layers; ++i) {
    TORCH_CHECK(k_caches[i].scalar_type() == at::kBFloat16 && k_caches[i].is_contiguous() &&
                    v_caches[i].sizes() == k_caches[i].sizes() && v_caches[i].is_contiguous(),
                "bf16_decode_layers: contiguous bf16 caches");
    for (int64_t j : {0, 3}) {
      const at::Tensor& norm = weights[i * per_layer + j];
      TORCH_CHECK(norm.scalar_type() == at::kBFloat16 && norm.is_contiguous() &&
                      norm.numel() == x.size(1),
                  "bf16_decode_layers: norm weights bf16 [E]");
    }
    for (int64_t j = kWeightsPerLayer; j < per_layer; ++j) {
      const at::Tensor& norm = weights[i * per_layer + j];
      TORCH_CHECK(norm.scalar_type() == at::kBFloat16 && norm.is_contiguous() &&
                      norm.numel() == head_dim,
                  "bf16_decode_layers: q / k norm weights bf16 [D]");
    }
  }
}

at::Tensor bf16_decode_layers(const at::Tensor& x_in, const at::Tensor& cos_in,
                              const at::Tensor& sin_in, const at::Tensor& slot_blocks_in,
                              const at::Tensor& slot_offsets_in,
                              const at::Tensor& block_tables_in, const at::Tensor& mask_in,
                              at::TensorList k_caches, at::TensorList v_caches,
                              at::TensorList weights, int64_t heads, int64_t kv_heads,
                              double eps, double scale, bool qk_norm) {
  TORCH_CHECK(bf16_decode_layers_built(),
              "bf16_decode_layers: this build has no AVX-512-BF16 code (the CPU lacks it)");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor slot_blocks = slot_blocks_in.contiguous();
  const at::Tensor slot_offsets = slot_offsets_in.contiguous();
  const at::Tensor block_tables = block_tables_in.contiguous(), mask = mask_in.contiguous();
  const int64_t head_dim = k_caches.empty() ? 0 : k_caches[0].size(3);
  check_inputs(x_in, cos, sin, slot_blocks, slot_offsets, k_caches, v_caches, weights, head_dim,
               qk_norm);
  TORCH_CHECK(k_caches[0].size(1) == kv_heads && heads % kv_heads == 0,
              "bf16_decode_layers: kv heads do not match the caches");
  const int64_t rows = x_in.size(0), hidden = x_in.size(1);
  at::Tensor x = x_in.clone(at::MemoryFormat::Contiguous);
#ifdef __AVX512BF16__
  const Dims s{rows, hidden, heads, kv_heads, head_dim, static_cast<float>(eps),
               static_cast<float>(scale), qk_norm};
  Buffers buf{x, at::empty({rows, hidden}, x_in.options()),
              at::empty({rows, heads, head_dim}, x_in.options()),
              at::empty({head_dim}, x_in.options())};
  const int64_t per_layer = weights_per_layer(qk_norm);
  for (int64_t i = 0; i < static_cast<int64_t>(k_caches.size()); ++i) {
    run_layer(s, weights.data() + i * per_layer, cos, sin, slot_blocks, slot_offsets,
              block_tables, mask, k_caches[i], v_caches[i], buf);
  }
#endif
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("bf16_decode_layers_built() -> bool");
  m.def("bf16_decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor slot_blocks, "
        "Tensor slot_offsets, Tensor block_tables, Tensor mask, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor[] weights, int heads, int kv_heads, float eps, "
        "float scale, bool qk_norm=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CompositeExplicitAutograd, m) {
  m.impl("bf16_decode_layers_built", &bf16_decode_layers_built);
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("bf16_decode_layers", &bf16_decode_layers); }
