// The Python module of the compiled CPU kernels: the one file that includes pybind11 with torch's tensor type casters
// (torch/csrc/utils/pybind.h: 23 s to compile here, where torch/extension.h, which adds the whole C++ frontend, took
// 55 s); the kernels' files include the ATen headers they use alone.
#include <torch/csrc/utils/pybind.h>

#include "hybrid_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace performer_hf;
  m.def("quadratic_far_state", &quadratic_far_state, "State of the polynomial far field over all keys");
  m.def("quadratic_far_apply", &quadratic_far_apply, "Far sums of the polynomial far field for every query");
  m.def("quadratic_far_state_backward", &quadratic_far_state_backward, "Gradients of quadratic_far_state");
  m.def("quadratic_far_apply_backward", &quadratic_far_apply_backward, "Gradients of quadratic_far_apply");
  m.def("top_blocks", &top_blocks, "Indices of the largest finite scores of each row");
  m.def("routed_candidates", &routed_candidates, "Grouped routing: the best key blocks of each query block's groups");
  m.def("sparse_decode_step", &sparse_decode_step, "Sparse attention's decoding step over a key/value cache");
  m.def("sparse_block_attend", &sparse_block_attend, "Sparse attention over one block of queries");
  m.def("sparse_walk_attend", &sparse_walk_attend, "Sparse attention over a call's queries, a block at a time");
  m.attr("max_value_width") = kMaxWidth;
  m.def("hybrid_support_sums", &hybrid_support_sums, "Fused exact-support sums of bidirectional hybrid attention");
  m.def("hybrid_support_sums_backward", &hybrid_support_sums_backward, "Gradients of hybrid_support_sums");
}
