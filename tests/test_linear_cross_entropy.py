"""The chunked output layer + cross-entropy against an fp64 truth computed from the full logits (torch's own loss)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fat5.kernels.linear_cross_entropy import default_chunk_rows, linear_cross_entropy


def _truth(hidden, weight, labels, grad_ce, grad_z, *, label_smoothing=0.0, z_loss=0.0, reduction="mean"):
    """fp64 losses and gradients through the materialised logits: torch's cross_entropy and z * logsumexp**2."""
    hidden = hidden.detach().double().requires_grad_()
    weight = weight.detach().double().requires_grad_()
    logits = (hidden @ weight.T).reshape(-1, weight.shape[0])
    flat = labels.reshape(-1)
    counted = flat != -100
    ce = F.cross_entropy(logits, flat, ignore_index=-100, label_smoothing=label_smoothing, reduction="sum")
    z = z_loss * (torch.logsumexp(logits, dim=-1).square() * counted).sum()
    if reduction == "mean":
        normaliser = max(int(counted.sum()), 1)
        ce, z = ce / normaliser, z / normaliser
    grads = torch.autograd.grad(grad_ce * ce + grad_z * z, (hidden, weight))
    return ce.detach(), z.detach(), grads


def _run(hidden, weight, labels, grad_ce, grad_z, **options):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    ce, z = linear_cross_entropy(hidden, weight, labels, **options)
    (grad_ce * ce + grad_z * z).backward()
    return ce, z, (hidden.grad, weight.grad)


def _close(actual, expected, tolerance=1e-5):
    # the absolute floor: a one-class vocabulary's gradient is exactly 0 in fp64, fp32 rounding residue here (1e-7)
    return (actual.double() - expected).norm() <= tolerance * expected.norm() + 1e-5


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 9),
    vocab_size=st.sampled_from([1, 7, 300, 2500]),  # 2500: several kernel blocks, not a power of two
    chunk_rows=st.sampled_from([1, 3, None]),
    label_smoothing=st.sampled_from([0.0, 0.1]),
    z_loss=st.sampled_from([0.0, 1e-3]),
    reduction=st.sampled_from(["mean", "sum"]),
    upstream=st.sampled_from([(1.0, 1.0), (0.5, 2.0), (1.0, 0.0)]),
    backend=st.sampled_from(["reference", "triton"]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.interpreter
def test_matches_the_materialised_logits(
    rows, vocab_size, chunk_rows, label_smoothing, z_loss, reduction, upstream, backend, seed
):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 16, generator=generator)
    weight = torch.randn(vocab_size, 16, generator=generator)
    labels = torch.randint(0, vocab_size, (rows,), generator=generator)
    labels[torch.rand(rows, generator=generator) < 0.25] = -100
    options = {"label_smoothing": label_smoothing, "z_loss": z_loss, "reduction": reduction}
    ce, z, grads = _run(hidden, weight, labels, *upstream, chunk_rows=chunk_rows, backend=backend, **options)
    expected_ce, expected_z, expected_grads = _truth(hidden, weight, labels, *upstream, **options)
    assert ce.dtype == z.dtype == torch.float32 and ce.shape == z.shape == ()
    assert abs(ce.item() - expected_ce.item()) <= 1e-5 * abs(expected_ce.item()) + 1e-6
    assert abs(z.item() - expected_z.item()) <= 1e-5 * abs(expected_z.item()) + 1e-9
    for actual, expected in zip(grads, expected_grads):
        assert _close(actual, expected, 1e-4)


@pytest.mark.interpreter
def test_unused_output_frozen_weight_and_leading_dimensions():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(50, 8)  # frozen, as an output layer under LoRA
    labels = torch.randint(0, 50, (2, 5))
    ce, _ = linear_cross_entropy(hidden, weight, labels, z_loss=1e-2, chunk_rows=4, backend="triton")
    ce.backward()  # the z-loss term unused: its upstream gradient is zero, not one
    _, _, (expected, _) = _truth(hidden, weight, labels, 1.0, 0.0, z_loss=1e-2)
    assert hidden.grad.shape == hidden.shape and weight.grad is None
    assert _close(hidden.grad, expected)


def test_autocast_computes_in_its_dtype_and_returns_the_parameters_dtypes():
    torch.manual_seed(0)
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    labels = torch.randint(0, 40, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce, _ = linear_cross_entropy(hidden, weight, labels, chunk_rows=4, backend="reference")
        expected = F.cross_entropy(F.linear(hidden, weight).float(), labels)
    ce.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    assert abs(ce.item() - expected.item()) < 1e-3 * expected.item()  # both from the same bf16 products


def test_default_chunk_holds_512_mib_of_logits():
    assert default_chunk_rows(250112, 2) == 1073
    assert default_chunk_rows(32128, 4) == 4177
    assert default_chunk_rows(2**30, 2) == 1


@pytest.mark.parametrize(
    "hidden, weight, labels, options, error, match",
    [
        (torch.randn(3, 8), torch.randn(10, 4), torch.zeros(3, dtype=torch.long), {}, ValueError, "same d"),
        (torch.randn(3, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), {}, ValueError, "labels"),
        (torch.randn(3, 8), torch.randn(10, 8), torch.zeros(3), {}, TypeError, "integer class indices"),
        (torch.randn(3, 8), torch.randn(10, 8), torch.zeros(3, dtype=torch.long), {"chunk_rows": 0}, ValueError,
         "chunk_rows"),
        (torch.randn(3, 8), torch.randn(10, 8), torch.zeros(3, dtype=torch.long), {"reduction": "none"}, ValueError,
         "reduction"),
        (torch.randn(3, 8), "weight", torch.zeros(3, dtype=torch.long), {}, TypeError, "tensors"),
    ],
)
def test_bad_input_raises_clear_errors(hidden, weight, labels, options, error, match):
    with pytest.raises(error, match=match):
        linear_cross_entropy(hidden, weight, labels, **options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_matches_the_unfused_loss_at_a_large_vocabulary():
    from fat5.kernels.cross_entropy import cross_entropy

    torch.manual_seed(0)
    hidden = (torch.randn(1024, 512, device="cuda") * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(250112, 512, device="cuda") * 0.05).bfloat16().requires_grad_()
    labels = torch.randint(0, 250112, (1024,), device="cuda")
    ce, z = linear_cross_entropy(hidden, weight, labels, z_loss=1e-4)
    (ce + z).backward()
    grads = hidden.grad.float(), weight.grad.float()
    hidden.grad = weight.grad = None
    expected_ce, expected_z = cross_entropy(hidden @ weight.T, labels, z_loss=1e-4)
    (expected_ce + expected_z).backward()
    assert abs(ce.item() - expected_ce.item()) < 1e-3 * expected_ce.item()
    for actual, expected in zip(grads, (hidden.grad.float(), weight.grad.float())):
        assert ((actual - expected).norm() / expected.norm()).item() < 1e-2


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_model_trains_on_the_chunked_loss_as_on_the_logits(tie_word_embeddings, backend):
    # the same weights with and without use_chunked_lm_loss: one loss, one set of gradients (the tied case scales
    # the decoder output by d_model**-0.5 first, as T5 v1.0 does). One layer of two heads: the loss reads only the
    # decoder's last states, and on the CPU the interpreter runs every attention kernel of the triton case
    from fat5 import FAT5Config, FAT5ForConditionalGeneration

    torch.manual_seed(0)
    config = FAT5Config(
        vocab_size=301, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0, z_loss=1e-3,
        label_smoothing=0.1, tie_word_embeddings=tie_word_embeddings, attention_backend=backend,
        decoder_start_token_id=0, pad_token_id=0,
    )
    plain = FAT5ForConditionalGeneration(config).train()
    chunked = FAT5ForConditionalGeneration(FAT5Config(**{**config.to_dict(), "use_chunked_lm_loss": True}))
    chunked.load_state_dict(plain.state_dict())
    chunked.train()
    batch = {"input_ids": torch.randint(1, 301, (2, 9)), "labels": torch.randint(1, 301, (2, 5))}
    batch["labels"][1, 3:] = -100
    expected, actual = plain(**batch, return_loss_parts=True), chunked(**batch, return_loss_parts=True)
    assert actual.logits is None and expected.logits is not None
    for name in ("loss", "ce_loss", "z_loss"):
        assert torch.allclose(getattr(actual, name), getattr(expected, name), rtol=1e-5, atol=1e-7), name
    expected.loss.backward()
    actual.loss.backward()
    for (name, parameter), reference in zip(chunked.named_parameters(), plain.parameters()):
        assert torch.allclose(parameter.grad, reference.grad, rtol=1e-4, atol=1e-7), name
    chunked.eval()
    with torch.no_grad():
        evaluated = chunked(**batch)
    assert evaluated.logits is not None and torch.allclose(evaluated.loss, expected.loss, rtol=1e-5)


def test_model_keeps_the_logits_when_an_adapter_sits_on_the_output_layer():
    # the chunked loss reads lm_head.weight alone; a LoRA layer on lm_head adds its own product, so the model must
    # take the ordinary path (and give the adapter its gradient)
    from peft import LoraConfig, get_peft_model

    from fat5 import FAT5Config, FAT5ForConditionalGeneration

    torch.manual_seed(0)
    config = FAT5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4, dropout_rate=0.0,
        attention_backend="reference", decoder_start_token_id=0, pad_token_id=0, use_chunked_lm_loss=True,
    )
    model = get_peft_model(
        FAT5ForConditionalGeneration(config), LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False)
    ).train()
    output = model(input_ids=torch.randint(1, 64, (2, 6)), labels=torch.randint(1, 64, (2, 4)))
    assert output.logits is not None
    output.loss.backward()
    assert all(parameter.grad is not None for name, parameter in model.named_parameters() if "lora_" in name)
