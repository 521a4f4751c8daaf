// Compiled CPU kernels of bidirectional hybrid attention with a polynomial far field
// (performer_hf.favor_hybrid, loaded by performer_hf.cpu_kernels):
// - hybrid_support_sums: for each query i and every key j of its support E(i) (local window, global
//   tokens, routed key blocks), one pass computes the exact logit, the kernel value that the far-field
//   state already counted, and their difference applied to the values: what favor_hybrid._hybrid_sums
//   computes, without (queries x candidates) temporaries; candidates are packed once per query block.
//   hybrid_support_sums_backward recomputes those per block and returns the inputs' gradients.
// - quadratic_far_state / quadratic_far_apply: the far field's state over all keys and its sums for
//   every query, on symmetric polynomial features built in registers, never stored.
// - top_blocks: the routing's top-k over key blocks; routed_candidates: the same over the blocks of chosen groups.
// Every function checks only what the Python side cannot get wrong cheaply; favor_hybrid validates inputs.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// exp for float, written so that the compiler vectorises loops that call it (std::exp is not);
// relative error about 2e-7 (Cephes' polynomial on [-ln 2 / 2, ln 2 / 2]); 0 below -87.
inline float exp_approx(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.0f);
  const float k = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = clamped - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

inline double exp_approx(double x) { return std::exp(x); }

template <typename T>
struct Inputs {
  const T* x;         // (B, H, L, d) scaled queries
  const T* rq;        // (B, H, L) x_i . c (query centering log-weight)
  const T* far_sum;   // (B, H, L, D1) kernel sums over all keys, relative to exp(rq_i + key_shift)
  const T* key_shift; // (B, H)
  const T* y_t;       // (B, H, d, L) scaled keys, transposed
  const T* values1;   // (B, H, L, D1) [v, 1], zero for padded keys
  const T* klog;      // (B, H, L) key centering log-weights (any value for padded keys)
  const bool* mask;   // (B, L) real keys
  const int64_t* routed;  // (B, H, N, R) routed key blocks of each query block, -1 for none
  T* out;             // (B, H, L, D1) numerator | mass relative to a per-query shift
  int64_t B, H, L, d, D1, N, R;
  int64_t left, right, num_global, block_q, block_k;
  T quadratic;
};

// Register tiles: kQueries queries against kLanes candidates (logits), or against a packed value row.
constexpr int64_t kQueries = 4;
constexpr int64_t kLanes = 16;

inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// logits (kQueries, Cp) = queries (kQueries, d) @ keys_t (d, Cp), Cp a multiple of kLanes
template <typename T>
void tile_logits(const T* queries, int64_t d, const T* keys_t, int64_t Cp, T* logits) {
  for (int64_t c0 = 0; c0 < Cp; c0 += kLanes) {
    T acc[kQueries][kLanes] = {};
    for (int64_t e = 0; e < d; ++e) {
      const T* row = keys_t + e * Cp + c0;
      for (int64_t q = 0; q < kQueries; ++q) {
        const T x = queries[q * d + e];
#pragma omp simd
        for (int64_t k = 0; k < kLanes; ++k) acc[q][k] += x * row[k];
      }
    }
    for (int64_t q = 0; q < kQueries; ++q) std::memcpy(logits + q * Cp + c0, acc[q], kLanes * sizeof(T));
  }
}

// sums (kQueries, W) = weights (kQueries, Cp) @ values (Cp, W)
template <typename T, int64_t W>
void tile_values(const T* weights, int64_t Cp, const T* values, T* sums) {
  T acc[kQueries][W] = {};
  for (int64_t c = 0; c < Cp; ++c) {
    const T* row = values + c * W;
    for (int64_t q = 0; q < kQueries; ++q) {
      const T w = weights[q * Cp + c];
#pragma omp simd
      for (int64_t k = 0; k < W; ++k) acc[q][k] += w * row[k];
    }
  }
  std::memcpy(sums, acc, sizeof(acc));
}

// A run of consecutive candidate keys [start, stop) of one kind (see Workspace::windowed).
struct Run {
  int64_t start, stop;
  int kind;
};

// Scratch buffers of one thread, reused across query blocks.
template <typename T>
struct Workspace {
  std::vector<Run> runs;
  std::vector<T> position;  // (Cp,) candidate key positions
  std::vector<T> windowed;  // (Cp,) 1: window key (in E(i) inside i's window); 0: global or routed key (in E(i)
                            // outside it); -1: never (padded key, routed global key, tile padding)
  std::vector<T> keys_t;    // (d, Cp) packed keys, transposed
  std::vector<T> values;    // (Cp, W) packed values, zero-padded to the tile width
  std::vector<T> klog, kexp;  // (Cp,) key log-weights and exp(klog - key_shift); 0 where never in E(i)
  std::vector<T> queries;   // (kQueries, d)
  std::vector<T> logits, active, weights;  // (kQueries, Cp)
  std::vector<T> sums;      // (kQueries, W)
  // backward only
  std::vector<T> t, pair, exact, d_weights, d_logits;  // (kQueries, Cp)
  std::vector<T> grad;             // (kQueries, D1) the output gradients of a query tile
  std::vector<T> values_t;         // (D1, Cp) the packed values, transposed
  std::vector<T> d_keys_t, d_values, d_klog;            // (d, Cp), (Cp, D1), (Cp,): a block's key gradients
};

// Packs query block n's candidates into the workspace: its window span, the global keys and its routed key
// blocks, once for the block's queries. Returns Cp, the candidate count rounded up to the tile width.
template <typename T, int64_t W>
int64_t pack_candidates(const Inputs<T>& in, int64_t bh, int64_t n, Workspace<T>& ws) {
  const int64_t b = bh / in.H, L = in.L, d = in.d, D1 = in.D1;
  const bool* mask = in.mask + b * L;
  const int64_t q_start = n * in.block_q, q_end = std::min(L, q_start + in.block_q);

  // 1. the block's candidates: its window span, the global keys and its routed key blocks
  ws.runs.clear();
  if (in.right >= 0) ws.runs.push_back({std::max<int64_t>(0, q_start - in.left), std::min(L, q_end + in.right), 1});
  if (in.num_global) ws.runs.push_back({0, std::min(in.num_global, L), 0});
  const int64_t* routed = in.routed + (bh * in.N + n) * in.R;
  for (int64_t r = 0; r < in.R; ++r) {
    if (routed[r] >= 0) ws.runs.push_back({routed[r] * in.block_k, std::min(L, (routed[r] + 1) * in.block_k), 2});
  }
  int64_t C = 0;
  for (const Run& run : ws.runs) C += std::max<int64_t>(0, run.stop - run.start);
  const int64_t Cp = round_up(std::max<int64_t>(C, 1), kLanes);

  // 2. pack them once for the block's queries
  const T key_shift = in.key_shift[bh];
  ws.position.assign(Cp, T(0));
  ws.windowed.assign(Cp, T(-1));
  ws.keys_t.assign(d * Cp, T(0));
  ws.values.assign(Cp * W, T(0));
  ws.klog.assign(Cp, T(0));
  ws.kexp.assign(Cp, T(0));
  ws.queries.resize(kQueries * d);
  for (auto* tile : {&ws.logits, &ws.active, &ws.weights}) tile->resize(kQueries * Cp);
  ws.sums.resize(kQueries * W);
  int64_t c0 = 0;
  for (const Run& run : ws.runs) {
    const int64_t length = std::max<int64_t>(0, run.stop - run.start);
    for (int64_t e = 0; e < d; ++e) {  // keys arrive transposed, (d, L): one copy per feature
      std::memcpy(&ws.keys_t[e * Cp + c0], in.y_t + (bh * d + e) * L + run.start, length * sizeof(T));
    }
    for (int64_t k = 0; k < length; ++k) {
      const int64_t j = run.start + k, c = c0 + k;
      const bool never = !mask[j] || (run.kind == 2 && j < in.num_global);  // routed: global keys are counted once
      ws.position[c] = static_cast<T>(j);
      ws.windowed[c] = never ? T(-1) : static_cast<T>(run.kind == 1);
      std::memcpy(&ws.values[c * W], in.values1 + (bh * L + j) * D1, D1 * sizeof(T));
      ws.klog[c] = never ? T(0) : in.klog[bh * L + j];
      ws.kexp[c] = never ? T(0) : exp_approx(ws.klog[c] - key_shift);
    }
    c0 += length;
  }
  return Cp;
}

// The exact logits of kQueries queries from i0 against the packed candidates, and per query: which candidates
// are in its support (`active`), the far field's weight exp(far_scale - shift) and the shift itself.
template <typename T>
void tile_support(const Inputs<T>& in, int64_t bh, int64_t i0, int64_t count, int64_t Cp, Workspace<T>& ws,
                  T* far_weight, T* shift) {
  std::fill(ws.queries.begin(), ws.queries.end(), T(0));
  std::memcpy(ws.queries.data(), in.x + (bh * in.L + i0) * in.d, count * in.d * sizeof(T));
  tile_logits(ws.queries.data(), in.d, ws.keys_t.data(), Cp, ws.logits.data());
  const T *position = ws.position.data(), *windowed = ws.windowed.data();
  const T left = static_cast<T>(in.left), right = static_cast<T>(in.right);
  constexpr T kLowest = -std::numeric_limits<T>::max();
  for (int64_t q = 0; q < kQueries; ++q) {
    const T* logits = ws.logits.data() + q * Cp;
    T* active = ws.active.data() + q * Cp;
    const T i = static_cast<T>(i0 + q);
    T max_logit = kLowest;
#pragma omp simd reduction(max : max_logit)
    for (int64_t c = 0; c < Cp; ++c) {
      const T gap = i - position[c];
      const T inside = (gap >= -right && gap <= left) ? T(1) : T(0);
      active[c] = inside == windowed[c] ? T(1) : T(0);
      max_logit = std::max(max_logit, active[c] != T(0) ? logits[c] : kLowest);
    }
    const T far_scale = (q < count ? in.rq[bh * in.L + i0 + q] : T(0)) + in.key_shift[bh];
    shift[q] = std::max(far_scale, max_logit);
    far_weight[q] = exp_approx(far_scale - shift[q]);
  }
}

template <typename T, int64_t W>
void query_block(const Inputs<T>& in, int64_t bh, int64_t n, Workspace<T>& ws) {
  const int64_t L = in.L, D1 = in.D1;
  const int64_t q_start = n * in.block_q, q_end = std::min(L, q_start + in.block_q);
  const int64_t Cp = pack_candidates<T, W>(in, bh, n, ws);
  const T *klog = ws.klog.data(), *kexp = ws.kexp.data();

  // kQueries queries at a time: exact logits, shift, exact weights minus the kernel values, sums
  for (int64_t i0 = q_start; i0 < q_end; i0 += kQueries) {
    const int64_t count = std::min(kQueries, q_end - i0);
    T far_weight[kQueries], shift[kQueries], kernel_mass[kQueries] = {};
    tile_support(in, bh, i0, count, Cp, ws, far_weight, shift);
    for (int64_t q = 0; q < kQueries; ++q) {
      const T* logits = ws.logits.data() + q * Cp;
      const T* active = ws.active.data() + q * Cp;
      T* weights = ws.weights.data() + q * Cp;
      const T rq = q < count ? in.rq[bh * L + i0 + q] : T(0);
      T mass = 0;
#pragma omp simd reduction(+ : mass)
      for (int64_t c = 0; c < Cp; ++c) {
        const T t = active[c] * (logits[c] - rq - klog[c]);  // (x_i - a) . (y_j - c)
        const T pair = active[c] * (T(1) + t + in.quadratic * t * t) * kexp[c];
        weights[c] = active[c] * exp_approx(std::min(logits[c] - shift[q], T(0))) - far_weight[q] * pair;
        mass += pair;
      }
      kernel_mass[q] = mass;
    }
    tile_values<T, W>(ws.weights.data(), Cp, ws.values.data(), ws.sums.data());
    for (int64_t q = 0; q < count; ++q) {
      T* out = in.out + (bh * L + i0 + q) * D1;
      const T* far_sum = in.far_sum + (bh * L + i0 + q) * D1;
      const T* sums = ws.sums.data() + q * W;
      for (int64_t e = 0; e < D1 - 1; ++e) out[e] = sums[e] + far_weight[q] * far_sum[e];
      // the far mass (all keys minus the support) cannot be negative
      out[D1 - 1] = sums[D1 - 1] + far_weight[q] * std::max(far_sum[D1 - 1], kernel_mass[q]);
    }
  }
}

// Gradients of hybrid_support_sums (same inputs): what autograd gives for favor_hybrid._support_sums with the
// per-query shift held constant, accumulated per (batch, head) so that no two threads write the same key.
template <typename T>
struct Gradients {
  const T* grad_out;  // (B, H, L, D1)
  T *x, *rq, *far_sum, *y, *values1, *klog;  // like the inputs; y (B, H, L, d) untransposed; zero-initialised
};

template <typename T, int64_t W>
void query_block_backward(const Inputs<T>& in, const Gradients<T>& g, int64_t bh, int64_t n, Workspace<T>& ws) {
  const int64_t L = in.L, d = in.d, D1 = in.D1;
  const int64_t q_start = n * in.block_q, q_end = std::min(L, q_start + in.block_q);
  const int64_t Cp = pack_candidates<T, W>(in, bh, n, ws);
  const T *klog = ws.klog.data(), *kexp = ws.kexp.data(), *values = ws.values.data();
  for (auto* tile : {&ws.t, &ws.pair, &ws.exact, &ws.d_weights, &ws.d_logits}) tile->resize(kQueries * Cp);
  ws.grad.resize(kQueries * D1);
  ws.values_t.resize(D1 * Cp);  // the packed values transposed, (D1, Cp)
  for (int64_t c = 0; c < Cp; ++c) {
    for (int64_t e = 0; e < D1; ++e) ws.values_t[e * Cp + c] = values[c * W + e];
  }
  ws.d_keys_t.assign(d * Cp, T(0));
  ws.d_values.assign(Cp * D1, T(0));
  ws.d_klog.assign(Cp, T(0));
  for (int64_t i0 = q_start; i0 < q_end; i0 += kQueries) {
    const int64_t count = std::min(kQueries, q_end - i0);
    T far_weight[kQueries], shift[kQueries];
    tile_support(in, bh, i0, count, Cp, ws, far_weight, shift);
    std::fill(ws.grad.begin(), ws.grad.end(), T(0));
    std::memcpy(ws.grad.data(), g.grad_out + (bh * L + i0) * D1, count * D1 * sizeof(T));
    // d loss / d weights (kQueries, Cp) = grad (kQueries, D1) @ values^T (D1, Cp)
    tile_logits(ws.grad.data(), D1, ws.values_t.data(), Cp, ws.d_weights.data());
    for (int64_t q = 0; q < count; ++q) {
      const T* logits = ws.logits.data() + q * Cp;
      const T* active = ws.active.data() + q * Cp;
      T *t = ws.t.data() + q * Cp, *pair = ws.pair.data() + q * Cp, *exact = ws.exact.data() + q * Cp;
      T* weights = ws.weights.data() + q * Cp;
      const T* d_weights = ws.d_weights.data() + q * Cp;
      const T* grad = ws.grad.data() + q * D1;
      const T rq = in.rq[bh * L + i0 + q];
      T mass = 0;
#pragma omp simd reduction(+ : mass)
      for (int64_t c = 0; c < Cp; ++c) {  // the forward's weights
        t[c] = active[c] * (logits[c] - rq - klog[c]);
        pair[c] = active[c] * (T(1) + t[c] + in.quadratic * t[c] * t[c]) * kexp[c];
        exact[c] = active[c] * exp_approx(std::min(logits[c] - shift[q], T(0)));
        weights[c] = exact[c] - far_weight[q] * pair[c];
        mass += pair[c];
      }
      // out = sums + far_weight * [far_sum values, max(far mass, kernel mass)]
      const int64_t row = bh * L + i0 + q;
      const T* far_sum = in.far_sum + row * D1;
      const T far_mass = far_sum[D1 - 1], g_mass = grad[D1 - 1];
      // torch.maximum's gradient: all to the larger one, half each on a tie
      const T to_far = far_mass > mass ? T(1) : (far_mass == mass ? T(0.5) : T(0));
      T d_far_weight = g_mass * std::max(far_mass, mass);
      for (int64_t e = 0; e < D1 - 1; ++e) {
        d_far_weight += grad[e] * far_sum[e];
        g.far_sum[row * D1 + e] = far_weight[q] * grad[e];
      }
      g.far_sum[row * D1 + D1 - 1] = far_weight[q] * g_mass * to_far;
      const T d_mass = far_weight[q] * g_mass * (T(1) - to_far);
      // weights = exact - far_weight * pair; pair = active (1 + t + c2 t^2) kexp; t = logit - rq - klog
      T* d_logits = ws.d_logits.data() + q * Cp;
      T* d_klog = ws.d_klog.data();
      T d_rq = 0;
#pragma omp simd reduction(+ : d_far_weight, d_rq)
      for (int64_t c = 0; c < Cp; ++c) {
        d_far_weight -= d_weights[c] * pair[c];
        const T d_pair = d_mass - far_weight[q] * d_weights[c];
        const T d_t = d_pair * active[c] * kexp[c] * (T(1) + T(2) * in.quadratic * t[c]);
        d_logits[c] = d_weights[c] * exact[c] + d_t;
        d_rq -= d_t;
        d_klog[c] += d_pair * pair[c] - d_t;  // pair is proportional to exp(klog)
      }
      g.rq[row] = d_rq + d_far_weight * far_weight[q];  // far_weight = exp(rq + key_shift - shift)
      // d x_i = sum_c d_logits_c y_c
      T* d_x = g.x + row * d;
      for (int64_t e = 0; e < d; ++e) {
        const T* keys = ws.keys_t.data() + e * Cp;
        T dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < Cp; ++c) dot += d_logits[c] * keys[c];
        d_x[e] = dot;
      }
    }
    // the candidates' gradients from this tile: d values_c += sum_q weights_qc grad_q; d y_c += sum_q d_logits_qc x_q
    for (int64_t c = 0; c < Cp; ++c) {
      T* d_values = &ws.d_values[c * D1];
      for (int64_t q = 0; q < count; ++q) {
        const T w = ws.weights[q * Cp + c];
        const T* grad = &ws.grad[q * D1];
#pragma omp simd
        for (int64_t e = 0; e < D1; ++e) d_values[e] += w * grad[e];
      }
    }
    for (int64_t e = 0; e < d; ++e) {
      T* d_keys = ws.d_keys_t.data() + e * Cp;
      for (int64_t q = 0; q < count; ++q) {
        const T xe = ws.queries[q * d + e];
        const T* d_logits = ws.d_logits.data() + q * Cp;
#pragma omp simd
        for (int64_t c = 0; c < Cp; ++c) d_keys[c] += xe * d_logits[c];
      }
    }
  }
  // scatter the block's candidate gradients to their keys (a key may be a candidate twice: both add)
  int64_t c = 0;
  for (const Run& run : ws.runs) {
    for (int64_t j = run.start; j < run.stop; ++j, ++c) {
      if (ws.windowed[c] < T(0)) continue;  // never in a support: no gradient
      T* d_y = g.y + (bh * L + j) * d;
      for (int64_t e = 0; e < d; ++e) d_y[e] += ws.d_keys_t[e * Cp + c];
      T* d_values1 = g.values1 + (bh * L + j) * D1;
      for (int64_t e = 0; e < D1; ++e) d_values1[e] += ws.d_values[c * D1 + e];
      g.klog[bh * L + j] += ws.d_klog[c];
    }
  }
}

template <typename T, int64_t W>
void run(const Inputs<T>& in) {
  at::parallel_for(0, in.B * in.H * in.N, 1, [&](int64_t begin, int64_t end) {
    Workspace<T> workspace;
    for (int64_t task = begin; task < end; ++task) query_block<T, W>(in, task / in.N, task % in.N, workspace);
  });
}

template <typename T, int64_t W>
void run_backward(const Inputs<T>& in, const Gradients<T>& g) {
  at::parallel_for(0, in.B * in.H, 1, [&](int64_t begin, int64_t end) {  // one thread per (batch, head)
    Workspace<T> workspace;
    for (int64_t bh = begin; bh < end; ++bh) {
      for (int64_t n = 0; n < in.N; ++n) query_block_backward<T, W>(in, g, bh, n, workspace);
    }
  });
}

// Value widths the kernels are compiled for: dv + 1 is padded up to the next one.
constexpr int64_t kMaxWidth = 256;

// body.template operator()<W>() with the smallest compiled width W >= D1
template <typename Body>
void with_width(int64_t D1, Body&& body) {
  if (D1 <= 16) return body.template operator()<16>();
  if (D1 <= 32) return body.template operator()<32>();
  if (D1 <= 48) return body.template operator()<48>();
  if (D1 <= 64) return body.template operator()<64>();
  if (D1 <= 96) return body.template operator()<96>();
  if (D1 <= 128) return body.template operator()<128>();
  return body.template operator()<kMaxWidth>();
}

}  // namespace

// See hybrid_compiled.fused_sums for the contract; every tensor is contiguous, on the CPU, in one dtype.
torch::Tensor hybrid_support_sums(torch::Tensor x, torch::Tensor rq, torch::Tensor far_sum, torch::Tensor key_shift,
                                  torch::Tensor y_t, torch::Tensor values1, torch::Tensor klog, torch::Tensor mask,
                                  torch::Tensor routed, int64_t left, int64_t right, int64_t num_global,
                                  int64_t block_q, int64_t block_k, double quadratic) {
  TORCH_CHECK(x.dim() == 4 && values1.dim() == 4 && routed.dim() == 4, "hybrid_support_sums: bad ranks");
  TORCH_CHECK(values1.size(3) <= kMaxWidth, "hybrid_support_sums: value width above ", kMaxWidth);
  auto out = torch::empty_like(values1);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hybrid_support_sums", [&] {
    Inputs<scalar_t> in{x.data_ptr<scalar_t>(), rq.data_ptr<scalar_t>(), far_sum.data_ptr<scalar_t>(),
                        key_shift.data_ptr<scalar_t>(), y_t.data_ptr<scalar_t>(), values1.data_ptr<scalar_t>(),
                        klog.data_ptr<scalar_t>(), mask.data_ptr<bool>(), routed.data_ptr<int64_t>(),
                        out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.size(3), values1.size(3),
                        routed.size(2), routed.size(3), left, right, num_global, block_q, block_k,
                        static_cast<scalar_t>(quadratic)};
    with_width(in.D1, [&]<int64_t W>() { run<scalar_t, W>(in); });
  });
  return out;
}

// The gradients of hybrid_support_sums with respect to x, rq, far_sum, y (B, H, L, d), values1 and klog (B, H, L)
std::vector<torch::Tensor> hybrid_support_sums_backward(
    torch::Tensor grad_out, torch::Tensor x, torch::Tensor rq, torch::Tensor far_sum, torch::Tensor key_shift,
    torch::Tensor y_t, torch::Tensor values1, torch::Tensor klog, torch::Tensor mask, torch::Tensor routed,
    int64_t left, int64_t right, int64_t num_global, int64_t block_q, int64_t block_k, double quadratic) {
  TORCH_CHECK(grad_out.sizes() == values1.sizes() && grad_out.is_contiguous(), "hybrid_support_sums_backward");
  TORCH_CHECK(values1.size(3) <= kMaxWidth, "hybrid_support_sums_backward: value width above ", kMaxWidth);
  auto d_x = torch::zeros_like(x), d_rq = torch::zeros_like(rq), d_far_sum = torch::zeros_like(far_sum);
  auto d_y = torch::zeros({x.size(0), x.size(1), x.size(2), x.size(3)}, x.options());
  auto d_values1 = torch::zeros_like(values1), d_klog = torch::zeros_like(klog);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hybrid_support_sums_backward", [&] {
    Inputs<scalar_t> in{x.data_ptr<scalar_t>(), rq.data_ptr<scalar_t>(), far_sum.data_ptr<scalar_t>(),
                        key_shift.data_ptr<scalar_t>(), y_t.data_ptr<scalar_t>(), values1.data_ptr<scalar_t>(),
                        klog.data_ptr<scalar_t>(), mask.data_ptr<bool>(), routed.data_ptr<int64_t>(),
                        nullptr, x.size(0), x.size(1), x.size(2), x.size(3), values1.size(3),
                        routed.size(2), routed.size(3), left, right, num_global, block_q, block_k,
                        static_cast<scalar_t>(quadratic)};
    Gradients<scalar_t> g{grad_out.data_ptr<scalar_t>(), d_x.data_ptr<scalar_t>(), d_rq.data_ptr<scalar_t>(),
                          d_far_sum.data_ptr<scalar_t>(), d_y.data_ptr<scalar_t>(), d_values1.data_ptr<scalar_t>(),
                          d_klog.data_ptr<scalar_t>()};
    with_width(in.D1, [&]<int64_t W>() { run_backward<scalar_t, W>(in, g); });
  });
  return {d_x, d_rq, d_far_sum, d_y, d_values1, d_klog};
}

// ----------------------------------------------------------------------------- polynomial far field
// The kernel 1 + t + c2 t^2 of t = u . w is the dot product of the features [1, u, (u_a u_b)_{a <= b}] of the
// query and [1, w, (g_ab w_a w_b)_{a <= b}] of the key, with g_aa = c2 and g_ab = 2 c2 for a < b: F = 1 + d +
// d (d + 1) / 2 features. The state is sum_j key_features(w_j) wv1_j^T, (F, D1); a query's far sum is
// query_features(u_i) . state. Both are computed in register tiles, without materialising features in memory.

constexpr int64_t kKeyTile = 32;  // keys per tile of the state accumulation

// features (F,) of one row u (d,); pair weights g_ab (key side) or 1 (query side)
template <typename T>
void quadratic_features(const T* u, int64_t d, T c2, bool key_side, T* features) {
  features[0] = T(1);
  for (int64_t a = 0; a < d; ++a) features[1 + a] = u[a];
  T* pairs = features + 1 + d;
  for (int64_t a = 0; a < d; ++a) {
    const T ua = key_side ? u[a] * c2 : u[a];
    pairs[0] = ua * u[a];
    const T ua2 = key_side ? ua * T(2) : ua;
#pragma omp simd
    for (int64_t b = a + 1; b < d; ++b) pairs[b - a] = ua2 * u[b];
    pairs += d - a;
  }
}

// state (F, D1) = sum_j features(w_j) wv1_j^T over rows w (L, d), wv1 (L, D1); key-side features (with c2) or
// query-side ones (the backward of far_apply: d state = sum_i features(u_i) grad_i^T)
template <typename T, int64_t W>
void far_state(const T* w, const T* wv1, int64_t L, int64_t d, int64_t D1, T c2, bool key_side, T* state) {
  const int64_t F = 1 + d + d * (d + 1) / 2, Fp = round_up(F, kQueries);
  std::vector<T> features(kKeyTile * Fp, T(0)), values(kKeyTile * W, T(0));  // (tile, Fp), (tile, W)
  std::vector<T> total(Fp * W, T(0));                                          // (Fp, W)
  for (int64_t j0 = 0; j0 < L; j0 += kKeyTile) {
    const int64_t count = std::min(kKeyTile, L - j0);
    for (int64_t k = 0; k < count; ++k) {
      quadratic_features(w + (j0 + k) * d, d, c2, key_side, &features[k * Fp]);
      std::memcpy(&values[k * W], wv1 + (j0 + k) * D1, D1 * sizeof(T));
    }
    // total (Fp, W) += features^T (Fp, count) @ values (count, W), kQueries features at a time
    for (int64_t f0 = 0; f0 < Fp; f0 += kQueries) {
      T acc[kQueries][W] = {};
      for (int64_t k = 0; k < count; ++k) {
        const T* row = &values[k * W];
        for (int64_t q = 0; q < kQueries; ++q) {
          const T z = features[k * Fp + f0 + q];
#pragma omp simd
          for (int64_t e = 0; e < W; ++e) acc[q][e] += z * row[e];
        }
      }
      for (int64_t q = 0; q < kQueries; ++q) {
        T* out = &total[(f0 + q) * W];
#pragma omp simd
        for (int64_t e = 0; e < W; ++e) out[e] += acc[q][e];
      }
    }
  }
  for (int64_t f = 0; f < F; ++f) std::memcpy(state + f * D1, &total[f * W], D1 * sizeof(T));
}

// sums (L, D1) for queries u (L, d) from a state padded to the tile width, (F, W); query-side features, or
// key-side ones (the backward of far_state: d wv1_j = d_state^T features(w_j))
template <typename T, int64_t W>
void far_apply(const T* u, const T* padded_state, int64_t L, int64_t d, int64_t D1, T c2, bool key_side, T* sums) {
  const int64_t F = 1 + d + d * (d + 1) / 2;
  std::vector<T> features(kQueries * F, T(0));
  for (int64_t i0 = 0; i0 < L; i0 += kQueries) {
    const int64_t count = std::min(kQueries, L - i0);
    if (count < kQueries) std::fill(features.begin(), features.end(), T(0));
    for (int64_t q = 0; q < count; ++q) quadratic_features(u + (i0 + q) * d, d, c2, key_side, &features[q * F]);
    T tile[kQueries * W];
    tile_values<T, W>(features.data(), F, padded_state, tile);  // (kQueries, F) @ (F, W)
    for (int64_t q = 0; q < count; ++q) std::memcpy(sums + (i0 + q) * D1, tile + q * W, D1 * sizeof(T));
  }
}

// rows (B, H, L, d), values (B, H, L, D1) -> (B, H, F, D1): sum over rows of features(row) values^T
torch::Tensor feature_sums(torch::Tensor rows, torch::Tensor values, double c2, bool key_side) {
  const int64_t B = rows.size(0), H = rows.size(1), L = rows.size(2), d = rows.size(3), D1 = values.size(3);
  const int64_t F = 1 + d + d * (d + 1) / 2;
  auto state = torch::empty({B, H, F, D1}, values.options());
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "feature_sums", [&] {
    const scalar_t *w = rows.data_ptr<scalar_t>(), *v = values.data_ptr<scalar_t>();
    scalar_t* out = state.data_ptr<scalar_t>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        with_width(D1, [&]<int64_t W>() {
          far_state<scalar_t, W>(w + bh * L * d, v + bh * L * D1, L, d, D1, static_cast<scalar_t>(c2), key_side,
                                 out + bh * F * D1);
        });
      }
    });
  });
  return state;
}

// rows (B, H, L, d), state (B, H, F, D1) -> (B, H, L, D1): features(row) . state for every row
torch::Tensor feature_products(torch::Tensor rows, torch::Tensor state, double c2, bool key_side) {
  const int64_t B = rows.size(0), H = rows.size(1), L = rows.size(2), d = rows.size(3), F = state.size(2);
  const int64_t D1 = state.size(3);
  TORCH_CHECK(F == 1 + d + d * (d + 1) / 2, "quadratic far field: a state of the wrong width");
  auto sums = torch::empty({B, H, L, D1}, state.options());
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "feature_products", [&] {
    const scalar_t* u = rows.data_ptr<scalar_t>();
    scalar_t* out = sums.data_ptr<scalar_t>();
    with_width(D1, [&]<int64_t W>() {
      // the state of every (batch, head), its rows padded to the tile width once: (B H, F, W)
      auto padded = torch::constant_pad_nd(state, {0, W - D1}).contiguous();
      const scalar_t* all = padded.data_ptr<scalar_t>();
      const int64_t blocks = (L + 255) / 256;  // 256 rows per task
      at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int64_t bh = task / blocks, i0 = (task % blocks) * 256, count = std::min<int64_t>(256, L - i0);
          far_apply<scalar_t, W>(u + (bh * L + i0) * d, all + bh * F * W, count, d, D1, static_cast<scalar_t>(c2),
                                 key_side, out + (bh * L + i0) * D1);
        }
      });
    });
  });
  return sums;
}

// d row (d,) = J^T h, the Jacobian of features(row) = [1, u, (g_ab u_a u_b)_{a <= b}] (g_aa = c2, g_ab = 2 c2
// on the key side; 1 on the query side) applied to h (F,)
template <typename T>
void features_backward(const T* u, const T* h, int64_t d, T c2, bool key_side, T* du) {
  for (int64_t a = 0; a < d; ++a) du[a] = h[1 + a];
  const T diagonal = key_side ? c2 : T(1), off_diagonal = key_side ? T(2) * c2 : T(1);
  const T* pairs = h + 1 + d;
  for (int64_t a = 0; a < d; ++a) {
    du[a] += T(2) * diagonal * pairs[0] * u[a];
    T acc = 0;
    for (int64_t b = a + 1; b < d; ++b) {
      const T hb = off_diagonal * pairs[b - a];
      acc += hb * u[b];
      du[b] += hb * u[a];
    }
    du[a] += acc;
    pairs += d - a;
  }
}

// d u_i = J^T (state v_i) for rows u (count, d) and vectors v (count, D1) of one (batch, head); the state
// transposed, (D1, F): kQueries rows at a time, h (kQueries, F) accumulated along contiguous state rows
template <typename T>
void row_grads(const T* u, const T* state_t, const T* v, int64_t count, int64_t d, int64_t F, int64_t D1, T c2,
               bool key_side, T* du) {
  std::vector<T> h(kQueries * F);
  for (int64_t i0 = 0; i0 < count; i0 += kQueries) {
    const int64_t rows = std::min(kQueries, count - i0);
    std::fill(h.begin(), h.end(), T(0));
    for (int64_t e = 0; e < D1; ++e) {
      const T* state_row = state_t + e * F;
      for (int64_t q = 0; q < rows; ++q) {
        const T ve = v[(i0 + q) * D1 + e];
        T* hq = h.data() + q * F;
#pragma omp simd
        for (int64_t f = 0; f < F; ++f) hq[f] += ve * state_row[f];
      }
    }
    for (int64_t q = 0; q < rows; ++q) features_backward(u + (i0 + q) * d, h.data() + q * F, d, c2, key_side, du + (i0 + q) * d);
  }
}

// rows (B, H, L, d), state (B, H, F, D1), vectors (B, H, L, D1) -> (B, H, L, d): the gradient of
// sum_i vectors_i . (state^T features(row_i)) with respect to each row
torch::Tensor feature_row_grads(torch::Tensor rows, torch::Tensor state, torch::Tensor vectors, double c2,
                                bool key_side) {
  const int64_t B = rows.size(0), H = rows.size(1), L = rows.size(2), d = rows.size(3), F = state.size(2);
  const int64_t D1 = state.size(3);
  auto grads = torch::empty_like(rows);
  auto state_t = state.transpose(-2, -1).contiguous();  // (B, H, D1, F)
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "feature_row_grads", [&] {
    const scalar_t *u = rows.data_ptr<scalar_t>(), *m = state_t.data_ptr<scalar_t>(), *v = vectors.data_ptr<scalar_t>();
    scalar_t* out = grads.data_ptr<scalar_t>();
    const int64_t blocks = (L + 255) / 256;
    at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t bh = task / blocks, i0 = (task % blocks) * 256, count = std::min<int64_t>(256, L - i0);
        row_grads(u + (bh * L + i0) * d, m + bh * F * D1, v + (bh * L + i0) * D1, count, d, F, D1,
                  static_cast<scalar_t>(c2), key_side, out + (bh * L + i0) * d);
      }
    });
  });
  return grads;
}

void check_far(const torch::Tensor& rows, const torch::Tensor& values, const char* name) {
  TORCH_CHECK(rows.dim() == 4 && values.dim() == 4 && rows.is_contiguous() && values.is_contiguous(), name,
              ": needs contiguous (B, H, L, X) tensors");
  TORCH_CHECK(values.size(3) <= kMaxWidth, name, ": value width above ", kMaxWidth);
}

// w (B, H, L, d) centred keys, wv1 (B, H, L, D1) weighted values -> (B, H, F, D1) far-field state
torch::Tensor quadratic_far_state(torch::Tensor w, torch::Tensor wv1, double quadratic) {
  check_far(w, wv1, "quadratic_far_state");
  return feature_sums(w, wv1, quadratic, true);
}

// (w, wv1, d_state) -> (d_w, d_wv1), the gradients of quadratic_far_state
std::vector<torch::Tensor> quadratic_far_state_backward(torch::Tensor w, torch::Tensor wv1, torch::Tensor d_state,
                                                        double quadratic) {
  check_far(w, wv1, "quadratic_far_state_backward");
  check_far(w, d_state, "quadratic_far_state_backward");
  return {feature_row_grads(w, d_state, wv1, quadratic, true), feature_products(w, d_state, quadratic, true)};
}

// u (B, H, L, d) centred queries, state (B, H, F, D1) -> (B, H, L, D1) far sums
torch::Tensor quadratic_far_apply(torch::Tensor u, torch::Tensor state) {
  check_far(u, state, "quadratic_far_apply");
  return feature_products(u, state, 1.0, false);
}

// (u, state, d_sums) -> (d_u, d_state), the gradients of quadratic_far_apply
std::vector<torch::Tensor> quadratic_far_apply_backward(torch::Tensor u, torch::Tensor state, torch::Tensor d_sums) {
  check_far(u, state, "quadratic_far_apply_backward");
  check_far(u, d_sums, "quadratic_far_apply_backward");
  return {feature_row_grads(u, state, d_sums, 1.0, false), feature_sums(u, d_sums, 1.0, false)};
}

// The R largest finite scores pushed into it and their indices, as a min-heap over caller-owned storage.
template <typename T>
struct BoundedTop {
  T* heap;         // (R,) the scores, smallest first
  int64_t* index;  // (R,) their indices
  int64_t R, filled = 0;

  bool full() const { return filled == R; }
  T smallest() const { return heap[0]; }

  void push(T score, int64_t k) {
    if (!std::isfinite(score)) return;  // -inf: excluded block
    if (filled < R) {
      int64_t slot = filled++;  // sift up
      heap[slot] = score, index[slot] = k;
      while (slot > 0 && heap[slot] < heap[(slot - 1) / 2]) {
        std::swap(heap[slot], heap[(slot - 1) / 2]);
        std::swap(index[slot], index[(slot - 1) / 2]);
        slot = (slot - 1) / 2;
      }
    } else if (score > heap[0]) {
      heap[0] = score, index[0] = k;
      for (int64_t slot = 0;;) {  // sift down
        int64_t child = 2 * slot + 1;
        if (child >= filled) break;
        if (child + 1 < filled && heap[child + 1] < heap[child]) ++child;
        if (!(heap[child] < heap[slot])) break;
        std::swap(heap[child], heap[slot]);
        std::swap(index[child], index[slot]);
        slot = child;
      }
    }
  }
};

// Rows [begin, end) of top_blocks: chunks of kLanes scores with nothing above the heap's minimum are skipped
// in one vectorised comparison.
template <typename T>
void top_rows(const T* all, int64_t Nk, int64_t R, int64_t begin, int64_t end, int64_t* chosen) {
  if (R <= 0) return;
  std::vector<T> heap(R);
  for (int64_t row = begin; row < end; ++row) {
    const T* s = all + row * Nk;
    BoundedTop<T> top{heap.data(), chosen + row * R, R};
    for (int64_t k = 0; k < Nk; ++k) {
      if (top.full() && k % kLanes == 0 && k + kLanes <= Nk) {  // skip a chunk with nothing better at once
        T chunk_max = s[k];
#pragma omp simd reduction(max : chunk_max)
        for (int64_t e = 1; e < kLanes; ++e) chunk_max = std::max(chunk_max, s[k + e]);
        if (!(chunk_max > top.smallest())) {
          k += kLanes - 1;
          continue;
        }
      }
      top.push(s[k], k);
    }
  }
}

// (B, H, N, Nk) scores -> (B, H, N, R) int64: the indices of the R largest finite scores of each row, in no
// particular order, -1 where fewer than R are finite (what topk + isfinite give).
torch::Tensor top_blocks(torch::Tensor scores, int64_t R) {
  TORCH_CHECK(scores.dim() == 4 && scores.is_contiguous() &&
                  (scores.scalar_type() == torch::kFloat32 || scores.scalar_type() == torch::kFloat64),
              "top_blocks: needs contiguous float (B, H, N, Nk) scores");
  const int64_t Nk = scores.size(3), rows = scores.numel() / std::max<int64_t>(Nk, 1);
  auto out = torch::full({scores.size(0), scores.size(1), scores.size(2), R}, -1, scores.options().dtype(torch::kInt64));
  int64_t* chosen = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "top_blocks", [&] {
    const scalar_t* all = scores.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) { top_rows(all, Nk, R, begin, end, chosen); });
  });
  return out;
}

template <typename T>
T dot(const T* a, const T* b, int64_t d) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < d; ++c) sum += a[c] * b[c];
  return sum;
}

// Grouped routing (hybrid_keys.route with routing groups), after the groups are chosen: for each query block, the
// R key blocks with the largest mean logit among the blocks of its groups that have keys and do not overlap its
// window span, without a (query blocks x candidates) temporary.
// mean_q (B, H, N, d) query-block means; means (B, H, Nk, d) key-block means, Nk a multiple of group_size;
// has_keys (B, Nk) bool; groups (B, H, N, g) int64 (-1: none); window_lo / window_hi (N,) int64: the first and last key of
// each query block's window span -> (B, H, N, R) int64 key blocks, -1 where fewer than R qualify.
torch::Tensor routed_candidates(torch::Tensor mean_q, torch::Tensor means, torch::Tensor has_keys,
                                torch::Tensor groups, torch::Tensor window_lo, torch::Tensor window_hi,
                                int64_t block_k, int64_t group_size, int64_t R) {
  TORCH_CHECK(mean_q.dim() == 4 && means.dim() == 4 && mean_q.is_contiguous() && means.is_contiguous() &&
                  mean_q.scalar_type() == means.scalar_type() && has_keys.scalar_type() == torch::kBool &&
                  has_keys.is_contiguous() && groups.scalar_type() == torch::kInt64 && groups.is_contiguous() &&
                  window_lo.is_contiguous() && window_hi.is_contiguous() && means.size(2) % group_size == 0,
              "routed_candidates: needs contiguous inputs as documented");
  const int64_t B = mean_q.size(0), H = mean_q.size(1), N = mean_q.size(2), d = mean_q.size(3);
  const int64_t Nk = means.size(2), g = groups.size(3);
  auto out = torch::full({B, H, N, R}, -1, groups.options());
  int64_t* chosen = out.data_ptr<int64_t>();
  const bool* has = has_keys.data_ptr<bool>();
  const int64_t *group = groups.data_ptr<int64_t>(), *lo = window_lo.data_ptr<int64_t>(),
                *hi = window_hi.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(mean_q.scalar_type(), "routed_candidates", [&] {
    const scalar_t *q_all = mean_q.data_ptr<scalar_t>(), *m_all = means.data_ptr<scalar_t>();
    at::parallel_for(0, B * H * N, 16, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> heap(R);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / (H * N), bh = row / N, n = row % N;
        const scalar_t* q = q_all + row * d;
        BoundedTop<scalar_t> top{heap.data(), chosen + row * R, R};
        for (int64_t e = 0; e < g; ++e) {
          if (group[row * g + e] < 0) continue;  // fewer groups qualified
          const int64_t first = group[row * g + e] * group_size;
          for (int64_t blk = first; blk < first + group_size; ++blk) {
            const int64_t k_start = blk * block_k;
            if (!has[b * Nk + blk] || (k_start <= hi[n] && k_start + block_k - 1 >= lo[n])) continue;
            const scalar_t* m = m_all + (bh * Nk + blk) * d;
            top.push(dot(q, m, d), blk);
          }
        }
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quadratic_far_state", &quadratic_far_state, "State of the polynomial far field over all keys");
  m.def("quadratic_far_apply", &quadratic_far_apply, "Far sums of the polynomial far field for every query");
  m.def("quadratic_far_state_backward", &quadratic_far_state_backward, "Gradients of quadratic_far_state");
  m.def("quadratic_far_apply_backward", &quadratic_far_apply_backward, "Gradients of quadratic_far_apply");
  m.def("top_blocks", &top_blocks, "Indices of the largest finite scores of each row");
  m.def("routed_candidates", &routed_candidates, "Grouped routing: the best key blocks of each query block's groups");
  m.attr("max_value_width") = kMaxWidth;
  m.def("hybrid_support_sums", &hybrid_support_sums, "Fused exact-support sums of bidirectional hybrid attention");
  m.def("hybrid_support_sums_backward", &hybrid_support_sums_backward, "Gradients of hybrid_support_sums");
}
