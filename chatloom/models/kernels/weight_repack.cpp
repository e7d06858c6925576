// Load-time work on GGUF blocks: expanding blocks to float32 (the tensors a model keeps as floats)
// and rearranging Q4_K / Q6_K super-blocks into the panels kquant_linear reads (the layout at the top
// of kquant_panels.cpp). Done in numpy, these took most of a 1.7B model's load (22 of 31 s); here one
// pass reads each of the file's blocks once and writes its output in place, at about 4 GB/s on one
// core: a 1 GB file's matrices in a quarter of a second.
//
// Each call runs on its calling thread alone (bound without the GIL): split across the work pool, a
// worker the OS takes away in the middle of its share holds the call up for a time slice (measured
// under load average 16 on 2 cores, a 9 MB matrix took 6-10 ms on two threads against 2.4 ms on one).
// packed_linear.pack_linears instead packs whole layers side by side on threads of its own.
//
// The float32 values are those of gguf's numpy dequantizer bit for bit: its products of a float16
// scale and small integers are exact in float32, so the only rounding is the final add of an offset
// (Q4_1, Q4_K, Q5_K), which happens once here too.
#include "weight_repack.h"

#include <c10/util/Half.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kSuper = 256;
// Must match kquant_panels.cpp (and SUPER_BYTES in kquant_panels.py).
constexpr int64_t kQ4KPanelBytes = 2368, kQ6KPanelBytes = 3360;

float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

enum Code { kQ4_0, kQ4_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K };

struct Kind {
  Code code;
  int64_t block, bytes;  // weights and bytes of one block
};

bool find_kind(const std::string& name, Kind* out) {
  static const std::pair<const char*, Kind> kinds[] = {
      {"Q4_0", {kQ4_0, 32, 18}},    {"Q4_1", {kQ4_1, 32, 20}},    {"Q8_0", {kQ8_0, 32, 34}},
      {"Q4_K", {kQ4_K, 256, 144}}, {"Q5_K", {kQ5_K, 256, 176}}, {"Q6_K", {kQ6_K, 256, 210}}};
  for (const auto& [n, k] : kinds)
    if (name == n) {
      *out = k;
      return true;
    }
  return false;
}

Kind kind_of(const std::string& name) {
  Kind k;
  TORCH_CHECK(find_kind(name, &k), "dequantize_blocks: no C++ path for ", name);
  return k;
}

// Q4_K and Q5_K: 8 six-bit scales and mins from their 12 packed bytes (gguf's get_scale_min).
void scales_mins(const uint8_t* b, uint8_t* sc, uint8_t* mn) {
  for (int i = 0; i < 4; ++i) {
    sc[i] = b[i] & 0x3F;
    mn[i] = b[4 + i] & 0x3F;
    sc[4 + i] = (b[8 + i] & 0x0F) | ((b[i] >> 2) & 0x30);
    mn[4 + i] = (b[8 + i] >> 4) | ((b[4 + i] >> 2) & 0x30);
  }
}

// Q6_K: the unsigned 6-bit code of each of a super-block's 256 depths, in order.
void q6k_codes(const uint8_t* blk, uint8_t* q) {
  const uint8_t *ql = blk, *qh = blk + 128;
  for (int n = 0; n < 2; ++n)
    for (int r = 0; r < 128; ++r) {
      const uint8_t low = (ql[n * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
      const uint8_t high = (qh[n * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
      q[n * 128 + r] = low | (high << 4);
    }
}

// Q4_K: the 4-bit code of each depth (chunk c of 32 bytes: depths 64c.. in the low nibbles, 64c+32.. high).
void q4k_codes(const uint8_t* blk, uint8_t* q) {
  const uint8_t* qs = blk + 16;
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 32; ++i) {
      q[c * 64 + i] = qs[c * 32 + i] & 0x0F;
      q[c * 64 + 32 + i] = qs[c * 32 + i] >> 4;
    }
}

void dequantize_block(Code kind, const uint8_t* b, float* y) {
  if (kind == kQ8_0) {
    const float d = half(b);
    for (int i = 0; i < 32; ++i) y[i] = (float)(int8_t)b[2 + i] * d;
  } else if (kind == kQ4_0) {
    const float d = half(b);
    for (int i = 0; i < 16; ++i) {
      y[i] = d * (float)((b[2 + i] & 0x0F) - 8);
      y[16 + i] = d * (float)((b[2 + i] >> 4) - 8);
    }
  } else if (kind == kQ4_1) {
    const float d = half(b), m = half(b + 2);
    for (int i = 0; i < 16; ++i) {
      y[i] = d * (float)(b[4 + i] & 0x0F) + m;
      y[16 + i] = d * (float)(b[4 + i] >> 4) + m;
    }
  } else if (kind == kQ4_K || kind == kQ5_K) {
    const float d = half(b), dmin = half(b + 2);
    uint8_t sc[8], mn[8];
    scales_mins(b + 4, sc, mn);
    const bool five = kind == kQ5_K;
    const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int g = 0; g < 8; ++g) {
      const float d1 = d * (float)sc[g], m1 = dmin * (float)mn[g];
      for (int i = 0; i < 32; ++i) {
        uint8_t q = (qs[(g / 2) * 32 + i] >> (4 * (g % 2))) & 0x0F;
        if (five) q |= ((qh[i] >> g) & 1) << 4;
        y[g * 32 + i] = d1 * (float)q - m1;
      }
    }
  } else {  // Q6_K
    uint8_t q[kSuper];
    q6k_codes(b, q);
    const float d = half(b + 208);
    for (int g = 0; g < 16; ++g) {
      const float d1 = d * (float)(int8_t)b[192 + g];
      for (int i = 0; i < 16; ++i) y[g * 16 + i] = d1 * (float)((int)q[g * 16 + i] - 32);
    }
  }
}

// One panel's super-block `sb` of Q4_K rows (rows past `rows` are zero) into `out` (2368 bytes).
void pack_q4k(const uint8_t* raw, int64_t row_bytes, int64_t rows, int64_t r0, int64_t sb, uint8_t* out) {
  std::memset(out, 0, kQ4KPanelBytes);
  uint8_t q[kSuper], sc[8], mn[8];
  for (int64_t j = 0; j < kPanel && r0 + j < rows; ++j) {
    const uint8_t* blk = raw + (r0 + j) * row_bytes + sb * 144;
    std::memcpy(out + 2 * j, blk, 2);
    std::memcpy(out + 32 + 2 * j, blk + 2, 2);
    scales_mins(blk + 4, sc, mn);
    for (int g = 0; g < 8; ++g) {
      out[64 + g * kPanel + j] = sc[g];
      out[192 + g * kPanel + j] = mn[g];
    }
    q4k_codes(blk, q);
    uint8_t* codes = out + 320;  // word w, lane j, byte b: depths 8w + 2b (low nibble) and + 1
    for (int w = 0; w < 32; ++w)
      for (int b = 0; b < 4; ++b) codes[w * 64 + j * 4 + b] = q[8 * w + 2 * b] | (q[8 * w + 2 * b + 1] << 4);
  }
}

// Q6_K; `int8` puts the high code bits in the int8 kernel's order (kquant_int8.cpp: in word h of 16
// depths, bits 2t..2t+1 of byte b of lane j hold depth 16h + 8 (t / 2) + 2b + t % 2), else in the exact
// kernel's (depth 16h + 4b + t).
void pack_q6k(const uint8_t* raw, int64_t row_bytes, int64_t rows, int64_t r0, int64_t sb, bool int8, uint8_t* out) {
  std::memset(out, 0, kQ6KPanelBytes);
  uint8_t q[kSuper];
  for (int64_t j = 0; j < kPanel && r0 + j < rows; ++j) {
    const uint8_t* blk = raw + (r0 + j) * row_bytes + sb * 210;
    std::memcpy(out + 2 * j, blk + 208, 2);
    for (int g = 0; g < 16; ++g) out[32 + g * kPanel + j] = blk[192 + g];
    q6k_codes(blk, q);
    uint8_t *low = out + 288, *high = out + 2336;
    for (int w = 0; w < 32; ++w)
      for (int b = 0; b < 4; ++b)
        low[w * 64 + j * 4 + b] = (q[8 * w + 2 * b] & 0x0F) | ((q[8 * w + 2 * b + 1] & 0x0F) << 4);
    for (int h = 0; h < 16; ++h)
      for (int b = 0; b < 4; ++b) {
        uint8_t v = 0;
        for (int t = 0; t < 4; ++t) {
          const int depth = int8 ? 16 * h + 8 * (t / 2) + 2 * b + t % 2 : 16 * h + 4 * b + t;
          v |= (q[depth] >> 4) << (2 * t);
        }
        high[h * 64 + j * 4 + b] = v;
      }
  }
}

void check_raw(const torch::Tensor& raw, const char* what) {
  TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous(), what,
              ": raw blocks must be a contiguous uint8 [rows, bytes] tensor");
}

}  // namespace

torch::Tensor dequantize_blocks(torch::Tensor raw, const std::string& kind) {
  check_raw(raw, "dequantize_blocks");
  const Kind k = kind_of(kind);
  const int64_t rows = raw.size(0), row_bytes = raw.size(1);
  TORCH_CHECK(row_bytes % k.bytes == 0, "dequantize_blocks: ", row_bytes, " bytes a row is not whole ", kind,
              " blocks");
  const int64_t nb = row_bytes / k.bytes;
  auto out = torch::empty({rows, nb * k.block}, torch::kFloat32);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b)
      dequantize_block(k.code, src + r * row_bytes + b * k.bytes, dst + (r * nb + b) * k.block);
  return out;
}

int64_t dequantized_width(const std::string& kind, int64_t row_bytes) {
  Kind k;
  if (!find_kind(kind, &k) || row_bytes <= 0 || row_bytes % k.bytes != 0) return 0;
  return row_bytes / k.bytes * k.block;
}

void dequantize_row(const std::string& kind, const uint8_t* row, int64_t row_bytes, float* out) {
  const Kind k = kind_of(kind);
  for (int64_t b = 0; b < row_bytes / k.bytes; ++b) dequantize_block(k.code, row + b * k.bytes, out + b * k.block);
}

void kquant_pack_panels(torch::Tensor raw, int64_t kind, torch::Tensor out) {
  check_raw(raw, "kquant_pack_panels");
  TORCH_CHECK(kind >= 0 && kind <= 3, "kquant_pack_panels: kind is 0 (Q4_K) or 1 (Q6_K), 2 or 3 for int8 activations");
  const bool q4 = kind % 2 == 0, int8 = kind >= 2;
  const int64_t block_bytes = q4 ? 144 : 210, panel_bytes = q4 ? kQ4KPanelBytes : kQ6KPanelBytes;
  const int64_t rows = raw.size(0), row_bytes = raw.size(1);
  TORCH_CHECK(row_bytes % block_bytes == 0, "kquant_pack_panels: a row is not whole super-blocks");
  const int64_t nb = row_bytes / block_bytes, panels = (rows + kPanel - 1) / kPanel;
  TORCH_CHECK(out.scalar_type() == torch::kUInt8 && out.is_contiguous() && out.numel() == panels * nb * panel_bytes,
              "kquant_pack_panels: out must be a contiguous uint8 tensor of ", panels * nb * panel_bytes, " bytes");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t sb = 0; sb < nb; ++sb) {
      uint8_t* o = dst + (p * nb + sb) * panel_bytes;
      if (q4)
        pack_q4k(src, row_bytes, rows, p * kPanel, sb, o);
      else
        pack_q6k(src, row_bytes, rows, p * kPanel, sb, int8, o);
    }
}
