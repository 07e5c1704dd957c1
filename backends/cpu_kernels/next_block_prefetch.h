// Asking for the next block pair's weights while this pair's rows are computed.
//
// bf16_linear and greedy_head pack a weight as blocks of 16 output columns, each k-step of a
// block one 64-byte line, and work a pair of blocks at a time: its row tiles in turn, the first
// reading the pair from memory (asking for its own lines a little ahead), the rest from L2.
// Left alone, memory is read in bursts (the first tile waits on it) and idles through the other
// tiles. So the later row tiles also ask, into L2, for the next pair's lines (the thread's next
// work item unless it steals or its share ends; lines past the weight's end never fault),
// shared out among them and spread over their k-steps. On a 2-core AVX-512-BF16 EPYC, 80
// alternating rounds: W1's 48 layer linears over weights from memory 0.92x the time at 16 rows
// (two tiles), 0.97x at 64; W1's greedy head 0.91x at 16, 0.96x at 64. The first tile asking
// too (the pair shared over all tiles) did no better at 16 rows and worse at 64 (0.98x).
// f32_linear does the same with its own code: on AVX2's 16 registers its prefetch test had to
// be a template argument.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace switchyard_prefetch {

constexpr int64_t kLineBytes = 64;

// One row tile's share of the next pair: `burst` lines every `every` k-steps, `lines` in all.
class LineCursor {
 public:
  LineCursor() = default;
  LineCursor(const char* first, int64_t lines, int64_t every, int64_t burst)
      : line_(first), left_(lines), every_(every), burst_(burst) {}

  // Called at every k-step of the tile's loop, in order from 0. Inlined by force: the
  // kernels' tiles are past GCC's inlining budget, and a call in their loop (through the PLT,
  // as -fPIC makes it) spilled the accumulators at every k-step.
  [[gnu::always_inline]] inline void step(int64_t k) {
    if (left_ > 0 && k == due_) {
      for (int64_t i = 0; i < std::min(burst_, left_); ++i) {
        _mm_prefetch(line_ + i * kLineBytes, _MM_HINT_T1);
      }
      line_ += burst_ * kLineBytes;
      due_ += every_;
      left_ -= burst_;
    }
  }

 private:
  const char* line_ = nullptr;
  int64_t left_ = 0, due_ = 0, every_ = 1, burst_ = 1;
};

// The next pair's lines dealt over row tiles 1 .. tiles - 1 of this pair.
class NextPairLines {
 public:
  // `next`: the next pair's first line (null: none); it holds `lines` lines; a tile runs
  // `steps` k-steps.
  NextPairLines(const void* next, int64_t lines, int64_t steps, int64_t tiles)
      : next_(tiles > 1 ? static_cast<const char*>(next) : nullptr), lines_(lines),
        per_tile_(tiles > 1 ? (lines + tiles - 2) / (tiles - 1) : 0),
        burst_(std::max<int64_t>(1, (per_tile_ + steps - 1) / std::max<int64_t>(steps, 1))),
        every_(per_tile_ > 0 ? std::max<int64_t>(1, steps * burst_ / per_tile_) : 1) {}

  LineCursor tile(int64_t t) const {
    if (next_ == nullptr || t == 0) return {};
    const int64_t first = (t - 1) * per_tile_;
    return {next_ + first * kLineBytes, std::clamp<int64_t>(lines_ - first, 0, per_tile_),
            every_, burst_};
  }

 private:
  const char* next_;
  int64_t lines_, per_tile_, burst_, every_;
};

}  // namespace switchyard_prefetch
