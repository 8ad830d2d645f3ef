"""Finetuning metrics: ROUGE as `evaluate`'s "rouge" computes it, accuracy and F1, and their Trainer wrappers.

`evaluate.load("rouge")` fetches its script from the Hub, which offline machines and CI cannot reach, so `rouge`
below is the same computation written against the `rouge_score` package (`evaluate`'s rouge is a thin wrapper
around it): one `RougeScorer` over all pairs, F-measures aggregated by `rouge_score`'s `BootstrapAggregator`
(its ``mid`` estimate) or returned per example.

The training logs' helpers close the module: numeric progress lines and the loss curve, which
``python -m fat5.trainer.metrics RUN/pretrain_summary.json`` draws from a finished run (`loss_curve_command`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import FAT5Error

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _rouge_score_modules():
    try:
        from rouge_score import rouge_scorer, scoring
    except ImportError as error:
        raise FAT5Error("ROUGE needs the `rouge_score` package: pip install rouge_score") from error
    return rouge_scorer, scoring


class _CallableTokenizer:
    """Adapts a ``str -> list[str]`` callable to the ``tokenize`` method rouge_score's scorer calls."""

    def __init__(self, tokenize: Callable[[str], list[str]]):
        self.tokenize = tokenize


def rouge(
    predictions: Sequence[str],
    references: Sequence[str] | Sequence[Sequence[str]],
    rouge_types: Sequence[str] | None = None,
    use_aggregator: bool = True,
    use_stemmer: bool = False,
    tokenizer: Callable[[str], list[str]] | None = None,
) -> dict:
    """ROUGE F-measures of ``predictions`` against ``references``, with `evaluate.load("rouge").compute`'s
    arguments, defaults and results.

    ``references`` holds one string per prediction, or a list of strings (several references; the best one counts).
    Returns ``{rouge_type: float}`` (the bootstrap ``mid`` F-measure, in [0, 1]) with ``use_aggregator``, else
    ``{rouge_type: [one F-measure per example]}``. ``rougeLsum`` treats newlines as sentence breaks, so put each
    sentence on its own line (see `split_sentences`). rouge_score's default tokenizer keeps only ``[a-z0-9]``
    (lower-cased): pass ``tokenizer`` (``str -> list[str]``) for text in other scripts or with accents.
    """
    rouge_scorer, scoring = _rouge_score_modules()
    if len(predictions) != len(references):
        raise ValueError(f"rouge: {len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise ValueError("rouge: no predictions to score")
    rouge_types = list(ROUGE_TYPES if rouge_types is None else rouge_types)
    unknown = [name for name in rouge_types if not re.fullmatch(r"rouge([1-9]|L|Lsum)", name)]
    if unknown:
        raise ValueError(f"rouge: unknown rouge types {unknown}; known: rouge1..rouge9, rougeL, rougeLsum")
    scorer = rouge_scorer.RougeScorer(
        rouge_types=rouge_types,
        use_stemmer=use_stemmer,
        tokenizer=_CallableTokenizer(tokenizer) if tokenizer is not None else None,
    )
    multiple_references = isinstance(references[0], (list, tuple))
    scores = [
        scorer.score_multi(reference, prediction) if multiple_references else scorer.score(reference, prediction)
        for reference, prediction in zip(references, predictions)
    ]
    if not use_aggregator:
        return {name: [score[name].fmeasure for score in scores] for name in rouge_types}
    aggregator = scoring.BootstrapAggregator()
    for score in scores:
        aggregator.add_scores(score)
    return {name: float(value.mid.fmeasure) for name, value in aggregator.aggregate().items()}


def split_sentences(text: str) -> str:
    """One sentence per line (after ``.``, ``!`` or ``?`` followed by a space), the form ``rougeLsum`` expects.

    A dependency-free stand-in for the ``nltk.sent_tokenize`` that transformers' summarisation example uses (whose
    model needs a download).
    """
    return "\n".join(sentence for sentence in _SENTENCE_END.split(text.strip()) if sentence)


def _decode(tokenizer, token_ids: np.ndarray) -> list[str]:
    # the evaluation loop pads predictions and labels of different lengths with -100
    token_ids = np.where(token_ids < 0, tokenizer.pad_token_id, token_ids)
    return tokenizer.batch_decode(token_ids, skip_special_tokens=True)


def rouge_metric(tokenizer, rouge_types: Sequence[str] | None = None, use_stemmer: bool = True) -> Callable:
    """A ``compute_metrics`` for `Seq2SeqTrainer` with ``predict_with_generate=True``: decodes the generated ids and
    the labels, and returns ROUGE F-measures (x100) and ``gen_len``, the mean generated length in tokens.

    As transformers' ``run_summarization.py`` computes them (stemming on, one sentence per line for ``rougeLsum``),
    except that each score is the plain mean over the examples, the quantity `evaluate`'s bootstrap ``mid``
    estimates with random resampling: the same predictions always give the same scores. Without the
    `rouge_score` package it raises FAT5Error now, not at the first evaluation.
    """
    _rouge_score_modules()

    def compute_metrics(eval_prediction) -> dict:
        predictions = eval_prediction.predictions
        predictions = predictions[0] if isinstance(predictions, tuple) else predictions
        predictions = np.asarray(predictions)
        predicted_texts = [split_sentences(text) for text in _decode(tokenizer, predictions)]
        reference_texts = [split_sentences(text) for text in _decode(tokenizer, np.asarray(eval_prediction.label_ids))]
        scores = rouge(
            predicted_texts, reference_texts, rouge_types=rouge_types, use_aggregator=False, use_stemmer=use_stemmer
        )
        result = {name: round(100.0 * float(np.mean(values)), 4) for name, values in scores.items()}
        generated = (predictions >= 0) & (predictions != tokenizer.pad_token_id)
        result["gen_len"] = round(float(generated.sum(axis=-1).mean()), 4)
        return result

    return compute_metrics


def classification_scores(predicted: np.ndarray, expected: np.ndarray) -> dict:
    """Accuracy and macro-averaged F1 (over the classes present in either array) of integer class predictions."""
    predicted, expected = np.asarray(predicted).ravel(), np.asarray(expected).ravel()
    if predicted.shape != expected.shape or predicted.size == 0:
        raise ValueError(f"classification_scores: got {predicted.size} predictions for {expected.size} labels")
    f1_scores = []
    for label in np.union1d(predicted, expected):
        true_positives = np.sum((predicted == label) & (expected == label))
        predicted_count, expected_count = np.sum(predicted == label), np.sum(expected == label)
        f1_scores.append(2.0 * true_positives / (predicted_count + expected_count))
    return {"accuracy": float(np.mean(predicted == expected)), "f1_macro": float(np.mean(f1_scores))}


def sequence_classification_metric(eval_prediction) -> dict:
    """``compute_metrics`` for a sequence classification head: accuracy and macro F1, or MSE for one output."""
    logits = eval_prediction.predictions
    logits = np.asarray(logits[0] if isinstance(logits, tuple) else logits)
    labels = np.asarray(eval_prediction.label_ids)
    if logits.ndim == 1 or logits.shape[-1] == 1:
        return {"mse": float(np.mean((logits.reshape(-1) - labels.reshape(-1).astype(np.float64)) ** 2))}
    return classification_scores(logits.argmax(axis=-1), labels)


def token_classification_metric(eval_prediction) -> dict:
    """``compute_metrics`` for a token classification head: accuracy and macro F1 over the labelled tokens
    (label ``-100`` marks padding, special tokens and the continuation pieces of a word)."""
    logits = eval_prediction.predictions
    logits = np.asarray(logits[0] if isinstance(logits, tuple) else logits)
    labels = np.asarray(eval_prediction.label_ids)
    labelled = labels != -100
    return classification_scores(logits.argmax(axis=-1)[labelled], labels[labelled])


# ----------------------------------------------------------------------------------------------- training logs

LOG_SIGNIFICANT_DIGITS = 4


def readable_logs(logs: dict) -> dict:
    """``logs`` with every float rounded to ``LOG_SIGNIFICANT_DIGITS`` significant digits, still a number (where
    transformers' progress bar prints ``'tokens_per_second': '1.453e+04'``, a string); ``total_flos`` left out."""
    return {
        key: float(f"{value:.{LOG_SIGNIFICANT_DIGITS}g}") if isinstance(value, float) else value
        for key, value in logs.items()
        if key != "total_flos"
    }


def numeric_progress_callback():
    """transformers' ``ProgressCallback`` (the tqdm bar) whose log lines keep numbers numbers."""
    from transformers.trainer_callback import ProgressCallback

    class NumericProgressCallback(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and self.training_bar is not None:
                self.training_bar.write(str(readable_logs(logs)))

    return NumericProgressCallback


def plot_loss_curve(log_history: list[dict], path) -> bool:
    """Draw the training (and evaluation) loss of a Trainer's ``log_history`` against the step into the PNG
    ``path``; False, with nothing written, when matplotlib is not installed (``pip install matplotlib``)."""
    import os
    from pathlib import Path

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    path = Path(path)
    figure, axes = plt.subplots(figsize=(6, 4))
    for key, label in (("loss", "training loss"), ("eval_loss", "evaluation loss")):
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry and "step" in entry]
        if points:
            steps, losses = zip(*points)
            axes.plot(steps, losses, marker="o" if key == "eval_loss" else None, label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_yscale("log")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    temporary = path.with_name(f".{path.name}.tmp")
    figure.savefig(temporary, dpi=100, format="png")
    plt.close(figure)
    os.replace(temporary, path)
    return True


def loss_curve_command(summary_path) -> str:
    """The command that draws ``loss_curve.png`` beside a run's ``pretrain_summary.json`` (``summary_path``) with
    this Python: what `fat5 pretrain` prints where matplotlib is not installed."""
    import shlex
    import sys

    return f"{shlex.quote(sys.executable)} -m {__name__} {shlex.quote(str(summary_path))}"


def main(argv=None) -> int:
    """``python -m fat5.trainer.metrics RUN/pretrain_summary.json``: draw ``RUN/loss_curve.png`` from the log history
    the summary holds. A mistake is one line on stderr, with exit status 2."""
    import json
    import shlex
    import sys
    from pathlib import Path

    arguments = sys.argv[1:] if argv is None else list(argv)
    if len(arguments) != 1:
        print(f"usage: python -m {__name__} RUN/pretrain_summary.json", file=sys.stderr)
        return 2
    summary = Path(arguments[0])
    try:
        history = json.loads(summary.read_text(encoding="utf-8"))["log_history"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"cannot read a log history from {summary} ({error}): give a run's pretrain_summary.json",
              file=sys.stderr)
        return 2
    curve = summary.with_name("loss_curve.png")
    if not plot_loss_curve(history, curve):
        print(f"matplotlib is not installed: {shlex.quote(sys.executable)} -m pip install matplotlib", file=sys.stderr)
        return 2
    print(f"loss curve: {curve}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
