// How our kernels deal a call's work items to the OpenMP threads. Each thread owns a
// contiguous share of the items and works through it from the front; once done, it takes
// items from the back of the share with the most left. A thread that loses its core for a
// while (the server's event loop writing a step's tokens, the load client, another tenant of
// the machine) so leaves the rest of its share to the others instead of holding up the call,
// where at::parallel_for's fixed ranges made every call as slow as its slowest thread; work
// that grows with the item (causal prompt tiles) evens out the same way. Without such a loss
// each thread keeps to its own share, in address order: one counter dealing items in turn
// broke the weights' streams (3% slower at 512 rows).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace switchyard_work {

class WorkShares {
 public:
  static constexpr int64_t kMaxThreads = 64;

  WorkShares(int64_t count, int64_t threads) : threads_(threads) {
    for (int64_t t = 0; t < threads; ++t) {
      shares_[t].range.store(pack(count * t / threads, count * (t + 1) / threads));
    }
  }

  // The next item for thread t, or -1 when none is left anywhere.
  int64_t next(int64_t t) {
    const int64_t own = take(shares_[t], true);
    if (own >= 0) return own;
    for (;;) {
      int64_t victim = -1, most = 0;
      for (int64_t v = 0; v < threads_; ++v) {
        const uint64_t r = shares_[v].range.load(std::memory_order_relaxed);
        const int64_t left = static_cast<int64_t>(back(r)) - static_cast<int64_t>(front(r));
        if (left > most) most = left, victim = v;
      }
      if (victim < 0) return -1;
      const int64_t stolen = take(shares_[victim], false);
      if (stolen >= 0) return stolen;
    }
  }

 private:
  struct alignas(64) Share {  // a cache line each: the owner's updates stay its own
    std::atomic<uint64_t> range{0};  // items [front, back): front in the low 32 bits
  };

  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }
  static int64_t front(uint64_t range) { return static_cast<uint32_t>(range); }
  static int64_t back(uint64_t range) { return static_cast<uint32_t>(range >> 32); }

  // The item at the front of a share (its owner) or at its back (a thief), or -1 if empty.
  static int64_t take(Share& share, bool from_front) {
    uint64_t r = share.range.load(std::memory_order_relaxed);
    while (front(r) < back(r)) {
      const int64_t item = from_front ? front(r) : back(r) - 1;
      const uint64_t rest = from_front ? pack(item + 1, back(r)) : pack(front(r), item);
      if (share.range.compare_exchange_weak(r, rest, std::memory_order_relaxed)) return item;
    }
    return -1;
  }

  int64_t threads_;
  Share shares_[kMaxThreads];
};

// f(item) for every item in [0, count), on the intra-op threads, dealt as above.
template <typename F>
void parallel_shares(int64_t count, F&& f) {
  const int64_t threads = std::min<int64_t>(
      {static_cast<int64_t>(at::get_num_threads()), count, WorkShares::kMaxThreads});
  if (threads <= 1) {
    for (int64_t item = 0; item < count; ++item) f(item);
    return;
  }
  WorkShares shares(count, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t item = shares.next(t); item >= 0; item = shares.next(t)) f(item);
    }
  });
}

}  // namespace switchyard_work
