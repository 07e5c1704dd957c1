// A mixture-of-experts block (models/moe.py) in one call where every expert is a SwiGLU MLP
// whose linears run our bf16 kernel (bf16_linear.cpp): the router's softmax, top-k and
// normalisation, the grouping of the rows by expert, each chosen expert once on its rows
//
//   y[rows] = bf16_linear(bf16_silu_mul_linear(grouped[rows], gate_up[e]), down[e])
//
// through the same C++ entry point the two operators run (switchyard::bf16_matmul), and the
// weighted sum of each token's experts. Every step is the Python block's own, in its order
// and roundings (softmax / topk / sum as ATen's ops, a stable grouping by expert in top-k-slot
// major order, bf16(y * w) summed in float in that order and rounded once, as index_add_ does),
// so the two agree bit for bit. From Python the same block cost ~20 dispatcher calls, slices and a cat a layer: at one
// token ~0.3 ms a layer on top of the kernels'.
//
//   bf16_moe_block_built() -> bool    whether this build has the code (AVX-512-BF16)
//   bf16_moe_block(x [T, H], logits [T, E], gate_up [E, ...], down [E, ...], top_k,
//                  renormalize, float32_weights, expert_tokens [E]) -> [T, H]   bf16
//
// `logits`: the router's scores (its matmul stays torch's, so the choice of experts is
// transformers'); gate_up / down: every expert's weights as PrepackedLinear packs them,
// stacked (gate_up packed for silu_mul); `renormalize`: divide the top-k weights by their sum;
// `float32_weights`: apply them in float32 (else in the logits' dtype); `expert_tokens` (int64)
// gains the rows routed to each expert.
//
// build.py compiles this file with -mavx512bf16 where the CPU has it (as bf16_linear.cpp);
// elsewhere the operator exists and refuses to run.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernel_entry_points.h"

namespace {

bool bf16_moe_block_built() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

void check_inputs(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& gate_up,
                  const at::Tensor& down, int64_t top_k, const at::Tensor& expert_tokens) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_moe_block: x must be contiguous bfloat16 [T, H]");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == x.size(0),
              "bf16_moe_block: logits must be [T, E] with the ", x.size(0), " rows of x");
  const int64_t experts = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "bf16_moe_block: top_k must be in 1..", experts);
  TORCH_CHECK(gate_up.dim() == 5 && down.dim() == 5 && gate_up.size(0) == experts &&
                  down.size(0) == experts && gate_up.is_contiguous() && down.is_contiguous(),
              "bf16_moe_block: gate_up and down must be the ", experts,
              " experts' packed weights, stacked and contiguous");
  TORCH_CHECK(down.size(1) * down.size(3) == x.size(1), "bf16_moe_block: each down projection "
              "must have ", x.size(1), " outputs");  // bf16_matmul checks the rest
  TORCH_CHECK(expert_tokens.dim() == 1 && expert_tokens.size(0) == experts &&
                  expert_tokens.scalar_type() == at::kLong && expert_tokens.is_contiguous(),
              "bf16_moe_block: expert_tokens must be int64 [", experts, "]");
}

// Each token's top-k weights (as float: exact for bf16) and experts, [T, k] each, as the
// Python block's route() computes them.
std::pair<at::Tensor, at::Tensor> route(const at::Tensor& logits, int64_t top_k,
                                        bool renormalize, bool float32_weights) {
  auto [weights, indices] = at::topk(at::softmax(logits, -1, at::kFloat), top_k, -1);
  if (renormalize) {
    weights = weights.div(weights.sum(-1, true));
  }
  if (!float32_weights) {
    weights = weights.to(logits.scalar_type());
  }
  return {weights.to(at::kFloat).contiguous(), indices.contiguous()};
}

// One routed row: which token, and its weight for the expert it is grouped under.
struct RoutedRow {
  int64_t token;
  float weight;
};

at::Tensor bf16_moe_block(const at::Tensor& x, const at::Tensor& logits,
                          const at::Tensor& gate_up, const at::Tensor& down, int64_t top_k,
                          bool renormalize, bool float32_weights, at::Tensor& expert_tokens) {
  TORCH_CHECK(bf16_moe_block_built(),
              "bf16_moe_block: this build has no AVX-512-BF16 code (the CPU lacks it)");
  check_inputs(x, logits, gate_up, down, top_k, expert_tokens);
  at::Tensor out = at::zeros_like(x);
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = logits.size(1);
  if (tokens == 0) {
    return out;
  }
  const auto [weights, indices] = route(logits, top_k, renormalize, float32_weights);
  const float* weight = weights.const_data_ptr<float>();
  const int64_t* index = indices.const_data_ptr<int64_t>();

  // A stable counting sort of the rows (top-k slot major, then token) by expert.
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    ++start[index[i] + 1];
  }
  int64_t* counted = expert_tokens.mutable_data_ptr<int64_t>();
  for (int64_t e = 0; e < experts; ++e) {
    counted[e] += start[e + 1];
    start[e + 1] += start[e];
  }
  const int64_t rows = tokens * top_k;
  std::vector<RoutedRow> routed(rows);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  at::Tensor grouped = at::empty({rows, hidden}, x.options());
  const auto* source = x.const_data_ptr<c10::BFloat16>();
  auto* target = grouped.mutable_data_ptr<c10::BFloat16>();
  for (int64_t slot = 0; slot < top_k; ++slot) {
    for (int64_t token = 0; token < tokens; ++token) {
      const int64_t row = next[index[token * top_k + slot]]++;
      routed[row] = {token, weight[token * top_k + slot]};
      std::memcpy(target + row * hidden, source + token * hidden,
                  hidden * sizeof(c10::BFloat16));
    }
  }

  // index_add_ on bf16 sums each token's rows in float, in the order given, and rounds once.
  std::vector<float> sums(tokens * hidden, 0.0f);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = start[e + 1] - start[e];
    if (count == 0) {
      continue;
    }
    const at::Tensor act =
        switchyard::bf16_matmul(grouped.narrow(0, start[e], count), gate_up[e], true);
    const at::Tensor y = switchyard::bf16_matmul(act, down[e], false);
    const auto* values = y.const_data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < count; ++i) {
      const RoutedRow& row = routed[start[e] + i];
      float* into = sums.data() + row.token * hidden;
      const c10::BFloat16* from = values + i * hidden;
      for (int64_t h = 0; h < hidden; ++h) {
        into[h] += static_cast<float>(c10::BFloat16(static_cast<float>(from[h]) * row.weight));
      }
    }
  }
  auto* summed = out.mutable_data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < tokens * hidden; ++i) {
    summed[i] = c10::BFloat16(sums[i]);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("bf16_moe_block_built() -> bool");
  m.def("bf16_moe_block(Tensor x, Tensor logits, Tensor gate_up, Tensor down, int top_k, "
        "bool renormalize, bool float32_weights, Tensor(a!) expert_tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CompositeExplicitAutograd, m) {
  m.impl("bf16_moe_block_built", &bf16_moe_block_built);
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("bf16_moe_block", &bf16_moe_block); }
