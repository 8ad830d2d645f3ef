"""`fat5 finetune`: finetune a FAT5 model from a YAML config (`fat5.trainer.finetuning`), fully or with LoRA."""

import argparse
import sys

from ..trainer.finetune_config import config_reference, load_finetune_config


def configure_finetune(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Finetune the FAT5 model that CONFIG names on its dataset with FAT5Trainer, then save it (or its\n"
        "LoRA adapter and the merged model) under output_dir. Examples: fat5/trainer/configs/finetune_*.yaml."
    )
    parser.epilog = "CONFIG's keys, with their defaults (fat5/trainer/finetune_config.py):\n\n" + config_reference()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("config", help="YAML configuration (task, model, data, lora, training, ...)")
    parser.add_argument("--output-dir", default=None, help="where to write (overrides the config's output_dir): the "
                        "final model and tokenizer, loadable with from_pretrained(DIR), and the checkpoints")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in the output folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="remove what a run wrote in the output folder (model, checkpoints, records) and start "
                        "over; your other files there are kept (never a folder that holds the input)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config entry (dotted key, YAML value), e.g. --set training.max_steps=100; repeatable",
    )
    parser.set_defaults(func=_run_finetune)


def _run_finetune(args: argparse.Namespace) -> int:
    # here, not at the top: `fat5 finetune --help` imports this module without torch, which these import
    from ..output_folder import resume_hint
    from ..trainer import finetuning as finetune_job

    try:
        result = finetune_job.finetune(args.config, output_dir=args.output_dir, overrides=args.overrides,
                                       overwrite=args.overwrite, resume=args.resume)
    except KeyboardInterrupt:
        config = load_finetune_config(args.config, output_dir=args.output_dir, overrides=args.overrides)
        output_dir = config["output_dir"]
        output_option = ["--output-dir", args.output_dir] if args.output_dir else []
        command = " ".join(["fat5 finetune", args.config, *output_option,
                            *(f"--set {override}" for override in args.overrides)])
        # this line says it all: returning (not raising) keeps `fat5` from adding an "interrupted" of its own; it
        # starts a line of its own, a progress bar may have been drawing on the last one
        print(f"\nfat5 finetune: interrupted; {resume_hint(command, output_dir)}", file=sys.stderr, flush=True)
        return 130
    for name in ("model_dir", "adapter_dir", "merged_dir", "bundle_dir"):
        if result[name]:
            print(f"{name.removesuffix('_dir')}: {result[name]}")
    if result["eval"]:
        print("evaluation: " + ", ".join(f"{key} {value:.4g}" for key, value in result["eval"].items()
                                         if isinstance(value, (int, float))))
    return 0
