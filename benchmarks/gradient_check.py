"""Are FAT5's training gradients as exact as transformers' T5's in mixed precision? Step by step, inside the run.

The question a loss spike in ``pretrain.py``'s runs raises: did FAT5 compute a wrong gradient, or was the spike the
run's own? This script runs ``pretrain.py``'s FAT5 path, the package's pretraining job (the same config, corpus,
shape, weight draw, packed batches, seed and learning-rate schedule of ``--steps``; eager unless ``--compile job``;
its z-loss off, since T5 has none and the gradients compared are the cross-entropy's), and stops after step
``--check-to``. At every step from ``--check-from``,
after the step's forward and backward and before its optimizer step, it unpacks the step's examples (one per row,
padded) and gives them to transformers' ``T5ForConditionalGeneration`` carrying FAT5's weights of that moment, twice:

* in fp32 with TF32 off: the truth the gradients are measured against;
* in bf16 autocast, SDPA with the kernels ``pretrain.py``'s transformers paths use: the precision a user without
  FAT5 trains in (when the job trains in bf16: not the --tiny job on a CPU).

Per step: FAT5's loss and the two T5 losses on the same examples; the relative error of FAT5's gradient and of T5's
bf16 gradient against the truth, ``|g - g_fp32| / |g_fp32|`` over the whole model, and the parameters where FAT5's is
largest (with T5's bf16 error beside). A FAT5 gradient that is wrong shows as an error well above T5's bf16 one.

    python benchmarks/gradient_check.py --check-from 128 --check-to 140        # pretrain_base.yaml, seed 0
    python benchmarks/gradient_check.py --tiny                                 # the whole path on a CPU

Writes ``results/gradient_check_SHAPE.json`` and a PNG beside it (errors and losses by step).
"""

import argparse
import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pretrain
import pretrain_peers
from common import draw_beside, parse_or_plot, save_png, t5_carrying_weights_of, write_result

logger = logging.getLogger("gradient_check")

EXAMPLES_PER_REFERENCE_BATCH = 6  # T5 materialises its attention scores: the step's examples go a few at a time
WORST = 5


def t5_gradients(t5, batches: list[dict], device: torch.device, bf16: bool) -> tuple[dict, float]:
    """T5's gradient (fp32 copies, by parameter name) and loss for the token-mean cross-entropy over the examples of
    ``batches`` (padded, on ``device``)."""
    t5.zero_grad(set_to_none=True)
    labelled = sum(int((batch["labels"] != -100).sum()) for batch in batches)
    total = 0.0
    for batch in batches:
        batch = dict(batch)
        labels = batch.pop("labels")
        precision = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with precision, torch.nn.attention.sdpa_kernel(list(pretrain_peers.SDPA_BACKENDS_OF_TRANSFORMERS)):
            logits = t5(**batch).logits
        loss = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                                                 reduction="sum") / labelled
        loss.backward()
        total += float(loss.detach())
    return {name: parameter.grad.detach().float().clone() for name, parameter in t5.named_parameters()}, total


def compare(fat5, inputs: dict, device: torch.device, bf16: bool) -> dict:
    """FAT5's gradients (of the step just taken) against T5's in fp32, and T5's bf16 ones beside them."""
    with torch.device(device):
        t5 = t5_carrying_weights_of(fat5, **pretrain.t5_fields(fat5.config)).train()
    examples = pretrain_peers.unpacked_examples({key: value.cpu() for key, value in inputs.items()})
    batches = [{key: value.to(device) for key, value in pretrain_peers.padded_batch(
        examples[first:first + EXAMPLES_PER_REFERENCE_BATCH], fat5.config.pad_token_id).items()}
        for first in range(0, len(examples), EXAMPLES_PER_REFERENCE_BATCH)]
    half, half_loss = t5_gradients(t5, batches, device, bf16=True) if bf16 else (None, None)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        truth, truth_loss = t5_gradients(t5, batches, device, bf16=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    del t5
    squares = {"truth": 0.0, "fat5": 0.0, "fat5_error": 0.0, "t5_bf16_error": 0.0}
    parameters = []
    for name, reference in truth.items():
        gradient = fat5.get_parameter(name).grad.float()
        error = float((gradient - reference).norm())
        half_error = float((half[name] - reference).norm()) if bf16 else None
        norm = float(reference.norm())
        squares["truth"] += norm**2
        squares["fat5"] += float(gradient.norm()) ** 2
        squares["fat5_error"] += error**2
        squares["t5_bf16_error"] += (half_error or 0.0) ** 2
        parameters.append({"name": name, "norm": norm, "fat5": error / max(norm, 1e-30),
                           "t5_bf16": None if half_error is None else half_error / max(norm, 1e-30)})
    norm = squares["truth"] ** 0.5
    worst = sorted(parameters, key=lambda row: -row["fat5"])[:WORST]
    return {
        "t5_fp32_loss": round(truth_loss, 6), "t5_bf16_loss": None if half_loss is None else round(half_loss, 6),
        "gradient_norm": round(norm, 6), "fat5_gradient_norm": round(squares["fat5"] ** 0.5, 6),
        "relative_error": {"fat5": squares["fat5_error"] ** 0.5 / norm,
                           "t5_bf16": squares["t5_bf16_error"] ** 0.5 / norm if bf16 else None},
        "worst_parameters": [{key: (float(f"{value:.4g}") if isinstance(value, float) else value)
                              for key, value in row.items()} for row in worst],
    }


def check_gradients(trainer, first: int, last: int, bf16: bool, steps: list) -> None:
    """``trainer`` (the job's) comparing the gradients of steps ``first`` to ``last`` and stopping after ``last``
    (its ``training_step`` wrapped on this trainer alone)."""
    training_step = trainer.training_step

    def checked(model, inputs, *args, **kwargs):
        step = trainer.state.global_step + 1
        loss = training_step(model, inputs, *args, **kwargs)
        if first <= step <= last:
            fat5 = trainer.accelerator.unwrap_model(model, keep_torch_compile=False)
            device = next(fat5.parameters()).device
            row = {"step": step, "loss": round(float(loss), 6), **compare(fat5, inputs, device, bf16)}
            logger.info("step %d: loss %.4f (T5 fp32 %.4f), gradient norm %.4g, relative error FAT5 %.3g, "
                        "T5 bf16 %s", step, row["loss"], row["t5_fp32_loss"], row["gradient_norm"],
                        row["relative_error"]["fat5"], row["relative_error"]["t5_bf16"])
            steps.append(row)
        if step >= last:
            trainer.control.should_training_stop = True
        return loss

    trainer.training_step = checked


def plot(document: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["results"]["steps"]
    steps = [row["step"] for row in rows]
    figure, (errors, losses) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    errors.plot(steps, [row["relative_error"]["fat5"] for row in rows], "o-", label="FAT5 (bf16 kernels)")
    if any(row["relative_error"]["t5_bf16"] is not None for row in rows):
        errors.plot(steps, [row["relative_error"]["t5_bf16"] for row in rows], "s--", label="transformers' T5, bf16")
    errors.set_yscale("log")
    errors.set_ylabel("|g - g_fp32| / |g_fp32|")
    errors.legend(fontsize=8)
    losses.plot(steps, [row["loss"] for row in rows], "o-", label="FAT5's step loss")
    losses.plot(steps, [row["t5_fp32_loss"] for row in rows], "x", label="T5 fp32, same weights and examples")
    losses.set_xlabel("optimizer step")
    losses.set_ylabel("loss")
    losses.legend(fontsize=8)
    save_png(figure, path, document, f"gradients, {document['shape']}, seed {document['seed']}")
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pretrain.add_job_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="the run's length, which sets its learning-rate "
                        "schedule (as pretrain.py's --steps); the run stops after --check-to (default 300; --tiny 4)")
    parser.add_argument("--check-from", type=int, default=None,
                        help="first step whose gradients are compared (default 128; --tiny 3)")
    parser.add_argument("--check-to", type=int, default=None,
                        help="last step compared, and the run's last (default 140; --tiny 4)")
    parser.add_argument("--compile", choices=["none", "job"], default="none",
                        help="FAT5's model eager (compile.mode: none) or compiled as the job's config says")
    parser.add_argument("--tiny", action="store_true",
                        help="the whole path on a CPU: the built-in default config, 4 steps, steps 3-4 compared, "
                             "on 40 scenes (or --max-documents)")
    parser.add_argument("--out", default=None,
                        help="result JSON (default benchmarks/results/gradient_check_SHAPE.json)")
    args = parse_or_plot(parser, plot, argv)
    if args is None:
        return
    defaults = (4, 3, 4) if args.tiny else (300, 128, 140)
    args.steps, args.check_from, args.check_to = (given or default for given, default in zip(
        (args.steps, args.check_from, args.check_to), defaults))
    if args.tiny:
        args.max_documents = args.max_documents or 40
    if not 1 <= args.check_from <= args.check_to <= args.steps:
        parser.error(f"the compared steps must lie within the run: 1 <= --check-from ({args.check_from}) <= "
                     f"--check-to ({args.check_to}) <= --steps ({args.steps})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    shape = "tiny" if args.tiny else args.shape
    args.out = args.out or f"benchmarks/results/gradient_check_{shape}.json"
    with tempfile.TemporaryDirectory(prefix="fat5-gradient-check-") as scratch:
        pretrain.resolve_job_arguments(parser, args, scratch)
        steps, last_step, job_settings = run(args, scratch)
    document = write_result(args.out, {"steps": steps, "stopped_after_step": last_step}, shape=shape, seed=args.seed,
                            model=job_settings["model"], job=job_settings, settings=vars(args))
    draw_beside(plot, document, args.out)
    print(f"{len(steps)} steps compared -> {args.out}")


def run(args, scratch: str) -> tuple[list[dict], int, dict]:
    """pretrain.py's FAT5 path to step ``args.check_to``, its gradients compared from ``args.check_from``: the
    compared steps, the last step the run took, and the job's settings."""
    extra = {"model": {"z_loss": 0.0}}
    if args.compile == "none":
        extra["compile"] = {"mode": "none"}
    job, _ = pretrain.prepare_job(args, args.seed, None, Path(scratch) / "job", extra=extra)
    steps = []
    check_gradients(job.trainer, args.check_from, args.check_to, bf16=job.trainer.args.bf16, steps=steps)
    job.trainer.train()
    return steps, job.trainer.state.global_step, job.settings.to_dict()


if __name__ == "__main__":
    main()
