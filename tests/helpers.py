"""What several test files share: data paths, the error measure, the tiny model shapes and job configs, the
transformers / FAT5 model pairs and the Hub-like checkpoints built from them, and isolated subprocesses.

Test files import it as ``from helpers import ...`` (pytest puts tests/ on ``sys.path``: ``pythonpath`` in
pyproject.toml). Fixtures stay in conftest.py.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import T5Config, T5ForConditionalGeneration, UMT5Config, UMT5ForConditionalGeneration

from fat5 import FAT5Config, FAT5ForConditionalGeneration
from fat5.conversion.convert import _make_umt5_decoder_causal

# the library's own measure, the one `fat5 convert` checks a conversion with: ‖actual − expected‖ / ‖expected‖ in
# fp64 (optionally over a mask's positions), inf when `actual` is not finite
from fat5.conversion.verify import relative_error

__all__ = [
    "BLOCK_FAT5",
    "DATA",
    "FAMILIES",
    "FINETUNE_QUIET",
    "PREFIX",
    "QUICK_START_JOB",
    "READER_ENVIRONMENT",
    "REPO",
    "ROWS",
    "SMALL_PRETRAIN",
    "SPEECHES_CORPUS",
    "TINY",
    "TINY_PRETRAIN",
    "benchmark_module",
    "fat5_from_hf",
    "hf_and_fat5",
    "make_checkpoint",
    "make_hf",
    "model_without_tokenizer",
    "padded_batch",
    "padded_seq2seq_batch",
    "relative_error",
    "run_as_a_reader",
    "run_isolated",
    "run_quick_start",
    "seq2seq_config",
    "transformers_class",
    "word_tokenizer",
]

REPO = Path(__file__).resolve().parents[1]
# real text for the tiny tokenizers and finetuning runs (Shakespeare's speeches, shipped with the tests)
DATA = REPO / "tests" / "data" / "shakespeare_speeches.jsonl"
ROWS = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]

# ------------------------------------------------------------------------------------------ model shapes, configs

# the T5 shape the parity and conversion tests build on both sides (transformers' and FAT5's classes)
TINY = {
    "vocab_size": 96,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 48,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
    "dropout_rate": 0.0,
    "decoder_start_token_id": 0,
}

# The jobs below read the shipped speeches (34 kB) as their corpus, not the built-in plays (5 MB): training a tokenizer
# on the plays and tokenizing them took most of each run, and no test of these jobs depends on the corpus's size (the
# quick-start tests run the built-in default on the plays).
SPEECHES_CORPUS = {"path": str(DATA), "text_column": "document"}
# the smallest pretraining job: it trains its own tokenizer on the speeches (tests add their `training` section)
TINY_PRETRAIN = {
    "model": {"d_model": 16, "d_kv": 4, "d_ff": 32, "num_heads": 4, "num_layers": 1},
    "tokenizer": {"vocab_size": 300, "num_sentinels": 8},
    "data": {**SPEECHES_CORPUS, "max_input_length": 32, "max_target_length": 16, "tokens_per_batch": 128},
}
# a pretraining run that learns something in 8 steps and saves two checkpoints
SMALL_PRETRAIN = {
    "model": {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_heads": 4, "num_layers": 1},
    "tokenizer": {"vocab_size": 400, "num_sentinels": 16},
    "data": {**SPEECHES_CORPUS, "max_input_length": 64, "max_target_length": 32, "tokens_per_batch": 512},
    "training": {"max_steps": 8, "logging_steps": 1, "save_steps": 4, "eval_strategy": "no", "warmup_steps": 0,
                 "learning_rate": 1e-3, "save_total_limit": None},
}

FINETUNE_QUIET = {"disable_tqdm": True, "report_to": "none", "save_strategy": "no", "use_cpu": True}


# bf16 / fp16 kernels against the fp32 reference on a GPU: ‖out − ref‖ / ‖ref‖, the output and every gradient
GPU_TOLERANCE = 1e-2


def cuda_leaf(*shape, std=1.0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * std).to(dtype).requires_grad_()


def check_against_fp32_reference(run, inputs, backend: str = "triton", tolerance: float = GPU_TOLERANCE) -> list:
    """``run(backend, *inputs)``: the kernel ``backend`` picks on the low-precision ``inputs``, and
    ``run("reference", ...)`` on the same values in fp32; the output and every input's gradient within ``tolerance``.
    Returns the relative errors (output first)."""
    out = run(backend, *inputs)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    reference_inputs = [t.detach().float().requires_grad_() for t in inputs]
    expected = run("reference", *reference_inputs)
    expected_grads = torch.autograd.grad(expected, reference_inputs, grad_out.float())
    errors = [relative_error(out, expected)] + [relative_error(g, e) for g, e in zip(grads, expected_grads)]
    assert all(e <= tolerance for e in errors), errors
    return errors


def seq2seq_config(model, output_dir, lora=None, validation=True, **training) -> dict:
    """A `fat5 finetune` seq2seq config on the shipped speeches (document -> summary)."""
    return {
        "task": "seq2seq",
        "model": str(model),
        "output_dir": str(output_dir),
        "data": {
            "train_file": str(DATA),
            "validation_fraction": 0.25 if validation else None,
            "text_column": "document",
            "target_column": "summary",
            "max_target_length": 24,
        },
        "lora": lora,
        "training": {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 16, **FINETUNE_QUIET,
                     **training},
    }


# ---------------------------------------------------------------- transformers' T5 / UMT5 and FAT5 with its weights


def make_hf(family, seed=0):
    """A tiny transformers model of `family` ("t5", "t5v1.1" or "umt5"), in eval mode."""
    torch.manual_seed(seed)
    if family == "t5":
        hf = T5ForConditionalGeneration(T5Config(**TINY, feed_forward_proj="relu"))
    elif family == "t5v1.1":
        hf = T5ForConditionalGeneration(T5Config(**TINY, feed_forward_proj="gated-gelu", tie_word_embeddings=False))
    else:
        hf = UMT5ForConditionalGeneration(UMT5Config(**TINY, feed_forward_proj="gated-gelu", tie_word_embeddings=False))
    if family != "t5":
        # transformers 5 ties lm_head to the embedding whatever the config says; untie it, as in a real v1.1 checkpoint
        hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.lm_head.weight) * 0.5)
    if family == "umt5":
        # some transformers 5 releases (5.17) leave UMT5's decoder self-attention non-causal; conversion fixes the
        # reference the same way before it compares (no public name: the fix is conversion's own)
        _make_umt5_decoder_causal(hf, [])
    return hf.eval()


def fat5_from_hf(hf_model, family):
    """Copy an HF model's weights into a FAT5 model by name (the names are T5's on both sides)."""
    hf_config = hf_model.config
    config = FAT5Config(
        **TINY,
        feed_forward_proj=hf_config.feed_forward_proj,
        tie_word_embeddings=family == "t5",
        # what the installed transformers does: T5 reads `scale_decoder_outputs`, UMT5 scales when tied (always, in 5.x)
        scale_decoder_outputs=getattr(hf_config, "scale_decoder_outputs", hf_config.tie_word_embeddings),
        position_bias_per_layer=family == "umt5",
        attention_backend="reference",
        initialization="transformers",
    )
    model = FAT5ForConditionalGeneration(config).eval()
    missing, unexpected = model.load_state_dict(hf_model.state_dict(), strict=False)
    assert not [k for k in missing if "embed_tokens" not in k], missing
    assert not [k for k in unexpected if "embed_tokens" not in k], unexpected
    return model


def hf_and_fat5(family="t5", seed=3):
    """A transformers T5 and the FAT5 with its weights, both in eval mode."""
    hf = make_hf(family, seed=seed)
    if family != "t5":
        # transformers 5's T5Config always says tied; the head make_hf unties stays untied only if the config says so
        hf.config.tie_word_embeddings = False
    return hf, fat5_from_hf(hf, family)


def padded_batch(seed=1):
    """(input_ids, attention_mask, labels) over TINY's vocabulary: three rows, two right-padded, -100 in the labels."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, TINY["vocab_size"], (3, 11), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    attention_mask[2, 3:] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    labels = torch.randint(2, TINY["vocab_size"], (3, 6), generator=generator)
    labels[2, 4:] = -100
    return input_ids, attention_mask, labels


def word_tokenizer():
    """A word-level tokenizer with T5's special ids (pad 0, eos 1, unk 2) over the tiny vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    words = ["<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(3, TINY["vocab_size"])]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    backend.decoder = decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


# ------------------------------------------------------------------------------ checkpoints saved as the Hub's are

PREFIX = {"t5": "T5", "mt5": "MT5", "umt5": "UMT5"}

# name -> (model_type, extra config, how the saved folder is edited, expected tie, expected scale)
FAMILIES = {
    "t5": ("t5", {"feed_forward_proj": "relu"}, None, True, True),
    "t5-legacy": ("t5", {"feed_forward_proj": "relu"}, "legacy", True, True),
    "flan-t5": ("t5", {"feed_forward_proj": "gated-gelu"}, "untie", False, False),
    "mt5": ("mt5", {"feed_forward_proj": "gated-gelu"}, "untie", False, False),
    "umt5": ("umt5", {"feed_forward_proj": "gated-gelu"}, "untie", False, False),
    "umt5-tied": ("umt5", {"feed_forward_proj": "gated-gelu"}, None, True, True),
}


def transformers_class(model_type, suffix):
    """transformers' class for `model_type` ("t5", "mt5", "umt5") and `suffix` ("ForConditionalGeneration", ...)."""
    return getattr(transformers, PREFIX[model_type] + suffix)


def _edit_like_the_hub(folder: Path, how: str, seed: int) -> None:
    """Rewrite a transformers-5-saved folder the way older Hub checkpoints are stored."""
    tensors = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config.pop("scale_decoder_outputs", None)
    if how == "untie":  # FLAN-T5 / mT5 / UMT5: a separate lm_head, "tie_word_embeddings": false
        generator = torch.Generator().manual_seed(seed)
        tensors["lm_head.weight"] = torch.randn(tensors["shared.weight"].shape, generator=generator)
        config["tie_word_embeddings"] = False
    elif how == "legacy":  # original T5: old class name, no tie key (tied), every alias stored, an unused bias table
        config.pop("tie_word_embeddings", None)
        config["architectures"] = ["T5WithLMHeadModel"]
        for alias in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
            tensors[alias] = tensors["shared.weight"].clone()
        bias = tensors["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        tensors["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = torch.randn_like(bias)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))


def make_checkpoint(folder: Path, family: str, seed: int = 0, suffix: str = "ForConditionalGeneration") -> Path:
    """A tiny randomly initialised checkpoint of one of FAMILIES, saved by transformers and edited as the Hub's."""
    model_type, extra, how, _, _ = FAMILIES[family]
    torch.manual_seed(seed)
    config = transformers_class(model_type, "Config")(**TINY, **extra)
    transformers_class(model_type, suffix)(config).save_pretrained(folder)
    if how:
        _edit_like_the_hub(folder, how, seed)
    return folder


def padded_seq2seq_batch(vocab_size, seed=1):
    """Right-padded rows of different lengths (independent of the batch the conversion checks itself with)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, vocab_size, (4, 11), generator=generator)
    attention_mask = (torch.arange(11)[None] < torch.tensor([11, 6, 3, 9])[:, None]).long()
    decoder_input_ids = torch.randint(2, vocab_size, (4, 6), generator=generator)
    decoder_input_ids[:, 0] = 0
    decoder_attention_mask = (torch.arange(6)[None] < torch.tensor([6, 2, 4, 5])[:, None]).long()
    return {
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "decoder_input_ids": decoder_input_ids * decoder_attention_mask,
        "decoder_attention_mask": decoder_attention_mask,
    }


def model_without_tokenizer(model: Path, folder: Path) -> Path:
    """A copy of the model folder ``model`` without its tokenizer (what `fat5 convert` writes of a transformers-made
    T5)."""
    import shutil

    from fat5.folder_contents import TOKENIZER_FILES

    shutil.copytree(model, folder, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    return folder


def benchmark_module(name: str):
    """``benchmarks/NAME.py`` imported as a module (the benchmarks are scripts, not a package)."""
    specification = importlib.util.spec_from_file_location(f"benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------- processes without fat5

# the head of a script that must run where fat5 cannot be imported (a Hub bundle's remote code on its own)
BLOCK_FAT5 = r"""
import importlib.abc, sys

class BlockFat5(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fat5" or name.startswith("fat5."):
            raise ImportError(f"fat5 is blocked in this process ({name})")
        return None

sys.meta_path.insert(0, BlockFat5())
"""


def run_isolated(script: str, *args, tmp: Path, environment: dict | None = None) -> subprocess.CompletedProcess:
    """`script` in a fresh isolated interpreter (no PYTHONPATH, no cwd on sys.path), remote-code cache under `tmp`,
    offline unless ``environment`` (variables set on top) says otherwise."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_MODULES_CACHE=str(tmp / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env.update(environment or {})
    return subprocess.run(
        [sys.executable, "-I", "-c", script, *map(str, args)],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


# the README's quick-start job; tests/test_readme.py runs the README's commands as a reader does, in this environment
QUICK_START_JOB = "fat5 pretrain --output-dir outputs/fat5-tiny"
# the `fat5` console script of the Python running the tests comes first on the PATH, activated or not
READER_ENVIRONMENT = {**os.environ,
                      "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
# what the README's commands may take, tiny models on a CPU shared with other work
READER_TIMEOUT = 1800


def run_as_a_reader(command, cwd: Path, **options) -> subprocess.CompletedProcess:
    # stdin closed: a command that prompts (transformers' "run the custom code? [y/N]") fails instead of waiting
    return subprocess.run(command, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=READER_TIMEOUT, check=False, env=READER_ENVIRONMENT, **options)


def run_quick_start(folder: Path) -> subprocess.CompletedProcess:
    """The quick start's job in ``folder``, laid out as the repository root (its sources linked in, so that the
    README's relative paths resolve): the model lands in ``folder / "outputs/fat5-tiny"``."""
    for name in ("fat5", "tests", "examples", "benchmarks", "pyproject.toml"):
        (folder / name).symlink_to(REPO / name)
    completed = run_as_a_reader(QUICK_START_JOB.split(), folder)
    assert completed.returncode == 0, f"{QUICK_START_JOB} failed:\n{completed.stdout[-3000:]}{completed.stderr[-3000:]}"
    return completed


def run_in_a_fork(work, kill_after: float | None = None) -> float:
    """Runs ``work()`` in a forked copy of this process, killed (SIGKILL) after ``kill_after`` seconds if given, as a
    crash or the OOM killer would end it; returns the seconds until the copy was gone."""
    pid = os.fork()
    if pid == 0:
        try:
            work()
        finally:
            os._exit(0)
    started = time.perf_counter()
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return time.perf_counter() - started
