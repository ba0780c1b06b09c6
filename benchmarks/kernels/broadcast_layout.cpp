// A prototype, not part of the package: the "lanes = weight rows" layout for a 4-bit block format
// (one float16 scale per 32 weights and row, no min), timed against rows of x. Each 64-byte
// vector holds 4 weights of each of 16 weight rows, x is broadcast from 4 bytes into vpdpbusd,
// and each output lane sums its blocks in k order (so it stays batch invariant); the 16 outputs
// of a tile are stored without a horizontal sum. README ("What bounds a pass of several rows")
// quotes it beside quickdraft's blocks.cpp kernel.
//
//   g++ -O3 -std=c++20 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mf16c \
//       -o /tmp/broadcast_layout benchmarks/kernels/broadcast_layout.cpp
//   /tmp/broadcast_layout          # weights hot in cache: arithmetic and loads only
//   /tmp/broadcast_layout stream   # each call on the next copy of 256 MB: from memory
//
// One thread; figures are ns per 512 weights of one weight row (blocks.cpp's group of 16 blocks).
// lanes = 16 weight rows, x broadcast: a 4-bit format with a float scale per 32-weight block and row
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <vector>
#include <algorithm>
// record per (tile of 16 rows, block b): 4 vectors of nibbles (step s low, s+4 high), then 16 float16 scales
constexpr int REC = 4 * 64 + 32;
template <int MB>
inline void tile16(const uint8_t* W, int64_t nblocks, const int8_t* xq, int64_t K, const float* xs, const int32_t* init, float* out, int64_t N, int64_t n0) {
  __m512 f[MB];
  for (int j = 0; j < MB; ++j) f[j] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* rec = W + b * REC;
    _mm_prefetch((const char*)rec + 4096, _MM_HINT_T0);
    _mm_prefetch((const char*)rec + 4096 + 64, _MM_HINT_T0);
    _mm_prefetch((const char*)rec + 4096 + 128, _MM_HINT_T0);
    _mm_prefetch((const char*)rec + 4096 + 192, _MM_HINT_T0);
    _mm_prefetch((const char*)rec + 4096 + 256, _MM_HINT_T0);
    __m512i acc[MB];
    for (int j = 0; j < MB; ++j) acc[j] = _mm512_set1_epi32(init[j * nblocks + b]);
    for (int v = 0; v < 4; ++v) {
      const __m512i packed = _mm512_loadu_si512(rec + 64 * v);
      const __m512i w0 = _mm512_and_si512(packed, low), w1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      for (int j = 0; j < MB; ++j) {
        const int32_t* xb = reinterpret_cast<const int32_t*>(xq + j * K + b * 32);
        acc[j] = _mm512_dpbusd_epi32(acc[j], w0, _mm512_set1_epi32(xb[v]));
        acc[j] = _mm512_dpbusd_epi32(acc[j], w1, _mm512_set1_epi32(xb[v + 4]));
      }
    }
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)));
    for (int j = 0; j < MB; ++j)
      f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j]), _mm512_mul_ps(ws, _mm512_set1_ps(xs[j * nblocks + b])), f[j]);
  }
  for (int j = 0; j < MB; ++j) _mm512_storeu_ps(out + j * N + n0, f[j]);
}
template <int MB>
double bench(int64_t N, int64_t K, int reps, bool stream) {
  const int64_t nb = K / 32, tile_bytes = nb * REC;
  const int64_t copies = stream ? std::max<int64_t>(2, (256 << 20) / (N / 16 * tile_bytes)) : 1;
  std::vector<uint8_t> W(copies * N / 16 * tile_bytes + 8192);
  for (size_t i = 0; i < W.size(); ++i) W[i] = (i * 2654435761u) >> 13;
  for (int64_t c = 0; c < copies * N / 16 * nb; ++c) for (int l = 0; l < 16; ++l) reinterpret_cast<uint16_t*>(&W[c * REC + 256])[l] = 0x2000;
  std::vector<int8_t> q(MB * K + 64); for (auto& v : q) v = rand();
  std::vector<float> xs(MB * nb, 0.01f); std::vector<int32_t> init(MB * nb, 0);
  std::vector<float> out(MB * N);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const uint8_t* base = W.data() + (r % copies) * (N / 16 * tile_bytes);
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t t = 0; t < N / 16; ++t) tile16<MB>(base + t * tile_bytes, nb, q.data(), K, xs.data(), init.data(), out.data(), N, t * 16);
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count());
  }
  volatile float s = out[5]; (void)s;
  return best / (N * (K / 512.0));  // ns per 512 weights of one weight row (the old kernel's group)
}
int main(int argc, char** argv) {
  const bool stream = argc > 1;
  const int64_t N = 1536, K = 1536;
  printf("bcast4 %s N=%ld K=%ld ns per 512 weights of a row: 1:%.2f 2:%.2f 4:%.2f 5:%.2f 8:%.2f\n", stream ? "stream" : "hot", N, K,
         bench<1>(N, K, 30, stream), bench<2>(N, K, 30, stream), bench<4>(N, K, 30, stream), bench<5>(N, K, 30, stream), bench<8>(N, K, 30, stream));
}
