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
//
// A draft model's greedy chains run here too, all K passes in one call (chains(): the token
// table's rows, the layers, the output head and the argmax between them), so that Python does
// not run between a draft's passes (proposers/draft_model.py).
#include <torch/extension.h>

#include <chrono>
#include <cmath>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "entry.h"
#include "layer.h"
#include "rowwise.h"

namespace {

float half_bits(const uint8_t* p) {  // a float16 field, as numpy's astype(float32) reads it
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// Row `row` of a matrix in blocks.h's tiles (K inputs) as models/ggml.py's _dequantize gives it:
// (q - offset) x scale (- min), each an IEEE float32 operation in that order, scale = sc x d and
// min = mn x dmin for the K-quants. A token's embedding: only the row's own bytes are read, where
// numpy unpacked its whole tile.
template <int KIND>
void block_row(const uint8_t* tiles, int64_t K, int64_t row, float* out) {
  using F = qd::Format<KIND>;
  constexpr int HALF = F::STEPS / 2;
  const int64_t blocks = K / F::L;
  const uint8_t* p = tiles + row / qd::LANES * F::tile_bytes(blocks);
  const int l = static_cast<int>(row % qd::LANES);
  float d = 0.0f, dmin = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (F::SUPER > 0) {
      if (b % F::SUPER == 0) {
        d = half_bits(p + 2 * l);
        if constexpr (F::MIN) dmin = half_bits(p + 32 + 2 * l);
        p += F::SUPER_BYTES;
      }
    }
    const uint8_t* fields = p + F::VECTORS * 64;
    float scale, mn = 0.0f;
    if constexpr (KIND == qd::Q4_K) {
      scale = static_cast<float>(fields[l]) * d;
      mn = static_cast<float>(fields[16 + l]) * dmin;
    } else if constexpr (KIND == qd::Q6_K) {
      scale = static_cast<float>(static_cast<int8_t>(fields[l])) * d;
    } else {
      scale = half_bits(fields + 2 * l);
      if constexpr (F::MIN) mn = half_bits(fields + 32 + 2 * l);
    }
    for (int s = 0; s < F::STEPS; ++s) {
      for (int e = 0; e < 4; ++e) {
        int q;
        if constexpr (F::BITS == 8) {
          q = p[64 * s + 4 * l + e];
        } else {  // step s in the low nibbles of vector s, step s + HALF in the high ones
          const uint8_t c = p[64 * (s % HALF) + 4 * l + e];
          q = s < HALF ? c & 0x0f : c >> 4;
          if constexpr (F::BITS > 4) {  // the high bits: step s's at bits W x s of vector HALF
            constexpr int W = F::BITS - 4;
            q |= ((p[64 * HALF + 4 * l + e] >> (W * s)) & ((1 << W) - 1)) << 4;
          }
        }
        float v = (static_cast<float>(q) - static_cast<float>(F::OFFSET)) * scale;
        if constexpr (F::MIN) v = v - mn;
        out[b * F::L + 4 * s + e] = v;
      }
    }
    p += F::BLOCK_BYTES;
  }
}

// A row of logits [n] -> its argmax as sampling.argmax_rows takes it (rowwise.h's argmax_row) and,
// when `confidence`, that token's probability under the softmax at temperature 1,
// 1 / sum(e^(x - max)) (simd.h's exp_neg; torch's softmax adds in another order, so the two may
// differ in the last bits: the probability only decides where a draft stops, never what the
// target accepts).
template <typename T>
std::pair<int64_t, float> choose(const T* x, int64_t n, bool confidence) {
  const int64_t best = qd::argmax_row(x, n);
  const float m = qd::to_float(x[best]);
  if (!std::isfinite(m)) return {best, NAN};  // torch's softmax: NaN
  if (!confidence) return {best, 1.0f};
  simd::F16 sum = simd::zero_f();
  const simd::F16 minus = simd::set1_f(-m);
  for (int64_t i = 0; i < n; i += 16) sum = simd::add(sum, simd::exp_neg(simd::add(qd::load16(x, i, n, -INFINITY), minus)));
  return {best, 1.0f / simd::reduce_add(sum)};
}

// The probability of row `token` of logits [n] under the softmax at temperature 1, as choose()
// reads it for the argmax (proposers/draft_sampling.py's confident_rows: a sampled draft's cut).
template <typename T>
float prob_of(const T* x, int64_t n, int64_t token) {
  simd::F16 top = simd::set1_f(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) top = simd::max(top, qd::load16(x, i, n, -INFINITY));
  const float m = simd::reduce_max(top);
  simd::F16 sum = simd::zero_f();
  const simd::F16 minus = simd::set1_f(-m);
  for (int64_t i = 0; i < n; i += 16) sum = simd::add(sum, simd::exp_neg(simd::add(qd::load16(x, i, n, -INFINITY), minus)));
  const simd::F16 e = simd::exp_neg(simd::add(simd::set1_f(qd::to_float(x[token])), minus));
  alignas(64) float lanes[16];
  simd::store_f(lanes, e);
  return lanes[0] / simd::reduce_add(sum);
}

class NativeDecoder {
 public:
  // w: per layer, input norm, q, k, v, o, the MLP's input norm, gate, up, down (9 a layer, layer by
  // layer); kinds: per layer, the 7 projections' (DENSE or a block format); biases: per layer, q,
  // k, v's (float32 as the kernels read them, or None); norms: per layer, layer.h's LayerSpec's q,
  // k, attention-output and MLP-output norms (4 a layer, each or None); cos, sin: rotary tables
  // [max_positions, head_dim] float32, tables[l] the one of layer l; windows[l]: layer l's sliding
  // window (0: none); act: rowwise.h's Activation; embed_scale: what chains() multiplies a token's
  // embedding by, rounded to the model's dtype (0: nothing; Gemma's sqrt(hidden)); norm: the final
  // norm's weight (of the activations' dtype, or float32: Gemma's); like: an empty tensor of the
  // activations' dtype
  NativeDecoder(std::vector<torch::Tensor> w, std::vector<int64_t> kinds, std::vector<c10::optional<torch::Tensor>> biases,
                std::vector<c10::optional<torch::Tensor>> norms, std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
                std::vector<int64_t> tables, std::vector<int64_t> windows, int64_t act, double embed_scale, torch::Tensor norm,
                torch::Tensor like, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : w_(std::move(w)), kinds_(std::move(kinds)), biases_(std::move(biases)), norm_(std::move(norm)),
        dtype_(like.scalar_type()), heads_(heads), kv_heads_(kv_heads), d_(head_dim), eps_(eps), scale_(scale),
        embed_scale_(embed_scale) {
    layers_ = static_cast<int64_t>(kinds_.size() / 7);
    const size_t L = static_cast<size_t>(layers_);
    TORCH_CHECK(layers_ > 0 && w_.size() == 9 * L && kinds_.size() == 7 * L && biases_.size() == 3 * L && norms.size() == 4 * L &&
                    tables.size() == L && windows.size() == L && cos.size() == sin.size(),
                "9 weights, 7 kinds, 3 biases, 4 norms, a table and a window a layer");
    TORCH_CHECK(norm_.dim() == 1 && heads_ % kv_heads_ == 0, "norm [hidden]; heads a multiple of kv heads");
    intermediate_ = out_features(w_[6], kinds_[4]);
    for (int64_t l = 0; l < layers_; ++l) {
      projections_.push_back(Projections::of(&w_[9 * l], &kinds_[7 * l], &biases_[3 * l], norm_.size(0), heads_ * d_, kv_heads_ * d_,
                                             intermediate_));
      const int64_t t = tables[l];
      TORCH_CHECK(t >= 0 && t < static_cast<int64_t>(cos.size()), "layer ", l, ": no rotary table ", t);
      specs_.push_back(LayerSpec{norms[4 * l], norms[4 * l + 1], norms[4 * l + 2], norms[4 * l + 3], cos[t], sin[t], windows[l], act});
    }
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
    TORCH_CHECK(x.dim() == 2 && x.size(1) == norm_.size(0) && x.scalar_type() == dtype_, "x [n, hidden] of the model's dtype");
    const int64_t n = x.size(0), hidden = x.size(1);
    TORCH_CHECK(n > 0, "a pass of at least one row");
    for (int64_t l : capture) TORCH_CHECK(l >= 0 && l < num_layers, "cannot capture the state entering layer ", l);
    const Pass pass{positions, std::move(slots), std::move(context_lens), std::move(query_lens),
                    std::move(tree_starts), std::move(tree_paths), heads_, kv_heads_, eps_, scale_};
    for (int64_t l = 0; l < num_layers; ++l) {
      pass.check(n, kcaches[l], vcaches[l]);
      specs_[l].check(pass, hidden, d_);
      TORCH_CHECK(kcaches[l].size(3) == d_ && kcaches[l].scalar_type() == x.scalar_type(), "caches of the model's head size and dtype");
    }
    // one pass at a time: the workspace is the object's (a Decoder shared by threads takes turns)
    std::lock_guard<std::mutex> lock(mutex_);
    torch::Tensor stream = workspace(n, x.options());  // the residual stream, each layer's output over its input
    stream.copy_(x);
    torch::Tensor captured;
    if (!capture.empty()) captured = torch::empty({n, static_cast<int64_t>(capture.size()) * hidden}, x.options());
    torch::Tensor out = torch::empty({n, hidden}, x.options());
    layers(stream, pass, kcaches, vcaches, num_layers, capture, captured, out);
    if (capture.empty()) return {out};
    return {out, captured};
  }

  // A draft's token table and output head, for chains(): embed [vocab, hidden] and head
  // [head_rows, hidden], each dense in the model's dtype (kind DENSE) or in block tiles (kind a
  // block format); head_ids [head_rows] int64: the vocabulary id of each head row (a truncated
  // head), or None (row r is token r).
  void set_head(torch::Tensor embed, int64_t embed_kind, int64_t vocab, torch::Tensor head, int64_t head_kind, int64_t head_rows,
                c10::optional<torch::Tensor> head_ids) {
    const int64_t hidden = norm_.size(0);
    for (auto [w, kind, rows] : {std::tuple{&embed, embed_kind, vocab}, std::tuple{&head, head_kind, head_rows}}) {
      TORCH_CHECK(w->is_contiguous() && w->dim() == 2 && rows > 0, "a contiguous table");
      if (kind == DENSE) {
        TORCH_CHECK(w->scalar_type() == dtype_ && w->size(1) == hidden && w->size(0) == rows,
                    "a dense table [rows, hidden] of the model's dtype");
      } else {
        TORCH_CHECK(w->scalar_type() == torch::kUInt8 && w->size(0) * qd::LANES >= rows && (w->size(0) - 1) * qd::LANES < rows,
                    "block tiles of 16 rows each");
        qd::by_kind(kind, [&](auto k) {
          constexpr int KIND = decltype(k)::value;
          if constexpr (KIND >= 0) {
            TORCH_CHECK(hidden % qd::Format<KIND>::L == 0 && w->size(1) == qd::Format<KIND>::tile_bytes(hidden / qd::Format<KIND>::L),
                        "tiles of the model's hidden size");
          } else {
            TORCH_CHECK(false, "no block format ", kind);
          }
        });
      }
    }
    if (head_ids) {
      TORCH_CHECK(head_ids->scalar_type() == torch::kInt64 && head_ids->is_contiguous() && head_ids->numel() == head_rows,
                  "one int64 id a head row");
      const int64_t* id = head_ids->data_ptr<int64_t>();
      for (int64_t r = 0; r < head_rows; ++r) TORCH_CHECK(id[r] >= 0 && id[r] < vocab, "head row ", r, "'s id ", id[r], " is past the table");
    } else {
      TORCH_CHECK(head_rows <= vocab, "a head of at most the table's rows");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    embed_ = std::move(embed), embed_kind_ = embed_kind, vocab_ = vocab;
    head_ = std::move(head), head_kind_ = head_kind, head_rows_ = head_rows;
    head_ids_ = head_ids ? *head_ids : torch::Tensor();
    head_keep_.clear();
    if (head_kind_ != DENSE) head_w_ = block_weights(head_kind_, hidden, {head_}, {c10::nullopt}, head_keep_);
  }

  // Greedy draft chains, every pass of them in one call (proposers/draft_model.py). Sequence i
  // first reads its query_lens[i] tokens (the ones its cache lacks, in `tokens` one sequence
  // after another) at positions context_lens[i].. of slot slots[i]; each pass then takes the
  // head's argmax at each sequence's last row as its next draft token (sampling.argmax_rows' ties)
  // and the next pass reads it, until sequence i has ks[i] tokens or a token's probability under
  // the head's softmax is below `threshold` (that token is its last; threshold <= 0: never). A
  // sequence's last token is not read. -> [tokens [sum of counts] int64, vocabulary ids sequence
  // by sequence; counts [batch] int64; seconds [passes] float64, each pass's own; q]
  //
  // Sampled chains (proposers/draft_sampling.py's draw): with `temperatures` [batch] (0: greedy)
  // and `uniforms` [batch, K] float64, sequence i's j-th token is rowwise.h's sample_one at
  // temperatures[i] with uniforms[i][j] and, where `top_ks`, `top_ps` and `min_ps` [batch] are
  // given, under sequence i's filters; q [batch, K, head rows] float32 holds the distribution each
  // was drawn from (a greedy sequence's one-hot); the threshold then reads the token's
  // probability at temperature 1 (prob_of). Without them q is empty.
  std::vector<torch::Tensor> chains(torch::Tensor tokens, std::vector<torch::Tensor> kcaches, std::vector<torch::Tensor> vcaches,
                                    std::vector<int64_t> slots, std::vector<int64_t> context_lens, std::vector<int64_t> query_lens,
                                    std::vector<int64_t> ks, double threshold, std::vector<double> temperatures,
                                    c10::optional<torch::Tensor> uniforms, std::vector<int64_t> top_ks,
                                    std::vector<double> top_ps, std::vector<double> min_ps) {
    const size_t batch = slots.size();
    const bool sampled = !temperatures.empty();
    int64_t kmax = 0;
    for (const int64_t k : ks) kmax = std::max(kmax, k);
    torch::Tensor coins, qout;
    std::vector<qd::Filters> filters;
    if (sampled) {
      TORCH_CHECK(temperatures.size() == batch, "a temperature a sequence");
      for (const double t : temperatures) TORCH_CHECK(t >= 0.0 && std::isfinite(t), "temperature ", t);
      TORCH_CHECK(uniforms.has_value() && uniforms->scalar_type() == torch::kFloat64 && uniforms->dim() == 2 &&
                      uniforms->size(0) == static_cast<int64_t>(batch) && uniforms->size(1) >= kmax,
                  "uniforms [batch, K] float64 with sampled chains");
      coins = uniforms->contiguous();
      TORCH_CHECK((top_ks.empty() || top_ks.size() == batch) && (top_ps.empty() || top_ps.size() == batch) &&
                      (min_ps.empty() || min_ps.size() == batch),
                  "top_ks, top_ps and min_ps: none, or one a sequence");
      filters.resize(batch);
      for (size_t i = 0; i < batch; ++i) {
        if (!top_ks.empty()) filters[i].top_k = top_ks[i];
        if (!top_ps.empty()) filters[i].top_p = static_cast<float>(top_ps[i]);  // a float32 as BatchSampling holds it
        if (!min_ps.empty()) filters[i].min_p = static_cast<float>(min_ps[i]);
      }
      qout = torch::empty({static_cast<int64_t>(batch), kmax, head_rows_}, torch::kFloat32);
    }
    std::lock_guard<std::mutex> lock(mutex_);  // one pass at a time, and set_head not in between
    TORCH_CHECK(embed_.defined(), "set_head first");
    TORCH_CHECK(tokens.scalar_type() == torch::kInt64 && tokens.dim() == 1 && tokens.is_contiguous(), "tokens [n] int64");
    TORCH_CHECK(batch > 0 && context_lens.size() == batch && query_lens.size() == batch && ks.size() == batch,
                "one slot, context, length and K a sequence");
    TORCH_CHECK(kcaches.size() == static_cast<size_t>(layers_) && vcaches.size() == kcaches.size(), "a key and a value cache a layer");
    int64_t fed = 0;
    for (size_t i = 0; i < batch; ++i) {
      TORCH_CHECK(ks[i] > 0 && query_lens[i] > 0, "sequence ", i, ": at least one token to read and one to draft");
      fed += query_lens[i];
    }
    TORCH_CHECK(fed == tokens.numel(), "the query lengths add up to ", fed, ", tokens has ", tokens.numel());
    const int64_t* in = tokens.data_ptr<int64_t>();
    for (int64_t r = 0; r < fed; ++r) TORCH_CHECK(in[r] >= 0 && in[r] < vocab_, "token ", in[r], " is past the table's ", vocab_, " rows");
    const auto options = norm_.options().dtype(dtype_);
    const int64_t hidden = norm_.size(0), padded = head_kind_ == DENSE ? head_rows_ : head_.size(0) * qd::LANES;
    const int64_t* ids = head_ids_.defined() ? head_ids_.data_ptr<int64_t>() : nullptr;
    const bool f32 = dtype_ == torch::kFloat32;
    std::vector<std::vector<int64_t>> drafts(batch);
    std::vector<size_t> active(batch);
    for (size_t i = 0; i < batch; ++i) active[i] = i;
    std::vector<int64_t> feed(in, in + fed);
    std::vector<double> times;
    while (!active.empty()) {
      const auto started = std::chrono::steady_clock::now();
      const int64_t n = static_cast<int64_t>(feed.size()), m = static_cast<int64_t>(active.size());
      torch::Tensor stream = workspace(n, options);
      embed_into(feed, stream);
      torch::Tensor positions = torch::empty({n}, torch::kInt64);
      int64_t* pos = positions.data_ptr<int64_t>();
      std::vector<int64_t> s(m), c(m), q(m);
      for (int64_t a = 0, r = 0; a < m; ++a) {
        const size_t i = active[a];
        s[a] = slots[i], c[a] = context_lens[i], q[a] = query_lens[i];
        for (int64_t j = 0; j < q[a]; ++j) pos[r++] = c[a] + j;
      }
      const Pass pass{positions, std::move(s), std::move(c), std::move(q), std::vector<c10::optional<torch::Tensor>>(m),
                      std::vector<c10::optional<torch::Tensor>>(m), heads_, kv_heads_, eps_, scale_};
      for (int64_t l = 0; l < layers_; ++l) {
        pass.check(n, kcaches[l], vcaches[l]);
        specs_[l].check(pass, hidden, d_);
        TORCH_CHECK(kcaches[l].size(3) == d_ && kcaches[l].scalar_type() == dtype_, "caches of the model's head size and dtype");
      }
      torch::Tensor normed = grown(normed_, n, hidden, options);
      layers(stream, pass, kcaches, vcaches, layers_, {}, torch::Tensor(), normed);
      torch::Tensor last = normed;  // each sequence's last row
      if (n > m) {
        last = grown(last_, m, hidden, options);
        for (int64_t a = 0, r = 0; a < m; ++a) {
          r += pass.query_lens[a];
          last[a].copy_(normed[r - 1]);
        }
      }
      torch::Tensor logits = grown(logits_, m, padded, options);
      if (head_kind_ == DENSE) {
        (f32 ? linear_f32_into : linear_bf16_into)(last, head_, c10::nullopt, logits);
      } else {
        qd::Weights w = head_w_;
        w.ys[0] = qd::Out{logits.data_ptr(), f32};
        run_blocks(head_kind_, last.data_ptr(), f32, m, hidden, w);
      }
      feed.clear();
      std::vector<size_t> next;
      for (int64_t a = 0; a < m; ++a) {
        const size_t i = active[a];
        int64_t row;
        float p;
        const auto pick = [&](const auto* x) {
          if (!sampled) {
            std::tie(row, p) = choose(x, head_rows_, threshold > 0);
            return;
          }
          const int64_t j = static_cast<int64_t>(drafts[i].size());
          float* qrow = qout.data_ptr<float>() + (static_cast<int64_t>(i) * kmax + j) * head_rows_;
          row = qd::sample_one(x, head_rows_, static_cast<float>(temperatures[i]), coins.data_ptr<double>()[i * coins.size(1) + j], qrow,
                                filters[i]);
          p = threshold > 0 ? prob_of(x, head_rows_, row) : 1.0f;
        };
        f32 ? pick(logits[a].data_ptr<float>()) : pick(reinterpret_cast<const uint16_t*>(logits[a].data_ptr()));
        const int64_t token = ids ? ids[row] : row;
        drafts[i].push_back(token);
        context_lens[i] += query_lens[i];
        query_lens[i] = 1;
        if (static_cast<int64_t>(drafts[i].size()) < ks[i] && (threshold <= 0 || p >= static_cast<float>(threshold))) {
          next.push_back(i);
          feed.push_back(token);
        }
      }
      active = std::move(next);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    }
    torch::Tensor counts = torch::empty({static_cast<int64_t>(batch)}, torch::kInt64);
    int64_t total = 0;
    for (size_t i = 0; i < batch; ++i) total += counts.data_ptr<int64_t>()[i] = static_cast<int64_t>(drafts[i].size());
    torch::Tensor out = torch::empty({total}, torch::kInt64);
    int64_t* o = out.data_ptr<int64_t>();
    for (const auto& d : drafts) o = std::copy(d.begin(), d.end(), o);
    return {out, counts, torch::tensor(times, torch::kFloat64), sampled ? qout : torch::empty({0}, torch::kFloat32)};
  }

 private:
  // the workspace for n rows of x's options, grown when a pass has more rows than any before -> the
  // residual stream's first n rows
  torch::Tensor workspace(int64_t n, const torch::TensorOptions& options) {
    const int64_t hidden = norm_.size(0);
    if (ws_rows_ < n || !ws_.h.defined() || ws_.h.scalar_type() != c10::typeMetaToScalarType(options.dtype())) {
      ws_ = Buffers::allocate(n, hidden, heads_, kv_heads_, d_, intermediate_, options);
      stream_ = torch::empty({n, hidden}, options);
      ws_rows_ = n;
    }
    return stream_.narrow(0, 0, n);
  }

  // buf's first n rows [n, width], buf made anew where it has fewer rows, another width or dtype
  static torch::Tensor grown(torch::Tensor& buf, int64_t n, int64_t width, const torch::TensorOptions& options) {
    if (!buf.defined() || buf.size(0) < n || buf.size(1) != width || buf.scalar_type() != c10::typeMetaToScalarType(options.dtype()))
      buf = torch::empty({n, width}, options);
    return buf.narrow(0, 0, n);
  }

  // The first num_layers layers over the residual stream [n, hidden] (in place), the states entering
  // the `capture` layers copied into `captured`, then the final norm into out (the caller holds mutex_)
  void layers(const torch::Tensor& stream, const Pass& pass, const std::vector<torch::Tensor>& kcaches,
              const std::vector<torch::Tensor>& vcaches, int64_t num_layers, const std::vector<int64_t>& capture,
              const torch::Tensor& captured, const torch::Tensor& out) {
    const int64_t hidden = stream.size(1);
    const Buffers b = ws_.first(stream.size(0));
    for (int64_t l = 0; l < num_layers; ++l) {
      for (size_t c = 0; c < capture.size(); ++c)
        if (capture[c] == l) captured.narrow(1, c * hidden, hidden).copy_(stream);
      layer_into(stream, stream, &w_[9 * l], projections_[l], &biases_[3 * l], specs_[l], kcaches[l], vcaches[l], pass, b,
                 profiling_ ? &times_ : nullptr);
    }
    rms_norm_into(stream, norm_, eps_, out);
  }

  // the table's rows of `tokens` into x [tokens, hidden]
  void embed_into(const std::vector<int64_t>& tokens, const torch::Tensor& x) const {
    const int64_t hidden = x.size(1), n = static_cast<int64_t>(tokens.size());
    const bool f32 = x.scalar_type() == torch::kFloat32;
    embed_rows_into(tokens, x);
    // Gemma's sqrt(hidden), after the row is in the model's dtype: the Python path's embed[tokens] * scale
    if (embed_scale_ == 0.0) return;
    if (f32) {
      qd::scale_values(x.data_ptr<float>(), n * hidden, static_cast<float>(embed_scale_));
    } else {
      qd::scale_values(reinterpret_cast<uint16_t*>(x.data_ptr()), n * hidden, static_cast<float>(embed_scale_));
    }
  }

  // the table's rows of `tokens` into x [tokens, hidden], as stored (dense) or dequantized (blocks)
  void embed_rows_into(const std::vector<int64_t>& tokens, const torch::Tensor& x) const {
    const int64_t hidden = x.size(1), n = static_cast<int64_t>(tokens.size());
    const bool f32 = x.scalar_type() == torch::kFloat32;
    if (embed_kind_ == DENSE) {
      const size_t bytes = hidden * x.element_size();
      const auto* from = static_cast<const uint8_t*>(embed_.data_ptr());
      for (int64_t r = 0; r < n; ++r) std::memcpy(static_cast<uint8_t*>(x.data_ptr()) + r * bytes, from + tokens[r] * bytes, bytes);
      return;
    }
    std::vector<float> row(hidden);
    qd::by_kind(embed_kind_, [&](auto k) {
      constexpr int KIND = decltype(k)::value;
      if constexpr (KIND >= 0) {
        for (int64_t r = 0; r < n; ++r) {
          block_row<KIND>(embed_.data_ptr<uint8_t>(), hidden, tokens[r], row.data());
          if (f32) {
            std::memcpy(x.data_ptr<float>() + r * hidden, row.data(), hidden * sizeof(float));
          } else {
            auto* y = reinterpret_cast<uint16_t*>(x.data_ptr()) + r * hidden;
            for (int64_t j = 0; j < hidden; ++j) y[j] = simd::to_bf16(row[j]);
          }
        }
      }
    });
  }

  std::vector<torch::Tensor> w_;
  std::vector<int64_t> kinds_;
  std::vector<c10::optional<torch::Tensor>> biases_;
  std::vector<Projections> projections_;  // each layer's, prepared once (layer.h)
  std::vector<LayerSpec> specs_;          // each layer's norms, rotary tables, window and activation (layer.h)
  torch::Tensor norm_;
  c10::ScalarType dtype_;  // the activations' (the norms may be float32 where they are bfloat16: Gemma)
  int64_t heads_, kv_heads_, d_, layers_ = 0, intermediate_ = 0;
  double eps_, scale_, embed_scale_;
  std::mutex mutex_;
  Buffers ws_;
  torch::Tensor stream_;
  int64_t ws_rows_ = 0;
  torch::Tensor normed_, last_, logits_;  // chains()'s: the final norm's output, the last rows, the head's output
  // the draft's token table and head (set_head)
  torch::Tensor embed_, head_, head_ids_;
  int64_t embed_kind_ = DENSE, head_kind_ = DENSE, vocab_ = 0, head_rows_ = 0;
  qd::Weights head_w_;
  std::vector<torch::Tensor> head_keep_;
  bool profiling_ = false;
  LayerTimes times_;
};

}  // namespace

void register_forward(pybind11::module& m) {
  pybind11::class_<NativeDecoder>(m, "NativeDecoder", "a model's decoder layers and final norm, run in one call a pass")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<c10::optional<torch::Tensor>>,
                          std::vector<c10::optional<torch::Tensor>>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<int64_t>, std::vector<int64_t>, int64_t, double, torch::Tensor, torch::Tensor, int64_t, int64_t,
                          int64_t, double, double>())
      .def_property_readonly("num_layers", &NativeDecoder::num_layers)
      // the GIL is let go: a pass touches no Python object, and the server's other threads may run
      .def("forward", &NativeDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "the decoder's layers and final norm over a pass's new tokens, in one call")
      .def("set_head", &NativeDecoder::set_head, "the token table and output head that chains() reads")
      .def("chains", &NativeDecoder::chains, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "greedy or sampled draft chains, every pass in one call")
      .def("set_profiling", &NativeDecoder::set_profiling, "while on, passes add where their layers' time goes (from zero)")
      .def_property_readonly("times", &NativeDecoder::times, "seconds in (matrices, attention, other) since profiling went on");
}
