// Compiled CPU kernel of sparse attention's decoding step (see hybrid_kernels.h; the contract and the PyTorch
// versions are sparse_attention._decode_step and _pooled_decode_step): one query per head over three runs of keys,
// in two passes. The runs are the global tokens read apart from the window, the candidate key blocks (a key/value
// cache's blocks before the window, or a bounded pool) and the window. The first pass forms the logits against
// every key, which is what attention over a key/value cache reads anyway; the second ranks the candidate blocks by
// their attention mass, then takes the softmax over the global tokens, the selected blocks and the window, reading
// only their values. Optionally it also adds to each candidate block's score the attention the block receives under
// a softmax over the candidates alone (what the bounded pool's "latest" ranking accumulates).
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
    for (int64_t width = kDotLanes / 2; width > 0; width /= 2)  // the lanes summed pairwise: vector adds
      for (int64_t l = 0; l < width; ++l) acc[j][l] += acc[j][l + width];
    float sum = acc[j][0];
    for (int64_t e = body; e < D; ++e) sum += query[e] * keys[j * D + e];
    out[j] = sum;
  }
}

// One run of keys and values (B, Hkv, rows, D / Dv), rows contiguous, any batch and head strides, with its
// visibility mask (B, Hkv, rows) or (B, rows) for every head (rows contiguous; absent: every key visible).
struct Run {
  const float* keys;
  const float* values;
  const bool* mask;
  int64_t rows, key_b, key_h, value_b, value_h, mask_b, mask_h;
  int64_t always_visible;  // a row visible whatever the mask (the query's own key), or -1

  Run(const at::Tensor& k, const at::Tensor& v, const at::Tensor& m, int64_t always_visible)
      : keys(k.data_ptr<float>()),
        values(v.data_ptr<float>()),
        mask(m.numel() ? m.data_ptr<bool>() : nullptr),
        rows(k.size(2)),
        key_b(k.stride(0)),
        key_h(k.stride(1)),
        value_b(v.stride(0)),
        value_h(v.stride(1)),
        mask_b(m.numel() ? m.stride(0) : 0),
        mask_h(m.numel() && m.dim() == 3 ? m.stride(1) : 0),
        always_visible(always_visible) {
    TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
                "sparse_decode_step takes float32 keys and values");
    TORCH_CHECK(!rows || (k.stride(3) == 1 && k.stride(2) == k.size(3) && v.stride(3) == 1 && v.stride(2) == v.size(3)),
                "sparse_decode_step takes keys and values with contiguous rows");
    TORCH_CHECK(!m.numel() || (m.scalar_type() == at::kBool && m.size(-1) == rows && m.stride(-1) == 1),
                "sparse_decode_step takes (B, Hkv, rows) or (B, rows) bool masks with contiguous rows");
  }
  const float* key_row(int64_t b, int64_t h, int64_t t, int64_t D) const { return keys + b * key_b + h * key_h + t * D; }
  const float* value_row(int64_t b, int64_t h, int64_t t, int64_t Dv) const {
    return values + b * value_b + h * value_h + t * Dv;
  }
  bool visible(int64_t b, int64_t h, int64_t t) const {
    return mask == nullptr || t == always_visible || mask[b * mask_b + h * mask_h + t];
  }
};

// logits of one key/value head's G queries (G, D) against rows [t0, t1) of a run, written at columns
// offset + t of rows of K; hidden keys: -inf
void run_logits(const float* queries, const Run& run, int64_t b, int64_t h, int64_t G, int64_t D, int64_t K,
                int64_t offset, int64_t t0, int64_t t1, float scale, float* logits) {
  constexpr float kHidden = -std::numeric_limits<float>::infinity();
  float out[kKeys];
  for (int64_t t = t0; t < t1; t += kKeys) {
    const int64_t n = std::min(kKeys, t1 - t);
    const float* keys = run.key_row(b, h, t, D);
    for (int64_t g = 0; g < G; ++g) {
      if (n == kKeys) {
        dots(queries + g * D, keys, D, out);
      } else {
        for (int64_t j = 0; j < n; ++j) {
          float sum = 0.0f;
          for (int64_t e = 0; e < D; ++e) sum += queries[g * D + e] * keys[j * D + e];
          out[j] = sum;
        }
      }
      float* row = logits + g * K + offset;
      for (int64_t j = 0; j < n; ++j) row[t + j] = run.visible(b, h, t + j) ? out[j] * scale : kHidden;
    }
  }
}

// The candidate blocks a query group reads: every one when there are at most `select`, else the `select` of most
// attention (the log-sum-exp of their logits over their selectable keys, from `skip` on, and the G heads: in log
// space, for under one shift the blocks of a head whose logits lie far below another head's would all be 0).
// cand: the (G, C) candidate logits, with row stride K.
std::vector<int64_t> selected_blocks(const float* cand, int64_t G, int64_t K, int64_t C, int64_t block, int64_t skip,
                                     int64_t select) {
  const int64_t N = C / block;
  std::vector<int64_t> blocks(N);
  for (int64_t n = 0; n < N; ++n) blocks[n] = n;
  if (N <= select) return blocks;
  constexpr float kHidden = -std::numeric_limits<float>::infinity();
  std::vector<float> score(N), maxima(G);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t start = std::max(n * block, skip), stop = (n + 1) * block;
    float top = kHidden;
    for (int64_t g = 0; g < G; ++g) {
      const float* row = cand + g * K;
      float peak = kHidden;
#pragma omp simd reduction(max : peak)
      for (int64_t t = start; t < stop; ++t) peak = std::max(peak, row[t]);
      maxima[g] = peak;
      top = std::max(top, peak);
    }
    float sum = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
      const float peak = maxima[g];
      if (peak == kHidden) continue;  // the head sees no key of the block
      const float* row = cand + g * K;
      float part = 0.0f;
#pragma omp simd reduction(+ : part)
      for (int64_t t = start; t < stop; ++t) part += exp_approx(row[t] - peak);
      sum += part * exp_approx(peak - top);
    }
    score[n] = top == kHidden ? kHidden : top + std::log(sum);  // every key hidden: -inf
  }
  std::nth_element(blocks.begin(), blocks.begin() + select, blocks.end(),
                   [&](int64_t a, int64_t b) { return score[a] > score[b]; });
  blocks.resize(select);
  return blocks;
}

// observed (N,) += the attention each candidate block receives from the G queries, under a softmax over the
// candidate keys alone per query (a query with every candidate hidden adds nothing)
void observe_blocks(const float* cand, int64_t G, int64_t K, int64_t C, int64_t block, float* observed) {
  std::vector<float> weights(C);
  for (int64_t g = 0; g < G; ++g) {
    const float* row = cand + g * K;
    float peak = -std::numeric_limits<float>::infinity(), total = 0.0f;
#pragma omp simd reduction(max : peak)
    for (int64_t t = 0; t < C; ++t) peak = std::max(peak, row[t]);
    if (!std::isfinite(peak)) continue;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < C; ++t) total += weights[t] = exp_approx(row[t] - peak);
    for (int64_t n = 0; n < C / block; ++n) {
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = n * block; t < (n + 1) * block; ++t) sum += weights[t];
      observed[n] += sum / total;
    }
  }
}

struct Span {  // logits columns [start, stop) of a run's rows from `first` on
  int64_t start, stop, first;
  const Run* run;
};

}  // namespace

at::Tensor sparse_decode_step(at::Tensor q, const std::vector<at::Tensor>& runs,
                                const std::vector<int64_t>& geometry, at::Tensor scores) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "sparse_decode_step takes a contiguous float32 q");
  TORCH_CHECK(runs.size() == 9, "sparse_decode_step takes (keys, values, mask) of the globals, candidates, window");
  const int64_t block = geometry[0], select = geometry[1], skip = geometry[2];
  const bool observe = scores.numel() > 0;
  const Run globals(runs[0], runs[1], runs[2], -1), candidates(runs[3], runs[4], runs[5], -1),
      window(runs[6], runs[7], runs[8], runs[6].size(2) - 1);  // every query sees itself
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3), Dv = runs[7].size(3);
  const int64_t S = globals.rows, C = candidates.rows, W = window.rows, K = S + C + W, N = C / block;
  TORCH_CHECK(C % block == 0 && W > 0, "sparse_decode_step takes whole candidate blocks and a non-empty window");
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  auto logits = at::empty({B, Hkv, G, K}, q.options());
  auto out = at::empty({B, Hkv, G, Dv}, q.options());
  TORCH_CHECK(!observe || (scores.scalar_type() == at::kFloat && scores.is_contiguous() && scores.size(2) == N),
              "sparse_decode_step takes (B, Hkv, N) contiguous float32 block scores");
  const float* qp = q.data_ptr<float>();
  float *lp = logits.data_ptr<float>(), *op = out.data_ptr<float>();
  float* obs = observe ? scores.data_ptr<float>() : nullptr;

  const Run* order[3] = {&globals, &candidates, &window};
  const int64_t offsets[3] = {0, S, S + C};
  int64_t chunks[3], per_head = 0;
  for (int r = 0; r < 3; ++r) per_head += chunks[r] = (order[r]->rows + kKeyChunk - 1) / kKeyChunk;
  at::parallel_for(0, B * Hkv * per_head, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t bh = i / per_head;
      int64_t chunk = i % per_head, r = 0;
      while (chunk >= chunks[r]) chunk -= chunks[r++];
      const int64_t t0 = chunk * kKeyChunk, t1 = std::min(order[r]->rows, t0 + kKeyChunk);
      run_logits(qp + bh * G * D, *order[r], bh / Hkv, bh % Hkv, G, D, K, offsets[r], t0, t1, scale,
                 lp + bh * G * K);
    }
  });

  at::parallel_for(0, B * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<Span> spans;
    std::vector<float> acc(G * Dv), total(G);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      float* rows = lp + bh * G * K;
      if (observe) observe_blocks(rows + S, G, K, C, block, obs + bh * N);
      // the spans read: the global tokens, the selected candidate blocks, the window
      spans.clear();
      if (S) spans.push_back({0, S, 0, &globals});
      for (int64_t n : selected_blocks(rows + S, G, K, C, block, skip, select)) {
        const int64_t first = std::max(n * block, skip);
        if (first < (n + 1) * block) spans.push_back({S + first, S + (n + 1) * block, first, &candidates});
      }
      spans.push_back({S + C, K, 0, &window});
      // each query's exponentials over the spans, in place of its logits
      for (int64_t g = 0; g < G; ++g) {
        float* row = rows + g * K;
        float peak = -std::numeric_limits<float>::infinity(), sum = 0.0f;
        for (const Span& span : spans) {
#pragma omp simd reduction(max : peak)
          for (int64_t t = span.start; t < span.stop; ++t) peak = std::max(peak, row[t]);
        }
        for (const Span& span : spans) {
#pragma omp simd reduction(+ : sum)
          for (int64_t t = span.start; t < span.stop; ++t) sum += row[t] = exp_approx(row[t] - peak);
        }
        total[g] = sum;
      }
      // the values they weigh, each value row read once for the G queries
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (const Span& span : spans) {
        const float* value = span.run->value_row(b, h, span.first, Dv);
        for (int64_t t = span.start; t < span.stop; ++t, value += Dv) {
          for (int64_t g = 0; g < G; ++g) {
            const float w = rows[g * K + t];
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
