"""A small T5-style tokenizer trained with `tokenizers`, and the UL2 token ids read from any tokenizer.

Layout of a trained tokenizer, as in T5: ``<pad>`` = 0 (also the decoder start token), ``</s>`` = 1,
``<unk>`` = 2, then the UL2 mode prefixes ``[R]``, ``[S]``, ``[X]``, the learned pieces, and last the sentinels
``<extra_id_{N-1}>, ..., <extra_id_0>``, so that ``<extra_id_0>`` has the highest id. Pieces use SentencePiece's
``▁`` word-boundary marker (Metaspace), so text round-trips through encode/decode. The result is a
``PreTrainedTokenizerFast`` that ``AutoTokenizer.from_pretrained`` reloads after ``save_pretrained``; it appends
``</s>`` when ``add_special_tokens=True``, like T5's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ..errors import FAT5Error

PAD_TOKEN = "<pad>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
UL2_PREFIXES = ("[R]", "[S]", "[X]")
# part of a trained tokenizer's fingerprint: raise it when train_tokenizer makes another tokenizer of the same texts
TRAINING_REVISION = 1
TOKENIZER_MODELS = ("unigram", "bpe")
_SENTINEL_PATTERN = re.compile(r"<extra_id_(\d+)>")


def sentinel_token(index: int) -> str:
    """The T5 name of sentinel ``index``: ``<extra_id_{index}>``."""
    return f"<extra_id_{index}>"


def train_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int = 4096,
    num_sentinels: int = 256,
    model: str = "unigram",
    prefixes: Sequence[str] = UL2_PREFIXES,
    model_max_length: int = 1024,
    save_directory: str | os.PathLike | None = None,
    show_progress: bool = False,
):
    """Train a T5-style tokenizer on ``texts`` and return it as a ``PreTrainedTokenizerFast``.

    Args:
        texts: the training text (an iterable of strings, read once).
        vocab_size: size of the learned vocabulary, special tokens included, sentinels not.
        num_sentinels: how many ``<extra_id_i>`` to add (T5 has 100; 256 covers UL2's r=0.5, mu=3 denoiser on
            1024-token inputs, which needs about 171).
        model: ``"unigram"`` (T5's SentencePiece model) or ``"bpe"``.
        prefixes: the UL2 mode tokens to reserve (ids 3, 4, 5 by default).
        model_max_length: recorded in the tokenizer config.
        save_directory: where to ``save_pretrained`` it, if given: written whole (in a temporary folder beside it,
            loaded back, then renamed) or not at all.
        show_progress: show the `tokenizers` trainer's progress bar.

    A Ctrl-C stops it at once (KeyboardInterrupt: see `TokenizerTraining`), with nothing saved.
    """
    training = TokenizerTraining(texts, vocab_size=vocab_size, num_sentinels=num_sentinels, model=model,
                                 prefixes=prefixes, model_max_length=model_max_length, show_progress=show_progress)
    return training.result(save_directory)


# the child process that trains: it imports fat5.trainer.tokenizer without running fat5/__init__.py (torch and
# transformers, seconds), from the package folder its parent names
_TRAINING_CHILD = """
import importlib.util, os, sys
package = sys.argv[1]
sys.modules["fat5"] = importlib.util.module_from_spec(importlib.util.spec_from_file_location(
    "fat5", os.path.join(package, "__init__.py"), submodule_search_locations=[package]))
from fat5.trainer.tokenizer import train_from_stdin
train_from_stdin()
"""


class TokenizerTraining:
    """`train_tokenizer`'s training, begun: the `tokenizers` trainer runs in a child process, which a Ctrl-C
    (KeyboardInterrupt) kills, and ``result()`` waits for it. It imports neither torch nor transformers until
    ``result()``, so a job may begin it, then import those while it trains.

    `tokenizers` trains in Rust, which checks for no signal: run here, a Ctrl-C reached Python when training ended
    (30 s on the built-in corpus), and a thread left to finish would keep the cores busy. The texts go to the child's
    stdin as JSON lines, after a line of settings; the trained tokenizer comes back on its stdout as JSON. A training
    never taken (its process ending first) is ended with it.
    """

    def __init__(self, texts: Iterable[str], *, vocab_size: int = 4096, num_sentinels: int = 256,
                 model: str = "unigram", prefixes: Sequence[str] = UL2_PREFIXES, model_max_length: int = 1024,
                 show_progress: bool = False):
        import atexit
        import subprocess
        import sys
        import tempfile

        self.special = _checked_special_tokens(model, vocab_size, num_sentinels, prefixes)
        self.model, self.num_sentinels, self.prefixes = model, num_sentinels, prefixes
        self.model_max_length = model_max_length
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115  (the child writes in it until result() or cancel())
        package = Path(__file__).resolve().parent.parent
        self._child = subprocess.Popen([sys.executable, "-c", _TRAINING_CHILD, str(package)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=None if show_progress else self._errors)
        atexit.register(self.cancel)
        try:
            settings = {"model": model, "vocab_size": vocab_size, "special": self.special,
                        "show_progress": show_progress}
            _send_lines(self._child.stdin, [settings], texts)
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        """End the child, if it still runs."""
        import atexit

        atexit.unregister(self.cancel)
        if self._child.poll() is None:
            self._child.kill()
            self._child.wait()
        self._errors.close()

    def result(self, save_directory: str | os.PathLike | None = None):
        """The trained tokenizer, a ``PreTrainedTokenizerFast``, saved in ``save_directory`` when given."""
        from transformers import PreTrainedTokenizerFast

        tokenizer = self._trained()
        for i, token in enumerate(self.special):
            if tokenizer.token_to_id(token) != i:
                raise RuntimeError(f"the trainer put {token!r} at id {tokenizer.token_to_id(token)}, expected {i}")
        if self.model == "unigram":
            tokenizer.model = _canonical_unigram(tokenizer, len(self.special))
        sentinels = _add_sentinels_and_eos(tokenizer, self.num_sentinels)
        wrapped = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer,
            pad_token=PAD_TOKEN,
            eos_token=EOS_TOKEN,
            unk_token=UNK_TOKEN,
            model_max_length=self.model_max_length,
            padding_side="right",
        )
        wrapped.add_special_tokens({"additional_special_tokens": [*self.prefixes, *reversed(sentinels)]})
        if save_directory is not None:
            save_tokenizer(wrapped, save_directory)
        return wrapped

    def _trained(self):
        """The `tokenizers` Tokenizer the child trained."""
        from tokenizers import Tokenizer

        try:
            trained = self._child.stdout.read()
            status = self._child.wait()
            if status != 0:
                self._errors.seek(0)
                said = self._errors.read().decode(errors="replace").strip().splitlines()
                raise RuntimeError(f"training the tokenizer failed: {said[-1] if said else f'exit status {status}'}")
        finally:
            self.cancel()
        return Tokenizer.from_str(trained.decode("utf-8"))


def _send_lines(stream, *parts: Iterable) -> None:
    """Each item of ``parts`` as a line of JSON, then the end of ``stream``; stops early if the reader has ended."""
    try:
        for part in parts:
            for item in part:
                stream.write(json.dumps(item).encode() + b"\n")
    except BrokenPipeError:  # the child failed: its exit status and message say why
        return
    stream.close()


def train_from_stdin() -> None:
    """The child process of `TokenizerTraining`: settings and texts read from stdin, the trained tokenizer written
    to stdout."""
    import signal
    import sys

    # a Ctrl-C in a terminal reaches the whole process group: the parent decides, and kills this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lines = iter(sys.stdin.buffer)
    settings = json.loads(next(lines))
    tokenizer, trainer = _untrained_tokenizer(settings["model"], settings["vocab_size"], settings["special"],
                                              settings["show_progress"])
    tokenizer.train_from_iterator((json.loads(line) for line in lines), trainer=trainer)
    sys.stdout.buffer.write(tokenizer.to_str().encode("utf-8"))


def tokenizer_fingerprint(texts: Iterable[str], **settings) -> str:
    """A name for the tokenizer that `train_tokenizer` makes of ``texts`` (in their order) with ``settings`` (its
    keyword arguments): the same texts and settings, the same name; training is deterministic, so a tokenizer saved
    under it can stand for training again."""
    import tokenizers

    digest = hashlib.sha256(json.dumps({"settings": settings, "prefixes": UL2_PREFIXES, "tokenizers":
                                        tokenizers.__version__, "revision": TRAINING_REVISION},
                                       sort_keys=True).encode())
    for text in texts:
        digest.update(text.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def save_tokenizer(tokenizer, save_directory) -> None:
    """``save_pretrained`` into a temporary folder beside ``save_directory``, loaded back, then renamed to it."""
    from transformers import AutoTokenizer

    from ..output_folder import atomic_directory

    with atomic_directory(save_directory, overwrite=True) as temporary:
        tokenizer.save_pretrained(temporary)
        AutoTokenizer.from_pretrained(temporary)


def _checked_special_tokens(model: str, vocab_size: int, num_sentinels: int, prefixes: Sequence[str]) -> list[str]:
    """The special tokens in their id order (pad, eos, unk, then the prefixes), once the arguments are checked."""
    if model not in TOKENIZER_MODELS:
        raise ValueError(f"model must be one of {TOKENIZER_MODELS}, got {model!r}")
    special = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, *prefixes]
    if vocab_size <= len(special) + 16:
        raise ValueError(f"vocab_size must be larger than the {len(special)} special tokens, got {vocab_size}")
    if num_sentinels < 0:
        raise ValueError(f"num_sentinels must be >= 0, got {num_sentinels}")
    return special


def _untrained_tokenizer(model: str, vocab_size: int, special: list[str], show_progress: bool):
    """An empty `tokenizers` Tokenizer with T5's normalisation and Metaspace pieces, and the trainer that fills it."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if model == "unigram":
        tokenizer = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size,
            special_tokens=special,
            unk_token=UNK_TOKEN,
            show_progress=show_progress,
            max_piece_length=16,
        )
    else:
        tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=show_progress)
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " ")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tokenizer, trainer


def _add_sentinels_and_eos(tokenizer, num_sentinels: int) -> list[str]:
    """Append the sentinels to the trained ``tokenizer`` and make it end each sequence with ``</s>``; returns the
    sentinels in id order."""
    from tokenizers import AddedToken, processors

    # Appended last, in decreasing index, so that <extra_id_0> has the highest id as in T5.
    sentinels = [sentinel_token(i) for i in reversed(range(num_sentinels))]
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in sentinels])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}",
        pair=f"$A {EOS_TOKEN} $B {EOS_TOKEN}",
        special_tokens=[(EOS_TOKEN, tokenizer.token_to_id(EOS_TOKEN))],
    )
    return sentinels


# Unigram scores are log-probabilities of order 1..20; the trainer's own rounding noise is of order 1e-14.
_SCORE_DECIMALS = 9
# the score step between the characters the Unigram trainer appends last (`tokenizers`' min_score_penalty_delta)
_APPENDED_CHARACTER_STEP = 1e-4


def _canonical_unigram(tokenizer, num_special: int):
    """The trained Unigram model with the same pieces, ids and scores for the same corpus in every process.

    The `tokenizers` Unigram trainer seeds its hash maps at random in each process and sums over threads: its scores
    differ in the last bits from run to run, which reorders pieces of near-equal score, and the characters it must
    keep but did not learn are appended in hash order, each a step of 1e-4 below the one before (or at the lowest
    score). The same seed then
    trained another model. Here the scores are rounded, the appended characters take their scores in the order of
    the characters, and the learned pieces are ordered by decreasing score, ties by the piece itself; the special
    tokens keep their first ids."""
    from tokenizers import models

    state = json.loads(tokenizer.to_str())["model"]
    vocab = [(piece, round(score, _SCORE_DECIMALS)) for piece, score in state["vocab"]]
    # the appended characters: the last pieces, single characters at most a step apart (the last ones may share
    # one score)
    start = len(vocab)
    while (
        start - 1 > num_special
        and len(vocab[start - 1][0]) == 1
        and (start == len(vocab) or 0 <= vocab[start - 1][1] - vocab[start][1] <= _APPENDED_CHARACTER_STEP + 1e-6)
    ):
        start -= 1
    appended_characters = sorted(piece for piece, _ in vocab[start:])  # scores in their order, whatever the hash
    appended_scores = sorted((score for _, score in vocab[start:]), reverse=True)
    learned = sorted(vocab[num_special:start], key=lambda entry: (-entry[1], entry[0]))
    pieces = vocab[:num_special] + learned + list(zip(appended_characters, appended_scores))
    return models.Unigram(pieces, unk_id=state["unk_id"], byte_fallback=state.get("byte_fallback", False))


def load_tokenizer(path: str | os.PathLike, task: str | None = None):
    """Load a tokenizer (one :func:`train_tokenizer` saved, a model folder's, a Hub id) with ``AutoTokenizer``.

    A tokenizer that cannot be loaded, or has no padding token, raises FAT5Error naming ``path``; so does a slow one
    for ``task="token_classification"``, which maps sub-word pieces back to words.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        raise FAT5Error(f"tokenizer: cannot load a tokenizer from {path} ({error})") from None
    if tokenizer.pad_token_id is None:
        raise FAT5Error(f"tokenizer: {path}'s tokenizer has no padding token")
    if task == "token_classification" and not tokenizer.is_fast:
        raise FAT5Error("tokenizer: token_classification needs a fast tokenizer (it maps sub-word pieces to words)")
    return tokenizer


def sentinel_token_ids(tokenizer) -> np.ndarray:
    """Ids of ``<extra_id_0>, <extra_id_1>, ...`` (consecutive indices from 0) as a numpy array."""
    vocab = tokenizer.get_vocab()
    indices = sorted(int(m.group(1)) for token in vocab if (m := _SENTINEL_PATTERN.fullmatch(token)))
    count = 0
    while count < len(indices) and indices[count] == count:
        count += 1
    if count == 0:
        raise ValueError(
            "the tokenizer has no sentinel tokens <extra_id_0>, <extra_id_1>, ...: train one with "
            "fat5.trainer.train_tokenizer or use a T5 tokenizer"
        )
    return np.array([vocab[sentinel_token(i)] for i in range(count)], dtype=np.int64)


def prefix_token_ids(tokenizer, prefixes: Sequence[str] = UL2_PREFIXES) -> dict[str, int]:
    """Ids of the UL2 mode tokens; each must be a single token of the vocabulary."""
    vocab = tokenizer.get_vocab()
    missing = [p for p in prefixes if p not in vocab]
    if missing:
        raise ValueError(
            f"the tokenizer has no token for the UL2 mode prefixes {missing}: call "
            "fat5.trainer.add_ul2_special_tokens(tokenizer) and save it (a trained model's embeddings then need "
            "resizing)"
        )
    return {p: int(vocab[p]) for p in prefixes}


def add_ul2_special_tokens(tokenizer, prefixes: Sequence[str] = UL2_PREFIXES) -> int:
    """Add the UL2 mode tokens to an existing tokenizer (e.g. T5's); returns how many were new.

    New tokens get ids after the current vocabulary: resize the model's embeddings to ``len(tokenizer)``.
    """
    vocab = tokenizer.get_vocab()
    new = [p for p in prefixes if p not in vocab]
    if not new:
        return 0
    return tokenizer.add_tokens(new, special_tokens=True)
