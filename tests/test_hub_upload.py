"""Bundled FAT5 folders: flat remote code that loads with trust_remote_code=True where fat5 cannot be imported.

The load checks run in fresh `python -I` processes with their own blockers (written here, independent of the
bundle's own validation), and compare against the in-package model.
"""

import ast
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import BLOCK_FAT5, TINY, make_checkpoint, padded_seq2seq_batch, run_isolated
from huggingface_hub import ModelCard

import fat5
from fat5 import FAT5ForConditionalGeneration, FAT5Model
from fat5.commands.convert import convert_to_hub_folder
from fat5.conversion import convert
from fat5.errors import FAT5Error
from fat5.hub_upload import BundleError, bundle, flatten_remote_code
from fat5_command import build_parser

bundle_module = sys.modules["fat5.hub_upload.bundle"]

REQUIRED_AUTO_MAP = {
    "AutoConfig": "configuration_fat5.FAT5Config",
    "AutoModel": "modeling_fat5.FAT5Model",
    "AutoModelForSeq2SeqLM": "modeling_fat5.FAT5ForConditionalGeneration",
    "AutoModelForSequenceClassification": "modeling_fat5.FAT5ForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_fat5.FAT5ForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_fat5.FAT5ForQuestionAnswering",
}


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    source = make_checkpoint(root / "src", "flan-t5")
    (source / "spiece.model").write_bytes(b"tokenizer bytes")
    (source / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    convert(source, root / "converted")
    return root / "converted"


@pytest.fixture(scope="module")
def bundled(converted_dir):
    out = converted_dir.parent / "bundle"
    result = bundle(
        converted_dir, out, repo_id="someone/fat5-tiny", license="apache-2.0", base_model="google/flan-t5-small"
    )
    return out, result


def test_bundle_layout_and_card(bundled, converted_dir):
    out, result = bundled
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", "fat5_conversion.json"} <= names
    assert {"spiece.model", "tokenizer_config.json"} <= names
    expected_code = {"configuration_fat5.py", "modeling_fat5.py", "position_encoding.py", "token_layout.py",
                     "graphed_decoding.py", "remote_code.py", "pipeline_fat5.py"} | {
        p.name for p in (Path(fat5.__file__).parent / "kernels").glob("*.py") if p.name != "__init__.py"
    }
    assert {n for n in names if n.endswith(".py")} == expected_code
    config = json.loads((out / "config.json").read_text())
    assert REQUIRED_AUTO_MAP.items() <= config["auto_map"].items()
    assert result.validation["AutoModelForSeq2SeqLM_relative_error"] <= 1e-5 and result.validation["generate_equal"]

    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text2text-generation"
    assert card.data.base_model == "google/flan-t5-small"
    assert card.data.license == "apache-2.0"
    assert "fat5" in card.data.tags
    assert 'AutoModelForSeq2SeqLM.from_pretrained("someone/fat5-tiny", trust_remote_code=True)' in card.text
    assert card.text.lstrip().startswith("# fat5-tiny\n")
    report = json.loads((converted_dir / "fat5_conversion.json").read_text())
    assert f"| logits | {report['verification']['logits_relative_error']:.2e} |" in card.text


def test_card_of_a_hub_conversion_names_its_base_model_and_licence(tmp_path, monkeypatch):
    """`fat5 convert HUB_ID OUT --bundle` with no card options: base_model is the Hub id, the licence the source
    card's (the download itself is replaced by a local folder, as the Hub would leave it in the cache)."""
    source = make_checkpoint(tmp_path / "src", "mt5")
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n# mT5\n")
    checkpoint = sys.modules["fat5.conversion.checkpoint"]
    monkeypatch.setattr(checkpoint, "_download_from_hub", lambda repo_id, revision: source)
    result = convert_to_hub_folder("google/mt5-small", tmp_path / "out")
    assert (result.source, result.repo_id) == ("google/mt5-small", "google/mt5-small")
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert (card.data.base_model, card.data.license) == ("google/mt5-small", "apache-2.0")
    assert {"fat5", "mt5"} <= set(card.data.tags)
    assert "a FAT5 conversion of [google/mt5-small](https://huggingface.co/google/mt5-small)" in card.text
    assert card.text.lstrip().startswith("# mt5-small in FAT5\n")


def test_a_card_without_repo_or_base_model_says_what_the_folder_holds(converted_dir):
    from fat5.hub_upload.model_card import build_model_card

    config = json.loads((converted_dir / "config.json").read_text())
    card = build_model_card(config, architecture="FAT5ForConditionalGeneration")
    assert card.text.lstrip().startswith("# A FAT5 model (FAT5ForConditionalGeneration)\n")


def test_flat_code_is_self_contained(bundled):
    """Independent of the bundler's own check: no file imports fat5, every relative import names a bundled sibling."""
    out, _ = bundled
    siblings = {p.stem for p in out.glob("*.py")}
    for path in out.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "fat5" for a in node.names), path.name
            elif isinstance(node, ast.ImportFrom):
                assert node.level in (0, 1), (path.name, node.lineno)
                if node.level == 0:
                    assert (node.module or "").split(".")[0] != "fat5", path.name
                else:
                    targets = [node.module] if node.module else [a.name for a in node.names]
                    assert set(targets) <= siblings, (path.name, node.lineno, targets)


LOAD_WITHOUT_FAT5 = BLOCK_FAT5 + r"""
try:
    import fat5
except ImportError:
    pass
else:
    raise SystemExit("fat5 could be imported")
import torch, transformers

folder, batch_file, out_file, resaved = sys.argv[1:5]
batch = torch.load(batch_file)
seq2seq = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
base = transformers.AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
prompt = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "max_new_tokens": 5}
with torch.no_grad():
    results = {
        "logits": seq2seq.eval()(**batch).logits,
        "hidden": base.eval()(**batch).last_hidden_state,
        "greedy": seq2seq.generate(**prompt, do_sample=False),
        "beam": seq2seq.generate(**prompt, do_sample=False, num_beams=2),
        "modules": [type(seq2seq).__module__, type(base).__module__],
        "fat5_loaded": sorted(m for m in sys.modules if m.split(".")[0] == "fat5"),
    }
    seq2seq.config.graphed_decoding = "always"  # the graphed loop's step, run eagerly on the CPU
    results["graphed"] = seq2seq.generate(**prompt, do_sample=False)
    results["graphed_uses"] = seq2seq.__dict__["_graphed_decoding_state"].graph_uses
# the model the remote code loads saves a folder that loads in turn
transformers.AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).save_pretrained(resaved)
resaved_model = transformers.AutoModelForSeq2SeqLM.from_pretrained(resaved, trust_remote_code=True)
results["resaved_module"] = type(resaved_model).__module__
torch.save(results, out_file)
"""


@pytest.fixture(scope="module")
def outside_fat5(bundled, tmp_path_factory):
    """What LOAD_WITHOUT_FAT5 gives for the bundle, and its batch: one fresh process, which imports torch and
    transformers once for the tests that read it."""
    out, _ = bundled
    scratch = tmp_path_factory.mktemp("outside-fat5")
    batch = padded_seq2seq_batch(TINY["vocab_size"], seed=5)
    torch.save(batch, scratch / "batch.pt")
    completed = run_isolated(LOAD_WITHOUT_FAT5, out, scratch / "batch.pt", scratch / "out.pt",
                             scratch / "remote-saved", tmp=scratch)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return torch.load(scratch / "out.pt"), batch


def test_bundle_loads_without_fat5(bundled, outside_fat5):
    out, _ = bundled
    remote, batch = outside_fat5
    assert all(module.startswith("transformers_modules.") for module in remote["modules"])
    assert remote["fat5_loaded"] == []

    local = FAT5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    local_base = FAT5Model.from_pretrained(out, dtype=torch.float32).eval()
    prompt = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "max_new_tokens": 5}
    with torch.no_grad():
        keep = batch["decoder_attention_mask"].bool()
        torch.testing.assert_close(remote["logits"][keep], local(**batch).logits[keep], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            remote["hidden"][keep], local_base(**batch).last_hidden_state[keep], rtol=1e-5, atol=1e-6
        )
        assert torch.equal(remote["greedy"], local.generate(**prompt, do_sample=False))
        assert torch.equal(remote["beam"], local.generate(**prompt, do_sample=False, num_beams=2))
    assert torch.equal(remote["graphed"], remote["greedy"])
    assert remote["graphed_uses"] == 1


CHECK_IMPORTS_WITHOUT_TRITON = r"""
import glob, os, sys
sys.modules["triton"] = None  # `import triton` fails and find_spec answers None: as if it were not installed
import torch, transformers
from transformers.dynamic_module_utils import check_imports

folder, scratch = sys.argv[1:3]
for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
    check_imports(path)
control = os.path.join(scratch, "control.py")
with open(control, "w") as handle:
    handle.write("import torch\nimport triton\n")
try:
    check_imports(control)
except ImportError:
    pass
else:
    raise SystemExit("negative control: an unguarded `import triton` passed check_imports")
model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
print("ok", type(model).__name__)
"""


def test_flat_code_passes_check_imports_without_triton(bundled, tmp_path):
    out, _ = bundled
    completed = run_isolated(CHECK_IMPORTS_WITHOUT_TRITON, out, tmp_path, tmp=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "ok FAT5ForConditionalGeneration" in completed.stdout


def test_a_model_loaded_from_a_bundle_saves_a_folder_that_loads(bundled, outside_fat5, tmp_path):
    """A saved FAT5 folder carries its remote code with its auto_map (issue 41), whether the package's classes or
    the bundle's own, run as remote code, saved it."""
    from transformers import AutoModelForSeq2SeqLM

    out, _ = bundled
    FAT5ForConditionalGeneration.from_pretrained(out).save_pretrained(tmp_path / "saved")
    saved_config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert REQUIRED_AUTO_MAP.items() <= saved_config["auto_map"].items()
    assert {p.name for p in out.glob("*.py")} == {p.name for p in (tmp_path / "saved").glob("*.py")}
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "saved", trust_remote_code=True)
    assert isinstance(reloaded, FAT5ForConditionalGeneration)
    remote, _ = outside_fat5
    assert remote["resaved_module"].startswith("transformers_modules.")


def test_sharded_bundle(converted_dir, tmp_path):
    result = bundle(converted_dir, tmp_path / "sharded", max_shard_size="20KB", validate=False)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and shards <= set(result.files)
    batch = padded_seq2seq_batch(TINY["vocab_size"])
    with torch.no_grad():
        expected = FAT5ForConditionalGeneration.from_pretrained(converted_dir).eval()(**batch).logits
        actual = FAT5ForConditionalGeneration.from_pretrained(tmp_path / "sharded").eval()(**batch).logits
    assert torch.equal(actual, expected)


def test_encoder_bundle_auto_map(tmp_path):
    source = make_checkpoint(tmp_path / "src", "t5", suffix="EncoderModel")
    convert(source, tmp_path / "converted")
    result = bundle(tmp_path / "converted", tmp_path / "out", validate=False)
    assert result.auto_map["AutoModel"] == "modeling_fat5.FAT5EncoderModel"
    assert "AutoModelForSeq2SeqLM" not in result.auto_map
    assert ModelCard.load(tmp_path / "out" / "README.md").data.pipeline_tag == "feature-extraction"


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


def test_bundle_refuses_a_transformers_folder(tmp_path):
    source = make_checkpoint(tmp_path / "src", "t5")
    with pytest.raises(BundleError, match="convert it first"):
        bundle(source, tmp_path / "out")
    assert _leftovers(tmp_path / "out") == []


def test_bundle_of_corrupted_weights_is_one_clear_line(converted_dir, tmp_path, capsys):
    """Through the `fat5` command, as a user meets it: exit status 2, one line on stderr, nothing left behind."""
    from fat5.cli import main

    broken = tmp_path / "broken"
    broken.mkdir()
    for path in converted_dir.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    weights = (converted_dir / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    assert main(["bundle", str(broken), str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("fat5 bundle: error: ") and "does not load as FAT5ForConditionalGeneration" in line
    assert _leftovers(tmp_path / "out") == []


class _OpensAFile:
    """Unpickled, it would create `path`: what an unsafe pickle could do instead."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_bundle_of_an_unsafe_pickle_is_one_clear_line_and_never_runs_it(converted_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    from fat5.cli import main

    unsafe = tmp_path / "unsafe"
    unsafe.mkdir()
    for path in converted_dir.iterdir():
        if path.name != "model.safetensors":
            (unsafe / path.name).write_bytes(path.read_bytes())
    marker = tmp_path / "the pickle ran"
    tensors = load_file(converted_dir / "model.safetensors")
    torch.save({**tensors, "payload": _OpensAFile(marker)}, unsafe / "pytorch_model.bin")
    assert main(["bundle", str(unsafe), str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("fat5 bundle: error: ") and "pytorch_model.bin" in line and "refus" in line
    assert not marker.exists() and _leftovers(tmp_path / "out") == []


def test_bundle_that_does_not_load_is_not_kept(converted_dir, tmp_path, monkeypatch):
    flat = flatten_remote_code()
    flat["modeling_fat5.py"] += "\nraise RuntimeError('deliberately broken remote code')\n"
    monkeypatch.setattr(bundle_module, "flatten_remote_code", lambda: flat)
    with pytest.raises(BundleError, match="deliberately broken remote code"):
        bundle(converted_dir, tmp_path / "out")
    assert _leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("layout", ["parent", "same"])
def test_bundle_overwrite_never_replaces_a_folder_that_holds_the_input(converted_dir, tmp_path, layout):
    """`fat5 bundle MODEL OUT --overwrite` with OUT holding MODEL (or being it) is refused; MODEL and its siblings
    survive."""
    import shutil

    from fat5.cli import main

    models = tmp_path / "models"
    model = Path(shutil.copytree(converted_dir, models / "fat5"))
    (models / "notes.txt").write_text("a sibling of the model")
    out = models if layout == "parent" else model
    before = {path: path.read_bytes() for path in models.rglob("*") if path.is_file()}
    with pytest.raises(FAT5Error, match="holds the input"):
        bundle(model, out, overwrite=True, validate=False)
    assert main(["bundle", str(model), str(out), "--overwrite", "--no-validate"]) == 2
    assert {path: path.read_bytes() for path in models.rglob("*") if path.is_file()} == before


def test_bundle_overwrite_replaces_a_bundle_never_the_users_files(converted_dir, tmp_path):
    out = tmp_path / "bundle"
    bundle(converted_dir, out, validate=False)
    bundle(converted_dir, out, overwrite=True, validate=False)  # an earlier bundle, model card and manifest included
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FAT5Error, match=r"holds files that FAT5 did not write \(notes.txt\)"):
        bundle(converted_dir, out, overwrite=True, validate=False)
    assert (out / "notes.txt").read_text() == "mine" and (out / "README.md").is_file()


# --------------------------------------------------------------------------------------------- flattening


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


FAKE_PACKAGE = {
    "configuration_fat5.py": "class FAT5Config:\n    value = 3\n",
    "token_layout.py": "class TokenLayout:\n    pass\n",
    "position_encoding.py": (
        "from .configuration_fat5 import FAT5Config\n\n\ndef offset():\n    return FAT5Config.value\n"
    ),
    "graphed_decoding.py": "from .kernels.dispatch import pick\n\n\ndef decode():\n    return pick()\n",
    "modeling_fat5.py": (
        "from .configuration_fat5 import FAT5Config\n"
        "from .token_layout import TokenLayout\n"
        "from .graphed_decoding import decode\n"
        "from .kernels.attention import attend\n"
        "from .kernels import dispatch as chooser\n\n\n"
        "class FAT5Model:\n    pass\n\n\n"
        "def run():\n    return attend(FAT5Config.value) + chooser.pick()\n"
    ),
    "remote_code.py": "from .pipeline_fat5 import Pipeline\n",
    "pipeline_fat5.py": "class Pipeline:\n    pass\n",
    "kernels/__init__.py": "",
    "kernels/dispatch.py": "def pick():\n    return 10\n",
    "kernels/helper.py": "def double(x):\n    return 2 * x\n",
    "kernels/attention.py": (
        "from .dispatch import pick\n"
        "from ..configuration_fat5 import FAT5Config\n\n\n"
        "def attend(x):\n"
        "    try:\n"
        "        from . import helper as _helper\n"
        "    except ImportError:\n"
        "        _helper = None\n"
        "    return _helper.double(x) + pick() + FAT5Config.value\n"
    ),
}


def test_flatten_rewrites_relative_imports_and_the_result_runs(tmp_path):
    flat = flatten_remote_code(_write_package(tmp_path / "fat5", FAKE_PACKAGE))
    assert set(flat) == {"configuration_fat5.py", "modeling_fat5.py", "position_encoding.py", "token_layout.py",
                         "graphed_decoding.py", "remote_code.py", "pipeline_fat5.py", "dispatch.py", "helper.py",
                         "attention.py"}
    assert "from .dispatch import pick" in flat["graphed_decoding.py"]
    assert "from .attention import attend" in flat["modeling_fat5.py"]
    assert "from .dispatch import pick" in flat["attention.py"]
    assert "from .configuration_fat5 import FAT5Config" in flat["attention.py"]
    assert "        from .helper import __name__" in flat["attention.py"]  # visible to transformers, inside the try
    # the flat files work as a package of siblings: attend(3) = 2 * 3 + 10 + 3, plus pick() = 10
    flat_package = tmp_path / "flat" / "flatpkg"
    _write_package(flat_package, {**flat, "__init__.py": ""})
    sys.path.insert(0, str(tmp_path / "flat"))
    try:
        assert importlib.import_module("flatpkg.modeling_fat5").run() == 29
    finally:
        sys.path.remove(str(tmp_path / "flat"))
        for name in [m for m in sys.modules if m.split(".")[0] == "flatpkg"]:
            del sys.modules[name]


@pytest.mark.parametrize(
    "file, text, message",
    [
        ("kernels/helper.py", "import fat5.trainer\n", "imports fat5.trainer absolutely"),
        ("kernels/helper.py", "from fat5.kernels import dispatch\n", "imports fat5.kernels absolutely"),
        ("kernels/helper.py", "from ..trainer import collate\n", "fat5.trainer .*does not ship as remote code"),
        ("kernels/helper.py", "def f():\n    from .missing_kernel import g\n", "missing_kernel.py does not exist"),
    ],
)
def test_flatten_rejects_what_cannot_ship(tmp_path, file, text, message):
    with pytest.raises(BundleError, match=message):
        flatten_remote_code(_write_package(tmp_path / "fat5", {**FAKE_PACKAGE, file: text}))


def test_bundle_command_line(converted_dir, tmp_path, capsys):

    parser = build_parser()
    args = parser.parse_args(["bundle", str(converted_dir), str(tmp_path / "out"), "--no-validate"])
    assert args.func(args) == 0
    assert "auto_map" in json.loads((tmp_path / "out" / "config.json").read_text())
    assert str(tmp_path / "out") in capsys.readouterr().out


CUDA_REMOTE_CODE = BLOCK_FAT5 + r"""
import torch, transformers

folder, batch_file, out_file = sys.argv[1:4]
batch = {k: v.cuda() for k, v in torch.load(batch_file).items()}
results = {}
for backend, dtype in (("triton", torch.bfloat16), ("reference", torch.float32)):
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        folder, trust_remote_code=True, dtype=dtype, attention_backend=backend
    ).cuda().eval()
    with torch.no_grad():
        results[backend] = model(**batch).logits.float().cpu()
        results[backend + "_generate"] = model.generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=8
        ).cpu()
results["triton_modules"] = sorted(m for m in sys.modules if m.startswith("transformers_modules") and "triton" in m)
torch.save(results, out_file)
"""


@pytest.mark.gpu
def test_bundle_runs_its_triton_kernels_on_cuda(tmp_path):
    """The Hub form of the code, loaded where fat5 cannot be imported, takes the Triton path on a GPU and agrees
    with its own fp32 reference path (bf16 tolerance)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=512,
        d_model=256,
        d_kv=64,
        d_ff=512,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "converted")
    bundle(tmp_path / "converted", tmp_path / "bundle", validate=False)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([200, 131, 64])
    mask = (torch.arange(200)[None] < lengths[:, None]).long()
    decoder_mask = (torch.arange(40)[None] < torch.tensor([40, 17, 3])[:, None]).long()
    batch = {
        "input_ids": torch.randint(2, 512, (3, 200), generator=generator) * mask,
        "attention_mask": mask,
        "decoder_input_ids": torch.randint(2, 512, (3, 40), generator=generator) * decoder_mask,
        "decoder_attention_mask": decoder_mask,
    }
    torch.save(batch, tmp_path / "batch.pt")
    completed = run_isolated(
        CUDA_REMOTE_CODE, tmp_path / "bundle", tmp_path / "batch.pt", tmp_path / "out.pt", tmp=tmp_path
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = torch.load(tmp_path / "out.pt")
    assert any(name.endswith(".attention_triton") for name in results["triton_modules"]), results["triton_modules"]
    keep = decoder_mask.bool()
    error = (results["triton"][keep] - results["reference"][keep]).norm() / results["reference"][keep].norm()
    assert error <= 1e-2, error
    assert results["triton_generate"].shape[0] == 3
