#include "kernels.h"

// Every kernel runs without the GIL (its arguments are converted before, its result after): the
// engine thread's matmuls then leave the interpreter to the event loop that streams the tokens.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention over a paged KV pool", NoGil());
  m.def("decode_attention", &decode_attention,
        "a decode batch's attention from fused qkv: rotary, pool writes, paged attention (float32)", NoGil());
  m.def("packed_linear", &packed_linear, "x [M, K] @ W^T (+ bias) with W packed in 16-column panels (float32)", NoGil(),
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("isa") = "auto");
  m.def("float_linear_isas", &float_linear_isas, "the float32 matmuls' instruction paths on this CPU, best first");
  m.def("quantized_linear", &quantized_linear, "x [M, K] @ W^T (+ bias) with W kept as Q4_1/Q8_0 panels", NoGil(),
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("isa") = "auto");
  m.def("int8_linear", &int8_linear, "x [M, K] @ W^T (+ bias) with x quantized to int8 per 32-block and W Q4_1 panels", NoGil(),
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("isa") = "auto");
  m.def("int8_linear_isas", &int8_linear_isas, "the int8 matmul's instruction paths on this CPU, best first");
  m.def("int8_linear_isa", &int8_linear_isa, "the path a request ('auto' or a name) resolves to",
        pybind11::arg("requested") = "auto");
  m.def("int8_linear_supported", &int8_linear_supported, "whether int8_linear was built for this CPU");
  m.def("grouped_quantized_linear", &grouped_quantized_linear,
        "x [M, K] @ W^T (+ bias) with W as int8 codes and a (d, m) per 16 weights (Q6_K, mixed K-quants)", NoGil(),
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none());
  m.def("grouped_int8_linear", &grouped_int8_linear,
        "grouped_quantized_linear with x quantized to int8 per 16 (codes in int8_linear's 8-bit layout)", NoGil(),
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none());
  m.def("bf16_linear", &bf16_linear, "x [M, K] @ W^T (+ bias) with W in bfloat16 panels [P, K / 2, 32]", NoGil(),
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("isa") = "auto");
  m.def("bf16_linear_isas", &bf16_linear_isas, "the bf16 matmul's instruction paths on this CPU, best first");
  m.def("peak_kinds", &peak_kinds, "instruction kinds whose peak this CPU can measure");
  m.def("peak_gops", &peak_gops, "measured peak GOP/s of one instruction kind on all threads", NoGil(),
        pybind11::arg("name"), pybind11::arg("iters") = 2000000);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row of x [T, H] (float32)", NoGil());
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of residual (float32)", NoGil());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up [T, 2I] (float32)", NoGil());
  m.def("rotary", &rotary, "rotary embedding of q [T, Hq, D] and k [T, Hk, D] at positions (float32)", NoGil());
}
