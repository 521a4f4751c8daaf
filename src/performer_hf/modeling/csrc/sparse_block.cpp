// Compiled CPU kernel of sparse attention over one block of queries (see hybrid_kernels.h; the contract and the
// PyTorch version are sparse_attention._attend_forward): the softmax of each query over the runs it reads whole (the
// global tokens, then its window), from the logits the caller formed, and over the candidate blocks of most
// attention. The candidates' logits are formed here, a tile of key blocks at a time, so that a tile's product, its
// maxima and exponentials stay in cache: each block keeps its largest logit, its exponentials under it and their sum.
// The blocks are ranked by their log-sum-exp over the query heads of a key/value head; then only the
// chosen blocks' exponentials and values are read, each value row once for the group's heads. The PyTorch version
// writes every candidate's logits, passes over them once per step and reads every candidate's values (a matrix
// product with zeros where no query chose).
#include "hybrid_kernels.h"

#include <ATen/ops/from_blob.h>

namespace performer_hf {
namespace {

// One run of keys' logits (B, Hkv, G * nq, K) (contiguous), their values (B, Hkv, K, Dv) (rows of unit stride) and
// their visibility, broadcast to (B, Hkv, nq, K) (last dimension of unit stride), or every key visible.
struct BlockRun {
  float* logits;
  const float* values;
  const bool* mask;
  int64_t keys, value_b, value_h, value_t, mask_b, mask_h, mask_q;

  BlockRun(at::Tensor& l, const at::Tensor& v, const at::Tensor& m)
      : logits(l.data_ptr<float>()),
        values(v.data_ptr<float>()),
        mask(m.numel() ? m.data_ptr<bool>() : nullptr),
        keys(l.size(3)),
        value_b(v.stride(0)),
        value_h(v.stride(1)),
        value_t(v.stride(2)),
        mask_b(m.numel() ? m.stride(0) : 0),
        mask_h(m.numel() ? m.stride(1) : 0),
        mask_q(m.numel() ? m.stride(2) : 0) {
    TORCH_CHECK(l.scalar_type() == at::kFloat && l.is_contiguous() && l.dim() == 4,
                "sparse_block_attend takes contiguous float32 (B, Hkv, G * nq, K) logits");
    TORCH_CHECK(v.scalar_type() == at::kFloat && v.dim() == 4 && v.size(2) == keys && (v.stride(3) == 1 || keys == 0),
                "sparse_block_attend takes float32 (B, Hkv, K, Dv) values with rows of unit stride");
    TORCH_CHECK(!m.numel() || (m.scalar_type() == at::kBool && m.dim() == 4 && m.size(3) == keys &&
                               (m.stride(3) == 1 || keys == 1)),
                "sparse_block_attend takes (B, Hkv, nq, K) bool masks whose last dimension has unit stride");
  }
  float* row(int64_t bh, int64_t g, int64_t q, int64_t nq, int64_t G) const {
    return logits + ((bh * G + g) * nq + q) * keys;
  }
  const bool* visible(int64_t b, int64_t h, int64_t q) const {
    return mask == nullptr ? nullptr : mask + b * mask_b + h * mask_h + q * mask_q;
  }
  const float* value_row(int64_t b, int64_t h, int64_t t) const {
    return values + b * value_b + h * value_h + t * value_t;
  }
};

constexpr float kHidden = -std::numeric_limits<float>::infinity();

// -inf written over the hidden keys of the G rows (visible: the keys' visibility, null for every key visible), the
// visibility read eight keys at a time: the hidden ones are few (global tokens, padding), mostly none
inline void hide(float* const* rows, int64_t G, const bool* visible, int64_t keys) {
  if (visible == nullptr) return;
  constexpr uint64_t kEightVisible = 0x0101010101010101ULL;
  for (int64_t t0 = 0; t0 < keys; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, keys - t0);
    uint64_t word = kEightVisible;
    std::memcpy(&word, visible + t0, n);
    if (word == kEightVisible) continue;
    for (int64_t t = t0; t < t0 + n; ++t)
      if (!visible[t])
        for (int64_t g = 0; g < G; ++g) rows[g][t] = kHidden;
  }
}

// Rows are read a step of 64 keys at a time, as four vectors of kLanes whose maxima and sums combine lane by lane
// before one reduction across lanes: a loop whose trip count the compiler cannot see reduces each vector across
// lanes and chains the exponentials one after another (1.6x slower at a block of 64 keys on AVX-512).
constexpr int64_t kStep = 4 * kLanes;

// the largest of row[0, kStep)
inline float step_max(const float* row) {
  float lanes[kLanes];
  for (int64_t e = 0; e < kLanes; ++e)
    lanes[e] = std::max(std::max(row[e], row[kLanes + e]), std::max(row[2 * kLanes + e], row[3 * kLanes + e]));
  float peak = lanes[0];
  for (int64_t e = 1; e < kLanes; ++e) peak = std::max(peak, lanes[e]);
  return peak;
}

// out[0, kStep) <- exp(row[0, kStep) - peak) (out may be row); returns their sum
inline float step_exponentials(const float* row, float* out, float peak) {
  float lanes[kLanes];
  for (int64_t e = 0; e < kLanes; ++e) {
    const float a = exp_approx(row[e] - peak), b = exp_approx(row[kLanes + e] - peak);
    const float c = exp_approx(row[2 * kLanes + e] - peak), d = exp_approx(row[3 * kLanes + e] - peak);
    out[e] = a, out[kLanes + e] = b, out[2 * kLanes + e] = c, out[3 * kLanes + e] = d;
    lanes[e] = (a + b) + (c + d);
  }
  float sum = 0.0f;
  for (int64_t e = 0; e < kLanes; ++e) sum += lanes[e];
  return sum;
}

// the largest of row[0, n) and peak
inline float row_max(const float* row, int64_t n, float peak) {
  const int64_t whole = n - n % kStep;
  for (int64_t t = 0; t < whole; t += kStep) peak = std::max(peak, step_max(row + t));
#pragma omp simd reduction(max : peak)
  for (int64_t t = whole; t < n; ++t) peak = std::max(peak, row[t]);
  return peak;
}

// out[0, n) <- exp(row[0, n) - peak) (0 where hidden: -inf; out may be row); returns their sum
inline float exponentials(const float* row, float* out, int64_t n, float peak) {
  const int64_t whole = n - n % kStep;
  float sum = 0.0f;
  for (int64_t t = 0; t < whole; t += kStep) sum += step_exponentials(row + t, out + t, peak);
#pragma omp simd reduction(+ : sum)
  for (int64_t t = whole; t < n; ++t) sum += out[t] = exp_approx(row[t] - peak);
  return sum;
}

// acc (G, Dv) += the G rows' weights at keys [lo, hi) of a run, each row's times factor[g], times their values.
// Up to kHeads rows at a time over kStep columns at a time, their sums held in registers across the keys (summed in
// memory, a store per product bounds the loop at half the multiply-add rate).
constexpr int64_t kHeads = 4;

template <int64_t kRows>
inline void weigh_tile(const BlockRun& run, int64_t b, int64_t h, float* const* rows, const float* factor,
                       int64_t lo, int64_t hi, int64_t Dv, int64_t e0, float* acc) {
  float sums[kRows][kStep];
  for (int64_t g = 0; g < kRows; ++g)
    for (int64_t e = 0; e < kStep; ++e) sums[g][e] = acc[g * Dv + e0 + e];
  for (int64_t t = lo; t < hi; ++t) {
    const float* value = run.value_row(b, h, t) + e0;
    for (int64_t g = 0; g < kRows; ++g) {
      const float w = rows[g][t] * factor[g];
#pragma omp simd
      for (int64_t e = 0; e < kStep; ++e) sums[g][e] += w * value[e];
    }
  }
  for (int64_t g = 0; g < kRows; ++g)
    for (int64_t e = 0; e < kStep; ++e) acc[g * Dv + e0 + e] = sums[g][e];
}

inline void weigh_values(const BlockRun& run, int64_t b, int64_t h, float* const* rows, const float* factor,
                         int64_t G, int64_t lo, int64_t hi, int64_t Dv, float* acc) {
  const int64_t whole = Dv - Dv % kStep;
  for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
    float* const* r = rows + g0;
    const float* f = factor + g0;
    float* a = acc + g0 * Dv;
    for (int64_t e0 = 0; e0 < whole; e0 += kStep) switch (std::min(kHeads, G - g0)) {
        case 1: weigh_tile<1>(run, b, h, r, f, lo, hi, Dv, e0, a); break;
        case 2: weigh_tile<2>(run, b, h, r, f, lo, hi, Dv, e0, a); break;
        case 3: weigh_tile<3>(run, b, h, r, f, lo, hi, Dv, e0, a); break;
        default: weigh_tile<kHeads>(run, b, h, r, f, lo, hi, Dv, e0, a);
      }
  }
  if (whole == Dv) return;
  for (int64_t t = lo; t < hi; ++t) {  // the columns past the last whole step
    const float* value = run.value_row(b, h, t);
    for (int64_t g = 0; g < G; ++g) {
      const float w = rows[g][t] * factor[g];
      float* sums = acc + g * Dv;
#pragma omp simd
      for (int64_t e = whole; e < Dv; ++e) sums[e] += w * value[e];
    }
  }
}

constexpr int64_t kTileKeys = 512;  // candidate keys whose logits a product forms at once (whole blocks)

// The candidates' blocks, a tile at a time: the logits of the queries q (B, Hkv, G * nq, D) against a tile's keys,
// their hidden keys -inf, then per block and query head its largest logit (block_max), the exponentials under it
// (exps, (B, Hkv, G * nq, C)) and their sum (block_sum, (B, Hkv, G * nq, N)); a block with every key hidden: 0.
void score_blocks(const at::Tensor& q, const at::Tensor& keys, const BlockRun& cand, int64_t G, int64_t nq,
                  int64_t block, float* exps, float* block_max, float* block_sum) {
  const int64_t B = q.size(0), Hkv = q.size(1), GQ = q.size(2), C = keys.size(2), N = C / block;
  const int64_t tile_blocks = std::max<int64_t>(1, kTileKeys / block), tiles = (N + tile_blocks - 1) / tile_blocks;
  at::parallel_for(0, B * Hkv * tiles, 1, [&](int64_t lo, int64_t hi) {
    c10::InferenceMode no_autograd;  // grad mode is the thread's own: the products record no graph
    // the thread's tile of logits, kept from call to call: allocated per block of queries, a buffer this size was
    // mapped afresh and its pages faulted in, where the model's own buffers had moved the allocator's thresholds
    thread_local std::vector<float> tile_logits;
    const auto tile_size = static_cast<size_t>(GQ * tile_blocks * block);
    if (tile_logits.size() < tile_size) tile_logits.resize(tile_size);
    std::vector<float*> rows(G);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t bh = i / tiles, b = bh / Hkv, h = bh % Hkv;
      const int64_t n0 = i % tiles * tile_blocks, n1 = std::min(N, n0 + tile_blocks), t0 = n0 * block;
      const int64_t width = (n1 - n0) * block;
      auto logits = at::from_blob(tile_logits.data(), {GQ, width}, q.options());
      at::mm_out(logits, q[b][h], keys[b][h].narrow(0, t0, width).t());  // (G * nq, width)
      float* tile = logits.data_ptr<float>();
      for (int64_t query = 0; query < nq; ++query) {
        for (int64_t g = 0; g < G; ++g) rows[g] = tile + (g * nq + query) * width;
        const bool* visible = cand.visible(b, h, query);
        hide(rows.data(), G, visible == nullptr ? nullptr : visible + t0, width);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (bh * G + g) * nq + query;
          float* out = exps + r * C + t0;
          for (int64_t n = n0; n < n1; ++n) {
            const float* row = rows[g] + (n - n0) * block;
            float* dst = out + (n - n0) * block;
            const float peak = row_max(row, block, kHidden);
            if (peak == kHidden) std::fill(dst, dst + block, 0.0f);
            block_max[r * N + n] = peak;
            block_sum[r * N + n] = peak == kHidden ? 0.0f : exponentials(row, dst, block, peak);
          }
        }
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> sparse_block_attend(std::vector<at::Tensor> logits, const std::vector<at::Tensor>& values,
                                            const std::vector<at::Tensor>& masks,
                                            const std::vector<at::Tensor>& candidates,
                                            const std::vector<int64_t>& geometry) {
  return sparse_block_attend_within(std::move(logits), values, masks, candidates, geometry, at::Tensor());
}

std::vector<at::Tensor> sparse_block_attend_within(std::vector<at::Tensor> logits,
                                                   const std::vector<at::Tensor>& values,
                                                   const std::vector<at::Tensor>& masks,
                                                   const std::vector<at::Tensor>& candidates,
                                                   const std::vector<int64_t>& geometry, const at::Tensor& scratch) {
  const int64_t G = geometry[0], block = geometry[1], select = geometry[2];
  const int64_t whole = static_cast<int64_t>(logits.size());
  TORCH_CHECK(whole >= 1 && whole == static_cast<int64_t>(values.size()) &&
                  whole == static_cast<int64_t>(masks.size()) && (candidates.empty() || candidates.size() == 4),
              "sparse_block_attend takes the runs read whole (the window last), then the candidates or none");
  std::vector<BlockRun> runs;
  for (int64_t r = 0; r < whole; ++r) runs.emplace_back(logits[r], values[r], masks[r]);
  const at::Tensor& window = logits[whole - 1];
  const int64_t B = window.size(0), Hkv = window.size(1), GQ = window.size(2), nq = GQ / G;
  const int64_t Dv = values[whole - 1].size(3);
  for (int64_t r = 0; r < whole; ++r)
    TORCH_CHECK(logits[r].size(0) == B && logits[r].size(1) == Hkv && logits[r].size(2) == GQ &&
                    values[r].size(3) == Dv,
                "sparse_block_attend takes runs of the same queries and value width");
  const bool selecting = !candidates.empty();
  const int64_t C = selecting ? candidates[1].size(2) : 0, N = selecting ? C / block : 0;
  const int64_t rows = B * Hkv * GQ;  // the candidates' exponentials, then each block's maximum and sum
  const bool fits = scratch.defined() && scratch.numel() >= rows * (C + 2 * N);
  const at::Tensor space = fits ? scratch : at::empty({rows * (C + 2 * N)}, window.options());
  auto exps = space.narrow(0, 0, rows * C).view({B, Hkv, GQ, C});
  auto block_max = space.narrow(0, rows * C, rows * N).view({B, Hkv, GQ, N});
  auto block_sum = space.narrow(0, rows * (C + N), rows * N).view({B, Hkv, GQ, N});
  std::optional<BlockRun> cand;  // the candidates, their exponentials in place of logits
  if (selecting) {
    const at::Tensor q = candidates[0].detach(), keys = candidates[1].detach();
    TORCH_CHECK(block > 0 && C % block == 0 && q.is_contiguous() && q.scalar_type() == at::kFloat &&
                    q.size(2) == GQ && keys.scalar_type() == at::kFloat && keys.stride(3) == 1,
                "sparse_block_attend takes whole candidate blocks, contiguous float32 queries and float32 keys");
    cand.emplace(exps, candidates[2], candidates[3]);
    score_blocks(q, keys, *cand, G, nq, block, exps.data_ptr<float>(), block_max.data_ptr<float>(),
                 block_sum.data_ptr<float>());
  }
  auto context = at::empty({B, Hkv, GQ, Dv}, window.options());
  auto lse = at::empty({B, Hkv, GQ}, window.options());
  const auto flags = window.options().dtype(at::kBool);
  auto chosen = selecting ? at::empty({B, Hkv, nq, N}, flags) : at::empty({0}, flags);
  float *out = context.data_ptr<float>(), *log_total = lse.data_ptr<float>();
  bool* choice = selecting ? chosen.data_ptr<bool>() : nullptr;
  const float *maxima = block_max.data_ptr<float>(), *sums = block_sum.data_ptr<float>();

  at::parallel_for(0, B * Hkv * nq, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float*> rows(G);
    std::vector<float> peak(G), total(G), acc(G * Dv), score(N), top(N), factor(G), ones(G, 1.0f);
    std::vector<int64_t> order(N);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t bh = i / nq, q = i % nq, b = bh / Hkv, h = bh % Hkv;
      // the hidden keys' logits -inf, then each head's largest logit over the runs
      std::fill(peak.begin(), peak.end(), kHidden);
      for (const BlockRun& run : runs) {
        for (int64_t g = 0; g < G; ++g) rows[g] = run.row(bh, g, q, nq, G);
        hide(rows.data(), G, run.visible(b, h, q), run.keys);
        for (int64_t g = 0; g < G; ++g) peak[g] = row_max(rows[g], run.keys, peak[g]);
      }
      int64_t kept = 0;
      if (selecting) {  // the blocks of largest log-sum-exp over their keys and the group's heads
        // in log space: under one shift, the blocks of a head whose logits lie far below another head's would be 0
        std::fill(top.begin(), top.end(), kHidden);
        std::fill(score.begin(), score.end(), 0.0f);
        for (int64_t g = 0; g < G; ++g) {
          const float* block_top = maxima + ((bh * G + g) * nq + q) * N;
          for (int64_t n = 0; n < N; ++n) top[n] = std::max(top[n], block_top[n]);
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (bh * G + g) * nq + q;
          for (int64_t n = 0; n < N; ++n)  // a block hidden to every head: exp(-inf - -inf), not read below
            score[n] += sums[r * N + n] * exp_approx(maxima[r * N + n] - top[n]);
        }
        for (int64_t n = 0; n < N; ++n) {
          score[n] = top[n] == kHidden ? kHidden : top[n] + std::log(score[n]);
          order[n] = n;
        }
        kept = N;
        if (N > select) {  // the select_blocks of largest score
          std::nth_element(order.begin(), order.begin() + select, order.end(),
                           [&](int64_t x, int64_t y) { return score[x] > score[y]; });
          kept = select;
          std::sort(order.begin(), order.begin() + kept);  // block order: the values read forwards
        }
        bool* chose = choice + i * N;
        std::fill(chose, chose + N, false);
        for (int64_t j = 0; j < kept; ++j) {  // each head's shift: its largest logit over what it reads
          chose[order[j]] = true;
          for (int64_t g = 0; g < G; ++g) peak[g] = std::max(peak[g], maxima[((bh * G + g) * nq + q) * N + order[j]]);
        }
      }
      // the runs read whole: their exponentials in place of the logits, summed, and their values weighed
      std::fill(total.begin(), total.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t r = 0; r < whole; ++r) {
        for (int64_t g = 0; g < G; ++g) {
          rows[g] = runs[r].row(bh, g, q, nq, G);
          total[g] += exponentials(rows[g], rows[g], runs[r].keys, peak[g]);
        }
        weigh_values(runs[r], b, h, rows.data(), ones.data(), G, 0, runs[r].keys, Dv, acc.data());
      }
      for (int64_t g = 0; g < G && selecting; ++g) rows[g] = cand->row(bh, g, q, nq, G);
      for (int64_t j = 0; j < kept; ++j) {  // the chosen blocks: exp(block max - peak) times their own exponentials
        const int64_t n = order[j];
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (bh * G + g) * nq + q;
          factor[g] = exp_approx(maxima[r * N + n] - peak[g]);  // 0 for a block with every key hidden
          total[g] += sums[r * N + n] * factor[g];
        }
        weigh_values(*cand, b, h, rows.data(), factor.data(), G, n * block, (n + 1) * block, Dv, acc.data());
      }
      for (int64_t g = 0; g < G; ++g) {
        float* dst = out + ((bh * G + g) * nq + q) * Dv;
        const float inverse = 1.0f / total[g];
        log_total[(bh * G + g) * nq + q] = peak[g] + std::log(total[g]);
        for (int64_t e = 0; e < Dv; ++e) dst[e] = acc[g * Dv + e] * inverse;
        float* probs = runs[whole - 1].row(bh, g, q, nq, G);  // the window's probabilities, in place
        for (int64_t t = 0; t < runs[whole - 1].keys; ++t) probs[t] *= inverse;
      }
    }
  });
  return {context, logits[whole - 1], chosen, lse};
}

}  // namespace performer_hf
