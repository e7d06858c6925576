#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention over a paged KV pool");
  m.def("packed_linear", &packed_linear, "x [M, K] @ W^T (+ bias) with W packed in 16-column panels (float32)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("bias") = pybind11::none());
  m.def("quantized_linear", &quantized_linear, "x [M, K] @ W^T (+ bias) with W kept as Q4_1/Q8_0 panels",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none());
  m.def("int8_linear", &int8_linear, "x [M, K] @ W^T (+ bias) with x quantized to int8 per 32-block and W Q4_1 panels",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none());
  m.def("int8_linear_supported", &int8_linear_supported, "whether int8_linear was built for this CPU");
  m.def("grouped_quantized_linear", &grouped_quantized_linear,
        "x [M, K] @ W^T (+ bias) with W as int8 codes and a (d, m) per 16 weights (Q6_K, mixed K-quants)",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none());
  m.def("grouped_int8_linear", &grouped_int8_linear,
        "grouped_quantized_linear with x quantized to int8 per 16 (codes in int8_linear's 8-bit layout)",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row of x [T, H] (float32)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of residual (float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up [T, 2I] (float32)");
  m.def("rotary", &rotary, "rotary embedding of q [T, Hq, D] and k [T, Hk, D] at positions (float32)");
}
