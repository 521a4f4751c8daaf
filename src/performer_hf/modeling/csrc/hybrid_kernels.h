// Shared by the compiled CPU kernels of hybrid attention (performer_hf.modeling.cpu_kernels builds the seven files
// into one module): a vectorisable exp, the register tiles, the compiled value widths, and the entry points.
// - bindings.cpp: the module;
// - hybrid_support.cpp: the support sums (the exact part and the far field's share on the support);
// - hybrid_far_field.cpp: the polynomial far field's state and sums;
// - hybrid_routing.cpp: the routing's top-k over key blocks.
// - sparse_decode.cpp: sparse attention's decoding step (one query per head over a key/value cache or a pool);
// - sparse_block.cpp: sparse attention over one block of queries (a prefill's or training's forward);
// - sparse_walk.cpp: the loop over a call's blocks of queries, from the first token.
// Every function checks only what the Python side cannot get wrong cheaply; favor_hybrid validates inputs.
#pragma once

// the operators the kernels call, one header each (ATen/ATen.h, every operator, took twice the compile time)
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace performer_hf {

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
// ---- entry points (see hybrid_compiled.py for the contracts)
// inputs: x, rq, q_scale, far_sum, key_shift, y_t, values1, klog, mask, routed; geometry: left, right, num_global,
// block_q, block_k
at::Tensor hybrid_support_sums(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& geometry,
                                  double quadratic);
std::vector<at::Tensor> hybrid_support_sums_backward(const at::Tensor& grad_out,
                                                        const std::vector<at::Tensor>& inputs,
                                                        const std::vector<int64_t>& geometry, double quadratic);
at::Tensor quadratic_far_state(at::Tensor w, at::Tensor wv1, double quadratic);
std::vector<at::Tensor> quadratic_far_state_backward(at::Tensor w, at::Tensor wv1, at::Tensor d_state,
                                                        double quadratic);
at::Tensor quadratic_far_apply(at::Tensor u, at::Tensor state);
std::vector<at::Tensor> quadratic_far_apply_backward(at::Tensor u, at::Tensor state, at::Tensor d_sums);
at::Tensor top_blocks(at::Tensor scores, int64_t R);
at::Tensor routed_candidates(const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& settings);
// sparse attention's decoding step: q (B, Hkv, G, D); runs: keys (B, Hkv, rows, D), values (B, Hkv, rows, Dv) and
// mask (B, Hkv, rows), (B, rows) or empty, of the global tokens, the candidate blocks and the window (rows
// contiguous); geometry: block, select_blocks, skip (candidate rows never selected); scores: (B, Hkv, N) float32 to
// which each candidate block's attention under a softmax over the candidates is added, or empty. Returns the
// context (B, Hkv, G, Dv).
at::Tensor sparse_decode_step(at::Tensor q, const std::vector<at::Tensor>& runs,
                                const std::vector<int64_t>& geometry, at::Tensor scores);
// sparse attention over one block of nq queries per head, G query heads per key/value head: logits (B, Hkv, G * nq,
// K) (contiguous, overwritten), values (B, Hkv, K, Dv) and masks (B, Hkv, nq, K) (broadcast views, or empty: every
// key visible) of the runs read whole (the global tokens, then the window); candidates: empty, or the scaled queries
// (B, Hkv, G * nq, D) (contiguous), keys (B, Hkv, C, D), values (B, Hkv, C, Dv) and mask (B, Hkv, nq, C) of the
// candidate key blocks, of which each query reads the `select` of most attention; geometry: G, block, select.
// Returns the context (B, Hkv, G * nq, Dv), the window's probabilities (B, Hkv, G * nq, Kw) (its logits' storage),
// the blocks each query read, (B, Hkv, nq, N) bool (empty without candidates), and each row's log-sum-exp over what
// it read, (B, Hkv, G * nq) (what a backward needs to recompute the probabilities).
std::vector<at::Tensor> sparse_block_attend(std::vector<at::Tensor> logits, const std::vector<at::Tensor>& values,
                                            const std::vector<at::Tensor>& masks,
                                            const std::vector<at::Tensor>& candidates,
                                            const std::vector<int64_t>& geometry);
// sparse_block_attend with the candidates' exponentials and block sums in scratch (float32, at least B * Hkv * G *
// nq * (C + 2 * N) elements; undefined or smaller: allocated), for a caller that runs many blocks
std::vector<at::Tensor> sparse_block_attend_within(std::vector<at::Tensor> logits,
                                                   const std::vector<at::Tensor>& values,
                                                   const std::vector<at::Tensor>& masks,
                                                   const std::vector<at::Tensor>& candidates,
                                                   const std::vector<int64_t>& geometry, const at::Tensor& scratch);
// sparse attention over the queries q (B, H, L, D) at positions first ... first + L - 1 of a call from the first
// token, one block of queries at a time, each block's candidates every stored key before its window: keys (B, Hkv,
// R, D) and values (B, Hkv, R, Dv) at positions 0 ... R - 1, key_mask (B, R) (real keys), selectable (B, R) (keys a
// query may select: real, not global tokens); globals: the global tokens' keys, values (B, Hkv, S, D) and mask (B,
// S); geometry: block, select, window_blocks, first. Returns the context (B, H, L, Dv), the candidate blocks each
// query read, (B, Hkv, L, N) bool (N: the last block's candidates; empty: none read), and each row's log-sum-exp,
// (B, Hkv, G, L).
std::vector<at::Tensor> sparse_walk_attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                           const at::Tensor& key_mask, const at::Tensor& selectable,
                                           const std::vector<at::Tensor>& globals,
                                           const std::vector<int64_t>& geometry);

}  // namespace performer_hf
