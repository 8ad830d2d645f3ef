"""Issue 41's first-hour items for finetuning and packaging: the generation config a finetuned model is saved with,
the model card's example, and FAT5 without triton.

The finetuned model is the tiny FAT5 of `make_tiny_model` trained for two steps on the shipped speeches, evaluated
with generation (what changed its generation config before), saved, bundled and exported as a transformers T5.
"""

import json
import logging
import os
import re
import runpy
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import transformers
import yaml
from helpers import REPO, ROWS, TINY_PRETRAIN, make_checkpoint, model_without_tokenizer, seq2seq_config
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, T5ForConditionalGeneration

from fat5 import FAT5Error
from fat5.conversion import export_hf
from fat5.hub_upload import bundle
from fat5.hub_upload.model_card import SAMPLE_TEXT, example_input
from fat5.trainer import train_tokenizer
from fat5.trainer.finetuning import finetune

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX = "summarize: "


@pytest.fixture(scope="module")
def finetuned(tiny_model, tmp_path_factory) -> Path:
    """A two-step finetuning with a generating evaluation at each step, a checkpoint and a bundle."""
    run = tmp_path_factory.mktemp("finetuned") / "run"
    config = seq2seq_config(tiny_model, run, max_steps=2, eval_strategy="steps", eval_steps=1,
                            save_strategy="steps", save_steps=2)
    config["data"]["source_prefix"] = PREFIX
    config["bundle"] = True
    finetune(config)
    return run


# ----------------------------------------------------------------------------------------------- generation config


def length_complaints(model, tokenizer) -> list[str]:
    """What ``generate(max_new_tokens=...)`` warns or logs about the generation length."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    transformers.logging.add_handler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generated = model.generate(**tokenizer([PREFIX + ROWS[0]["document"]], return_tensors="pt"),
                                       max_new_tokens=4)
    finally:
        transformers.logging.remove_handler(handler)
        transformers.logging.set_verbosity(verbosity)
    assert generated.shape[1] <= 5
    messages = [str(warning.message) for warning in caught] + [record.getMessage() for record in records]
    return [message for message in messages if "max_length" in message or "max_new_tokens" in message]


def saved_forms(finetuned: Path, tmp_path: Path) -> dict:
    """Every saved form of the finetuned model, loaded: the folder, its checkpoint, its bundle, its T5 export."""
    export_hf(finetuned, tmp_path / "t5", verify=False)
    return {
        "folder": AutoModelForSeq2SeqLM.from_pretrained(finetuned),
        "checkpoint": AutoModelForSeq2SeqLM.from_pretrained(finetuned / "checkpoint-2"),
        "bundle": AutoModelForSeq2SeqLM.from_pretrained(finetuned / "bundle", trust_remote_code=True),
        "t5 export": T5ForConditionalGeneration.from_pretrained(tmp_path / "t5"),
    }


def test_generating_from_every_saved_form_of_a_finetuned_model_names_no_length_conflict(finetuned, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(finetuned)
    for form, model in saved_forms(finetuned, tmp_path).items():
        assert length_complaints(model, tokenizer) == [], form
        # as transformers' own T5 checkpoints: the special tokens generation needs, no length of its own
        assert model.generation_config.max_length is None, form
        assert (model.generation_config.decoder_start_token_id, model.generation_config.eos_token_id) == (0, 1), form


def test_the_complaint_is_caught_where_the_saved_config_sets_max_length(finetuned, tmp_path):
    """The check above can fail: a generation config holding transformers' default length, as the finetuning used
    to save, makes the same call complain."""
    folder = tmp_path / "with-length"
    shutil.copytree(finetuned, folder, ignore=shutil.ignore_patterns("checkpoint-*", "bundle"))
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "max_length": 20}))
    complaints = length_complaints(AutoModelForSeq2SeqLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))
    assert any("max_length" in complaint for complaint in complaints), complaints


# ----------------------------------------------------------------------------------------------- the demo

DEMO = REPO / "fat5" / "trainer" / "configs" / "finetune_shakespeare.yaml"


def test_the_finetuning_demo_scores_higher_at_its_last_evaluation_than_before_its_first_step(tiny_model, tmp_path,
                                                                                             monkeypatch):
    """The README's demo as configured, on the tests' tiny random model instead of the quick start's (a half-hour
    pretraining on a shared CPU): evaluated before any step and along the way, its ROUGE rises."""
    monkeypatch.chdir(REPO)  # the demo's data path is relative to the repository root, where the README runs it
    result = finetune(DEMO, output_dir=tmp_path / "demo",
                      overrides=[f"model={tiny_model}", "training.disable_tqdm=true"])
    evaluations = [entry for entry in result["log_history"] if "eval_rouge1" in entry]
    assert evaluations[0]["step"] == 0 and len(evaluations) >= 4
    first, last = evaluations[0]["eval_rouge1"], result["eval"]["eval_rouge1"]
    assert last > first + 10, [(entry["step"], entry["eval_rouge1"]) for entry in evaluations]


# ----------------------------------------------------------------------------------------------- model card


def card_code(folder: Path) -> str:
    card = (folder / "README.md").read_text(encoding="utf-8")
    [code] = [code for language, code in re.findall(r"```(\w+)\n(.*?)```", card, re.DOTALL) if language == "python"]
    return code


def test_the_card_of_a_finetuned_model_prompts_with_its_finetuning_prefix(finetuned, tmp_path, capsys):
    code = card_code(finetuned / "bundle")
    assert f'tokenizer("{PREFIX}{SAMPLE_TEXT}"' in code and "translate" not in code
    # the card's code runs as written on the bundle, and answers what the model generates for that input
    program = tmp_path / "card_example.py"
    program.write_text(code.replace("path/to/this/folder", str(finetuned / "bundle")))
    runpy.run_path(str(program))
    model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(finetuned), AutoTokenizer.from_pretrained(finetuned)
    expected = tokenizer.decode(model.generate(**tokenizer(PREFIX + SAMPLE_TEXT, return_tensors="pt"),
                                               max_new_tokens=32)[0], skip_special_tokens=True)
    assert capsys.readouterr().out.strip() == expected.strip()

    # bundled later from the finetuned folder, the prefix comes from the finetune_config.yaml the job wrote there
    bundle(finetuned, tmp_path / "later", validate=False)
    assert f'tokenizer("{PREFIX}{SAMPLE_TEXT}"' in card_code(tmp_path / "later")


def test_the_cards_example_fits_how_the_model_was_trained(tiny_model, tmp_path):
    assert example_input(tiny_model) == SAMPLE_TEXT
    assert example_input(tiny_model, {"repo_id": "google/flan-t5-small"}).startswith("translate English to German: ")
    assert example_input(tiny_model, {"repo_id": "google/t5-v1_1-small"}) == SAMPLE_TEXT
    assert example_input(tiny_model, source_prefix='say "hi": ') == 'say "hi": ' + SAMPLE_TEXT

    # a tokenizer with UL2's mode tokens, as `fat5 pretrain` trains: the prefix-LM mode, which continues the text
    pretrained = tmp_path / "pretrained"
    train_tokenizer([row["document"] for row in ROWS], vocab_size=300, num_sentinels=8, save_directory=pretrained)
    assert example_input(pretrained) == "[S] " + SAMPLE_TEXT

    (pretrained / "finetune_config.yaml").write_text(yaml.safe_dump({"data": {"source_prefix": ""}}))
    assert example_input(pretrained) == SAMPLE_TEXT
    (pretrained / "finetune_config.yaml").write_text("data: [unclosed\n")
    with pytest.raises(FAT5Error) as refused:
        example_input(pretrained)
    assert str(refused.value) == (f"{pretrained / 'finetune_config.yaml'} is not valid YAML at line 2; fix it or "
                                  "remove it from the model folder")
    (pretrained / "finetune_config.yaml").unlink()
    (pretrained / "tokenizer.json").write_text('{"added_tokens": [')
    with pytest.raises(FAT5Error) as refused:
        example_input(pretrained)
    assert str(refused.value).startswith(f"{pretrained / 'tokenizer.json'} is not valid JSON (")
    assert "\n" not in str(refused.value)


# ----------------------------------------------------------------------------------------------- without triton

# imported first by every Python started with this folder on PYTHONPATH (the environment has no sitecustomize of
# its own): `import triton` then fails and importlib.util.find_spec answers None, as where triton is not installed
NO_TRITON_SITECUSTOMIZE = 'import sys\nsys.modules["triton"] = None\n'

NO_TRITON_JOB = r"""
import json, sys
import torch
from fat5.conversion import convert
from fat5.hub_upload import bundle
from fat5.kernels import dispatch
from fat5.testing import make_tiny_model
from fat5.trainer import pretrain
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

work, t5_checkpoint, texts, pretrain_config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
assert dispatch.TRITON_UNUSABLE_REASON == "the `triton` package is not installed", dispatch.TRITON_UNUSABLE_REASON
model_dir = make_tiny_model(work + "/tiny", texts)
model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
batch = tokenizer(texts[:2], return_tensors="pt", padding=True)
assert torch.isfinite(model(**batch, labels=batch["input_ids"]).loss)
assert model.generate(**batch, max_new_tokens=3).shape == (2, 4)

convert(t5_checkpoint, work + "/converted")
# the bundle's own check loads it in a further process that can import neither fat5 nor triton
bundle(model_dir, work + "/bundle")
loaded_bundle = AutoModelForSeq2SeqLM.from_pretrained(work + "/bundle", trust_remote_code=True)
assert loaded_bundle.generate(**batch, max_new_tokens=3).shape == (2, 4)

summary = pretrain(pretrain_config, work + "/pretrained")
assert summary["steps"] == 2, summary
loaded = sorted(name for name, module in sys.modules.items() if name.split(".")[0] == "triton" and module)
assert not loaded, loaded
print("ran without triton")
"""


def test_fat5_runs_converts_bundles_and_pretrains_where_triton_is_not_installed(tmp_path):
    blocker = tmp_path / "no-triton"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(NO_TRITON_SITECUSTOMIZE)
    t5_checkpoint = make_checkpoint(tmp_path / "t5", "t5")
    pretrain_config = {**TINY_PRETRAIN, "training": {"max_steps": 2, "eval_strategy": "no", "save_strategy": "no",
                                                     "disable_tqdm": True, "report_to": "none"}}
    environment = {**os.environ, "PYTHONPATH": str(blocker), "HF_MODULES_CACHE": str(tmp_path / "modules"),
                   "CUDA_VISIBLE_DEVICES": ""}
    environment.pop("TRITON_INTERPRET", None)
    completed = subprocess.run(
        [sys.executable, "-c", NO_TRITON_JOB, str(tmp_path), str(t5_checkpoint),
         json.dumps([row["document"] for row in ROWS]), json.dumps(pretrain_config)],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=900, check=False,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    assert "ran without triton" in completed.stdout


def test_a_cuda_machine_without_triton_is_told_in_one_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(NO_TRITON_SITECUSTOMIZE)
    program = ("import json, torch, warnings\ntorch.cuda.is_available = lambda: CUDA\n"
               "with warnings.catch_warnings(record=True) as caught:\n    warnings.simplefilter('always')\n"
               "    import fat5\nprint(json.dumps([str(warning.message) for warning in caught]))\n")
    told = {}
    for cuda in (True, False):
        completed = subprocess.run([sys.executable, "-c", program.replace("CUDA", str(cuda))], cwd=tmp_path,
                                   capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                                   timeout=300, check=False)
        assert completed.returncode == 0, completed.stderr[-3000:]
        told[cuda] = [message for message in json.loads(completed.stdout.splitlines()[-1])
                      if "triton" in message.lower()]
    [message] = told[True]
    assert "\n" not in message and "Triton kernels are off" in message and "pip install 'triton>=3.3'" in message
    assert told[False] == []


def test_triton_is_no_base_dependency_but_the_dev_extra_has_it():
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [requirement for requirement in project["dependencies"] if requirement.startswith("triton")]
    assert any(requirement.startswith("triton>=3.3") for requirement in project["optional-dependencies"]["dev"])


# the `fat5` command in a fresh process, which says on its last stderr line whether torch was imported
COMMAND_SAYING_IF_TORCH_LOADED = ("import sys\nfrom fat5_command import main\nstatus = main(sys.argv[1:])\n"
                                  "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n"
                                  "sys.exit(status)\n")


@pytest.mark.parametrize("mistake", ["model without a tokenizer", "empty data file"])
def test_finetune_names_a_mistake_of_its_inputs_before_torch_loads(mistake, tiny_model, tmp_path):
    """A model converted from a transformers-made T5 has no tokenizer: `fat5 finetune` said sentencepiece or tiktoken
    was missing, after importing torch and transformers, and hid a missing data file too (issue 50). What the job
    reads from this machine is checked before those imports, and named in one line."""
    model = model_without_tokenizer(tiny_model, tmp_path / "converted") if "tokenizer" in mistake else tiny_model
    config = seq2seq_config(model, tmp_path / "run")
    if mistake == "empty data file":
        config["data"]["train_file"] = str(tmp_path / "train.jsonl")
        (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    completed = subprocess.run([sys.executable, "-c", COMMAND_SAYING_IF_TORCH_LOADED, "finetune",
                                str(tmp_path / "config.yaml")], capture_output=True, text=True, timeout=300,
                               check=False)
    assert completed.returncode == 2 and completed.stdout == ""
    said = {"model without a tokenizer": f"model: {tmp_path / 'converted'} holds no tokenizer (none of tokenizer.json",
            "empty data file": f"data.train_file: {tmp_path / 'train.jsonl'} is empty"}[mistake]
    error, torch_loaded = completed.stderr.splitlines()
    assert error.startswith(f"fat5 finetune: error: {said}") and torch_loaded == "torch imported: False"
    assert not (tmp_path / "run").exists()
