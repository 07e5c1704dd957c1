// Greedy decoding's lm_head: each row's argmax of the bf16 logits `bf16_linear` would give,
// bit for bit, without computing all of them. An int8 pass (`vpdpbusd`, twice `vdpbf16ps`'s
// multiply-adds a cycle) gives every logit to within a bound; only the tokens whose upper
// bound reaches the row's best lower bound (a few dozen of 32k on a random model) are then
// computed as `bf16_linear` does: the same `vdpbf16ps` chain over the k-pairs in order from
// zero, rounded to bf16 once, from a row-major copy of the weight.
//
// The bound, per row r and token v: x = s_x q_x + e (int8 rows, scale s_x), W_v = s_v q_v + R_v
// (int8 rows, scale s_v), so W_v . x - s_x s_v q_v . q_x = W_v . e + R_v . (s_x q_x), at most
// |W_v| |e| + |R_v| |s_x q_x| (Cauchy-Schwarz; x's norms computed in double, W's at packing,
// greedy_head.py, all rounded up), plus the float32 sums' rounding (K roundings of 2^-24 each at most, counted twice
// over: (K + 8) 2^-22 |W_v| |x|) and the bf16 rounding of the result (2^-8 of it). The token
// `bf16_linear` would pick has its upper bound at or above every token's lower bound, so it
// is a candidate, as is every token tied with it (the lowest index wins, as torch.argmax).
//
//   greedy_head_argmax(x [M, K] bf16, packed [Vp / 16, K / 4, 16, 4] int8,
//                      stats [4, Vp] float32 (scale, 128 * row sum, |W_v|, |R_v|),
//                      rows [V, K] bf16) -> [M] int64
//
// A row answers -1 where its x is not finite or all (nearly) zero, or where more than
// kMaxCandidates tokens stay in the running: the caller computes that step's logits in full.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "work_shares.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kColumns = 16;
constexpr int kRowTile = 8;
constexpr int64_t kMaxCandidates = 4096;
constexpr int64_t kPrefetchQuads = 64;

bool greedy_head_built() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512BF16__

struct InputRow {
  float scale, e_norm, q_norm, x_norm;
  bool usable;
};

struct Candidate {
  int32_t token;
  float upper;
};

// One thread's running best lower bound and candidates, per input row.
struct ThreadState {
  std::vector<float> best_lower;
  std::vector<std::vector<Candidate>> candidates;
};

struct Problem {
  const uint8_t* xq;        // [M, K] x / s_x + 128
  const InputRow* inputs;   // [M]
  const int8_t* packed;     // [Vp / 16, K / 4, 16, 4]
  const float* scale;       // [Vp] s_v
  const float* offset;      // [Vp] 128 * sum(q_v): the +128 of xq taken back (an integer)
  const float* w_norm;      // [Vp]
  const float* r_norm;      // [Vp]
  int64_t m, k, vocab, padded;
  float rounding;           // the float32 sums' rounding, per |W_v| |x|
};

float rounded_up(double value) { return static_cast<float>(value) * (1.0f + 1e-6f); }

// xq and the row's norms; `usable` false for a non-finite or all-zero (or all-tiny) row.
InputRow quantize_row(const uint16_t* x, int64_t k, uint8_t* xq) {
  double amax = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    const float v = c10::detail::f32_from_bits(x[i]);
    if (!std::isfinite(v)) return {1.0f, 0.0f, 0.0f, 0.0f, false};
    amax = std::max(amax, static_cast<double>(std::fabs(v)));
  }
  // Below this (all zero, or subnormal) s_x would not be a normal float: not worth bounding.
  if (amax < 1e-30) return {1.0f, 0.0f, 0.0f, 0.0f, false};
  const float scale = static_cast<float>(amax / 127.0);
  double e2 = 0.0, q2 = 0.0, x2 = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    const float v = c10::detail::f32_from_bits(x[i]);
    const float q = std::clamp(std::nearbyint(v / scale), -127.0f, 127.0f);
    xq[i] = static_cast<uint8_t>(static_cast<int>(q) + 128);
    const double kept = static_cast<double>(scale) * q;
    e2 += (v - kept) * (v - kept);
    q2 += kept * kept;
    x2 += static_cast<double>(v) * v;
  }
  return {scale, rounded_up(std::sqrt(e2)), rounded_up(std::sqrt(q2)), rounded_up(std::sqrt(x2)),
          true};
}

// The tokens of 16 columns whose upper bound reaches the row's running best lower bound. Most
// columns fall short of it on their upper bounds, and then none of their lower bounds can
// raise it: only the rest take the horizontal max.
inline __attribute__((always_inline)) void keep_candidates(
    const Problem& p, const InputRow& in, int64_t column, __m512 approx, float& best_lower,
    std::vector<Candidate>& kept) {
  const int64_t valid = std::min<int64_t>(kColumns, p.vocab - column);
  if (valid <= 0) return;
  const __m512 magnitude = _mm512_abs_ps(approx);
  const __m512 w_norm = _mm512_loadu_ps(p.w_norm + column);
  const __m512 r_norm = _mm512_loadu_ps(p.r_norm + column);
  __m512 bound = _mm512_fmadd_ps(
      w_norm, _mm512_set1_ps(in.e_norm + p.rounding * in.x_norm),
      _mm512_fmadd_ps(r_norm, _mm512_set1_ps(in.q_norm),
                      _mm512_fmadd_ps(magnitude, _mm512_set1_ps(1e-6f), _mm512_set1_ps(1e-30f))));
  bound = _mm512_fmadd_ps(_mm512_add_ps(magnitude, bound), _mm512_set1_ps(0.00390625f), bound);
  const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1u);
  const __m512 upper = _mm512_add_ps(approx, bound);
  if (!_mm512_mask_cmp_ps_mask(lanes, upper, _mm512_set1_ps(best_lower), _CMP_GE_OQ)) return;
  best_lower =
      std::max(best_lower, _mm512_mask_reduce_max_ps(lanes, _mm512_sub_ps(approx, bound)));
  __mmask16 in_running =
      _mm512_mask_cmp_ps_mask(lanes, upper, _mm512_set1_ps(best_lower), _CMP_GE_OQ);
  alignas(64) float uppers[kColumns];
  _mm512_store_ps(uppers, upper);
  while (in_running) {
    const int lane = __builtin_ctz(in_running);
    in_running &= in_running - 1;
    kept.push_back({static_cast<int32_t>(column + lane), uppers[lane]});
  }
}

// Rows [row, row + Rows) x blocks [block, block + Blocks): int8 sums, then bounds.
template <int Rows, int Blocks>
void tile(const Problem& p, int64_t row, int64_t block, bool prefetch, ThreadState& state) {
  __m512i acc[Rows][Blocks];
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_si512();
  const int64_t quads = p.k / 4, block_stride = quads * 4 * kColumns;
  const int32_t* x = reinterpret_cast<const int32_t*>(p.xq + row * p.k);
  const int8_t* w = p.packed + block * block_stride;
  for (int64_t q = 0; q < quads; ++q) {
    __m512i weights[Blocks];
    for (int b = 0; b < Blocks; ++b)
      weights[b] = _mm512_loadu_si512(w + b * block_stride + q * 4 * kColumns);
    if (prefetch) {
      for (int b = 0; b < Blocks; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(
                         w + b * block_stride + (q + kPrefetchQuads) * 4 * kColumns),
                     _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const __m512i quad = _mm512_set1_epi32(x[r * quads + q]);
      for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], quad, weights[b]);
    }
  }
  for (int b = 0; b < Blocks; ++b) {
    const int64_t column = (block + b) * kColumns;
    const __m512 scale = _mm512_loadu_ps(p.scale + column);
    const __m512i offset = _mm512_cvtps_epi32(_mm512_loadu_ps(p.offset + column));  // exact
    for (int r = 0; r < Rows; ++r) {
      const InputRow& in = p.inputs[row + r];
      if (!in.usable) continue;
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][b], offset));
      const __m512 approx = _mm512_mul_ps(_mm512_mul_ps(sums, scale), _mm512_set1_ps(in.scale));
      keep_candidates(p, in, column, approx, state.best_lower[row + r],
                      state.candidates[row + r]);
    }
  }
}

template <int Blocks>
void rows_remainder(const Problem& p, int64_t row, int64_t block, int64_t count, bool prefetch,
                    ThreadState& state) {
  switch (count) {
    case 1: return tile<1, Blocks>(p, row, block, prefetch, state);
    case 2: return tile<2, Blocks>(p, row, block, prefetch, state);
    case 3: return tile<3, Blocks>(p, row, block, prefetch, state);
    case 4: return tile<4, Blocks>(p, row, block, prefetch, state);
    case 5: return tile<5, Blocks>(p, row, block, prefetch, state);
    case 6: return tile<6, Blocks>(p, row, block, prefetch, state);
    case 7: return tile<7, Blocks>(p, row, block, prefetch, state);
    default: return;
  }
}

template <int Blocks>
void block_rows(const Problem& p, int64_t block, ThreadState& state) {
  int64_t row = 0;
  for (; row + kRowTile <= p.m; row += kRowTile) {
    tile<kRowTile, Blocks>(p, row, block, row == 0, state);
  }
  rows_remainder<Blocks>(p, row, block, p.m - row, row == 0, state);
}

// Every thread's candidates, found over pairs of blocks dealt as work shares.
std::vector<ThreadState> bounded_pass(const Problem& p) {
  const int64_t blocks = p.padded / kColumns, pairs = (blocks + 1) / 2;
  const int64_t threads = std::clamp<int64_t>(at::get_num_threads(), 1,
                                              switchyard_work::WorkShares::kMaxThreads);
  std::vector<ThreadState> states(threads);
  for (auto& s : states) {
    s.best_lower.assign(p.m, -std::numeric_limits<float>::infinity());
    s.candidates.resize(p.m);
  }
  switchyard_work::WorkShares shares(pairs, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t pair = shares.next(t); pair >= 0; pair = shares.next(t)) {
        if (2 * pair + 1 < blocks) block_rows<2>(p, 2 * pair, states[t]);
        else block_rows<1>(p, 2 * pair, states[t]);
      }
    }
  });
  return states;
}

// The bf16 logits of up to 16 tokens of one row, as bf16_linear computes them.
__m512 exact_logits(const int32_t* x_pairs, const int32_t* rows, int64_t pairs,
                    const int32_t* tokens, int count) {
  alignas(64) int32_t offsets[kColumns];
  for (int j = 0; j < kColumns; ++j)
    offsets[j] = static_cast<int32_t>(tokens[std::min(j, count - 1)] * pairs);
  const __m512i index = _mm512_load_si512(offsets);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    const __m512i weights = _mm512_i32gather_epi32(index, rows + k, 4);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(x_pairs[k]), (__m512bh)weights);
  }
  const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(acc);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
}

// Row r's token: the candidates left by every thread, then the exact logits of the few whose
// upper bound reaches the best lower bound over all threads; -1 where it cannot say.
int64_t pick(const Problem& p, const std::vector<ThreadState>& states, int64_t r,
             const int32_t* x_pairs, const int32_t* rows) {
  if (!p.inputs[r].usable) return -1;
  float best_lower = -std::numeric_limits<float>::infinity();
  for (const auto& s : states) best_lower = std::max(best_lower, s.best_lower[r]);
  std::vector<int32_t> tokens;
  for (const auto& s : states)
    for (const Candidate& c : s.candidates[r])
      if (c.upper >= best_lower) tokens.push_back(c.token);
  if (tokens.empty() || static_cast<int64_t>(tokens.size()) > kMaxCandidates) return -1;
  std::sort(tokens.begin(), tokens.end());
  float best = -std::numeric_limits<float>::infinity();
  int64_t chosen = -1;
  alignas(64) float values[kColumns];
  for (size_t first = 0; first < tokens.size(); first += kColumns) {
    const int count = static_cast<int>(std::min<size_t>(kColumns, tokens.size() - first));
    _mm512_store_ps(values, exact_logits(x_pairs, rows, p.k / 2, tokens.data() + first, count));
    for (int j = 0; j < count; ++j) {
      if (std::isnan(values[j])) return -1;
      if (chosen < 0 || values[j] > best) best = values[j], chosen = tokens[first + j];
    }
  }
  return chosen;
}

#endif

at::Tensor greedy_head_argmax(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& stats, const at::Tensor& rows) {
  TORCH_CHECK(greedy_head_built(),
              "greedy_head_argmax: this build has no AVX-512-BF16 code (the CPU lacks it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "greedy_head_argmax: x must be contiguous bfloat16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 4 == 0, "greedy_head_argmax: K must be a multiple of 4, got ", k);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(1) * 4 == k && packed.size(2) == kColumns && packed.size(3) == 4,
              "greedy_head_argmax: packed must be contiguous int8 [Vp / 16, K / 4, 16, 4]");
  const int64_t padded = packed.size(0) * kColumns;
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.is_contiguous() && stats.dim() == 2 &&
                  stats.size(0) == 4 && stats.size(1) == padded,
              "greedy_head_argmax: stats must be contiguous float32 [4, ", padded, "]");
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16 && rows.is_contiguous() && rows.dim() == 2 &&
                  rows.size(1) == k && rows.size(0) <= padded &&
                  rows.size(0) * (k / 2) < std::numeric_limits<int32_t>::max(),
              "greedy_head_argmax: rows must be contiguous bfloat16 [V, K], V <= ", padded);
  at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
#ifdef __AVX512BF16__
  if (m == 0) return out;
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
  std::vector<uint8_t> xq(m * k);
  std::vector<InputRow> inputs(m);
  switchyard_work::parallel_shares(
      m, [&](int64_t r) { inputs[r] = quantize_row(xs + r * k, k, xq.data() + r * k); });
  const float* s = stats.const_data_ptr<float>();
  const Problem p{xq.data(), inputs.data(), packed.const_data_ptr<int8_t>(), s, s + padded,
                  s + 2 * padded, s + 3 * padded, m, k, rows.size(0), padded,
                  std::ldexp(static_cast<float>(k + 8), -22)};
  const std::vector<ThreadState> states = bounded_pass(p);
  const int32_t* weight_pairs =
      reinterpret_cast<const int32_t*>(rows.const_data_ptr<c10::BFloat16>());
  int64_t* chosen = out.mutable_data_ptr<int64_t>();
  switchyard_work::parallel_shares(m, [&](int64_t r) {
    chosen[r] = pick(p, states, r, reinterpret_cast<const int32_t*>(xs + r * k), weight_pairs);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("greedy_head_built() -> bool");
  m.def("greedy_head_argmax(Tensor x, Tensor packed, Tensor stats, Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CompositeExplicitAutograd, m) {
  m.impl("greedy_head_built", &greedy_head_built);
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("greedy_head_argmax", &greedy_head_argmax);
}
