// y = x @ W^T (+ bias) for GGUF Q4_K and Q6_K weights kept in their super-blocks: a decode step reads
// about the bytes the file holds (4.625 bits a Q4_K weight, 6.5625 a Q6_K one), where the group-scale
// layouts (quantized_linear's nibbles with a float32 d and m per 32, grouped_quantized_linear's int8
// codes with a d and m per 16) read 6 and 12 bits. The weights' values, and so the results' bits, are
// those of gguf's dequantizer followed by the float32 packed kernel, at every row count.
//
// blob: the panels one after the other; panel p (16 output features) starts at offsets[p] and holds
// K / 256 super-blocks of kinds[p] (a fused layer's parts each keep their own kind):
//
//   Q4_K, 2368 bytes: d[16] f16 | dmin[16] f16 | sc[8][16] u8 | mn[8][16] u8 | codes, 32 words of 64 bytes
//   Q6_K, 3360 bytes: d[16] f16 | sc[16][16] i8 | low codes, 32 words of 64 bytes | high codes, 16 words
//
// Kinds 2 and 3 are the same super-blocks multiplied with int8 activations (kquant_int8.cpp), Q6_K's
// high codes then in that path's order; a layer's panels are all of the exact kinds or all int8.
//
// [g][j] is group g of feature j. A 64-byte word of low codes is 16 uint32 lanes, lane j holding feature
// j's 4-bit codes at 8 depths (depth 8w + t in bits 4t..4t+3, as quantized_linear's nibble words); a
// word of Q6_K high codes holds 16 depths of the codes' top two bits (depth 16h + t in bits 2t..2t+1).
//
// A weight is fma(q, d1, m1) with q the unsigned code and, exactly in float32 (the factors have few
// significant bits):  Q4_K  d1 = d * sc, m1 = -(dmin * mn);  Q6_K  d1 = d * sc, m1 = -32 d1.
// gguf computes d1 * q - m1 and (d * sc) * (q - 32): the same values with the same single rounding
// (none at all for Q6_K). Each output is one FMA chain over k in increasing order, as in packed_linear.
#include "kernels.h"
#include "kquant_int8.h"
#include "panel_tile.h"

#include <algorithm>
#include <memory>

namespace {

using chatloom_kernels::kPanel;
constexpr int64_t kSuper = 256;  // weights per super-block along K
constexpr uint8_t kQ4K = 0, kQ6K = 1;
constexpr int64_t kQ4KBytes = 2368, kQ6KBytes = 3360;
constexpr int64_t kQ4KCodes = 320, kQ6KLow = 288, kQ6KHigh = 2336;  // where the codes start
constexpr int64_t kFewRows = 12;  // up to here weights are expanded in registers, once per tile of rows
constexpr int64_t kTaskPanels = 4;
constexpr int64_t kRowBlock = 96;
// Bytes ahead in each panel's stream that the tiles prefetch: at one row a task is 4 streams that the
// hardware prefetcher picks up late at every new task.
constexpr int64_t kAhead = 1024;

constexpr uint8_t kInt8Kinds = 2;  // kinds 2 and 3: Q4_K and Q6_K for the int8 path
int64_t super_bytes(uint8_t kind) { return (kind & 1) == kQ4K ? kQ4KBytes : kQ6KBytes; }
bool int8_kind(uint8_t kind) { return kind >= kInt8Kinds; }

struct Panels {
  const uint8_t* blob;
  const int64_t* offsets;
  const uint8_t* kinds;
  int64_t panels, k_dim, out_features;
  const float* bias;
};

#if defined(__GNUC__) && defined(__x86_64__)
#define CHATLOOM_HAVE_KQUANT_PANELS 1

CHATLOOM_WIDE inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
CHATLOOM_WIDE inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
CHATLOOM_WIDE inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
CHATLOOM_WIDE inline __m512i word(const uint8_t* p) { return _mm512_loadu_si512(p); }
// Keeps an expanded weight vector in a register (see gemm.cpp's in_register).
CHATLOOM_WIDE inline void keep(__m512& v) { __asm__("" : "+v"(v)); }

// Calls use(k, w) for k = 0 .. K - 1 in order, w[i] being panel i's 16 weights at depth k, expanded
// in registers from KIND's layout (see the top of the file). `use` is a functor whose call operator
// has the AVX-512 target too (a lambda would not).
template <int NP, int KIND, typename Use>
CHATLOOM_WIDE inline void walk(const uint8_t* const (&base)[NP], int64_t k_dim, const Use& use) {
  const __m512 nibble_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t sb = 0; sb < k_dim / kSuper; ++sb) {
    const uint8_t* b[NP];
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) b[i] = base[i] + sb * (KIND == kQ4K ? kQ4KBytes : kQ6KBytes);
    if constexpr (KIND == kQ4K) {
      __m512 dd[NP], dm[NP];
#pragma GCC unroll 4
      for (int i = 0; i < NP; ++i) {
        dd[i] = half16(b[i]);
        dm[i] = _mm512_mul_ps(half16(b[i] + 32), _mm512_set1_ps(-1.f));  // -dmin: exact, zeros' signs too
      }
      for (int g = 0; g < 8; ++g) {
        __m512 d[NP], m[NP];
#pragma GCC unroll 4
        for (int i = 0; i < NP; ++i) {
          d[i] = _mm512_mul_ps(dd[i], u8x16(b[i] + 64 + 16 * g));
          m[i] = _mm512_mul_ps(dm[i], u8x16(b[i] + 192 + 16 * g));
        }
        for (int w = 0; w < 4; ++w) {
          const int64_t at = kQ4KCodes + (g * 4 + w) * 64;
          __m512i v[NP];
#pragma GCC unroll 4
          for (int i = 0; i < NP; ++i) {
            _mm_prefetch(reinterpret_cast<const char*>(b[i] + at + kAhead), _MM_HINT_T0);
            v[i] = word(b[i] + at);
          }
          const int64_t k0 = sb * kSuper + g * 32 + w * 8;
#pragma GCC unroll 8
          for (int t = 0; t < 8; ++t) {
            __m512 wt[NP];
#pragma GCC unroll 4
            for (int i = 0; i < NP; ++i) {
              wt[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v[i], nibble_values), d[i], m[i]);
              keep(wt[i]);
              v[i] = _mm512_srli_epi32(v[i], 4);
            }
            use(k0 + t, wt);
          }
        }
      }
    } else {
      const __m512 high_values = _mm512_setr_ps(0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48);
      const __m512 minus32 = _mm512_set1_ps(-32.f);
      __m512 dd[NP];
#pragma GCC unroll 4
      for (int i = 0; i < NP; ++i) dd[i] = half16(b[i]);
      for (int g = 0; g < 16; ++g) {
        __m512 d[NP], m[NP];
        __m512i h[NP];
#pragma GCC unroll 4
        for (int i = 0; i < NP; ++i) {
          d[i] = _mm512_mul_ps(dd[i], i8x16(b[i] + 32 + 16 * g));
          m[i] = _mm512_mul_ps(d[i], minus32);
          h[i] = word(b[i] + kQ6KHigh + g * 64);
        }
        for (int w = 0; w < 2; ++w) {
          const int64_t at = kQ6KLow + (g * 2 + w) * 64;
          __m512i v[NP];
#pragma GCC unroll 4
          for (int i = 0; i < NP; ++i) {
            _mm_prefetch(reinterpret_cast<const char*>(b[i] + at + kAhead), _MM_HINT_T0);
            v[i] = word(b[i] + at);
          }
          if (w == 0) {
#pragma GCC unroll 4
            for (int i = 0; i < NP; ++i)
              _mm_prefetch(reinterpret_cast<const char*>(b[i] + kQ6KHigh + g * 64 + kAhead), _MM_HINT_T0);
          }
          const int64_t k0 = sb * kSuper + g * 16 + w * 8;
#pragma GCC unroll 8
          for (int t = 0; t < 8; ++t) {
            __m512 wt[NP];
#pragma GCC unroll 4
            for (int i = 0; i < NP; ++i) {
              // q = low + 16 high, exact small integers; vpermps reads each index lane's low 4 bits.
              const __m512 q = _mm512_add_ps(_mm512_permutexvar_ps(v[i], nibble_values),
                                             _mm512_permutexvar_ps(h[i], high_values));
              wt[i] = _mm512_fmadd_ps(q, d[i], m[i]);
              keep(wt[i]);
              v[i] = _mm512_srli_epi32(v[i], 4);
              h[i] = _mm512_srli_epi32(h[i], 2);
            }
            use(k0 + t, wt);
          }
        }
      }
    }
  }
}

template <int R>
CHATLOOM_WIDE inline void store16(const __m512 (&acc)[R], const float* bias, float* out, int64_t ldo,
                                  int64_t ncols) {
  const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, _mm512_add_ps(acc[r], bv));
}

// R rows (x, ldx apart) against NP panels of one kind at once: R x NP independent FMA chains, each
// weight row expanded once for all R rows.
template <int R, int NP>
struct Accumulate {
  const float* x;
  int64_t k_dim;
  __m512 (&acc)[NP][R];
  CHATLOOM_WIDE inline void operator()(int64_t k, const __m512 (&wt)[NP]) const {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * k_dim + k]);
#pragma GCC unroll 4
      for (int i = 0; i < NP; ++i) acc[i][r] = _mm512_fmadd_ps(a, wt[i], acc[i][r]);
    }
  }
};

struct Store {
  float* dst;
  CHATLOOM_WIDE inline void operator()(int64_t k, const __m512 (&wt)[1]) const {
    _mm512_storeu_ps(dst + k * kPanel, wt[0]);
  }
};

template <int R, int NP, int KIND>
CHATLOOM_WIDE void tile(const float* x, const Panels& w, int64_t p0, float* out) {
  const uint8_t* base[NP];
  for (int i = 0; i < NP; ++i) base[i] = w.blob + w.offsets[p0 + i];
  __m512 acc[NP][R];
  for (int i = 0; i < NP; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  walk<NP, KIND>(base, w.k_dim, Accumulate<R, NP>{x, w.k_dim, acc});
  for (int i = 0; i < NP; ++i) {
    const int64_t col = (p0 + i) * kPanel;
    store16<R>(acc[i], w.bias ? w.bias + col : nullptr, out + col, w.out_features,
               std::min(kPanel, w.out_features - col));
  }
}

// Panels [p0, p0 + np) of one kind against a tile of R rows, as many panels at a time as keep the
// accumulators and expanded weights in the 32 vector registers.
template <int R, int KIND>
CHATLOOM_WIDE void tile_run(const float* x, const Panels& w, int64_t p0, int64_t np, float* out) {
  // Q6_K's expansion holds two more vectors a panel (the high codes and their table).
  constexpr int kMax = KIND == kQ4K ? (R <= 4 ? 4 : R <= 6 ? 3 : 2) : (R <= 2 ? 4 : R <= 4 ? 3 : 2);
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

// Rows [0, m) of x against the task's panels [p0, p1): each run of panels of one kind, tile by tile.
// 7 or 8 rows (8 sequences in flight) are one tile of 8 rows x 2 panels, so that each weight row is
// expanded once, not once per tile of 4 (16 accumulators, and 9-13 registers for the expansion).
CHATLOOM_WIDE void few_rows_task(const float* x, int64_t m, const Panels& w, int64_t p0, int64_t p1, float* out) {
  for (int64_t a = p0; a < p1;) {
    int64_t b = a + 1;
    while (b < p1 && w.kinds[b] == w.kinds[a]) ++b;
    const bool q4 = w.kinds[a] == kQ4K;
    if (m == 8) {
      if (q4) tile_run<8, kQ4K>(x, w, a, b - a, out);
      else tile_run<8, kQ6K>(x, w, a, b - a, out);
      a = b;
      continue;
    }
    if (m == 7) {
      if (q4) tile_run<7, kQ4K>(x, w, a, b - a, out);
      else tile_run<7, kQ6K>(x, w, a, b - a, out);
      a = b;
      continue;
    }
    chatloom_kernels::for_each_row_tile(0, m, [&](int64_t r0, int64_t rows) {
      const float* xr = x + r0 * w.k_dim;
      float* orow = out + r0 * w.out_features;
      chatloom_kernels::with_tile_rows(rows, [&](auto r) {
        constexpr int R = decltype(r)::value;
        if (q4) tile_run<R, kQ4K>(xr, w, a, b - a, orow);
        else tile_run<R, kQ6K>(xr, w, a, b - a, orow);
      });
    });
    a = b;
  }
}

// Panel p's weights as float32 [K, 16], for the many-row path's float tiles.
CHATLOOM_WIDE void expand_panel(const Panels& w, int64_t p, float* dst) {
  const uint8_t* base[1] = {w.blob + w.offsets[p]};
  if (w.kinds[p] == kQ4K) walk<1, kQ4K>(base, w.k_dim, Store{dst});
  else walk<1, kQ6K>(base, w.k_dim, Store{dst});
}

bool cpu_ok() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
  return ok;
}
#else
bool cpu_ok() { return false; }
#endif

}  // namespace

bool kquant_linear_supported() { return cpu_ok(); }

int64_t kquant_super_bytes(int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind <= 3, "unknown super-block kind ", kind,
              " (0: Q4_K, 1: Q6_K; 2, 3: the same for int8 activations)");
  return super_bytes((uint8_t)kind);
}

namespace {

// The panels' layout checked against K: every panel one kind's K / 256 super-blocks, end to end.
Panels checked_panels(const torch::Tensor& blob, const torch::Tensor& offsets, const torch::Tensor& kinds,
                      int64_t k_dim, int64_t out_features) {
  TORCH_CHECK(cpu_ok(), "kquant_linear needs AVX-512 (F, BW, VL) and F16C");
  TORCH_CHECK(blob.scalar_type() == torch::kUInt8 && blob.dim() == 1 && blob.is_contiguous(),
              "blob must be contiguous uint8 [bytes]");
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && offsets.dim() == 1 && offsets.is_contiguous() &&
              kinds.scalar_type() == torch::kUInt8 && kinds.dim() == 1 && kinds.is_contiguous() &&
              offsets.numel() == kinds.numel() + 1 && kinds.numel() >= 1,
              "offsets must be int64 [P + 1] and kinds uint8 [P]");
  const int64_t panels = kinds.numel();
  TORCH_CHECK(k_dim % kSuper == 0 && k_dim > 0, "K must be a positive multiple of 256, got ", k_dim);
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features does not match the panels");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const uint8_t* kd = kinds.data_ptr<uint8_t>();
  TORCH_CHECK(off[0] == 0 && off[panels] == blob.numel(), "offsets do not span the blob");
  for (int64_t p = 0; p < panels; ++p) {
    TORCH_CHECK(kd[p] <= 3 && off[p + 1] - off[p] == k_dim / kSuper * super_bytes(kd[p]),
                "panel ", p, " does not hold K = ", k_dim, " weights of its kind");
    TORCH_CHECK(int8_kind(kd[p]) == int8_kind(kd[0]), "panels mix exact and int8 kinds");
  }
  TORCH_CHECK(!int8_kind(kd[0]) || kquant_int8_supported(), "int8 super-block panels need AVX-512 VNNI");
  return Panels{blob.data_ptr<uint8_t>(), off, kd, panels, k_dim, out_features, nullptr};
}

const float* checked_bias(const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == out_features,
              "bias must be contiguous float32 [out_features]");
  return bias->data_ptr<float>();
}

}  // namespace

QuantizedPanels kquant_panels(const torch::Tensor& blob, const torch::Tensor& offsets, const torch::Tensor& kinds,
                              const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && kinds.scalar_type() == torch::kUInt8 && kinds.numel() >= 1 &&
              offsets.numel() == kinds.numel() + 1, "offsets must be int64 [P + 1] and kinds uint8 [P]");
  const int64_t first = kinds.data_ptr<uint8_t>()[0];
  TORCH_CHECK(first >= 0 && first <= 3, "unknown super-block kind ", first);
  const int64_t k_dim = offsets.data_ptr<int64_t>()[1] / super_bytes((uint8_t)first) * kSuper;
  const Panels w = checked_panels(blob, offsets, kinds, k_dim, out_features);
  QuantizedPanels q{};
  q.codes = w.blob;
  q.scales = nullptr;
  q.half_scales = false;
  q.q4 = false;
  q.k_dim = k_dim;
  q.panels = w.panels;
  q.out_features = out_features;
  q.bias = checked_bias(bias, out_features);
  q.kq_offsets = w.offsets;
  q.kq_kinds = w.kinds;
  return q;
}

void run_kquant_task(const QuantizedPanels& q, const float* x, int64_t m_dim, float* out, int64_t task,
                     int64_t x_version) {
#ifdef CHATLOOM_HAVE_KQUANT_PANELS
  const Panels w{q.codes, q.kq_offsets, q.kq_kinds, q.panels, q.k_dim, q.out_features, q.bias};
  if (int8_kind(w.kinds[0])) {
    const KQuantInt8Weights iw{w.blob, w.offsets, w.kinds, w.panels, w.k_dim, w.out_features, w.bias};
    kquant_int8_panels(iw, x, m_dim, task * kTaskPanels, std::min(q.panels, (task + 1) * kTaskPanels), out,
                       x_version);
    return;
  }
  few_rows_task(x, m_dim, w, task * kTaskPanels, std::min(q.panels, (task + 1) * kTaskPanels), out);
#else
  TORCH_CHECK(false, "kquant tasks need AVX-512");
#endif
}

torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor blob, torch::Tensor offsets, torch::Tensor kinds,
                            int64_t out_features, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  Panels w = checked_panels(blob, offsets, kinds, x.size(1), out_features);
  const int64_t panels = w.panels, k_dim = w.k_dim;
  torch::Tensor bias_keep;
  if (bias.has_value() && bias->defined()) {
    bias_keep = bias->contiguous();
    w.bias = checked_bias(bias_keep, out_features);
  }
  x = x.contiguous();
  const int64_t m_dim = x.size(0);
  auto out = torch::empty({m_dim, out_features}, x.options());
  if (m_dim == 0) return out;
#ifdef CHATLOOM_HAVE_KQUANT_PANELS
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (int8_kind(w.kinds[0])) {
    kquant_int8_matmul(KQuantInt8Weights{w.blob, w.offsets, w.kinds, panels, k_dim, out_features, w.bias}, xp, m_dim,
                       op);
    return out;
  }
  if (m_dim <= kFewRows) {
    const int64_t tasks = (panels + kTaskPanels - 1) / kTaskPanels;
    const int64_t grain = std::max<int64_t>(1, 200000 / (2 * m_dim * k_dim * kPanel * kTaskPanels));
    chatloom_kernels::parallel_for_dynamic(tasks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        few_rows_task(xp, m_dim, w, t * kTaskPanels, std::min(panels, (t + 1) * kTaskPanels), op);
    });
    return out;
  }
  // Many rows: each pair of panels is expanded once per block of rows into a float32 scratch, and
  // the float32 kernel's tiles run on it (the same FMA chains, so the same bits).
  const int64_t pairs = (panels + 1) / 2;
  for (int64_t m0 = 0; m0 < m_dim; m0 += kRowBlock) {
    const int64_t m1 = std::min(m_dim, m0 + kRowBlock);
    const int64_t grain = std::max<int64_t>(1, 200000 / (2 * (m1 - m0) * k_dim * kPanel * 2));
    chatloom_kernels::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
      std::unique_ptr<float[]> scratch(new float[2 * k_dim * kPanel]);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = 2 * g, col = p * kPanel;
        const bool pair = p + 1 < panels;
        expand_panel(w, p, scratch.get());
        if (pair) expand_panel(w, p + 1, scratch.get() + k_dim * kPanel);
        const int64_t ncols_b = std::min(kPanel, out_features - col - (pair ? kPanel : 0));
        float_panel_pair_rows(xp, k_dim, scratch.get(), pair ? scratch.get() + k_dim * kPanel : nullptr,
                              w.bias ? w.bias + col : nullptr, op + col, out_features, ncols_b, m0, m1);
      }
    });
  }
#endif
  return out;
}
