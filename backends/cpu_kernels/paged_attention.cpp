// Decode attention over the paged KV cache on x86 CPUs: one query token per sequence against
// the K/V blocks its table lists, K and V read once (online softmax, block by block), float32
// arithmetic whatever the cache dtype (float32 or bfloat16).
//
//   q            [B, H, D]                     the step's rotated queries
//   k/v_cache    [num_blocks, KVH, bs, D]      head-major blocks (attention.KVCache)
//   block_tables [B, nb] int64                 padded with any block (masked)
//   mask         [B, nb * bs] float32          additive: 0 where attended, -inf elsewhere
//   -> [B, H, D]
//
// Work is split over (sequence, kv head); the query heads of a group share each K/V tile.
// Built by backends/cpu_kernels/build.py with AVX-512 (SWITCHYARD_VNNI) or AVX2 code.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernel_entry_points.h"
#include "simd.h"
#include "work_shares.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using switchyard_work::parallel_shares;

using namespace switchyard_simd;

constexpr int64_t kMaxGroup = 16;      // query heads per kv head
constexpr int64_t kMaxBlockSize = 64;

struct Shape {
  int64_t heads, kv_heads, head_dim, block_size, blocks;  // blocks: table width
  float scale;
};

// Running softmax state of one kv head's query group, updated one block at a time.
struct GroupState {
  float* query;    // [group, D], scaled
  float* acc;      // [group, D]: sum of weight * value
  float* weights;  // [group, bs]: this block's scores, then weights
  float* max;      // [group]
  float* total;    // [group]

  static int64_t floats(int64_t group, int64_t d, int64_t bs) { return group * (2 * d + bs + 2); }

  static GroupState at(float* base, int64_t group, int64_t d, int64_t bs) {
    return {base, base + group * d, base + 2 * group * d, base + group * (2 * d + bs),
            base + group * (2 * d + bs + 1)};
  }
};

// Key o of a block asks for its share of the next tile's lines (null: none) into L2: the lines
// that start within its row. A tile (bs keys of one kv head) is 2-4 KB, often a page of its
// own, and the hardware prefetcher does not cross pages: without this, every tile began with
// misses. The row's size is a constant, so no division runs per key (a line range over bs
// took two 64-bit divisions per key and head, the costliest instructions of the loop).
template <typename T, int NV>
inline void fetch_share(const T* next, int64_t o) {
  if (next == nullptr) return;
  constexpr int64_t kLine = 64, kRow = NV * kWidth * static_cast<int64_t>(sizeof(T));
  const char* base = reinterpret_cast<const char*>(next);
  for (int64_t line = (o * kRow + kLine - 1) / kLine; line * kLine < (o + 1) * kRow; ++line) {
    _mm_prefetch(base + line * kLine, _MM_HINT_T1);
  }
}

// q . k for each attended key of a block and each query head of the group (NV vectors a row).
template <typename T, int NV>
void score_block(const Shape& s, int64_t group, const T* keys, const float* mask,
                 const T* next_keys, GroupState& st) {
  const int64_t bs = s.block_size;
  for (int64_t o = 0; o < bs; ++o) {
    fetch_share<T, NV>(next_keys, o);
    if (mask[o] == kNegInf) {
      for (int64_t g = 0; g < group; ++g) st.weights[g * bs + o] = kNegInf;
      continue;
    }
    Vec key[NV];
    for (int c = 0; c < NV; ++c) key[c] = load(keys + o * NV * kWidth + c * kWidth);
    for (int64_t g = 0; g < group; ++g) {
      const float* query = st.query + g * NV * kWidth;
      Vec even = mul(load(query), key[0]), odd = zero();
      for (int c = 1; c < NV; ++c) {
        if (c % 2) odd = fmadd(load(query + c * kWidth), key[c], odd);
        else even = fmadd(load(query + c * kWidth), key[c], even);
      }
      st.weights[g * bs + o] = sum(add(even, odd)) + mask[o];
    }
  }
}

// Scores -> weights (exp against the new running max; masked keys get 0), rescaling what was
// summed before.
template <int NV>
void softmax_update(const Shape& s, int64_t group, GroupState& st) {
  const int64_t bs = s.block_size;
  for (int64_t g = 0; g < group; ++g) {
    float* w = st.weights + g * bs;
    const float block_max = *std::max_element(w, w + bs);
    const float new_max = std::max(st.max[g], block_max);
    if (new_max == kNegInf) continue;  // nothing attended yet
    const float correction = std::exp(st.max[g] - new_max);  // 0 when max was -inf
    int64_t o = 0;
    Vec block_sum = zero();
    for (; o + kWidth <= bs; o += kWidth) {
      const Vec e = exp_nonpositive(sub(load(w + o), splat(new_max)));
      store(w + o, e);
      block_sum = add(block_sum, e);
    }
    float tail = 0.0f;
    for (; o < bs; ++o) tail += (w[o] = std::exp(w[o] - new_max));
    st.total[g] = std::fma(st.total[g], correction, sum(block_sum)) + tail;  // in any build
    st.max[g] = new_max;
    if (correction != 1.0f) {
      float* acc = st.acc + g * NV * kWidth;
      for (int c = 0; c < NV; ++c) store(acc + c * kWidth, mul(load(acc + c * kWidth), splat(correction)));
    }
  }
}

// acc += weight * value over the block's keys: two independent sums of NV vectors each, so
// consecutive multiply-adds do not wait on one another.
template <typename T, int NV>
void accumulate_values(const Shape& s, int64_t group, const T* values, const T* next_values,
                       GroupState& st) {
  const int64_t bs = s.block_size;
  constexpr int64_t d = NV * kWidth;
  for (int64_t g = 0; g < group; ++g) {
    const float* w = st.weights + g * bs;
    float* acc = st.acc + g * d;
    const T* fetch = g == 0 ? next_values : nullptr;  // the first head's pass spreads it
    Vec even[NV], odd[NV];
    for (int c = 0; c < NV; ++c) even[c] = load(acc + c * kWidth), odd[c] = zero();
    int64_t o = 0;
    for (; o + 1 < bs; o += 2) {
      fetch_share<T, NV>(fetch, o);
      fetch_share<T, NV>(fetch, o + 1);
      const Vec w0 = splat(w[o]), w1 = splat(w[o + 1]);
      for (int c = 0; c < NV; ++c) {
        even[c] = fmadd(w0, load(values + o * d + c * kWidth), even[c]);
        odd[c] = fmadd(w1, load(values + (o + 1) * d + c * kWidth), odd[c]);
      }
    }
    if (o < bs) {
      fetch_share<T, NV>(fetch, o);
      for (int c = 0; c < NV; ++c) even[c] = fmadd(splat(w[o]), load(values + o * d + c * kWidth), even[c]);
    }
    for (int c = 0; c < NV; ++c) store(acc + c * kWidth, add(even[c], odd[c]));
  }
}

template <typename T, int NV>
void start_group(const Shape& s, int64_t group, const T* q, GroupState& st) {
  const int64_t d = NV * kWidth;
  for (int64_t i = 0; i < group * d; ++i) st.query[i] = static_cast<float>(q[i]) * s.scale;
  std::fill(st.acc, st.acc + group * d, 0.0f);
  std::fill(st.max, st.max + group, kNegInf);
  std::fill(st.total, st.total + group, 0.0f);
}

template <typename T, int NV>
void finish_group(int64_t group, const GroupState& st, T* out) {
  const int64_t d = NV * kWidth;
  for (int64_t g = 0; g < group; ++g) {
    const float inverse = st.total[g] > 0.0f ? 1.0f / st.total[g] : 0.0f;
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<T>(st.acc[g * d + i] * inverse);
  }
}

// One sequence, kv heads [first, last): block by block, the heads' tiles of a block in turn,
// so K and V are read in address order within each block.
template <typename T, int NV>
void attend_sequence(const Shape& s, const T* q, const T* k_cache, const T* v_cache,
                     const int64_t* table, const float* mask, int64_t first, int64_t last,
                     T* out) {
  const int64_t group = s.heads / s.kv_heads, d = NV * kWidth, bs = s.block_size;
  const int64_t per_head = GroupState::floats(group, d, bs), tile = bs * d;
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < (last - first) * per_head) {
    buffer.resize((last - first) * per_head);
  }
  auto state = [&](int64_t h) { return GroupState::at(buffer.data() + (h - first) * per_head, group, d, bs); };
  for (int64_t h = first; h < last; ++h) {
    GroupState st = state(h);
    start_group<T, NV>(s, group, q + h * group * d, st);
  }
  for (int64_t j = 0; j < s.blocks; ++j) {
    const float* block_mask = mask + j * bs;
    if (std::all_of(block_mask, block_mask + bs, [](float m) { return m == kNegInf; })) continue;
    const int64_t block = table[j] * s.kv_heads * tile;
    for (int64_t h = first; h < last; ++h) {
      // The tile read next: this block's next head, else the next block's first.
      const int64_t next = h + 1 < last ? block + (h + 1) * tile
          : j + 1 < s.blocks ? table[j + 1] * s.kv_heads * tile + first * tile : -1;
      GroupState st = state(h);
      score_block<T, NV>(s, group, k_cache + block + h * tile, block_mask,
                         next < 0 ? nullptr : k_cache + next, st);
      softmax_update<NV>(s, group, st);
      accumulate_values<T, NV>(s, group, v_cache + block + h * tile,
                               next < 0 ? nullptr : v_cache + next, st);
    }
  }
  for (int64_t h = first; h < last; ++h) finish_group<T, NV>(group, state(h), out + h * group * d);
}

// Kv head h of one sequence over blocks [j0, j1) into `st`, left unnormalised (max, total and
// acc as the online softmax has them) for merge_parts.
template <typename T, int NV>
void attend_part(const Shape& s, const T* q, const T* k_cache, const T* v_cache,
                 const int64_t* table, const float* mask, int64_t h, int64_t j0, int64_t j1,
                 GroupState& st) {
  const int64_t group = s.heads / s.kv_heads, d = NV * kWidth, bs = s.block_size, tile = bs * d;
  start_group<T, NV>(s, group, q + h * group * d, st);
  for (int64_t j = j0; j < j1; ++j) {
    const float* block_mask = mask + j * bs;
    if (std::all_of(block_mask, block_mask + bs, [](float m) { return m == kNegInf; })) continue;
    const int64_t block = table[j] * s.kv_heads * tile + h * tile;
    const int64_t next = j + 1 < j1 ? table[j + 1] * s.kv_heads * tile + h * tile : -1;
    score_block<T, NV>(s, group, k_cache + block, block_mask, next < 0 ? nullptr : k_cache + next,
                       st);
    softmax_update<NV>(s, group, st);
    accumulate_values<T, NV>(s, group, v_cache + block, next < 0 ? nullptr : v_cache + next, st);
  }
}

// The parts of one kv head's query group, each over its own blocks, into one output.
template <typename T, int NV>
void merge_parts(int64_t group, GroupState* parts, int64_t count, T* out) {
  constexpr int64_t d = NV * kWidth;
  for (int64_t g = 0; g < group; ++g) {
    float top = kNegInf;
    for (int64_t p = 0; p < count; ++p) top = std::max(top, parts[p].max[g]);
    float total = 0.0f;
    float acc[d] = {};
    for (int64_t p = 0; p < count; ++p) {
      if (parts[p].max[g] == kNegInf) continue;  // nothing attended in this part
      const float weight = std::exp(parts[p].max[g] - top);
      total += parts[p].total[g] * weight;
      for (int64_t i = 0; i < d; ++i) acc[i] += parts[p].acc[g * d + i] * weight;
    }
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<T>(acc[i] * inverse);
  }
}

// Fewer (sequence, kv head) pairs than two per thread (batch 1 of a model with few kv heads:
// the default model's 3 on 2 threads ran 2:1): each pair's blocks are split into parts too,
// flash-decoding style, and the parts merged after.
template <typename T, int NV>
void run_split(const Shape& s, const T* qp, const T* kp, const T* vp, const int64_t* tp,
               const float* mp, int64_t batch, int64_t parts, T* op) {
  const int64_t group = s.heads / s.kv_heads, d = NV * kWidth, bs = s.block_size;
  const int64_t row = s.heads * s.head_dim, width = s.blocks * bs;
  const int64_t per_part = GroupState::floats(group, d, bs), items = batch * s.kv_heads * parts;
  std::vector<float> buffer(items * per_part);
  std::vector<GroupState> states(items);
  for (int64_t i = 0; i < items; ++i) states[i] = GroupState::at(buffer.data() + i * per_part, group, d, bs);
  parallel_shares(items, [&](int64_t item) {
    const int64_t pair = item / parts, part = item % parts, b = pair / s.kv_heads;
    attend_part<T, NV>(s, qp + b * row, kp, vp, tp + b * s.blocks, mp + b * width,
                       pair % s.kv_heads, part * s.blocks / parts, (part + 1) * s.blocks / parts,
                       states[item]);
  });
  for (int64_t pair = 0; pair < batch * s.kv_heads; ++pair) {
    const int64_t b = pair / s.kv_heads, h = pair % s.kv_heads;
    merge_parts<T, NV>(group, states.data() + pair * parts, parts, op + b * row + h * group * d);
  }
}

template <typename T, int NV>
void run(const Shape& s, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& mask,
         at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const float* mp = mask.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t batch = q.size(0), row = s.heads * s.head_dim, width = s.blocks * s.block_size;
  const int64_t threads = at::get_num_threads(), pairs = batch * s.kv_heads;
  if (threads > 1 && pairs < 2 * threads && s.blocks > 1) {
    const int64_t parts = std::min(s.blocks, (2 * threads + pairs - 1) / pairs);
    run_split<T, NV>(s, qp, kp, vp, tp, mp, batch, parts, op);
    return;
  }
  // Few sequences: split their kv heads too, so every thread has work.
  const int64_t wanted = 4 * threads;
  const int64_t splits = std::min(s.kv_heads, std::max<int64_t>(1, (wanted + batch - 1) / batch));
  parallel_shares(batch * splits, [&](int64_t item) {
    const int64_t b = item / splits, part = item % splits;
    const int64_t first = part * s.kv_heads / splits, last = (part + 1) * s.kv_heads / splits;
    attend_sequence<T, NV>(s, qp + b * row, kp, vp, tp + b * s.blocks, mp + b * width, first,
                           last, op + b * row);
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& tables_in,
                                  const at::Tensor& mask_in, double scale) {
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = tables_in.contiguous();
  const at::Tensor mask = mask_in.contiguous();
  check_query_and_caches("paged_decode_attention", q, k_cache, v_cache);
  TORCH_CHECK(tables.scalar_type() == at::kLong && mask.scalar_type() == at::kFloat,
              "block tables int64, mask float32");
  const Shape s{q.size(1), k_cache.size(1), q.size(2), k_cache.size(2), tables.size(1),
                static_cast<float>(scale)};
  TORCH_CHECK(s.heads % s.kv_heads == 0 && s.heads / s.kv_heads <= kMaxGroup &&
                  s.head_dim == k_cache.size(3) && s.block_size <= kMaxBlockSize,
              "paged_decode_attention: unsupported shape");
  TORCH_CHECK(tables.size(0) == q.size(0) && mask.size(0) == q.size(0) &&
                  mask.size(1) == s.blocks * s.block_size,
              "block tables [B, nb] and mask [B, nb * bs]");
  at::Tensor out = at::empty(q.sizes(), q.options());
  with_dtype_and_head_vectors(q, [&](auto dtype, auto nv) {
    run<typename decltype(dtype)::type, decltype(nv)::value>(s, q, k_cache, v_cache, tables, mask,
                                                              out);
  });
  return out;
}

}  // namespace

at::Tensor switchyard::decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                                        const at::Tensor& mask, double scale) {
  return paged_decode_attention(q, k_cache, v_cache, block_tables, mask, scale);
}

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
