"""fat5 pretrain: UL2 pretraining of a FAT5 model, from a YAML config, in one command.

The steps, in order: read and check the config (fat5.trainer.pretrain_config.PretrainConfig: the built-in default
updated by the config's keys, listed below), check what the job will need (its packages, the corpus, an output folder
it can write, a given tokenizer's sentinel, eos and pad tokens), choose the path (a step compiled into CUDA graphs on
batches of a few fixed shapes on a CUDA device, else an eager one; the first printed line says which and why), get a
tokenizer (train one on the corpus when none is given), load and tokenize the corpus, build the packed UL2 batches,
train with FAT5Trainer, evaluate, and save the model and tokenizer to the output folder itself, where
AutoModelForSeq2SeqLM.from_pretrained(folder) (after import fat5) and AutoTokenizer load them.

The output folder also holds the checkpoints (checkpoint-N, each written whole or not at all), the tokenizer trained
for the run (tokenizer/), the resolved config (pretrain_config.yaml: every default filled in, with the chosen path
and batch shapes) and pretrain_summary.json. A folder that already holds a model, checkpoints or files no run wrote is
refused: --resume continues from its newest complete checkpoint, with the config the run saved (a config given then
must not differ from it), --overwrite removes what a run wrote there and keeps the rest (never a folder that holds
the input or the current directory). A checkpoint at max_steps leaves no step to train: --resume then evaluates and
saves its model, and a finished run is refused as such. What a run interrupted before its first checkpoint left is
removed, the job saying it starts over.
"""

import contextlib
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import FAT5Error
from ..output_folder import write_atomically
from . import jobs
from .config_schema import read_yaml
from .pretrain_config import (
    VOCAB_MULTIPLE,
    PretrainConfig,
    PretrainDataSection,
    PretrainingPath,
    TokenizerSection,
    cache_folder,
    check_cache_dir,
    choose_path,
    differing_keys,
    load_pretrain_config,
)

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_OUTPUT_DIR = "outputs/fat5-pretrain"
# the resolved config in the output folder, which --resume reads
SAVED_CONFIG = "pretrain_config.yaml"
SUMMARY_FILE = "pretrain_summary.json"
# torch.compiler's cache artifacts (compiled graphs and kernels), written beside the checkpoints, loaded on --resume
COMPILE_ARTIFACTS = "compile_cache_artifacts.bin"
# graphs dynamo keeps per compiled function: one per batch shape (5 by default), the evaluation's among them
DYNAMO_RECOMPILE_LIMIT = 64


def _texts_for_tokenizer(dataset, limit: int | None, text_column: str):
    for index, record in enumerate(dataset):
        if limit is not None and index >= limit:
            return
        yield record[text_column]


def load_corpus(data: PretrainDataSection, seed: int):
    """(train, eval) text datasets with a ``text`` column; eval is None when nothing is held out."""
    from .data import load_shakespeare, load_text_dataset

    if data.corpus == "shakespeare":
        if data.eval_fraction:
            splits = load_shakespeare(unit=data.unit, test_fraction=data.eval_fraction, seed=seed)
            return splits["train"], splits["test"]
        return load_shakespeare(unit=data.unit), None
    options = {"name": data.name, "data_files": data.data_files, "streaming": data.streaming,
               "text_column": data.text_column}
    try:
        train = load_text_dataset(data.path, split=data.split, **options)
        evaluation = None
        if data.eval_split:
            evaluation = load_text_dataset(data.path, split=data.eval_split, **dict(options, streaming=False))
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as error:
        raise FAT5Error(f"cannot load the corpus {data.path!r}: {error}") from None
    return train, evaluation


def get_tokenizer(settings: TokenizerSection, train_texts, text_column: str, output_dir: Path, saved=None):
    """The configured tokenizer; else the one this run saved (``saved``: the checkpoint a run resumes from, or the
    folder where the main process saved the tokenizer it trained); else a new one, saved in ``output_dir/tokenizer``:
    the one kept from a run on the same texts and settings, or the one `begun_pretraining` began training on them,
    or one trained now."""
    from .tokenizer import TokenizerTraining, load_tokenizer, save_tokenizer, tokenizer_fingerprint

    path = settings.path or saved
    if path:
        return load_tokenizer(path)

    def texts():
        return _texts_for_tokenizer(train_texts, settings.train_on_documents, text_column)

    training = _tokenizer_training_settings(settings)
    fingerprint = tokenizer_fingerprint(texts(), **training)
    kept = _kept_tokenizer(settings, fingerprint)
    if kept is not None:
        print(f"tokenizer: the one trained before on the same texts and settings ({kept})", flush=True)
        tokenizer = load_tokenizer(kept)
        save_tokenizer(tokenizer, output_dir / "tokenizer")
        return tokenizer
    begun = _BEGUN_TOKENIZER_TRAININGS.pop(fingerprint, None)
    if begun is None:
        print(f"training a {settings.vocab_size}-token tokenizer on the corpus", flush=True)
        begun = TokenizerTraining(texts(), **training)
    tokenizer = begun.result(save_directory=output_dir / "tokenizer")
    if settings.cache_dir is not None:
        kept = cache_folder(settings.cache_dir) / fingerprint
        try:
            save_tokenizer(tokenizer, kept)
        except OSError as error:  # the run has its tokenizer; only the next run's shortcut is lost
            print(f"tokenizer.cache_dir: could not keep the tokenizer in {kept} ({error.strerror or error})")
    return tokenizer


def _tokenizer_training_settings(settings: TokenizerSection) -> dict:
    return {"vocab_size": settings.vocab_size, "num_sentinels": settings.num_sentinels}


def _kept_tokenizer(settings: TokenizerSection, fingerprint: str) -> Path | None:
    """The folder of the tokenizer an earlier run trained on the same texts and settings, kept in tokenizer.cache_dir
    (None: none is)."""
    kept = cache_folder(settings.cache_dir) / fingerprint if settings.cache_dir is not None else None
    return kept if kept is not None and (kept / "tokenizer.json").is_file() else None


# tokenizer trainings that `begun_pretraining` began, by the fingerprint of what they train on (`get_tokenizer` takes
# the one it would train)
_BEGUN_TOKENIZER_TRAININGS: dict = {}


def _begin_tokenizer_training(settings: PretrainConfig) -> str | None:
    """Begin training the tokenizer the job will train, where it can tell which without `datasets` (the built-in
    corpus) and none is kept from an earlier run; returns the fingerprint it is kept under (None: nothing begun)."""
    from .data import shakespeare_training_texts
    from .tokenizer import TokenizerTraining, tokenizer_fingerprint

    tokenizer, data = settings.tokenizer, settings.data
    if tokenizer.path is not None or data.corpus != "shakespeare":
        return None
    texts = shakespeare_training_texts(data.unit, data.eval_fraction, settings.seed)[: tokenizer.train_on_documents]
    training = _tokenizer_training_settings(tokenizer)
    fingerprint = tokenizer_fingerprint(texts, **training)
    if _kept_tokenizer(tokenizer, fingerprint) is not None:
        return None
    print(f"training a {tokenizer.vocab_size}-token tokenizer on the corpus", flush=True)
    _BEGUN_TOKENIZER_TRAININGS[fingerprint] = TokenizerTraining(texts, **training)
    return fingerprint


def build_model(settings: PretrainConfig, tokenizer, vocab_size: int | None = None):
    """A fresh FAT5 for the tokenizer; ``vocab_size`` (a resumed run's, from its checkpoint) replaces the length of
    the tokenizer rounded up to a multiple of `VOCAB_MULTIPLE`.

    As T5 has 32,128 ids for its 32,100 tokens: with an output width that is not a multiple of 8, cuBLAS has only its
    pre-Hopper kernels for the logits' products (minipile config on an H100: 29,699 ids, 146 ms of GPU time a step;
    29,824, 126 ms). The ids past the tokenizer's never occur in the data; training pushes their logits down."""
    from .. import FAT5ForConditionalGeneration

    vocab_size = vocab_size or -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return FAT5ForConditionalGeneration(
        settings.model_config(vocab_size, tokenizer.pad_token_id, tokenizer.eos_token_id)
    )


@dataclass
class PretrainingJob:
    """A pretraining run made ready by :func:`prepare_pretraining`: its settings (the checked `PretrainConfig`),
    output folder, the checkpoint it resumes from, tokenizer, model, UL2 collator, packed batches, the trainer wired
    to them and the path chosen. ``run()`` trains, evaluates and saves. Benchmarks add their callbacks to
    ``trainer`` and feed peers ``batches`` in between."""

    settings: PretrainConfig
    output_dir: Path
    checkpoint: Path | None
    tokenizer: Any
    model: Any
    collator: Any
    batches: "PackedBatches"
    trainer: Any
    path: PretrainingPath

    def run(self) -> dict:
        """Train (from the checkpoint when resuming), evaluate, save the model and tokenizer to the output folder
        itself and write ``pretrain_summary.json``; returns the summary."""
        from transformers import AutoModelForSeq2SeqLM

        trainer = self.trainer
        with jobs.released_at_the_end(self.output_dir):
            # read before training: once the run writes its next checkpoint, save_total_limit may delete this one
            resumed_from = _announce_resumed_run(trainer, self.checkpoint)
            train_output, metrics = jobs.train_and_evaluate(trainer, self.checkpoint)
            # what is written is loaded back before it replaces anything: what users will load
            jobs.save_final_model(trainer, self.output_dir, verify=AutoModelForSeq2SeqLM.from_pretrained)
            summary = _summary(trainer, train_output, metrics or {}, resumed_from, self.output_dir)
            # a step compiled by torch.compile, or FAT5's Triton kernels, compiled on a CUDA device (not on a CPU)
            summary["first_steps_compile"] = self.path.compiled or trainer.args.device.type == "cuda"
            if trainer.is_world_process_zero():
                write_atomically(self.output_dir / SUMMARY_FILE, json.dumps(summary, indent=2).encode())
            # no process returns before the model and summary are in place
            trainer.accelerator.wait_for_everyone()
        return summary


@contextlib.contextmanager
def begun_pretraining(config=None, output_dir=None, *, overrides=None, resume: bool = False,
                      overwrite: bool = False) -> Iterator[Path]:
    """What `fat5 pretrain` does before it imports torch and transformers, in its first second: the config read and
    checked (what needs transformers' classes aside), the corpus checked, the output folder checked and locked (the
    job, `prepare_pretraining`, takes the lock over), the job said in one line, and on the main process the
    tokenizer's training begun in its child process when the job will train one on the built-in corpus
    (`get_tokenizer` takes it over), so that those imports run while it trains. Yields the output folder; at the end
    of the block the lock is released and a training the job did not take is ended."""
    output_dir = Path(output_dir or DEFAULT_OUTPUT_DIR)
    settings = _settings(config, overrides, output_dir, resume, load=PretrainConfig.read)
    jobs.check_output_dir(output_dir, resume=resume, overwrite=overwrite, resume_keeps_config=True)
    begun = None
    try:
        _check_corpus(settings.data)
        if jobs.is_main_launch_process():
            print(_job_line(settings, output_dir, resume), flush=True)
            begun = None if resume else _begin_tokenizer_training(settings)
        yield output_dir
    finally:
        if begun in _BEGUN_TOKENIZER_TRAININGS:
            _BEGUN_TOKENIZER_TRAININGS.pop(begun).cancel()
        jobs.release_output_dir(output_dir)


def _job_line(settings: PretrainConfig, output_dir: Path, resume: bool) -> str:
    """The job's first line: what it trains on, how long, and where."""
    data, steps = settings.data, settings.training.get("max_steps", -1)
    corpus = "the built-in Shakespeare plays" if data.corpus == "shakespeare" else data.path
    length = f"{steps} steps" if steps > 0 else f"{settings.training.get('num_train_epochs', 3)} epochs"
    run = f"continuing the run in {output_dir}" if resume else f"into {output_dir}"
    return f"pretraining {length} on {corpus}, {run} (loading torch and transformers)"


def prepare_pretraining(config=None, output_dir=None, *, overrides=None, resume: bool = False,
                        overwrite: bool = False) -> PretrainingJob:
    """Every step of :func:`pretrain` before training: the settings read (``config`` updated by ``overrides``; with
    ``resume``, the run's saved config when ``config`` is None), what the job needs checked (`check_job_needs`), the
    path chosen and said, the output folder prepared, the corpus, tokenizer, model, collator, batches and trainer
    built."""
    output_dir = Path(output_dir or DEFAULT_OUTPUT_DIR)
    settings = _settings(config, overrides, output_dir, resume)
    jobs.check_output_dir(output_dir, resume=resume, overwrite=overwrite, resume_keeps_config=True)
    with jobs.released_on_failure(output_dir):
        return _prepared_pretraining(settings, config, output_dir, resume=resume, overwrite=overwrite)


def _prepared_pretraining(settings: PretrainConfig, config, output_dir: Path, *, resume: bool,
                          overwrite: bool) -> PretrainingJob:
    """`prepare_pretraining` once the output folder is locked."""
    given_tokenizer = check_job_needs(settings)
    from transformers import set_seed

    state = jobs.process_state(settings.training)
    cuda = _trains_on_cuda(settings)
    path = choose_path(settings, cuda)
    _prepare_compiler(settings, path, cuda)
    if state.is_main_process:
        print(path.describe(), flush=True)
    inputs = [settings.tokenizer.path, settings.data.path, *([settings.ul2] if _is_path(settings.ul2) else [])]
    output_dir, checkpoint = jobs.prepare_output_folder(output_dir, config, inputs, settings.training,
                                                        overwrite=overwrite, resume=resume, resume_keeps_config=True)
    set_seed(settings.seed)
    train_texts, eval_texts, tokenizer = _corpus_and_tokenizer(settings, output_dir, checkpoint, state,
                                                                given_tokenizer)
    model = build_model(settings, tokenizer, _saved_vocab_size(checkpoint))
    collator = _ul2_collator(settings, tokenizer)
    batches = _packed_batches(settings, path, train_texts, eval_texts, tokenizer, collator, state)
    trainer = _build_trainer(settings, path, output_dir, model, tokenizer, collator, batches)
    if path.compiled:
        _load_compile_artifacts(output_dir if resume else None)
        trainer.add_callback(_compile_artifacts_callback(output_dir))
    if state.is_main_process:
        write_saved_config(settings, path, batches, output_dir)
    return PretrainingJob(settings, output_dir, checkpoint, tokenizer, model, collator, batches, trainer, path)


def pretrain(config=None, output_dir=None, *, overrides=None, resume: bool = False, overwrite: bool = False) -> dict:
    """Run the whole pretraining job; returns a summary (losses, steps, where the model is).

    ``config`` is a YAML path, a mapping, or None for the built-in default (with ``resume``: the run's saved
    config); ``overrides`` a mapping of sections or ``KEY=VALUE`` strings applied over it, key by key. The final
    model and tokenizer are written to ``output_dir`` itself; a folder that holds a model, checkpoints or files no run
    wrote is refused unless ``resume`` (continue from its newest complete checkpoint, or start over when there is
    none) or ``overwrite`` (remove what a run wrote there, keep the rest) is set.
    """
    return prepare_pretraining(config, output_dir, overrides=overrides, resume=resume, overwrite=overwrite).run()


def _settings(config, overrides, output_dir: Path, resume: bool, load=load_pretrain_config) -> PretrainConfig:
    """The config checked by ``load`` (`PretrainConfig.read` leaves out what needs transformers' classes); on
    ``resume``, the one the run saved (``config`` None) or ``config``, which must not differ from it."""
    saved_file = output_dir / SAVED_CONFIG
    if not (resume and saved_file.is_file()):
        return load(config, overrides)
    saved_raw = read_yaml(saved_file, "the run's saved config")
    saved_raw.pop("resolved", None)
    saved = load(saved_raw)
    settings = load(saved.to_dict() if config is None else config, overrides)
    differing = differing_keys(settings.to_dict(), saved.to_dict())
    if differing:
        raise FAT5Error(f"--resume: {', '.join(differing)} differ(s) from the run's config ({saved_file}); resume "
                        "without a config to continue the run as it was, or start a new run in another folder")
    return settings


# the packages the job imports, fat5's dependencies all (one missing is a broken install), and what each does here
NEEDED_PACKAGES = {"datasets": "reads and tokenizes the corpus", "tokenizers": "trains the tokenizer",
                   "accelerate": "runs the Trainer"}
# a data.path with one of these endings names a local file (else it may be a Hub dataset's name)
DATA_FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".parquet", ".csv", ".arrow")


def check_job_needs(settings: PretrainConfig):
    """What the job will need, checked before any work (a folder emptied, a tokenizer trained, a step taken): the
    packages it imports, the corpus, a given tokenizer's tokens (the output folder: `jobs.check_output_dir`). A missing
    one raises FAT5Error naming the fix; returns the given tokenizer, loaded (None: the job trains one)."""
    for package, role in NEEDED_PACKAGES.items():
        if importlib.util.find_spec(package) is None:
            raise FAT5Error(f"the `{package}` package, which {role}, is not installed: pip install {package}")
    _check_corpus(settings.data)
    if settings.tokenizer.path:
        return _checked_tokenizer(settings)
    check_cache_dir(settings.tokenizer.cache_dir, "tokenizer.cache_dir", "null to train the tokenizer every time")
    return None


def _check_corpus(data: PretrainDataSection) -> None:
    """The built-in corpus is installed; the local files the config names exist and can be read."""
    if data.corpus == "shakespeare":
        from .data import shakespeare_dir

        try:
            shakespeare_dir()
        except (ModuleNotFoundError, FileNotFoundError) as error:
            raise FAT5Error(f"data.corpus shakespeare: {error}") from None
        return
    path = str(data.path)
    local = [path] if Path(path).suffix in DATA_FILE_SUFFIXES or path.startswith((".", "/", "~")) else []
    files = data.data_files if isinstance(data.data_files, dict) else {"": data.data_files}
    for named in files.values():
        local += [name for name in (named if isinstance(named, list) else [named])
                  if isinstance(name, str) and "://" not in name and not any(mark in name for mark in "*?[")]
    for name in local:
        found = Path(name).expanduser()
        if not found.exists():
            raise FAT5Error(f"the corpus {name}: no such file or folder; give a data file "
                            f"({', '.join(DATA_FILE_SUFFIXES)}), a save_to_disk folder or a Hub dataset's name")
        if not os.access(found, os.R_OK):
            raise FAT5Error(f"the corpus {name} cannot be read by this user: give one you can read")
        if found.is_file() and _is_blank(found):  # datasets' loaders fail on it with a bare StopIteration
            raise FAT5Error(f"the corpus {name} is empty: give a file that holds the texts to train on")


def _is_blank(path: Path) -> bool:
    """Whether the file holds nothing but white space (read until its first other character)."""
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _checked_tokenizer(settings: PretrainConfig):
    """The tokenizer at tokenizer.path, with what UL2 takes from it: padding and end-of-sequence tokens, sentinels
    and the mixture's mode prefixes."""
    from .tokenizer import load_tokenizer, sentinel_token_ids

    path = settings.tokenizer.path
    fix = "give a tokenizer that has them, or tokenizer.path: null to train one on the corpus"
    tokenizer = load_tokenizer(path)
    if tokenizer.eos_token_id is None:
        raise FAT5Error(f"tokenizer.path {path}: the tokenizer has no end-of-sequence (eos) token, which ends every "
                        f"UL2 input and target; {fix}")
    try:
        sentinel_token_ids(tokenizer)
    except ValueError:
        raise FAT5Error(f"tokenizer.path {path}: the tokenizer has no sentinel tokens (<extra_id_0>, <extra_id_1>, "
                        f"...), which stand for the spans UL2 masks; {fix}") from None
    try:
        _ul2_collator(settings, tokenizer)
    except ValueError as error:
        raise FAT5Error(f"tokenizer.path {path}: {error}; or tokenizer.path: null to train one on the corpus") from None
    return tokenizer


def _trains_on_cuda(settings: PretrainConfig) -> bool:
    import torch

    return torch.cuda.is_available() and not jobs.trains_on_cpu(settings.training)


def _prepare_compiler(settings: PretrainConfig, path: PretrainingPath, cuda: bool) -> None:
    """Point Inductor's, Triton's and flash-attn-4's caches (FAT5's own Triton kernels too, and its Hopper kernels'
    CuTe DSL compilations, which FA4 keeps only in memory by default) at compile.cache_dir, keep the FX-graph and
    AOTAutograd caches on, and let dynamo keep a graph per batch shape."""
    if not (path.compiled or cuda):
        return
    folder = check_cache_dir(settings.compile.cache_dir)
    if folder is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
        os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"
        os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = str(folder / "cute")
    if path.compiled:
        import torch

        torch._inductor.config.fx_graph_cache = True
        torch._functorch.config.enable_autograd_cache = True
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), DYNAMO_RECOMPILE_LIMIT))


def _load_compile_artifacts(output_dir: Path | None) -> None:
    """Load the compiled code a resumed run saved (`COMPILE_ARTIFACTS`), so that it does not compile again."""
    import torch

    artifacts = output_dir / COMPILE_ARTIFACTS if output_dir is not None else None
    if artifacts is None or not artifacts.is_file():
        return
    # torch checks the bytes itself: damaged ones (or another torch's) are skipped with a warning, and compiled again
    torch.compiler.load_cache_artifacts(artifacts.read_bytes())


def _compile_artifacts_callback(output_dir: Path):
    """A callback that writes torch.compiler's cache artifacts beside each checkpoint (main process, atomically)."""
    from transformers import TrainerCallback

    class CompileArtifacts(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            import torch

            saved = torch.compiler.save_cache_artifacts() if state.is_world_process_zero else None
            if saved is not None:
                write_atomically(output_dir / COMPILE_ARTIFACTS, saved[0])

    return CompileArtifacts()


def write_saved_config(settings: PretrainConfig, path: PretrainingPath, batches: "PackedBatches",
                       output_dir: Path) -> None:
    """``pretrain_config.yaml``: the config with every default filled in, and under ``resolved`` the path taken
    and the batch shapes chosen."""
    buckets = getattr(batches.train_sampler, "buckets", None)
    document = settings.to_dict()
    document["resolved"] = {
        "path": path.describe(),
        "compile_mode": path.compile_mode,
        "shape_buckets": list(buckets.target_widths) if buckets is not None else path.shape_buckets,
        "batch_shapes": [list(shape) for shape in buckets.shapes()] if buckets is not None else None,
    }
    write_atomically(output_dir / SAVED_CONFIG, yaml.safe_dump(document, sort_keys=False).encode())


def _text_column(data: PretrainDataSection) -> str:
    return "text" if data.corpus == "shakespeare" else data.text_column


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike))


def _corpus_and_tokenizer(settings: PretrainConfig, output_dir: Path, checkpoint: Path | None, state, given=None):
    """(train texts, eval texts or None, tokenizer): ``given``, the configured tokenizer loaded already, or the
    one `get_tokenizer` finds or trains.

    Under `accelerate launch` every process runs this: the main one loads the corpus first (filling the datasets
    cache the others then read) and trains the tokenizer; the others load the tokenizer it saved, since a tokenizer
    trained on each rank could differ, and would then give the same ids different meanings.
    """
    with state.main_process_first():
        train_texts, eval_texts = load_corpus(settings.data, settings.seed)
        saved = checkpoint or (None if state.is_main_process else output_dir / "tokenizer")
        tokenizer = given or get_tokenizer(settings.tokenizer, train_texts, _text_column(settings.data), output_dir,
                                           saved)
    return train_texts, eval_texts, tokenizer


def _saved_vocab_size(checkpoint: Path | None) -> int | None:
    """The resumed checkpoint's vocab_size: a run started by an older release may have its embeddings at the
    tokenizer's own length."""
    if checkpoint and (checkpoint / "config.json").is_file():
        return json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    return None


def _ul2_collator(settings: PretrainConfig, tokenizer):
    from .collator import UL2DataCollator

    return UL2DataCollator(
        tokenizer,
        mixture=settings.ul2,
        max_input_length=settings.data.max_input_length,
        max_target_length=settings.data.max_target_length,
        packed=True,
        seed=settings.seed,
    )


@dataclass
class PackedBatches:
    """The tokenized training and evaluation data, and the samplers that pack them into UL2 batches (None for a
    streamed training set, which packs itself, and where there is no evaluation data)."""

    train: Any
    train_sampler: Any
    evaluation: Any
    eval_sampler: Any


def _packed_batches(settings: PretrainConfig, path: PretrainingPath, train_texts, eval_texts, tokenizer, collator,
                    state) -> PackedBatches:
    from .data import tokenize_dataset
    from .packing import PackedStreamDataset, UL2PackedBatchSampler

    data = settings.data
    tokenize = {"text_column": _text_column(data), "num_proc": data.num_proc}
    train = tokenize_dataset(train_texts, tokenizer, **tokenize)
    batching = {"tokens_per_batch": data.tokens_per_batch, "seed": settings.seed, "shape_buckets": path.shape_buckets}
    train_sampler = None
    if data.streaming:
        train = PackedStreamDataset(train, collator, **batching)
    else:
        # with fixed shapes, the batches of a step share one on every process (see UL2PackedBatchSampler)
        group = state.num_processes * settings.training.get("gradient_accumulation_steps", 1)
        train_sampler = UL2PackedBatchSampler(
            train["length"], collator.objective, drop_last=bool(settings.training.get("dataloader_drop_last")),
            shape_group=group if path.shape_buckets is not None else 1, **batching,
        )
        if train_sampler.buckets is not None:
            # the evaluation batches take the training shapes too
            batching["shape_buckets"] = list(train_sampler.buckets.target_widths)
            if state.is_main_process:
                print("packed batches in shapes (rows, encoder, decoder): "
                      + ", ".join(str(shape) for shape in train_sampler.buckets.shapes()), flush=True)
    evaluation, eval_sampler = None, None
    if eval_texts is not None and data.max_eval_documents:
        eval_texts = eval_texts.select(range(min(data.max_eval_documents, len(eval_texts))))
    if eval_texts is not None:
        evaluation = tokenize_dataset(eval_texts, tokenizer, **tokenize)
        eval_sampler = UL2PackedBatchSampler(evaluation["length"], collator.objective, shuffle=False, **batching)
    return PackedBatches(train, train_sampler, evaluation, eval_sampler)


def _build_trainer(settings: PretrainConfig, path: PretrainingPath, output_dir: Path, model, tokenizer, collator,
                   batches: PackedBatches):
    fixed = {"seed": settings.seed, "remove_unused_columns": False, **path.training_arguments()}
    arguments = jobs.training_arguments(output_dir, settings.training, fixed=fixed,
                                        evaluates=batches.evaluation is not None)
    return jobs.build_trainer(arguments, model, tokenizer, collator, batches.train, batches.evaluation,
                              train_batch_sampler=batches.train_sampler, eval_batch_sampler=batches.eval_sampler)


def _announce_resumed_run(trainer, checkpoint: Path | None) -> int:
    """The step a resumed run starts from (0 for a fresh one), saying so when its checkpoint reached max_steps:
    --resume runs the config the run saved (see _settings), so the checkpoint's max_steps is this run's."""
    from ..checkpoints import checkpoint_steps, reached_max_steps

    resumed_from, max_steps = checkpoint_steps(checkpoint) if checkpoint else (0, 0)
    if checkpoint and reached_max_steps(checkpoint) and trainer.is_world_process_zero():
        done = "evaluated and saved" if trainer.eval_dataset is not None else "saved"
        print(f"--resume: {checkpoint} reached the run's max_steps ({max_steps}): no step left to train; its model is "
              f"{done}", flush=True)
    return resumed_from


def _summary(trainer, train_output, metrics: dict, resumed_from: int, output_dir: Path) -> dict:
    """What `pretrain_summary.json` records: where the model is, the steps, the losses and the log history."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    steps_this_run = trainer.state.global_step - resumed_from
    return {
        "output": str(output_dir),
        # the run's total; a resumed run trained steps_this_run of them in this process, and train_loss covers those
        "steps": trainer.state.global_step,
        "resumed_from_step": resumed_from,
        "steps_this_run": steps_this_run,
        "first_logged_loss": losses[0] if losses else None,
        "last_logged_loss": losses[-1] if losses else None,
        # the Trainer says 0.0 for a train() of no step
        "train_loss": train_output.training_loss if steps_this_run else None,
        "eval_loss": metrics.get("eval_loss"),
        "log_history": trainer.state.log_history,
    }
