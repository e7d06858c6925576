// A decode step's whole decoder stack in one native call.
//
// At batch 1 a step is about 30 layers x 8 small kernel calls. Through Python each call also pays
// for a module dispatch and the conversion of its arguments, about half a millisecond per step in
// all, as much as the attention itself. DecodeStack holds every layer's weights once (converted at
// build time) and runs the same kernels in the same order as the Python path (llama.py), so the
// result has the same bits; only the glue between them goes.
#include "decode_stack.h"
#include "weight_repack.h"

#include <algorithm>

namespace {

// y = x @ W^T (+ bias) through the kernel the Python layer would call (packed_linear.py).
torch::Tensor run_linear(const NativeLinear& l, const torch::Tensor& x) {
  switch (l.kind) {
    case NativeLinear::kPacked:
      return packed_linear(x, l.weight, l.out_features, l.bias, "auto");
    case NativeLinear::kQuantized:
      return quantized_linear(x, l.weight, l.scales, l.out_features, l.bias, "auto");
    case NativeLinear::kInt8: {
      auto y = int8_linear(x, l.weight, l.scales, l.out_features, l.bias, "auto");
      if (l.m_panels.defined()) {  // Q5_K: the m term, (block sums of x) @ m^T
        auto sums = x.reshape({x.size(0), -1, 32}).sum(2);
        y += packed_linear(sums, l.m_panels, l.out_features, c10::nullopt, "auto");
      }
      return y;
    }
    case NativeLinear::kGrouped:
      return grouped_quantized_linear(x, l.weight, l.scales, l.out_features, l.bias);
    case NativeLinear::kGroupedInt8:
      return grouped_int8_linear(x, l.weight, l.scales, l.out_features, l.bias);
    case NativeLinear::kBF16:
      return bf16_linear(x, l.weight, l.out_features, l.bias, "auto");
    case NativeLinear::kKQuant:
      return kquant_linear(x, l.weight, l.scales, l.m_panels, l.out_features, l.bias);
  }
  TORCH_CHECK(false, "unknown linear kind ", l.kind);
}

// A quantized layer (kQuantized or kKQuant) as the team path's tasks.
QuantizedPanels panels_of(const NativeLinear& l) {
  if (l.kind == NativeLinear::kKQuant) return kquant_panels(l.weight, l.scales, l.m_panels, l.bias, l.out_features);
  return quantized_panels(l.weight, l.scales, l.bias, l.out_features);
}

// What forward and forward_logits both need before they pick a path.
void check_stack_inputs(const torch::Tensor& x, size_t layers, const std::vector<torch::Tensor>& k_pools,
                        const std::vector<torch::Tensor>& v_pools) {
  TORCH_CHECK(k_pools.size() == layers && v_pools.size() == layers, "one K and one V pool per layer");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [T, hidden]");
}

// The team path reads float32, float16 and bfloat16 pools (a float64 model's take the layer-by-layer path).
bool team_pools(const std::vector<torch::Tensor>& k_pools) {
  const auto type = k_pools[0].scalar_type();
  return type == torch::kFloat32 || type == torch::kHalf || type == torch::kBFloat16;
}

// What a stopped step returns: no logits and no picks.
std::tuple<torch::Tensor, torch::Tensor> stopped_step(const torch::Tensor& x) {
  return {torch::empty({0, 0}, x.options()), torch::empty({0}, x.options().dtype(torch::kInt64))};
}

}  // namespace

NativeLinear::NativeLinear(int64_t kind_, torch::Tensor weight_, c10::optional<torch::Tensor> scales_,
                           c10::optional<torch::Tensor> bias_, c10::optional<torch::Tensor> m_panels_,
                           int64_t out_features_)
    : kind((Kind)kind_), weight(std::move(weight_)), out_features(out_features_) {
  TORCH_CHECK(kind_ >= kPacked && kind_ <= kKQuant, "unknown linear kind ", kind_);
  if (scales_.has_value()) scales = *scales_;
  if (bias_.has_value() && bias_->defined()) bias = *bias_;
  if (m_panels_.has_value()) m_panels = *m_panels_;
}

DecodeStack::DecodeStack(std::vector<DecodeLayerWeights> layers, torch::Tensor final_norm, double eps,
                         torch::Tensor cos, torch::Tensor sin, bool interleaved, int64_t hq, int64_t hkv,
                         double scale)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), eps_(eps), cos_(std::move(cos)),
      sin_(std::move(sin)), interleaved_(interleaved), hq_(hq), hkv_(hkv), scale_(scale) {
  TORCH_CHECK(!layers_.empty(), "a decoder stack needs at least one layer");
  const auto tasks = [](const NativeLinear& l) { return panels_of(l); };
  const bool all_quantized = std::all_of(layers_.begin(), layers_.end(), [](const DecodeLayerWeights& w) {
    for (const NativeLinear* l : {&w.qkv, &w.o, &w.gate_up, &w.down})
      if (l->kind != NativeLinear::kQuantized && l->kind != NativeLinear::kKQuant) return false;
    return true;
  });
  if (all_quantized && quantized_tasks_supported())
    for (const auto& w : layers_) team_.push_back({tasks(w.qkv), tasks(w.o), tasks(w.gate_up), tasks(w.down)});
  if (!team_.empty() && !team_shape_ok()) team_.clear();
}

// The team path's buffers and raw loops assume one Llama shape for every layer.
bool DecodeStack::team_shape_ok() const {
  const TeamLayer& a = team_[0];
  const int64_t hidden = a.qkv.k_dim, heads = hq_ + 2 * hkv_;
  if (heads <= 0 || hkv_ <= 0 || hq_ % hkv_ != 0 || a.qkv.out_features % heads != 0) return false;
  const int64_t d = a.qkv.out_features / heads;
  if (d % 2 != 0 || a.o.k_dim != hq_ * d || a.o.out_features != hidden || a.gate_up.k_dim != hidden ||
      a.gate_up.out_features != 2 * a.down.k_dim || a.down.out_features != hidden)
    return false;
  if (cos_.scalar_type() != torch::kFloat32 || sin_.scalar_type() != torch::kFloat32 || !cos_.is_contiguous() ||
      !sin_.is_contiguous() || cos_.dim() != 2 || cos_.size(1) != d / 2 || sin_.sizes() != cos_.sizes() ||
      final_norm_.numel() != hidden || final_norm_.scalar_type() != torch::kFloat32 || !final_norm_.is_contiguous())
    return false;
  for (size_t i = 0; i < team_.size(); ++i) {
    const TeamLayer& b = team_[i];
    const QuantizedPanels *x[4] = {&a.qkv, &a.o, &a.gate_up, &a.down}, *y[4] = {&b.qkv, &b.o, &b.gate_up, &b.down};
    for (int j = 0; j < 4; ++j)
      if (x[j]->k_dim != y[j]->k_dim || x[j]->out_features != y[j]->out_features) return false;
    for (const torch::Tensor* norm : {&layers_[i].input_norm, &layers_[i].post_norm})
      if (norm->numel() != hidden || norm->scalar_type() != torch::kFloat32 || !norm->is_contiguous()) return false;
  }
  return true;
}

torch::Tensor DecodeStack::forward(torch::Tensor x, torch::Tensor positions, const std::vector<torch::Tensor>& k_pools,
                                   const std::vector<torch::Tensor>& v_pools, torch::Tensor slot_mapping,
                                   torch::Tensor block_tables, torch::Tensor rows, torch::Tensor kv_lens) const {
  const size_t n = layers_.size();
  check_stack_inputs(x, n, k_pools, v_pools);
  if (!team_.empty() && x.size(0) <= kMaxTaskRows && team_pools(k_pools))
    return forward_team(x, positions, k_pools, v_pools, slot_mapping, block_tables, rows, kv_lens);
  // The residual stream is x itself, updated in place (the embedding output is a fresh tensor).
  torch::Tensor residual = x;
  torch::Tensor h;
  for (size_t i = 0; i < n; ++i) {
    if (i > 0 && stop_asked()) {
      interrupted_ = true;
      return x;
    }
    const DecodeLayerWeights& w = layers_[i];
    h = i == 0 ? rms_norm(x.contiguous(), w.input_norm, eps_) : add_rms_norm(h, residual, w.input_norm, eps_);
    auto qkv = run_linear(w.qkv, h);
    auto attn = decode_attention(qkv, positions, cos_, sin_, interleaved_, hq_, hkv_, k_pools[i], v_pools[i],
                                 slot_mapping, block_tables, rows, kv_lens, scale_);
    h = add_rms_norm(run_linear(w.o, attn), residual, w.post_norm, eps_);
    h = run_linear(w.down, silu_and_mul(run_linear(w.gate_up, h)));
  }
  return add_rms_norm(h, residual, final_norm_, eps_);
}

void DecodeStack::set_head(const NativeLinear& head) {
  head_.reset();
  if (team_.empty() || (head.kind != NativeLinear::kQuantized && head.kind != NativeLinear::kKQuant)) return;
  const QuantizedPanels panels = panels_of(head);
  if (panels.k_dim != team_[0].qkv.k_dim) return;
  head_ = head;
  head_panels_ = panels;
}

std::tuple<torch::Tensor, torch::Tensor> DecodeStack::forward_logits(
    torch::Tensor x, torch::Tensor positions, const std::vector<torch::Tensor>& k_pools,
    const std::vector<torch::Tensor>& v_pools, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor rows, torch::Tensor kv_lens) const {
  TORCH_CHECK(head_.has_value(), "this stack has no head (set_head took none)");
  check_stack_inputs(x, layers_.size(), k_pools, v_pools);
  if (x.size(0) <= kMaxTaskRows && team_pools(k_pools)) {
    torch::Tensor logits, argmax;
    forward_team(x, positions, k_pools, v_pools, slot_mapping, block_tables, rows, kv_lens, &logits, &argmax);
    if (interrupted_) return stopped_step(x);
    return {logits, argmax};
  }
  const auto hidden = forward(x, positions, k_pools, v_pools, slot_mapping, block_tables, rows, kv_lens);
  if (interrupted_) return stopped_step(x);
  auto logits = run_linear(*head_, hidden);
  return {logits, logits.argmax(1)};
}

bool DecodeStack::screens_head(int64_t rows, const std::vector<torch::Tensor>& k_pools) const {
  // The team's head is bound by reading its weights, where screening saves nothing.
  return has_greedy_head() && !(rows <= kMaxTaskRows && team_pools(k_pools));
}

namespace {

// Each row's argmax as ints, and the rows whose picked logit (value_at(row, its argmax)) is a NaN.
template <typename ValueAt>
DecodeStack::Picks with_picks(torch::Tensor logits, torch::Tensor argmax, ValueAt value_at) {
  const int64_t t = argmax.size(0);
  const int64_t* a = argmax.data_ptr<int64_t>();
  std::vector<int64_t> picks(a, a + t), nan_rows;
  for (int64_t i = 0; i < t; ++i)
    if (is_nan_bits(value_at(i, a[i]))) nan_rows.push_back(i);
  return {std::move(logits), std::move(argmax), std::move(picks), std::move(nan_rows)};
}

// forward_logits' result with its picks.
DecodeStack::Picks logits_with_picks(std::tuple<torch::Tensor, torch::Tensor> found) {
  auto& [logits, argmax] = found;
  const float* l = logits.data_ptr<float>();
  const int64_t width = logits.size(1);
  return with_picks(logits, argmax, [&](int64_t i, int64_t j) { return l[i * width + j]; });
}

}  // namespace

DecodeStack::Picks DecodeStack::forward_argmax(
    torch::Tensor x, torch::Tensor positions, const std::vector<torch::Tensor>& k_pools,
    const std::vector<torch::Tensor>& v_pools, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor rows, torch::Tensor kv_lens) const {
  TORCH_CHECK(head_.has_value(), "this stack has no head (set_head took none)");
  check_stack_inputs(x, layers_.size(), k_pools, v_pools);
  if (screens_head(x.size(0), k_pools)) {
    const auto hidden = forward(x, positions, k_pools, v_pools, slot_mapping, block_tables, rows, kv_lens);
    if (interrupted_) return logits_with_picks(stopped_step(x));
    auto [argmax, picked] = greedy_head_argmax(hidden, head_->weight, head_->scales, head_->out_features,
                                               greedy_codes_, greedy_scales_, greedy_norms_);
    const float* v = picked.data_ptr<float>();
    return with_picks(torch::empty({x.size(0), 0}, x.options()), argmax, [&](int64_t i, int64_t) { return v[i]; });
  }
  return logits_with_picks(forward_logits(x, positions, k_pools, v_pools, slot_mapping, block_tables, rows, kv_lens));
}

void DecodeStack::set_greedy_head(torch::Tensor codes8, torch::Tensor scales8, torch::Tensor norms) {
  TORCH_CHECK(head_.has_value(), "set_greedy_head needs a head (set_head took none)");
  TORCH_CHECK(norms.scalar_type() == torch::kFloat32 && norms.numel() == head_->out_features,
              "one float32 norm per output feature");
  greedy_codes_ = std::move(codes8);
  greedy_scales_ = std::move(scales8);
  greedy_norms_ = std::move(norms);
}

void DecodeStack::set_embedding(torch::Tensor weight, const std::string& kind) {
  embedding_ = torch::Tensor();
  embedding_kind_.clear();
  if (!head_.has_value() || weight.dim() != 2 || !weight.is_contiguous()) return;
  const int64_t hidden = team_[0].qkv.k_dim;
  const bool floats = kind.empty() && weight.scalar_type() == torch::kFloat32 && weight.size(1) == hidden;
  const bool blocks = !kind.empty() && weight.scalar_type() == torch::kUInt8 &&
                      dequantized_width(kind, weight.size(1)) == hidden;
  if (!floats && !blocks) return;
  embedding_ = std::move(weight);
  embedding_kind_ = kind;
}

DecodeStack::Picks DecodeStack::forward_tokens(
    const std::vector<int64_t>& ids, const std::vector<int64_t>& positions, const std::vector<int64_t>& slots,
    const std::vector<std::vector<int32_t>>& tables, const std::vector<torch::Tensor>& k_pools,
    const std::vector<torch::Tensor>& v_pools, bool argmax_only, bool interruptible) const {
  TORCH_CHECK(embedding_.defined(), "this stack has no embedding (set_embedding took none)");
  const int64_t t = (int64_t)ids.size(), vocab = embedding_.size(0), hidden = team_[0].qkv.k_dim;
  TORCH_CHECK(t >= 1 && (int64_t)positions.size() == t && (int64_t)slots.size() == t && (int64_t)tables.size() == t,
              "one position, slot and block table per token id");
  size_t width = 0;
  for (const auto& table : tables) width = std::max(width, table.size());
  TORCH_CHECK(width > 0, "every block table needs a block");
  // The embedded tokens: a fresh tensor, as the stack updates it in place (nn.Embedding's bits).
  auto x = torch::empty({t, hidden}, torch::kFloat32);
  float* xp = x.data_ptr<float>();
  std::vector<int32_t> padded(t * width, 0), rows(t), kv_lens(t);
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < vocab, "token id ", ids[i], " is outside the vocabulary (", vocab, ")");
    if (embedding_kind_.empty()) {
      std::memcpy(xp + i * hidden, embedding_.data_ptr<float>() + ids[i] * hidden, hidden * sizeof(float));
    } else {
      const int64_t row_bytes = embedding_.size(1);
      dequantize_row(embedding_kind_, embedding_.data_ptr<uint8_t>() + ids[i] * row_bytes, row_bytes, xp + i * hidden);
    }
    std::copy(tables[i].begin(), tables[i].end(), padded.begin() + i * width);
    rows[i] = (int32_t)i;
    TORCH_CHECK(positions[i] >= 0 && positions[i] < INT32_MAX, "position out of range");
    kv_lens[i] = (int32_t)(positions[i] + 1);
  }
  // Views of the lists (the kernels only read them, and they outlive the call).
  const auto view = [](const auto& v, at::IntArrayRef shape, torch::ScalarType type) {
    return torch::from_blob(const_cast<void*>(static_cast<const void*>(v.data())), shape, type);
  };
  const auto pos_t = view(positions, {t}, torch::kInt64), slots_t = view(slots, {t}, torch::kInt64);
  const auto tables_t = view(padded, {t, (int64_t)width}, torch::kInt32);
  const auto rows_t = view(rows, {t}, torch::kInt32), lens_t = view(kv_lens, {t}, torch::kInt32);
  // Only this call may stop early: forward, forward_logits and forward_argmax called on their own never do.
  struct Interruptible {
    bool& flag;
    Interruptible(bool& f, bool on) : flag(f) { flag = on; }
    ~Interruptible() { flag = false; }
  } scope(interruptible_, interruptible);
  interrupted_ = false;
  if (argmax_only) return forward_argmax(x, pos_t, k_pools, v_pools, slots_t, tables_t, rows_t, lens_t);
  return logits_with_picks(forward_logits(x, pos_t, k_pools, v_pools, slots_t, tables_t, rows_t, lens_t));
}
