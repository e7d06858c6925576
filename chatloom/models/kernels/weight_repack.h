// Load-time conversions of GGUF blocks (weight_repack.cpp), bound to Python in bindings.cpp.
#pragma once
#include <torch/extension.h>

#include <string>

// Rows of GGUF blocks of `kind` (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), uint8 [rows, bytes], as float32
// [rows, weights], the values of gguf's dequantizer.
torch::Tensor dequantize_blocks(torch::Tensor raw, const std::string& kind);

// Rows of Q4_K (kind 0) or Q6_K (kind 1) super-blocks, uint8 [rows, bytes], into kquant_linear's
// panels in `out` (kinds 2 and 3: the same for the int8-activation kernel) (uint8, ceil(rows / 16) * (K / 256) panel super-blocks; rows past the end are zero).
void kquant_pack_panels(torch::Tensor raw, int64_t kind, torch::Tensor out);

// The width in weights of a row of `row_bytes` bytes of GGUF blocks of `kind`, or 0 where `kind` has no
// C++ path or the row is not whole blocks.
int64_t dequantized_width(const std::string& kind, int64_t row_bytes);

// One such row into `out` (float32, dequantized_width weights), as dequantize_blocks expands it.
void dequantize_row(const std::string& kind, const uint8_t* row, int64_t row_bytes, float* out);
