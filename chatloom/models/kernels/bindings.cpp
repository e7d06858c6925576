#include "decode_stack.h"
#include "kquant_int8.h"
#include "weight_repack.h"

#include <pybind11/stl.h>

// Every kernel runs without the GIL (its arguments are converted before, its result after): the
// engine thread's matmuls then leave the interpreter to the event loop that streams the tokens.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention over a paged KV pool", NoGil(), pybind11::arg("q"),
        pybind11::arg("k_pool"), pybind11::arg("v_pool"), pybind11::arg("block_tables"), pybind11::arg("rows"),
        pybind11::arg("kv_lens"), pybind11::arg("scale"), pybind11::arg("isa") = "auto");
  m.def("write_pool_rows", &write_pool_rows, "fresh K or V rows into a paged pool at flat slots, rounded as it keeps them",
        NoGil(), pybind11::arg("pool"), pybind11::arg("slot_mapping"), pybind11::arg("rows"));
  m.def("decode_attention", &decode_attention,
        "a decode batch's attention from fused qkv: rotary, pool writes, paged attention (float32)", NoGil());
  m.def("packed_linear", &packed_linear, "x [M, K] @ W^T (+ bias) with W packed in 16-column panels (float32)", NoGil(),
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("isa") = "auto");
  m.def("float_linear_isas", &float_linear_isas, "the float32 matmuls' instruction paths on this CPU, best first");
  m.def("paged_attention_isas", &paged_attention_isas, "the paged attention's instruction paths in this build, best first");
  m.def("quantized_linear", &quantized_linear, "x [M, K] @ W^T (+ bias) with W kept as Q4_1/Q8_0 panels", NoGil(),
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("isa") = "auto");
  m.def("int8_linear", &int8_linear, "x [M, K] @ W^T (+ bias) with x quantized to int8 per 32-block and W Q4_1 panels", NoGil(),
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("isa") = "auto");
  m.def("greedy_head_argmax", &greedy_head_argmax,
        "the exact quantized head's argmax per row, screened with int8 activations (greedy_head.cpp)", NoGil(),
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"),
        pybind11::arg("codes8"), pybind11::arg("scales8"), pybind11::arg("norms"), pybind11::arg("isa") = "auto");
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
  m.def("kquant_linear", &kquant_linear,
        "x [M, K] @ W^T (+ bias) with W as Q4_K / Q6_K super-block panels (blob, offsets [P + 1], kinds [P])",
        NoGil(), pybind11::arg("x"), pybind11::arg("blob"), pybind11::arg("offsets"), pybind11::arg("kinds"),
        pybind11::arg("out_features"), pybind11::arg("bias") = pybind11::none());
  m.def("kquant_linear_supported", &kquant_linear_supported, "whether this CPU runs kquant_linear (AVX-512)");
  m.def("kquant_int8_supported", &kquant_int8_supported,
        "whether this CPU runs kquant_linear's int8-activation kinds 2 and 3 (AVX-512 VNNI)");
  m.def("kquant_super_bytes", &kquant_super_bytes, "bytes of one panel's super-block of a kind (0: Q4_K, 1: Q6_K)");
  m.def("bf16_linear", &bf16_linear, "x [M, K] @ W^T (+ bias) with W in bfloat16 panels [P, K / 2, 32]", NoGil(),
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("isa") = "auto");
  m.def("bf16_linear_isas", &bf16_linear_isas, "the bf16 matmul's instruction paths on this CPU, best first");
  m.def("peak_kinds", &peak_kinds, "instruction kinds whose peak this CPU can measure");
  m.def("peak_gops", &peak_gops, "measured peak GOP/s of one instruction kind on all threads", NoGil(),
        pybind11::arg("name"), pybind11::arg("iters") = 2000000);
  m.def("work_pool_probe", &work_pool_probe, "which thread ran each item of a loop on the work pool (tests)",
        NoGil(), pybind11::arg("items"), pybind11::arg("stall_ns") = 0);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row of x [T, H] (float32)", NoGil());
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of residual (float32)", NoGil());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up [T, 2I] (float32)", NoGil());
  pybind11::class_<NativeLinear>(m, "NativeLinear", "one linear layer as the kernels see it (decode_stack.h)")
      .def(pybind11::init<int64_t, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                          c10::optional<torch::Tensor>, int64_t>(),
           pybind11::arg("kind"), pybind11::arg("weight"), pybind11::arg("scales"), pybind11::arg("bias"),
           pybind11::arg("m_panels"), pybind11::arg("out_features"));
  pybind11::class_<DecodeLayerWeights>(m, "DecodeLayerWeights", "a Llama-shaped layer's weights")
      .def(pybind11::init<torch::Tensor, torch::Tensor, NativeLinear, NativeLinear, NativeLinear, NativeLinear>(),
           pybind11::arg("input_norm"), pybind11::arg("post_norm"), pybind11::arg("qkv"), pybind11::arg("o"),
           pybind11::arg("gate_up"), pybind11::arg("down"));
  pybind11::class_<DecodeStack>(m, "DecodeStack", "a decode step's decoder stack in one call (float32)")
      .def(pybind11::init<std::vector<DecodeLayerWeights>, torch::Tensor, double, torch::Tensor, torch::Tensor, bool,
                          int64_t, int64_t, double>(),
           pybind11::arg("layers"), pybind11::arg("final_norm"), pybind11::arg("eps"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("interleaved"), pybind11::arg("hq"), pybind11::arg("hkv"),
           pybind11::arg("scale"))
      .def("forward", &DecodeStack::forward, NoGil(), pybind11::arg("x"), pybind11::arg("positions"),
           pybind11::arg("k_pools"), pybind11::arg("v_pools"), pybind11::arg("slot_mapping"),
           pybind11::arg("block_tables"), pybind11::arg("rows"), pybind11::arg("kv_lens"))
      .def("set_head", &DecodeStack::set_head, "run this head in forward_logits (taken only where the team path can)",
           pybind11::arg("head"))
      .def_property_readonly("has_head", &DecodeStack::has_head, "whether set_head took a head")
      .def("forward_logits", &DecodeStack::forward_logits, NoGil(), pybind11::arg("x"), pybind11::arg("positions"),
           pybind11::arg("k_pools"), pybind11::arg("v_pools"), pybind11::arg("slot_mapping"),
           pybind11::arg("block_tables"), pybind11::arg("rows"), pybind11::arg("kv_lens"))
      .def("forward_argmax", &DecodeStack::forward_argmax, NoGil(), pybind11::arg("x"), pybind11::arg("positions"),
           pybind11::arg("k_pools"), pybind11::arg("v_pools"), pybind11::arg("slot_mapping"),
           pybind11::arg("block_tables"), pybind11::arg("rows"), pybind11::arg("kv_lens"))
      .def("set_greedy_head", &DecodeStack::set_greedy_head,
           "the head's int8 screen for argmax-only steps (greedy_head_argmax's codes8, scales8, norms)")
      .def_property_readonly("has_greedy_head", &DecodeStack::has_greedy_head, "whether set_greedy_head took one")
      .def("set_embedding", &DecodeStack::set_embedding,
           "embed forward_tokens' ids with this [vocab, hidden] float32 table, or these GGUF blocks of `kind` "
           "(uint8 [vocab, bytes]; taken only with a head)",
           pybind11::arg("weight"), pybind11::arg("kind") = "")
      .def_property_readonly("has_embedding", &DecodeStack::has_embedding, "whether set_embedding took a table")
      .def("forward_tokens", &DecodeStack::forward_tokens, NoGil(), pybind11::arg("ids"), pybind11::arg("positions"),
           pybind11::arg("slots"), pybind11::arg("tables"), pybind11::arg("k_pools"), pybind11::arg("v_pools"),
           pybind11::arg("argmax_only") = false, pybind11::arg("interruptible") = false)
      .def("interrupt", &DecodeStack::interrupt,
           "stop an interruptible forward_tokens at its next layer boundary (the one running, or the next)")
      .def("clear_interrupt", &DecodeStack::clear_interrupt, "withdraw an interrupt() no step has taken")
      .def_property_readonly("interrupted", &DecodeStack::interrupted, "whether the last forward_tokens stopped early")
      .def("set_profiling", &DecodeStack::set_profiling, "time each part of the team path's steps (resets the sums)",
           pybind11::arg("on"))
      .def("set_test_stall", &DecodeStack::set_test_stall,
           "for tests: the team's second thread sleeps ns before an item of every every-th phase", NoGil())
      .def("profile", &DecodeStack::profile, "seconds per part of the team path's steps while profiling, and steps")
      .def_property_readonly("team_path", &DecodeStack::team_path,
                             "whether decode steps run on one team of threads (every matmul quantized, AVX-512)");
  m.def("rotary", &rotary, "rotary embedding of q [T, Hq, D] and k [T, Hk, D] at positions (float32)", NoGil());
  m.def("dequantize_blocks", &dequantize_blocks, "rows of GGUF blocks (uint8 [rows, bytes]) as float32, as gguf dequantizes",
        NoGil(), pybind11::arg("raw"), pybind11::arg("kind"));
  m.def("kquant_pack_panels", &kquant_pack_panels, "Q4_K (0) or Q6_K (1) rows into kquant_linear's panels, in out (2, 3: for int8 activations)",
        NoGil(), pybind11::arg("raw"), pybind11::arg("kind"), pybind11::arg("out"));
}
