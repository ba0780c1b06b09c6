// The verifier's and the sampler's rows, on logits: each row's argmax and finiteness in one read,
// a row shaped into probabilities (temperature, top-k, top-p, min-p), a draw from a row, and
// speculative sampling's rule over a batch of draft chains (verify/rejection.py), in one call
// each. Each row's result depends on that row alone, in a fixed order (batch invariant); the row
// helpers are rowwise.h's, shared with the layer's row operations (rows.cpp).
#include <torch/extension.h>

#include <cstring>
#include <omp.h>

#include "rowwise.h"

// each row's argmax of x [M, V] (float32 or bfloat16, as sampling.argmax_rows: the lowest index on
// ties, the first NaN) and whether the row is finite, from one read of the row (rowwise.h's
// argmax_row): the verifier's greedy walk and its check of the logits (engine/runner.py), where
// numpy's argmax and sum read a 151,936-logit row twice (~0.13 ms each on an AMD EPYC Zen 1, the
// row fresh from the output head and larger than a core's L2). Rows over the threads.
std::tuple<torch::Tensor, torch::Tensor> argmax_finite(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0, "x [M, V] contiguous, V > 0");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
  const int64_t M = x.size(0), V = x.size(1);
  auto index = torch::empty({M}, x.options().dtype(torch::kInt64));
  auto finite = torch::empty({M}, x.options().dtype(torch::kBool));
  int64_t* out = index.data_ptr<int64_t>();
  bool* ok = finite.data_ptr<bool>();
  const bool f32 = x.scalar_type() == torch::kFloat32;
  const void* base = x.data_ptr();
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t r = 0; r < M; ++r) {
    out[r] = f32 ? qd::argmax_row(static_cast<const float*>(base) + r * V, V, ok + r)
                 : qd::argmax_row(static_cast<const uint16_t*>(base) + r * V, V, ok + r);
  }
  return {index, finite};
}

// q [M, N] float32: each row of logits [M, N] shaped at its temperature [M] (float32; 0: a greedy
// row, one-hot at its argmax) and, where given, its top_k [M] int64, top_p [M] float32 and min_p
// [M] float32 (rowwise.h's shaped_row, as the draft's native chains compute it):
// sampling.logits_to_probs on the CPU.
torch::Tensor softmax_rows(torch::Tensor logits, torch::Tensor temperature, c10::optional<torch::Tensor> top_k,
                           c10::optional<torch::Tensor> top_p, c10::optional<torch::Tensor> min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0, "logits [M, N] contiguous, N > 0");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16, "float32 or bfloat16 logits");
  const int64_t M = logits.size(0), N = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && temperature.dim() == 1 && temperature.size(0) == M, "temperature [M] float32");
  const torch::Tensor t = temperature.contiguous();
  const float* tp = t.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) TORCH_CHECK(tp[r] >= 0.0f && std::isfinite(tp[r]), "temperature ", tp[r], " of row ", r);
  const auto per_row = [&](const c10::optional<torch::Tensor>& v, c10::ScalarType type, const char* what) {
    if (!v.has_value()) return torch::Tensor();
    TORCH_CHECK(v->scalar_type() == type && v->dim() == 1 && v->size(0) == M, what, " [M] of ", type);
    return v->contiguous();
  };
  const torch::Tensor ks = per_row(top_k, torch::kInt64, "top_k"), ps = per_row(top_p, torch::kFloat32, "top_p"),
                      mins = per_row(min_p, torch::kFloat32, "min_p");
  std::vector<qd::Filters> filters(M);
  for (int64_t r = 0; r < M; ++r) {
    if (ks.defined()) filters[r].top_k = ks.data_ptr<int64_t>()[r];
    if (ps.defined()) filters[r].top_p = ps.data_ptr<float>()[r];
    if (mins.defined()) filters[r].min_p = mins.data_ptr<float>()[r];
  }
  auto q = torch::empty({M, N}, logits.options().dtype(torch::kFloat32));
  float* qp = q.data_ptr<float>();
  const bool f32 = logits.scalar_type() == torch::kFloat32;
  const void* base = logits.data_ptr();
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t r = 0; r < M; ++r) {
    const auto shape = [&](const auto* x) {
      if (tp[r] == 0.0f) {
        std::memset(qp + r * N, 0, sizeof(float) * N);
        qp[r * N + qd::argmax_row(x + r * N, N)] = 1.0f;
      } else {
        qd::shaped_row(x + r * N, N, tp[r], filters[r], qp + r * N);
      }
    };
    f32 ? shape(static_cast<const float*>(base)) : shape(static_cast<const uint16_t*>(base));
  }
  return q;
}

// rows [M] int64 drawn from probs [M, N] float32 (>= 0, each row some mass, not necessarily
// normalized) with uniforms [M] float64: rowwise.h's sample_row, sampling.sample_from_probs's rule
// with the cumulative mass summed by blocks.
torch::Tensor sample_probs(torch::Tensor probs, torch::Tensor uniforms) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat32 && probs.size(1) > 0, "probs [M, N] float32, N > 0");
  const int64_t M = probs.size(0), N = probs.size(1);
  TORCH_CHECK(uniforms.scalar_type() == torch::kFloat64 && uniforms.dim() == 1 && uniforms.size(0) == M, "uniforms [M] float64");
  const torch::Tensor p = probs.contiguous(), u = uniforms.contiguous();
  auto rows = torch::empty({M}, torch::kInt64);
  int64_t* out = rows.data_ptr<int64_t>();
  const float* pp = p.data_ptr<float>();
  const double* up = u.data_ptr<double>();
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t r = 0; r < M; ++r) out[r] = qd::sample_row(pp + r * N, N, up[r]);
  return rows;
}

// Speculative sampling's rule for a batch of draft chains (verify/rejection.py: what _sampled_step
// and _greedy_step give, token for token), a sequence at a time, each target row shaped only
// when it may be read: row j of a sequence becomes p_j (softmax_rows' shaping) only if its
// drafts before j were accepted, or beside row j - 1 on a second thread (verify_one, below), so a
// chain rejected early shapes one or two rows, not K + 1.
//   logits [R, V] float32 or bfloat16, sequence b's K_b + 1 rows after the ones before it;
//   q [D, V] float32, the draft's distributions (None: point masses, q(x) = 1), or [D, Q] over a
//   truncated head's rows with q_columns (below); drafts [D] int64;
//   num_draft [B] the K_b; temperature, top_k, top_p, min_p [B]; uniforms [R] float64, laid out
//   like the rows (K_b coins, then the final draw's).
// A sampled sequence accepts x_j while u_j < p_j(x_j) / q_j(x_j) (in float64), then draws its last
// token from max(0, p_n - q_n) at a rejection (p_n itself if rounding left that empty) or from
// p_K after a full accept, with rowwise.h's sample_row; a greedy one (temperature 0) accepts
// while x_j is the row's argmax and ends with the argmax. -> (num_accepted [B], final [B]) int64
std::tuple<torch::Tensor, torch::Tensor> verify_chains(torch::Tensor logits, c10::optional<torch::Tensor> q,
                                                       torch::Tensor drafts, std::vector<int64_t> num_draft,
                                                       torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                                                       torch::Tensor min_p, torch::Tensor uniforms,
                                                       c10::optional<torch::Tensor> q_columns) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0, "logits [R, V] contiguous");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16, "float32 or bfloat16 logits");
  const int64_t R = logits.size(0), V = logits.size(1), B = static_cast<int64_t>(num_draft.size());
  int64_t D = 0;
  for (const int64_t k : num_draft) {
    TORCH_CHECK(k >= 0, "a negative number of drafts");
    D += k;
  }
  TORCH_CHECK(R == D + B, "logits has ", R, " rows, the drafts need ", D + B);
  TORCH_CHECK(drafts.scalar_type() == torch::kInt64 && drafts.dim() == 1 && drafts.size(0) == D && drafts.is_contiguous(), "drafts [D] int64");
  // q [D, Q]: over the vocabulary (Q = V), or with q_columns [V] over some ids alone (a draft's
  // truncated head: q is 0 elsewhere), q_columns[v] being v's column of q or -1, so that the
  // draft's rows need not be spread over V first. The columns are sampling.head_columns's, read
  // as given: a value past Q - 1 reads column Q - 1 and a negative one q = 0, never outside q (a
  // pass over V to check them took as long as verifying a row)
  const float* qp = nullptr;
  const int32_t* columns = nullptr;
  int64_t Q = V;
  if (q_columns.has_value()) {
    TORCH_CHECK(q.has_value() && q->dim() == 2, "q_columns without q [D, Q]");
    TORCH_CHECK(q_columns->scalar_type() == torch::kInt32 && q_columns->dim() == 1 && q_columns->size(0) == V &&
                    q_columns->is_contiguous(),
                "q_columns [", V, "] int32");
    Q = q->size(1);
    TORCH_CHECK(Q > 0, "q has no columns");
    columns = q_columns->data_ptr<int32_t>();
  }
  const int32_t last = static_cast<int32_t>(Q - 1);
  const auto column = [&](int64_t v) -> int64_t { return columns ? std::min(columns[v], last) : v; };  // < 0: q is 0
  if (q.has_value()) {
    TORCH_CHECK(q->scalar_type() == torch::kFloat32 && q->is_contiguous() && q->dim() == 2 && q->size(0) == D && q->size(1) == Q,
                "q [D, ", Q, "] float32 contiguous");
    qp = q->data_ptr<float>();
  }
  const auto q_at = [&](int64_t draft, int64_t token) -> double {  // q of `token` in draft row `draft`
    if (qp == nullptr) return 1.0;
    const int64_t c = column(token);
    return c < 0 ? 0.0 : static_cast<double>(qp[draft * Q + c]);
  };
  const auto per_sequence = [&](const torch::Tensor& t, c10::ScalarType type, const char* what) {
    TORCH_CHECK(t.scalar_type() == type && t.dim() == 1 && t.size(0) == B && t.is_contiguous(), what, " [B] of ", type);
  };
  per_sequence(temperature, torch::kFloat32, "temperature");
  per_sequence(top_k, torch::kInt64, "top_k");
  per_sequence(top_p, torch::kFloat32, "top_p");
  per_sequence(min_p, torch::kFloat32, "min_p");
  TORCH_CHECK(uniforms.scalar_type() == torch::kFloat64 && uniforms.dim() == 1 && uniforms.size(0) == R && uniforms.is_contiguous(),
              "uniforms [R] float64");
  const int64_t* x = drafts.data_ptr<int64_t>();
  for (int64_t i = 0; i < D; ++i) TORCH_CHECK(x[i] >= 0 && x[i] < V, "draft token ", x[i], " is outside the ", V, " rows");
  const float* tp = temperature.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(tp[b] >= 0.0f && std::isfinite(tp[b]), "temperature ", tp[b]);
  std::vector<int64_t> row0(B), draft0(B);
  for (int64_t b = 0, r = 0, d = 0; b < B; ++b) row0[b] = r, draft0[b] = d, r += num_draft[b] + 1, d += num_draft[b];
  auto accepted = torch::empty({B}, torch::kInt64), final = torch::empty({B}, torch::kInt64);
  int64_t *acc = accepted.data_ptr<int64_t>(), *fin = final.data_ptr<int64_t>();
  const double* u = uniforms.data_ptr<double>();
  const bool f32 = logits.scalar_type() == torch::kFloat32;
  const void* base = logits.data_ptr();
  // One sequence's chain. Its rows are prepared (shaped, or for a temperature alone their e values
  // and sum) `width` at a time: one, or two at once on two threads where one sequence is verified
  // and two threads are there, so that the row after a draft is ready when that draft is accepted
  // (its work is lost only where the draft is rejected, on a thread that would have waited). Each
  // row's values are computed as on one thread, so the tokens are the same either way.
  const auto verify_one = [&](int64_t b, int width) {
    thread_local std::vector<float> buffers[2], residual;
    const auto run = [&](const auto* rows) {
      const auto row = [&](int64_t j) { return rows + (row0[b] + j) * V; };
      const int64_t K = num_draft[b];
      int64_t n = 0;
      if (tp[b] == 0.0f) {
        while (n < K && qd::argmax_row(row(n), V) == x[draft0[b] + n]) ++n;
        acc[b] = n, fin[b] = qd::argmax_row(row(n), V);
        return;
      }
      qd::Filters f;
      f.top_k = top_k.data_ptr<int64_t>()[b], f.top_p = top_p.data_ptr<float>()[b], f.min_p = min_p.data_ptr<float>()[b];
      // a row with a temperature alone is tested on its e values: p(x) is e(x) over their sum, the
      // bits of softmax_row's division, and only a row that rejects (or the bonus row) is divided
      // whole; a filtered row is shaped whole (shaped_row) and its sum left at 1
      const bool filtered = f.any(V);
      float* p[2];
      float total[2] = {1.0f, 1.0f};
      for (int j = 0; j < width; ++j) buffers[j].resize(V), p[j] = buffers[j].data();
      const double coin = u[row0[b] + K];
      for (;;) {
        const int64_t now = std::min<int64_t>(width, K + 1 - n);  // rows n.., row K being the bonus token's
#pragma omp parallel for num_threads(2) schedule(static, 1) if (now > 1)
        for (int64_t j = 0; j < now; ++j) {
          if (filtered) {
            qd::shaped_row(row(n + j), V, tp[b], f, p[j]);
          } else {
            total[j] = qd::softmax_exps(row(n + j), V, tp[b], p[j]);
          }
        }
        for (int64_t j = 0; j < now; ++j, ++n) {
          float* pn = p[j];
          const bool bonus = n == K;  // every draft accepted: the bonus token, from p_K
          const int64_t token = bonus ? 0 : x[draft0[b] + n];
          if (!bonus && u[row0[b] + n] < static_cast<double>(filtered ? pn[token] : pn[token] / total[j]) / q_at(draft0[b] + n, token))
            continue;  // accepted
          if (!filtered) qd::divide_row(pn, V, total[j]);
          acc[b] = n;
          if (bonus) {
            fin[b] = qd::sample_row(pn, V, coin);
            return;
          }
          residual.resize(V);  // max(0, p_n - q_n), q_n a point mass at x_n where no q is given
          const float* qrow = qp ? qp + (draft0[b] + n) * Q : nullptr;
          if (columns == nullptr) {
            for (int64_t v = 0; v < V; ++v) {
              const float qv = qrow ? qrow[v] : (v == token ? 1.0f : 0.0f);
              residual[v] = std::max(pn[v] - qv, 0.0f);
            }
          } else {  // q_v is column c's, or +0 where c is -1: masked bits, not a branch (the head's ids
            // fall anywhere in the vocabulary, and a branch on them took 0.7 ms a row, mispredicted)
            for (int64_t v = 0; v < V; ++v) {
              const int32_t c = std::min(columns[v], last);
              uint32_t bits;
              std::memcpy(&bits, qrow + (c & ~(c >> 31)), sizeof bits);  // column 0 where c is -1
              bits &= static_cast<uint32_t>(~(c >> 31));
              float qv;
              std::memcpy(&qv, &bits, sizeof qv);
              residual[v] = std::max(pn[v] - qv, 0.0f);
            }
          }
          bool mass = false;
          for (int64_t v = 0; v < V && !mass; ++v) mass = residual[v] > 0.0f;
          fin[b] = qd::sample_row(mass ? residual.data() : pn, V, coin);
          return;
        }
      }
    };
    f32 ? run(static_cast<const float*>(base)) : run(static_cast<const uint16_t*>(base));
  };
  if (B == 1) {
    verify_one(0, omp_get_max_threads() > 1 ? 2 : 1);
  } else {
#pragma omp parallel for schedule(dynamic)
    for (int64_t b = 0; b < B; ++b) verify_one(b, 1);
  }
  return {accepted, final};
}
