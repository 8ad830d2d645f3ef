"""What a Hugging Face user does with a FAT5 model writes a folder that loads where fat5 and triton cannot be
imported (issue 41): `save_pretrained` of the package's class, `transformers.Trainer.save_model`, `push_to_hub` and
`save_pretrained(push_to_hub=True)` (uploads recorded by a local stand-in for the Hub). The folders are loaded in one
fresh process that blocks fat5 and triton, and compared with the model that was saved; the pipeline they name answers
as `generate` and decoding do.
"""

import json

import pytest
import torch
from helpers import BLOCK_FAT5, run_isolated, word_tokenizer
from test_push import hub  # noqa: F401  (the fixture: a local HTTP server standing in for the Hub)
from transformers import Trainer, TrainingArguments

from fat5 import FAT5ForConditionalGeneration
from fat5.testing import tiny_config

TEXTS = ["w5 w17 w3 w40 w41", "w9 w9 w12"]
GENERATION = {"max_new_tokens": 6, "num_beams": 2}

LOAD_WITHOUT_FAT5_OR_TRITON = BLOCK_FAT5 + r"""
sys.modules["triton"] = None  # `import triton` fails: as if it were not installed
import json
import torch, transformers

batch_file, out_file, texts, generation, *folders = sys.argv[1:]
batch, texts, generation = torch.load(batch_file), json.loads(texts), json.loads(generation)
results = {}
for folder in folders:
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    with torch.no_grad():
        logits = model(**batch).logits
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    results[folder] = {"logits": logits, "input_ids": tokenizer(texts)["input_ids"], "pipelines": {
        task: transformers.pipeline(task, model=folder, trust_remote_code=True)(texts, **generation)
        for task in ("text2text-generation", "text-generation")
    }}
results["fat5_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "fat5" and sys.modules[m] is not None)
torch.save(results, out_file)
"""


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return FAT5ForConditionalGeneration(tiny_config(vocab_size=96)).eval()


def _expected(model, tokenizer, batch):
    """The saved model's logits, and what generate + decode give for each text."""
    with torch.no_grad():
        logits = model(**batch).logits
        texts = [
            tokenizer.decode(model.generate(**tokenizer(text, return_tensors="pt"), **GENERATION)[0],
                             skip_special_tokens=True)
            for text in TEXTS
        ]
    return logits, texts


def _write(files: dict, folder):
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return folder


def test_every_way_of_saving_writes_a_folder_that_loads_without_fat5(model, hub, tmp_path):  # noqa: F811
    tokenizer = word_tokenizer()
    folders = {}
    model.save_pretrained(tmp_path / "save_pretrained")
    tokenizer.save_pretrained(tmp_path / "save_pretrained")
    folders["save_pretrained"] = tmp_path / "save_pretrained"

    arguments = TrainingArguments(tmp_path / "trainer", report_to="none", use_cpu=True, save_strategy="no")
    Trainer(model=model, args=arguments, processing_class=tokenizer).save_model(tmp_path / "trainer")
    folders["trainer"] = tmp_path / "trainer"

    model.push_to_hub("someone/fat5-pushed")
    tokenizer.push_to_hub("someone/fat5-pushed")
    model.save_pretrained(tmp_path / "save_and_push", push_to_hub=True, repo_id="someone/fat5-saved")
    commits = hub.commits()
    assert len(commits) == 3
    folders["push_to_hub"] = _write({**commits[0][1], **commits[1][1]}, tmp_path / "pushed")
    uploaded = commits[2][1]
    assert {"config.json", "modeling_fat5.py", "attention.py", "pipeline_fat5.py"} <= set(uploaded)
    folders["save_pretrained(push_to_hub=True)"] = _write({**uploaded, **commits[1][1]}, tmp_path / "saved_pushed")

    code = {p.name for p in (tmp_path / "save_pretrained").glob("*.py")}
    for name, folder in folders.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["auto_map"]["AutoModelForSeq2SeqLM"] == "modeling_fat5.FAT5ForConditionalGeneration", name
        assert {p.name for p in folder.glob("*.py")} == code, name

    batch = {key: torch.tensor(value) for key, value in tokenizer(TEXTS, padding=True).items()}
    batch["decoder_input_ids"] = torch.tensor([[0, 5, 9, 11], [0, 3, 3, 4]])
    torch.save(batch, tmp_path / "batch.pt")
    completed = run_isolated(LOAD_WITHOUT_FAT5_OR_TRITON, tmp_path / "batch.pt", tmp_path / "out.pt",
                             json.dumps(TEXTS), json.dumps(GENERATION), *folders.values(), tmp=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    remote = torch.load(tmp_path / "out.pt")
    assert remote.pop("fat5_loaded") == []

    logits, texts = _expected(model, tokenizer, batch)
    assert any(texts)  # a non-empty answer, so that a pipeline returning nothing cannot pass
    for name, folder in folders.items():
        torch.testing.assert_close(remote[str(folder)]["logits"], logits, rtol=1e-5, atol=1e-5, msg=name)
        assert remote[str(folder)]["input_ids"] == tokenizer(TEXTS)["input_ids"], name
        for task, answers in remote[str(folder)]["pipelines"].items():
            assert answers == [[{"generated_text": text}] for text in texts], (name, task)
