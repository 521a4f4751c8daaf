// Compiled CPU loop of sparse attention over the queries of a call from the first token, one block of queries at a
// time (the PyTorch version is sparse_attention._BlockWalk.walk over _query_block): each block's logits of its
// global tokens and window, its window's visibility and its candidates (every stored key before its window) are
// formed here and passed to sparse_block_attend. In Python these took about 40 small operations a block: at 8K
// tokens, 128 blocks a layer, 5% of one Llama layer's prefill (0.588 s against 0.559 s compiled).
#include "hybrid_kernels.h"

#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>

namespace performer_hf {

std::vector<at::Tensor> sparse_walk_attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                           const at::Tensor& key_mask, const at::Tensor& selectable,
                                           const std::vector<at::Tensor>& globals,
                                           const std::vector<int64_t>& geometry) {
  const int64_t block = geometry[0], select = geometry[1], window_blocks = geometry[2], first = geometry[3];
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), Hkv = keys.size(1), G = H / Hkv;
  const int64_t Dv = values.size(3), end = first + L;
  TORCH_CHECK(globals.size() == 3 && H % Hkv == 0 && keys.size(2) >= end && key_mask.dim() == 2 &&
                  key_mask.scalar_type() == at::kBool && selectable.scalar_type() == at::kBool,
              "sparse_walk_attend takes queries (B, H, L, D), keys and values (B, Hkv, R, D) with R >= first + L, "
              "bool key masks (B, R) and the global tokens' keys, values and mask");
  const at::Tensor& global_keys = globals[0];
  const at::Tensor& global_values = globals[1];
  const at::Tensor& global_mask = globals[2];
  const at::Tensor real = key_mask.contiguous();
  const bool* real_keys = real.data_ptr<bool>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const int64_t last_window = std::max<int64_t>(0, (end - 1) / block - window_blocks) * block;
  const int64_t N = select ? last_window / block : 0;  // the last block's candidate blocks
  auto context = at::empty({B, Hkv, G, L, Dv}, q.options());
  auto lse = at::empty({B, Hkv, G, L}, q.options());
  auto chosen = at::zeros({B, Hkv, L, N}, q.options().dtype(at::kBool));
  // buffers for every block, sized for the largest (the last block's candidates, a whole window): allocated per
  // block, buffers of megabytes were mapped afresh and their pages faulted in once the model's own buffers had moved
  // the allocator's thresholds (SmolLM2's forward at 4K tokens: 773K page faults against SDPA's 550K)
  const int64_t rows = B * Hkv * G * std::min(block, L);
  auto scratch = at::empty({N ? rows * (last_window + 2 * N) : 0}, q.options());
  auto window_logits = at::empty({rows * (window_blocks + 1) * block}, q.options());
  for (int64_t lo = first; lo < end;) {
    const int64_t hi = std::min(end, (lo / block + 1) * block), nq = hi - lo;
    const int64_t window_lo = std::max<int64_t>(0, lo / block - window_blocks) * block, width = hi - window_lo;
    auto flat = (q.narrow(2, lo - first, nq).unflatten(1, {Hkv, G}).flatten(2, 3).mul(scale)).contiguous();
    std::vector<at::Tensor> logits, runs, masks;  // the global tokens outside the window, then the window
    const int64_t outside = std::min(global_keys.size(2), window_lo);
    if (outside) {
      logits.push_back(at::matmul(flat, global_keys.narrow(2, 0, outside).transpose(-1, -2)));
      runs.push_back(global_values.narrow(2, 0, outside));
      masks.push_back(global_mask.narrow(1, 0, outside).unsqueeze(1).unsqueeze(1).expand({B, Hkv, nq, outside}));
    }
    auto window = window_logits.narrow(0, 0, B * Hkv * G * nq * width).view({B, Hkv, G * nq, width});
    logits.push_back(at::matmul_out(window, flat, keys.narrow(2, window_lo, width).transpose(-1, -2)));
    runs.push_back(values.narrow(2, window_lo, width));
    auto visible = at::empty({B, 1, nq, width}, key_mask.options());  // a query sees itself and real keys before
    bool* seen = visible.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t t = 0; t < width; ++t) {
          const int64_t key = window_lo + t, query = lo + i;
          seen[(b * nq + i) * width + t] = key == query || (key < query && real_keys[b * real.size(1) + key]);
        }
    masks.push_back(visible.expand({B, Hkv, nq, width}));
    std::vector<at::Tensor> candidates;  // every stored key before the window
    if (window_lo && select)
      candidates = {flat, keys.narrow(2, 0, window_lo), values.narrow(2, 0, window_lo),
                    selectable.narrow(1, 0, window_lo).unsqueeze(1).unsqueeze(1).expand({B, Hkv, nq, window_lo})};
    auto out = sparse_block_attend_within(logits, runs, masks, candidates, {G, block, select}, scratch);
    context.narrow(3, lo - first, nq).copy_(out[0].view({B, Hkv, G, nq, Dv}));
    lse.narrow(3, lo - first, nq).copy_(out[3].view({B, Hkv, G, nq}));
    if (!candidates.empty()) chosen.narrow(2, lo - first, nq).narrow(3, 0, window_lo / block).copy_(out[2]);
    lo = hi;
  }
  return {context.flatten(1, 2), N ? chosen : at::empty({0}, chosen.options()), lse};
}

}  // namespace performer_hf
