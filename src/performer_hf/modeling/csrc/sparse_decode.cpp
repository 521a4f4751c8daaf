// Compiled CPU kernel of sparse attention's decoding step (see hybrid_kernels.h; the contract and the PyTorch
// version are sparse_attention._decode_step): one query per head over every kept key in two passes. The first forms
// the logits against every key, which is what attention over a key/value cache reads anyway; the second ranks the
// key blocks before the window by their attention mass, then takes the softmax over the global tokens, the selected
// blocks and the window, reading only their values.
#include "hybrid_kernels.h"

namespace performer_hf {
namespace {

constexpr int64_t kKeyChunk = 256;  // keys per task of the first pass

// dot products of one query (D,) with kKeys consecutive keys (kKeys, D): independent accumulators, so that the
// multiply-adds of the keys overlap instead of waiting on one another
constexpr int64_t kKeys = 4;
constexpr int64_t kDotLanes = 16;

inline void dots(const float* query, const float* keys, int64_t D, float* out) {
  float acc[kKeys][kDotLanes] = {};
  const int64_t body = D / kDotLanes * kDotLanes;
  for (int64_t e0 = 0; e0 < body; e0 += kDotLanes)
    for (int64_t j = 0; j < kKeys; ++j) {
      const float* key = keys + j * D + e0;
#pragma omp simd
      for (int64_t l = 0; l < kDotLanes; ++l) acc[j][l] += query[e0 + l] * key[l];
    }
  for (int64_t j = 0; j < kKeys; ++j) {
    float sum = 0.0f;
    for (int64_t l = 0; l < kDotLanes; ++l) sum += acc[j][l];
    for (int64_t e = body; e < D; ++e) sum += query[e] * keys[j * D + e];
    out[j] = sum;
  }
}

// logits (G, T) of one key/value head's G queries (G, D) against the keys [t0, t1) of (T, D); hidden keys: -inf
void head_logits(const float* queries, const float* keys, const bool* visible, int64_t G, int64_t D, int64_t T,
                 int64_t t0, int64_t t1, float scale, float* logits) {
  constexpr float kHidden = -std::numeric_limits<float>::infinity();
  float out[kKeys];
  for (int64_t t = t0; t < t1; t += kKeys) {
    const int64_t n = std::min(kKeys, t1 - t);
    for (int64_t g = 0; g < G; ++g) {
      float* row = logits + g * T;
      if (n == kKeys) {
        dots(queries + g * D, keys + t * D, D, out);
      } else {
        for (int64_t j = 0; j < n; ++j) {
          float sum = 0.0f;
          for (int64_t e = 0; e < D; ++e) sum += queries[g * D + e] * keys[(t + j) * D + e];
          out[j] = sum;
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        const bool hidden = visible != nullptr && !visible[t + j] && t + j != T - 1;  // every query sees itself
        row[t + j] = hidden ? kHidden : out[j] * scale;
      }
    }
  }
}

// The support's key ranges [start, stop) of one key/value head: the global tokens outside the window, the
// selected blocks (without the global tokens they hold), the window.
std::vector<std::pair<int64_t, int64_t>> support_ranges(const float* logits, int64_t G, int64_t T, int64_t window_lo,
                                                        int64_t outside, int64_t num_global, int64_t block,
                                                        int64_t select) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  if (outside > 0) ranges.emplace_back(0, outside);
  const int64_t N = window_lo / block;
  std::vector<int64_t> blocks(N);
  for (int64_t n = 0; n < N; ++n) blocks[n] = n;
  if (N > select) {
    // a block's score: its exponentials summed over its selectable keys and the G heads, under one shift
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t g = 0; g < G; ++g) {
      const float* row = logits + g * T;
#pragma omp simd reduction(max : top)
      for (int64_t t = 0; t < window_lo; ++t) top = std::max(top, row[t]);
    }
    std::vector<float> score(N, 0.0f);
    for (int64_t g = 0; g < G && std::isfinite(top); ++g) {  // every key hidden: every score 0
      const float* row = logits + g * T;
      for (int64_t n = 0; n < N; ++n) {
        float sum = 0.0f;
        const int64_t stop = (n + 1) * block;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = std::max(n * block, num_global); t < stop; ++t) sum += exp_approx(row[t] - top);
        score[n] += sum;
      }
    }
    std::nth_element(blocks.begin(), blocks.begin() + select, blocks.end(),
                     [&](int64_t a, int64_t b) { return score[a] > score[b]; });
    blocks.resize(select);
  }
  for (int64_t n : blocks) {
    const int64_t start = std::max(n * block, num_global);
    if (start < (n + 1) * block) ranges.emplace_back(start, (n + 1) * block);
  }
  ranges.emplace_back(window_lo, T);
  return ranges;
}

}  // namespace

torch::Tensor sparse_decode_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor key_mask,
                                 const std::vector<int64_t>& geometry) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat,
              "sparse_decode_step takes float32 tensors");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "sparse_decode_step takes contiguous tensors");
  const int64_t window_lo = geometry[0], outside = geometry[1], num_global = geometry[2], block = geometry[3],
                select = geometry[4];
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3), T = k.size(2), Dv = v.size(3);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  auto logits = torch::empty({B, Hkv, G, T}, q.options());
  auto out = torch::empty({B, Hkv, G, Dv}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const bool* mp = key_mask.numel() ? key_mask.data_ptr<bool>() : nullptr;
  float *lp = logits.data_ptr<float>(), *op = out.data_ptr<float>();

  const int64_t chunks = (T + kKeyChunk - 1) / kKeyChunk;
  at::parallel_for(0, B * Hkv * chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t bh = i / chunks, t0 = (i % chunks) * kKeyChunk;
      head_logits(qp + bh * G * D, kp + bh * T * D, mp ? mp + (bh / Hkv) * T : nullptr, G, D, T, t0,
                  std::min(T, t0 + kKeyChunk), scale, lp + bh * G * T);
    }
  });

  at::parallel_for(0, B * Hkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const float* row = lp + bh * G * T;
      const auto ranges = support_ranges(row, G, T, window_lo, outside, num_global, block, select);
      std::vector<float> peak(G, -std::numeric_limits<float>::infinity()), total(G, 0.0f), acc(G * Dv, 0.0f);
      for (const auto& [start, stop] : ranges)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t t = start; t < stop; ++t) peak[g] = std::max(peak[g], row[g * T + t]);
      std::vector<float> weight(G);
      const float* values = vp + bh * T * Dv;
      for (const auto& [start, stop] : ranges) {
        for (int64_t t = start; t < stop; ++t) {
          const float* value = values + t * Dv;
          for (int64_t g = 0; g < G; ++g) {
            const float w = exp_approx(row[g * T + t] - peak[g]);
            total[g] += w;
            float* sums = acc.data() + g * Dv;
#pragma omp simd
            for (int64_t e = 0; e < Dv; ++e) sums[e] += w * value[e];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t e = 0; e < Dv; ++e) op[(bh * G + g) * Dv + e] = acc[g * Dv + e] / total[g];
    }
  });
  return out;
}

}  // namespace performer_hf
