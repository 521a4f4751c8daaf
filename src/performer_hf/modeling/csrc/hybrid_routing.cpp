// Compiled CPU kernels of hybrid attention's routing (see hybrid_kernels.h): the top-k over key blocks.
#include "hybrid_kernels.h"

namespace performer_hf {
namespace {

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

template <typename T>
T dot(const T* a, const T* b, int64_t d) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < d; ++c) sum += a[c] * b[c];
  return sum;
}
}  // namespace

// (B, H, N, Nk) scores -> (B, H, N, R) int64: the indices of the R largest finite scores of each row, in no
// particular order, -1 where fewer than R are finite (what topk + isfinite give).
at::Tensor top_blocks(at::Tensor scores, int64_t R) {
  TORCH_CHECK(scores.dim() == 4 && scores.is_contiguous() &&
                  (scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kDouble),
              "top_blocks: needs contiguous float (B, H, N, Nk) scores");
  const int64_t Nk = scores.size(3), rows = scores.numel() / std::max<int64_t>(Nk, 1);
  auto out = at::full({scores.size(0), scores.size(1), scores.size(2), R}, -1, scores.options().dtype(at::kLong));
  int64_t* chosen = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "top_blocks", [&] {
    const scalar_t* all = scores.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) { top_rows(all, Nk, R, begin, end, chosen); });
  });
  return out;
}



// Grouped routing (hybrid_keys.route with routing groups), after the groups are chosen: for each query block, the
// R key blocks with the largest mean logit among the blocks of its groups that have keys and do not overlap its
// window span, without a (query blocks x candidates) temporary.
// mean_q (B, H, N, d) query-block means; means (B, H, Nk, d) key-block means, Nk a multiple of group_size;
// has_keys (B, Nk) bool; groups (B, H, N, g) int64 (-1: none); window_lo / window_hi (N,) int64: the first and last key of
// each query block's window span -> (B, H, N, R) int64 key blocks, -1 where fewer than R qualify.
// blocks: mean_q, means, has_keys, groups, window_lo, window_hi; settings: block_k, group_size, R.
at::Tensor routed_candidates(const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& settings) {
  TORCH_CHECK(blocks.size() == 6 && settings.size() == 3, "routed_candidates: 6 tensors and 3 settings");
  const at::Tensor &mean_q = blocks[0], &means = blocks[1], &has_keys = blocks[2], &groups = blocks[3];
  const at::Tensor &window_lo = blocks[4], &window_hi = blocks[5];
  const int64_t block_k = settings[0], group_size = settings[1], R = settings[2];
  TORCH_CHECK(mean_q.dim() == 4 && means.dim() == 4 && mean_q.is_contiguous() && means.is_contiguous() &&
                  mean_q.scalar_type() == means.scalar_type() && has_keys.scalar_type() == at::kBool &&
                  has_keys.is_contiguous() && groups.scalar_type() == at::kLong && groups.is_contiguous() &&
                  window_lo.is_contiguous() && window_hi.is_contiguous() && means.size(2) % group_size == 0,
              "routed_candidates: needs contiguous inputs as documented");
  const int64_t B = mean_q.size(0), H = mean_q.size(1), N = mean_q.size(2), d = mean_q.size(3);
  const int64_t Nk = means.size(2), g = groups.size(3);
  auto out = at::full({B, H, N, R}, -1, groups.options());
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
}  // namespace performer_hf
