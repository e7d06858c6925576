// Attention that reads K/V straight from the paged pool: no gather, no padding.
// Each query token i attends to the first kv_len[i] positions of the sequence whose
// block table is block_tables[row[i]]. Work is split over (query token, KV head);
// the query heads that share a KV head (GQA) are scored together so K and V are read once.
#include "kernels.h"
#include "attention_simd.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

// The three inner loops, portable: the compiler vectorizes what it can.
template <typename T, typename Acc>
struct PortableOps {
  template <typename KV>
  static Acc dot(const Acc* q, const KV* k, int64_t d) {
    Acc s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t x = 0; x < d; ++x) s += q[x] * (Acc)k[x];
    return s;
  }
  // st[t] = exp(st[t] - m) for every t < len; returns their sum.
  static Acc exp_shift(Acc* st, int64_t len, Acc m) {
    Acc sum = 0;
    for (int64_t t = 0; t < len; ++t) {
      st[t] = std::exp(st[t] - m);
      sum += st[t];
    }
    return sum;
  }
  // a += p * v
  template <typename KV>
  static void axpy(Acc* a, Acc p, const KV* v, int64_t d) {
#pragma omp simd
    for (int64_t x = 0; x < d; ++x) a[x] += p * (Acc)v[x];
  }
};

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Pass 1 for GC query heads that share one KV head: scores of four cached positions at a time,
// each K row read once for all GC heads (GC * 4 independent multiply-add chains, one shuffle tree
// per head for its four sums). Every score is reduced the same way wherever it falls (a short last
// group is padded with zeros), so a query's result depends on its own keys only.
template <int D16, int GC, typename KV>
static inline void score_heads(const float* qv, const KV* kp, const int64_t* offs, int64_t len, int64_t kv_head,
                               int64_t pf_head, int pf_bytes, float* scores, float* mx) {
  constexpr int64_t d = 16 * D16;
  __m512 q[GC][D16];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < D16; ++c) q[g][c] = _mm512_loadu_ps(qv + g * d + 16 * c);
  __m512 best[GC];
  for (int g = 0; g < GC; ++g) best[g] = _mm512_set1_ps(-std::numeric_limits<float>::max());
  for (int64_t t = 0; t < len; t += 4) {
    __m512 a[GC][4];
    for (int i = 0; i < 4; ++i) {
      for (int g = 0; g < GC; ++g) a[g][i] = _mm512_setzero_ps();
      if (t + i < len) {
        if (t + i + kPrefetchAhead < len)
          prefetch_row(kp + offs[t + i + kPrefetchAhead] + pf_head, pf_bytes);
        const KV* krow = kp + offs[t + i] + kv_head;
        for (int c = 0; c < D16; ++c) {
          const __m512 k = load16(krow + 16 * c);
          for (int g = 0; g < GC; ++g) a[g][i] = _mm512_fmadd_ps(q[g][c], k, a[g][i]);
        }
      }
    }
    const int64_t n = std::min<int64_t>(4, len - t);
    const __mmask16 keep = (__mmask16)((1u << n) - 1);
    for (int g = 0; g < GC; ++g) {
      const __m128 s4 = reduce4(a[g][0], a[g][1], a[g][2], a[g][3]);
      _mm512_mask_storeu_ps(scores + g * len + t, keep, _mm512_castps128_ps512(s4));
      best[g] = _mm512_mask_max_ps(best[g], keep, best[g], _mm512_castps128_ps512(s4));
    }
  }
  for (int g = 0; g < GC; ++g) mx[g] = _mm512_reduce_max_ps(best[g]);
}

// Pass 2 for the same GC heads: each V row read once, every head's accumulator in registers.
template <int D16, int GC, typename KV>
static inline void weigh_values(const KV* vp, const int64_t* offs, int64_t len, int64_t kv_head,
                                int64_t pf_head, int pf_bytes, const float* scores, const float* sum, float* out) {
  constexpr int64_t d = 16 * D16;
  __m512 acc[GC][D16];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < D16; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len)
      prefetch_row(vp + offs[t + kPrefetchAhead] + pf_head, pf_bytes);
    const KV* vrow = vp + offs[t] + kv_head;
    for (int c = 0; c < D16; ++c) {
      const __m512 v = load16(vrow + 16 * c);
      for (int g = 0; g < GC; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + t]), v, acc[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[g]);
    for (int c = 0; c < D16; ++c) _mm512_storeu_ps(out + g * d + 16 * c, _mm512_mul_ps(acc[g][c], inv));
  }
}

// Pass 1 for all H KV heads of a job (GC query heads each), four positions at a time: each cached row
// (H heads' keys side by side) is read whole, once, while every head is scored, instead of in H
// strided passes. Reading rows whole keeps the loads in step with the arithmetic: on Zen 4 a
// 32-sequence step's attention from scattered pools took 10.7-11.5 ms against 13.8-14.4 in passes.
// Each score's chain, tree and running maximum are score_heads', in the same order: the same bits.
template <int D16, int GC, int H, typename KV>
static inline void score_rows(const float* qv, const KV* kp, const int64_t* offs, int64_t len, int64_t kv0,
                              float* scores, float* mx) {
  constexpr int64_t d = 16 * D16;
  constexpr int row_bytes = H * d * sizeof(KV);
  __m512 best[H][GC];
  for (int h = 0; h < H; ++h)
    for (int g = 0; g < GC; ++g) best[h][g] = _mm512_set1_ps(-std::numeric_limits<float>::max());
  for (int64_t t = 0; t < len; t += 4) {
    for (int i = 0; i < 4; ++i)
      if (t + i + kPrefetchAhead < len) prefetch_row(kp + offs[t + i + kPrefetchAhead] + kv0, row_bytes);
    const int64_t n = std::min<int64_t>(4, len - t);
    const __mmask16 keep = (__mmask16)((1u << n) - 1);
    for (int h = 0; h < H; ++h) {
      __m512 q[GC][D16];
      for (int g = 0; g < GC; ++g)
        for (int c = 0; c < D16; ++c) q[g][c] = _mm512_loadu_ps(qv + (h * GC + g) * d + 16 * c);
      __m512 a[GC][4];
      for (int i = 0; i < 4; ++i) {
        for (int g = 0; g < GC; ++g) a[g][i] = _mm512_setzero_ps();
        if (t + i < len) {
          const KV* krow = kp + offs[t + i] + kv0 + h * d;
          for (int c = 0; c < D16; ++c) {
            const __m512 k = load16(krow + 16 * c);
            for (int g = 0; g < GC; ++g) a[g][i] = _mm512_fmadd_ps(q[g][c], k, a[g][i]);
          }
        }
      }
      for (int g = 0; g < GC; ++g) {
        const __m128 s4 = reduce4(a[g][0], a[g][1], a[g][2], a[g][3]);
        _mm512_mask_storeu_ps(scores + (h * GC + g) * len + t, keep, _mm512_castps128_ps512(s4));
        best[h][g] = _mm512_mask_max_ps(best[h][g], keep, best[h][g], _mm512_castps128_ps512(s4));
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int g = 0; g < GC; ++g) mx[h * GC + g] = _mm512_reduce_max_ps(best[h][g]);
}

// Pass 2 for the same H KV heads: each V row read whole while every head takes its share. Not all
// H * GC * D16 sums fit the registers: the first HR heads' stay there, the others' wait in `out`
// (an L1 round trip per multiply-add, which the memory's pace hides). The same multiply-adds in the
// same order as weigh_values, so the same bits.
template <int D16, int GC, int H, int HR, typename KV>
static inline void weigh_rows(const KV* vp, const int64_t* offs, int64_t len, int64_t kv0,
                              const float* scores, const float* sum, float* out) {
  constexpr int64_t d = 16 * D16;
  constexpr int row_bytes = H * d * sizeof(KV);
  __m512 acc[HR][GC][D16];
  for (int h = 0; h < HR; ++h)
    for (int g = 0; g < GC; ++g)
      for (int c = 0; c < D16; ++c) acc[h][g][c] = _mm512_setzero_ps();
  for (int64_t x = HR * GC * d; x < H * GC * d; x += 16) _mm512_storeu_ps(out + x, _mm512_setzero_ps());
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_row(vp + offs[t + kPrefetchAhead] + kv0, row_bytes);
    const KV* vrow = vp + offs[t] + kv0;
    for (int h = 0; h < HR; ++h)
      for (int c = 0; c < D16; ++c) {
        const __m512 v = load16(vrow + h * d + 16 * c);
        for (int g = 0; g < GC; ++g)
          acc[h][g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(h * GC + g) * len + t]), v, acc[h][g][c]);
      }
    for (int h = HR; h < H; ++h)
      for (int c = 0; c < D16; ++c) {
        const __m512 v = load16(vrow + h * d + 16 * c);
        for (int g = 0; g < GC; ++g) {
          float* o = out + (h * GC + g) * d + 16 * c;
          _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(scores[(h * GC + g) * len + t]), v, _mm512_loadu_ps(o)));
        }
      }
  }
  for (int h = 0; h < HR; ++h)
    for (int g = 0; g < GC; ++g)
      for (int c = 0; c < D16; ++c) _mm512_storeu_ps(out + (h * GC + g) * d + 16 * c, acc[h][g][c]);
  for (int64_t j = 0; j < H * GC; ++j) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[j]);
    for (int c = 0; c < D16; ++c)
      _mm512_storeu_ps(out + j * d + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(out + j * d + 16 * c), inv));
  }
}

// Calls body(std::integral_constant<int, H>) for h in 2..4 (the KV heads a row-wise job takes).
template <typename F>
static inline void with_row_heads(int64_t h, F&& body) {
  switch (h) {
    case 2: body(std::integral_constant<int, 2>{}); break;
    case 3: body(std::integral_constant<int, 3>{}); break;
    default: body(std::integral_constant<int, 4>{}); break;
  }
}

// One job's attention in AVX-512 for float32 heads of 16 * D16 values. The query heads that share
// a KV head go through both passes together, a few at a time, so K and V rows are read once per
// pass rather than once per query head; a job of 2-4 KV heads reads whole rows (score_rows,
// weigh_rows). `offs[t]`: where position t's row starts in the pools.
template <int D16, typename KV>
static void attend_avx512(const float* qv, const KV* kp, const KV* vp, const int64_t* offs, int64_t len,
                          int64_t h0, int64_t heads_per_job, int64_t group, float* scores, float* mx, float* sum,
                          float* out) {
  constexpr int64_t d = 16 * D16;
  constexpr int64_t per_pass = max_heads_per_pass<D16>();
  // Where the passes ask for rows ahead: the first pass over a KV head's rows does (pf_bytes), a later
  // one finds them in cache. pf_head is always the KV head's offset in a row, passed apart from
  // kv_head only because that build measured faster (see prefetch_row).
  auto pf_head_for = [&](int64_t hh, int64_t g0) { return (h0 + hh) * d; };
  auto pf_bytes_for = [&](int64_t hh, int64_t g0) { return g0 == 0 ? (int)(d * sizeof(KV)) : 0; };
  // A job of several KV heads reads each cached row whole where a pass carries a KV head's whole
  // group; otherwise one KV head at a time, in passes.
  const bool whole_rows = group <= per_pass && heads_per_job >= 2 && heads_per_job <= 4;
  if (whole_rows) {
    with_heads<D16>(group, [&](auto gc) {
      with_row_heads(heads_per_job, [&](auto h) {
        score_rows<D16, decltype(gc)::value, decltype(h)::value, KV>(qv, kp, offs, len, h0 * d, scores, mx);
      });
    });
  } else {
    for (int64_t hh = 0; hh < heads_per_job; ++hh) {
      const int64_t kv_head = (h0 + hh) * d;
      for (int64_t g0 = 0; g0 < group; g0 += per_pass) {
        const int64_t j = hh * group + g0;
        with_heads<D16>(std::min(per_pass, group - g0), [&](auto gc) {
          score_heads<D16, decltype(gc)::value, KV>(qv + j * d, kp, offs, len, kv_head, pf_head_for(hh, g0),
                                                    pf_bytes_for(hh, g0), scores + j * len, mx + j);
        });
      }
    }
  }
  for (int64_t j = 0; j < heads_per_job * group; ++j) sum[j] = Avx2F32Ops::exp_shift(scores + j * len, len, mx[j]);
  if (whole_rows) {
    with_heads<D16>(group, [&](auto gc) {
      with_row_heads(heads_per_job, [&](auto h) {
        constexpr int GC = decltype(gc)::value, H = decltype(h)::value;
        constexpr int HR = std::min(H, 24 / (GC * D16));  // the heads whose sums fit the registers
        weigh_rows<D16, GC, H, HR, KV>(vp, offs, len, h0 * d, scores, sum, out);
      });
    });
  } else {
    for (int64_t hh = 0; hh < heads_per_job; ++hh) {
      const int64_t kv_head = (h0 + hh) * d;
      for (int64_t g0 = 0; g0 < group; g0 += per_pass) {
        const int64_t j = hh * group + g0;
        with_heads<D16>(std::min(per_pass, group - g0), [&](auto gc) {
          weigh_values<D16, decltype(gc)::value, KV>(vp, offs, len, kv_head, pf_head_for(hh, g0),
                                                     pf_bytes_for(hh, g0), scores + j * len, sum + j, out + j * d);
        });
      }
    }
  }
}

#endif

// The attention's instruction path: "auto" is AVX-512 where the build has it unless
// CHATLOOM_KERNEL_ISA=avx2 (read once); "avx512" and "avx2" force one (tests compare them).
static bool use_avx512_attention(const std::string& isa) {
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  static const bool by_default = [] {
    const char* env = std::getenv("CHATLOOM_KERNEL_ISA");
    return !(env && std::string(env) == "avx2");
  }();
  TORCH_CHECK(isa == "auto" || isa == "avx512" || isa == "avx2", "unknown attention path '", isa,
              "': use auto, avx512 or avx2");
  return isa == "auto" ? by_default : isa == "avx512";
#else
  TORCH_CHECK(isa == "auto" || isa == "avx2", "the attention's ", isa, " path is not available on this CPU or build");
  return false;
#endif
}

std::vector<std::string> paged_attention_isas() {
  std::vector<std::string> out;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  out.emplace_back("avx512");
#endif
  out.emplace_back("avx2");
  return out;
}

// One job: query token qi's heads that share KV heads [h0, h0 + heads_per_job) against the first `len`
// positions of the sequence whose block table is `table`, into o. Every path (paged_attention's
// threads, the decode team's) runs this one copy of the code, so a query head's bits do not depend
// on who runs it. wide16: the AVX-512 path's head size / 16, or 0.
template <typename T, typename KV, typename Acc, typename Ops>
__attribute__((noinline)) static void attend_job(const T* qi, const KV* kp, const KV* vp, const int32_t* table,
                                                 int64_t len, int64_t hkv, int64_t d, int64_t group,
                                                 int64_t block_size, double scale, int64_t h0, int64_t heads_per_job,
                                                 int64_t wide16, JobScratch<Acc>& sc, T* o) {
  const int64_t row_stride = hkv * d;  // values per cached position
  const int64_t nq = heads_per_job * group;  // query heads handled by this job
  sc.scores.resize(nq * len);  // [query head][position]
  sc.qv.resize(nq * d);
  sc.mx.resize(nq);
  sc.sum.resize(nq);
  auto& scores = sc.scores;
  auto& qv = sc.qv;
  auto& mx = sc.mx;
  auto& sum = sc.sum;
  for (int64_t x = 0; x < nq * d; ++x) qv[x] = (Acc)qi[x] * (Acc)scale;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<Ops, Avx2F32Ops>) {
    if (wide16 > 0) {
      sc.offs.resize(len);
      for (int64_t t = 0; t < len; ++t)
        sc.offs[t] = ((int64_t)table[t / block_size] * block_size + t % block_size) * row_stride;
      auto run = [&](auto d16) {
        attend_avx512<decltype(d16)::value, KV>(qv.data(), kp, vp, sc.offs.data(), len, h0, heads_per_job, group,
                                            scores.data(), mx.data(), sum.data(), o);
      };
      switch (wide16) {
        case 1: run(std::integral_constant<int, 1>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        case 4: run(std::integral_constant<int, 4>{}); break;
        default: run(std::integral_constant<int, 8>{}); break;
      }
      return;
    }
  }
#endif
  auto& acc = sc.acc;
  acc.assign(nq * d, (Acc)0);
  std::fill(mx.begin(), mx.end(), -std::numeric_limits<Acc>::max());

  // Where position t's rows for this job's KV heads start, and how many bytes they span; each pass
  // asks for the rows it will need kPrefetchAhead positions later.
  const auto row_at = [&](int64_t t) {
    return ((int64_t)table[t / block_size] * block_size + t % block_size) * row_stride + h0 * d;
  };
  const int64_t job_bytes = heads_per_job * d * (int64_t)sizeof(KV);
  // Pass 1: scores of every query head against every cached key.
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_span(kp + row_at(t + kPrefetchAhead), job_bytes);
    const KV* krow = kp + row_at(t);
    for (int64_t hh = 0; hh < heads_per_job; ++hh) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t j = hh * group + g;
        const Acc s = Ops::dot(qv.data() + j * d, krow + hh * d, d);
        scores[j * len + t] = s;
        mx[j] = std::max(mx[j], s);
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) sum[j] = Ops::exp_shift(scores.data() + j * len, len, mx[j]);
  // Pass 2: probability-weighted sum of the values.
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_span(vp + row_at(t + kPrefetchAhead), job_bytes);
    const KV* vrow = vp + row_at(t);
    for (int64_t hh = 0; hh < heads_per_job; ++hh) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t j = hh * group + g;
        Ops::axpy(acc.data() + j * d, scores[j * len + t], vrow + hh * d, d);
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    const Acc inv = (Acc)1 / sum[j];
    for (int64_t x = 0; x < d; ++x) o[j * d + x] = (T)(acc[j * d + x] * inv);
  }
}

// Heads of 16, 32, 64 or 128 float32 values take the AVX-512 path where the build has it.
static int64_t wide16_for(bool wide, int64_t d) {
  return wide && (d == 16 || d == 32 || d == 64 || d == 128) ? d / 16 : 0;
}

template <typename T, typename KV, typename Acc, typename Ops>
static void paged_attention_impl(const T* q, const KV* kp, const KV* vp, const int32_t* tables,
                                 const int32_t* rows, const int32_t* kv_lens, T* out,
                                 int64_t n_tokens, int64_t hq, int64_t hkv, int64_t d,
                                 int64_t block_size, int64_t table_width, double scale, bool wide) {
  const int64_t group = hq / hkv;
  const bool one_thread = attention_fits_one_thread(kv_lens, n_tokens, hq, d);
  // With several query tokens (or one thread doing it all), one job takes all KV heads of a token,
  // so each cached position is read as one contiguous run (hkv * d values) that prefetchers
  // stream well. With very few tokens on two threads, split by KV head so both cores have work.
  // A query head's arithmetic is the same whichever job or thread runs it, so the bits are too.
  const int64_t heads_per_job = n_tokens >= 4 || one_thread ? hkv : 1;
  const int64_t jobs_per_token = hkv / heads_per_job;
  const int64_t jobs = n_tokens * jobs_per_token;
  const int64_t wide16 = wide16_for(wide, d);
  // Contiguous runs of jobs, a few per thread, cut where the cached positions (a job's cost) reach each
  // run's share rather than where the job count does: a batch holds tokens of a few positions next to
  // tokens of hundreds (a prefill chunk's first and last, or short and long chats), and an even split by
  // count left one core waiting for the other at the end of every call. Several runs per thread go to
  // whichever thread is free (work_pool.h), so a thread the OS takes away leaves its runs to the others.
  const int64_t threads = one_thread ? 1 : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), jobs));
  const int64_t parts = threads > 1 ? std::min<int64_t>(jobs, threads * 4) : 1;
  std::vector<int64_t> bounds(parts + 1, jobs);
  bounds[0] = 0;
  if (parts > 1) {
    const auto job_cost = [&](int64_t job) { return query_cost(kv_lens[job / jobs_per_token]); };
    int64_t total = 0;
    for (int64_t job = 0; job < jobs; ++job) total += job_cost(job);
    int64_t done = 0, next = 1;
    for (int64_t job = 0; job < jobs && next < parts; ++job) {
      done += job_cost(job);
      while (next < parts && done * parts >= total * next) bounds[next++] = job + 1;
    }
  }
  chatloom_kernels::parallel_for(0, parts, 1, [&](int64_t first_part, int64_t end_part) {
    JobScratch<Acc> scratch;
    for (int64_t job = bounds[first_part]; job < bounds[end_part]; ++job) {
      const int64_t i = job / jobs_per_token;
      const int64_t h0 = (job % jobs_per_token) * heads_per_job;
      const int64_t first = (i * hq + h0 * group) * d;
      attend_job<T, KV, Acc, Ops>(q + first, kp, vp, tables + (int64_t)rows[i] * table_width, kv_lens[i], hkv, d,
                              group, block_size, scale, h0, heads_per_job, wide16, scratch, out + first);
    }
  });
}

// attention_job for a pool of KV values (float, c10::Half or c10::BFloat16): the same choice of
// path as paged_attention_impl makes for that pool.
template <typename KV>
static void attention_job_of(const float* q, const KV* k_pool, const KV* v_pool, const int32_t* table, int64_t len,
                             int64_t hq, int64_t hkv, int64_t d, int64_t block_size, double scale, int64_t h0,
                             int64_t heads, AttentionScratch& scratch, float* out) {
  const int64_t group = hq / hkv, first = h0 * group * d;
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 16 == 0) {
    attend_job<float, KV, float, Avx2F32Ops>(q + first, k_pool, v_pool, table, len, hkv, d, group, block_size, scale,
                                             h0, heads, wide16_for(use_avx512_attention("auto"), d), scratch,
                                             out + first);
    return;
  }
#endif
  attend_job<float, KV, float, PortableOps<float, float>>(q + first, k_pool, v_pool, table, len, hkv, d, group,
                                                          block_size, scale, h0, heads, 0, scratch, out + first);
}

void attention_job(const float* q, const float* k_pool, const float* v_pool, const int32_t* table, int64_t len,
                   int64_t hq, int64_t hkv, int64_t d, int64_t block_size, double scale, int64_t h0, int64_t heads,
                   AttentionScratch& scratch, float* out) {
  attention_job_of(q, k_pool, v_pool, table, len, hq, hkv, d, block_size, scale, h0, heads, scratch, out);
}

void attention_job(const float* q, const c10::Half* k_pool, const c10::Half* v_pool, const int32_t* table,
                   int64_t len, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, double scale, int64_t h0,
                   int64_t heads, AttentionScratch& scratch, float* out) {
  attention_job_of(q, k_pool, v_pool, table, len, hq, hkv, d, block_size, scale, h0, heads, scratch, out);
}

void attention_job(const float* q, const c10::BFloat16* k_pool, const c10::BFloat16* v_pool, const int32_t* table,
                   int64_t len, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, double scale, int64_t h0,
                   int64_t heads, AttentionScratch& scratch, float* out) {
  attention_job_of(q, k_pool, v_pool, table, len, hq, hkv, d, block_size, scale, h0, heads, scratch, out);
}

// The float32 query against a pool of 16-bit values (KV: c10::Half or c10::BFloat16).
template <typename KV>
static void attend_16bit_pool(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                              const torch::Tensor& block_tables, const torch::Tensor& rows,
                              const torch::Tensor& kv_lens, torch::Tensor& out, int64_t hkv, int64_t bs,
                              double scale, bool wide) {
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const KV* kp = k_pool.data_ptr<KV>();
  const KV* vp = v_pool.data_ptr<KV>();
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 16 == 0) {
    paged_attention_impl<float, KV, float, Avx2F32Ops>(q.data_ptr<float>(), kp, vp, block_tables.data_ptr<int32_t>(),
        rows.data_ptr<int32_t>(), kv_lens.data_ptr<int32_t>(), out.data_ptr<float>(), n, hq, hkv, d, bs,
        block_tables.size(1), scale, wide);
    return;
  }
#endif
  paged_attention_impl<float, KV, float, PortableOps<float, float>>(q.data_ptr<float>(), kp, vp,
      block_tables.data_ptr<int32_t>(), rows.data_ptr<int32_t>(), kv_lens.data_ptr<int32_t>(), out.data_ptr<float>(),
      n, hq, hkv, d, bs, block_tables.size(1), scale, wide);
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor block_tables, torch::Tensor rows, torch::Tensor kv_lens,
                              double scale, const std::string& isa) {
  const bool wide = use_avx512_attention(isa);
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && rows.scalar_type() == torch::kInt32 &&
              kv_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools of one type");
  block_tables = block_tables.contiguous();
  auto out = torch::empty_like(q);
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t bs = k_pool.size(1), hkv = k_pool.size(2);
  const auto pool_type = k_pool.scalar_type();
  // Runs of queries of one sequence (a prompt, a chunk) go through the tiles, with the same bits.
  if (wide && paged_attention_tiles(q, k_pool, v_pool, block_tables, rows, kv_lens, scale, out)) return out;
  if (pool_type == torch::kHalf || pool_type == torch::kBFloat16) {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32, "a 16-bit KV pool takes float32 queries");
    if (pool_type == torch::kHalf)
      attend_16bit_pool<c10::Half>(q, k_pool, v_pool, block_tables, rows, kv_lens, out, hkv, bs, scale, wide);
    else
      attend_16bit_pool<c10::BFloat16>(q, k_pool, v_pool, block_tables, rows, kv_lens, out, hkv, bs, scale, wide);
    return out;
  }
  TORCH_CHECK(pool_type == q.scalar_type(), "the KV pool must be float16, bfloat16 or the query's type");
#if defined(__AVX2__) && defined(__FMA__)
  if (q.scalar_type() == torch::kFloat32 && d % 16 == 0) {
    paged_attention_impl<float, float, float, Avx2F32Ops>(q.data_ptr<float>(), k_pool.data_ptr<float>(),
        v_pool.data_ptr<float>(), block_tables.data_ptr<int32_t>(), rows.data_ptr<int32_t>(),
        kv_lens.data_ptr<int32_t>(), out.data_ptr<float>(), n, hq, hkv, d, bs, block_tables.size(1), scale, wide);
    return out;
  }
#endif
  if (q.scalar_type() == torch::kFloat32) {
    paged_attention_impl<float, float, float, PortableOps<float, float>>(
        q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), block_tables.data_ptr<int32_t>(), rows.data_ptr<int32_t>(), kv_lens.data_ptr<int32_t>(),
        out.data_ptr<float>(), n, hq, hkv, d, bs, block_tables.size(1), scale, wide);
  } else if (q.scalar_type() == torch::kFloat64) {
    paged_attention_impl<double, double, double, PortableOps<double, double>>(
        q.data_ptr<double>(), k_pool.data_ptr<double>(), v_pool.data_ptr<double>(), block_tables.data_ptr<int32_t>(), rows.data_ptr<int32_t>(), kv_lens.data_ptr<int32_t>(),
        out.data_ptr<double>(), n, hq, hkv, d, bs, block_tables.size(1), scale, wide);
  } else {
    TORCH_CHECK(false, "paged_attention supports float32 and float64");
  }
  return out;
}
