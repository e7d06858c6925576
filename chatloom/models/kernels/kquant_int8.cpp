// y = x @ W^T (+ bias) for Q4_K and Q6_K super-block panels (kquant_panels.cpp's layout, kinds 2 and
// 3) with int8 activations and integer dot products, the way llama.cpp runs K-quants on CPUs.
//
// Each row of x is quantized once per matmul, per block of 32 along K: s = max|x| / 127,
// q = round(x / s). Within an 8-depth step the quantized row is stored as depths 0, 2, 4, 6, 1, 3,
// 5, 7, so that the codes' low nibbles (depths 0, 2, 4, 6 of a lane's 32-bit word) and high nibbles
// (1, 3, 5, 7) each meet four consecutive activation bytes: VPDPBUSD then sums 4 code x int8
// products per feature, 16 features an instruction, straight from the file's 4-bit codes.
//
//   Q4_K, sub-block g of 32:  sum_k w x = s (d sc_g) sum(c q) - (dmin mn_g) s sum(q)
//   Q6_K, sub-block g of 16:  sum_k w x = s (d sc_g) (sum(c q) - 32 sum(q))
//
// The integer sums are exact; the float steps run once per sub-block and row. A row's result does
// not depend on the other rows of the batch. Q6_K's high code bits are stored for this path in the
// int8 order: in a 64-byte word of 16 depths, bits 2t..2t+1 of byte b of lane j hold feature j's
// depth 8 (t / 2) + 2b + (t % 2), so one shift and mask per 4 depths puts them beside the low nibble.
#include "kquant_int8.h"
#include "kernels.h"
#include "panel_tile.h"

#include <cpuid.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using chatloom_kernels::kPanel;
constexpr int64_t kSuper = 256, kBlock = 32;
constexpr uint8_t kQ4K = 2, kQ6K = 3;
constexpr int64_t kQ4KBytes = 2368, kQ6KBytes = 3360;
constexpr int64_t kQ4KCodes = 320, kQ6KLow = 288, kQ6KHigh = 2336;
constexpr int64_t kFewRows = 12;
constexpr int64_t kTaskPanels = 4;
// Rows per block of the many-row path: a multiple of both wide tiles' rows (10 and 8).
constexpr int64_t kRowBlock = 80;
// How far ahead the kernels prefetch the weights, per CPU (measured with `chatloom bench
// kquant-matmul`, GB/s of the panels' bytes in thread CPU time, one thread). One row: on the 2-core
// EPYC of Zen 5 one thread streamed the most at 6 KiB into L1, and at 4 and 8 KiB Q6_K fell to two
// thirds of that; on a 2-core Xeon (Emerald Rapids) 12 KiB into L2 streamed 0.85-0.90 of the float32
// rate where 6 KiB into L1 streamed 0.78-0.83; on a 2-core EPYC of Zen 4, 6 KiB into L1 streamed
// Q6_K at 8.3-8.7 GB/s, 12 KiB into L2 at 17-19 and 8 KiB into L2 at 20.7-22.5 (Q4_K 16.5, 17-19
// and 18-20), and a 3B decode step took 4-5 ms less at 8 KiB than at 12. Several rows: 1 KiB on Zen 5;
// 4 KiB on the Xeon, where at 1 KiB Q6_K streamed half the float32 rate at 4 and 8 rows, and on Zen 4
// (Q6_K at 4 rows 11 GB/s against 8.2-8.9).
struct Prefetch {
  int64_t row_ahead;  // one-row kernel
  bool row_to_l2;     // its prefetches go to L2 (_MM_HINT_T1), not L1
  int64_t ahead;      // the kernels of several rows
};
// The CPU's family from CPUID leaf 1 (AMD: 0x19 Zen 3 and 4, 0x1A Zen 5).
unsigned cpu_family() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
  const unsigned base = (eax >> 8) & 0xF;
  return base == 0xF ? base + ((eax >> 20) & 0xFF) : base;
}
const Prefetch kPrefetch = [] {
  __builtin_cpu_init();
  if (!__builtin_cpu_is("amd")) return Prefetch{12288, true, 4096};
  return cpu_family() >= 0x1A ? Prefetch{6144, false, 1024} : Prefetch{8192, true, 4096};
}();

// The quantized rows: q [m, K] (each 8 depths in the order above), per block of 32 the scale s and
// s * sum(q), and per 16 depths -32 * sum(q) (Q6_K's code offset, the integer sums' starting value).
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> scale, msum;
  std::vector<int32_t> offset16;
  int64_t k_dim = 0;
  void resize(int64_t m, int64_t k) {
    k_dim = k;
    q.resize(m * k);
    scale.resize(m * k / kBlock);
    msum.resize(m * k / kBlock);
    offset16.resize(m * k / 16);
  }
};

// Row r's pointers into Activations.
struct RowPtrs {
  const int8_t* q;
  const float *scale, *msum;
  const int32_t* offset16;
  int64_t k_dim;
  RowPtrs at(int64_t r) const {
    return {q + r * k_dim, scale + r * (k_dim / kBlock), msum + r * (k_dim / kBlock), offset16 + r * (k_dim / 16),
            k_dim};
  }
};

RowPtrs rows_of(const Activations& a) {
  return {a.q.data(), a.scale.data(), a.msum.data(), a.offset16.data(), a.k_dim};
}

#if defined(__GNUC__) && defined(__x86_64__)
#define CHATLOOM_HAVE_KQUANT_INT8 1
#define CHATLOOM_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

CHATLOOM_VNNI void quantize_row(const float* x, int64_t k_dim, int8_t* q, float* scale, float* msum,
                                int32_t* offset16) {
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t b = 0; b < k_dim / kBlock; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * kBlock), v1 = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float s = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    // Rounded to nearest, ties to even (the default rounding mode); |x / s| <= 127 up to one
    // rounding, and the saturating narrowing below keeps it there.
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    const __m128i b0 = _mm512_cvtsepi32_epi8(i0), b1 = _mm512_cvtsepi32_epi8(i1);
    const int32_t s0 = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(b0));
    const int32_t s1 = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(b1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm_shuffle_epi8(b0, order));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm_shuffle_epi8(b1, order));
    scale[b] = s;
    msum[b] = s * (float)(s0 + s1);
    offset16[2 * b] = -32 * s0;
    offset16[2 * b + 1] = -32 * s1;
  }
}

CHATLOOM_VNNI inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
CHATLOOM_VNNI inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
CHATLOOM_VNNI inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
CHATLOOM_VNNI inline __m512i word(const uint8_t* p) { return _mm512_loadu_si512(p); }
CHATLOOM_VNNI inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}
// Keeps v as computed: -ffast-math may otherwise regroup a product of products (d * sc * s) in one
// kernel and not in another, and the row kernel must give the tiles' bits.
CHATLOOM_VNNI inline void keep(__m512& v) { __asm__("" : "+v"(v)); }
// a | (b & c), bit by bit.
CHATLOOM_VNNI inline __m512i or_masked(__m512i a, __m512i b, __m512i c) {
  return _mm512_ternarylogic_epi32(a, b, c, 0xF8);
}

// R rows (from x) against NP panels of one kind from panel p0, into out's rows (ldo apart).
// Kept out of line: inlined into run_panels' loop over row tiles, it ran the Q6_K 8-row matmul
// about 15% slower.
template <int R, int NP, int KIND>
__attribute__((noinline)) CHATLOOM_VNNI void tile(const RowPtrs& x, const KQuantInt8Weights& w, int64_t p0, float* out) {
  const int64_t k_dim = w.k_dim, nb32 = k_dim / kBlock, nb16 = k_dim / 16;
  const uint8_t* base[NP];
  for (int i = 0; i < NP; ++i) base[i] = w.blob + w.offsets[p0 + i];
  const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
  __m512 acc[NP][R];
  for (int i = 0; i < NP; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < k_dim / kSuper; ++sb) {
    const uint8_t* b[NP];
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) b[i] = base[i] + sb * (KIND == kQ4K ? kQ4KBytes : kQ6KBytes);
    if constexpr (KIND == kQ4K) {
      for (int g = 0; g < 8; ++g) {
        __m512i s[NP][R];
#pragma GCC unroll 4
        for (int i = 0; i < NP; ++i)
#pragma GCC unroll 6
          for (int r = 0; r < R; ++r) s[i][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int wd = 0; wd < 4; ++wd) {
          const int64_t at = kQ4KCodes + (g * 4 + wd) * 64, k8 = sb * kSuper + g * 32 + wd * 8;
#pragma GCC unroll 4
          for (int i = 0; i < NP; ++i) {
            _mm_prefetch(reinterpret_cast<const char*>(b[i] + at + kPrefetch.ahead), _MM_HINT_T0);
            const __m512i v = word(b[i] + at);
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 6
            for (int r = 0; r < R; ++r) {
              const int8_t* xq = x.q + r * k_dim + k8;
              s[i][r] = _mm512_dpbusd_epi32(s[i][r], lo, bcast4(xq));
              s[i][r] = _mm512_dpbusd_epi32(s[i][r], hi, bcast4(xq + 4));
            }
          }
        }
        const int64_t kb = sb * 8 + g;
#pragma GCC unroll 4
        for (int i = 0; i < NP; ++i) {
          const __m512 d1 = _mm512_mul_ps(half16(b[i]), u8x16(b[i] + 64 + 16 * g));
          const __m512 m1 = _mm512_mul_ps(half16(b[i] + 32), u8x16(b[i] + 192 + 16 * g));
#pragma GCC unroll 6
          for (int r = 0; r < R; ++r) {
            const __m512 ds = _mm512_mul_ps(d1, _mm512_set1_ps(x.scale[r * nb32 + kb]));
            acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][r]), ds, acc[i][r]);
            acc[i][r] = _mm512_fnmadd_ps(m1, _mm512_set1_ps(x.msum[r * nb32 + kb]), acc[i][r]);
          }
        }
      }
    } else {
      for (int g = 0; g < 16; ++g) {
        __m512i s[NP][R];
#pragma GCC unroll 4
        for (int i = 0; i < NP; ++i)
#pragma GCC unroll 6
          for (int r = 0; r < R; ++r) s[i][r] = _mm512_set1_epi32(x.offset16[r * nb16 + sb * 16 + g]);
#pragma GCC unroll 2
        for (int wd = 0; wd < 2; ++wd) {
          const int64_t at = kQ6KLow + (g * 2 + wd) * 64, k8 = sb * kSuper + g * 16 + wd * 8;
#pragma GCC unroll 4
          for (int i = 0; i < NP; ++i) {
            _mm_prefetch(reinterpret_cast<const char*>(b[i] + at + kPrefetch.ahead), _MM_HINT_T0);
            if (wd == 0) _mm_prefetch(reinterpret_cast<const char*>(b[i] + kQ6KHigh + g * 64 + kPrefetch.ahead), _MM_HINT_T0);
            const __m512i v = word(b[i] + at), h = word(b[i] + kQ6KHigh + g * 64);
            // The high bits of depths 2b (lo) and 2b + 1 (hi) of this word: fields 2 wd and 2 wd + 1.
            const __m512i hl = wd == 0 ? _mm512_slli_epi16(h, 4) : h;
            const __m512i hh = wd == 0 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2);
            const __m512i lo = or_masked(_mm512_and_si512(v, low4), hl, top2);
            const __m512i hi = or_masked(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), hh, top2);
#pragma GCC unroll 6
            for (int r = 0; r < R; ++r) {
              const int8_t* xq = x.q + r * k_dim + k8;
              s[i][r] = _mm512_dpbusd_epi32(s[i][r], lo, bcast4(xq));
              s[i][r] = _mm512_dpbusd_epi32(s[i][r], hi, bcast4(xq + 4));
            }
          }
        }
        const int64_t kb = sb * 8 + g / 2;
#pragma GCC unroll 4
        for (int i = 0; i < NP; ++i) {
          const __m512 d1 = _mm512_mul_ps(half16(b[i]), i8x16(b[i] + 32 + 16 * g));
#pragma GCC unroll 6
          for (int r = 0; r < R; ++r) {
            const __m512 ds = _mm512_mul_ps(d1, _mm512_set1_ps(x.scale[r * nb32 + kb]));
            acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][r]), ds, acc[i][r]);
          }
        }
      }
    }
  }
  for (int i = 0; i < NP; ++i) {
    const int64_t col = (p0 + i) * kPanel, ncols = std::min(kPanel, w.out_features - col);
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
    const __m512 bv = w.bias ? _mm512_maskz_loadu_ps(mask, w.bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * w.out_features + col, mask, _mm512_add_ps(acc[i][r], bv));
  }
}

// One row against one panel: tile<1, 1>'s float steps in the same order (so the same bits), with
// less work per code word and the panel's bytes prefetched as one stream. A decode step at one
// sequence is this kernel against every weight, and it is bound by how fast one thread pulls the
// bytes in: a task's panels lie end to end, and one panel at a time reads them in order, where
// several panels at once read as many streams. Each super-block's float16 d and dmin are widened
// once, not once per sub-block. A Q4_K word's high nibbles are multiplied where they lie (16 c: one
// mask, no shift) in sums of their own, divided by 16, exactly, once per sub-block. The integer sums
// run as two chains each so that the dot products' latency stays hidden with one panel.
//
// Prefetches run kPrefetch.row_ahead bytes ahead of the super-block being read, one line per slot, the slots
// spread over the super-block (a word of codes, and a sub-block's scales) so that together they
// cover every line of the stream, headers included, once.
template <int KIND>
CHATLOOM_VNNI void row_tile(const RowPtrs& x, const KQuantInt8Weights& w, int64_t p, float* out) {
  const uint8_t* base = w.blob + w.offsets[p];
  const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
  const int64_t distance = kPrefetch.row_ahead;
  const bool to_l2 = kPrefetch.row_to_l2;
  const auto ahead = [distance, to_l2](const uint8_t* at) {
    const char* line = reinterpret_cast<const char*>(at + distance);
    if (to_l2) _mm_prefetch(line, _MM_HINT_T1);
    else _mm_prefetch(line, _MM_HINT_T0);
  };
  __m512 acc = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < w.k_dim / kSuper; ++sb) {
    const uint8_t* b = base + sb * (KIND == kQ4K ? kQ4KBytes : kQ6KBytes);
    const __m512 d = half16(b);
    if constexpr (KIND == kQ4K) {
      const __m512 dmin = half16(b + 32);
      for (int g = 0; g < 8; ++g) {
        __m512i lo[2], hi[2];
        lo[0] = lo[1] = hi[0] = hi[1] = _mm512_setzero_si512();
        ahead(b + 2048 + 64 * g);  // 32 words and 8 of these: 2,560 bytes, a super-block is 2,368
#pragma GCC unroll 4
        for (int wd = 0; wd < 4; ++wd) {
          const int64_t k8 = sb * kSuper + g * 32 + wd * 8;
          ahead(b + (g * 4 + wd) * 64);
          const __m512i v = word(b + kQ4KCodes + (g * 4 + wd) * 64);
          lo[wd & 1] = _mm512_dpbusd_epi32(lo[wd & 1], _mm512_and_si512(v, low4), bcast4(x.q + k8));
          hi[wd & 1] = _mm512_dpbusd_epi32(hi[wd & 1], _mm512_andnot_si512(low4, v), bcast4(x.q + k8 + 4));
        }
        const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(lo[0], _mm512_srai_epi32(hi[0], 4)),
                                             _mm512_add_epi32(lo[1], _mm512_srai_epi32(hi[1], 4)));
        const int64_t kb = sb * 8 + g;
        __m512 d1 = _mm512_mul_ps(d, u8x16(b + 64 + 16 * g));
        keep(d1);
        const __m512 m1 = _mm512_mul_ps(dmin, u8x16(b + 192 + 16 * g));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d1, _mm512_set1_ps(x.scale[kb])), acc);
        acc = _mm512_fnmadd_ps(m1, _mm512_set1_ps(x.msum[kb]), acc);
      }
    } else {
      for (int g = 0; g < 16; ++g) {
        __m512i lo = _mm512_set1_epi32(x.offset16[sb * 16 + g]), hi = _mm512_setzero_si512();
        const __m512i h = word(b + kQ6KHigh + g * 64);
        ahead(b + 2048 + 64 * g);  // 32 words, 16 of these and 8 more: 3,584 bytes, a super-block is 3,360
        if (g % 2 == 0) ahead(b + 3072 + 32 * g);
#pragma GCC unroll 2
        for (int wd = 0; wd < 2; ++wd) {
          const int64_t k8 = sb * kSuper + g * 16 + wd * 8;
          ahead(b + (g * 2 + wd) * 64);
          const __m512i v = word(b + kQ6KLow + (g * 2 + wd) * 64);
          // The high bits of depths 2b (lo) and 2b + 1 (hi) of this word: fields 2 wd and 2 wd + 1.
          const __m512i hl = wd == 0 ? _mm512_slli_epi16(h, 4) : h;
          const __m512i hh = wd == 0 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2);
          const __m512i cl = or_masked(_mm512_and_si512(v, low4), hl, top2);
          const __m512i ch = or_masked(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), hh, top2);
          lo = _mm512_dpbusd_epi32(lo, cl, bcast4(x.q + k8));
          hi = _mm512_dpbusd_epi32(hi, ch, bcast4(x.q + k8 + 4));
        }
        __m512 d1 = _mm512_mul_ps(d, i8x16(b + 32 + 16 * g));
        keep(d1);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)),
                              _mm512_mul_ps(d1, _mm512_set1_ps(x.scale[sb * 8 + g / 2])), acc);
      }
    }
  }
  const int64_t col = p * kPanel, ncols = std::min(kPanel, w.out_features - col);
  const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
  const __m512 bv = w.bias ? _mm512_maskz_loadu_ps(mask, w.bias + col) : _mm512_setzero_ps();
  _mm512_mask_storeu_ps(out + col, mask, _mm512_add_ps(acc, bv));
}

// Panels [p0, p0 + np) of one kind against one row. Their first kPrefetch.row_ahead bytes are prefetched at
// once: a task's stream starts cold, and its panels' own prefetches only run ahead of what they read.
template <int KIND>
CHATLOOM_VNNI void row_run(const RowPtrs& x, const KQuantInt8Weights& w, int64_t p0, int64_t np, float* out) {
  const uint8_t* first = w.blob + w.offsets[p0];
  const int64_t bytes = std::min<int64_t>(kPrefetch.row_ahead, w.offsets[p0 + np] - w.offsets[p0]);
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(first + at), _MM_HINT_T0);
  for (int64_t i = 0; i < np; ++i) row_tile<KIND>(x, w, p0 + i, out);
}

// Panels [p0, p0 + np) of one kind against R rows, as many panels at a time as keep the integer
// sums and float accumulators (2 R NP vectors) with the unpacked codes in the 32 registers.
template <int R, int KIND>
CHATLOOM_VNNI void tile_run(const RowPtrs& x, const KQuantInt8Weights& w, int64_t p0, int64_t np, float* out) {
  constexpr int kMax = R <= 2 ? 4 : R <= 3 ? 3 : 2;
  for (int64_t i = 0; i < np;) {
    const int64_t n = std::min<int64_t>(kMax, np - i);
    switch (n) {
      case 4: tile<R, (kMax >= 4 ? 4 : 1), KIND>(x, w, p0 + i, out); break;
      case 3: tile<R, (kMax >= 3 ? 3 : 1), KIND>(x, w, p0 + i, out); break;
      case 2: tile<R, 2, KIND>(x, w, p0 + i, out); break;
      default: tile<R, 1, KIND>(x, w, p0 + i, out); break;
    }
    i += n;
  }
}

// Many rows (a prefill): R rows x NP panels with the integer sums of one sub-block in registers and
// the float accumulators in memory (L1). tile() above keeps both in registers, which caps it at
// 6 x 2 and spills there; here the 32 registers hold 2 R NP sums, the NP panels' unpacked codes and
// two activation broadcasts, so each unpacked code vector meets R rows and each broadcast NP panels.
// The float steps per sub-block and row are tile()'s, in its order, so a row's bits are the same.
template <int R, int NP, int KIND>
CHATLOOM_VNNI void wide_tile(const RowPtrs& x, const KQuantInt8Weights& w, int64_t p0, float* out) {
  const int64_t k_dim = w.k_dim, nb32 = k_dim / kBlock, nb16 = k_dim / 16;
  const uint8_t* base[NP];
  for (int i = 0; i < NP; ++i) base[i] = w.blob + w.offsets[p0 + i];
  const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
  alignas(64) float acc[NP][R][kPanel];
  for (int i = 0; i < NP; ++i)
    for (int r = 0; r < R; ++r) _mm512_store_ps(acc[i][r], _mm512_setzero_ps());
  for (int64_t sb = 0; sb < k_dim / kSuper; ++sb) {
    const uint8_t* b[NP];
    for (int i = 0; i < NP; ++i) b[i] = base[i] + sb * (KIND == kQ4K ? kQ4KBytes : kQ6KBytes);
    constexpr int kGroups = KIND == kQ4K ? 8 : 16, kWords = KIND == kQ4K ? 4 : 2;
    for (int g = 0; g < kGroups; ++g) {
      __m512i s[NP][R];
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512i start =
            KIND == kQ4K ? _mm512_setzero_si512() : _mm512_set1_epi32(x.offset16[r * nb16 + sb * 16 + g]);
#pragma GCC unroll 2
        for (int i = 0; i < NP; ++i) s[i][r] = start;
      }
#pragma GCC unroll 4
      for (int wd = 0; wd < kWords; ++wd) {
        const int64_t k8 = sb * kSuper + g * (KIND == kQ4K ? 32 : 16) + wd * 8;
        __m512i lo[NP], hi[NP];
#pragma GCC unroll 2
        for (int i = 0; i < NP; ++i) {
          if constexpr (KIND == kQ4K) {
            const int64_t at = kQ4KCodes + (g * 4 + wd) * 64;
            _mm_prefetch(reinterpret_cast<const char*>(b[i] + at + kPrefetch.ahead), _MM_HINT_T0);
            const __m512i v = word(b[i] + at);
            lo[i] = _mm512_and_si512(v, low4);
            hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          } else {
            const int64_t at = kQ6KLow + (g * 2 + wd) * 64;
            _mm_prefetch(reinterpret_cast<const char*>(b[i] + at + kPrefetch.ahead), _MM_HINT_T0);
            if (wd == 0) _mm_prefetch(reinterpret_cast<const char*>(b[i] + kQ6KHigh + g * 64 + kPrefetch.ahead), _MM_HINT_T0);
            const __m512i v = word(b[i] + at), h = word(b[i] + kQ6KHigh + g * 64);
            const __m512i hl = wd == 0 ? _mm512_slli_epi16(h, 4) : h;
            const __m512i hh = wd == 0 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2);
            lo[i] = or_masked(_mm512_and_si512(v, low4), hl, top2);
            hi[i] = or_masked(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), hh, top2);
          }
        }
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + r * k_dim + k8;
          const __m512i x0 = bcast4(xq), x1 = bcast4(xq + 4);
#pragma GCC unroll 2
          for (int i = 0; i < NP; ++i) {
            s[i][r] = _mm512_dpbusd_epi32(s[i][r], lo[i], x0);
            s[i][r] = _mm512_dpbusd_epi32(s[i][r], hi[i], x1);
          }
        }
      }
      const int64_t kb = sb * 8 + (KIND == kQ4K ? g : g / 2);
#pragma GCC unroll 2
      for (int i = 0; i < NP; ++i) {
        const __m512 d1 = KIND == kQ4K ? _mm512_mul_ps(half16(b[i]), u8x16(b[i] + 64 + 16 * g))
                                       : _mm512_mul_ps(half16(b[i]), i8x16(b[i] + 32 + 16 * g));
        const __m512 m1 = KIND == kQ4K ? _mm512_mul_ps(half16(b[i] + 32), u8x16(b[i] + 192 + 16 * g))
                                       : _mm512_setzero_ps();
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const __m512 ds = _mm512_mul_ps(d1, _mm512_set1_ps(x.scale[r * nb32 + kb]));
          __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][r]), ds, _mm512_load_ps(acc[i][r]));
          if constexpr (KIND == kQ4K) a = _mm512_fnmadd_ps(m1, _mm512_set1_ps(x.msum[r * nb32 + kb]), a);
          _mm512_store_ps(acc[i][r], a);
        }
      }
    }
  }
  for (int i = 0; i < NP; ++i) {
    const int64_t col = (p0 + i) * kPanel, ncols = std::min(kPanel, w.out_features - col);
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
    const __m512 bv = w.bias ? _mm512_maskz_loadu_ps(mask, w.bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + r * w.out_features + col, mask, _mm512_add_ps(_mm512_load_ps(acc[i][r]), bv));
  }
}

// Rows of a wide tile per kind: 2 R + 4 sums and codes, plus Q6_K's high codes and mask, within the
// 32 registers with room for the broadcasts.
constexpr int64_t kWideRowsQ4K = 10, kWideRowsQ6K = 8;

// Rows [r0, r1) against panels [p0, p1) of one kind: whole wide tiles of R rows over pairs of panels,
// and the rows left over (fewer than R) in tile()'s tiles.
template <int R, int KIND>
CHATLOOM_VNNI void wide_run(const RowPtrs& x, const KQuantInt8Weights& w, int64_t r0, int64_t r1, int64_t p0,
                            int64_t p1, float* out) {
  int64_t m = r0;
  for (; m + R <= r1; m += R) {
    const RowPtrs xr = x.at(m);
    float* orow = out + m * w.out_features;
    int64_t p = p0;
    for (; p + 2 <= p1; p += 2) wide_tile<R, 2, KIND>(xr, w, p, orow);
    if (p < p1) wide_tile<R, 1, KIND>(xr, w, p, orow);
  }
  chatloom_kernels::for_each_row_tile(m, r1, [&](int64_t mm, int64_t rows) {
    const RowPtrs xr = x.at(mm);
    float* orow = out + mm * w.out_features;
    chatloom_kernels::with_tile_rows(rows, [&](auto r) {
      constexpr int RR = decltype(r)::value;
      tile_run<RR, KIND>(xr, w, p0, p1 - p0, orow);
    });
  });
}

// The many-row path's task: rows [r0, r1) against panels [p0, p1), each run of one kind in wide tiles.
CHATLOOM_VNNI void run_panels_wide(const RowPtrs& x, const KQuantInt8Weights& w, int64_t r0, int64_t r1, int64_t p0,
                                   int64_t p1, float* out) {
  for (int64_t a = p0; a < p1;) {
    int64_t b = a + 1;
    while (b < p1 && w.kinds[b] == w.kinds[a]) ++b;
    if (w.kinds[a] == kQ4K) wide_run<kWideRowsQ4K, kQ4K>(x, w, r0, r1, a, b, out);
    else wide_run<kWideRowsQ6K, kQ6K>(x, w, r0, r1, a, b, out);
    a = b;
  }
}

// Rows [r0, r1) of the quantized x against panels [p0, p1), each run of one kind in tiles of rows.
CHATLOOM_VNNI void run_panels(const RowPtrs& x, const KQuantInt8Weights& w, int64_t r0, int64_t r1, int64_t p0,
                              int64_t p1, float* out) {
  for (int64_t a = p0; a < p1;) {
    int64_t b = a + 1;
    while (b < p1 && w.kinds[b] == w.kinds[a]) ++b;
    const bool q4 = w.kinds[a] == kQ4K;
    if (r1 - r0 == 1) {
      if (q4) row_run<kQ4K>(x.at(r0), w, a, b - a, out + r0 * w.out_features);
      else row_run<kQ6K>(x.at(r0), w, a, b - a, out + r0 * w.out_features);
      a = b;
      continue;
    }
    chatloom_kernels::for_each_row_tile(r0, r1, [&](int64_t m, int64_t rows) {
      const RowPtrs xr = x.at(m);
      float* orow = out + m * w.out_features;
      chatloom_kernels::with_tile_rows(rows, [&](auto r) {
        constexpr int R = decltype(r)::value;
        if (q4) tile_run<R, kQ4K>(xr, w, a, b - a, orow);
        else tile_run<R, kQ6K>(xr, w, a, b - a, orow);
      });
    });
    a = b;
  }
}

bool cpu_ok() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

void quantize_rows(const float* x, int64_t m, int64_t k_dim, Activations& a, bool parallel) {
  a.resize(m, k_dim);
  const auto one = [&](int64_t r) {
    quantize_row(x + r * k_dim, k_dim, a.q.data() + r * k_dim, a.scale.data() + r * (k_dim / kBlock),
                 a.msum.data() + r * (k_dim / kBlock), a.offset16.data() + r * (k_dim / 16));
  };
  if (!parallel) {
    for (int64_t r = 0; r < m; ++r) one(r);
    return;
  }
  chatloom_kernels::parallel_for(0, m, std::max<int64_t>(1, 65536 / k_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) one(r);
  });
}
#else
bool cpu_ok() { return false; }
#endif

}  // namespace

bool kquant_int8_supported() { return cpu_ok(); }

void kquant_int8_matmul(const KQuantInt8Weights& w, const float* x, int64_t m, float* out) {
#ifdef CHATLOOM_HAVE_KQUANT_INT8
  TORCH_CHECK(cpu_ok(), "the int8 K-quant matmul needs AVX-512 VNNI");
  Activations a;
  quantize_rows(x, m, w.k_dim, a, m > kFewRows);
  const RowPtrs rows = rows_of(a);
  const int64_t groups = (w.panels + kTaskPanels - 1) / kTaskPanels;
  if (m <= kFewRows) {
    const int64_t grain = std::max<int64_t>(1, 200000 / (2 * m * w.k_dim * kPanel * kTaskPanels));
    chatloom_kernels::parallel_for_dynamic(groups, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        run_panels(rows, w, 0, m, t * kTaskPanels, std::min(w.panels, (t + 1) * kTaskPanels), out);
    });
    return;
  }
  // Many rows: a block of rows at a time, so that its quantized rows stay in the caches while each
  // group of panels comes from memory once per block.
  for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
    const int64_t m1 = std::min(m, m0 + kRowBlock);
    chatloom_kernels::parallel_for_dynamic(groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        run_panels_wide(rows, w, m0, m1, t * kTaskPanels, std::min(w.panels, (t + 1) * kTaskPanels), out);
    });
  }
#else
  TORCH_CHECK(false, "the int8 K-quant matmul needs AVX-512 VNNI");
#endif
}

void kquant_int8_panels(const KQuantInt8Weights& w, const float* x, int64_t m, int64_t p0, int64_t p1, float* out,
                        int64_t x_version) {
#ifdef CHATLOOM_HAVE_KQUANT_INT8
  // The decode team runs a matmul as tasks on its threads, each handed the same float rows: a thread
  // quantizes them once. A versioned input is known by its version and address alone (no second
  // read of the rows per task); otherwise a copy tells the next matmul's rows apart.
  struct Cached {
    std::vector<float> rows;
    Activations a;
    const float* x = nullptr;
    int64_t version = -1;
  };
  thread_local Cached cached;
  const int64_t n = m * w.k_dim;
  const bool same_size = cached.a.k_dim == w.k_dim && (int64_t)cached.a.q.size() == n;
  if (x_version >= 0) {
    if (!(same_size && cached.version == x_version && cached.x == x)) {
      quantize_rows(x, m, w.k_dim, cached.a, false);
      cached.rows.clear();
      cached.x = x;
      cached.version = x_version;
    }
  } else if ((int64_t)cached.rows.size() != n || cached.a.k_dim != w.k_dim ||
             std::memcmp(cached.rows.data(), x, n * sizeof(float)) != 0) {
    cached.rows.assign(x, x + n);
    quantize_rows(x, m, w.k_dim, cached.a, false);
    cached.x = nullptr;
    cached.version = -1;
  }
  run_panels(rows_of(cached.a), w, 0, m, p0, p1, out);
#else
  TORCH_CHECK(false, "the int8 K-quant matmul needs AVX-512 VNNI");
#endif
}
