// Prefill's product for packed weights: the weight dequantized a slice of lane blocks (16
// output columns each) at a time into a buffer that stays in cache, each slice's columns of the
// output by torch's matmul (oneDNN). The whole weight dense per call took 2.2x as long at 128
// rows (a Q8_0 17920 x 1536: written to and read back from memory, a fresh allocation faulted
// in each call); 4 MB slices slowed oneDNN down (16 MB: within 10% of the dense matmul alone
// from 512 rows, AMX Xeon).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace switchyard_slices {

constexpr int64_t kSliceBytes = int64_t{16} << 20;

// How a slice of `count` output columns comes out of the dequantizer: [K, count] (lane-block
// layouts write a packed line's columns as rows) or [count, K] (a weight row at a time).
enum class Layout { kKN, kNK };

// x [M, K] float32 | bfloat16 times a weight of n output columns (+ bias [n] in x's dtype,
// added before the product rounds), where dequantize(first, count, out) writes columns
// [first, first + count) (multiples of `unit`) into `out` (float* or c10::BFloat16*, x's
// dtype) in `layout`.
template <Layout layout, typename Dequantize>
at::Tensor dense_mm(const at::Tensor& x, int64_t n, int64_t unit, Dequantize&& dequantize,
                    const std::optional<at::Tensor>& bias = std::nullopt) {
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t fits = std::max<int64_t>(1, kSliceBytes / (unit * k * x.element_size())) * unit;
  const int64_t slice = std::min(n, fits);
  thread_local at::Tensor buffer;  // kept: a fresh one would be faulted in every call
  if (!buffer.defined() || buffer.scalar_type() != x.scalar_type() || buffer.numel() < slice * k)
    buffer = at::empty({slice * k}, x.options());
  at::Tensor out = at::empty({m, n}, x.options());
  for (int64_t first = 0; first < n; first += slice) {
    const int64_t count = std::min(slice, n - first);
    at::Tensor w = buffer.narrow(0, 0, count * k);
    if (x.scalar_type() == at::kFloat)
      dequantize(first, count, w.mutable_data_ptr<float>());
    else
      dequantize(first, count, w.mutable_data_ptr<c10::BFloat16>());
    const at::Tensor slice_w = layout == Layout::kKN ? w.view({k, count}) : w.view({count, k}).t();
    out.narrow(1, first, count)
        .copy_(bias.has_value() ? at::addmm(bias->narrow(0, first, count), x, slice_w)
                                : at::mm(x, slice_w));
  }
  return out;
}

}  // namespace switchyard_slices
