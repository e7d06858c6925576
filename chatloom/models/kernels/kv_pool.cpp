// A step's fresh K or V rows written into a layer's paged pool at their flat slots.
//
// PyTorch's index_copy_ does this on the calling thread, element by element, while the other
// threads wait: about a millisecond of a 32-sequence decode step and tens of a 2,048-token
// prefill step. Here each row is one contiguous copy (or conversion), spread over the threads.
// The values are those index_copy_ after attention.py's as_stored would write: the same float32
// bits, or rounded to nearest even for a 16-bit pool, float16 saturating at 65504.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cstring>

namespace {

template <typename T>
void store_row(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    // A NaN stays one (a clamp under -ffast-math would turn it into -65504).
    for (int64_t i = 0; i < n; ++i)
      dst[i] = c10::Half(is_nan_bits(src[i]) ? src[i] : std::clamp(src[i], -65504.0f, 65504.0f));
  } else {
    // c10's rounding tells a NaN by std::isnan, which -ffast-math turns off.
    for (int64_t i = 0; i < n; ++i)
      dst[i] = is_nan_bits(src[i]) ? c10::BFloat16(0x7FC0, c10::BFloat16::from_bits()) : c10::BFloat16(src[i]);
  }
}

}  // namespace

void store_pool_row(const float* src, float* dst, int64_t n) { store_row(src, dst, n); }
void store_pool_row(const float* src, c10::Half* dst, int64_t n) { store_row(src, dst, n); }
void store_pool_row(const float* src, c10::BFloat16* dst, int64_t n) { store_row(src, dst, n); }

void write_pool_rows(torch::Tensor pool, torch::Tensor slot_mapping, torch::Tensor rows) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous(), "pool must be a contiguous [blocks, block_size, H, D]");
  const int64_t width = pool.size(2) * pool.size(3), slots = pool.size(0) * pool.size(1);
  TORCH_CHECK(rows.scalar_type() == torch::kFloat32, "rows must be float32");
  TORCH_CHECK(rows.dim() >= 2 && rows.numel() == rows.size(0) * width,
              "rows must be [T, H, D] with the pool's H and D");
  const auto flat = rows.reshape({rows.size(0), width});
  TORCH_CHECK(flat.stride(1) == 1, "each row must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == flat.size(0),
              "one int64 slot per row");
  const int64_t t = flat.size(0), stride = flat.stride(0);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < slots, "slot ", slot[i], " out of range");
  const float* src = flat.data_ptr<float>();
  auto write = [&](auto* dst) {
    // Rows of a few KB each: spread them only when there are enough to pay for waking a thread.
    chatloom_kernels::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) store_row(src + i * stride, dst + slot[i] * width, width);
    });
  };
  switch (pool.scalar_type()) {
    case torch::kFloat32: write(pool.data_ptr<float>()); break;
    case torch::kHalf: write(pool.data_ptr<c10::Half>()); break;
    case torch::kBFloat16: write(pool.data_ptr<c10::BFloat16>()); break;
    default: TORCH_CHECK(false, "pools are float32, float16 or bfloat16");
  }
}
