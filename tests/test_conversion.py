"""T5-family checkpoints -> FAT5 -> transformers, against transformers' own classes (fp32, CPU, padded batches).

Every source checkpoint is a tiny randomly initialised model made and saved by transformers' own classes; the
"Hub-like" ones are then edited the way the Hub's FLAN-T5 / mT5 / UMT5 / original T5 files look (untied lm_head
with "tie_word_embeddings": false, or the legacy layout with every alias of the embedding stored).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers import FAMILIES, PREFIX, TINY, make_checkpoint, padded_seq2seq_batch, relative_error, transformers_class
from safetensors.torch import load_file, save_file

from fat5 import FAT5Config, FAT5EncoderModel, FAT5ForConditionalGeneration
from fat5.commands.convert import convert_to_hub_folder
from fat5.conversion import ConversionError, convert, export_hf
from fat5.errors import FAT5Error
from fat5_command import build_parser


def reference_model(folder: Path, model_type: str, suffix: str, scale: bool):
    """transformers' own class on the source; for UMT5 with the decoder-output scaling the raw config asks for
    (transformers 5.17 and before scale every UMT5 checkpoint by its forced tie_word_embeddings, 5.24 follows
    scale_decoder_outputs: both are set, see fat5/conversion/convert.py)."""
    model = transformers_class(model_type, suffix).from_pretrained(folder, dtype=torch.float32).eval()
    if model_type == "umt5":
        model.config.tie_word_embeddings = model.config.scale_decoder_outputs = scale
    return model


def leftovers(out: Path) -> list[str]:
    """Anything the conversion may have left: `out` itself or a temporary folder beside it."""
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


def test_relative_error_is_a_norm_ratio_over_the_masked_positions():
    """The measure the conversion check, the tests and the benchmarks share, on a hand-computed case."""
    expected = torch.tensor([[[3.0, 4.0]], [[100.0, 0.0]]])
    actual = torch.tensor([[[3.0, 4.5]], [[0.0, 0.0]]])
    assert relative_error(actual, expected, torch.tensor([[1], [0]])) == pytest.approx(0.5 / 5)
    assert relative_error(actual, expected) == pytest.approx((0.5**2 + 100**2) ** 0.5 / (5**2 + 100**2) ** 0.5)
    assert relative_error(torch.full_like(expected, float("nan")), expected) == float("inf")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (source folder, converted folder, ConversionResult), converted once per module."""
    root = tmp_path_factory.mktemp("conversion")
    results = {}
    for index, family in enumerate(FAMILIES):
        source = make_checkpoint(root / f"{family}-src", family, seed=index)
        results[family] = (source, root / f"{family}-fat5", convert(source, root / f"{family}-fat5"))
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_matches_transformers(converted, family):
    model_type, _, _, tie, scale = FAMILIES[family]
    source, out, result = converted[family]
    assert result.verification["logits_relative_error"] <= 1e-5
    assert (result.tie_word_embeddings, result.scale_decoder_outputs) == (tie, scale)
    raw = json.loads((out / "config.json").read_text())
    # a converted folder is saved as every FAT5 model is: loadable as remote code (issue 41)
    assert raw["model_type"] == "fat5" and raw["auto_map"]["AutoConfig"] == "configuration_fat5.FAT5Config"
    assert (raw["tie_word_embeddings"], raw["scale_decoder_outputs"]) == (tie, scale)
    assert raw["position_bias_per_layer"] == (model_type == "umt5")
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not list(out.glob("*.bin"))

    batch = padded_seq2seq_batch(TINY["vocab_size"])
    reference = reference_model(source, model_type, "ForConditionalGeneration", scale)
    fat5_model = FAT5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected, actual = reference(**batch), fat5_model(**batch)
    assert relative_error(actual.logits, expected.logits, batch["decoder_attention_mask"]) <= 1e-5
    encoder_error = relative_error(
        actual.encoder_last_hidden_state, expected.encoder_last_hidden_state, batch["attention_mask"]
    )
    assert encoder_error <= 1e-5

    encoder_inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    reference_encoder = transformers_class(model_type, "EncoderModel").from_pretrained(source, dtype=torch.float32)
    fat5_encoder = FAT5EncoderModel.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        expected_states = reference_encoder.eval()(**encoder_inputs).last_hidden_state
        actual_states = fat5_encoder.eval()(**encoder_inputs).last_hidden_state
    assert relative_error(actual_states, expected_states, batch["attention_mask"]) <= 1e-5


def test_untied_umt5_is_not_scaled(converted):
    """The Hub's UMT5 (untied, tie_word_embeddings false) projects the decoder output unscaled, as the original:
    checked against lm_head applied by hand to transformers' own final decoder states."""
    source, out, _ = converted["umt5"]
    batch = padded_seq2seq_batch(TINY["vocab_size"])
    reference = transformers.UMT5ForConditionalGeneration.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        states = reference(**batch, output_hidden_states=True).decoder_hidden_states[-1]
        expected = states @ load_file(source / "model.safetensors")["lm_head.weight"].T
        actual = FAT5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()(**batch).logits
    assert relative_error(actual, expected, batch["decoder_attention_mask"]) <= 1e-5


@pytest.mark.parametrize("family", ["t5", "flan-t5", "mt5", "umt5"])
def test_generation_matches_transformers(converted, family):
    model_type, _, _, _, scale = FAMILIES[family]
    source, out, _ = converted[family]
    batch = padded_seq2seq_batch(TINY["vocab_size"], seed=3)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "max_new_tokens": 6}
    reference = reference_model(source, model_type, "ForConditionalGeneration", scale)
    fat5_model = FAT5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    for options in ({"do_sample": False}, {"do_sample": False, "num_beams": 3}):
        expected = reference.generate(**inputs, **options)
        actual = fat5_model.generate(**inputs, **options)
        assert torch.equal(actual, expected), options


@pytest.mark.parametrize("family", ["t5", "umt5-tied"])
def test_encoder_only_checkpoint(tmp_path, family):
    model_type = FAMILIES[family][0]
    source = make_checkpoint(tmp_path / "src", family, suffix="EncoderModel")
    result = convert(source, tmp_path / "out")
    assert result.target_architecture == "FAT5EncoderModel"
    assert result.verification["encoder_relative_error"] <= 1e-5
    batch = padded_seq2seq_batch(TINY["vocab_size"])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        reference = transformers_class(model_type, "EncoderModel").from_pretrained(source).eval()
        expected = reference(**inputs).last_hidden_state
        actual = FAT5EncoderModel.from_pretrained(tmp_path / "out").eval()(**inputs).last_hidden_state
    assert relative_error(actual, expected, batch["attention_mask"]) <= 1e-5


def test_save_load_round_trip(converted, tmp_path):
    _, out, _ = converted["flan-t5"]
    batch = padded_seq2seq_batch(TINY["vocab_size"])
    model = FAT5ForConditionalGeneration.from_pretrained(out).eval()
    model.save_pretrained(tmp_path / "again")
    again = FAT5ForConditionalGeneration.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, again(**batch).logits)
    assert again.config.tie_word_embeddings is False
    assert again.lm_head.weight.data_ptr() != again.shared.weight.data_ptr()


@pytest.mark.parametrize("family", ["t5", "flan-t5", "mt5", "umt5-tied", "umt5"])
def test_export_hf_round_trip(converted, tmp_path, family):
    model_type, _, _, tie, scale = FAMILIES[family]
    source, out, _ = converted[family]
    result = export_hf(out, tmp_path / "back")
    assert result.target_architecture == PREFIX[model_type] + "ForConditionalGeneration"
    raw = json.loads((tmp_path / "back" / "config.json").read_text())
    assert raw["model_type"] == model_type and raw["tie_word_embeddings"] == tie
    # every tensor transformers' class uses comes back bit for bit
    original, exported = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name
    assert ("lm_head.weight" in exported) == (not tie)
    batch = padded_seq2seq_batch(TINY["vocab_size"])
    back = reference_model(tmp_path / "back", model_type, "ForConditionalGeneration", scale)
    fat5_model = FAT5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert relative_error(back(**batch).logits, fat5_model(**batch).logits, batch["decoder_attention_mask"]) <= 1e-5


def test_a_tied_unscaled_umt5_goes_both_ways(tmp_path):
    """A UMT5 saved by transformers 5.24 from an untied config: tied (its forced tie_word_embeddings) and unscaled
    (its scale_decoder_outputs false). Converted, then exported, it gives the source's logits; the export failed its
    check (relative error 0.82) when it left scale_decoder_outputs out."""
    source = make_checkpoint(tmp_path / "src", "umt5-tied")
    raw = json.loads((source / "config.json").read_text())
    raw.update(tie_word_embeddings=True, scale_decoder_outputs=False)
    (source / "config.json").write_text(json.dumps(raw))
    convert(source, tmp_path / "fat5")
    export_hf(tmp_path / "fat5", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["scale_decoder_outputs"] is False
    batch = padded_seq2seq_batch(TINY["vocab_size"])
    with torch.no_grad():
        expected = reference_model(source, "umt5", "ForConditionalGeneration", False)(**batch).logits
        exported = reference_model(tmp_path / "back", "umt5", "ForConditionalGeneration", False)(**batch).logits
        converted = FAT5ForConditionalGeneration.from_pretrained(tmp_path / "fat5").eval()(**batch).logits
    for logits in (exported, converted):
        assert relative_error(logits, expected, batch["decoder_attention_mask"]) <= 1e-5


def test_export_hf_needs_t5_position_encoding(tmp_path):
    config = FAT5Config(**{k: v for k, v in TINY.items() if "relative" not in k}, position_encoding="rope")
    FAT5ForConditionalGeneration(config).save_pretrained(tmp_path / "rope")
    with pytest.raises(ConversionError, match="position_encoding='rope'"):
        export_hf(tmp_path / "rope", tmp_path / "out")
    assert leftovers(tmp_path / "out") == []


def test_sharded_and_pytorch_bin_sources(tmp_path):
    source = make_checkpoint(tmp_path / "src", "t5")
    model = transformers.T5ForConditionalGeneration.from_pretrained(source)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    result = convert(tmp_path / "sharded", tmp_path / "out-sharded", max_shard_size="20KB")
    assert (tmp_path / "out-sharded" / "model.safetensors.index.json").is_file()
    assert result.verification["logits_relative_error"] <= 1e-5

    bin_source = tmp_path / "bin"
    bin_source.mkdir()
    (bin_source / "config.json").write_text((source / "config.json").read_text())
    torch.save(load_file(source / "model.safetensors"), bin_source / "pytorch_model.bin")
    result = convert(bin_source, tmp_path / "out-bin")
    assert result.verification["logits_relative_error"] <= 1e-5
    assert (tmp_path / "out-bin" / "model.safetensors").is_file()


def test_bfloat16_output(converted, tmp_path):
    source, _, _ = converted["flan-t5"]
    result = convert(source, tmp_path / "bf16", dtype="bfloat16")
    assert result.dtype == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
    assert result.verification["logits_relative_error"] <= 1e-5


def test_tokenizer_and_generation_config_travel(tmp_path):
    source = make_checkpoint(tmp_path / "src", "t5")
    (source / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    (source / "spiece.model").write_bytes(b"not really sentencepiece")
    generation = json.loads((source / "generation_config.json").read_text())
    generation.pop("decoder_start_token_id", None)  # as transformers 5 writes it for T5
    generation["max_length"] = 77
    (source / "generation_config.json").write_text(json.dumps(generation))
    convert(source, tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "spiece.model").read_bytes() == b"not really sentencepiece"
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"model_max_length": 512}
    written = json.loads((out / "generation_config.json").read_text())
    assert written["max_length"] == 77 and written["decoder_start_token_id"] == 0


# --------------------------------------------------------------------------------------------- broken inputs


def _corrupt(folder: Path, how: str) -> None:
    path = folder / "model.safetensors"
    if how == "garbage":
        path.write_bytes(b"\x93NUMPY garbage " * 64)
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        tensors = load_file(path)
        config = json.loads((folder / "config.json").read_text())
        if how == "wrong-shape":
            tensors["encoder.block.1.layer.1.DenseReluDense.wo.weight"] = torch.zeros(32, 40)
        elif how == "missing":
            del tensors["decoder.block.1.layer.0.SelfAttention.k.weight"]
        elif how == "unexpected":
            tensors["encoder.block.2.layer.0.SelfAttention.q.weight"] = torch.zeros(32, 32)
        elif how == "wrong-config":
            config["num_heads"] = 2
            config["d_kv"] = 8  # q is (heads * d_kv, d_model) = (16, 32) in the config's eyes, (32, 32) on disk
        elif how == "tied-but-different":
            config.pop("tie_word_embeddings", None)
            tensors["encoder.embed_tokens.weight"] = tensors["shared.weight"] + 1
        save_file(tensors, path, metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "how, message",
    [
        ("garbage", "not a readable safetensors file"),
        ("truncated", "not a readable safetensors file"),
        ("wrong-shape", r"wrong shape \(1\): encoder\.block\.1\.layer\.1\.DenseReluDense\.wo\.weight"),
        ("missing", r"missing from the checkpoint \(1\): decoder\.block\.1\.layer\.0\.SelfAttention\.k\.weight"),
        ("unexpected", r"unexpected in the checkpoint \(1\): encoder\.block\.2\.layer\.0\.SelfAttention\.q\.weight"),
        ("wrong-config", r"wrong shape \(\d+\): .*SelfAttention\.q\.weight: checkpoint \(32, 32\), model \(16, 32\)"),
        ("tied-but-different", "tied in the model but different in the checkpoint"),
    ],
)
def test_broken_checkpoints_fail_clearly_and_leave_nothing(tmp_path, how, message):
    source = make_checkpoint(tmp_path / "src", "t5")
    _corrupt(source, how)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=message):
        convert(source, out)
    assert leftovers(out) == []


def test_unsupported_or_invalid_configs(tmp_path):
    source = make_checkpoint(tmp_path / "src", "t5")
    config = json.loads((source / "config.json").read_text())
    for raw, message in (
        ({**config, "model_type": "bart"}, "model_type 'bart' is not supported"),
        ({**config, "feed_forward_proj": "gated-nonsense"}, "feed_forward_proj"),
        ({**config, "architectures": ["T5ForSequenceClassification"]}, "cannot convert a T5ForSequenceClassification"),
    ):
        (source / "config.json").write_text(json.dumps(raw))
        with pytest.raises(ConversionError, match=message):
            convert(source, tmp_path / "out")
        assert leftovers(tmp_path / "out") == []
    (source / "config.json").write_text("{not json")
    with pytest.raises(ConversionError, match="not valid JSON"):
        convert(source, tmp_path / "out")
    (source / "config.json").unlink()
    with pytest.raises(ConversionError, match="no config.json"):
        convert(source, tmp_path / "out")


def test_failed_verification_writes_nothing(converted, tmp_path):
    """Nothing is written unless the logits agree: an impossible tolerance makes the check fail."""
    source, _, _ = converted["t5"]
    with pytest.raises(ConversionError, match="verification failed.*nothing was written"):
        convert(source, tmp_path / "out", tolerance=1e-300)
    assert leftovers(tmp_path / "out") == []


def test_overwrite_replaces_a_model_folder_never_the_users_files(converted, tmp_path):
    """A non-empty OUT needs --overwrite, which replaces a folder of FAT5's files (an earlier conversion) and refuses
    one holding anything else: the user's files are never removed."""
    from fat5.cli import main

    source, _, _ = converted["t5"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    (out / "photos").mkdir()
    with pytest.raises(FAT5Error, match="already exists"):
        convert(source, out, verify=False)
    with pytest.raises(FAT5Error, match=r"holds files that FAT5 did not write \(photos, precious.txt\)"):
        convert(source, out, overwrite=True, verify=False)
    assert main(["convert", str(source), str(out), "--overwrite", "--no-verify"]) == 2
    assert sorted(path.name for path in out.iterdir()) == ["photos", "precious.txt"]
    assert (out / "precious.txt").read_text() == "keep me"
    shutil.rmtree(out)
    convert(source, out, verify=False)
    written = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(b"stale")
    convert(source, out, overwrite=True, verify=False)
    assert (out / "model.safetensors").read_bytes() == written
    assert leftovers(out) == ["out"]


def test_export_overwrite_never_removes_the_users_files(converted, tmp_path):
    _, fat5_dir, _ = converted["t5"]
    out = tmp_path / "t5"
    export_hf(fat5_dir, out, verify=False)
    export_hf(fat5_dir, out, overwrite=True, verify=False)  # an earlier export is replaced
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FAT5Error, match=r"holds files that FAT5 did not write \(notes.txt\)"):
        export_hf(fat5_dir, out, overwrite=True, verify=False)
    assert (out / "notes.txt").read_text() == "mine" and (out / "config.json").is_file()


def _copy_tree(source: Path, destination: Path) -> Path:
    return Path(shutil.copytree(source, destination))


@pytest.mark.parametrize("layout", ["parent", "grandparent", "same", "inside"])
def test_overwrite_never_replaces_a_folder_that_holds_the_input(converted, tmp_path, layout, monkeypatch):
    """`--overwrite` replaces the output folder's own content only: an OUT that holds SRC (or is SRC, or lies inside
    it) is refused, and SRC and the files beside it survive."""
    from fat5.cli import main

    models = tmp_path / "models"
    source = _copy_tree(converted["t5"][0], models / "zoo" / "t5")
    (models / "notes.txt").write_text("a sibling of the source")
    (models / "zoo" / "other.bin").write_bytes(b"another model")
    out = {"parent": models / "zoo", "grandparent": models, "same": source, "inside": source / "fat5"}[layout]
    before = {path: path.read_bytes() for path in models.rglob("*") if path.is_file()}
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FAT5Error, match="holds the input|lies inside the input"):
        convert(source, out, overwrite=True, verify=False)
    assert main(["convert", str(source), str(out), "--overwrite", "--no-verify"]) == 2
    assert {path: path.read_bytes() for path in models.rglob("*") if path.is_file()} == before


def test_overwrite_refuses_the_current_directory_and_the_home_folder(converted, tmp_path, monkeypatch):
    source, _, _ = converted["t5"]
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "sub" / "precious.txt").write_text("keep me")
    monkeypatch.chdir(work / "sub")
    with pytest.raises(FAT5Error, match="holds the current directory"):
        convert(source, work, overwrite=True, verify=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(work))
    with pytest.raises(FAT5Error, match="home folder"):
        convert(source, work, overwrite=True, verify=False)
    assert (work / "sub" / "precious.txt").read_text() == "keep me"


def test_export_overwrite_never_replaces_a_folder_that_holds_the_input(converted, tmp_path):
    fat5_dir = _copy_tree(converted["t5"][1], tmp_path / "runs" / "fat5")
    (tmp_path / "runs" / "log.txt").write_text("a sibling")
    with pytest.raises(FAT5Error, match="holds the input"):
        export_hf(fat5_dir, tmp_path / "runs", overwrite=True, verify=False)
    assert (tmp_path / "runs" / "log.txt").is_file() and (fat5_dir / "model.safetensors").is_file()


def test_an_existing_output_fails_before_anything_is_read(converted, tmp_path, monkeypatch):
    """OUT is checked first, not after a Hub download or a conversion (a bundle is converted in a staging folder)."""
    import sys

    source, _, _ = converted["t5"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    monkeypatch.setattr(
        sys.modules["fat5.conversion.convert"], "resolve_source", lambda *args: pytest.fail("read the source first")
    )
    for convert_to_folder in (convert, convert_to_hub_folder):
        with pytest.raises(FAT5Error, match="already exists"):
            convert_to_folder(source, out)
    assert leftovers(out) == ["out"] and [p.name for p in out.iterdir()] == ["precious.txt"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, in which no folder can be made")
@pytest.mark.parametrize("convert_to_folder", [convert, convert_to_hub_folder])
def test_an_output_folder_that_cannot_be_made(converted, convert_to_folder):
    with pytest.raises(FAT5Error, match="cannot create a folder beside /proc/fat5-out"):
        convert_to_folder(converted["t5"][0], "/proc/fat5-out")
    with pytest.raises(FAT5Error, match="cannot create a folder beside /proc/fat5-out"):
        export_hf(converted["t5"][1], "/proc/fat5-out")


def test_unreachable_hub_and_bad_paths(tmp_path, monkeypatch):
    import socket

    from huggingface_hub import constants

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ConversionError, match="could not download google/flan-t5-small from the Hub"):
        convert("google/flan-t5-small", tmp_path / "out")
    with pytest.raises(ConversionError, match="no such folder"):
        convert(str(tmp_path / "does" / "not" / "exist"), tmp_path / "out")
    assert leftovers(tmp_path / "out") == []


def test_command_line_handlers(converted, tmp_path, capsys):
    parser = build_parser()
    source, out, _ = converted["flan-t5"]
    args = parser.parse_args(["convert", str(source), str(tmp_path / "cli"), "--dtype", "float32"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "verified against transformers.T5ForConditionalGeneration" in printed and str(tmp_path / "cli") in printed
    args = parser.parse_args(["export-hf", str(out), str(tmp_path / "cli-back"), "--no-verify"])
    assert args.func(args) == 0
    assert (tmp_path / "cli-back" / "model.safetensors").is_file()
    args = parser.parse_args(["convert", str(tmp_path / "nowhere"), str(tmp_path / "x")])
    with pytest.raises(FAT5Error, match="no such folder"):
        args.func(args)


def test_a_source_without_a_tokenizer_is_said(converted, tmp_path):
    """A model converted without its tokenizer cannot be used, finetuned or shared as it is: the conversion (and the
    export) says so in a note, which `fat5 convert` prints, with how to add it; a source with one gets no such note and
    carries it over."""
    from helpers import word_tokenizer

    source, fat5_dir, result = converted["t5"]
    [note] = [note for note in result.notes if "holds no tokenizer files" in note]
    assert "save the tokenizer the checkpoint was trained with into it: AutoTokenizer.from_pretrained(NAME)" in note
    exported = export_hf(fat5_dir, tmp_path / "exported", verify=False)
    assert any("holds no tokenizer files" in note for note in exported.notes)
    with_tokenizer = _copy_tree(source, tmp_path / "with-tokenizer")
    word_tokenizer().save_pretrained(with_tokenizer)
    result = convert(with_tokenizer, tmp_path / "fat5", verify=False)
    assert not any("tokenizer" in note for note in result.notes)
    assert (tmp_path / "fat5" / "tokenizer.json").read_bytes() == (with_tokenizer / "tokenizer.json").read_bytes()
