// The kernels' cores on one machine's instruction sets, without Python or torch (so that the ARM64
// ones run under qemu-user on an x86 machine): each ISA's kernels give a row the same bits
// whatever else is in the pass (1..MAX_ROWS rows), and the bits of the portable reference where
// simd.h promises them (float32, int8 and GGUF-block linears, attention and its exp, the
// row-wise steps; bfloat16 linears except on AVX512-BF16).
// Built and run by tests/models/test_native_kernels.py; prints one line per check, and
// "N passed, N failed" last.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define QD_DECLARE(p)                                                                                                      \
  extern "C" const char* p##_isa();                                                                                        \
  extern "C" void p##_linear_f32(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t);             \
  extern "C" void p##_linear_bf16(const uint16_t*, const uint16_t*, const float*, uint16_t*, int64_t, int64_t, int64_t);   \
  extern "C" void p##_linear_w8(const uint16_t*, const int8_t*, const float*, const int32_t*, uint16_t*, int64_t, int64_t,  \
                                int64_t);                                                                                  \
  extern "C" int p##_linear_blocks(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, float*);                   \
  extern "C" int p##_sanitize(int, uint8_t*, int64_t, int64_t);                                                            \
  extern "C" int64_t p##_tile_bytes(int, int64_t);                                                                        \
  extern "C" void p##_attend(int, const float*, const void*, const void*, int64_t, float*, int64_t, int64_t, int64_t, int64_t, \
                             int64_t, int64_t, const int64_t*, const int64_t*, float, int64_t);                            \
  extern "C" void p##_exp_neg(const float*, float*, int64_t);                                                              \
  extern "C" void p##_store_bf16(const float*, uint16_t*, int64_t);                                                         \
  extern "C" void p##_rowwise(int, int, const void*, const void*, void*, int64_t, int64_t);

#define QD_TABLE(p)                                                                                                      \
  Kernels{#p,           p##_linear_f32, p##_linear_bf16, p##_linear_w8, p##_linear_blocks, p##_sanitize, p##_tile_bytes, \
          p##_attend,   p##_exp_neg,    p##_store_bf16,  p##_rowwise}

QD_DECLARE(portable)
#if defined(__x86_64__)
QD_DECLARE(avx2)
QD_DECLARE(avx2_vnni)
QD_DECLARE(avx512)
#elif defined(__aarch64__)
QD_DECLARE(neon)
#endif

namespace {

struct Kernels {
  const char* name;
  void (*f32)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t);
  void (*bf16)(const uint16_t*, const uint16_t*, const float*, uint16_t*, int64_t, int64_t, int64_t);
  void (*w8)(const uint16_t*, const int8_t*, const float*, const int32_t*, uint16_t*, int64_t, int64_t, int64_t);
  int (*blocks)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, float*);
  int (*sanitize)(int, uint8_t*, int64_t, int64_t);
  int64_t (*tile_bytes)(int, int64_t);
  void (*attend)(int, const float*, const void*, const void*, int64_t, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                 int64_t, const int64_t*, const int64_t*, float, int64_t);
  void (*exp_neg)(const float*, float*, int64_t);
  void (*store_bf16)(const float*, uint16_t*, int64_t);
  void (*rowwise)(int, int, const void*, const void*, void*, int64_t, int64_t);
};

constexpr int64_t MAX_ROWS = 19;
int passed = 0, failed = 0;

void check(bool ok, const std::string& what) {
  (ok ? passed : failed) += 1;
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
}

uint16_t bf16(float f) {  // truncation is enough for test data
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// run(rows, x offset in rows, y) for all MAX_ROWS rows, then each row count 1..MAX_ROWS from row 0
// and each row alone: every run's rows must have the bits of the full pass's
template <typename T, typename Run>
bool invariant(int64_t N, Run run, std::vector<T>& full) {
  full.assign(MAX_ROWS * N, T());
  run(MAX_ROWS, 0, full.data());
  std::vector<T> part(MAX_ROWS * N);
  for (int64_t m = 1; m <= MAX_ROWS; ++m) {
    run(m, 0, part.data());
    if (std::memcmp(part.data(), full.data(), sizeof(T) * m * N) != 0) return false;
  }
  for (int64_t r = 0; r < MAX_ROWS; ++r) {
    run(1, r, part.data());
    if (std::memcmp(part.data(), full.data() + r * N, sizeof(T) * N) != 0) return false;
  }
  return true;
}

void test_isa(const Kernels& k, const Kernels& ref, bool same_bf16) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  const std::string isa = k.name;
  for (int64_t K : {64, 200, 896}) {  // 200: a tail step in every product
    const int64_t N = 37;
    std::vector<float> X(MAX_ROWS * K), W(N * K), B(N);
    for (auto& v : X) v = normal(rng);
    for (auto& v : W) v = normal(rng);
    for (auto& v : B) v = normal(rng);
    std::vector<float> y, yr;
    auto f32 = [&](const Kernels& kk) {
      return [&](int64_t m, int64_t r, float* out) { kk.f32(X.data() + r * K, W.data(), B.data(), out, m, K, N); };
    };
    check(invariant(N, f32(k), y), isa + " f32 rows invariant, K=" + std::to_string(K));
    invariant(N, f32(ref), yr);
    check(y == yr, isa + " f32 equals portable, K=" + std::to_string(K));

    std::vector<uint16_t> Xh(X.size()), Wh(W.size()), yh, yhr;
    for (size_t i = 0; i < X.size(); ++i) Xh[i] = bf16(X[i]);
    for (size_t i = 0; i < W.size(); ++i) Wh[i] = bf16(W[i]);
    auto h = [&](const Kernels& kk) {
      return [&](int64_t m, int64_t r, uint16_t* out) { kk.bf16(Xh.data() + r * K, Wh.data(), B.data(), out, m, K, N); };
    };
    check(invariant(N, h(k), yh), isa + " bf16 rows invariant, K=" + std::to_string(K));
    if (same_bf16) {
      invariant(N, h(ref), yhr);
      check(yh == yhr, isa + " bf16 equals portable, K=" + std::to_string(K));
    }

    std::vector<int8_t> Wq(N * K);
    std::vector<float> WS(N, 0.01f);
    std::vector<int32_t> WSUM(N, 0);
    std::uniform_int_distribution<int> byte(-127, 127);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < K; ++c) WSUM[n] += (Wq[n * K + c] = static_cast<int8_t>(byte(rng)));
    auto w8 = [&](const Kernels& kk) {
      return [&](int64_t m, int64_t r, uint16_t* out) { kk.w8(Xh.data() + r * K, Wq.data(), WS.data(), WSUM.data(), out, m, K, N); };
    };
    check(invariant(N, w8(k), yh), isa + " int8 rows invariant, K=" + std::to_string(K));
    invariant(N, w8(ref), yhr);
    check(yh == yhr, isa + " int8 equals portable, K=" + std::to_string(K));
  }
  const char* kinds[] = {"Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q6_K"};
  for (int kind = 0; kind < 6; ++kind) {
    const int64_t K = 512, tiles = 3, N = tiles * 16, bytes = ref.tile_bytes(kind, K);
    std::vector<uint8_t> T(tiles * bytes);
    std::uniform_int_distribution<int> any(0, 255);
    for (auto& b : T) b = static_cast<uint8_t>(any(rng));
    ref.sanitize(kind, T.data(), tiles, K);
    std::vector<float> X(MAX_ROWS * K), y, yr;
    for (auto& v : X) v = normal(rng);
    auto run = [&](const Kernels& kk) {
      return [&](int64_t m, int64_t r, float* out) { kk.blocks(kind, X.data() + r * K, m, K, T.data(), tiles, out); };
    };
    check(k.tile_bytes(kind, K) == bytes, isa + " " + kinds[kind] + " layout as portable's");
    check(invariant(N, run(k), y), isa + " " + kinds[kind] + " rows invariant");
    invariant(N, run(ref), yr);
    check(y == yr, isa + " " + kinds[kind] + " equals portable");
    bool finite = true;
    for (float v : y) finite = finite && v == v && v - v == 0.0f;
    check(finite, isa + " " + kinds[kind] + " outputs finite");
  }
}


// exp_neg: within 2 ulp of e^x (rounded from double) on [-87, 0], the portable bits, and NaN kept
void test_exp(const Kernels& k, const Kernels& ref) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> wide(-87.0f, 0.0f), narrow(-1.0f, 0.0f);
  std::vector<float> x = {0.0f, -0.0f, -87.0f, -1e-30f, -0.34657359f, -0.34657362f, -86.99f, -50.0f};
  while (x.size() < (1 << 18)) x.push_back(x.size() % 2 ? wide(rng) : narrow(rng));
  std::vector<float> y(x.size()), yr(x.size());
  k.exp_neg(x.data(), y.data(), static_cast<int64_t>(x.size()));
  ref.exp_neg(x.data(), yr.data(), static_cast<int64_t>(x.size()));
  int64_t worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = static_cast<float>(std::exp(static_cast<double>(x[i])));
    int32_t a, b;
    std::memcpy(&a, &y[i], 4), std::memcpy(&b, &want, 4);
    worst = std::max<int64_t>(worst, std::abs(static_cast<int64_t>(a) - b));
  }
  const std::string isa = k.name;
  check(worst <= 2, isa + " exp_neg within 2 ulp of e^x on [-87, 0] (worst " + std::to_string(worst) + ")");
  check(y == yr, isa + " exp_neg equals portable");
  float edge[16], out[16];
  for (int i = 0; i < 16; ++i) edge[i] = i == 3 ? NAN : -200.0f * i;
  k.exp_neg(edge, out, 16);
  bool ok = std::isnan(out[3]) && out[0] == 1.0f;
  for (int i = 1; i < 16; ++i) ok = ok && (i == 3 || (out[i] > 0.0f && out[i] < 1e-37f));
  check(ok, isa + " exp_neg: 1 at 0, tiny and positive below -87, NaN kept");
}

// float32 -> bfloat16 as torch rounds (to nearest even; a NaN -> 0x7fc0), written out bit by bit
uint16_t torch_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) return 0x7fc0;
  const uint32_t rest = u & 0xffffu, top = u >> 16;
  return static_cast<uint16_t>(rest > 0x8000u || (rest == 0x8000u && (top & 1)) ? top + 1 : top);
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float widen(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

// rowwise.h: store_bf16 rounds as torch on every bit pattern class (ties both ways, overflow to
// infinity, NaNs of either sign, subnormals); RMSNorm, add, multiply, SiLU and the conversions give the
// portable bits in float32 and bfloat16, with tails (200 and 203 values), and round as torch does
// (RMSNorm: close to the exact value)
void test_rowwise(const Kernels& k, const Kernels& ref) {
  const std::string isa = k.name;
  std::mt19937 rng(13);
  std::vector<float> x;
  for (uint32_t u : {0x00000000u, 0x80000000u, 0x3f800000u, 0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f817fffu, 0x7f7fffffu,
                     0xff7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffffffffu, 0xff800001u, 0x00000001u,
                     0x807fffffu, 0x00008000u, 0x00018000u})
    x.push_back(from_bits(u));
  while (x.size() % 16 || x.size() < (1 << 16)) x.push_back(from_bits(static_cast<uint32_t>(rng())));
  std::vector<uint16_t> got(x.size());
  k.store_bf16(x.data(), got.data(), static_cast<int64_t>(x.size()));
  bool ok = true;
  for (size_t i = 0; i < x.size(); ++i) ok = ok && got[i] == torch_bf16(x[i]);
  check(ok, isa + " store_bf16 rounds as torch (ties, overflow, NaN, subnormals, random bits)");

  std::normal_distribution<float> normal;
  for (int bf16 : {0, 1}) {
    const std::string type = bf16 ? " bf16" : " f32";
    for (int64_t h : {200, 896}) {
      const int64_t n = 9;
      std::vector<float> X(n * h), W(h);
      for (auto& v : X) v = 3.0f * normal(rng);
      for (auto& v : W) v = normal(rng);
      std::vector<uint16_t> Xh(X.size()), Wh(W.size());
      for (size_t i = 0; i < X.size(); ++i) X[i] = widen(Xh[i] = torch_bf16(X[i]));
      for (size_t i = 0; i < W.size(); ++i) W[i] = widen(Wh[i] = torch_bf16(W[i]));
      std::vector<float> y(X.size()), yr(X.size());
      const void *a = bf16 ? static_cast<const void*>(Xh.data()) : X.data(), *b = bf16 ? static_cast<const void*>(Wh.data()) : W.data();
      std::vector<uint16_t> yh(X.size()), yhr(X.size());
      void *out = bf16 ? static_cast<void*>(yh.data()) : y.data(), *outr = bf16 ? static_cast<void*>(yhr.data()) : yr.data();
      k.rowwise(0, bf16, a, b, out, n, h);
      ref.rowwise(0, bf16, a, b, outr, n, h);
      check(bf16 ? yh == yhr : y == yr, isa + type + " RMSNorm equals portable, h=" + std::to_string(h));
      double worst = 0.0;
      for (int64_t r = 0; r < n; ++r) {
        double ss = 0.0;
        for (int64_t i = 0; i < h; ++i) ss += static_cast<double>(X[r * h + i]) * X[r * h + i];
        const double inv = 1.0 / std::sqrt(ss / h + 1e-6);
        for (int64_t i = 0; i < h; ++i) {
          const double want = X[r * h + i] * inv * W[i], v = bf16 ? widen(yh[r * h + i]) : y[r * h + i];
          worst = std::max(worst, std::abs(v - want) / (std::abs(want) + 1e-3));
        }
      }
      check(worst < (bf16 ? 2e-2 : 1e-5), isa + type + " RMSNorm close to exact, h=" + std::to_string(h));
    }
    const int64_t count = 4096 + 203;
    std::vector<float> A(count), B(count);
    for (auto& v : A) v = 4.0f * normal(rng);
    for (auto& v : B) v = normal(rng);
    A[7] = 0.0f, A[8] = -0.0f, A[9] = INFINITY, B[10] = NAN;
    std::vector<uint16_t> Ah(count), Bh(count);
    for (int64_t i = 0; i < count; ++i) A[i] = widen(Ah[i] = torch_bf16(A[i])), B[i] = widen(Bh[i] = torch_bf16(B[i]));
    const void *a = bf16 ? static_cast<const void*>(Ah.data()) : A.data(), *b = bf16 ? static_cast<const void*>(Bh.data()) : B.data();
    for (int op : {1, 2}) {
      const std::string what = op == 1 ? " add" : " mul";
      std::vector<float> y(count), yr(count);
      std::vector<uint16_t> yh(count), yhr(count);
      k.rowwise(op, bf16, a, b, bf16 ? static_cast<void*>(yh.data()) : y.data(), 1, count);
      ref.rowwise(op, bf16, a, b, bf16 ? static_cast<void*>(yhr.data()) : yr.data(), 1, count);
      check(bf16 ? yh == yhr : std::memcmp(y.data(), yr.data(), sizeof(float) * count) == 0, isa + type + what + " equals portable");
      bool once = true;
      for (int64_t i = 0; i < count; ++i) {
        const float want = op == 1 ? A[i] + B[i] : A[i] * B[i];
        once = once && (bf16 ? yh[i] == torch_bf16(want) : (y[i] == want || (std::isnan(y[i]) && std::isnan(want))));
      }
      check(once, isa + type + what + " rounds the float result once");
    }
    // act(a) * b for the MLP's two activations (SiLU; Gemma 3's GELU-tanh): the portable bits, each
    // step rounded, close to the exact value, NaN and infinity kept
    struct Act { int op; const char* name; double (*exact)(double); double tol32; };
    const Act acts[] = {
        {4, "silu_mul", [](double x) { return x / (1.0 + std::exp(-x)); }, 1e-6},
        {8, "gelu_mul", [](double x) { return std::isinf(x) ? (x > 0 ? x : 0.0)
                                          : 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }, 1e-5},
    };
    for (const Act& act : acts) {
      const std::string what = isa + type + " " + act.name;
      std::vector<float> y(count), yr(count);
      std::vector<uint16_t> yh(count), yhr(count);
      k.rowwise(act.op, bf16, a, b, bf16 ? static_cast<void*>(yh.data()) : y.data(), 1, count);
      ref.rowwise(act.op, bf16, a, b, bf16 ? static_cast<void*>(yhr.data()) : yr.data(), 1, count);
      check(bf16 ? yh == yhr : std::memcmp(y.data(), yr.data(), sizeof(float) * count) == 0, what + " equals portable");
      double worst = 0.0;
      bool special = true;
      for (int64_t i = 0; i < count; ++i) {
        const double s = act.exact(A[i]);
        const double want = (bf16 ? widen(torch_bf16(static_cast<float>(s))) : s) * B[i];
        const double v = bf16 ? widen(yh[i]) : y[i];
        if (std::isnan(want) || std::isinf(want)) {
          special = special && (std::isnan(want) ? std::isnan(v) : v == want);
        } else {
          worst = std::max(worst, std::abs(v - want) / (std::abs(want) + 1e-6));
        }
      }
      check(special, what + " keeps NaN and infinity");
      check(worst < (bf16 ? 8e-3 : act.tol32), what + " close to exact (" + std::to_string(worst) + ")");
    }
    if (bf16) {  // RMSNorm of bfloat16 rows with a float32 weight (Gemma's 1 + w): portable bits, close to exact
      const int64_t n = 9, h = 640;
      std::vector<float> X(n * h), W(h);
      std::vector<uint16_t> Xh(X.size()), yh(X.size()), yhr(X.size());
      for (size_t i = 0; i < X.size(); ++i) X[i] = widen(Xh[i] = torch_bf16(3.0f * normal(rng)));
      for (auto& v : W) v = 1.0f + 0.1f * normal(rng);  // not bfloat16 values: the weight's own bits count
      k.rowwise(9, 1, Xh.data(), W.data(), yh.data(), n, h);
      ref.rowwise(9, 1, Xh.data(), W.data(), yhr.data(), n, h);
      check(yh == yhr, isa + " bf16 RMSNorm with a float32 weight equals portable");
      double worst = 0.0;
      for (int64_t r = 0; r < n; ++r) {
        double ss = 0.0;
        for (int64_t i = 0; i < h; ++i) ss += static_cast<double>(X[r * h + i]) * X[r * h + i];
        const double inv = 1.0 / std::sqrt(ss / h + 1e-6);
        for (int64_t i = 0; i < h; ++i) {
          const double want = X[r * h + i] * inv * W[i];
          worst = std::max(worst, std::abs(widen(yh[r * h + i]) - want) / (std::abs(want) + 1e-3));
        }
      }
      check(worst < 4e-3, isa + " bf16 RMSNorm with a float32 weight rounds once (" + std::to_string(worst) + ")");
    }
    {  // argmax_row: sampling.argmax_rows's index (lowest on ties, first NaN) and the row's finiteness,
       // rows of every length past a multiple of 16 (the tail padded), all negative or not
      const int64_t h = 16 * 9 + 5;
      std::vector<float> R(8 * h);
      for (auto& v : R) v = -100.0f - std::abs(normal(rng));  // every value negative: the tail's pad must not win
      R[0 * h + h - 1] = -1.0f;                                  // the maximum in the tail
      R[1 * h + 17] = R[1 * h + 90] = -0.5f;                     // a tie: the lower index
      R[2 * h + 40] = NAN, R[2 * h + 30] = INFINITY;             // the first NaN, past an infinity
      R[3 * h + 60] = INFINITY, R[3 * h + 61] = INFINITY;        // the first infinity
      R[4 * h + 3] = -INFINITY, R[4 * h + 100] = -2.0f;          // a minus infinity: not finite, yet its argmax is the maximum
      R[5 * h + 144] = 7.0f;                                     // the last full block's last lane
      R[6 * h + 0] = 3.0f, R[6 * h + 1] = 3.0f;                  // the first value
      for (int64_t i = 0; i < h; ++i) R[7 * h + i] = -0.0f;      // all zeros, of both signs: index 0
      R[7 * h + 8] = 0.0f;
      std::vector<uint16_t> Rh(R.size());
      for (size_t i = 0; i < R.size(); ++i) Rh[i] = torch_bf16(R[i]);
      for (int half : {0, 1}) {
        std::vector<int64_t> got(16), want(16);
        const void* a = half ? static_cast<const void*>(Rh.data()) : R.data();
        k.rowwise(5, half, a, nullptr, got.data(), 8, h);
        bool exact = true;
        for (int64_t r = 0; r < 8; ++r) {
          int64_t best = 0;
          float m = half ? widen(Rh[r * h]) : R[r * h];
          bool finite = std::isfinite(m);
          for (int64_t i = 1; i < h; ++i) {
            const float v = half ? widen(Rh[r * h + i]) : R[r * h + i];
            finite = finite && std::isfinite(v);
            if (!std::isnan(m) && (v > m || std::isnan(v))) best = i, m = v;
          }
          want[2 * r] = best, want[2 * r + 1] = finite;
          exact = exact && got[2 * r] == best && got[2 * r + 1] == finite;
        }
        check(exact, isa + (half ? " bf16" : " f32") + " argmax_row: the lowest index, the first NaN, finiteness");
      }
    }
    {  // sample_one: q = softmax(x / t) and the draw, the portable bits on every ISA; q close to exact (0 at a
       // -inf logit) and summing to 1; the token the first whose cumulative mass passes u x total (away
       // from a boundary)
      const int64_t n = 5, h = 16 * 40 + 7;
      std::vector<float> X(n * h);
      for (auto& v : X) v = 3.0f * normal(rng);
      for (int64_t i = 3; i < n * h; i += 11) X[i] = -INFINITY;  // masked logits: probability exactly 0
      std::vector<uint16_t> Xh(X.size());
      for (size_t i = 0; i < X.size(); ++i) Xh[i] = torch_bf16(X[i]);
      for (int half : {0, 1}) {
        std::vector<float> q(n * h + n), qr(n * h + n);
        const void* a = half ? static_cast<const void*>(Xh.data()) : X.data();
        k.rowwise(6, half, a, nullptr, q.data(), n, h);
        ref.rowwise(6, half, a, nullptr, qr.data(), n, h);
        const std::string what = isa + (half ? " bf16" : " f32") + " sample_one";
        check(std::memcmp(q.data(), qr.data(), sizeof(float) * q.size()) == 0, what + " equals portable");
        bool close = true, drawn = true;
        for (int64_t r = 1; r < n; ++r) {
          double m = -INFINITY, sum = 0.0, mass = 0.0, cum = 0.0;
          for (int64_t i = 0; i < h; ++i) m = std::max(m, static_cast<double>(half ? widen(Xh[r * h + i]) : X[r * h + i]) / 0.7);
          for (int64_t i = 0; i < h; ++i) sum += std::exp(static_cast<double>(half ? widen(Xh[r * h + i]) : X[r * h + i]) / 0.7 - m);
          for (int64_t i = 0; i < h; ++i) {
            const double want = std::exp(static_cast<double>(half ? widen(Xh[r * h + i]) : X[r * h + i]) / 0.7 - m) / sum;
            close = close && (want == 0.0 ? q[r * h + i] == 0.0f : std::abs(q[r * h + i] - want) <= 1e-5 * want + 1e-37);
            mass += q[r * h + i];
          }
          close = close && std::abs(mass - 1.0) < 1e-5;
          const double point = (r + 0.5) / n * mass;
          int64_t token = 0;
          while (cum + q[r * h + token] <= point) cum += q[r * h + token++];
          if (std::abs(cum - point) > 1e-9 && std::abs(cum + q[r * h + token] - point) > 1e-9)
            drawn = drawn && static_cast<int64_t>(q[n * h + r]) == token;
        }
        check(close, what + " q close to softmax(x / t)");
        check(drawn, what + " draws by the cumulative mass");
        int64_t best = 0;  // row 0 greedy: the argmax, q one-hot
        for (int64_t i = 1; i < h; ++i)
          if ((half ? widen(Xh[i]) : X[i]) > (half ? widen(Xh[best]) : X[best])) best = i;
        check(static_cast<int64_t>(q[n * h]) == best && q[best] == 1.0f, what + " greedy row: the argmax, one-hot");
      }
    }
    {  // sample_one under top-k, top-p and min-p (rowwise.h's shaped_row): the portable bits on every ISA;
       // each row sums to 1 and keeps what its filters let through: top-k 20 exactly 20 tokens (no
       // ties among normal floats), top-p 0.9 the shortest prefix by descending logit of mass >= 0.9,
       // min-p nothing below 0.05 x the top; the drawn token has mass
      const int64_t n = 8, h = 16 * 300 + 5;
      std::vector<float> X(n * h);
      for (auto& v : X) v = 2.0f * normal(rng);
      std::vector<uint16_t> Xh(X.size());
      for (size_t i = 0; i < X.size(); ++i) Xh[i] = torch_bf16(X[i]);
      std::vector<float> q(n * h + n), qr(n * h + n);
      k.rowwise(7, 0, X.data(), nullptr, q.data(), n, h);
      ref.rowwise(7, 0, X.data(), nullptr, qr.data(), n, h);
      const std::string what = isa + " f32 filtered sample_one";
      check(std::memcmp(q.data(), qr.data(), sizeof(float) * q.size()) == 0, what + " equals portable");
      std::vector<float> qh(n * h + n), qhr(n * h + n);
      k.rowwise(7, 1, Xh.data(), nullptr, qh.data(), n, h);
      ref.rowwise(7, 1, Xh.data(), nullptr, qhr.data(), n, h);
      check(std::memcmp(qh.data(), qhr.data(), sizeof(float) * qh.size()) == 0, isa + " bf16 filtered sample_one equals portable");
      bool sums = true, kept = true;
      for (int64_t r = 0; r < n; ++r) {
        const float* row = q.data() + r * h;
        double mass = 0.0, top = 0.0;
        int64_t nonzero = 0;
        for (int64_t i = 0; i < h; ++i) mass += row[i], nonzero += row[i] > 0.0f, top = std::max(top, static_cast<double>(row[i]));
        sums = sums && std::abs(mass - 1.0) < 1e-5 && row[static_cast<int64_t>(q[n * h + r])] > 0.0f;
        if (r % 4 == 0) kept = kept && nonzero == 20;
        if (r % 4 == 2)
          for (int64_t i = 0; i < h; ++i) kept = kept && (row[i] == 0.0f || row[i] >= 0.05 * top * (1 - 1e-6));
        if (r % 4 == 1) {  // the kept tokens are the highest logits, and all but the last lack 0.9 of the mass
          std::vector<std::pair<float, int64_t>> order;
          for (int64_t i = 0; i < h; ++i) order.emplace_back(X[r * h + i], i);
          std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
          double m = -INFINITY, sum = 0.0, before = 0.0;
          for (int64_t i = 0; i < h; ++i) m = std::max(m, X[r * h + i] / 0.7);
          for (int64_t i = 0; i < h; ++i) sum += std::exp(X[r * h + i] / 0.7 - m);
          int64_t want = 0;
          while (before < 0.9 - 1e-6) before += std::exp(order[want++].first / 0.7 - m) / sum;
          for (int64_t j = 0; j < h; ++j) kept = kept && ((row[order[j].second] > 0.0f) == (j < want));
        }
      }
      check(sums, what + ": each row sums to 1 and draws a kept token");
      check(kept, what + ": top-k, top-p and min-p keep what they should");
    }
    std::vector<float> back(count);
    std::vector<uint16_t> narrow(count);
    if (bf16) {
      k.rowwise(3, 1, Ah.data(), nullptr, back.data(), 1, count);
      check(back == A, isa + " bf16 -> f32 conversion exact");
    } else {
      for (size_t i = 0; i < A.size(); ++i) A[i] += 1e-3f * normal(rng);  // bits below bfloat16's
      k.rowwise(3, 0, A.data(), nullptr, narrow.data(), 1, count);
      bool same = true;
      for (int64_t i = 0; i < count; ++i) same = same && narrow[i] == torch_bf16(A[i]);
      check(same, isa + " f32 -> bf16 conversion rounds as torch");
    }
  }
}

// attention.h: each chain row equals that row computed alone, a chain given as a tree is the
// chain, each tree row equals the chain row of its history, and all of it has the portable bits;
// for float32 and bfloat16 caches, and heads a KV head of 6 (Qwen2.5's) and 7 (every round size)
void test_attention(const Kernels& k, const Kernels& ref) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  const std::string isa = k.name;
  struct Shape { int64_t H, Hkv, d; };
  for (const Shape sh : {Shape{12, 2, 128}, Shape{7, 1, 80}})
    for (int half : {0, 1}) {
      const int64_t m = MAX_ROWS, ctx = 37, L = ctx + m + 5, N = sh.H * sh.d;
      const std::string what = isa + " attention " + (half ? "bf16" : "f32") + " H=" + std::to_string(sh.H) + " d=" + std::to_string(sh.d);
      std::vector<float> Q(m * N), Kf(sh.Hkv * L * sh.d), Vf(Kf.size());
      for (auto& v : Q) v = normal(rng);
      for (auto& v : Kf) v = 2.0f * normal(rng);
      for (auto& v : Vf) v = normal(rng);
      std::vector<uint16_t> Kh(Kf.size()), Vh(Vf.size());
      for (size_t i = 0; i < Kf.size(); ++i) Kh[i] = bf16(Kf[i]), Vh[i] = bf16(Vf[i]);
      const void* K = half ? static_cast<const void*>(Kh.data()) : Kf.data();
      const void* V = half ? static_cast<const void*>(Vh.data()) : Vf.data();
      const float scale = 1.0f / std::sqrt(static_cast<float>(sh.d));
      auto chain = [&](const Kernels& kk, const float* q, int64_t rows, int64_t c, const void* kc, const void* vc, float* out) {
        kk.attend(half, q, kc, vc, L, out, rows, sh.H, sh.Hkv, sh.d, c, 0, nullptr, nullptr, scale, 0);
      };
      std::vector<float> full(m * N), part(N), fr(m * N);
      chain(k, Q.data(), m, ctx, K, V, full.data());
      bool alone = true;
      for (int64_t j = 0; j < m; ++j) {
        chain(k, Q.data() + j * N, 1, ctx + j, K, V, part.data());
        alone = alone && std::memcmp(part.data(), full.data() + j * N, sizeof(float) * N) == 0;
      }
      check(alone, what + ": each chain row as alone");
      chain(ref, Q.data(), m, ctx, K, V, fr.data());
      check(full == fr, what + ": chain equals portable");

      // a tree over the context: node j's parent (-1: none), its path root first
      const int64_t parents[MAX_ROWS] = {-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 0, 10, 11, 4, 13, 8, 15, 2, 17};
      std::vector<int64_t> start = {0}, path;
      for (int64_t j = 0; j < m; ++j) {
        std::vector<int64_t> p;
        for (int64_t a = j; a >= 0; a = parents[a]) p.insert(p.begin(), a);
        path.insert(path.end(), p.begin(), p.end());
        start.push_back(static_cast<int64_t>(path.size()));
      }
      std::vector<float> tree(m * N), tr(m * N);
      k.attend(half, Q.data(), K, V, L, tree.data(), m, sh.H, sh.Hkv, sh.d, ctx, 0, start.data(), path.data(), scale, 0);
      ref.attend(half, Q.data(), K, V, L, tr.data(), m, sh.H, sh.Hkv, sh.d, ctx, 0, start.data(), path.data(), scale, 0);
      check(tree == tr, what + ": tree equals portable");
      bool as_chain = true;  // node j's row: the last row of the chain over the context and its path
      for (int64_t j = 0; j < m; ++j) {
        std::vector<float> Kc = Kf, Vc = Vf;
        std::vector<uint16_t> Khc = Kh, Vhc = Vh;
        const int64_t n = start[j + 1] - start[j];
        for (int64_t h = 0; h < sh.Hkv; ++h)
          for (int64_t i = 0; i < n; ++i) {
            const int64_t from = (h * L + ctx + path[start[j] + i]) * sh.d, to = (h * L + ctx + i) * sh.d;
            std::memcpy(&Kc[to], &Kf[from], sizeof(float) * sh.d), std::memcpy(&Vc[to], &Vf[from], sizeof(float) * sh.d);
            std::memcpy(&Khc[to], &Kh[from], 2 * sh.d), std::memcpy(&Vhc[to], &Vh[from], 2 * sh.d);
          }
        const void* kc = half ? static_cast<const void*>(Khc.data()) : Kc.data();
        const void* vc = half ? static_cast<const void*>(Vhc.data()) : Vc.data();
        chain(k, Q.data() + j * N, 1, ctx + n - 1, kc, vc, part.data());
        as_chain = as_chain && std::memcmp(part.data(), tree.data() + j * N, sizeof(float) * N) == 0;
      }
      check(as_chain, what + ": each tree row equals the chain row of its history");

      // a sliding window of W positions (Mistral's, Gemma 3's local layers): each chain row is the
      // row over its last W keys alone, unwindowed (the keys start later, nothing else changes);
      // chain and tree have the portable bits
      const int64_t W = 9;
      std::vector<float> win(m * N), winr(m * N), slice(N);
      k.attend(half, Q.data(), K, V, L, win.data(), m, sh.H, sh.Hkv, sh.d, ctx, 0, nullptr, nullptr, scale, W);
      ref.attend(half, Q.data(), K, V, L, winr.data(), m, sh.H, sh.Hkv, sh.d, ctx, 0, nullptr, nullptr, scale, W);
      check(win == winr, what + ": windowed chain equals portable");
      bool sliced = true;
      for (int64_t j = 0; j < m; ++j) {
        const int64_t first = ctx + j + 1 - W;  // keys first .. ctx + j
        const void* kc = half ? static_cast<const void*>(Kh.data() + first * sh.d) : Kf.data() + first * sh.d;
        const void* vc = half ? static_cast<const void*>(Vh.data() + first * sh.d) : Vf.data() + first * sh.d;
        chain(k, Q.data() + j * N, 1, W - 1, kc, vc, slice.data());
        sliced = sliced && std::memcmp(slice.data(), win.data() + j * N, sizeof(float) * N) == 0;
      }
      check(sliced, what + ": each windowed row is the row over its last W keys");
      check(win != full, what + ": the window drops keys");
      k.attend(half, Q.data(), K, V, L, tree.data(), m, sh.H, sh.Hkv, sh.d, ctx, 0, start.data(), path.data(), scale, W);
      ref.attend(half, Q.data(), K, V, L, tr.data(), m, sh.H, sh.Hkv, sh.d, ctx, 0, start.data(), path.data(), scale, W);
      check(tree == tr, what + ": windowed tree equals portable");
    }
}
}  // namespace

int main(int argc, char** argv) {
  // argv: the ISAs to test (they must run on this CPU: the caller chose them), portable by default
  const Kernels ref = QD_TABLE(portable);
  std::vector<Kernels> all = {ref};
#if defined(__x86_64__)
  all.push_back(QD_TABLE(avx2));
  all.push_back(QD_TABLE(avx2_vnni));
  all.push_back(QD_TABLE(avx512));
#elif defined(__aarch64__)
  all.push_back(QD_TABLE(neon));
#endif
  for (int a = 1; a < argc; ++a) {
    std::string name = argv[a], variant;
    if (const auto dash = name.find('+'); dash != std::string::npos) variant = name.substr(dash + 1), name = name.substr(0, dash);
    for (const Kernels& k : all)
      if (name == k.name) {
        test_isa(k, ref, variant != "bf16");  // "avx512+bf16": vdpbf16ps rounds its own way
        test_exp(k, ref);
        test_attention(k, ref);
        test_rowwise(k, ref);
      }
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
