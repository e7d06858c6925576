// Entry points of chatloom's C++ kernels (bound to Python in bindings.cpp).
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include <cstring>
#include <vector>

#include "work_pool.h"

// Whether v is a NaN, told by its bits: the kernels build with -ffast-math, under which std::isnan
// is always false.
inline bool is_nan_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor block_tables, torch::Tensor rows, torch::Tensor kv_lens,
                              double scale, const std::string& isa = "auto");

// paged_attention's AVX-512 path for runs of consecutive queries of one sequence (prompts, chunks),
// in tiles that read each span of K/V once (prefill_attention.cpp), into out. Returns false, doing
// nothing, where it does not apply: no two consecutive queries share a row, queries not float32, a
// head size other than 16-128, or a build without AVX-512.
bool paged_attention_tiles(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                           const torch::Tensor& block_tables, const torch::Tensor& rows, const torch::Tensor& kv_lens,
                           double scale, torch::Tensor& out);

// A decode-only batch's attention from the fused QKV projection [T, (Hq + 2 Hkv) D]: rotary, the
// pool writes at slot_mapping and paged_attention in one call (decode_attention.cpp); [T, Hq D].
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                               bool interleaved, int64_t hq, int64_t hkv, torch::Tensor k_pool,
                               torch::Tensor v_pool, torch::Tensor slot_mapping, torch::Tensor block_tables,
                               torch::Tensor rows, torch::Tensor kv_lens, double scale);

// A step's fresh K or V rows [T, H, D] (float32, each row contiguous) into a layer's pool [blocks,
// block_size, H, D] at flat slots, rounded as the pool keeps them (kv_pool.cpp).
void write_pool_rows(torch::Tensor pool, torch::Tensor slot_mapping, torch::Tensor rows);

// isa for the float32 matmuls: "auto" (CHATLOOM_KERNEL_ISA, else the best), "avx512" or "avx2".
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                            c10::optional<torch::Tensor> bias, const std::string& isa);
std::vector<std::string> float_linear_isas();
// The paged attention's instruction paths in this build, best first ("avx2" names the path without
// AVX-512: AVX2 where the CPU has it, else portable).
std::vector<std::string> paged_attention_isas();

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);

torch::Tensor silu_and_mul(torch::Tensor gate_up);

std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions,
                                  torch::Tensor cos, torch::Tensor sin, bool interleaved);

torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features,
                               c10::optional<torch::Tensor> bias, const std::string& isa);

bool int8_linear_supported();

// isa: "auto" (CHATLOOM_KERNEL_ISA, else the best this CPU has), "avx512_vnni", "avx2" or "scalar".
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features,
                          c10::optional<torch::Tensor> bias, const std::string& isa);

// The int8 matmul's paths this CPU and build can run, best first; and the one `requested` resolves to.
std::vector<std::string> int8_linear_isas();
std::string int8_linear_isa(const std::string& requested);

// This CPU's measured peak (GOP/s, all intra-op threads) per instruction kind (isa_peak.cpp).
std::vector<std::string> peak_kinds();
double peak_gops(const std::string& name, int64_t iters);

// x [M, K] @ W^T (+ bias) with W in bfloat16 panels [P, K / 2, 32] (bf16_gemm.cpp);
// isa: "auto", "avx512_bf16" or "scalar".
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                          c10::optional<torch::Tensor> bias, const std::string& isa);
std::vector<std::string> bf16_linear_isas();

torch::Tensor grouped_quantized_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                       int64_t out_features, c10::optional<torch::Tensor> bias);

// Rows [m0, m1) of x [M, K] against two float32 panels [K, 16] (pb null: pa alone), into columns
// [0, 32) of out (ldo apart; the second panel's first ncols_b): packed_linear's tiles, so its bits.
void float_panel_pair_rows(const float* x, int64_t k_dim, const float* pa, const float* pb, const float* bias,
                           float* out, int64_t ldo, int64_t ncols_b, int64_t m0, int64_t m1);

// x [M, K] @ W^T (+ bias) with W as Q4_K / Q6_K super-block panels (kquant_panels.cpp): blob holds
// panel p at offsets[p], of kind kinds[p] (0: Q4_K, 1: Q6_K). Bit-identical to gguf's dequantizer
// followed by packed_linear. Needs AVX-512: kquant_linear_supported().
torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor blob, torch::Tensor offsets, torch::Tensor kinds,
                            int64_t out_features, c10::optional<torch::Tensor> bias);
bool kquant_linear_supported();
int64_t kquant_super_bytes(int64_t kind);

// The exact quantized head's argmax per row of x (greedy_head.cpp): the same token as
// quantized_linear(x, codes, scales, out_features).argmax(1), found by screening every logit with
// int8_linear(x, codes8, scales8) under a rigorous error bound and recomputing only the candidates
// exactly. norms: each weight row's Euclidean norm, rounded up. Returns the argmax [T] and the exact
// logit it picked [T] (NaN where the row's logits hold one: torch.argmax ranks NaN first).
// isa: "auto", "avx512" or "scalar" (the same candidates and bits on both).
std::tuple<torch::Tensor, torch::Tensor> greedy_head_argmax(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features,
                                 torch::Tensor codes8, torch::Tensor scales8, torch::Tensor norms,
                                 const std::string& isa = "auto");

torch::Tensor grouped_int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features,
                                  c10::optional<torch::Tensor> bias);

// The few-row (at most kMaxTaskRows) quantized matmul of quantized_linear ("auto" path) split into
// tasks of 4 panels, for a caller that schedules them on its own threads (decode_stack.cpp): the same
// kernels, so the same bits. Only where quantized_tasks_supported() (the AVX-512 path is in use).
struct QuantizedPanels {
  const uint8_t* codes;
  const void* scales;
  bool half_scales, q4;
  int64_t k_dim, panels, out_features;
  const float* bias;
  // Super-block panels (kquant_linear's; codes is then the blob): the panels' offsets and kinds.
  const int64_t* kq_offsets = nullptr;
  const uint8_t* kq_kinds = nullptr;
};
constexpr int64_t kMaxTaskRows = 12;
constexpr int64_t kTaskFeatures = 64;  // output features per task: columns [task * 64, task * 64 + 64)
QuantizedPanels quantized_panels(const torch::Tensor& codes, const torch::Tensor& scales,
                                 const c10::optional<torch::Tensor>& bias, int64_t out_features);
// kquant_linear's weights as tasks of 4 panels (checked as kquant_linear checks them).
QuantizedPanels kquant_panels(const torch::Tensor& blob, const torch::Tensor& offsets, const torch::Tensor& kinds,
                              const c10::optional<torch::Tensor>& bias, int64_t out_features);
void run_kquant_task(const QuantizedPanels& w, const float* x, int64_t m_dim, float* out, int64_t task,
                     int64_t x_version = -1);
bool quantized_tasks_supported();
int64_t quantized_tasks(const QuantizedPanels& w);
// Rows x [m_dim, K] against task `task`'s panels, into their columns of out [m_dim, out_features].
// `x_version` >= 0 names the rows for the int8 path, which then quantizes them once per thread
// without comparing them (see kquant_int8_panels).
void run_quantized_task(const QuantizedPanels& w, const float* x, int64_t m_dim, float* out, int64_t task,
                        int64_t x_version = -1);

// -- raw-pointer forms of the layer ops, for a caller that runs them on its own threads
// (decode_team.cpp). The tensor functions above run these same functions, so the bits agree. --

// Per-thread scratch of attention jobs, reused from job to job.
template <typename Acc>
struct JobScratch {
  std::vector<Acc> scores, acc, qv, mx, sum;
  std::vector<int64_t> offs;
};
using AttentionScratch = JobScratch<float>;

// The float32 attention paged_attention ("auto" path) computes for one query token's heads that
// share KV heads [h0, h0 + heads): q and out are the token's rows [hq * d].
// The pool may also hold 16-bit values: the float32 query against them, as paged_attention computes.
void attention_job(const float* q, const float* k_pool, const float* v_pool, const int32_t* table, int64_t len,
                   int64_t hq, int64_t hkv, int64_t d, int64_t block_size, double scale, int64_t h0, int64_t heads,
                   AttentionScratch& scratch, float* out);
void attention_job(const float* q, const c10::Half* k_pool, const c10::Half* v_pool, const int32_t* table,
                   int64_t len, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, double scale, int64_t h0,
                   int64_t heads, AttentionScratch& scratch, float* out);
void attention_job(const float* q, const c10::BFloat16* k_pool, const c10::BFloat16* v_pool, const int32_t* table,
                   int64_t len, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, double scale, int64_t h0,
                   int64_t heads, AttentionScratch& scratch, float* out);

// One row of n float32 values into a pool's row as write_pool_rows stores it: the same bits, or
// rounded to nearest even for a 16-bit pool (float16 saturating at 65504, a NaN kept a NaN).
void store_pool_row(const float* src, float* dst, int64_t n);
void store_pool_row(const float* src, c10::Half* dst, int64_t n);
void store_pool_row(const float* src, c10::BFloat16* dst, int64_t n);

// Rows [rows, h] of rms_norm; of add_rms_norm (residual += x in place, out = its norm).
void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t h, float eps);
void add_rms_norm_rows(const float* x, float* residual, const float* w, float* out, int64_t rows, int64_t h,
                       float eps);
// Rows of silu_and_mul: gate_up [rows, 2 inter] -> out [rows, inter].
void silu_and_mul_rows(const float* gate_up, float* out, int64_t rows, int64_t inter);
// One token's heads [heads, d] (rows d apart) rotated by the tables' rows for its position, into dst.
void rotary_heads(const float* src, float* dst, int64_t heads, int64_t d, const float* cos_row, const float* sin_row,
                  bool interleaved);

// For the tests: runs a loop of `items` on the work pool (work_pool.h), the first worker to get items
// sleeping `stall_ns` first; returns which thread ran each item (0: the caller, 1: a worker).
std::vector<int64_t> work_pool_probe(int64_t items, int64_t stall_ns);
