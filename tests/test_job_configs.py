"""The two jobs' configurations on one machinery (fat5.trainer.config_schema): overrides given as a mapping of sections
or as the command line's KEY=VALUE strings mean the same, a section given updates the config's key by key, and a
mistake is one line naming the key, for `fat5 pretrain` and `fat5 finetune` alike."""

import pytest

from fat5 import FAT5Error
from fat5.trainer.config_schema import overrides_as_sections, update
from fat5.trainer.finetune_config import FinetuneConfig
from fat5.trainer.pretrain_config import PretrainConfig

FINETUNE = {"model": "some/model", "data": {"train_file": "train.jsonl"}, "lora": {"r": 8, "alpha": 16}}


def test_key_value_strings_read_as_nested_sections():
    assert overrides_as_sections(["training.max_steps=10", "lora=null", "data.text_column=body", "seed=3"]) == {
        "training": {"max_steps": 10}, "lora": None, "data": {"text_column": "body"}, "seed": 3}
    assert overrides_as_sections(["lora={r: 2}", "lora.alpha=4"]) == {"lora": {"r": 2, "alpha": 4}}
    with pytest.raises(FAT5Error, match=r"override 'lora.r=2': lora is not a section"):
        overrides_as_sections(["lora=null", "lora.r=2"])
    with pytest.raises(FAT5Error, match="must read KEY=VALUE"):
        overrides_as_sections(["training.max_steps"])


def test_a_section_given_updates_the_config_key_by_key():
    config = {"training": {"max_steps": 5, "learning_rate": 1e-3}, "lora": {"r": 8}}
    assert update(config, {"training": {"max_steps": 9}, "lora": None}) == {
        "training": {"max_steps": 9, "learning_rate": 1e-3}, "lora": None}


@pytest.mark.parametrize("job, config", [(PretrainConfig, None), (FinetuneConfig, FINETUNE)])
def test_both_jobs_take_overrides_either_way(job, config):
    strings = job.load(config, ["training.max_steps=7", "training.logging_steps=2"])
    mapping = job.load(config, {"training": {"max_steps": 7, "logging_steps": 2}})
    assert strings.to_dict() == mapping.to_dict()
    assert (strings.training["max_steps"], strings.training["logging_steps"]) == (7, 2)


def test_a_lora_override_keeps_the_sections_other_keys():
    config = FinetuneConfig.load(FINETUNE, ["lora.r=2"])
    assert (config.lora.r, config.lora.alpha) == (2, 16)
    assert FinetuneConfig.load(FINETUNE, ["lora=null"]).lora is None


@pytest.mark.parametrize("job, config, key, message", [
    (PretrainConfig, None, "data.max_input_lenght=8", r"pretrain config: data: unknown key\(s\) \[.max_input_lenght"),
    (FinetuneConfig, FINETUNE, "lora.rank=8", r"finetune config: lora: unknown key\(s\) \['rank'\]"),
    (PretrainConfig, None, "training.seed=1", r"training.seed is not set here: the top-level seed sets it"),
    (FinetuneConfig, FINETUNE, "training.output_dir=x", r"training.output_dir is not set here"),
    (FinetuneConfig, FINETUNE, "training.eval_strategy=sometimes", r"training.eval_strategy must be one of"),
])
def test_a_mistake_is_one_line_naming_the_key(job, config, key, message):
    with pytest.raises(FAT5Error, match=message) as raised:
        job.load(config, [key])
    assert "\n" not in str(raised.value)


def test_an_unquoted_no_is_read_as_the_strategy_it_names():
    """YAML 1.1 reads `save_strategy: no` as false; both jobs take it for "no"."""
    assert PretrainConfig.load(None, {"training": {"save_strategy": False}}).training["save_strategy"] == "no"
    assert FinetuneConfig.load(FINETUNE, ["training.eval_strategy=no"]).training["eval_strategy"] == "no"


def test_the_training_fields_read_from_the_source_are_the_classes():
    """The training section's keys are checked, in a job's first second, against names read from the source of
    FAT5TrainingArguments and the classes it extends: they must be the fields the class has."""
    import typing

    from fat5.trainer.trainer import FAT5TrainingArguments
    from fat5.trainer.training_fields import training_argument_names

    assert training_argument_names() == set(typing.get_type_hints(FAT5TrainingArguments))
