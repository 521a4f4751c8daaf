// Compiled CPU kernel of bidirectional hybrid attention's support sums (see hybrid_kernels.h), and the module.
// hybrid_support_sums: for each query i and every key j of its support E(i) (local window, global tokens, routed key
// blocks), one pass computes the exact logit, the kernel value that the far-field state already counted, and their
// difference applied to the values, without (queries x candidates) temporaries; candidates are packed once per query
// block. hybrid_support_sums_backward recomputes those per block and returns the inputs' gradients.
#include "hybrid_kernels.h"

namespace performer_hf {
namespace {

template <typename T>
struct Inputs {
  const T* x;         // (B, H, L, d) scaled queries
  const T* rq;        // (B, H, L) x_i . c (query centering log-weight)
  const T* q_scale;   // (B, H, L) log of each query's far-field factor: rq_i plus the far field's log gain
  const T* far_sum;   // (B, H, L, D1) kernel sums over all keys, relative to exp(q_scale_i + key_shift)
  const T* key_shift; // (B, H)
  const T* y_t;       // (B, H, d, L) scaled keys, transposed
  const T* values1;   // (B, H, L, D1) [v, 1], zero for padded keys
  const T* klog;      // (B, H, L) key centering log-weights (any value for padded keys)
  const bool* mask;   // (B, L) real keys
  const int64_t* routed;  // (B, H, N, R) routed key blocks of each query block, -1 for none
  const T* far_floor; // (B, H, L) the far mass at or below which what remains outside the support is rounding
  T* out;             // (B, H, L, D1) numerator | mass relative to a per-query shift
  int64_t B, H, L, d, D1, N, R;
  int64_t left, right, num_global, block_q, block_k;
  T quadratic;
};

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
  std::vector<T> t, pair;   // (kQueries, Cp): (x_i - a) . (y_j - c) and the kernel's values on the support
  // backward only
  std::vector<T> exact, d_weights, d_logits;  // (kQueries, Cp)
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
      if (never) {  // its key and values stay zero: whatever a padded row holds (NaN too) reaches no sum
        for (int64_t e = 0; e < d; ++e) ws.keys_t[e * Cp + c] = T(0);
      } else {
        std::memcpy(&ws.values[c * W], in.values1 + (bh * L + j) * D1, D1 * sizeof(T));
      }
      ws.klog[c] = never ? T(0) : in.klog[bh * L + j];
      ws.kexp[c] = never ? T(0) : exp_approx(ws.klog[c] - key_shift);
    }
    c0 += length;
  }
  return Cp;
}

// The exact logits of kQueries queries from i0 against the packed candidates, and per query: which candidates
// are in its support (`active`), the kernel's values there (`pair`) and their mass, its largest logit and the far
// field's scale (query scale plus key shift).
template <typename T>
void tile_support(const Inputs<T>& in, int64_t bh, int64_t i0, int64_t count, int64_t Cp, Workspace<T>& ws,
                  T* max_logits, T* far_scale, T* kernel_mass) {
  std::fill(ws.queries.begin(), ws.queries.end(), T(0));
  std::memcpy(ws.queries.data(), in.x + (bh * in.L + i0) * in.d, count * in.d * sizeof(T));
  tile_logits(ws.queries.data(), in.d, ws.keys_t.data(), Cp, ws.logits.data());
  const T *position = ws.position.data(), *windowed = ws.windowed.data();
  const T left = static_cast<T>(in.left), right = static_cast<T>(in.right);
  constexpr T kLowest = -std::numeric_limits<T>::max();
  for (int64_t q = 0; q < kQueries; ++q) {
    const T* logits = ws.logits.data() + q * Cp;
    T *active = ws.active.data() + q * Cp, *t = ws.t.data() + q * Cp, *pair = ws.pair.data() + q * Cp;
    const T i = static_cast<T>(i0 + q);
    const T rq = q < count ? in.rq[bh * in.L + i0 + q] : T(0);
    T max_logit = kLowest, mass = 0;
#pragma omp simd reduction(max : max_logit) reduction(+ : mass)
    for (int64_t c = 0; c < Cp; ++c) {
      const T gap = i - position[c];
      const T inside = (gap >= -right && gap <= left) ? T(1) : T(0);
      active[c] = inside == windowed[c] ? T(1) : T(0);
      max_logit = std::max(max_logit, active[c] != T(0) ? logits[c] : kLowest);
      t[c] = active[c] * (logits[c] - rq - ws.klog[c]);  // (x_i - a) . (y_j - c)
      pair[c] = active[c] * (T(1) + t[c] + in.quadratic * t[c] * t[c]) * ws.kexp[c];
      mass += pair[c];
    }
    max_logits[q] = max_logit;
    far_scale[q] = (q < count ? in.q_scale[bh * in.L + i0 + q] : T(0)) + in.key_shift[bh];
    kernel_mass[q] = mass;
  }
}

// A query's shift and the far field's weight exp(far_scale - shift) in its sums: the far field outside its support
// (its sums over every key minus the kernel's mass on the support) counts only above the floor of rounding; else the
// weight is 0 and the shift the largest exact logit alone.
template <typename T>
void far_part(const Inputs<T>& in, int64_t row, bool live, T max_logit, T far_scale, T kernel_mass, T& shift,
              T& far_weight) {
  const bool outside = live && in.far_sum[row * in.D1 + in.D1 - 1] - kernel_mass > in.far_floor[row];
  shift = outside ? std::max(far_scale, max_logit) : max_logit;
  far_weight = outside ? exp_approx(far_scale - shift) : T(0);
}

template <typename T, int64_t W>
void query_block(const Inputs<T>& in, int64_t bh, int64_t n, Workspace<T>& ws) {
  const int64_t L = in.L, D1 = in.D1;
  const int64_t q_start = n * in.block_q, q_end = std::min(L, q_start + in.block_q);
  const int64_t Cp = pack_candidates<T, W>(in, bh, n, ws);
  for (auto* tile : {&ws.t, &ws.pair}) tile->resize(kQueries * Cp);

  // kQueries queries at a time: exact logits, kernel values, shift, exact weights minus the kernel values, sums
  for (int64_t i0 = q_start; i0 < q_end; i0 += kQueries) {
    const int64_t count = std::min(kQueries, q_end - i0);
    T max_logit[kQueries], far_scale[kQueries], kernel_mass[kQueries], shift[kQueries], far_weight[kQueries];
    tile_support(in, bh, i0, count, Cp, ws, max_logit, far_scale, kernel_mass);
    for (int64_t q = 0; q < kQueries; ++q) {
      far_part(in, bh * L + i0 + q, q < count, max_logit[q], far_scale[q], kernel_mass[q], shift[q], far_weight[q]);
      const T *logits = ws.logits.data() + q * Cp, *active = ws.active.data() + q * Cp;
      const T* pair = ws.pair.data() + q * Cp;
      T* weights = ws.weights.data() + q * Cp;
#pragma omp simd
      for (int64_t c = 0; c < Cp; ++c) {
        weights[c] = active[c] * exp_approx(std::min(logits[c] - shift[q], T(0))) - far_weight[q] * pair[c];
      }
    }
    tile_values<T, W>(ws.weights.data(), Cp, ws.values.data(), ws.sums.data());
    for (int64_t q = 0; q < count; ++q) {
      T* out = in.out + (bh * L + i0 + q) * D1;
      const T* far_sum = in.far_sum + (bh * L + i0 + q) * D1;
      const T* sums = ws.sums.data() + q * W;
      for (int64_t e = 0; e < D1; ++e) out[e] = sums[e] + far_weight[q] * far_sum[e];
    }
  }
}

// Gradients of hybrid_support_sums (same inputs): what autograd gives for favor_hybrid._support_sums with the
// per-query shift held constant, accumulated per (batch, head) so that no two threads write the same key.
template <typename T>
struct Gradients {
  const T* grad_out;  // (B, H, L, D1)
  T *x, *rq, *q_scale, *far_sum, *y, *values1, *klog;  // like the inputs; y (B, H, L, d) untransposed; zeroed
};

template <typename T, int64_t W>
void query_block_backward(const Inputs<T>& in, const Gradients<T>& g, int64_t bh, int64_t n, Workspace<T>& ws) {
  const int64_t L = in.L, d = in.d, D1 = in.D1;
  const int64_t q_start = n * in.block_q, q_end = std::min(L, q_start + in.block_q);
  const int64_t Cp = pack_candidates<T, W>(in, bh, n, ws);
  const T *kexp = ws.kexp.data(), *values = ws.values.data();
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
    T max_logit[kQueries], far_scale[kQueries], kernel_mass[kQueries];
    tile_support(in, bh, i0, count, Cp, ws, max_logit, far_scale, kernel_mass);
    std::fill(ws.grad.begin(), ws.grad.end(), T(0));
    std::memcpy(ws.grad.data(), g.grad_out + (bh * L + i0) * D1, count * D1 * sizeof(T));
    // d loss / d weights (kQueries, Cp) = grad (kQueries, D1) @ values^T (D1, Cp)
    tile_logits(ws.grad.data(), D1, ws.values_t.data(), Cp, ws.d_weights.data());
    for (int64_t q = 0; q < count; ++q) {
      const int64_t row = bh * L + i0 + q;
      T shift, far_weight;
      far_part(in, row, true, max_logit[q], far_scale[q], kernel_mass[q], shift, far_weight);
      const T* logits = ws.logits.data() + q * Cp;
      const T* active = ws.active.data() + q * Cp;
      const T *t = ws.t.data() + q * Cp, *pair = ws.pair.data() + q * Cp;
      T *exact = ws.exact.data() + q * Cp, *weights = ws.weights.data() + q * Cp;
      const T* d_weights = ws.d_weights.data() + q * Cp;
      const T* grad = ws.grad.data() + q * D1;
#pragma omp simd
      for (int64_t c = 0; c < Cp; ++c) {  // the forward's weights
        exact[c] = active[c] * exp_approx(std::min(logits[c] - shift, T(0)));
        weights[c] = exact[c] - far_weight * pair[c];
      }
      // out = sums + far_weight * far_sum
      const T* far_sum = in.far_sum + row * D1;
      T d_far_weight = 0;
      for (int64_t e = 0; e < D1; ++e) {
        d_far_weight += grad[e] * far_sum[e];
        g.far_sum[row * D1 + e] = far_weight * grad[e];
      }
      // weights = exact - far_weight * pair; pair = active (1 + t + c2 t^2) kexp; t = logit - rq - klog
      T* d_logits = ws.d_logits.data() + q * Cp;
      T* d_klog = ws.d_klog.data();
      T d_rq = 0;
#pragma omp simd reduction(+ : d_far_weight, d_rq)
      for (int64_t c = 0; c < Cp; ++c) {
        d_far_weight -= d_weights[c] * pair[c];
        const T d_pair = -far_weight * d_weights[c];
        const T d_t = d_pair * active[c] * kexp[c] * (T(1) + T(2) * in.quadratic * t[c]);
        d_logits[c] = d_weights[c] * exact[c] + d_t;
        d_rq -= d_t;
        d_klog[c] += d_pair * pair[c] - d_t;  // pair is proportional to exp(klog)
      }
      g.rq[row] = d_rq;
      g.q_scale[row] = d_far_weight * far_weight;  // far_weight = exp(q_scale + key_shift - shift)
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
}  // namespace


// The Inputs of the tensors (x, rq, q_scale, far_sum, key_shift, y_t, values1, klog, mask, routed, far_floor) and
// the geometry
// (left, right, num_global, block_q, block_k); every tensor contiguous, on the CPU, in one dtype.
template <typename T>
Inputs<T> make_inputs(const std::vector<at::Tensor>& t, const std::vector<int64_t>& geometry, double quadratic,
                      T* out) {
  TORCH_CHECK(t.size() == 11 && geometry.size() == 5, "hybrid_support_sums: 11 tensors and 5 settings");
  const at::Tensor &x = t[0], &values1 = t[6], &routed = t[9];
  TORCH_CHECK(x.dim() == 4 && values1.dim() == 4 && routed.dim() == 4, "hybrid_support_sums: bad ranks");
  TORCH_CHECK(values1.size(3) <= kMaxWidth, "hybrid_support_sums: value width above ", kMaxWidth);
  return {x.data_ptr<T>(), t[1].data_ptr<T>(), t[2].data_ptr<T>(), t[3].data_ptr<T>(), t[4].data_ptr<T>(),
          t[5].data_ptr<T>(), values1.data_ptr<T>(), t[7].data_ptr<T>(), t[8].data_ptr<bool>(),
          routed.data_ptr<int64_t>(), t[10].data_ptr<T>(), out, x.size(0), x.size(1), x.size(2), x.size(3), values1.size(3),
          routed.size(2), routed.size(3), geometry[0], geometry[1], geometry[2], geometry[3], geometry[4],
          static_cast<T>(quadratic)};
}

// See hybrid_compiled.fused_sums for the contract: (B, H, L, D1) numerator | mass relative to a per-query shift.
at::Tensor hybrid_support_sums(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& geometry,
                                  double quadratic) {
  auto out = at::empty_like(inputs.at(6));
  AT_DISPATCH_FLOATING_TYPES(inputs[0].scalar_type(), "hybrid_support_sums", [&] {
    const auto in = make_inputs<scalar_t>(inputs, geometry, quadratic, out.data_ptr<scalar_t>());
    with_width(in.D1, [&]<int64_t W>() { run<scalar_t, W>(in); });
  });
  return out;
}

// The gradients of hybrid_support_sums with respect to x, rq, q_scale, far_sum, y (B, H, L, d), values1 and klog
std::vector<at::Tensor> hybrid_support_sums_backward(const at::Tensor& grad_out,
                                                        const std::vector<at::Tensor>& inputs,
                                                        const std::vector<int64_t>& geometry, double quadratic) {
  const at::Tensor& x = inputs.at(0);
  TORCH_CHECK(grad_out.sizes() == inputs.at(6).sizes() && grad_out.is_contiguous(), "hybrid_support_sums_backward");
  auto d_x = at::zeros_like(x), d_rq = at::zeros_like(inputs[1]), d_q_scale = at::zeros_like(inputs[2]);
  auto d_far_sum = at::zeros_like(inputs[3]), d_y = at::zeros_like(x);
  auto d_values1 = at::zeros_like(inputs[6]), d_klog = at::zeros_like(inputs[7]);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hybrid_support_sums_backward", [&] {
    const auto in = make_inputs<scalar_t>(inputs, geometry, quadratic, nullptr);
    Gradients<scalar_t> g{grad_out.data_ptr<scalar_t>(), d_x.data_ptr<scalar_t>(), d_rq.data_ptr<scalar_t>(),
                          d_q_scale.data_ptr<scalar_t>(), d_far_sum.data_ptr<scalar_t>(), d_y.data_ptr<scalar_t>(),
                          d_values1.data_ptr<scalar_t>(), d_klog.data_ptr<scalar_t>()};
    with_width(in.D1, [&]<int64_t W>() { run_backward<scalar_t, W>(in, g); });
  });
  return {d_x, d_rq, d_q_scale, d_far_sum, d_y, d_values1, d_klog};
}

}  // namespace performer_hf
