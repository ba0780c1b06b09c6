// Build and run from the repository's root (AVX-512 path; 2 threads, spinning waits):
//   g++ -O3 -ffp-contract=off -std=c++17 -fopenmp -DQD_ISA_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512dq \
//       -mavx512vnni -mfma -mf16c -mavx512bf16 -Iquickdraft/models/kernels docs/benchmarks/archive/native-pass-one-run-intel/scripts/attention_alone.cpp -o /tmp/attention_alone
//   OMP_NUM_THREADS=2 GOMP_SPINCOUNT=300000 OMP_WAIT_POLICY=active /tmp/attention_alone LEN SETS TOKENS
// one decoding row of Qwen2.5-1.5B's attention (12 heads, 2 KV heads, d 128, bf16 cache) over LEN keys,
// 28 layers a "token"; SETS copies of the 28 layers' caches rotated so that a token's keys are cold
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <algorithm>
#include "attention.h"
using namespace std::chrono;
int main(int argc, char** argv) {
  const int64_t LEN = atoi(argv[1]), SETS = atoi(argv[2]), TOKENS = atoi(argv[3]);
  const int64_t H = 12, Hkv = 2, d = 128, L = 28, CAP = LEN + 16;
  const int64_t per_layer = Hkv * CAP * d;
  std::vector<uint16_t> kv(SETS * L * 2 * per_layer);
  std::mt19937 g(1);
  for (auto& v : kv) v = simd::to_bf16(std::normal_distribution<float>(0, 1)(g));
  std::vector<float> q(H * d), out(H * d);
  for (auto& v : q) v = std::normal_distribution<float>(0, 1)(g);
  std::vector<double> times;
  for (int64_t t = 0; t < TOKENS; ++t) {
    const int64_t set = t % SETS;
    auto t0 = steady_clock::now();
    for (int64_t l = 0; l < L; ++l) {
      const uint16_t* K = kv.data() + ((set * L + l) * 2) * per_layer;
      const uint16_t* V = K + per_layer;
      qd::attend_chain(q.data(), K, V, CAP * d, d, out.data(), 1, H, Hkv, d, LEN - 1, 0.088f);
    }
    times.push_back(duration<double>(steady_clock::now() - t0).count() * 1e3);
  }
  std::sort(times.begin() + 0, times.end());
  const double bytes = 2.0 * L * Hkv * LEN * d * 2;
  printf("len %ld sets %ld: median %.2f ms a token (%.1f MB of keys and values: %.1f GB/s), min %.2f\n", LEN, SETS,
         times[times.size() / 2], bytes / 1e6, bytes / 1e6 / times[times.size() / 2], times[0]);
  double s = 0; for (float v : out) s += v; printf("check %f\n", s);
}
