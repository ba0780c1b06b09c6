// One decoder layer written into given buffers: layer.cpp's decoder_layer runs it on buffers of its
// own (one call a layer), forward.cpp's NativeDecoder on one workspace for every layer of a pass.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "entry.h"  // qd::Weights

constexpr int64_t DENSE = -1;  // a projection's kind: a dense weight of x's dtype; >= 0: a GGUF block format

// What a pass's layers share: where its rows go and the model's shape. Sequence i's query_lens[i]
// rows are its new tokens at positions context_lens[i].. of slot slots[i]: a causal chain, or where
// tree_starts[i] and tree_paths[i] are given a token tree (row j sees the tree tokens
// tree_paths[i][start[j] .. start[j + 1]], hidden nodes of earlier passes included:
// attention.cpp's attend_tree).
struct Pass {
  torch::Tensor positions;  // [n] int64
  std::vector<int64_t> slots, context_lens, query_lens;                // [batch]
  std::vector<c10::optional<torch::Tensor>> tree_starts, tree_paths;   // [batch], None for a chain
  int64_t heads, kv_heads;
  double eps, scale;
  // the metadata against n rows and a layer's caches [slots, kv_heads, max_len, d]: once a pass
  void check(int64_t n, const torch::Tensor& kcache, const torch::Tensor& vcache) const;
};

// What a layer's arithmetic has beyond Llama's, as the model's family (models/families.py) says:
// each norm optional (none: Llama, Qwen2, Mistral), the rotary tables the layer's own (Gemma 3's
// sliding layers turn at another base than its global ones).
struct LayerSpec {
  c10::optional<torch::Tensor> q_norm, k_norm;  // [d]: RMSNorm of each head's q and k before rotary (Qwen3, Gemma 3)
  // [hidden]: RMSNorm of the attention's and of the MLP's output before its residual add (Gemma 3)
  c10::optional<torch::Tensor> attn_out_norm, mlp_out_norm;
  torch::Tensor cos, sin;  // [max_positions, d] float32
  int64_t window = 0;      // a sliding window of this many positions (0: none), attention.h's windowed
  int64_t act = 0;         // rowwise.h's Activation of the MLP's gate
  // the tables and norms against the pass's positions and the model's shape: once a pass
  void check(const Pass& pass, int64_t hidden, int64_t d) const;
};

// A layer's activations, n rows each, contiguous; x's dtype unless said.
struct Buffers {
  torch::Tensor h, mid, o, down;  // [n, hidden]
  torch::Tensor q, k, v;          // [n, heads * d], [n, kv_heads * d], [n, kv_heads * d]
  torch::Tensor qf, attn;         // [n, heads * d] float32 (qf is q's storage when x is float32)
  torch::Tensor attn_x;           // [n, heads * d] (attn's storage when x is float32)
  torch::Tensor gate, up;         // [n, intermediate]
  // rows buffers of each width for x's options
  static Buffers allocate(int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t d, int64_t intermediate,
                          const torch::TensorOptions& options);
  // the first n rows of each (views: no new storage)
  Buffers first(int64_t n) const;
};

// A layer's seven projections (q, k, v, o, gate, up, down) as the kernels run them, checked and
// prepared once: each run of one block format against the same x (q, k, v; gate, up) is one
// run_blocks call on pointers, with no tensor made or checked per pass; a dense projection stays a
// torch-bound call (linear.cpp).
struct Projections {
  struct Run {
    int64_t kind;      // DENSE or a block format
    int first, count;  // projections first .. first + count - 1 (0 q .. 6 down)
    qd::Weights w;     // a block run's tiles and biases (outputs set per pass)
  };
  std::vector<Run> stages[4];       // q k v, o, gate up, down
  int64_t inputs[4];                // each stage's x width: hidden, heads x d, hidden, intermediate
  std::vector<torch::Tensor> keep;  // biases converted to the tiles' form
  // w: a layer's 9 weights as layer_into takes them, kinds: the 7 projections' formats, biases: q,
  // k, v's; the widths of the layer's buffers (hidden, heads x d, kv heads x d, intermediate), which
  // each projection's output is checked against
  static Projections of(const torch::Tensor* w, const int64_t* kinds, const c10::optional<torch::Tensor>* biases,
                        int64_t hidden, int64_t heads_d, int64_t kv_heads_d, int64_t intermediate);
};

// Where a layer's time goes, added to when a pass is profiled (NativeDecoder's profile): its
// projections, its attention (the cache writes with it), and the rest (norms, rotary, the
// elementwise steps and conversions).
struct LayerTimes {
  double matrices = 0, attention = 0, other = 0;
};

// The output width of a projection's weight: a dense [N, K] or block tiles [N / 16, bytes].
inline int64_t out_features(const torch::Tensor& w, int64_t kind) { return kind == DENSE ? w.size(0) : w.size(0) * 16; }

// x [n, hidden] -> out [n, hidden] after one layer (out may be x itself: x is last read before out
// is first written). w: input norm, q, k, v, o, post-attention norm, gate, up, down; proj: the
// projections of w prepared (Projections::of); biases: q, k, v's; kcache, vcache: this layer's
// [slots, kv_heads, max_len, d], written at the new tokens' positions; spec: what the family adds.
// The pass's metadata must have passed Pass::check, and spec LayerSpec::check. times: where the layer's time went is added there (nullptr: no clock is read).
void layer_into(const torch::Tensor& x, const torch::Tensor& out, const torch::Tensor* w, const Projections& proj,
                const c10::optional<torch::Tensor>* biases, const LayerSpec& spec, const torch::Tensor& kcache,
                const torch::Tensor& vcache, const Pass& pass, const Buffers& b, LayerTimes* times = nullptr);
