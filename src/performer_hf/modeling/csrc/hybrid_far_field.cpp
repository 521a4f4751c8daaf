// Compiled CPU kernels of the polynomial far field of bidirectional hybrid attention (see hybrid_kernels.h).
// ----------------------------------------------------------------------------- polynomial far field
// The kernel 1 + t + c2 t^2 of t = u . w is the dot product of the features [1, u, (u_a u_b)_{a <= b}] of the
// query and [1, w, (g_ab w_a w_b)_{a <= b}] of the key, with g_aa = c2 and g_ab = 2 c2 for a < b: F = 1 + d +
// d (d + 1) / 2 features. The state is sum_j key_features(w_j) wv1_j^T, (F, D1); a query's far sum is
// query_features(u_i) . state. Both are computed in register tiles, without materialising features in memory.
#include "hybrid_kernels.h"

namespace performer_hf {
namespace {

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
at::Tensor feature_sums(at::Tensor rows, at::Tensor values, double c2, bool key_side) {
  const int64_t B = rows.size(0), H = rows.size(1), L = rows.size(2), d = rows.size(3), D1 = values.size(3);
  const int64_t F = 1 + d + d * (d + 1) / 2;
  auto state = at::empty({B, H, F, D1}, values.options());
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
at::Tensor feature_products(at::Tensor rows, at::Tensor state, double c2, bool key_side) {
  const int64_t B = rows.size(0), H = rows.size(1), L = rows.size(2), d = rows.size(3), F = state.size(2);
  const int64_t D1 = state.size(3);
  TORCH_CHECK(F == 1 + d + d * (d + 1) / 2, "quadratic far field: a state of the wrong width");
  auto sums = at::empty({B, H, L, D1}, state.options());
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "feature_products", [&] {
    const scalar_t* u = rows.data_ptr<scalar_t>();
    scalar_t* out = sums.data_ptr<scalar_t>();
    with_width(D1, [&]<int64_t W>() {
      // the state of every (batch, head), its rows padded to the tile width once: (B H, F, W)
      auto padded = at::constant_pad_nd(state, {0, W - D1}).contiguous();
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
at::Tensor feature_row_grads(at::Tensor rows, at::Tensor state, at::Tensor vectors, double c2,
                                bool key_side) {
  const int64_t B = rows.size(0), H = rows.size(1), L = rows.size(2), d = rows.size(3), F = state.size(2);
  const int64_t D1 = state.size(3);
  auto grads = at::empty_like(rows);
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

void check_far(const at::Tensor& rows, const at::Tensor& values, const char* name) {
  TORCH_CHECK(rows.dim() == 4 && values.dim() == 4 && rows.is_contiguous() && values.is_contiguous(), name,
              ": needs contiguous (B, H, L, X) tensors");
  TORCH_CHECK(values.size(3) <= kMaxWidth, name, ": value width above ", kMaxWidth);
}
}  // namespace

// w (B, H, L, d) centred keys, wv1 (B, H, L, D1) weighted values -> (B, H, F, D1) far-field state
at::Tensor quadratic_far_state(at::Tensor w, at::Tensor wv1, double quadratic) {
  check_far(w, wv1, "quadratic_far_state");
  return feature_sums(w, wv1, quadratic, true);
}

// (w, wv1, d_state) -> (d_w, d_wv1), the gradients of quadratic_far_state
std::vector<at::Tensor> quadratic_far_state_backward(at::Tensor w, at::Tensor wv1, at::Tensor d_state,
                                                        double quadratic) {
  check_far(w, wv1, "quadratic_far_state_backward");
  check_far(w, d_state, "quadratic_far_state_backward");
  return {feature_row_grads(w, d_state, wv1, quadratic, true), feature_products(w, d_state, quadratic, true)};
}

// u (B, H, L, d) centred queries, state (B, H, F, D1) -> (B, H, L, D1) far sums
at::Tensor quadratic_far_apply(at::Tensor u, at::Tensor state) {
  check_far(u, state, "quadratic_far_apply");
  return feature_products(u, state, 1.0, false);
}

// (u, state, d_sums) -> (d_u, d_state), the gradients of quadratic_far_apply
std::vector<at::Tensor> quadratic_far_apply_backward(at::Tensor u, at::Tensor state, at::Tensor d_sums) {
  check_far(u, state, "quadratic_far_apply_backward");
  check_far(u, d_sums, "quadratic_far_apply_backward");
  return {feature_row_grads(u, state, d_sums, 1.0, false), feature_sums(u, d_sums, 1.0, false)};
}
}  // namespace performer_hf
