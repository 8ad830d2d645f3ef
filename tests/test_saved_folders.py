"""What a Hugging Face user does with a FAT5 model writes a folder that loads where fat5 and triton cannot be
imported (issue 41): `save_pretrained` of the package's class, `transformers.Trainer.save_model`, `push_to_hub` and
`save_pretrained(push_to_hub=True)` (uploads recorded by a local stand-in for the Hub); and the same model loaded as
remote code, in a process without fat5 (the Hub user's route), saved again by `save_pretrained`, a Trainer checkpoint,
`push_to_hub` and PEFT's merged save (issue 50: every file its config.json names, pipeline_fat5.py among them). The
folders are loaded in one fresh process that blocks fat5 and triton, and compared with the model that was saved; the
pipeline they name answers as `generate` and decoding do.
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


# the model loaded as remote code where fat5 and triton cannot be imported, then saved again each way a Hugging Face
# user saves it; the Trainer trains one step at learning rate 0 (its checkpoint keeps the weights), and LoRA's B
# matrices start at zero (the merged model keeps them too)
RESAVE_WITHOUT_FAT5_OR_TRITON = BLOCK_FAT5 + r"""
sys.modules["triton"] = None
import peft, transformers

source, out, repo = sys.argv[1:]
model = transformers.AutoModelForSeq2SeqLM.from_pretrained(source, trust_remote_code=True)
tokenizer = transformers.AutoTokenizer.from_pretrained(source, trust_remote_code=True)
model.save_pretrained(f"{out}/save_pretrained")
tokenizer.save_pretrained(f"{out}/save_pretrained")
arguments = transformers.Seq2SeqTrainingArguments(f"{out}/trainer", max_steps=1, learning_rate=0.0, save_steps=1,
                                                  report_to="none", use_cpu=True, disable_tqdm=True)
examples = [{"input_ids": [5, 17, 1], "labels": [9, 1]}] * 2
transformers.Seq2SeqTrainer(model=model, args=arguments, train_dataset=examples, processing_class=tokenizer,
                            data_collator=transformers.DataCollatorForSeq2Seq(tokenizer)).train()
model.push_to_hub(repo)
tokenizer.push_to_hub(repo)
lora = peft.LoraConfig(task_type="SEQ_2_SEQ_LM", target_modules=["q", "v"])
merged = peft.get_peft_model(model, lora).merge_and_unload()
merged.save_pretrained(f"{out}/peft_merged")
tokenizer.save_pretrained(f"{out}/peft_merged")
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


def _saved_with_fat5(model, tokenizer, hub, tmp_path) -> dict:  # noqa: F811
    """The folders the package's model is saved in, by name."""
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
    return folders


def _saved_as_remote_code(source, hub, tmp_path) -> dict:  # noqa: F811
    """The folders the model loaded from ``source`` as remote code, without fat5, is saved in, by name."""
    before = len(hub.commits())
    out = tmp_path / "as_remote_code"
    completed = run_isolated(RESAVE_WITHOUT_FAT5_OR_TRITON, source, out, "someone/fat5-resaved", tmp=tmp_path,
                             environment={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_test_token"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    commits = hub.commits()[before:]
    assert len(commits) == 2
    return {"remote code: save_pretrained": out / "save_pretrained",
            "remote code: Trainer checkpoint": out / "trainer" / "checkpoint-1",
            "remote code: push_to_hub": _write({**commits[0][1], **commits[1][1]}, tmp_path / "resaved_pushed"),
            "remote code: PEFT merged": out / "peft_merged"}


def test_every_way_of_saving_writes_a_folder_that_loads_without_fat5(model, hub, tmp_path):  # noqa: F811
    tokenizer = word_tokenizer()
    folders = _saved_with_fat5(model, tokenizer, hub, tmp_path)
    folders.update(_saved_as_remote_code(folders["save_pretrained"], hub, tmp_path))

    code = {p.name for p in (tmp_path / "save_pretrained").glob("*.py")}
    for name, folder in folders.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["auto_map"]["AutoModelForSeq2SeqLM"] == "modeling_fat5.FAT5ForConditionalGeneration", name
        named = {entry["impl"].partition(".")[0] + ".py" for entry in config["custom_pipelines"].values()}
        named |= {path.partition(".")[0] + ".py" for path in config["auto_map"].values()}
        assert named <= {p.name for p in folder.glob("*.py")} == code, name

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
