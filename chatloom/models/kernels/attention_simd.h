// The paged attention's SIMD building blocks, shared by the one-query jobs of a decode step
// (paged_attention.cpp) and the tiles of a prefill (prefill_attention.cpp): both build every score,
// exponential and weighted sum from these, which is why a query gets the same bits on either.
#pragma once
#include <torch/extension.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <type_traits>

// A pool of 16-bit values (float16 or bfloat16) halves the bytes a decode step reads; the
// arithmetic stays float32: each value is widened as it is loaded.
// A decode step's pools are far bigger than the caches and a sequence's blocks lie anywhere in
// them, so most rows would be demand misses: the hardware prefetchers stop at page ends and need a
// run to learn each stream. Every path's passes ask for the rows they will need kPrefetchAhead
// positions later, into L2 (__builtin_prefetch with locality 2: prefetcht1 on x86): in L1 the
// requests would take the few miss buffers the loads need. Measured on Zen 4 at 32 sequences of
// 150-250 positions: 16 ahead, into L2, read the pools a third faster than no prefetch; 8 or 32
// ahead, or into L1, gained less.
constexpr int64_t kPrefetchAhead = 16;

// Waking the second thread costs more than a short step's whole attention (a chat's first few
// hundred positions at batch 1): below about 64K multiply-adds a call runs on the calling thread.
static inline bool attention_fits_one_thread(const int32_t* kv_lens, int64_t n_queries, int64_t hq, int64_t d) {
  int64_t positions = 0;
  for (int64_t i = 0; i < n_queries; ++i) positions += (int64_t)kv_lens[i];
  return positions * 2 * hq * d < (int64_t)1 << 16;
}

// A query's share of a call's work, to split it between threads: the positions it sees, plus a
// fixed amount (its setup and the last group's reductions) counted as 8 positions.
static inline int64_t query_cost(int32_t kv_len) { return (int64_t)kv_len + 8; }
static inline void prefetch_span(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 2);
}

#if defined(__AVX2__) && defined(__FMA__)
// exp for x <= 0 (scores minus their maximum): 2^n * p(r) with |r| <= ln2 / 2 and a
// degree-6 Taylor polynomial, within a few ulp of expf; underflows to 2^-126 near -87.
static inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// Eight pool values as float32: a float16 is widened by F16C, a bfloat16 is a float32's top half.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// The same loops in AVX2 for float32 with a head size that is a multiple of 16; the
// softmax's exponentials run eight at a time.
struct Avx2F32Ops {
  template <typename KV>
  static float dot(const float* q, const KV* k, int64_t d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t x = 0; x < d; x += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + x), load8(k + x), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + x + 8), load8(k + x + 8), a1);
    }
    return hsum8(_mm256_add_ps(a0, a1));
  }
  static float exp_shift(float* st, int64_t len, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 vs = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(st + t), mv));
      _mm256_storeu_ps(st + t, e);
      vs = _mm256_add_ps(vs, e);
    }
    float tail = 0.f;
    for (; t < len; ++t) {
      st[t] = std::exp(st[t] - m);
      tail += st[t];
    }
    return hsum8(vs) + tail;
  }
  template <typename KV>
  static void axpy(float* a, float p, const KV* v, int64_t d) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t x = 0; x < d; x += 8)
      _mm256_storeu_ps(a + x, _mm256_fmadd_ps(pv, load8(v + x), _mm256_loadu_ps(a + x)));
  }
};
#endif

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Sixteen pool values as float32 (see load8).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// Four scores from four 16-lane partial sums: [sum(a0), sum(a1), sum(a2), sum(a3)].
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  auto halves = [](__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  };
  const __m256 c01 = _mm256_hadd_ps(halves(a0), halves(a1));
  const __m256 c23 = _mm256_hadd_ps(halves(a2), halves(a3));
  const __m256 d = _mm256_hadd_ps(c01, c23);
  return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

// prefetch_span's request as the AVX-512 passes make it. The same prefetcht1 instructions, but built
// with prefetch_span (or with kv_head in place of pf_head, below) the passes read scattered pools
// 10-20% slower on Zen 4, in every alternated run of the two builds: code layout, not arithmetic.
template <typename KV>
static inline void prefetch_row(const KV* p, int bytes) {
  for (int b = 0; b < bytes; b += 64) _mm_prefetch((const char*)p + b, _MM_HINT_T1);
}

// The most query heads one pass carries in registers: GC * D16 query (or accumulator) vectors
// and GC * 4 partial sums must fit the 32 vector registers.
template <int D16>
constexpr int max_heads_per_pass() { return D16 == 1 ? 5 : D16 == 2 ? 4 : D16 == 4 ? 3 : 2; }

// Calls body(std::integral_constant<int, GC>) for gc in 1..max_heads_per_pass<D16>().
template <int D16, typename F>
static inline void with_heads(int64_t gc, F&& body) {
  switch (gc) {
    case 1: body(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (max_heads_per_pass<D16>() >= 2) body(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (max_heads_per_pass<D16>() >= 3) body(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (max_heads_per_pass<D16>() >= 4) body(std::integral_constant<int, 4>{}); break;
    default: if constexpr (max_heads_per_pass<D16>() >= 5) body(std::integral_constant<int, 5>{}); break;
  }
}

#endif
