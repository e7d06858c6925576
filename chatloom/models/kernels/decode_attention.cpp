// A decode step's attention in one call: split the fused QKV projection, rotate q and k, write
// k and v into the paged pool and attend. The same kernels (rotary, paged_attention) and the
// same pool writes as the step-by-step Python path, so the same bits; what goes is a dozen small
// Python-level tensor operations per layer, which at batch 1 cost as much as the attention itself.
#include "kernels.h"

torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                               bool interleaved, int64_t hq, int64_t hkv, torch::Tensor k_pool,
                               torch::Tensor v_pool, torch::Tensor slot_mapping, torch::Tensor block_tables,
                               torch::Tensor rows, torch::Tensor kv_lens, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous [T, (Hq + 2 Hkv) D]");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(2) == hkv && v_pool.sizes() == k_pool.sizes(),
              "pools must be [blocks, block_size, Hkv, D]");
  const int64_t t = qkv.size(0), d = k_pool.size(3);
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d, "qkv width does not match the heads");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == t, "one int64 slot per token");
  const auto q = qkv.narrow(1, 0, hq * d).view({t, hq, d});
  const auto k = qkv.narrow(1, hq * d, hkv * d).view({t, hkv, d});
  const auto v = qkv.narrow(1, (hq + hkv) * d, hkv * d).view({t, hkv, d});
  auto rotated = rotary(q, k, positions, cos, sin, interleaved);
  write_pool_rows(k_pool, slot_mapping, rotated[1]);
  write_pool_rows(v_pool, slot_mapping, v);
  return paged_attention(rotated[0], k_pool, v_pool, block_tables, rows, kv_lens, scale).view({t, hq * d});
}
