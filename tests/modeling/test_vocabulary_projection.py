"""The vocabulary projection with rows padded for the matrix kernels: the same logits, loss and gradients as the
plain product, in a view whose rows keep the padded length (from MIN_ROWS rows; forced here for tiny models)."""

import pytest
import torch
import torch.nn.functional as F

from performer_hf import PerformerForCausalLM, PerformerForMaskedLM
from performer_hf.modeling import vocabulary_projection
from performer_hf.modeling.token_loss import token_cross_entropy
from performer_hf.modeling.vocabulary_projection import ALIGNMENT, MIN_ROWS, alignment_for, vocabulary_logits

from ..tiny_models import VOCAB, random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


def _leaves(seed: int, rows: int, hidden: int, vocab: int, bias: bool, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(rows, hidden, generator=g), torch.randn(vocab, hidden, generator=g) / hidden**0.5]
    if bias:
        tensors.append(torch.randn(vocab, generator=g))
    return [t.to(device, dtype).requires_grad_() for t in tensors]


@pytest.mark.parametrize("vocab", [99, 128, 30])
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
def test_padded_logits_and_gradients_equal_the_plain_product(vocab, bias):
    """Against ``F.linear`` on the same leaves: logits, and the gradients of the hidden states, weight and bias
    under a random upstream gradient; rows padded to a multiple of 32 where the vocabulary is not one already."""
    hidden, weight, *rest = _leaves(0, 12, 16, vocab, bias)
    plain_leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, *rest)]
    logits = vocabulary_logits(hidden.view(3, 4, 16), weight, *rest, alignment=32)
    want = F.linear(plain_leaves[0].view(3, 4, 16), *plain_leaves[1:])
    assert logits.shape == want.shape == (3, 4, vocab)
    assert logits.stride(-2) == -(-vocab // 32) * 32  # rows of the padded length
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (logits * upstream).sum().backward()
    (want * upstream).sum().backward()
    for leaf, plain in zip((hidden, weight, *rest), plain_leaves, strict=True):
        assert leaf.grad.shape == leaf.shape
        torch.testing.assert_close(leaf.grad, plain.grad, rtol=1e-6, atol=1e-6)


def test_a_few_rows_are_not_padded_and_many_are():
    """Padding pays for large products only: below MIN_ROWS rows (decoding) the plain product; from MIN_ROWS on, on
    the CPU too, the padded one."""
    hidden, weight = _leaves(0, MIN_ROWS, 8, 99, bias=False)
    assert alignment_for(hidden[:-1]) == 1 and vocabulary_logits(hidden[:-1], weight).is_contiguous()
    assert alignment_for(hidden) == ALIGNMENT and vocabulary_logits(hidden, weight).stride(0) == 128


def test_a_model_pads_its_logits_from_min_rows_on():
    """Unforced, a causal LM's logits over 2 x 130 tokens (MIN_ROWS = 256 rows or more) are the padded view, equal
    to the product of its last hidden states with the tied embeddings."""
    model = tiny_model(PerformerForCausalLM, max_position_embeddings=160)
    with torch.no_grad():
        out = model(input_ids=random_ids(2, 130), output_hidden_states=True)
    assert out.logits.stride(-2) == 128
    want = out.hidden_states[-1] @ model.performer.embeddings.word_embeddings.weight.T  # (2, 130, VOCAB)
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)


def _autograd_nodes(loss: torch.Tensor) -> set[str]:
    """The names of every autograd node that ``loss``'s backward runs."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [fn for fn, _ in node.next_functions]
    return {type(node).__name__ for node in seen}


@pytest.mark.parametrize("chunks", [1, 3], ids=["one chunk", "three chunks"])
@pytest.mark.parametrize("asked", [None, "retain_grad", "hook"])
def test_the_token_loss_reads_the_padded_rows_whole(monkeypatch, asked, chunks):
    """The token loss of the padded view takes the product's rows themselves (its gradient goes to the product, no
    zero-filled copy through the view), with the loss and every gradient of the contiguous logits' loss, in one chunk
    of rows or several (a CPU's cache-sized chunks); where the logits' own gradient is asked for (retain_grad, a
    hook), it goes through the view and the logits get it."""
    from performer_hf.modeling import token_loss

    if chunks == 3:
        monkeypatch.setattr(token_loss, "_chunks", lambda logits: [slice(0, 7), slice(7, 16), slice(16, 24)])
    hidden, weight = _leaves(0, 24, 16, 99, bias=False)
    labels = torch.randint(0, 99, (24,), generator=torch.Generator().manual_seed(2))
    labels[::5] = -100
    logits = vocabulary_logits(hidden, weight, alignment=32)  # (24, 99) in rows of 128
    hooked = []
    if asked == "retain_grad":
        logits.retain_grad()
    elif asked == "hook":
        logits.register_hook(lambda grad: hooked.append(grad.shape))
    loss = token_cross_entropy(logits, labels)
    loss.backward()
    plain_hidden, plain_weight = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    want = F.cross_entropy(F.linear(plain_hidden, plain_weight), labels)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, plain_hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, plain_weight.grad, rtol=1e-5, atol=1e-6)
    sliced = any("Slice" in name for name in _autograd_nodes(loss))  # the view's backward: a zero-filled copy
    assert sliced == (asked is not None)
    if asked is not None:
        assert asked != "hook" or hooked == [(24, 99)]
        assert asked != "retain_grad" or logits.grad.shape == (24, 99)


def _padding_everywhere(monkeypatch):
    """Every product padded to ALIGNMENT, whatever its rows (a tiny model's are fewer than MIN_ROWS)."""
    monkeypatch.setattr(vocabulary_projection, "alignment_for", lambda hidden: ALIGNMENT)


@pytest.mark.parametrize("head", [PerformerForCausalLM, PerformerForMaskedLM])
def test_the_heads_logits_loss_and_gradients_are_unchanged_by_padding(monkeypatch, head):
    """A model's logits, loss and every parameter's gradient with the padded product equal the plain product's
    (VOCAB = 99 words padded to 128), and the logits come out as the padded view."""
    ids = random_ids(2, 11)
    results = []
    for padded in (False, True):
        if padded:
            _padding_everywhere(monkeypatch)
        model = tiny_model(head).train()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits.detach(), out.loss.detach(), grads))
    (plain_logits, plain_loss, plain_grads), (logits, loss, grads) = results
    assert logits.shape == (2, 11, VOCAB) and logits.stride(-2) == 128
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_generation_and_a_hooked_head_with_padding(monkeypatch):
    """Greedy generation reads the padded logits as the plain ones (same tokens); a head with a forward hook (an
    adapter, offloading) still runs its own call, whose change reaches the logits."""
    ids = random_ids(2, 7)
    model = tiny_model(PerformerForCausalLM)
    plain = model.generate(ids, max_new_tokens=5, do_sample=False)
    _padding_everywhere(monkeypatch)
    torch.testing.assert_close(model.generate(ids, max_new_tokens=5, do_sample=False), plain, rtol=0, atol=0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        model.lm_head.register_forward_hook(lambda module, args, output: output * 2)
        hooked = model(input_ids=ids).logits
    assert hooked.is_contiguous()  # the head's own call: not the padded product
    torch.testing.assert_close(hooked, 2 * logits)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_pads_large_products_and_matches_the_plain_product(dtype):
    """On CUDA at GPT-2's vocabulary (50,257 words) and 1,024 rows: the logits' rows padded to 50,304, the same
    logits and gradients as ``F.linear`` within the dtype's rounding; a few rows (decoding) are not padded."""
    hidden, weight = _leaves(0, 1024, 384, 50257, bias=False, device="cuda", dtype=dtype)
    plain_hidden, plain_weight = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    logits = vocabulary_logits(hidden, weight)
    want = F.linear(plain_hidden, plain_weight)
    assert logits.stride(0) == 50304
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(logits, want, **tolerance)
    upstream = torch.randn_like(want)
    (logits * upstream).sum().backward()
    (want * upstream).sum().backward()
    torch.testing.assert_close(hidden.grad, plain_hidden.grad, **tolerance)
    torch.testing.assert_close(weight.grad, plain_weight.grad, **tolerance)
    assert vocabulary_logits(hidden[: MIN_ROWS - 1], weight).is_contiguous()
