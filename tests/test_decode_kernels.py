"""``decode_kernels="fused"``: a tiny model's decoding steps through the fused projections (``kernels.decode_linear``)
give the greedy ids of ``"separate"`` and its logits within rounding, in transformers' loop (the decoder layers) and
in the graphed step (run eagerly on the CPU); the kernels run through Triton's interpreter here, in bf16 on a GPU."""

import pytest
import torch
from helpers import TINY, padded_batch

import fat5.graphed_decoding
import fat5.modeling_fat5
from fat5 import FAT5Config, FAT5ForConditionalGeneration

pytestmark = pytest.mark.interpreter

_LOGITS_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def _pair(feed_forward_proj: str, dtype: torch.dtype, device: str = "cpu"):
    """The same weights under ``decode_kernels="separate"`` and ``"fused"``, in eval mode."""
    torch.manual_seed(0)
    models = []
    for decode_kernels in ("separate", "fused"):
        # one layer a stack: every kernel runs through the interpreter, and one layer chains all the fused calls
        config = FAT5Config(**{**TINY, "num_layers": 1, "num_decoder_layers": 1}, feed_forward_proj=feed_forward_proj,
                            attention_backend="triton", decode_kernels=decode_kernels,
                            tie_word_embeddings=feed_forward_proj == "relu")
        models.append(FAT5ForConditionalGeneration(config))
    models[1].load_state_dict(models[0].state_dict())
    return [model.to(device, dtype).eval() for model in models]


def _counted(monkeypatch, module, calls: list, residual_calls: list) -> None:
    """Count the calls of ``module``'s fused projections: the normed ones (their input's shape in ``calls``) and
    the output projections with their residual (in ``residual_calls``)."""
    for name, found in (("rms_norm_linear", calls), ("linear_residual", residual_calls)):
        original = getattr(module, name)

        def counting(*args, _original=original, _found=found, **kwargs):
            _found.append(args[0].shape)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)


def _generate(model, graphed: str, device: str = "cpu", **options):
    model.config.graphed_decoding = graphed
    input_ids, attention_mask, _ = padded_batch()
    return model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), max_new_tokens=4,
                          do_sample=False, output_logits=graphed == "never", return_dict_in_generate=True, **options)


def _check_same_decoding(monkeypatch, feed_forward_proj, dtype, graphed, device="cpu", **options):
    separate, fused = _pair(feed_forward_proj, dtype, device)
    calls, residual_calls = [], []
    _counted(monkeypatch, fat5.modeling_fat5 if graphed == "never" else fat5.graphed_decoding, calls, residual_calls)
    expected = _generate(separate, graphed, device, **options)
    assert not calls and not residual_calls, "the separate route ran a fused projection"
    actual = _generate(fused, graphed, device, **options)
    assert calls and residual_calls, "the fused route did not run both of its kernels"
    assert all(shape[-2] == 1 or len(shape) == 2 for shape in calls), "a prompt went through the fused route"
    if dtype != torch.bfloat16:
        assert torch.equal(actual.sequences, expected.sequences)
    if graphed == "never":
        _check_logits(actual, expected, dtype)


def _check_logits(actual, expected, dtype) -> None:
    """Each step's logits, up to the first step where a row's id differs (bf16 only: a near tie of random weights
    flips with one rounding; the later steps then decode other tokens)."""
    differing = (actual.sequences != expected.sequences).any(dim=0).nonzero()
    steps = len(expected.logits) if len(differing) == 0 else int(differing[0])
    for actual_logits, expected_logits in zip(actual.logits[:steps], expected.logits[:steps], strict=True):
        scale = expected_logits.float().abs().max()
        error = (actual_logits.float() - expected_logits.float()).abs().max()
        assert error <= _LOGITS_TOLERANCE[dtype] * scale, f"logits differ by {error} (scale {scale})"


# "never": transformers' loop, through the decoder layers; "always": the graphed step (eager on the CPU)
@pytest.mark.parametrize(("graphed", "feed_forward_proj"), [("never", "gated-gelu"), ("never", "relu"),
                                                            ("always", "gated-gelu")])
def test_fused_decoding_gives_the_separate_routes_ids_fp32(monkeypatch, graphed, feed_forward_proj):
    _check_same_decoding(monkeypatch, feed_forward_proj, torch.float32, graphed)


def test_fused_decoding_into_a_static_cache(monkeypatch):
    """transformers' static cache, not compiled on the CPU: the fused projections beside its fixed-size buffers."""
    _check_same_decoding(monkeypatch, "gated-gelu", torch.float32, "never", cache_implementation="static")


def test_beam_search_through_the_fused_graphed_step(monkeypatch):
    _check_same_decoding(monkeypatch, "gated-gelu", torch.float32, "always", num_beams=2)


def test_fused_decoding_gives_the_separate_routes_ids_fp16(monkeypatch):
    _check_same_decoding(monkeypatch, "gated-gelu", torch.float16, "never")


def test_training_and_the_prompt_keep_the_separate_route(monkeypatch):
    """A forward with labels (grad, training) under "fused" computes what "separate" computes, without the kernels."""
    separate, fused = _pair("gated-gelu", torch.float32)
    calls, residual_calls = [], []
    _counted(monkeypatch, fat5.modeling_fat5, calls, residual_calls)
    input_ids, attention_mask, labels = padded_batch()
    losses = [model.train()(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
              for model in (separate, fused)]
    assert not calls and not residual_calls
    assert torch.equal(losses[0], losses[1])


def test_a_wrong_value_is_named():
    with pytest.raises(ValueError, match=r"decode_kernels must be one of \('separate', 'fused'\).*'fast'"):
        FAT5Config(decode_kernels="fast")


def test_the_default_is_separate_and_saved(tmp_path):
    assert FAT5Config().decode_kernels == "separate"
    FAT5Config(decode_kernels="fused").save_pretrained(tmp_path)
    assert FAT5Config.from_pretrained(tmp_path).decode_kernels == "fused"


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", ["never", "auto"])
def test_fused_decoding_on_the_gpu_fp32(monkeypatch, graphed):
    """With "auto", the captured CUDA graph of the step."""
    _check_same_decoding(monkeypatch, "gated-gelu", torch.float32, graphed, device="cuda")


@pytest.mark.gpu
def test_fused_decoding_on_the_gpu_bf16(monkeypatch):
    _check_same_decoding(monkeypatch, "gated-gelu", torch.bfloat16, "never", device="cuda")
