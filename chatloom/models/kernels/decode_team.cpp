// A decode step's decoder stack on one team of threads (DecodeStack::forward_team).
//
// At batch 1 a step is 30 layers x 4 matmuls of 10-50 us each. Run as separate parallel regions,
// every matmul pays a fork and a join, splits its panels between the threads in advance (so a
// thread that the OS hands to the event loop for a moment holds up the whole matmul), and the
// second core idles through every serial part. Here one OpenMP region spans the whole stack, on
// buffers allocated once per step: the leading thread does the small serial parts (norms, rotary and
// the pool writes, SiLU) through the same raw functions as the tensor kernels, and each matmul's tasks
// (4 panels each) and the attention's jobs (a token's KV head each) go to whichever thread asks next,
// from shared counters. A task or job computes exactly what quantized_linear or paged_attention
// computes for its outputs, and every output belongs to one of them, so the bits are the same.
//
// A step at batch 1 is bound by reading the weights from memory, and the memory sits idle while the
// leading thread does a serial part. So meanwhile the other threads prefetch the first lines of the
// next matmul's weights (prefetch_while): its first tasks then start from cache.
#include "decode_stack.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>

namespace {

constexpr const char* kTeamParts[8] = {"input_norm", "qkv", "attention", "o", "post_norm", "gate_up", "silu", "down"};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Runs the tasks of one matmul that this thread wins from `next` (shared by the team).
void run_tasks(const QuantizedPanels& w, const float* x, int64_t rows, float* out, std::atomic<int64_t>& next) {
  const int64_t n = quantized_tasks(w);
  for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < n;)
    run_quantized_task(w, x, rows, out, task);
}

// Prefetches `w`'s codes, and the scales that go with them, in claims of kClaim bytes from a cursor
// the idle threads share, until `done` is set or the weights run out.
void prefetch_while(const std::atomic<bool>& done, std::atomic<int64_t>& cursor, const QuantizedPanels& w) {
  constexpr int64_t kClaim = 1024, kLine = 64;
  const int64_t code_bytes = w.panels * w.k_dim * (w.q4 ? 8 : 16);
  const int64_t scale_bytes = w.panels * (w.k_dim / 32) * 2 * 16 * (w.half_scales ? 2 : 4);
  const char* codes = reinterpret_cast<const char*>(w.codes);
  const char* scales = static_cast<const char*>(w.scales);
  while (!done.load(std::memory_order_acquire)) {
    const int64_t at = cursor.fetch_add(kClaim, std::memory_order_relaxed);
    if (at >= code_bytes) return;
    const int64_t end = std::min(code_bytes, at + kClaim);
    for (int64_t b = at; b < end; b += kLine) _mm_prefetch(codes + b, _MM_HINT_T1);
    // Tasks read codes and scales at the same pace: panel p's scales are at p's share of the scales.
    for (int64_t b = at * scale_bytes / code_bytes / kLine * kLine; b < end * scale_bytes / code_bytes; b += kLine)
      _mm_prefetch(scales + b, _MM_HINT_T1);
  }
}

}  // namespace

void DecodeStack::set_profiling(bool on) {
  profiling_ = on;
  profile_ns_.fill(0);
}

std::map<std::string, double> DecodeStack::profile() const {
  std::map<std::string, double> out;
  for (int i = 0; i < 8; ++i) out[kTeamParts[i]] = profile_ns_[i] * 1e-9;
  out["steps"] = (double)profile_ns_[8];
  return out;
}

torch::Tensor DecodeStack::forward_team(torch::Tensor x, torch::Tensor positions,
                                        const std::vector<torch::Tensor>& k_pools,
                                        const std::vector<torch::Tensor>& v_pools, torch::Tensor slot_mapping,
                                        torch::Tensor block_tables, torch::Tensor rows, torch::Tensor kv_lens) const {
  // Everything is checked here: the team's parts are raw loops that must not fail halfway.
  const size_t n = layers_.size();
  const TeamLayer& shape = team_[0];  // every layer has this shape (checked when the stack was built)
  const int64_t t = x.size(0), hidden = shape.qkv.k_dim, inter = shape.down.k_dim;
  const int64_t d = shape.qkv.out_features / (hq_ + 2 * hkv_), q_width = hq_ * d, kv_width = hkv_ * d;
  TORCH_CHECK(x.is_contiguous() && x.size(1) == hidden, "x must be a contiguous [T, hidden]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == t,
              "one int64 position per token");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() && slot_mapping.numel() == t,
              "one int64 slot per token");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 && rows.scalar_type() == torch::kInt32 &&
              rows.is_contiguous() && rows.numel() == t && kv_lens.scalar_type() == torch::kInt32 &&
              kv_lens.is_contiguous() && kv_lens.numel() == t, "int32 block tables, rows and kv_lens, one per token");
  block_tables = block_tables.contiguous();
  const auto& pool = k_pools[0];
  TORCH_CHECK(pool.dim() == 4 && pool.size(2) == hkv_ && pool.size(3) == d && pool.scalar_type() == torch::kFloat32,
              "pools must be float32 [blocks, block_size, Hkv, D]");
  for (size_t i = 0; i < n; ++i)
    TORCH_CHECK(k_pools[i].sizes() == pool.sizes() && v_pools[i].sizes() == pool.sizes() &&
                k_pools[i].scalar_type() == torch::kFloat32 && v_pools[i].scalar_type() == torch::kFloat32 &&
                k_pools[i].is_contiguous() && v_pools[i].is_contiguous(), "every layer's pools alike and contiguous");
  const int64_t block_size = pool.size(1), slots = pool.size(0) * block_size, width = block_tables.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int32_t* row = rows.data_ptr<int32_t>();
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_.size(0), "position out of range");
    TORCH_CHECK(slot[i] >= 0 && slot[i] < slots, "slot out of range");
    TORCH_CHECK(row[i] >= 0 && row[i] < block_tables.size(0), "block table row out of range");
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width * block_size, "kv length out of range");
  }
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const float *cos = cos_.data_ptr<float>(), *sin = sin_.data_ptr<float>();

  const auto opts = x.options();
  torch::Tensor qkv = torch::empty({t, shape.qkv.out_features}, opts), q = torch::empty({t, q_width}, opts);
  torch::Tensor attn = torch::empty({t, q_width}, opts), o = torch::empty({t, hidden}, opts);
  torch::Tensor gate_up = torch::empty({t, 2 * inter}, opts), act = torch::empty({t, inter}, opts);
  torch::Tensor down = torch::empty({t, hidden}, opts), h = torch::empty({t, hidden}, opts);
  torch::Tensor out = torch::empty({t, hidden}, opts);
  float *xp = x.data_ptr<float>(), *qkvp = qkv.data_ptr<float>(), *qp = q.data_ptr<float>();
  float *attnp = attn.data_ptr<float>(), *op = o.data_ptr<float>(), *gup = gate_up.data_ptr<float>();
  float *actp = act.data_ptr<float>(), *downp = down.data_ptr<float>(), *hp = h.data_ptr<float>();
  const float eps = (float)eps_;
  // Per matmul, then per attention: the next task or job to hand out.
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[5 * n]);
  for (size_t i = 0; i < 5 * n; ++i) next[i].store(0, std::memory_order_relaxed);
  std::atomic<bool> serial_done{false};  // the leading thread is through its serial part
  std::atomic<int64_t> prefetched{0};  // the idle threads' cursor into the next matmul's codes
  const bool timed = profiling_;

  // The residual stream is x itself, updated in place (the embedding output is a fresh tensor).
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const bool lead = omp_get_thread_num() == 0;
    AttentionScratch scratch;
    int64_t mark = lead && timed ? now_ns() : 0;
    // Charges the time since the last mark to part `p` (the leading thread, when profiling).
    const auto charge = [&](int p) {
      if (lead && timed) {
        const int64_t now = now_ns();
        profile_ns_[p] += now - mark;
        mark = now;
      }
    };
    // The leading thread's serial part while the others prefetch the weights of the matmul that
    // follows it; then the whole team waits for it.
    const auto serial = [&](const auto& part, const QuantizedPanels& next_matmul) {
      if (lead) {
        part();
        serial_done.store(true, std::memory_order_release);
      } else {
        prefetch_while(serial_done, prefetched, next_matmul);
      }
#pragma omp barrier
      // Ready for the next serial part; nobody reads these again before the barrier after this matmul.
      if (lead) {
        serial_done.store(false, std::memory_order_relaxed);
        prefetched.store(0, std::memory_order_relaxed);
      }
    };
    for (size_t i = 0; i < n; ++i) {
      const TeamLayer& l = team_[i];
      const DecodeLayerWeights& w = layers_[i];
      const float* input_norm = w.input_norm.data_ptr<float>();
      serial([&] {
        if (i == 0) rms_norm_rows(xp, input_norm, hp, t, hidden, eps);
        else add_rms_norm_rows(downp, xp, input_norm, hp, t, hidden, eps);
      }, l.qkv);
      charge(0);
      run_tasks(l.qkv, hp, t, qkvp, next[5 * i]);
#pragma omp barrier
      charge(1);
      // Rotary, and this step's keys and values into the pools (as decode_attention does), then the
      // attention itself, one job per (token, KV head), shared out like the matmuls' tasks.
      float* k_pool = k_pools[i].data_ptr<float>();
      float* v_pool = v_pools[i].data_ptr<float>();
      serial([&] {
        for (int64_t j = 0; j < t; ++j) {
          const float* row_qkv = qkvp + j * shape.qkv.out_features;
          const float *c = cos + pos[j] * (d / 2), *s = sin + pos[j] * (d / 2);
          rotary_heads(row_qkv, qp + j * q_width, hq_, d, c, s, interleaved_);
          rotary_heads(row_qkv + q_width, k_pool + slot[j] * kv_width, hkv_, d, c, s, interleaved_);
          std::memcpy(v_pool + slot[j] * kv_width, row_qkv + q_width + kv_width, kv_width * sizeof(float));
        }
      }, l.o);
      for (int64_t job; (job = next[5 * i + 4].fetch_add(1, std::memory_order_relaxed)) < t * hkv_;) {
        const int64_t j = job / hkv_;
        attention_job(qp + j * q_width, k_pool, v_pool, tables + (int64_t)row[j] * width, lens[j], hq_, hkv_, d,
                      block_size, scale_, job % hkv_, 1, scratch, attnp + j * q_width);
      }
#pragma omp barrier
      charge(2);
      run_tasks(l.o, attnp, t, op, next[5 * i + 1]);
#pragma omp barrier
      charge(3);
      serial([&] { add_rms_norm_rows(op, xp, w.post_norm.data_ptr<float>(), hp, t, hidden, eps); }, l.gate_up);
      charge(4);
      run_tasks(l.gate_up, hp, t, gup, next[5 * i + 2]);
#pragma omp barrier
      charge(5);
      serial([&] { silu_and_mul_rows(gup, actp, t, inter); }, l.down);
      charge(6);
      run_tasks(l.down, actp, t, downp, next[5 * i + 3]);
#pragma omp barrier
      charge(7);
    }
  }
  if (timed) ++profile_ns_[8];
  add_rms_norm_rows(downp, xp, final_norm_.data_ptr<float>(), out.data_ptr<float>(), t, hidden, eps);
  return out;
}
