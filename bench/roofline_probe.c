/* What this CPU can do at most, for bench/roofline.py: multiply-add peaks and a read stream.
 *
 *   roofline_probe fma32|bf16dot|stream   (threads: OMP_NUM_THREADS)
 *
 * Prints one number: GFLOP/s (fma32: float32 FMA; bf16dot: AVX-512-BF16 vdpbf16ps, 2 products
 * a lane) or GB/s (stream: a parallel sum over 1 GiB). Twelve independent accumulators keep
 * the multiply-add units busy whatever their latency. Built with -O3 -march=native. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHAINS 12
static const long ITERS = 100000000 / CHAINS;

#ifdef __AVX512F__
typedef __m512 vec;
#define WIDTH 16
#define SPLAT _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define LOAD _mm512_loadu_ps
static float lanes_sum(vec v) { return _mm512_reduce_add_ps(v); }
#else
typedef __m256 vec;
#define WIDTH 8
#define SPLAT _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define LOAD _mm256_loadu_ps
static float lanes_sum(vec v) {
  float out[8];
  _mm256_storeu_ps(out, v);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}
#endif

static double fma32(float *sink) {
  double start = omp_get_wtime();
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    vec acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = SPLAT(i * 1e-9f);
    const vec x = SPLAT(0.999f), y = SPLAT(1e-7f);
    for (long n = 0; n < ITERS; ++n)
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS; ++i) acc[i] = FMA(acc[i], x, y);
    for (int i = 0; i < CHAINS; ++i) total += lanes_sum(acc[i]);
  }
  *sink = total;
  return omp_get_max_threads() * (double)ITERS * CHAINS * WIDTH * 2 / (omp_get_wtime() - start) / 1e9;
}

static double bf16dot(float *sink) {
#ifdef __AVX512BF16__
  double start = omp_get_wtime();
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    __m512 acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_set1_ps(i * 1e-9f);
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3c00);
    for (long n = 0; n < ITERS; ++n)
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
    for (int i = 0; i < CHAINS; ++i) total += _mm512_reduce_add_ps(acc[i]);
  }
  *sink = total;
  return omp_get_max_threads() * (double)ITERS * CHAINS * 64 / (omp_get_wtime() - start) / 1e9;
#else
  *sink = 0;
  return 0.0; /* no AVX-512-BF16 on this CPU */
#endif
}

static double stream(float *sink) {
  const long count = (1L << 30) / sizeof(float);
  float *data = aligned_alloc(64, count * sizeof(float));
  if (!data) return 0.0;
#pragma omp parallel for schedule(static)
  for (long i = 0; i < count; ++i) data[i] = 1.0f; /* first touch on the reading thread */
  double best = 0;
  for (int round = 0; round < 3; ++round) {
    double start = omp_get_wtime();
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
      vec acc[4] = {SPLAT(0), SPLAT(0), SPLAT(0), SPLAT(0)};
#pragma omp for schedule(static)
      for (long i = 0; i < count; i += 4 * WIDTH)
        for (int j = 0; j < 4; ++j) acc[j] = ADD(acc[j], LOAD(data + i + j * WIDTH));
      total += lanes_sum(ADD(ADD(acc[0], acc[1]), ADD(acc[2], acc[3])));
    }
    *sink += total;
    double rate = count * sizeof(float) / (omp_get_wtime() - start) / 1e9;
    if (rate > best) best = rate;
  }
  free(data);
  return best;
}

int main(int argc, char **argv) {
  float sink = 0;
  if (argc != 2) return 2;
  double value = !strcmp(argv[1], "fma32") ? fma32(&sink)
               : !strcmp(argv[1], "bf16dot") ? bf16dot(&sink)
               : !strcmp(argv[1], "stream") ? stream(&sink) : -1.0;
  if (value < 0) return 2;
  printf("%.1f\n", value + 0 * sink);
  return 0;
}
