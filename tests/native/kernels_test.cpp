// The kernels' cores on one machine's instruction sets, without Python or torch (so that the ARM64
// ones run under qemu-user on an x86 machine): each ISA's kernels give a row the same bits
// whatever else is in the pass (1..MAX_ROWS rows), and the bits of the portable reference where
// simd.h promises them (float32, int8 and GGUF-block linears; bfloat16 except on AVX512-BF16).
// Built and run by tests/models/test_native_kernels.py; prints one line per check, and
// "N passed, N failed" last.
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
  extern "C" int64_t p##_tile_bytes(int, int64_t);

#define QD_TABLE(p) Kernels{#p, p##_linear_f32, p##_linear_bf16, p##_linear_w8, p##_linear_blocks, p##_sanitize, p##_tile_bytes}

QD_DECLARE(portable)
#if defined(__x86_64__)
QD_DECLARE(avx2)
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

}  // namespace

int main(int argc, char** argv) {
  // argv: the ISAs to test (they must run on this CPU: the caller chose them), portable by default
  const Kernels ref = QD_TABLE(portable);
  std::vector<Kernels> all = {ref};
#if defined(__x86_64__)
  all.push_back(QD_TABLE(avx2));
  all.push_back(QD_TABLE(avx512));
#elif defined(__aarch64__)
  all.push_back(QD_TABLE(neon));
#endif
  for (int a = 1; a < argc; ++a) {
    std::string name = argv[a], variant;
    if (const auto dash = name.find('+'); dash != std::string::npos) variant = name.substr(dash + 1), name = name.substr(0, dash);
    for (const Kernels& k : all)
      if (name == k.name) test_isa(k, ref, variant != "bf16");  // "avx512+bf16": vdpbf16ps rounds its own way
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
