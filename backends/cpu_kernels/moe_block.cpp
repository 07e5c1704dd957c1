// A mixture-of-experts block's experts (models/moe.py) in one call, each a SwiGLU MLP whose
// linears run our bf16 kernel (bf16_linear.cpp): for each expert with tokens,
//
//   out[rows] = bf16_linear(bf16_silu_mul_linear(grouped[rows], gate_up), down)
//
// through the same C++ entry point the two operators run (switchyard::bf16_matmul), so the
// results are theirs bit for bit. From Python the loop cost two dispatcher calls, module calls,
// slices and a cat an expert: at one token (8 experts) ~0.7 ms a layer on top of the kernels'.
//
//   bf16_moe_experts_built() -> bool    whether this build has the code (AVX-512-BF16)
//   bf16_moe_experts(grouped [A, H], counts [E'], gate_up [E'], down [E']) -> [A, H]   bf16
//
// `grouped`: the routed rows gathered and grouped by expert, in the order of `counts` (the rows
// of each expert with any); gate_up[i] / down[i]: that expert's weights as PrepackedLinear
// holds them (gate_up packed for silu_mul).
//
// build.py compiles this file with -mavx512bf16 where the CPU has it (as bf16_linear.cpp);
// elsewhere the operator exists and refuses to run.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "kernel_entry_points.h"

namespace {

bool bf16_moe_experts_built() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

void check_inputs(const at::Tensor& grouped, at::IntArrayRef counts, at::TensorList gate_up,
                  at::TensorList down) {
  TORCH_CHECK(grouped.dim() == 2 && grouped.scalar_type() == at::kBFloat16 &&
                  grouped.is_contiguous(),
              "bf16_moe_experts: grouped must be contiguous bfloat16 [A, H]");
  TORCH_CHECK(gate_up.size() == counts.size() && down.size() == counts.size(),
              "bf16_moe_experts: ", counts.size(), " counts, ", gate_up.size(), " gate_up and ",
              down.size(), " down weights");
  int64_t total = 0;
  for (const int64_t count : counts) {
    TORCH_CHECK(count > 0, "bf16_moe_experts: counts must be positive (experts with rows)");
    total += count;
  }
  TORCH_CHECK(total == grouped.size(0), "bf16_moe_experts: counts sum to ", total,
              ", grouped has ", grouped.size(0), " rows");
  for (const at::Tensor& w : down) {  // bf16_matmul checks the rest of each weight
    TORCH_CHECK(w.dim() == 4 && w.size(0) * w.size(2) == grouped.size(1),
                "bf16_moe_experts: each down projection must have ", grouped.size(1),
                " outputs");
  }
}

at::Tensor bf16_moe_experts(const at::Tensor& grouped, at::IntArrayRef counts,
                            at::TensorList gate_up, at::TensorList down) {
  TORCH_CHECK(bf16_moe_experts_built(),
              "bf16_moe_experts: this build has no AVX-512-BF16 code (the CPU lacks it)");
  check_inputs(grouped, counts, gate_up, down);
  at::Tensor out = at::empty(grouped.sizes(), grouped.options());
  const int64_t row_bytes = grouped.size(1) * static_cast<int64_t>(sizeof(c10::BFloat16));
  auto* target = reinterpret_cast<char*>(out.mutable_data_ptr<c10::BFloat16>());
  int64_t start = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const at::Tensor rows = grouped.narrow(0, start, counts[i]);
    const at::Tensor act = switchyard::bf16_matmul(rows, gate_up[i], true);
    const at::Tensor y = switchyard::bf16_matmul(act, down[i], false);
    std::memcpy(target + start * row_bytes, y.const_data_ptr<c10::BFloat16>(),
                counts[i] * row_bytes);
    start += counts[i];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("bf16_moe_experts_built() -> bool");
  m.def("bf16_moe_experts(Tensor grouped, int[] counts, Tensor[] gate_up, Tensor[] down) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CompositeExplicitAutograd, m) {
  m.impl("bf16_moe_experts_built", &bf16_moe_experts_built);
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("bf16_moe_experts", &bf16_moe_experts); }
