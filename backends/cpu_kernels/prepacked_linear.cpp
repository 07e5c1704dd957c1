// The prepacked dense linear (backends/native/cpu_linear.py) as a C++ operator: the same
// oneDNN call (`mkldnn::_linear_pointwise` on a weight reordered once at load, rows padded to
// `row_bucket`), without the ~30 us a call that a Python custom op costs (49 calls a step for
// a 12-layer model).
//
//   keep_packed_weight(Tensor packed) -> int     registers a reordered weight: its handle
//   prepacked_linear(Tensor x, Tensor handle, int out_features, Tensor? bias) -> Tensor

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr int64_t kExactRows = 16;  // cpu_linear.EXACT_ROWS

std::mutex weights_mutex;
std::deque<at::Tensor> weights;  // handle -> oneDNN tensor, for the process's life

int64_t keep_packed_weight(const at::Tensor& packed) {
  std::lock_guard<std::mutex> lock(weights_mutex);
  weights.push_back(packed);
  return static_cast<int64_t>(weights.size()) - 1;
}

at::Tensor packed_weight(const at::Tensor& handle) {
  TORCH_CHECK(handle.scalar_type() == at::kLong && handle.numel() == 1,
              "prepacked_linear: the handle is one int64");
  const int64_t index = *handle.const_data_ptr<int64_t>();  // item() would dispatch
  std::lock_guard<std::mutex> lock(weights_mutex);
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(weights.size()),
              "prepacked_linear: no packed weight ", index);
  return weights[index];
}

// cpu_linear.row_bucket: exact up to 16 rows, then 8 evenly spaced counts per power of two.
int64_t row_bucket(int64_t rows) {
  if (rows <= kExactRows) return rows;
  int bits = 0;
  for (int64_t r = rows; r > 0; r >>= 1) ++bits;
  const int64_t step = int64_t{1} << (bits - 4);
  return (rows + step - 1) / step * step;
}

at::Tensor prepacked_linear(const at::Tensor& x, const at::Tensor& handle, int64_t out_features,
                            const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle onednn =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  at::Tensor rows = x.reshape({-1, x.size(-1)});
  const int64_t count = rows.size(0), padded = row_bucket(count);
  if (padded != count) rows = at::cat({rows, at::zeros({padded - count, rows.size(1)}, rows.options())});
  torch::jit::Stack stack{rows, packed_weight(handle), bias, std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::string("")};
  onednn.callBoxed(&stack);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return stack[0].toTensor().narrow(0, 0, count).reshape(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("keep_packed_weight(Tensor packed) -> int");
  m.def("prepacked_linear(Tensor x, Tensor handle, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CompositeExplicitAutograd, m) {
  m.impl("keep_packed_weight", &keep_packed_weight);
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("prepacked_linear", &prepacked_linear); }
