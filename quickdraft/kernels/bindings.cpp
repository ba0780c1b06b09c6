// The module's Python entry points: every kernel declared in entry.h, registered under one name
// (the kernels themselves live in their own files: linear.cpp, blocks.cpp, attention.cpp, rows.cpp,
// verify.cpp, layer.cpp, forward.cpp).
#include <torch/extension.h>

#include <string>

#include "entry.h"
#include "simd.h"

std::string isa() { return simd::ISA; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction set this module was built for (simd.h)");
  m.def("linear_bf16", &linear_bf16, "x @ w.T + b in bfloat16");
  m.def("linear_f32", &linear_f32, "x @ w.T + b in float32, batch invariant");
  m.def("linear_blocks", &linear_blocks, "x @ w.T + b: w in a GGUF block format as repacked by models/ggml.py, x quantized per block");
  m.def("linear_blocks_many", &linear_blocks_many, "linear_blocks for several weights of one format against one x, in one pass");
  m.def("amx_active", &amx_active, "whether passes of several rows run on AMX (the CPU has it, Linux grants it, QUICKDRAFT_AMX is not 0)");
  m.def("amx_min_rows", &amx_min_rows, "the rows from which a pass goes to AMX");
  m.def("use_amx", &use_amx, "switch the AMX path on or off; returns the previous setting");
  m.def("vnni_rate", &vnni_rate, "64-byte integer dots a second on one core: the fastest of runs of about a millisecond");
  m.def("attend_chain", &attend_chain, "row j of q attends over keys 0..ctx+j (the last `window` of them, where window > 0), batch invariant",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("ctx"), py::arg("scale"), py::arg("window") = 0);
  m.def("attend_tree", &attend_tree, "row j of q attends over the context and its own path of new tokens, as a chain would",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("ctx"), py::arg("start"), py::arg("path"), py::arg("scale"),
        py::arg("window") = 0);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, as Hugging Face's");
  m.def("rotary", &rotary, "rotate-half rotary embedding of each row");
  m.def("argmax_finite", &argmax_finite, "each row's argmax (the lowest index on ties, the first NaN) and whether it is finite, in one read");
  m.def("softmax_rows", &softmax_rows, "softmax(logits / t) of each row at its temperature (0: one-hot at the argmax), then its top-k, top-p and min-p where given",
        py::arg("logits"), py::arg("temperature"), py::arg("top_k") = py::none(), py::arg("top_p") = py::none(),
        py::arg("min_p") = py::none());
  m.def("verify_chains", &verify_chains, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "speculative sampling's rule on draft chains: each sequence's accepted drafts and final token",
        py::arg("logits"), py::arg("q"), py::arg("drafts"), py::arg("num_draft"), py::arg("temperature"), py::arg("top_k"),
        py::arg("top_p"), py::arg("min_p"), py::arg("uniforms"), py::arg("q_columns") = py::none());
  m.def("sample_probs", &sample_probs, "a row drawn from each row of probs with its uniform: the first whose cumulative mass passes u x total");
  m.def("silu_mul", &silu_mul, "silu(gate) * up, each step rounded to the dtype as torch rounds it");
  m.def("act_mul", &act_mul, "act(gate) * up, act 0 SiLU or 1 GELU-tanh, each step rounded to the dtype");
  m.def("linear_w8", &linear_w8, "x @ (w * scale).T + b: int8 weights and int8-quantized rows of x");
  m.def("decoder_layer", &decoder_layer, "one decoder layer for chains or token trees of new tokens: the Python path's kernels in one call");
  register_forward(m);  // forward.cpp: the whole decoder in one call
}
