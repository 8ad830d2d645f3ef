"""`fat5.trainer`'s front door: every exported name imports through it, once, and importing it stays cheap."""

import subprocess
import sys
from importlib import import_module

import fat5.trainer

# what the README and the docs tell users to import from fat5.trainer
USED = {"FAT5Trainer", "FAT5TrainingArguments", "UL2DataCollator", "pretrain", "prepare_pretraining", "finetune",
        "prepare_finetuning", "PretrainingJob", "FinetuningJob", "PretrainConfig", "FinetuneConfig", "load_tokenizer",
        "train_tokenizer", "UL2Mixture",
        "load_ul2_config", "UL2PackedBatchSampler", "PlannedDataset", "PackedStreamDataset", "ShapeBuckets"}


def test_every_exported_name_imports_through_the_package():
    names = fat5.trainer.__all__
    assert len(names) == len(set(names)) and USED <= set(names)
    assert sorted(dir(fat5.trainer)) == sorted(names)
    for name in names:
        value = getattr(fat5.trainer, name)
        owner = sys.modules[f"fat5.trainer.{fat5.trainer._MODULE_OF[name]}"]
        assert getattr(owner, name) is value, name
    # the jobs' functions stay the package's attributes once their modules are imported
    pretraining, finetuning = (import_module(f"fat5.trainer.{name}") for name in ("pretraining", "finetuning"))
    assert fat5.trainer.pretrain is pretraining.pretrain and fat5.trainer.finetune is finetuning.finetune


def test_importing_the_package_pulls_in_no_trainer_or_datasets():
    code = ("import sys, fat5; before = set(sys.modules); import fat5.trainer; "
            "print(sorted(name for name in set(sys.modules) - before if name.split('.')[0] != 'fat5' "
            "or name.count('.') > 1))")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert completed.stdout.strip() == "[]"


def test_both_jobs_take_one_signature():
    """`fat5 pretrain` and `fat5 finetune` have one shape: the same parameters, in the same order and kinds, for the
    functions that run a job and those that prepare one."""
    from inspect import signature

    for pretraining, finetuning in ((fat5.trainer.pretrain, fat5.trainer.finetune),
                                    (fat5.trainer.prepare_pretraining, fat5.trainer.prepare_finetuning)):
        shape = [(parameter.name, parameter.kind) for parameter in signature(pretraining).parameters.values()]
        assert shape == [(parameter.name, parameter.kind) for parameter in signature(finetuning).parameters.values()]
        assert [name for name, _ in shape] == ["config", "output_dir", "overrides", "resume", "overwrite"]
    assert callable(fat5.trainer.PretrainingJob.run) and callable(fat5.trainer.FinetuningJob.run)
