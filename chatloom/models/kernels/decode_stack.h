// The decoder stack of a decode step as one native object (decode_stack.cpp).
#pragma once
#include "kernels.h"

#include <array>
#include <atomic>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

// One linear layer as the kernels see it; `kind` names the kernel its Python module calls.
struct NativeLinear {
  enum Kind : int64_t { kPacked = 0, kQuantized = 1, kInt8 = 2, kGrouped = 3, kGroupedInt8 = 4, kBF16 = 5, kKQuant = 6 };
  NativeLinear(int64_t kind, torch::Tensor weight, c10::optional<torch::Tensor> scales,
               c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> m_panels, int64_t out_features);
  Kind kind;
  torch::Tensor weight;  // packed panels (float32 or bf16) or quantized codes
  torch::Tensor scales;  // quantized kinds: [P, K / group, 2, 16]; kKQuant: the panels' offsets
  c10::optional<torch::Tensor> bias;
  torch::Tensor m_panels;  // int8 kind with a nonzero m (Q5_K): the m term's packed panels; kKQuant: kinds
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

  // The output head, run by forward_logits. Taken only where the team path can run it (a
  // quantized head over the hidden size); has_head() tells whether it was.
  void set_head(const NativeLinear& head);
  bool has_head() const { return head_.has_value(); }
  // forward's arguments; returns the head's logits [T, vocab] and each row's argmax [T] (int64, the
  // first maximum; a NaN counts as the maximum, as in torch.argmax). On the team path the head is
  // the team's last phase and the argmax is taken as its tasks finish; wider batches run forward,
  // then the head's kernel. Either way, the bits of forward followed by the head's module.
  std::tuple<torch::Tensor, torch::Tensor> forward_logits(torch::Tensor x, torch::Tensor positions,
                                                          const std::vector<torch::Tensor>& k_pools,
                                                          const std::vector<torch::Tensor>& v_pools,
                                                          torch::Tensor slot_mapping, torch::Tensor block_tables,
                                                          torch::Tensor rows, torch::Tensor kv_lens) const;

  // Logits, their argmax, the argmax as a list, and the rows whose maximum is a NaN (the model failed
  // on them).
  using Picks = std::tuple<torch::Tensor, torch::Tensor, std::vector<int64_t>, std::vector<int64_t>>;

  // forward, then each row's argmax of the head, for a step where nobody reads the logits: every row
  // greedy. Wider than the team and with a greedy head set, the argmax is screened
  // (greedy_head_argmax) and the logits returned have shape [T, 0]; otherwise they are
  // forward_logits'. The argmax's bits are forward_logits' either way.
  Picks forward_argmax(
      torch::Tensor x, torch::Tensor positions, const std::vector<torch::Tensor>& k_pools,
      const std::vector<torch::Tensor>& v_pools, torch::Tensor slot_mapping, torch::Tensor block_tables,
      torch::Tensor rows, torch::Tensor kv_lens) const;

  // The exact head's screen for argmax-only steps (greedy_head_argmax's codes8, scales8 and norms);
  // has_greedy_head() tells whether one was set. Taken only with a head.
  void set_greedy_head(torch::Tensor codes8, torch::Tensor scales8, torch::Tensor norms);
  bool has_greedy_head() const { return greedy_norms_.defined(); }

  // The token embedding for forward_tokens: float32 [vocab, hidden] (kind ""), or GGUF blocks of `kind`
  // as uint8 [vocab, bytes a row], each looked-up row expanded as dequantize_blocks does (contiguous
  // either way); has_embedding() tells whether it was taken (the head must be set first:
  // forward_tokens needs both).
  void set_embedding(torch::Tensor weight, const std::string& kind = "");
  bool has_embedding() const { return embedding_.defined(); }
  // A plain decode step from the engine's own lists, so that the caller makes no tensor: query i is
  // token ids[i] at positions[i] of the sequence whose block table is tables[i], writes its K/V to
  // slots[i] and sees positions[i] + 1 keys. Returns forward_logits' logits and argmax, the argmax
  // as a list, and the rows whose maximum is a NaN (the model failed on them). With `argmax_only`
  // (every row greedy, nobody reads the logits) it is forward_argmax on the lists.
  // With `interruptible`, the step stops at the next layer boundary once interrupt() is called (from
  // any thread, during the call or after the last clear_interrupt()); interrupted() then says so, and
  // the returned tensors are empty. A stopped step wrote this step's K/V for its first layers only: run
  // again, it writes the same values at the same slots.
  Picks forward_tokens(
      const std::vector<int64_t>& ids, const std::vector<int64_t>& positions, const std::vector<int64_t>& slots,
      const std::vector<std::vector<int32_t>>& tables, const std::vector<torch::Tensor>& k_pools,
      const std::vector<torch::Tensor>& v_pools, bool argmax_only = false, bool interruptible = false) const;
  // Ask an interruptible step to stop (the one running or the next one), or withdraw the request.
  void interrupt() { interrupt_.store(true, std::memory_order_release); }
  void clear_interrupt() { interrupt_.store(false, std::memory_order_release); }
  // Whether the last forward_tokens call stopped early.
  bool interrupted() const { return interrupted_; }

  // Wall time per part of the team path's decode steps (decode_team.cpp), summed while profiling is
  // on: the serial parts as the leading thread ran them, each matmul from its start to the barrier
  // after it. For `chatloom bench latency`'s breakdown; off by default (two clock reads per part).
  void set_profiling(bool on);
  std::map<std::string, double> profile() const;  // seconds per part, "steps", and "redone" items
  // For tests: the team's second thread sleeps `ns` before it runs an item of every `every`-th phase,
  // as if the OS had stopped it holding the item (0: never).
  void set_test_stall(int64_t ns, int64_t every);
  bool team_path() const { return !team_.empty(); }

 private:
  // Every layer's matmuls are few-row quantized tasks (decode_team.cpp); empty when they are not.
  struct TeamLayer {
    QuantizedPanels qkv, o, gate_up, down;
  };
  // The team path: returns the final norm's output; with `head`, also the logits and argmax.
  torch::Tensor forward_team(torch::Tensor x, torch::Tensor positions, const std::vector<torch::Tensor>& k_pools,
                             const std::vector<torch::Tensor>& v_pools, torch::Tensor slot_mapping,
                             torch::Tensor block_tables, torch::Tensor rows, torch::Tensor kv_lens,
                             torch::Tensor* logits = nullptr, torch::Tensor* argmax = nullptr) const;

  bool team_shape_ok() const;
  // Whether the step in progress is interruptible and was asked to stop (checked between layers).
  bool stop_asked() const { return interruptible_ && interrupt_.load(std::memory_order_acquire); }
  // Whether an argmax-only step of this many rows takes the screened head (forward_argmax).
  bool screens_head(int64_t rows, const std::vector<torch::Tensor>& k_pools) const;

  std::vector<DecodeLayerWeights> layers_;
  std::vector<TeamLayer> team_;
  c10::optional<NativeLinear> head_;  // the head's weights (set_head), kept alive for head_panels_
  QuantizedPanels head_panels_{};
  bool profiling_ = false;
  // The parts in kTeamParts order, the step count, then the items redone (counted while profiling).
  mutable std::array<int64_t, 11> profile_ns_{};
  int64_t stall_ns_ = 0, stall_every_ = 0;
  std::atomic<bool> interrupt_{false};
  // The call in progress may stop (forward_tokens' `interruptible`), and whether the last one did.
  mutable bool interruptible_ = false, interrupted_ = false;
  torch::Tensor embedding_;  // set_embedding's table, or undefined
  std::string embedding_kind_;  // its blocks' kind, or "" for float32 rows
  torch::Tensor greedy_codes_, greedy_scales_, greedy_norms_;  // set_greedy_head's, or undefined
  torch::Tensor final_norm_;
  double eps_;
  torch::Tensor cos_, sin_;
  bool interleaved_;
  int64_t hq_, hkv_;
  double scale_;
};
