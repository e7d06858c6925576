// The int8-activation path of the super-block K-quant matmul (kquant_int8.cpp): panels of kinds 2
// (Q4_K) and 3 (Q6_K), laid out as kquant_panels.cpp describes, multiplied with VPDPBUSD.
#pragma once
#include <cstdint>

struct KQuantInt8Weights {
  const uint8_t* blob;
  const int64_t* offsets;
  const uint8_t* kinds;
  int64_t panels, k_dim, out_features;
  const float* bias;
};

// Whether this CPU runs the path (AVX-512 F, BW, VL, VNNI and F16C).
bool kquant_int8_supported();
// out [m, N] = x [m, K] @ W^T (+ bias), every row of x quantized once, on the work pool.
void kquant_int8_matmul(const KQuantInt8Weights& w, const float* x, int64_t m, float* out);
// Panels [p0, p1) only, on the calling thread (the decode team's tasks); x is quantized by each
// thread once per distinct input. `x_version` >= 0 names the input: the same version at the same
// address is the same rows (the decode team numbers each step's phases). Without one (-1), a
// thread-local copy of the rows tells when they changed.
void kquant_int8_panels(const KQuantInt8Weights& w, const float* x, int64_t m, int64_t p0, int64_t p1, float* out,
                        int64_t x_version = -1);
