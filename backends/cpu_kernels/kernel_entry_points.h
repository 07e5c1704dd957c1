// Our operators' C++ entry points, for kernels that chain them without the dispatcher
// (decode_layers.cpp, bf16_decode_layers.cpp, moe_block.cpp): the same functions the operators
// run.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace switchyard {

// int8_dot.cpp's switchyard_cpu::q4_mm.
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zero,
                     int64_t group_size, bool fine);

// kquant_dot.cpp's switchyard_cpu::kquant_mm (GGUF blocks as stored; type: ggml's id).
at::Tensor kquant_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                         int64_t in_features);

// bf16_linear.cpp's switchyard_cpu::bf16_linear (no bias) and, with silu_mul,
// switchyard_cpu::bf16_silu_mul_linear.
at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& packed, bool silu_mul);

// paged_attention.cpp's switchyard_cpu::paged_decode_attention.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& mask, double scale);

}  // namespace switchyard
