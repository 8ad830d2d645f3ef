"""Numerical check of a conversion: both models on one random, padded batch, in fp32 on the CPU; and the loading
report of a written model, which must load back with no weight missing, unexpected or mismatched."""

from pathlib import Path

import torch


def comparison_batch(
    vocab_size: int,
    seed: int = 0,
    encoder_lengths: tuple[int, ...] = (13, 9, 4),
    decoder_lengths: tuple[int, ...] = (7, 5, 2),
) -> dict[str, torch.Tensor]:
    """A right-padded batch of random ids with its masks: rows of different lengths, so padding is exercised.

    Ids avoid 0 and 1 (pad and eos in T5 vocabularies) only to look like text; the models treat every id alike.
    """
    generator = torch.Generator().manual_seed(seed)
    low = 2 if vocab_size > 2 else 0

    def padded(lengths):
        ids = torch.randint(low, vocab_size, (len(lengths), max(lengths)), generator=generator)
        mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
        return ids.masked_fill(~mask, 0), mask.long()

    input_ids, attention_mask = padded(encoder_lengths)
    decoder_input_ids, decoder_attention_mask = padded(decoder_lengths)
    decoder_input_ids[:, 0] = 0  # T5's decoder_start_token_id
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "decoder_input_ids": decoder_input_ids,
        "decoder_attention_mask": decoder_attention_mask,
    }


def relative_error(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """‖actual − expected‖ / ‖expected‖ in fp64, over the positions where `mask` (batch, length) is set."""
    actual, expected = actual.double(), expected.double()
    if mask is not None:
        keep = mask.bool()
        actual, expected = actual[keep], expected[keep]
    if not torch.isfinite(actual).all():
        return float("inf")
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@torch.no_grad()
def compare_outputs(reference: torch.nn.Module, candidate: torch.nn.Module, vocab_size: int, seq2seq: bool) -> dict:
    """Run both models on `comparison_batch` and return the relative errors of what they output.

    For an encoder-decoder: the encoder's last hidden states and the LM logits (`logits`) or, for a bare model, the
    decoder's last hidden states; for an encoder: its last hidden states. Padded positions are left out.
    """
    batch = comparison_batch(vocab_size)
    reference.eval()
    candidate.eval()
    if not seq2seq:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        expected = reference(**inputs).last_hidden_state
        actual = candidate(**inputs).last_hidden_state
        return {"encoder_relative_error": relative_error(actual, expected, batch["attention_mask"])}
    expected = reference(**batch)
    actual = candidate(**batch)
    output = "logits" if getattr(expected, "logits", None) is not None else "last_hidden_state"
    return {
        "encoder_relative_error": relative_error(
            actual.encoder_last_hidden_state, expected.encoder_last_hidden_state, batch["attention_mask"]
        ),
        f"{'logits' if output == 'logits' else 'decoder'}_relative_error": relative_error(
            getattr(actual, output), getattr(expected, output), batch["decoder_attention_mask"]
        ),
    }


def check_agreement(errors: dict, tolerance: float, what: str) -> None:
    """Raise `VerificationError` unless every relative error in `errors` is within `tolerance`."""
    from .checkpoint import ConversionError

    failing = {name: value for name, value in errors.items() if not value <= tolerance}
    if failing:
        details = ", ".join(f"{name} = {value:.3g}" for name, value in errors.items())
        raise ConversionError(
            f"verification failed: {what} disagree beyond the tolerance {tolerance:g} ({details}); nothing was written"
        )


class quiet_transformers:
    """Silence transformers' loading progress bars and warnings (the tie notice for untied FLAN-T5, among others)."""

    def __enter__(self):
        from transformers.utils import logging

        self._verbosity = logging.get_verbosity()
        self._bars = logging.is_progress_bar_enabled()
        logging.set_verbosity_error()
        logging.disable_progress_bar()

    def __exit__(self, *exc):
        from transformers.utils import logging

        logging.set_verbosity(self._verbosity)
        if self._bars:
            logging.enable_progress_bar()


def check_loading_info(info: dict, folder: Path) -> None:
    """Raise `ConversionError` unless `from_pretrained(folder, output_loading_info=True)`'s `info` is clean."""
    from .checkpoint import ConversionError

    problems = {key: value for key, value in info.items() if key != "error_msgs" and value} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    if problems:
        raise ConversionError(f"the model written to {folder} does not load back cleanly: {problems}")
