// The module's entry points, one declaration each: bindings.cpp registers them with Python, and
// layer.cpp strings them into a decoder layer. The *_into variants write into given contiguous
// outputs (forward.cpp's workspace); the others allocate theirs.
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "blocks.h"  // qd::Weights

// linear.cpp: dense and int8 weights
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
void linear_bf16_into(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias, const torch::Tensor& y);
void linear_f32_into(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias, const torch::Tensor& y);
torch::Tensor linear_w8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor wsum,
                        c10::optional<torch::Tensor> bias);

// blocks.cpp: GGUF block formats
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor w, int64_t kind, int64_t K, c10::optional<torch::Tensor> bias);
std::vector<torch::Tensor> linear_blocks_many(torch::Tensor x, std::vector<torch::Tensor> ws, int64_t kind, int64_t K,
                                              std::vector<c10::optional<torch::Tensor>> biases);
void linear_blocks_into(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, int64_t kind, int64_t K,
                        const std::vector<c10::optional<torch::Tensor>>& biases, const std::vector<torch::Tensor>& ys);
// the same on raw pointers, for layer.cpp's projections prepared once a model: block_weights
// checks ws (1 to 4 of ``kind``'s layout for K inputs) and their biases and gives their tiles and
// biases (a bias not float32 [tiles * 16] is converted into a tensor kept in ``keep``, which must
// live as long as the result); run_blocks runs x [M, K] (float32, or bfloat16 as uint16_t) against
// them into the outputs set in w.ys, with no check
qd::Weights block_weights(int64_t kind, int64_t K, const std::vector<torch::Tensor>& ws,
                          const std::vector<c10::optional<torch::Tensor>>& biases, std::vector<torch::Tensor>& keep);
void run_blocks(int64_t kind, const void* x, bool f32, int64_t M, int64_t K, const qd::Weights& w);
double vnni_rate(int64_t runs);
bool amx_active();
bool use_amx(bool on);
int64_t amx_min_rows();

// attention.cpp
// window: a sliding window of that many positions (0: none), attention.h's windowed
torch::Tensor attend_chain(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t ctx, double scale, int64_t window);
torch::Tensor attend_tree(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t ctx, torch::Tensor start,
                          torch::Tensor path, double scale, int64_t window);
void attend_chain_into(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, int64_t ctx, double scale,
                       const torch::Tensor& out, int64_t window);
void attend_tree_into(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, int64_t ctx,
                      const torch::Tensor& start, const torch::Tensor& path, double scale, const torch::Tensor& out, int64_t window);

// rows.cpp: the layer's row operations
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions);
void rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor& y);
void rotary_into(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
                 const torch::Tensor& y);
void add_into(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out);
void mul_into(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out);
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
torch::Tensor act_mul(torch::Tensor gate, torch::Tensor up, int64_t act);
void convert_into(const torch::Tensor& src, const torch::Tensor& dst);
void write_cache(const torch::Tensor& rows, const torch::Tensor& cache, int64_t at);

// verify.cpp: the verifier's and the sampler's rows
std::tuple<torch::Tensor, torch::Tensor> argmax_finite(torch::Tensor x);
torch::Tensor softmax_rows(torch::Tensor logits, torch::Tensor temperature, c10::optional<torch::Tensor> top_k,
                           c10::optional<torch::Tensor> top_p, c10::optional<torch::Tensor> min_p);
torch::Tensor sample_probs(torch::Tensor probs, torch::Tensor uniforms);
std::tuple<torch::Tensor, torch::Tensor> verify_chains(torch::Tensor logits, c10::optional<torch::Tensor> q,
                                                       torch::Tensor drafts, std::vector<int64_t> num_draft,
                                                       torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                                                       torch::Tensor min_p, torch::Tensor uniforms,
                                                       c10::optional<torch::Tensor> q_columns);

// layer.cpp
torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor positions, std::vector<torch::Tensor> w, std::vector<int64_t> kinds,
                            std::vector<c10::optional<torch::Tensor>> biases, std::vector<c10::optional<torch::Tensor>> norms,
                            torch::Tensor cos, torch::Tensor sin, int64_t window, int64_t act, torch::Tensor kcache, torch::Tensor vcache, std::vector<int64_t> slots,
                            std::vector<int64_t> context_lens, std::vector<int64_t> query_lens,
                            std::vector<c10::optional<torch::Tensor>> tree_starts, std::vector<c10::optional<torch::Tensor>> tree_paths,
                            int64_t heads, int64_t kv_heads, double eps, double scale);

// forward.cpp: the NativeDecoder class (the whole decoder in one call), added to the module
void register_forward(pybind11::module& m);
