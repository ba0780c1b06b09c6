// One decoder layer (models/decoder/reference.py's block) for chains or token trees of new tokens,
// in one call.
//
// Written by hand because at one row a decoding step is dozens of small operations a layer, each
// a trip through the Python interpreter and torch's dispatcher. Measured against the Python path,
// interleaved in one process (AMD EPYC, stored Q4_K_M blocks, 200 tokens of context): the 0.5B
// draft's one-row step 17.6 -> 16.0 ms, the 1.5B's 40.4 -> 39.5 and 40.5 -> 36.9 ms (two runs).
// This is the same sequence of the same kernels (blocks.cpp, linear.cpp, rowwise.h, attention.h)
// and of the same elementwise operations (SiLU, adds, multiplies and conversions rounded as torch
// rounds them, rowwise.h), in the same order, so its output is bit for bit that of the Python
// path, which stays for long prefills, the int8 draft format, CUDA and CPUs without the kernels
// (tests/models/test_fused_layer.py). forward.cpp runs every layer of a pass through the same
// layer_into, with each layer's projections prepared once (Projections): a block projection is
// one call on pointers, with no tensor or check per pass. No torch operation is left in a layer.
#include <torch/extension.h>

#include <chrono>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "entry.h"  // the kernels it strings together
#include "layer.h"
#include "rowwise.h"

namespace {

// projection p's weight (0 q .. 6 down) among a layer's 9 (the two norms' weights among them)
const torch::Tensor& weight_of(const torch::Tensor* w, int p) { return w[p < 4 ? 1 + p : 2 + p]; }

// stage s of the layer's projections (Projections::stages) over x into ys, indexed by projection
// (0 q .. 6 down); w and biases as layer_into takes them, for the dense ones
void project(const Projections& proj, int stage, const torch::Tensor& x, const torch::Tensor* w,
             const c10::optional<torch::Tensor>* biases, const torch::Tensor* ys) {
  const bool f32 = x.scalar_type() == torch::kFloat32;
  for (const Projections::Run& run : proj.stages[stage]) {
    if (run.kind == DENSE) {
      for (int p = run.first; p < run.first + run.count; ++p) {
        const c10::optional<torch::Tensor> bias = p < 3 ? biases[p] : c10::nullopt;
        if (f32) {
          linear_f32_into(x, weight_of(w, p), bias, ys[p]);
        } else {
          linear_bf16_into(x, weight_of(w, p), bias, ys[p]);
        }
      }
      continue;
    }
    qd::Weights to = run.w;
    for (int i = 0; i < run.count; ++i) to.ys[i] = qd::Out{ys[run.first + i].data_ptr(), f32};
    run_blocks(run.kind, x.data_ptr(), f32, x.size(0), proj.inputs[stage], to);
  }
}

// t's elements as T (float, or uint16_t for bfloat16): a pointer, no check
template <typename T>
T* data(const torch::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// run(static_cast<T*>(nullptr)) with T x's element type: float for float32, uint16_t for bfloat16
template <typename Run>
void with_type(const torch::Tensor& x, Run run) {
  if (x.scalar_type() == torch::kFloat32) {
    run(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "float32 or bfloat16 activations");
    run(static_cast<uint16_t*>(nullptr));
  }
}

// Adds the time since its last lap to one of a LayerTimes' fields; reads no clock without one.
class Laps {
 public:
  explicit Laps(LayerTimes* times) : times_(times) {
    if (times_) last_ = std::chrono::steady_clock::now();
  }
  void to(double LayerTimes::*field) {
    if (!times_) return;
    const auto now = std::chrono::steady_clock::now();
    times_->*field += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  LayerTimes* times_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace

void Pass::check(int64_t n, const torch::Tensor& kcache, const torch::Tensor& vcache) const {
  TORCH_CHECK(slots.size() == context_lens.size() && slots.size() == query_lens.size() && slots.size() == tree_starts.size() &&
                  slots.size() == tree_paths.size(),
              "one slot, context, length and tree (or None) a sequence");
  TORCH_CHECK(kcache.dim() == 4 && kcache.sizes() == vcache.sizes(), "caches [slots, kv_heads, max_len, d]");
  TORCH_CHECK(kcache.size(1) == kv_heads && heads % kv_heads == 0, "the caches' kv heads are the model's");
  int64_t rows = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < kcache.size(0), "sequence ", i, ": no slot ", slots[i]);
    TORCH_CHECK(context_lens[i] + query_lens[i] <= kcache.size(2), "sequence ", i, " runs past the cache's ", kcache.size(2), " positions");
    TORCH_CHECK(tree_starts[i].has_value() == tree_paths[i].has_value(), "sequence ", i, ": a tree's starts and paths, or neither");
    rows += query_lens[i];
  }
  TORCH_CHECK(rows == n, "the query lengths add up to ", rows, ", x has ", n, " rows");
  // what layer_into's pointers take for granted
  const int64_t d = kcache.size(3);
  TORCH_CHECK(kcache.strides() == vcache.strides() && kcache.stride(3) == 1 && d % 16 == 0,
              "caches alike, rows of d contiguous, d a multiple of 16");
  TORCH_CHECK(positions.numel() == n && positions.scalar_type() == torch::kInt64 && positions.is_contiguous(),
              "one int64 position a row");
}

void LayerSpec::check(const Pass& pass, int64_t hidden, int64_t d) const {
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == d,
              "cos, sin [positions, d] float32, contiguous");
  const int64_t* p = pass.positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < pass.positions.numel(); ++r)
    TORCH_CHECK(p[r] >= 0 && p[r] < cos.size(0), "position ", p[r], " is past the rotary table's ", cos.size(0));
  for (const auto& [norm, width] : {std::pair{&q_norm, d}, std::pair{&k_norm, d}, std::pair{&attn_out_norm, hidden},
                                    std::pair{&mlp_out_norm, hidden}})
    TORCH_CHECK(!norm->has_value() || ((*norm)->dim() == 1 && (*norm)->size(0) == width && (*norm)->is_contiguous()),
                "a norm's weight [", width, "], contiguous");
  TORCH_CHECK(window >= 0 && (act == qd::SILU || act == qd::GELU_TANH), "a window of 0 or more positions; activation 0 or 1");
}

Buffers Buffers::allocate(int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t d, int64_t intermediate,
                          const torch::TensorOptions& options) {
  const auto f32 = options.dtype(torch::kFloat32);
  const bool is_f32 = c10::typeMetaToScalarType(options.dtype()) == torch::kFloat32;
  Buffers b;
  b.h = torch::empty({rows, hidden}, options);
  b.mid = torch::empty({rows, hidden}, options);
  b.o = torch::empty({rows, hidden}, options);
  b.down = torch::empty({rows, hidden}, options);
  b.q = torch::empty({rows, heads * d}, options);
  b.k = torch::empty({rows, kv_heads * d}, options);
  b.v = torch::empty({rows, kv_heads * d}, options);
  b.attn = torch::empty({rows, heads * d}, f32);
  b.qf = is_f32 ? b.q : torch::empty({rows, heads * d}, f32);
  b.attn_x = is_f32 ? b.attn : torch::empty({rows, heads * d}, options);
  b.gate = torch::empty({rows, intermediate}, options);
  b.up = torch::empty({rows, intermediate}, options);
  return b;
}

Buffers Buffers::first(int64_t n) const {
  Buffers b;
  b.h = h.narrow(0, 0, n);
  b.mid = mid.narrow(0, 0, n);
  b.o = o.narrow(0, 0, n);
  b.down = down.narrow(0, 0, n);
  b.q = q.narrow(0, 0, n);
  b.k = k.narrow(0, 0, n);
  b.v = v.narrow(0, 0, n);
  b.qf = qf.narrow(0, 0, n);
  b.attn = attn.narrow(0, 0, n);
  b.attn_x = attn_x.narrow(0, 0, n);
  b.gate = gate.narrow(0, 0, n);
  b.up = up.narrow(0, 0, n);
  return b;
}

Projections Projections::of(const torch::Tensor* w, const int64_t* kinds, const c10::optional<torch::Tensor>* biases,
                            int64_t hidden, int64_t heads_d, int64_t kv_heads_d, int64_t intermediate) {
  Projections p;
  const int64_t widths[7] = {heads_d, kv_heads_d, kv_heads_d, hidden, intermediate, intermediate, hidden};
  const int64_t inputs[4] = {hidden, heads_d, hidden, intermediate};
  const int bounds[5] = {0, 3, 4, 6, 7};  // each stage's first projection
  for (int s = 0; s < 4; ++s) {
    p.inputs[s] = inputs[s];
    for (int i = bounds[s]; i < bounds[s + 1];) {
      const int64_t kind = kinds[i];
      int end = i + 1;
      while (kind != DENSE && end < bounds[s + 1] && kinds[end] == kind) ++end;
      Run run{kind, i, end - i, {}};
      std::vector<torch::Tensor> ws;
      std::vector<c10::optional<torch::Tensor>> bs;
      for (int j = i; j < end; ++j) {
        const torch::Tensor& wj = weight_of(w, j);
        TORCH_CHECK(out_features(wj, kind) == widths[j], "projection ", j, ": ", out_features(wj, kind), " outputs, the layer needs ",
                    widths[j]);
        if (kind == DENSE) TORCH_CHECK(wj.dim() == 2 && wj.size(1) == inputs[s], "projection ", j, ": a dense [", widths[j], ", ",
                                       inputs[s], "] weight");
        ws.push_back(wj);
        bs.push_back(j < 3 ? biases[j] : c10::nullopt);
      }
      if (kind != DENSE) run.w = block_weights(kind, inputs[s], ws, bs, p.keep);
      p.stages[s].push_back(run);
      i = end;
    }
  }
  return p;
}

void layer_into(const torch::Tensor& x, const torch::Tensor& out, const torch::Tensor* w, const Projections& proj,
                const c10::optional<torch::Tensor>* biases, const LayerSpec& spec, const torch::Tensor& kcache,
                const torch::Tensor& vcache, const Pass& pass, const Buffers& b, LayerTimes* times) {
  Laps laps(times);
  const int64_t n = x.size(0), d = kcache.size(3);
  rms_norm_into(x, w[0], pass.eps, b.h);
  laps.to(&LayerTimes::other);
  const torch::Tensor ys[7] = {b.q, b.k, b.v, b.o, b.gate, b.up, b.down};  // each projection's output
  project(proj, 0, b.h, w, biases, ys);
  laps.to(&LayerTimes::matrices);
  // Rotary, the cache writes and a chain's attention go straight to rowwise.h and attention.h on the
  // workspace's and the caches' pointers (checked once a pass: Pass::check): each tensor view of
  // a cache or a sequence's rows (select, narrow, view) costs a dispatch and a tensor, which came
  // to ~40 us a layer of the 0.5B's attention on an AMD EPYC Zen 1, two fifths of it. The same kernels
  // with the same arguments: the same bits.
  const int64_t H = pass.heads, Hkv = pass.kv_heads;
  const int64_t* positions = pass.positions.data_ptr<int64_t>();
  const float *cos = spec.cos.data_ptr<float>(), *sin = spec.sin.data_ptr<float>();
  // each head's q and k normed first where the family says (into attn_x, which holds a row of q in
  // x's dtype and is free until attention's output), then rotated from there back into q and k
  const torch::Tensor spare = b.attn_x;
  for (const auto& [t, heads, norm] : {std::tuple{&b.q, H, &spec.q_norm}, std::tuple{&b.k, Hkv, &spec.k_norm}}) {
    if (!norm->has_value()) continue;
    const torch::Tensor normed = spare.view(-1).narrow(0, 0, n * heads * d).view({n * heads, d});  // its first rows' storage
    rms_norm_into(t->view({n * heads, d}), **norm, pass.eps, normed);
    with_type(x, [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      qd::rotary_rows(data<T>(normed), cos, sin, positions, data<T>(*t), n, heads, d);
    });
  }
  with_type(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    // rotated in place: rotary_rows reads each pair of values before it writes them
    if (!spec.q_norm) qd::rotary_rows(data<T>(b.q), cos, sin, positions, data<T>(b.q), n, H, d);
    if (!spec.k_norm) qd::rotary_rows(data<T>(b.k), cos, sin, positions, data<T>(b.k), n, Hkv, d);
  });
  // attention reads float32 queries: the Python path's q.float(), one conversion for every sequence
  if (b.qf.data_ptr() != b.q.data_ptr()) convert_into(b.q, b.qf);
  laps.to(&LayerTimes::other);
  int64_t start = 0;
  for (size_t i = 0; i < pass.slots.size(); ++i) {
    const int64_t ctx = pass.context_lens[i], len = pass.query_lens[i];
    if (pass.tree_starts[i].has_value()) {  // a tree: attend_tree_into checks its paths
      const torch::Tensor keys = kcache.select(0, pass.slots[i]), values = vcache.select(0, pass.slots[i]);  // [kv_heads, max_len, d]
      write_cache(b.k.narrow(0, start, len).view({len, Hkv, d}), keys, ctx);
      write_cache(b.v.narrow(0, start, len).view({len, Hkv, d}), values, ctx);
      attend_tree_into(b.qf.narrow(0, start, len).view({len, H, d}), keys.narrow(1, 0, ctx + len), values.narrow(1, 0, ctx + len),
                       ctx, *pass.tree_starts[i], *pass.tree_paths[i], pass.scale, b.attn.narrow(0, start, len), spec.window);
    } else {
      with_type(x, [&](auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        // the slot's keys and values [kv_heads, max_len, d]: rows of d contiguous
        T *keys = data<T>(kcache) + pass.slots[i] * kcache.stride(0), *values = data<T>(vcache) + pass.slots[i] * vcache.stride(0);
        const int64_t hs = kcache.stride(1), ks = kcache.stride(2);
        constexpr int64_t size = sizeof(T);
        qd::write_rows(data<T>(b.k) + start * Hkv * d, keys, hs * size, ks * size, ctx, len, Hkv, d * size);
        qd::write_rows(data<T>(b.v) + start * Hkv * d, values, hs * size, ks * size, ctx, len, Hkv, d * size);
        qd::attend_chain(data<float>(b.qf) + start * H * d, static_cast<const T*>(keys), static_cast<const T*>(values), hs, ks,
                         data<float>(b.attn) + start * H * d, len, H, Hkv, d, ctx, static_cast<float>(pass.scale), spec.window);
      });
    }
    start += len;
  }
  laps.to(&LayerTimes::attention);
  if (b.attn_x.data_ptr() != b.attn.data_ptr()) convert_into(b.attn, b.attn_x);  // the Python path's .to(x's dtype)
  laps.to(&LayerTimes::other);
  project(proj, 1, b.attn_x, w, biases, ys);
  laps.to(&LayerTimes::matrices);
  // a sublayer's output normed before its residual add where the family says (into h: free by then)
  const auto add_normed = [&](const torch::Tensor& residual, const torch::Tensor& y, const c10::optional<torch::Tensor>& norm,
                              const torch::Tensor& into) {
    if (norm) rms_norm_into(y, *norm, pass.eps, b.h);
    add_into(residual, norm ? b.h : y, into);
  };
  add_normed(x, b.o, spec.attn_out_norm, b.mid);
  rms_norm_into(b.mid, w[5], pass.eps, b.h);
  laps.to(&LayerTimes::other);
  project(proj, 2, b.h, w, biases, ys);
  laps.to(&LayerTimes::matrices);
  // act(gate) * up in place, as the Python path's ops.act_mul
  with_type(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    qd::act_mul_values(spec.act, data<T>(b.gate), data<T>(b.up), data<T>(b.gate), b.gate.numel());
  });
  laps.to(&LayerTimes::other);
  project(proj, 3, b.gate, w, biases, ys);
  laps.to(&LayerTimes::matrices);
  add_normed(b.mid, b.down, spec.mlp_out_norm, out);
  laps.to(&LayerTimes::other);
}

// the same arguments as layer_into, one layer a call with buffers of its own -> x after the layer
torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor positions, std::vector<torch::Tensor> w, std::vector<int64_t> kinds,
                            std::vector<c10::optional<torch::Tensor>> biases, std::vector<c10::optional<torch::Tensor>> norms,
                            torch::Tensor cos, torch::Tensor sin, int64_t window, int64_t act,
                            torch::Tensor kcache, torch::Tensor vcache, std::vector<int64_t> slots,
                            std::vector<int64_t> context_lens, std::vector<int64_t> query_lens,
                            std::vector<c10::optional<torch::Tensor>> tree_starts, std::vector<c10::optional<torch::Tensor>> tree_paths,
                            int64_t heads, int64_t kv_heads, double eps, double scale) {
  TORCH_CHECK(w.size() == 9 && kinds.size() == 7 && biases.size() == 3 && norms.size() == 4, "9 weights, 7 kinds, 3 biases, 4 norms");
  TORCH_CHECK(x.dim() == 2, "x [n, hidden]");
  const Pass pass{positions, slots, context_lens, query_lens, tree_starts, tree_paths, heads, kv_heads, eps, scale};
  const LayerSpec spec{norms[0], norms[1], norms[2], norms[3], cos, sin, window, act};
  const int64_t n = x.size(0);
  pass.check(n, kcache, vcache);
  spec.check(pass, x.size(1), kcache.size(3));
  TORCH_CHECK(kcache.scalar_type() == x.scalar_type(), "caches of x's dtype");
  const Buffers b = Buffers::allocate(n, x.size(1), heads, kv_heads, kcache.size(3), out_features(w[6], kinds[4]), x.options());
  torch::Tensor out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  const Projections proj = Projections::of(w.data(), kinds.data(), biases.data(), x.size(1), heads * kcache.size(3),
                                           kv_heads * kcache.size(3), out_features(w[6], kinds[4]));
  layer_into(x, out, w.data(), proj, biases.data(), spec, kcache, vcache, pass, b);
  return out;
}
