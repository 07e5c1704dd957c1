// Every decoder layer of a Llama-shaped model whose linears are our 4-bit int8-dot weights
// (int8_dot.cpp), for one decode step, in one call: no Python, no dispatcher and no graph
// wrapper between the layer's kernels. At batch 1 the default model's 30 layers spent
// ~1.5 ms a step between kernels as compiled graphs (each layer's Python wrapper, five
// pybind calls into inductor's small kernels, five dispatcher calls); here a layer is
//
//   h = rms_norm(x) * w1;  q, k, v = split(q4_mm(h));  [Qwen3: rms_norm each head of q, k]
//   rotate q, k;  write k, v to the cache
//   x = x + q4_mm(paged_decode_attention(q));  h = rms_norm(x) * w2
//   gate, up = split(q4_mm(h));  x = x + q4_mm(silu(gate) * up)
//
// float32 rows only. The same operations in the same order as models/llama.py; reductions
// and the FMA contraction may round differently from the compiled graph's (last-ulp).
//
//   x [B, E], cos / sin [B, (1,) D], slot_blocks / slot_offsets [B] int64,
//   block_tables [B, nb] int64, mask [B, nb * bs] float32, caches [blocks, KVH, bs, D] each,
//   weights: 10 a layer (input norm, qkv packed, qkv scale_zero, o packed, o scale_zero,
//   post-attention norm, gate_up packed, gate_up scale_zero, down packed, down scale_zero),
//   with qk_norm 12 (then q norm [D], k norm [D], normalizing each head with the layers' eps)
//   -> [B, E]

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "kernel_entry_points.h"
#include "simd.h"

namespace {

using namespace switchyard_simd;

constexpr int64_t kWeightsPerLayer = 10, kQkNormWeights = 2;

struct Dims {
  int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, group_size;
  float eps, scale;
  bool fine, qk_norm;
};

int64_t weights_per_layer(bool qk_norm) {
  return kWeightsPerLayer + (qk_norm ? kQkNormWeights : 0);
}

// out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), as RMSNorm.forward.
void rms_norm(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    Vec acc = zero();
    int64_t i = 0;
    for (; i + kWidth <= n; i += kWidth) acc = fmadd(load(xr + i), load(xr + i), acc);
    float squares = sum(acc);
    for (; i < n; ++i) squares += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
    for (i = 0; i + kWidth <= n; i += kWidth)
      store(out + r * n + i, mul(load(w + i), mul(load(xr + i), splat(inv))));
    for (; i < n; ++i) out[r * n + i] = w[i] * (xr[i] * inv);
  }
}

// x * cos + rotate_half(x) * sin over one head (rotate_half(x) = [-x2, x1]).
void rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) out[j] = x[j] * cos[j] - x[j + half] * sin[j];
  for (int64_t j = half; j < d; ++j) out[j] = x[j] * cos[j] + x[j - half] * sin[j];
}

// One head as the rotary takes it: itself, or with a per-head norm (`norm` not null) its
// rms_norm in `scratch` [D].
const float* head_in(const float* head, const float* norm, const Dims& s, float* scratch) {
  if (norm == nullptr) return head;
  rms_norm(head, norm, 1, s.head_dim, s.eps, scratch);
  return scratch;
}

// q [B, H, D] (normed per head where q_norm is given, then) rotated out of qkv; k likewise into
// the cache and v copied there, at each row's slot.
void project_rows(const Dims& s, const float* qkv, const float* cos, const float* sin,
                  const int64_t* slot_blocks, const int64_t* slot_offsets, at::Tensor& k_cache,
                  at::Tensor& v_cache, const float* q_norm, const float* k_norm, float* scratch,
                  float* q) {
  const int64_t d = s.head_dim, width = (s.heads + 2 * s.kv_heads) * d;
  const int64_t block_stride = k_cache.stride(0), head_stride = k_cache.stride(1);
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t b = 0; b < s.rows; ++b) {
    const float* row = qkv + b * width;
    const float* c = cos + b * d;
    const float* sn = sin + b * d;
    for (int64_t h = 0; h < s.heads; ++h) {
      rotate(head_in(row + h * d, q_norm, s, scratch), c, sn, d, q + (b * s.heads + h) * d);
    }
    const int64_t slot = slot_blocks[b] * block_stride + slot_offsets[b] * d;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      rotate(head_in(row + (s.heads + h) * d, k_norm, s, scratch), c, sn, d,
             kc + slot + h * head_stride);
      const float* v = row + (s.heads + s.kv_heads + h) * d;
      std::copy(v, v + d, vc + slot + h * head_stride);
    }
  }
}

// silu(gate) * up for gate_up [B, 2F] -> [B, F]; silu(g) = g * sigmoid(g).
void silu_and_mul(const float* gate_up, int64_t rows, int64_t f, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * f;
    const float* up = gate + f;
    float* o = out + r * f;
    int64_t i = 0;
    for (; i + kWidth <= f; i += kWidth) {
      Vec g = load(gate + i);
      store(o + i, mul(mul(g, sigmoid(g)), load(up + i)));
    }
    for (; i < f; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
}

void add_into(float* x, const at::Tensor& delta, int64_t count) {
  const float* d = delta.data_ptr<float>();
  int64_t i = 0;
  for (; i + kWidth <= count; i += kWidth) store(x + i, add(load(x + i), load(d + i)));
  for (; i < count; ++i) x[i] += d[i];
}

struct Buffers {
  at::Tensor x, normed, q, act, head;
};

void run_layer(const Dims& s, const at::Tensor* w, const at::Tensor& cos, const at::Tensor& sin,
               const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
               const at::Tensor& block_tables, const at::Tensor& mask, at::Tensor k_cache,
               at::Tensor v_cache, Buffers& buf) {
  float* x = buf.x.data_ptr<float>();
  const int64_t hidden = s.rows * s.hidden;
  rms_norm(x, w[0].data_ptr<float>(), s.rows, s.hidden, s.eps, buf.normed.data_ptr<float>());
  const at::Tensor qkv = switchyard::q4_matmul(buf.normed, w[1], w[2], s.group_size, s.fine);
  const float* q_norm = s.qk_norm ? w[10].data_ptr<float>() : nullptr;
  const float* k_norm = s.qk_norm ? w[11].data_ptr<float>() : nullptr;
  project_rows(s, qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
               slot_blocks.data_ptr<int64_t>(), slot_offsets.data_ptr<int64_t>(), k_cache,
               v_cache, q_norm, k_norm, buf.head.data_ptr<float>(), buf.q.data_ptr<float>());
  const at::Tensor attention =
      switchyard::decode_attention(buf.q, k_cache, v_cache, block_tables, mask, s.scale);
  add_into(x, switchyard::q4_matmul(attention.view({s.rows, s.heads * s.head_dim}), w[3], w[4],
                                    s.group_size, s.fine),
           hidden);
  rms_norm(x, w[5].data_ptr<float>(), s.rows, s.hidden, s.eps, buf.normed.data_ptr<float>());
  const at::Tensor gate_up = switchyard::q4_matmul(buf.normed, w[6], w[7], s.group_size, s.fine);
  silu_and_mul(gate_up.data_ptr<float>(), s.rows, s.intermediate, buf.act.data_ptr<float>());
  add_into(x, switchyard::q4_matmul(buf.act, w[8], w[9], s.group_size, s.fine), hidden);
}

void check_inputs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                  at::TensorList k_caches, at::TensorList v_caches, at::TensorList weights,
                  int64_t head_dim, bool qk_norm) {
  const int64_t rows = x.size(0), layers = static_cast<int64_t>(k_caches.size());
  const int64_t per_layer = weights_per_layer(qk_norm);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q4_decode_layers: x float32 [B, E]");
  TORCH_CHECK(cos.numel() == rows * head_dim && sin.numel() == rows * head_dim &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "q4_decode_layers: cos / sin float32 [B, D]");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.numel() == rows && slot_offsets.numel() == rows,
              "q4_decode_layers: slots int64 [B]");
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == layers * per_layer,
              "q4_decode_layers: a K and a V cache and 10 weights a layer (12 with qk_norm)");
  for (int64_t i = 0; i < layers; ++i) {
    TORCH_CHECK(k_caches[i].scalar_type() == at::kFloat && k_caches[i].is_contiguous() &&
                    v_caches[i].sizes() == k_caches[i].sizes() && v_caches[i].is_contiguous(),
                "q4_decode_layers: contiguous float32 caches");
    for (int64_t j : {0, 5}) {
      const at::Tensor& norm = weights[i * per_layer + j];
      TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() &&
                      norm.numel() == x.size(1),
                  "q4_decode_layers: norm weights float32 [E]");
    }
    for (int64_t j = kWeightsPerLayer; j < per_layer; ++j) {
      const at::Tensor& norm = weights[i * per_layer + j];
      TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() &&
                      norm.numel() == head_dim,
                  "q4_decode_layers: q / k norm weights float32 [D]");
    }
  }
}

at::Tensor q4_decode_layers(const at::Tensor& x_in, const at::Tensor& cos_in,
                            const at::Tensor& sin_in, const at::Tensor& slot_blocks_in,
                            const at::Tensor& slot_offsets_in,
                            const at::Tensor& block_tables_in, const at::Tensor& mask_in,
                            at::TensorList k_caches,
                            at::TensorList v_caches, at::TensorList weights, int64_t heads,
                            int64_t kv_heads, double eps, double scale, int64_t group_size,
                            bool fine, bool qk_norm) {
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor slot_blocks = slot_blocks_in.contiguous();
  const at::Tensor slot_offsets = slot_offsets_in.contiguous();
  // Once here, not in each layer's attention call (the step passes a view of its rows).
  const at::Tensor block_tables = block_tables_in.contiguous(), mask = mask_in.contiguous();
  const int64_t head_dim = k_caches.empty() ? 0 : k_caches[0].size(3);
  check_inputs(x_in, cos, sin, slot_blocks, slot_offsets, k_caches, v_caches, weights, head_dim,
               qk_norm);
  TORCH_CHECK(k_caches[0].size(1) == kv_heads && heads % kv_heads == 0,
              "q4_decode_layers: kv heads do not match the caches");
  const int64_t rows = x_in.size(0), hidden = x_in.size(1);
  const int64_t intermediate = weights[6].size(0) * 16 / 2;
  const Dims s{rows, hidden, heads, kv_heads, head_dim, intermediate, group_size,
               static_cast<float>(eps), static_cast<float>(scale), fine, qk_norm};
  Buffers buf{x_in.clone(at::MemoryFormat::Contiguous), at::empty({rows, hidden}, x_in.options()),
              at::empty({rows, heads, head_dim}, x_in.options()),
              at::empty({rows, intermediate}, x_in.options()),
              at::empty({head_dim}, x_in.options())};
  const int64_t per_layer = weights_per_layer(qk_norm);
  for (int64_t i = 0; i < static_cast<int64_t>(k_caches.size()); ++i) {
    run_layer(s, weights.data() + i * per_layer, cos, sin, slot_blocks, slot_offsets,
              block_tables, mask, k_caches[i], v_caches[i], buf);
  }
  return buf.x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("q4_decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor slot_blocks, "
        "Tensor slot_offsets, Tensor block_tables, Tensor mask, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor[] weights, int heads, int kv_heads, float eps, float scale, "
        "int group_size, bool fine, bool qk_norm=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("q4_decode_layers", &q4_decode_layers); }
