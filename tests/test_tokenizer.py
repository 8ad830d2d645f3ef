"""The T5-style tokenizer trained on the built-in Shakespeare corpus, and the data pipeline on `datasets`."""

import time

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from fat5.trainer.data import (
    load_shakespeare,
    load_text_dataset,
    shakespeare_documents,
    shakespeare_texts,
    tokenize_dataset,
)
from fat5.trainer.tokenizer import (
    add_ul2_special_tokens,
    prefix_token_ids,
    sentinel_token_ids,
    train_tokenizer,
)

NUM_SENTINELS = 100


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    start = time.perf_counter()
    tokenizer = train_tokenizer(
        shakespeare_texts(), vocab_size=4096, num_sentinels=NUM_SENTINELS, model="unigram", save_directory=directory
    )
    return tokenizer, directory, time.perf_counter() - start


def test_training_is_fast(trained):
    _, _, seconds = trained
    assert seconds < 60, f"training the default tokenizer took {seconds:.1f} s"


def test_t5_layout(trained):
    tokenizer, _, _ = trained
    assert len(tokenizer) == 4096 + NUM_SENTINELS
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert prefix_token_ids(tokenizer) == {"[R]": 3, "[S]": 4, "[X]": 5}
    sentinels = sentinel_token_ids(tokenizer)
    assert len(sentinels) == NUM_SENTINELS
    assert sentinels[0] == len(tokenizer) - 1, "<extra_id_0> must be the highest id, as in T5"
    assert (np.diff(sentinels) == -1).all()


def test_saved_tokenizer_reloads_with_autotokenizer(trained):
    tokenizer, directory, _ = trained
    reloaded = AutoTokenizer.from_pretrained(directory)
    text = "To be, or not to be: that is the question. [X] <extra_id_7> Whether 'tis nobler in the mind"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    ids = reloaded(text)["input_ids"]
    assert ids[-1] == reloaded.eos_token_id  # EOS appended, as T5's tokenizer does
    assert reloaded.convert_tokens_to_ids("<extra_id_7>") in ids and 5 in ids  # special tokens are not split
    plain = "To be, or not to be: that is the question."
    assert reloaded.decode(reloaded(plain)["input_ids"], skip_special_tokens=True) == plain
    assert reloaded(plain, add_special_tokens=False)["input_ids"][-1] != reloaded.eos_token_id
    assert reloaded.pad_token_id == 0 and reloaded.eos_token_id == 1


def test_bpe_model_has_the_same_layout():
    texts = (t for t, _ in zip(shakespeare_texts(), range(60)))
    tokenizer = train_tokenizer(texts, vocab_size=512, num_sentinels=8, model="bpe")
    assert prefix_token_ids(tokenizer) == {"[R]": 3, "[S]": 4, "[X]": 5}
    assert sentinel_token_ids(tokenizer).tolist() == list(range(len(tokenizer) - 1, len(tokenizer) - 9, -1))
    with pytest.raises(ValueError, match="model must be"):
        train_tokenizer(["a b c"], model="wordpiece")


def test_ul2_tokens_on_a_tokenizer_without_them():
    plain = train_tokenizer(
        (t for t, _ in zip(shakespeare_texts(), range(30))), vocab_size=300, num_sentinels=0, prefixes=()
    )
    with pytest.raises(ValueError, match="no sentinel tokens"):
        sentinel_token_ids(plain)
    with pytest.raises(ValueError, match="add_ul2_special_tokens"):
        prefix_token_ids(plain)
    size = len(plain)
    assert add_ul2_special_tokens(plain) == 3
    assert sorted(prefix_token_ids(plain).values()) == [size, size + 1, size + 2]
    assert add_ul2_special_tokens(plain) == 0


def test_shakespeare_corpus_is_built_in():
    documents = list(shakespeare_documents())
    plays = {d["play"] for d in documents}
    assert len(plays) >= 36 and len(documents) > 700
    hamlet = " ".join(d["text"] for d in documents if d["play"] == "hamlet")
    assert "To be, or not to be" in hamlet
    assert "**" not in hamlet and "###" not in hamlet
    whole_plays = list(shakespeare_documents(unit="play"))
    assert len(whole_plays) == len(plays)
    assert sum(len(d["text"]) for d in whole_plays) == pytest.approx(sum(len(d["text"]) for d in documents), rel=0.01)


def test_shakespeare_split_holds_out_whole_plays():
    splits = load_shakespeare(test_fraction=0.1)
    train_plays, test_plays = set(splits["train"]["play"]), set(splits["test"]["play"])
    assert train_plays.isdisjoint(test_plays) and len(test_plays) >= 3


def test_tokenize_map_style_to_disk_and_streaming(trained, tmp_path):
    tokenizer, _, _ = trained
    corpus = load_shakespeare().select(range(40))
    saved = tmp_path / "tokenized"
    tokenized = tokenize_dataset(corpus, tokenizer, num_proc=2, save_path=saved)
    assert tokenized.column_names == ["input_ids", "length"]
    expected = tokenizer(list(corpus["text"]), add_special_tokens=False, verbose=False)["input_ids"]
    assert [list(x) for x in tokenized["input_ids"]] == expected
    assert list(tokenized["length"]) == [len(x) for x in expected]
    reloaded = load_text_dataset(str(saved), text_column="input_ids")
    assert list(reloaded[3]["input_ids"]) == expected[3]

    streamed = tokenize_dataset(corpus.to_iterable_dataset(num_shards=2), tokenizer, keep_columns=())
    assert isinstance(streamed, datasets.IterableDataset)
    assert [row["input_ids"] for row in streamed] == expected


def test_load_text_dataset_from_local_files(tmp_path):
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("first line\nsecond line\n")
    dataset = load_text_dataset(str(text_file))
    assert list(dataset["text"]) == ["first line", "second line"]
    streamed = load_text_dataset(str(text_file), streaming=True)
    assert [row["text"] for row in streamed] == ["first line", "second line"]
    with pytest.raises(ValueError, match="no text column"):
        load_text_dataset(str(text_file), text_column="content")


_TRAIN_IN_A_NEW_PROCESS = """
import json, sys
from fat5.trainer.tokenizer import train_tokenizer
rows = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")]
tokenizer = train_tokenizer([row["document"] for row in rows], vocab_size=512, num_sentinels=8)
print(json.dumps(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))))
"""


def test_the_same_corpus_trains_the_same_tokenizer_in_every_process():
    """Same corpus, same machine -> the same pieces with the same ids: the `tokenizers` trainer seeds its hash maps
    at random in each process, which used to reorder pieces of near-equal score, so the same pretraining seed gave
    different models. Each training runs in a process of its own (a new hash seed): this one and two new ones."""
    import json
    import subprocess
    import sys

    from helpers import DATA, ROWS

    here = train_tokenizer([row["document"] for row in ROWS], vocab_size=512, num_sentinels=8)
    pieces = [here.convert_ids_to_tokens(list(range(len(here))))] + [
        json.loads(subprocess.run([sys.executable, "-c", _TRAIN_IN_A_NEW_PROCESS, str(DATA)], capture_output=True,
                                  text=True, check=True, timeout=300).stdout)
        for _ in range(2)
    ]
    assert len(pieces[0]) == 512 + 8
    assert pieces[1] == pieces[0] and pieces[2] == pieces[0]


def test_the_same_seed_gives_the_same_tokenizer_and_losses(tmp_path):
    """Two pretraining runs of one config and seed (three default runs used to end at eval losses 5.590, 5.606,
    5.603): the same tokenizer, the same logged losses."""
    from helpers import SPEECHES_CORPUS

    from fat5.trainer.pretraining import pretrain

    config = {
        "model": {"d_model": 16, "d_kv": 8, "d_ff": 32, "num_heads": 2, "num_layers": 1},
        # each run trains its tokenizer (the cache would hand the second the first's)
        "tokenizer": {"vocab_size": 300, "num_sentinels": 16, "cache_dir": None},
        "data": {**SPEECHES_CORPUS, "max_input_length": 64, "max_target_length": 32, "tokens_per_batch": 256},
        "training": {"max_steps": 3, "logging_steps": 1, "eval_strategy": "no", "save_strategy": "no",
                     "warmup_steps": 0, "learning_rate": 1e-3, "disable_tqdm": True},
    }
    runs = [pretrain(config, tmp_path / f"run-{index}") for index in range(2)]
    vocabularies = [AutoTokenizer.from_pretrained(tmp_path / f"run-{index}" / "tokenizer").get_vocab()
                    for index in range(2)]
    assert vocabularies[0] == vocabularies[1]
    losses = [[entry["loss"] for entry in run["log_history"] if "loss" in entry] for run in runs]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
