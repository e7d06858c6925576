// The decoder stack of a decode step as one native object (decode_stack.cpp).
#pragma once
#include "kernels.h"

// One linear layer as the kernels see it; `kind` names the kernel its Python module calls.
struct NativeLinear {
  enum Kind : int64_t { kPacked = 0, kQuantized = 1, kInt8 = 2, kGrouped = 3, kGroupedInt8 = 4, kBF16 = 5 };
  NativeLinear(int64_t kind, torch::Tensor weight, c10::optional<torch::Tensor> scales,
               c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> m_panels, int64_t out_features);
  Kind kind;
  torch::Tensor weight;  // packed panels (float32 or bf16) or quantized codes
  torch::Tensor scales;  // quantized kinds: [P, K / group, 2, 16]
  c10::optional<torch::Tensor> bias;
  torch::Tensor m_panels;  // int8 kind with a nonzero m (Q5_K): the m term's packed panels
  int64_t out_features;
};

// A Llama-shaped layer: RMSNorm, fused QKV, rotary + paged attention, O, RMSNorm, fused gate/up, SiLU, down.
struct DecodeLayerWeights {
  torch::Tensor input_norm, post_norm;
  NativeLinear qkv, o, gate_up, down;
};

class DecodeStack {
 public:
  DecodeStack(std::vector<DecodeLayerWeights> layers, torch::Tensor final_norm, double eps, torch::Tensor cos,
              torch::Tensor sin, bool interleaved, int64_t hq, int64_t hkv, double scale);
  // x: the embedded tokens [T, hidden] (updated in place as the residual stream); the rest as for
  // decode_attention. Returns the final norm's output [T, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, const std::vector<torch::Tensor>& k_pools,
                        const std::vector<torch::Tensor>& v_pools, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor rows, torch::Tensor kv_lens) const;

 private:
  std::vector<DecodeLayerWeights> layers_;
  torch::Tensor final_norm_;
  double eps_;
  torch::Tensor cos_, sin_;
  bool interleaved_;
  int64_t hq_, hkv_;
  double scale_;
};
