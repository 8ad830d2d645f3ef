"""transformers' own common model tests (``ModelTesterMixin``) run against every FAT5 class, and against the T5
classes they stand for, in the same environment.

The mixin is not in the transformers wheel: it is read from the source distribution of the installed version, which
CI downloads from PyPI (``pip download --no-deps --no-binary :all: transformers==VERSION``) and names in
``FAT5_TRANSFORMERS_SDIST`` (the .tar.gz, or a folder holding it or its extracted tree). Nothing of transformers' test
code lives in this repository; without the sdist this module is skipped.

What the sdist lacks: transformers 5.24's sdist ships ``tests/test_modeling_common.py`` but neither
``tests/generation/test_utils.py`` (``GenerationTesterMixin``) nor ``tests/exporters/test_export.py``
(``ExportTesterMixin``, a base of ``ModelTesterMixin``), which ``test_modeling_common.py`` imports. Both are given
empty stand-ins here, so the generation and export mixins do not run (generation is tested against T5 in
test_generation.py and test_hf_api.py); nor does T5's own test class (``tests/models/t5/``, also absent), so the T5
classes run under this module's tester, the same one FAT5's classes run under.

The tester is right when transformers' own T5 fails none of the tests under it: with transformers 5.24, T5 passes 208
and skips 112 of 320, FAT5 passes 151, skips 169 and fails none. Every test that T5 passes and FAT5 skips is one of
the kinds in FAT5_ONLY_SKIPS, with the reason why.
"""

import importlib.util
import os
import shutil
import sys
import tarfile
import tempfile
import types
import unittest
from pathlib import Path

import pytest
import torch
import transformers
from transformers import (
    T5Config,
    T5EncoderModel,
    T5ForConditionalGeneration,
    T5ForQuestionAnswering,
    T5ForSequenceClassification,
    T5ForTokenClassification,
    T5Model,
)

import fat5

PACKAGE = "transformers_sdist_tests"


def _sdist_tests_folder() -> Path | None:
    given = os.environ.get("FAT5_TRANSFORMERS_SDIST")
    if not given:
        return None
    path = Path(given)
    name = f"transformers-{transformers.__version__}"
    if path.is_dir() and (path / name / "tests").is_dir():
        return path / name / "tests"
    archive = path if path.is_file() else path / f"{name}.tar.gz"
    if not archive.is_file():
        return None
    target = archive.parent / "extracted"
    if not (target / name / "tests").is_dir():
        # pytest-xdist's workers all import this module at once: each extracts into a folder of its own and renames
        # it into place, so none reads a file another is still writing
        scratch = Path(tempfile.mkdtemp(prefix="extracting-", dir=archive.parent))
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{name}/tests/")]
            tar.extractall(scratch, members=members, filter="data")
        try:
            scratch.rename(target)
        except OSError:  # another worker's rename came first: its tree is complete
            shutil.rmtree(scratch)
    return target / name / "tests"


def _load_model_tester_mixin():
    folder = _sdist_tests_folder()
    if folder is None or not (folder / "test_modeling_common.py").is_file():
        return None
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(folder)]
    sys.modules[PACKAGE] = package
    # the modules the sdist leaves out (see the module docstring): empty mixins in their place
    for module_name, class_name in (("generation.test_utils", "GenerationTesterMixin"),
                                    ("exporters.test_export", "ExportTesterMixin")):
        if (folder / (module_name.replace(".", "/") + ".py")).is_file():
            continue
        parent = f"{PACKAGE}.{module_name.split('.')[0]}"
        sys.modules.setdefault(parent, types.ModuleType(parent)).__path__ = []
        stand_in = types.ModuleType(f"{PACKAGE}.{module_name}")
        setattr(stand_in, class_name, type(class_name, (), {}))
        sys.modules[stand_in.__name__] = stand_in
    spec = importlib.util.spec_from_file_location(f"{PACKAGE}.test_modeling_common", folder / "test_modeling_common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        # transformers' test suite needs packages of its own (`parameterized`), which .ci/run installs with the sdist
        pytest.skip(f"transformers' common tests cannot be imported: {error}", allow_module_level=True)
    return module


common = _load_model_tester_mixin()
if common is None:
    pytest.skip("transformers' source distribution is not given (FAT5_TRANSFORMERS_SDIST): see the module docstring",
                allow_module_level=True)


class Seq2SeqTester:
    """Tiny configs and inputs, as a transformers model tester gives them (``prepare_config_and_inputs_for_common``)."""

    # seven rows: the eager-against-SDPA tests extend a smaller batch to seven with random ids, which hold no EOS token
    # and which T5's sequence classifier therefore refuses
    def __init__(self, parent, config_class, batch_size=7, seq_length=7, decoder_seq_length=7, vocab_size=99):
        self.parent, self.config_class = parent, config_class
        self.batch_size, self.seq_length, self.decoder_seq_length = batch_size, seq_length, decoder_seq_length
        self.encoder_seq_length = seq_length
        self.vocab_size = vocab_size
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 32, 2, 4
        self.is_training = True

    def get_config(self):
        extra = {"attention_backend": "reference"} if self.config_class is fat5.FAT5Config else {}
        return self.config_class(
            vocab_size=self.vocab_size, d_model=self.hidden_size, d_ff=37, d_kv=self.hidden_size // 4,
            num_layers=self.num_hidden_layers, num_decoder_layers=self.num_hidden_layers,
            num_heads=self.num_attention_heads, relative_attention_num_buckets=8, dropout_rate=0.1,
            initializer_factor=0.002, eos_token_id=1, pad_token_id=0, decoder_start_token_id=0, **extra,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(2)
        # one EOS per row, where a tokenizer puts it (the sequence classifiers read the decoder's state there)
        input_ids[:, -1] = 1
        decoder_input_ids = common.ids_tensor([self.batch_size, self.decoder_seq_length], self.vocab_size)
        inputs = {
            "input_ids": input_ids,
            "attention_mask": common.random_attention_mask([self.batch_size, self.seq_length]).clamp(max=1),
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": torch.ones_like(decoder_input_ids),
        }
        inputs["attention_mask"][:, -1] = 1
        return self.get_config(), inputs


class EncoderTester(Seq2SeqTester):
    def prepare_config_and_inputs_for_common(self):
        config, inputs = super().prepare_config_and_inputs_for_common()
        config.is_encoder_decoder = False  # what the encoder-only classes see, as in T5's encoder-only tests
        return config, {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}


# where transformers' tests look a class up by name (labels to make, base models to leave out of training), FAT5's
# classes sit under model type "fat5" beside T5's, as a model of transformers' own would. The encoder models are base
# models too (no head, no loss: the training tests have nothing to train), but transformers registers T5EncoderModel
# under no model type of its own, so the tester names both encoder models there, under a type of their own.
CLASS_NAMES = [
    ("MODEL_MAPPING_NAMES", "fat5", "FAT5Model"),
    ("MODEL_MAPPING_NAMES", "t5-encoder", "T5EncoderModel"),
    ("MODEL_MAPPING_NAMES", "fat5-encoder", "FAT5EncoderModel"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "fat5", "FAT5ForConditionalGeneration"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "fat5", "FAT5ForSequenceClassification"),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "fat5", "FAT5ForQuestionAnswering"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "fat5", "FAT5ForTokenClassification"),
]

def _suites():
    """The four test cases, made here so that pytest does not collect them on their own: one pytest test runs them
    and compares (see test_fat5_passes_every_common_test_that_t5_passes)."""

    class Common(common.ModelTesterMixin):
        config_class = T5Config
        model_tester_class = Seq2SeqTester
        is_encoder_decoder = True
        test_torch_exportable = False  # the export mixin is not in the sdist (module docstring)
        # GenerationTesterMixin is not in the sdist either: no generative class is claimed to run its tests
        all_generative_model_classes = ()

        def setUp(self):
            self.model_tester = self.model_tester_class(self, self.config_class)

        def test_inputs_embeds(self):
            # the sequence classifiers read the decoder's state at the input's last EOS token, which embeddings do not
            # mark: T5's refuses inputs_embeds (NotImplementedError), and so does FAT5's (ValueError, by name)
            classes = self.all_model_classes
            self.all_model_classes = tuple(c for c in classes if not c.__name__.endswith("ForSequenceClassification"))
            try:
                super().test_inputs_embeds()
            finally:
                self.all_model_classes = classes

    class T5CommonTest(Common, unittest.TestCase):
        all_model_classes = (T5Model, T5ForConditionalGeneration, T5ForSequenceClassification, T5ForQuestionAnswering)

    class T5EncoderCommonTest(Common, unittest.TestCase):
        all_model_classes = (T5EncoderModel, T5ForTokenClassification)
        model_tester_class = EncoderTester
        is_encoder_decoder = False

    class FAT5CommonTest(Common, unittest.TestCase):
        all_model_classes = (
            fat5.FAT5Model, fat5.FAT5ForConditionalGeneration, fat5.FAT5ForSequenceClassification,
            fat5.FAT5ForQuestionAnswering,
        )
        config_class = fat5.FAT5Config

    class FAT5EncoderCommonTest(FAT5CommonTest):
        all_model_classes = (fat5.FAT5EncoderModel, fat5.FAT5ForTokenClassification)
        model_tester_class = EncoderTester
        is_encoder_decoder = False

    return {"T5": (T5CommonTest, T5EncoderCommonTest), "FAT5": (FAT5CommonTest, FAT5EncoderCommonTest)}


class _Outcomes(unittest.TestResult):
    """Each test's outcome by name: failed if it or one of its subtests failed, skipped (with the reason) if it was."""

    def __init__(self):
        super().__init__()
        self.outcomes = {}

    @staticmethod
    def _name(test) -> str:
        # a subtest (one model class of the test) reports under its test's name
        return getattr(test, "test_case", test).id().rsplit(".", 1)[-1]

    def _set(self, test, outcome):
        name = self._name(test)
        if self.outcomes.get(name) != "fail":
            self.outcomes[name] = outcome

    def addSuccess(self, test):
        self._set(test, "pass")

    def addFailure(self, test, err):
        self.outcomes[self._name(test)] = "fail"

    def addError(self, test, err):
        self.outcomes[self._name(test)] = "fail"

    def addSkip(self, test, reason):
        self._set(test, f"skip: {reason}")

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self.outcomes[self._name(test)] = "fail"


def _run(cases) -> dict:
    from transformers.models.auto import modeling_auto

    added = []
    for mapping_name, model_type, class_name in CLASS_NAMES:
        mapping = getattr(modeling_auto, mapping_name)
        if model_type not in mapping:
            mapping[model_type] = class_name
            added.append((mapping, model_type))
    try:
        outcomes = {}
        for case in cases:
            result = _Outcomes()
            unittest.defaultTestLoader.loadTestsFromTestCase(case).run(result)
            outcomes.update({f"{case.__name__.replace('FAT5', '').replace('T5', '')}.{name}": outcome
                             for name, outcome in result.outcomes.items()})
        return outcomes
    finally:
        for mapping, model_type in added:
            del mapping[model_type]


# the tests that T5 passes and FAT5 skips, by the mixin's skip message, and why that is right for FAT5
FAT5_ONLY_SKIPS = {
    "does not support SDPA": (
        "FAT5's attention is its own fused kernels (config.attention_backend), not one of transformers' attention "
        "functions: there is no SDPA path to hold against an eager one. attn_implementation=\"sdpa\" loads the same "
        "kernels and the config records what was asked (test_hf_api.py); the probabilities that the eager side "
        "returns are checked against T5's own (test_t5_parity.py)"
    ),
    "does not support setting its attention dynamically": (
        "set_attn_implementation would switch between transformers' attention functions, which FAT5 does not call: "
        "there is nothing to switch"
    ),
    "capture_outputs": (
        "FAT5's stacks gather their hidden states and attention probabilities themselves, not through transformers' "
        "output-capturing hooks; what they return is checked by test_hidden_states_output and test_attention_outputs, "
        "which pass"
    ),
    "Cannot capture hidden states": "the same: transformers' output-capturing hooks, which FAT5 does not use",
}


def test_fat5_passes_every_common_test_that_t5_passes(capsys):
    suites = _suites()
    t5, fat5 = _run(suites["T5"]), _run(suites["FAT5"])
    unexplained = {}
    with capsys.disabled():
        for name, outcomes in (("T5", t5), ("FAT5", fat5)):
            passed = sum(outcome == "pass" for outcome in outcomes.values())
            skipped = sum(outcome.startswith("skip") for outcome in outcomes.values())
            print(f"\ntransformers {transformers.__version__} ModelTesterMixin, {name}: {passed} passed, {skipped} "
                  f"skipped, {len(outcomes) - passed - skipped} failed (of {len(outcomes)})")
        for test, outcome in sorted(fat5.items()):
            if outcome.startswith("skip") and t5.get(test) == "pass":
                reason = next((why for message, why in FAT5_ONLY_SKIPS.items() if message in outcome), None)
                if reason is None:
                    unexplained[test] = outcome
                print(f"  FAT5 skips {test}, which T5 passes: {outcome[6:][:100]}")
        for message, why in FAT5_ONLY_SKIPS.items():
            print(f"  '{message}': {why}")
    failures = {name: {test for test, outcome in outcomes.items() if outcome == "fail"}
                for name, outcomes in (("T5", t5), ("FAT5", fat5))}
    # the tester is fit for T5 (every failure would be the tester's), and FAT5 fails nothing either
    assert failures == {"T5": set(), "FAT5": set()}, failures
    assert set(fat5) == set(t5)
    assert not unexplained, unexplained
