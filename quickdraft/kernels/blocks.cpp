// blocks.h's block linear bound to torch tensors; on the AVX-512 build, passes of many rows go to
// AMX where the CPU has it (amx_x86.h).
#include <torch/extension.h>

#include <vector>

#include "blocks.h"
#include "entry.h"
#if defined(QD_ISA_AVX512)
#include "arch/amx_x86.h"
#endif

namespace {

using qd::Format;
using qd::LANES;

// per-thread scratch for x's quantized rows and block figures: a call allocates nothing but its
// output (at one row, five allocations were a good part of a small matrix's ~10 us)
template <typename T>
T* scratch(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// run(std::integral_constant<int, KIND>()) for block format ``kind``; an unknown one fails
template <typename Run>
auto with_kind(int64_t kind, Run run) {
  return qd::by_kind(kind, [&](auto k) {
    constexpr int KIND = decltype(k)::value;
    TORCH_CHECK(KIND >= 0, "unknown block format ", kind);
    return run(std::integral_constant<int, KIND < 0 ? 0 : KIND>());
  });
}

}  // namespace

// x [M, K] (float32, or bfloat16 as uint16_t) times the weights of w, its tiles, biases and outputs
// set, on raw pointers: x quantized into this thread's scratch, then the tiles (on AMX where it
// takes the pass)
void run_blocks(int64_t kind, const void* x, bool f32, int64_t M, int64_t K, const qd::Weights& w) {
  with_kind(kind, [&](auto k) {
    constexpr int KIND = decltype(k)::value;
    const int64_t nb = K / Format<KIND>::L;
    thread_local std::vector<int8_t> qbuf;
    thread_local std::vector<float> xsbuf, qsbuf;
    thread_local std::vector<int32_t> initbuf;
    const int64_t padded = (M + 15) / 16 * 16;  // AMX reads x in whole tiles of rows (the rows past M: never read back)
    int8_t* q = scratch(qbuf, padded * K);
    float* xs = scratch(xsbuf, M * nb);
    int32_t* init = scratch(initbuf, M * nb);
    float* qs = scratch(qsbuf, M * nb);
    const qd::Rows rows{q, xs, init, qs, K, nb, M > 1};
    if (f32) {
      qd::quantize_rows<KIND>(static_cast<const float*>(x), M, K, q, xs, init, qs);
    } else {
      qd::quantize_rows<KIND>(static_cast<const uint16_t*>(x), M, K, q, xs, init, qs);
    }
#if defined(QD_ISA_AVX512)
    if (qd::run_amx<KIND>(rows, w, M)) return;
#endif
    qd::run_tiles<KIND>(rows, w, M);
  });
}

qd::Weights block_weights(int64_t kind, int64_t K, const std::vector<torch::Tensor>& ws,
                          const std::vector<c10::optional<torch::Tensor>>& biases, std::vector<torch::Tensor>& keep) {
  return with_kind(kind, [&](auto k) {
    using F = Format<decltype(k)::value>;
    TORCH_CHECK(K % F::L == 0 && (!F::SUPER || K % (F::L * F::SUPER) == 0), "K a multiple of the block and super-block");
    TORCH_CHECK(!ws.empty() && ws.size() <= qd::Weights::MAX && biases.size() == ws.size(), "1 to 4 weights, a bias (or None) each");
    qd::Weights w;
    w.count = static_cast<int>(ws.size());
    w.tile_bytes = F::tile_bytes(K / F::L);
    for (int i = 0; i < w.count; ++i) {
      const torch::Tensor& wi = ws[i];
      TORCH_CHECK(wi.scalar_type() == torch::kUInt8 && wi.dim() == 2 && wi.is_contiguous(), "w: uint8 tiles [N / 16, bytes]");
      TORCH_CHECK(wi.size(1) == w.tile_bytes, "w: ", wi.size(1), " bytes a tile, the layout needs ", w.tile_bytes);
      const int64_t N = wi.size(0) * LANES;
      w.W[i] = wi.data_ptr<uint8_t>();
      w.B[i] = nullptr;
      if (biases[i].has_value()) {
        const torch::Tensor& bias = *biases[i];
        const int64_t n = bias.numel();
        TORCH_CHECK(n <= N && n > N - LANES, "a bias of ", n, " values for ", wi.size(0), " tiles of 16 rows");
        if (n == N && bias.scalar_type() == torch::kFloat32 && bias.is_contiguous()) {
          w.B[i] = bias.data_ptr<float>();  // as the tiles read it (models/decoder/native.py keeps its biases so)
        } else {  // three small torch operations a bias: ~10 us a call at one row
          keep.push_back(torch::zeros({N}, torch::kFloat32));
          keep.back().narrow(0, 0, n).copy_(bias.reshape({n}));
          w.B[i] = keep.back().data_ptr<float>();
        }
      }
      w.first[i + 1] = w.first[i] + wi.size(0);
    }
    return w;
  });
}

namespace {

// x [M, K] against ws of format ``kind``, checked; into: null, or one output a weight [M, tiles * 16]
// of x's dtype, contiguous, written in place; null allocates them
std::vector<torch::Tensor> run(int64_t kind, const torch::Tensor& x, const std::vector<torch::Tensor>& ws, int64_t K,
                               const std::vector<c10::optional<torch::Tensor>>& biases, const std::vector<torch::Tensor>* into) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x float32 or bfloat16");
  TORCH_CHECK(x.is_contiguous(), "x contiguous");
  TORCH_CHECK(into == nullptr || into->size() == ws.size(), "one output a weight");
  const int64_t M = x.size(0);
  std::vector<torch::Tensor> outs, keep;
  qd::Weights w = block_weights(kind, K, ws, biases, keep);
  for (int i = 0; i < w.count; ++i) {
    const int64_t N = ws[i].size(0) * LANES;  // the padded rows too: the caller drops them
    if (into == nullptr) {
      outs.push_back(torch::empty({M, N}, x.options()));
    } else {
      const torch::Tensor& y = (*into)[i];
      TORCH_CHECK(y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.dim() == 2 && y.size(0) == M && y.size(1) == N,
                  "output ", i, ": [M, tiles * 16] contiguous, of x's dtype");
      outs.push_back(y);
    }
    w.ys[i] = qd::Out{outs.back().data_ptr(), x.scalar_type() == torch::kFloat32};
  }
  run_blocks(kind, x.data_ptr(), x.scalar_type() == torch::kFloat32, M, K, w);
  return outs;
}

}  // namespace

// x [M, K] float32 or bfloat16, w [tiles, bytes] uint8 in ``kind``'s layout -> [M, tiles * 16] in x's
// dtype (the rows that pad the last tile are the caller's to drop)
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor w, int64_t kind, int64_t K, c10::optional<torch::Tensor> bias) {
  return run(kind, x, {w}, K, {bias}, nullptr)[0];
}

// the same for up to 4 weights of one format against the same x -> one output each
std::vector<torch::Tensor> linear_blocks_many(torch::Tensor x, std::vector<torch::Tensor> ws, int64_t kind, int64_t K,
                                              std::vector<c10::optional<torch::Tensor>> biases) {
  return run(kind, x, ws, K, biases, nullptr);
}

// the same into given outputs ys (one a weight, [M, tiles * 16] of x's dtype, contiguous)
void linear_blocks_into(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, int64_t kind, int64_t K,
                        const std::vector<c10::optional<torch::Tensor>>& biases, const std::vector<torch::Tensor>& ys) {
  run(kind, x, ws, K, biases, &ys);
}

double vnni_rate(int64_t runs) { return qd::dot_rate(runs); }

#if defined(QD_ISA_AVX512)
bool amx_active() { return qd::amx_hardware() && qd::amx_wanted.load(); }
bool use_amx(bool on) { return qd::amx_wanted.exchange(on); }
#else  // no AMX outside the AVX-512 build
bool amx_active() { return false; }
bool use_amx(bool) { return false; }
#endif

int64_t amx_min_rows() { return qd::AMX_MIN_ROWS; }
