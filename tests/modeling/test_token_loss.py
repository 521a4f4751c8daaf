"""token_cross_entropy against F.cross_entropy on float32 / float64 copies of the logits: loss and gradient."""

import pytest
import torch
import torch.nn.functional as F

from performer_hf.modeling import modeling_performer, slabs
from performer_hf.modeling.token_loss import token_cross_entropy

from ..tiny_models import random_ids, tiny_model


def _logits_and_labels(dtype, rows=37, classes=53, ignored=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, classes, generator=g) * 4).to(dtype)
    labels = torch.randint(0, classes, (rows,), generator=g)
    labels[torch.rand(rows, generator=g) < ignored] = -100
    return logits, labels


def _loss_and_grad(loss_fn, logits, labels, **kwargs):
    logits = logits.detach().requires_grad_()
    loss = loss_fn(logits, labels, **kwargs)
    weight = torch.tensor(1.7, dtype=loss.dtype)  # an upstream gradient other than 1
    (loss * weight).backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("chunk_elements", [1 << 24, 100])  # one chunk; many, the last one short
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_loss_and_gradient_match_cross_entropy_in_float32(monkeypatch, dtype, chunk_elements):
    monkeypatch.setitem(slabs.SLAB_ELEMENTS["cpu"], "loss", chunk_elements)
    logits, labels = _logits_and_labels(dtype)
    wide = torch.promote_types(dtype, torch.float32)  # the reference: F.cross_entropy on a float32 copy
    want_loss, want_grad = _loss_and_grad(lambda x, y: F.cross_entropy(x.to(wide), y), logits, labels)
    got_loss, got_grad = _loss_and_grad(token_cross_entropy, logits, labels)
    assert got_loss.dtype == wide and got_grad.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(got_loss, want_loss, rtol=tolerance, atol=tolerance)
    if dtype == torch.bfloat16:  # both gradients are rounded to bfloat16 from float32
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-2, atol=1e-4)
    else:
        torch.testing.assert_close(got_grad, want_grad, rtol=tolerance, atol=tolerance)
    assert got_grad[labels == -100].abs().max() == 0  # unscored rows get no gradient


def test_shapes_and_num_items_in_batch_follow_the_trainer_convention():
    logits, labels = _logits_and_labels(torch.float32, rows=24)
    batched, batched_labels = logits.view(2, 12, -1), labels.view(2, 12)
    summed = F.cross_entropy(logits, labels, reduction="sum")
    torch.testing.assert_close(token_cross_entropy(batched, batched_labels, num_items_in_batch=7), summed / 7)
    torch.testing.assert_close(token_cross_entropy(batched, batched_labels), F.cross_entropy(logits, labels))


def test_no_scored_token_gives_nan_as_cross_entropy():
    logits, _ = _logits_and_labels(torch.float32, rows=5)
    labels = torch.full((5,), -100)
    assert torch.isnan(F.cross_entropy(logits, labels)) and torch.isnan(token_cross_entropy(logits, labels))


@pytest.mark.parametrize("label", [53, -1, -101])
def test_a_label_outside_the_vocabulary_is_an_error_naming_it(label):
    """A label past the vocabulary or negative (but -100) is a ValueError naming the label, the range and the likely
    cause (it ended in torch's 'index 53 is out of bounds for dimension 1 with size 53' inside the loss)."""
    logits, labels = _logits_and_labels(torch.float32, rows=5, classes=53)
    labels[2] = label
    with pytest.raises(
        ValueError, match=rf"labels hold {label}, out of range: .* 53 classes \(labels 0 to 52, or -100"
    ):
        token_cross_entropy(logits, labels)
    labels[2] = -100  # not scored: no error
    token_cross_entropy(logits, labels)


@pytest.mark.parametrize("head", ["PerformerForMaskedLM", "PerformerForCausalLM", "PerformerForTokenClassification"])
def test_a_models_labels_outside_its_vocabulary_are_named(head):
    """Through the heads: a collator's -1 for ignored tokens, or a label at vocab_size."""
    cls = getattr(modeling_performer, head)
    model = tiny_model(cls, attention_kernel="exact", is_decoder=head == "PerformerForCausalLM")
    ids = random_ids(2, 11)
    classes = model.config.num_labels if head == "PerformerForTokenClassification" else model.config.vocab_size
    for label in (classes, -1):
        labels = ids.clone() % classes
        labels[0, 3] = label
        with pytest.raises(ValueError, match=rf"labels hold {label}, out of range: .*-1 \(not -100\)"):
            model(input_ids=ids, labels=labels)


def test_backward_keeps_no_float32_copy_of_the_logits():
    """What backward saves: the logits themselves (not a float32 copy, not a log-softmax) and per-row vectors."""
    logits, labels = _logits_and_labels(torch.bfloat16, rows=64, classes=1000)
    logits.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_cross_entropy(logits, labels)
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16
