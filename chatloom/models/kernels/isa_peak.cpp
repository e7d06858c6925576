// This CPU's peak arithmetic rate per instruction set, measured: many independent chains of
// one multiply-add instruction, on every intra-op thread at once. `bench roofline` sets the
// matmul kernels' GFLOP/s against these (an operation is a multiply or an add, so one fused
// multiply-add of 8 float32 lanes is 16).
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <atomic>
#include <chrono>
#include <string>

namespace {

constexpr int kChains = 12;  // independent accumulators: enough to cover the instruction's latency

// Runs `iters` rounds of kChains independent `op`s (acc[c] = op), with the operands a and b
// hidden from the optimizer each round so that nothing is hoisted or folded; returns one lane
// of the summed accumulators so the work cannot be dropped. (Macros, not lambdas: a lambda
// would not inherit the function's target instruction set.)
#define CHATLOOM_PEAK_LOOP(type, zero, op, add, first)                    \
  type acc[kChains];                                                       \
  for (int c = 0; c < kChains; ++c) acc[c] = zero;                         \
  for (int64_t i = 0; i < iters; ++i) {                                    \
    __asm__ volatile("" : "+x"(a), "+x"(b));                               \
    _Pragma("GCC unroll 12") for (int c = 0; c < kChains; ++c) acc[c] = op; \
  }                                                                        \
  type total = acc[0];                                                     \
  for (int c = 1; c < kChains; ++c) total = add(total, acc[c]);           \
  return (double)first(total);

__attribute__((target("avx2,fma"))) double fma_avx2(int64_t iters, float seed) {
  __m256 a = _mm256_set1_ps(seed), b = _mm256_set1_ps(0.999f);
  CHATLOOM_PEAK_LOOP(__m256, _mm256_setzero_ps(), _mm256_fmadd_ps(acc[c], b, a), _mm256_add_ps, _mm256_cvtss_f32)
}

__attribute__((target("avx512f"))) double fma_avx512(int64_t iters, float seed) {
  __m512 a = _mm512_set1_ps(seed), b = _mm512_set1_ps(0.999f);
  CHATLOOM_PEAK_LOOP(__m512, _mm512_setzero_ps(), _mm512_fmadd_ps(acc[c], b, a), _mm512_add_ps, _mm512_cvtss_f32)
}

__attribute__((target("avx2"))) double int8_avx2(int64_t iters, float seed) {
  // The AVX2 int8 matmul's inner step: vpmaddubsw into int16, then vpaddw.
  __m256i a = _mm256_set1_epi8((char)(int)seed), b = _mm256_set1_epi8(3);
  // Each chain multiplies its own accumulator, or the compiler would compute one shared product.
  (void)b;
  CHATLOOM_PEAK_LOOP(__m256i, _mm256_setzero_si256(), _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(a, acc[c])),
                     _mm256_add_epi16, _mm256_cvtsi256_si32)
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double int8_vnni(int64_t iters, float seed) {
  __m512i a = _mm512_set1_epi8((char)(int)seed), b = _mm512_set1_epi8(3);
  CHATLOOM_PEAK_LOOP(__m512i, _mm512_setzero_si512(), _mm512_dpbusd_epi32(acc[c], a, b), _mm512_add_epi32,
                     _mm512_cvtsi512_si32)
}

__attribute__((target("avx512f,avx512bf16"))) double bf16_avx512(int64_t iters, float seed) {
  __m512 a = _mm512_set1_ps(seed), b = _mm512_set1_ps(0.5f);  // reinterpreted as 32 bf16 pairs each
  CHATLOOM_PEAK_LOOP(__m512, _mm512_setzero_ps(),
                     _mm512_dpbf16_ps(acc[c], (__m512bh)_mm512_castps_si512(a), (__m512bh)_mm512_castps_si512(b)),
                     _mm512_add_ps, _mm512_cvtss_f32)
}

struct Kind {
  const char* name;
  const char* features[3];
  double ops_per_iter;  // operations per loop iteration (kChains instructions)
  double (*run)(int64_t, float);
};

const Kind kKinds[] = {
    {"fp32_avx2_fma", {"avx2", "fma", nullptr}, kChains * 8 * 2, fma_avx2},
    {"fp32_avx512_fma", {"avx512f", nullptr, nullptr}, kChains * 16 * 2, fma_avx512},
    {"int8_avx2_maddubs", {"avx2", nullptr, nullptr}, kChains * 32 * 2, int8_avx2},
    {"int8_avx512_vnni", {"avx512bw", "avx512vnni", nullptr}, kChains * 64 * 2, int8_vnni},
    {"bf16_avx512_dot", {"avx512f", "avx512bf16", nullptr}, kChains * 32 * 2, bf16_avx512},
};

bool supported(const Kind& k) {
  for (const char* f : k.features) {
    if (f == nullptr) break;
    const std::string s(f);
    // __builtin_cpu_supports needs literal names.
    if (s == "avx2" && !__builtin_cpu_supports("avx2")) return false;
    if (s == "fma" && !__builtin_cpu_supports("fma")) return false;
    if (s == "avx512f" && !__builtin_cpu_supports("avx512f")) return false;
    if (s == "avx512bw" && !__builtin_cpu_supports("avx512bw")) return false;
    if (s == "avx512vnni" && !__builtin_cpu_supports("avx512vnni")) return false;
    if (s == "avx512bf16" && !__builtin_cpu_supports("avx512bf16")) return false;
  }
  return true;
}

}  // namespace

std::vector<std::string> peak_kinds() {
  std::vector<std::string> out;
  for (const Kind& k : kKinds)
    if (supported(k)) out.emplace_back(k.name);
  return out;
}

double peak_gops(const std::string& name, int64_t iters) {
  for (const Kind& k : kKinds) {
    if (name != k.name) continue;
    TORCH_CHECK(supported(k), "this CPU lacks the instructions for ", name);
    const int threads = at::get_num_threads();
    std::atomic<double> keep{0.0};
    const auto t0 = std::chrono::steady_clock::now();
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) keep = keep + k.run(iters, 1.0f + (float)t);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return k.ops_per_iter * (double)iters * threads / s / 1e9;
  }
  TORCH_CHECK(false, "unknown peak kind '", name, "'");
  return 0.0;
}
