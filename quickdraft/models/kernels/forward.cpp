// The whole decoder in one call: every layer as layer.cpp runs it (layer_into: the same kernels
// in the same order, so the bits of the Python path, models/decoder/reference.py), then the final
// norm, for chains, token trees and ragged batches of several sequences.
//
// Why: at one row a draft pass is 24 layers of small kernels, and the time between them (Python,
// argument conversion, allocation) was a third of the 0.5B draft's pass. A NativeDecoder is made
// once per model (models/decoder/native.py): it keeps the layers' weights as the kernels take
// them, and a workspace of activations that every layer of every pass reuses, grown only when a
// pass has more rows than any before. The pass's metadata is handed in once, and checked
// against each layer's caches before the first layer runs (a few comparisons a sequence).
//
// What still allocates per layer: for a token tree, the views of its rows and caches (select,
// narrow, view: metadata only, no storage); a chain's layers run on pointers (layer.cpp). Per
// pass: the workspace's views of its first n rows, and the returned hidden states (and the
// captured ones), which outlive the call.
#include <torch/extension.h>

#include <mutex>
#include <tuple>
#include <vector>

#include "entry.h"
#include "layer.h"

namespace {

class NativeDecoder {
 public:
  // w: per layer, input norm, q, k, v, o, post-attention norm, gate, up, down (9 a layer, layer by
  // layer); kinds: per layer, the 7 projections' (DENSE or a block format); biases: per layer, q,
  // k, v's (float32 as the kernels read them, or None); norm: the final norm's weight;
  // cos, sin: the rotary tables [max_positions, head_dim] float32
  NativeDecoder(std::vector<torch::Tensor> w, std::vector<int64_t> kinds, std::vector<c10::optional<torch::Tensor>> biases,
                torch::Tensor norm, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                double eps, double scale)
      : w_(std::move(w)), kinds_(std::move(kinds)), biases_(std::move(biases)), norm_(std::move(norm)), cos_(std::move(cos)),
        sin_(std::move(sin)), heads_(heads), kv_heads_(kv_heads), d_(head_dim), eps_(eps), scale_(scale) {
    layers_ = static_cast<int64_t>(kinds_.size() / 7);
    TORCH_CHECK(layers_ > 0 && w_.size() == 9 * static_cast<size_t>(layers_) && kinds_.size() == 7 * static_cast<size_t>(layers_) &&
                    biases_.size() == 3 * static_cast<size_t>(layers_),
                "9 weights, 7 kinds and 3 biases a layer");
    TORCH_CHECK(norm_.dim() == 1 && heads_ % kv_heads_ == 0, "norm [hidden]; heads a multiple of kv heads");
    intermediate_ = out_features(w_[6], kinds_[4]);
    for (int64_t l = 0; l < layers_; ++l)
      projections_.push_back(Projections::of(&w_[9 * l], &kinds_[7 * l], &biases_[3 * l], norm_.size(0), heads_ * d_, kv_heads_ * d_,
                                             intermediate_));
  }

  int64_t num_layers() const { return layers_; }

  // Profiling: while on, every pass adds where its layers' time went (layer.h's LayerTimes);
  // switching it on starts the sums from zero. The clock is read ~10 times a layer, so only then.
  void set_profiling(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    profiling_ = on;
    if (on) times_ = LayerTimes{};
  }

  // seconds summed over the passes since profiling went on: (matrices, attention, other)
  std::tuple<double, double, double> times() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {times_.matrices, times_.attention, times_.other};
  }

  // x [n, hidden]: the new tokens' embeddings; positions [n] int64; kcaches, vcaches: each layer's
  // [slots, kv_heads, max_len, d]; the sequences' metadata as layer.h's Pass; num_layers: run the
  // first this many layers (self-speculation's draft); capture: layers whose entering residual
  // stream is returned too -> [hidden [n, hidden] after the final norm] and, with capture, the
  // captured states concatenated in the order given [n, len(capture) * hidden]
  std::vector<torch::Tensor> forward(torch::Tensor x, torch::Tensor positions, std::vector<torch::Tensor> kcaches,
                                     std::vector<torch::Tensor> vcaches, std::vector<int64_t> slots,
                                     std::vector<int64_t> context_lens, std::vector<int64_t> query_lens,
                                     std::vector<c10::optional<torch::Tensor>> tree_starts,
                                     std::vector<c10::optional<torch::Tensor>> tree_paths, int64_t num_layers,
                                     std::vector<int64_t> capture) {
    TORCH_CHECK(num_layers >= 0 && num_layers <= layers_, "0 to ", layers_, " layers");
    TORCH_CHECK(kcaches.size() >= static_cast<size_t>(num_layers) && vcaches.size() == kcaches.size(), "a key and a value cache a layer");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == norm_.size(0) && x.scalar_type() == norm_.scalar_type(), "x [n, hidden] of the model's dtype");
    const int64_t n = x.size(0), hidden = x.size(1);
    TORCH_CHECK(n > 0, "a pass of at least one row");
    for (int64_t l : capture) TORCH_CHECK(l >= 0 && l < num_layers, "cannot capture the state entering layer ", l);
    const Pass pass{positions, cos_, sin_, std::move(slots), std::move(context_lens), std::move(query_lens),
                    std::move(tree_starts), std::move(tree_paths), heads_, kv_heads_, eps_, scale_};
    for (int64_t l = 0; l < num_layers; ++l) {
      pass.check(n, kcaches[l], vcaches[l]);
      TORCH_CHECK(kcaches[l].size(3) == d_ && kcaches[l].scalar_type() == x.scalar_type(), "caches of the model's head size and dtype");
    }
    // one pass at a time: the workspace is the object's (a Decoder shared by threads takes turns)
    std::lock_guard<std::mutex> lock(mutex_);
    if (ws_rows_ < n || !ws_.h.defined() || ws_.h.scalar_type() != x.scalar_type() || ws_.h.size(1) != hidden) {
      ws_ = Buffers::allocate(n, hidden, heads_, kv_heads_, d_, intermediate_, x.options());
      stream_ = torch::empty({n, hidden}, x.options());
      ws_rows_ = n;
    }
    const Buffers b = ws_.first(n);
    torch::Tensor stream = stream_.narrow(0, 0, n);  // the residual stream, each layer's output over its input
    stream.copy_(x);
    torch::Tensor captured;
    if (!capture.empty()) captured = torch::empty({n, static_cast<int64_t>(capture.size()) * hidden}, x.options());
    for (int64_t l = 0; l < num_layers; ++l) {
      for (size_t c = 0; c < capture.size(); ++c)
        if (capture[c] == l) captured.narrow(1, c * hidden, hidden).copy_(stream);
      layer_into(stream, stream, &w_[9 * l], projections_[l], &biases_[3 * l], kcaches[l], vcaches[l], pass, b,
                 profiling_ ? &times_ : nullptr);
    }
    torch::Tensor out = torch::empty({n, hidden}, x.options());
    rms_norm_into(stream, norm_, eps_, out);
    if (capture.empty()) return {out};
    return {out, captured};
  }

 private:
  std::vector<torch::Tensor> w_;
  std::vector<int64_t> kinds_;
  std::vector<c10::optional<torch::Tensor>> biases_;
  std::vector<Projections> projections_;  // each layer's, prepared once (layer.h)
  torch::Tensor norm_, cos_, sin_;
  int64_t heads_, kv_heads_, d_, layers_ = 0, intermediate_ = 0;
  double eps_, scale_;
  std::mutex mutex_;
  Buffers ws_;
  torch::Tensor stream_;
  int64_t ws_rows_ = 0;
  bool profiling_ = false;
  LayerTimes times_;
};

}  // namespace

void register_forward(pybind11::module& m) {
  pybind11::class_<NativeDecoder>(m, "NativeDecoder", "a model's decoder layers and final norm, run in one call a pass")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<c10::optional<torch::Tensor>>, torch::Tensor,
                          torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, double, double>())
      .def_property_readonly("num_layers", &NativeDecoder::num_layers)
      // the GIL is let go: a pass touches no Python object, and the server's other threads may run
      .def("forward", &NativeDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "the decoder's layers and final norm over a pass's new tokens, in one call")
      .def("set_profiling", &NativeDecoder::set_profiling, "while on, passes add where their layers' time goes (from zero)")
      .def_property_readonly("times", &NativeDecoder::times, "seconds in (matrices, attention, other) since profiling went on");
}
