// Entry points of chatloom's C++ kernels (bound to Python in bindings.cpp).
#pragma once
#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor block_tables, torch::Tensor rows, torch::Tensor kv_lens,
                              double scale, const std::string& isa = "auto");

// A decode-only batch's attention from the fused QKV projection [T, (Hq + 2 Hkv) D]: rotary, the
// pool writes at slot_mapping and paged_attention in one call (decode_attention.cpp); [T, Hq D].
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                               bool interleaved, int64_t hq, int64_t hkv, torch::Tensor k_pool,
                               torch::Tensor v_pool, torch::Tensor slot_mapping, torch::Tensor block_tables,
                               torch::Tensor rows, torch::Tensor kv_lens, double scale);

// isa for the float32 matmuls: "auto" (CHATLOOM_KERNEL_ISA, else the best), "avx512" or "avx2".
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                            c10::optional<torch::Tensor> bias, const std::string& isa);
std::vector<std::string> float_linear_isas();

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

torch::Tensor grouped_int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features,
                                  c10::optional<torch::Tensor> bias);
