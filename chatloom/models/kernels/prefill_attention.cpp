// Prefill attention over the paged pool: a prompt's (or a chunk's) queries in tiles.
// See attend_tile_avx512 for why a query gets the bits a decode step's one-query job gives it.
#include "kernels.h"
#include "attention_simd.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// -- Prefill: a tile of queries of one sequence ------------------------------------------------
// A prompt (or a chunk of one) is many queries of one sequence over the same cached positions. Run
// one at a time, each query reads every K and V row it sees from memory again. A tile's queries go
// through the positions together, kTileSpan at a time, so a span's rows are read once for the
// whole tile and stay in L1 while each query takes its turn. Every query's arithmetic is the one
// attend_avx512 does for it alone (the same multiply-add chains, reduction trees, exponentials and
// accumulation order; partial results kept in scratch between spans are stored exactly), so a
// query's bits do not depend on whether it came in a prompt, a chunk or a decode step.
constexpr int64_t kTileQueries = 8;
constexpr int64_t kTileSpan = 64;  // a multiple of score_heads' groups of 4

// score_heads over positions [tb, te) of a query that sees `len` (tb a multiple of 4, te <= len or a
// multiple of 4); the running maxima come in and go out through best_io.
template <int D16, int GC, typename KV>
static inline void score_span(const float* qv, const KV* kp, const int64_t* offs, int64_t tb, int64_t te,
                              int64_t len, int64_t kv_head, float* scores, int64_t stride, __m512* best_io) {
  constexpr int64_t d = 16 * D16;
  __m512 q[GC][D16];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < D16; ++c) q[g][c] = _mm512_loadu_ps(qv + g * d + 16 * c);
  __m512 best[GC];
  for (int g = 0; g < GC; ++g) best[g] = best_io[g];
  // The loop of score_heads (paged_attention.cpp), copied rather than shared: built from one shared
  // inline helper, the decode step's pass read scattered pools about 45% slower on Zen 4 (`chatloom
  // bench attention`: 23.8 against 16.4 ms a step). Both must stay the same multiply-adds and
  // reduction; the tests compare the bits.
  for (int64_t t = tb; t < te; t += 4) {
    __m512 a[GC][4];
    for (int i = 0; i < 4; ++i) {
      for (int g = 0; g < GC; ++g) a[g][i] = _mm512_setzero_ps();
      if (t + i < len) {
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
      _mm512_mask_storeu_ps(scores + g * stride + t, keep, _mm512_castps128_ps512(s4));
      best[g] = _mm512_mask_max_ps(best[g], keep, best[g], _mm512_castps128_ps512(s4));
    }
  }
  for (int g = 0; g < GC; ++g) best_io[g] = best[g];
}

// weigh_values over positions [tb, te): the accumulators come in and go out through acc_io.
template <int D16, int GC, typename KV>
static inline void weigh_span(const KV* vp, const int64_t* offs, int64_t tb, int64_t te, int64_t kv_head,
                              const float* scores, int64_t stride, float* acc_io) {
  constexpr int64_t d = 16 * D16;
  __m512 acc[GC][D16];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < D16; ++c) acc[g][c] = _mm512_loadu_ps(acc_io + g * d + 16 * c);
  for (int64_t t = tb; t < te; ++t) {
    const KV* vrow = vp + offs[t] + kv_head;
    for (int c = 0; c < D16; ++c) {
      const __m512 v = load16(vrow + 16 * c);
      for (int g = 0; g < GC; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * stride + t]), v, acc[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < D16; ++c) _mm512_storeu_ps(acc_io + g * d + 16 * c, acc[g][c]);
}

// score_span for R rows that share a KV head: a query's heads, or the heads of several queries of the
// tile, each row with its own query, scores and running maximum, over positions [tb, te) that every row
// sees in full (tb and te multiples of 4). Each K row loaded serves all R rows; each row's multiply-adds
// and reduction are score_span's, so its bits are too.
template <int D16, int R, typename KV>
static inline void score_span_shared(const float* const* qv, const KV* kp, const int64_t* offs, int64_t tb,
                                     int64_t te, int64_t kv_head, float* const* scores, __m512* const* best_io) {
  __m512 q[R][D16];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < D16; ++c) q[r][c] = _mm512_loadu_ps(qv[r] + 16 * c);
  __m512 best[R];
  for (int r = 0; r < R; ++r) best[r] = *best_io[r];
  for (int64_t t = tb; t < te; t += 4) {
    __m512 a[R][4];
    for (int i = 0; i < 4; ++i) {
      for (int r = 0; r < R; ++r) a[r][i] = _mm512_setzero_ps();
      const KV* krow = kp + offs[t + i] + kv_head;
      for (int c = 0; c < D16; ++c) {
        const __m512 k = load16(krow + 16 * c);
        for (int r = 0; r < R; ++r) a[r][i] = _mm512_fmadd_ps(q[r][c], k, a[r][i]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m128 s4 = reduce4(a[r][0], a[r][1], a[r][2], a[r][3]);
      _mm512_mask_storeu_ps(scores[r] + t, (__mmask16)0xF, _mm512_castps128_ps512(s4));
      best[r] = _mm512_mask_max_ps(best[r], (__mmask16)0xF, best[r], _mm512_castps128_ps512(s4));
    }
  }
  for (int r = 0; r < R; ++r) *best_io[r] = best[r];
}

// weigh_span for R rows that share a KV head over positions [tb, te) that every row sees: each V row
// loaded serves all R rows, each row's accumulation in weigh_span's order.
template <int D16, int R, typename KV>
static inline void weigh_span_shared(const KV* vp, const int64_t* offs, int64_t tb, int64_t te, int64_t kv_head,
                                     const float* const* scores, float* const* acc_io) {
  __m512 acc[R][D16];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < D16; ++c) acc[r][c] = _mm512_loadu_ps(acc_io[r] + 16 * c);
  for (int64_t t = tb; t < te; ++t) {
    const KV* vrow = vp + offs[t] + kv_head;
    for (int c = 0; c < D16; ++c) {
      const __m512 v = load16(vrow + 16 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[r][t]), v, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < D16; ++c) _mm512_storeu_ps(acc_io[r] + 16 * c, acc[r][c]);
}

// Asks for one KV head's rows of positions [tb, min(tb + kTileSpan, len)) into L2, a span before the
// tile needs them: a long context's rows come from memory (see kPrefetchAhead).
template <typename KV>
static inline void prefetch_span_rows(const KV* pool, const int64_t* offs, int64_t tb, int64_t len, int64_t kv_head,
                                      int bytes) {
  for (int64_t t = tb; t < std::min(tb + kTileSpan, len); ++t) prefetch_row(pool + offs[t] + kv_head, bytes);
}

struct TileScratch {
  std::vector<float> qv, scores, acc, mx, sum;
  std::vector<__m512> best;
};

// Between the passes: each row's maximum score, and its scores turned into exponentials and summed.
static void softmax_rows(int64_t nt, int64_t hq, const int32_t* lens, int64_t stride, TileScratch& sc) {
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t j = 0; j < hq; ++j) {
      const int64_t row = i * hq + j;
      sc.mx[row] = _mm512_reduce_max_ps(sc.best[row]);
      sc.sum[row] = Avx2F32Ops::exp_shift(sc.scores.data() + row * stride, lens[i], sc.mx[row]);
    }
}

// attend_tile_avx512's passes with `packed` queries' rows (each query's `group` heads) at a time: over
// the positions all of them see, one K or V row serves them all (score_span_shared, weigh_span_shared);
// each query's last positions past the shortest one's go through score_span and weigh_span alone. The
// positions are split at a multiple of 4, where score_span's groups of 4 fall anyway, so every row's
// scores, maximum, sum and accumulators are those of the one-query passes, bit for bit.
template <int D16, typename KV>
static void attend_tile_packed(int64_t nt, const int32_t* lens, int64_t max_len, const KV* kp, const KV* vp,
                               const int64_t* offs, int64_t hkv, int64_t group, int64_t packed, int64_t stride,
                               TileScratch& sc) {
  constexpr int64_t d = 16 * D16;
  const int64_t hq = hkv * group;
  std::vector<const float*> qv(packed * group), score_in(packed * group);
  std::vector<float*> scores(packed * group), acc(packed * group);
  std::vector<__m512*> best(packed * group);
  std::vector<int64_t> members;
  // The queries of the tile that see position tb, in packs; calls body(pack, shared end) per pack.
  const auto packs = [&](int64_t tb, auto&& body) {
    for (int64_t i = 0; i < nt;) {
      members.clear();
      for (; i < nt && (int64_t)members.size() < packed; ++i)
        if (lens[i] > tb) members.push_back(i);
      if (members.empty()) break;
      int64_t shared = tb + kTileSpan;
      for (int64_t m : members) shared = std::min<int64_t>(shared, lens[m]);
      body(shared & ~int64_t(3));
    }
  };
  for (int64_t hh = 0; hh < hkv; ++hh) {
    const int64_t j = hh * group;
    for (int64_t tb = 0; tb < max_len; tb += kTileSpan) {
      prefetch_span_rows(kp, offs, tb + kTileSpan, max_len, hh * d, (int)(d * sizeof(KV)));
      packs(tb, [&](int64_t shared) {
        const int64_t rows = (int64_t)members.size() * group;
        for (size_t m = 0; m < members.size(); ++m)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t row = members[m] * hq + j + g, r = (int64_t)m * group + g;
            qv[r] = sc.qv.data() + row * d;
            scores[r] = sc.scores.data() + row * stride;
            best[r] = sc.best.data() + row;
          }
        if (shared > tb && rows > 1)
          with_heads<D16>(rows, [&](auto rc) {
            score_span_shared<D16, decltype(rc)::value, KV>(qv.data(), kp, offs, tb, shared, hh * d, scores.data(),
                                                            best.data());
          });
        else
          shared = tb;
        for (int64_t m : members) {
          const int64_t row = m * hq + j, te = std::min<int64_t>(tb + kTileSpan, lens[m]);
          if (te > shared)
            with_heads<D16>(group, [&](auto gc) {
              score_span<D16, decltype(gc)::value, KV>(sc.qv.data() + row * d, kp, offs, shared, te, lens[m], hh * d,
                                                       sc.scores.data() + row * stride, stride, sc.best.data() + row);
            });
        }
      });
    }
  }
  softmax_rows(nt, hq, lens, stride, sc);
  for (int64_t hh = 0; hh < hkv; ++hh) {
    const int64_t j = hh * group;
    for (int64_t tb = 0; tb < max_len; tb += kTileSpan) {
      prefetch_span_rows(vp, offs, tb + kTileSpan, max_len, hh * d, (int)(d * sizeof(KV)));
      packs(tb, [&](int64_t shared) {
        const int64_t rows = (int64_t)members.size() * group;
        for (size_t m = 0; m < members.size(); ++m)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t row = members[m] * hq + j + g, r = (int64_t)m * group + g;
            score_in[r] = sc.scores.data() + row * stride;
            acc[r] = sc.acc.data() + row * d;
          }
        if (shared > tb && rows > 1)
          with_heads<D16>(rows, [&](auto rc) {
            weigh_span_shared<D16, decltype(rc)::value, KV>(vp, offs, tb, shared, hh * d, score_in.data(), acc.data());
          });
        else
          shared = tb;
        for (int64_t m : members) {
          const int64_t row = m * hq + j, te = std::min<int64_t>(tb + kTileSpan, lens[m]);
          if (te > shared)
            with_heads<D16>(group, [&](auto gc) {
              weigh_span<D16, decltype(gc)::value, KV>(vp, offs, shared, te, hh * d, sc.scores.data() + row * stride,
                                                       stride, sc.acc.data() + row * d);
            });
        }
      });
    }
  }
}

// nt queries of one sequence (rows [hq * d] of q and out), query i seeing lens[i] positions, max_len
// the largest; offs[t]: where position t's row starts in the pools, for every t below max_len.
template <int D16, typename KV>
static void attend_tile_avx512(const float* q, int64_t nt, const int32_t* lens, int64_t max_len, const KV* kp,
                               const KV* vp, const int64_t* offs, int64_t hkv, int64_t group, double scale,
                               TileScratch& sc, float* out) {
  constexpr int64_t d = 16 * D16;
  constexpr int64_t per_pass = max_heads_per_pass<D16>();
  const int64_t hq = hkv * group;
  const int64_t stride = (max_len + 3) & ~int64_t(3);  // one head's scores; room for a last group's masked store
  sc.qv.resize(nt * hq * d);
  sc.scores.resize(nt * hq * stride);
  sc.acc.assign(nt * hq * d, 0.f);
  sc.mx.resize(nt * hq);
  sc.sum.resize(nt * hq);
  sc.best.assign(nt * hq, _mm512_set1_ps(-std::numeric_limits<float>::max()));
  for (int64_t x = 0; x < nt * hq * d; ++x) sc.qv[x] = q[x] * (float)scale;
  // Few query heads per KV head (none shared, as in SmolLM2): one query's rows alone would load each
  // K and V row for a multiply-add or two, so several queries' rows go through a span together.
  const int64_t packed = group * 2 <= per_pass ? per_pass / group : 1;
  if (packed > 1) {
    attend_tile_packed<D16, KV>(nt, lens, max_len, kp, vp, offs, hkv, group, packed, stride, sc);
  } else {
  for (int64_t hh = 0; hh < hkv; ++hh) {
    for (int64_t g0 = 0; g0 < group; g0 += per_pass) {
      const int64_t j = hh * group + g0;
      with_heads<D16>(std::min(per_pass, group - g0), [&](auto gc) {
        for (int64_t tb = 0; tb < max_len; tb += kTileSpan) {
          if (g0 == 0) prefetch_span_rows(kp, offs, tb + kTileSpan, max_len, hh * d, (int)(d * sizeof(KV)));
          for (int64_t i = 0; i < nt; ++i) {
            if (lens[i] <= tb) continue;
            const int64_t row = i * hq + j;
            score_span<D16, decltype(gc)::value, KV>(sc.qv.data() + row * d, kp, offs, tb,
                                                     std::min<int64_t>(tb + kTileSpan, lens[i]), lens[i], hh * d,
                                                     sc.scores.data() + row * stride, stride, sc.best.data() + row);
          }
        }
      });
    }
  }
  softmax_rows(nt, hq, lens, stride, sc);
  for (int64_t hh = 0; hh < hkv; ++hh) {
    for (int64_t g0 = 0; g0 < group; g0 += per_pass) {
      const int64_t j = hh * group + g0;
      with_heads<D16>(std::min(per_pass, group - g0), [&](auto gc) {
        for (int64_t tb = 0; tb < max_len; tb += kTileSpan) {
          if (g0 == 0) prefetch_span_rows(vp, offs, tb + kTileSpan, max_len, hh * d, (int)(d * sizeof(KV)));
          for (int64_t i = 0; i < nt; ++i) {
            if (lens[i] <= tb) continue;
            const int64_t row = i * hq + j;
            weigh_span<D16, decltype(gc)::value, KV>(vp, offs, tb, std::min<int64_t>(tb + kTileSpan, lens[i]),
                                                     hh * d, sc.scores.data() + row * stride, stride,
                                                     sc.acc.data() + row * d);
          }
        }
      });
    }
  }
  }
  for (int64_t row = 0; row < nt * hq; ++row) {
    const __m512 inv = _mm512_set1_ps(1.f / sc.sum[row]);
    for (int c = 0; c < D16; ++c)
      _mm512_storeu_ps(out + row * d + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(sc.acc.data() + row * d + 16 * c), inv));
  }
}

// Where position t's row starts in the pools, for t < len of the sequence whose block table is `table`.
static void row_offsets(const int32_t* table, int64_t len, int64_t block_size, int64_t row_stride,
                        std::vector<int64_t>& offs) {
  offs.resize(len);
  for (int64_t t = 0, b = 0; t < len; ++b)
    for (int64_t w = 0; w < block_size && t < len; ++w, ++t) offs[t] = ((int64_t)table[b] * block_size + w) * row_stride;
}

// The queries in tiles: runs of consecutive queries of one sequence (a prompt, a chunk, a decode with
// its proposed tokens), cut every kTileQueries. Returns false, doing nothing, when no two
// consecutive queries share a sequence (a plain decode batch: the one-query jobs suit it better).
template <typename KV>
static bool attend_tiles(const float* q, const KV* kp, const KV* vp, const int32_t* tables, const int32_t* rows,
                         const int32_t* kv_lens, float* out, int64_t n_tokens, int64_t hq, int64_t hkv, int64_t d,
                         int64_t block_size, int64_t table_width, double scale, int64_t wide16, int64_t max_threads) {
  std::vector<int64_t> starts;  // tile t holds queries [starts[t], starts[t + 1])
  bool shared = false;
  for (int64_t i = 0; i < n_tokens; ++i) {
    const bool same = i > 0 && rows[i] == rows[i - 1];
    shared |= same;
    if (!same || i - starts.back() == kTileQueries) starts.push_back(i);
  }
  if (!shared) return false;
  starts.push_back(n_tokens);
  const int64_t tiles = (int64_t)starts.size() - 1;
  // A tile costs what its queries cost.
  std::vector<int64_t> cost(tiles + 1, 0);
  for (int64_t t = 0; t < tiles; ++t) {
    int64_t c = 0;
    for (int64_t i = starts[t]; i < starts[t + 1]; ++i) c += query_cost(kv_lens[i]);
    cost[t + 1] = cost[t] + c;
  }
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(max_threads, tiles));
  std::vector<int64_t> bounds(threads + 1, tiles);
  bounds[0] = 0;
  for (int64_t part = 1, t = 0; part < threads; ++part) {
    while (t < tiles && cost[t] * threads < cost[tiles] * part) ++t;
    bounds[part] = t;
  }
  const int64_t group = hq / hkv, row_stride = hkv * d;
  chatloom_kernels::parallel_for(0, threads, 1, [&](int64_t first_part, int64_t end_part) {
    TileScratch scratch;
    std::vector<int64_t> offs;
    for (int64_t t = bounds[first_part]; t < bounds[end_part]; ++t) {
      const int64_t i0 = starts[t], nt = starts[t + 1] - i0;
      int64_t max_len = 0;
      for (int64_t i = i0; i < i0 + nt; ++i) max_len = std::max<int64_t>(max_len, kv_lens[i]);
      row_offsets(tables + (int64_t)rows[i0] * table_width, max_len, block_size, row_stride, offs);
      auto run = [&](auto d16) {
        attend_tile_avx512<decltype(d16)::value, KV>(q + i0 * hq * d, nt, kv_lens + i0, max_len, kp, vp, offs.data(),
                                                     hkv, group, scale, scratch, out + i0 * hq * d);
      };
      switch (wide16) {
        case 1: run(std::integral_constant<int, 1>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        case 4: run(std::integral_constant<int, 4>{}); break;
        default: run(std::integral_constant<int, 8>{}); break;
      }
    }
  });
  return true;
}
#endif

bool paged_attention_tiles(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                           const torch::Tensor& block_tables, const torch::Tensor& rows, const torch::Tensor& kv_lens,
                           double scale, torch::Tensor& out) {
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t bs = k_pool.size(1), hkv = k_pool.size(2);
  if (n < 2 || q.scalar_type() != torch::kFloat32 || !(d == 16 || d == 32 || d == 64 || d == 128)) return false;
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  const int64_t max_threads = attention_fits_one_thread(lens, n, hq, d) ? 1 : at::get_num_threads();
  auto run = [&](auto* kp, auto* vp) {
    return attend_tiles(q.data_ptr<float>(), kp, vp, block_tables.data_ptr<int32_t>(), rows.data_ptr<int32_t>(),
                        lens, out.data_ptr<float>(), n, hq, hkv, d, bs, block_tables.size(1), scale, d / 16,
                        max_threads);
  };
  switch (k_pool.scalar_type()) {
    case torch::kFloat32: return run(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
    case torch::kHalf: return run(k_pool.data_ptr<c10::Half>(), v_pool.data_ptr<c10::Half>());
    case torch::kBFloat16: return run(k_pool.data_ptr<c10::BFloat16>(), v_pool.data_ptr<c10::BFloat16>());
    default: return false;
  }
#else
  return false;
#endif
}
