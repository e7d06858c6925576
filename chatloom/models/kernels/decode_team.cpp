// A decode step's decoder stack on one team of threads (DecodeStack::forward_team).
//
// At batch 1 a step is 30 layers x 4 matmuls of 10-50 us each. Run as separate parallel regions,
// every matmul pays a fork and a join and splits its panels between the threads in advance, and the
// second core idles through every serial part. On a 2-core machine the gateway's event loop also
// takes a core for a moment at every token: a thread it displaces then holds up every join.
//
// Here one OpenMP region spans the whole stack, on buffers allocated once per step, as a chain of
// phases: per layer the QKV matmul, the attention, O, gate/up and down, and (forward_logits) the
// output head, whose tasks also find their columns' best logit, so that the step's argmax is a
// reduction over one value per task rather than another pass over the vocabulary. A phase's work items (a
// matmul's tasks of 4 panels, the attention's jobs of one token's KV head) go to whichever thread asks
// next, from a shared counter, and the thread that finishes a phase's last item runs the small serial
// part that follows (rotary and the pool writes, a norm, SiLU) and opens the next phase. No thread
// ever waits for another to arrive, only for work it needs to be done; and a thread that waits long
// for an item the OS stopped another thread in the middle of runs that item again itself, so when the
// OS takes one thread away the others carry the step on. Threads waiting for a phase to open prefetch its weights:
// a step is bound by reading them from memory, which would otherwise idle through the serial parts.
//
// A task or job computes exactly what quantized_linear or paged_attention computes for its outputs,
// and the serial parts run the same raw functions as the tensor kernels, so the bits are the same.
#include "decode_stack.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>

namespace {

constexpr const char* kTeamParts[9] = {"input_norm", "qkv", "attention", "o", "post_norm", "gate_up", "silu", "down",
                                       "head"};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Prefetches the next kClaim bytes of `w`'s codes, and the scales that go with them, from a cursor the
// waiting threads share. False when the weights are all claimed.
bool prefetch_some(std::atomic<int64_t>& cursor, const QuantizedPanels& w) {
  constexpr int64_t kClaim = 1024, kLine = 64;
  // Super-block panels hold their scales among the codes.
  const int64_t code_bytes = w.kq_offsets ? w.kq_offsets[w.panels] : w.panels * w.k_dim * (w.q4 ? 8 : 16);
  const int64_t scale_bytes = w.kq_offsets ? 0 : w.panels * (w.k_dim / 32) * 2 * 16 * (w.half_scales ? 2 : 4);
  const int64_t at = cursor.fetch_add(kClaim, std::memory_order_relaxed);
  if (at >= code_bytes) return false;
  const char* codes = reinterpret_cast<const char*>(w.codes);
  const char* scales = static_cast<const char*>(w.scales);
  const int64_t end = std::min(code_bytes, at + kClaim);
  for (int64_t b = at; b < end; b += kLine) _mm_prefetch(codes + b, _MM_HINT_T1);
  // Tasks read codes and scales at the same pace: panel p's scales are at p's share of the scales.
  for (int64_t b = at * scale_bytes / code_bytes / kLine * kLine; b < end * scale_bytes / code_bytes; b += kLine)
    _mm_prefetch(scales + b, _MM_HINT_T1);
  return true;
}

// How long a thread waits for a phase to open before it redoes an unfinished item of the phase before:
// several times an item's usual length (2-20 us), so a thread that is merely slower is left alone.
constexpr int64_t kRedoAfterNs = 25000;

// Whether logit v ranks above the best so far, as torch.argmax ranks them: a NaN above every number,
// and between equals the first one seen (callers go in index order).
inline bool ranks_above(float v, float best) {
  if (is_nan_bits(best)) return false;
  return is_nan_bits(v) || v > best;
}

// One per phase of a step: the work items' counters and whether the phase is open.
struct Phase {
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<bool> open{false};
  std::atomic<int64_t> prefetched{0};
  int64_t opened_ns = 0, serial_ns = 0;  // when profiling: when it opened, when its serial part began
};

}  // namespace

void DecodeStack::set_profiling(bool on) {
  profiling_ = on;
  profile_ns_.fill(0);
}

void DecodeStack::set_test_stall(int64_t ns, int64_t every) {
  TORCH_CHECK(ns >= 0 && every >= 0, "stall and period must be >= 0");
  stall_ns_ = ns;
  stall_every_ = every;
}

std::map<std::string, double> DecodeStack::profile() const {
  std::map<std::string, double> out;
  for (int i = 0; i < 9; ++i) out[kTeamParts[i]] = profile_ns_[i] * 1e-9;
  out["steps"] = (double)profile_ns_[9];
  out["redone"] = (double)profile_ns_[10];
  return out;
}

torch::Tensor DecodeStack::forward_team(torch::Tensor x, torch::Tensor positions,
                                        const std::vector<torch::Tensor>& k_pools,
                                        const std::vector<torch::Tensor>& v_pools, torch::Tensor slot_mapping,
                                        torch::Tensor block_tables, torch::Tensor rows, torch::Tensor kv_lens,
                                        torch::Tensor* logits, torch::Tensor* argmax) const {
  // Everything is checked here: the team's parts are raw loops that must not fail halfway.
  const size_t n = layers_.size();
  const TeamLayer& shape = team_[0];  // every layer has this shape (checked when the stack was built)
  const int64_t t = x.size(0), hidden = shape.qkv.k_dim, inter = shape.down.k_dim;
  const int64_t d = shape.qkv.out_features / (hq_ + 2 * hkv_), q_width = hq_ * d, kv_width = hkv_ * d;
  TORCH_CHECK(x.is_contiguous() && t >= 1 && x.size(1) == hidden, "x must be a contiguous [T, hidden], T >= 1");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == t,
              "one int64 position per token");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() && slot_mapping.numel() == t,
              "one int64 slot per token");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 && rows.scalar_type() == torch::kInt32 &&
              rows.is_contiguous() && rows.numel() == t && kv_lens.scalar_type() == torch::kInt32 &&
              kv_lens.is_contiguous() && kv_lens.numel() == t, "int32 block tables, rows and kv_lens, one per token");
  block_tables = block_tables.contiguous();
  const auto& pool = k_pools[0];
  const auto pool_type = pool.scalar_type();
  TORCH_CHECK(pool.dim() == 4 && pool.size(2) == hkv_ && pool.size(3) == d &&
              (pool_type == torch::kFloat32 || pool_type == torch::kHalf || pool_type == torch::kBFloat16),
              "pools must be float32, float16 or bfloat16 [blocks, block_size, Hkv, D]");
  for (size_t i = 0; i < n; ++i)
    TORCH_CHECK(k_pools[i].sizes() == pool.sizes() && v_pools[i].sizes() == pool.sizes() &&
                k_pools[i].scalar_type() == pool_type && v_pools[i].scalar_type() == pool_type &&
                k_pools[i].is_contiguous() && v_pools[i].is_contiguous(), "every layer's pools alike and contiguous");
  // Raw pointers per layer, taken here: the team's loops make no tensor calls.
  std::vector<void*> k_raw(n), v_raw(n);
  for (size_t i = 0; i < n; ++i) {
    k_raw[i] = k_pools[i].data_ptr();
    v_raw[i] = v_pools[i].data_ptr();
  }
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

  // The matmuls' and the attention's outputs get a buffer per layer: a thread the OS stopped in the
  // middle of an item, which another thread has since redone (see the loop below), may finish it late,
  // after the team moved on and its inputs changed; it then writes into a layer's buffer nobody reads
  // any more. Every input an item reads is rewritten only after its phase's outputs have been used.
  const auto opts = x.options();
  const int64_t L = (int64_t)n;
  torch::Tensor qkv = torch::empty({L, t, shape.qkv.out_features}, opts), q = torch::empty({t, q_width}, opts);
  torch::Tensor attn = torch::empty({L, t, q_width}, opts), o = torch::empty({L, t, hidden}, opts);
  torch::Tensor gate_up = torch::empty({L, t, 2 * inter}, opts), act = torch::empty({t, inter}, opts);
  torch::Tensor down = torch::empty({L, t, hidden}, opts), h = torch::empty({t, hidden}, opts);
  torch::Tensor out = torch::empty({t, hidden}, opts);
  // A 16-bit pool's rotated keys pass through float32 first, as decode_attention's do.
  std::vector<float> rotated_k(pool_type == torch::kFloat32 ? 0 : kv_width);
  float *xp = x.data_ptr<float>(), *qkv_all = qkv.data_ptr<float>(), *qp = q.data_ptr<float>();
  float *attn_all = attn.data_ptr<float>(), *o_all = o.data_ptr<float>(), *gu_all = gate_up.data_ptr<float>();
  float *actp = act.data_ptr<float>(), *down_all = down.data_ptr<float>(), *hp = h.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const auto per_layer = [t](float* all, int64_t width) {  // layer i's [t, width] rows of a buffer
    return [=](size_t i) { return all + (int64_t)i * t * width; };
  };
  const auto qkv_of = per_layer(qkv_all, shape.qkv.out_features), attn_of = per_layer(attn_all, q_width);
  const auto o_of = per_layer(o_all, hidden), gu_of = per_layer(gu_all, 2 * inter), down_of = per_layer(down_all, hidden);
  const float eps = (float)eps_;
  const bool timed = profiling_;

  // With the head: its logits, and per task and row the best logit of the task's columns and where.
  const bool with_head = logits != nullptr && argmax != nullptr;
  TORCH_CHECK(!with_head || head_.has_value(), "this stack has no head");
  const int64_t vocab = with_head ? head_panels_.out_features : 0;
  const int64_t head_tasks = with_head ? quantized_tasks(head_panels_) : 0;
  if (with_head) {
    *logits = torch::empty({t, vocab}, opts);
    *argmax = torch::empty({t}, opts.dtype(torch::kInt64));
  }
  std::vector<float> best_value(head_tasks * t);
  std::vector<int64_t> best_index(head_tasks * t);
  float* logits_p = with_head ? logits->data_ptr<float>() : nullptr;
  int64_t* argmax_p = with_head ? argmax->data_ptr<int64_t>() : nullptr;

  // Per layer: QKV, attention, O, gate/up, down; then, with the head, one phase for it.
  constexpr int kPerLayer = 5;
  const int64_t layer_phases = kPerLayer * (int64_t)n, head_phase = layer_phases;
  const int64_t phases = layer_phases + (with_head ? 1 : 0);
  std::unique_ptr<Phase[]> phase(new Phase[phases + 1]);
  const auto items = [&](int64_t k) -> int64_t {
    if (k == head_phase) return head_tasks;
    const TeamLayer& l = team_[k / kPerLayer];
    switch (k % kPerLayer) {
      case 0: return quantized_tasks(l.qkv);
      case 1: return t * hkv_;
      case 2: return quantized_tasks(l.o);
      case 3: return quantized_tasks(l.gate_up);
      default: return quantized_tasks(l.down);
    }
  };
  const auto weights = [&](int64_t k) -> const QuantizedPanels* {  // the matmul phase k runs, or null
    if (k == head_phase) return &head_panels_;
    const TeamLayer& l = team_[k / kPerLayer];
    switch (k % kPerLayer) {
      case 0: return &l.qkv;
      case 1: return nullptr;
      case 2: return &l.o;
      case 3: return &l.gate_up;
      default: return &l.down;
    }
  };
  // Each phase's input rows get a number of their own, unique in this process, so the int8 path
  // quantizes them once per thread and knows them again without comparing them.
  static std::atomic<int64_t> versions{0};
  const int64_t version0 = versions.fetch_add(phases, std::memory_order_relaxed);
  const auto run_item = [&](int64_t k, int64_t item, AttentionScratch& scratch) {
    const int64_t v = version0 + k;
    if (k == head_phase) {  // the task's logits, and each row's best of them
      run_quantized_task(head_panels_, outp, t, logits_p, item, v);
      const int64_t c0 = item * kTaskFeatures, c1 = std::min(vocab, c0 + kTaskFeatures);
      for (int64_t r = 0; r < t; ++r) {
        const float* row_logits = logits_p + r * vocab;
        int64_t at = c0;
        for (int64_t c = c0 + 1; c < c1; ++c)
          if (ranks_above(row_logits[c], row_logits[at])) at = c;
        best_value[item * t + r] = row_logits[at];
        best_index[item * t + r] = at;
      }
      return;
    }
    const size_t i = k / kPerLayer;
    const TeamLayer& l = team_[i];
    switch (k % kPerLayer) {
      case 0: run_quantized_task(l.qkv, hp, t, qkv_of(i), item, v); break;
      case 1: {
        const int64_t j = item / hkv_;
        const auto attend = [&](const auto* k_pool, const auto* v_pool) {
          attention_job(qp + j * q_width, k_pool, v_pool, tables + (int64_t)row[j] * width, lens[j], hq_, hkv_, d,
                        block_size, scale_, item % hkv_, 1, scratch, attn_of(i) + j * q_width);
        };
        if (pool_type == torch::kHalf)
          attend(static_cast<const c10::Half*>(k_raw[i]), static_cast<const c10::Half*>(v_raw[i]));
        else if (pool_type == torch::kBFloat16)
          attend(static_cast<const c10::BFloat16*>(k_raw[i]), static_cast<const c10::BFloat16*>(v_raw[i]));
        else
          attend(static_cast<const float*>(k_raw[i]), static_cast<const float*>(v_raw[i]));
        break;
      }
      case 2: run_quantized_task(l.o, attn_of(i), t, o_of(i), item, v); break;
      case 3: run_quantized_task(l.gate_up, hp, t, gu_of(i), item, v); break;
      default: run_quantized_task(l.down, actp, t, down_of(i), item, v); break;
    }
  };
  // What follows phase k once all its items are done, run by the thread that finished the last one.
  const auto serial_after = [&](int64_t k) {
    if (k == head_phase) {  // each row's argmax: the tasks' bests, in column order
      for (int64_t r = 0; r < t; ++r) {
        int64_t best = 0;
        for (int64_t task = 1; task < head_tasks; ++task)
          if (ranks_above(best_value[task * t + r], best_value[best * t + r])) best = task;
        argmax_p[r] = best_index[best * t + r];
      }
      return;
    }
    const size_t i = k / kPerLayer;
    switch (k % kPerLayer) {
      case 0: {  // rotary, and this step's keys and values into the pools (as decode_attention does)
        const auto write = [&](auto* k_pool, auto* v_pool) {
          for (int64_t j = 0; j < t; ++j) {
            const float* row_qkv = qkv_of(i) + j * shape.qkv.out_features;
            const float *c = cos + pos[j] * (d / 2), *s = sin + pos[j] * (d / 2);
            rotary_heads(row_qkv, qp + j * q_width, hq_, d, c, s, interleaved_);
            if constexpr (std::is_same_v<std::remove_pointer_t<decltype(k_pool)>, float>) {
              rotary_heads(row_qkv + q_width, k_pool + slot[j] * kv_width, hkv_, d, c, s, interleaved_);
            } else {
              rotary_heads(row_qkv + q_width, rotated_k.data(), hkv_, d, c, s, interleaved_);
              store_pool_row(rotated_k.data(), k_pool + slot[j] * kv_width, kv_width);
            }
            store_pool_row(row_qkv + q_width + kv_width, v_pool + slot[j] * kv_width, kv_width);
          }
        };
        if (pool_type == torch::kHalf)
          write(static_cast<c10::Half*>(k_raw[i]), static_cast<c10::Half*>(v_raw[i]));
        else if (pool_type == torch::kBFloat16)
          write(static_cast<c10::BFloat16*>(k_raw[i]), static_cast<c10::BFloat16*>(v_raw[i]));
        else
          write(static_cast<float*>(k_raw[i]), static_cast<float*>(v_raw[i]));
        break;
      }
      case 1: break;
      case 2: add_rms_norm_rows(o_of(i), xp, layers_[i].post_norm.data_ptr<float>(), hp, t, hidden, eps); break;
      case 3: silu_and_mul_rows(gu_of(i), actp, t, inter); break;
      default:  // the residual stream (x itself, updated in place) into the next layer's norm, or the final one
        if (i + 1 < n) add_rms_norm_rows(down_of(i), xp, layers_[i + 1].input_norm.data_ptr<float>(), hp, t, hidden, eps);
        else add_rms_norm_rows(down_of(i), xp, final_norm_.data_ptr<float>(), outp, t, hidden, eps);
    }
  };

  std::atomic<bool> stopping{false};  // the step stops at the phase opened last (stop_asked)
  // One flag per work item: set by whoever finishes the item first. Only that finish counts towards
  // the phase's `done`, so an item run twice still completes its phase once.
  std::vector<int64_t> first_item(phases + 1, 0);
  for (int64_t k = 0; k < phases; ++k) first_item[k + 1] = first_item[k] + items(k);
  std::unique_ptr<std::atomic<uint8_t>[]> finished(new std::atomic<uint8_t>[first_item[phases]]);
  for (int64_t f = 0; f < first_item[phases]; ++f) finished[f].store(0, std::memory_order_relaxed);
  const auto finish = [&](int64_t k, int64_t item) {
    if (finished[first_item[k] + item].exchange(1, std::memory_order_acq_rel) != 0) return;
    Phase& ph = phase[k];
    if (ph.done.fetch_add(1, std::memory_order_acq_rel) + 1 == first_item[k + 1] - first_item[k]) {
      if (timed) ph.serial_ns = now_ns();
      serial_after(k);
      // A layer is done: a step asked to stop does so here, every thread at its next phase.
      if (k % kPerLayer == kPerLayer - 1 && k + 1 < layer_phases && stop_asked())
        stopping.store(true, std::memory_order_release);
      if (timed) phase[k + 1].opened_ns = now_ns();
      phase[k + 1].open.store(true, std::memory_order_release);
    }
  };
  // An item of phase k that was handed out but is not finished yet, or -1.
  const auto unfinished = [&](int64_t k) -> int64_t {
    for (int64_t item = 0, n_items = first_item[k + 1] - first_item[k]; item < n_items; ++item)
      if (finished[first_item[k] + item].load(std::memory_order_acquire) == 0) return item;
    return -1;
  };

  std::atomic<int64_t> redone{0};
  rms_norm_rows(xp, layers_[0].input_norm.data_ptr<float>(), hp, t, hidden, eps);
  phase[0].opened_ns = timed ? now_ns() : 0;
  phase[0].open.store(true, std::memory_order_release);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    AttentionScratch scratch;
    for (int64_t k = 0; k < phases; ++k) {
      Phase& ph = phase[k];
      // Until the phase opens: prefetch its weights while they last, then spin, yielding after a while
      // in case the thread we wait for shares this core. A phase that stays shut long after every item
      // of the one before was handed out has an item whose thread the OS has stopped (on a 2-core
      // machine the gateway's event loop takes a core at every token): run that item again here, so
      // the step goes on at the pace of the threads still running rather than waiting for it.
      // The clock is read only once the thread spins (most phases are open when a thread gets there).
      const QuantizedPanels* w = weights(k);
      int64_t since = -1;
      for (int spins = 0; !ph.open.load(std::memory_order_acquire);) {
        if (w != nullptr && prefetch_some(ph.prefetched, *w)) continue;
        _mm_pause();
        if ((++spins & 63) == 0 && k > 0) {
          const int64_t now = now_ns();
          if (since < 0) {
            since = now;
          } else if (now - since > kRedoAfterNs) {
            const int64_t item = unfinished(k - 1);
            if (item >= 0) {
              if (timed) redone.fetch_add(1, std::memory_order_relaxed);
              run_item(k - 1, item, scratch);
              finish(k - 1, item);
              continue;
            }
          }
        }
        if (spins > 4000) sched_yield();
      }
      if (stopping.load(std::memory_order_acquire)) break;
      const int64_t n_items = items(k);
      for (int64_t item; (item = ph.next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
        if (stall_ns_ > 0 && stall_every_ > 0 && k % stall_every_ == 0 && omp_get_thread_num() == 1)
          std::this_thread::sleep_for(std::chrono::nanoseconds(stall_ns_));
        run_item(k, item, scratch);
        finish(k, item);
      }
    }
  }
  if (stopping.load()) {
    interrupted_ = true;
    return out;
  }
  if (timed) {
    // Parts in kTeamParts order: input_norm, qkv, attention, o, post_norm, gate_up, silu, down, head.
    for (int64_t k = 0; k < phases; ++k) {
      const int64_t work = phase[k].serial_ns - phase[k].opened_ns, after = phase[k + 1].opened_ns - phase[k].serial_ns;
      if (k == head_phase) {
        profile_ns_[8] += work + after;
        continue;
      }
      switch (k % kPerLayer) {
        case 0: profile_ns_[1] += work; profile_ns_[2] += after; break;  // rotary counts as attention
        case 1: profile_ns_[2] += work + after; break;
        case 2: profile_ns_[3] += work; profile_ns_[4] += after; break;
        case 3: profile_ns_[5] += work; profile_ns_[6] += after; break;
        default: profile_ns_[7] += work; profile_ns_[0] += after; break;  // the next layer's (or final) norm
      }
    }
    ++profile_ns_[9];
    profile_ns_[10] += redone.load();
  }
  return out;
}
