"""`fat5 finetune`: finetune a FAT5 model from a YAML config (`fat5.trainer.finetuning`), fully or with LoRA."""

import argparse

from ..trainer.finetune_config import FinetuneConfig
from ..trainer.jobs import is_main_launch_process
from .arguments import add_job_options, run_job


def configure_finetune(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Finetune the FAT5 model that CONFIG names on its dataset with FAT5Trainer, then save it (or its\n"
        "LoRA adapter and the merged model) in the output folder. Examples: fat5/trainer/configs/finetune_*.yaml."
    )
    parser.epilog = ("CONFIG's keys, with their defaults (fat5/trainer/finetune_config.py):\n\n"
                     + FinetuneConfig.reference())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("config", help="YAML configuration (task, model, data, lora, training, ...)")
    add_job_options(parser, "the config's output_dir")
    parser.set_defaults(func=_run_finetune)


def _run_finetune(args: argparse.Namespace) -> int:
    from ..trainer.finetuning import begun_finetuning, finetune

    result = run_job(begun_finetuning, finetune, args)
    if result is None:
        return 130
    if is_main_launch_process():
        for name in ("model_dir", "adapter_dir", "merged_dir", "bundle_dir"):
            if result[name]:
                print(f"{name.removesuffix('_dir')}: {result[name]}")
        if result["eval"]:
            print("evaluation: " + ", ".join(f"{key} {value:.4g}" for key, value in result["eval"].items()
                                             if isinstance(value, (int, float))))
    return 0
