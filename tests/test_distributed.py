"""Several processes: the packed UL2 batches are dealt out to the ranks, and `fat5 pretrain` under torchrun and
`fat5 finetune` under `accelerate launch`, on two CPU processes (gloo), train exactly like one process that
accumulates two batches per step, as one job: the main process alone trains the tokenizer, writes the model and
reports (issue 50: under torchrun without use_cpu each process ran a job of its own, and the two saves raced).

accelerate 1.15 turns FSDP on only on accelerators (a `--cpu` launch is plain data parallel), so the shipped FSDP
configuration is exercised by benchmarks/distributed.py on GPUs; here, torch's own FSDP2 shards every FAT5Block on
two CPU processes, as that configuration's auto-wrap does, and must give the unsharded model's loss and gradients.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.data_loader import prepare_data_loader
from helpers import DATA, REPO, ROWS, SMALL_PRETRAIN
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoModelForSeq2SeqLM

from fat5 import FAT5ForConditionalGeneration
from fat5.trainer.collator import UL2DataCollator
from fat5.trainer.packing import PlannedDataset, UL2PackedBatchSampler
from fat5.trainer.tokenizer import load_tokenizer, train_tokenizer
from fat5_command import main

DOCUMENTS = [row["document"] for row in ROWS]
STEPS = 4


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(DOCUMENTS, vocab_size=400, num_sentinels=16, save_directory=str(folder))
    return folder


def test_packed_batches_are_dealt_round_robin_to_the_ranks(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    token_ids = tokenizer(DOCUMENTS)["input_ids"]
    lengths = [len(ids) for ids in token_ids]
    collator = UL2DataCollator(tokenizer, max_input_length=64, max_target_length=32, packed=True, seed=0)
    sampler = UL2PackedBatchSampler(lengths, collator.objective, tokens_per_batch=256, seed=0)
    every_batch = sampler.batches()
    processes = 3
    assert len(every_batch) % processes, "a count that does not divide also checks how the last ranks are topped up"

    for rank_count in (2, processes):
        per_rank = []
        for rank in range(rank_count):
            # the DataLoader that FAT5Trainer builds, prepared as accelerate prepares it on process `rank`
            loader = DataLoader(PlannedDataset(token_ids), batch_sampler=sampler,
                                collate_fn=lambda examples: [example["ul2_plan"] for example in examples])
            per_rank.append(list(prepare_data_loader(loader, num_processes=rank_count, process_index=rank,
                                                     put_on_device=False)))
        # rank r takes batches r, r + n, ...; ranks left one batch short start over at the first batches, so that
        # every rank takes the same number of steps
        topped_up = every_batch + every_batch[: -len(every_batch) % rank_count]
        for rank in range(rank_count):
            assert per_rank[rank] == topped_up[rank::rank_count], (rank_count, rank)
        interleaved = [batch for step in zip(*per_rank) for batch in step]
        assert interleaved[: len(every_batch)] == every_batch


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pretrain_config(tokenizer_dir, accumulation: int, device: str = "cpu") -> dict:
    training = {"max_steps": STEPS, "gradient_accumulation_steps": accumulation, "logging_steps": 1,
                "warmup_steps": 0, "learning_rate": 3e-3, "eval_strategy": "no", "save_strategy": "no",
                "disable_tqdm": True, "dataloader_num_workers": 0}
    training.update({"use_cpu": True} if device == "cpu" else {"bf16": True})
    return {
        "model": SMALL_PRETRAIN["model"],
        "tokenizer": {"path": str(tokenizer_dir)},
        "data": {"path": str(DATA), "text_column": "document", "max_input_length": 64, "max_target_length": 32,
                 "tokens_per_batch": 256},
        "training": training,
    }


def finetune_config(model_dir, accumulation: int, device: str = "cpu") -> dict:
    # sequential batches: rank r of 2 then takes batches r, r + 2, ..., the two batches one process accumulates in a
    # step (a length-grouped sampler draws its groups from batch size x accumulation, which differ between the two);
    # the one checkpoint, at the last step, keeps the per-step losses (trainer_state.json)
    training = {"max_steps": STEPS, "per_device_train_batch_size": 4, "gradient_accumulation_steps": accumulation,
                "logging_steps": 1, "warmup_steps": 0, "learning_rate": 3e-3, "train_sampling_strategy": "sequential",
                "eval_strategy": "no", "save_strategy": "steps", "save_steps": STEPS, "disable_tqdm": True,
                "dataloader_num_workers": 0, "seed": 0}
    training.update({"use_cpu": True} if device == "cpu" else {"bf16": True})
    return {
        "task": "seq2seq",
        "model": str(model_dir),
        "data": {"train_file": str(DATA), "text_column": "document", "target_column": "summary",
                 "max_source_length": 64, "max_target_length": 16},
        "training": training,
    }


def run_job(job: str, tmp_path: Path, name: str, config: dict, launcher: str | None = None,
            processes: int = 2, device: str = "cpu", arguments: tuple = ()) -> tuple[Path, str]:
    """``fat5 JOB`` in one plain process (``launcher`` None: on the CPU this process, which has imported torch
    already), under plain torchrun (``launcher`` "torchrun"), or under ``accelerate launch`` with the shipped
    ``examples/accelerate/{launcher}.yaml``, in ``processes`` processes; returns the output folder and what the
    launch printed (stdout, then stderr)."""
    config_file = tmp_path / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    output = tmp_path / name
    if launcher is None and device == "cpu":
        assert main([job, str(config_file), "--output-dir", str(output), *arguments]) == 0
        return output, ""
    command = ["-m", "fat5.cli", job, str(config_file), "--output-dir", str(output), *arguments]
    environment = dict(os.environ, TOKENIZERS_PARALLELISM="false",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                       # NVLink multicast stays off on shared hosts (the lent GPU machines require it)
                       NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    if device == "cpu":
        # one thread per process: two processes share the two cores of a CI machine
        environment["OMP_NUM_THREADS"] = "1"
    if launcher == "torchrun":
        command = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_port", str(_free_port())] + command
    elif launcher is not None:
        settings = yaml.safe_load((REPO / "examples" / "accelerate" / f"{launcher}.yaml").read_text())
        settings.update(num_processes=processes, main_process_port=_free_port())
        if device == "cpu":
            # the shipped DDP config on the CPU: accelerate's `--cpu` flag alone would start one process, but a
            # MULTI_GPU config with use_cpu starts them all through torchrun, and they meet over gloo
            settings.update(use_cpu=True)
            settings.pop("gpu_ids")
        launch_config = tmp_path / f"{name}-accelerate.yaml"
        launch_config.write_text(yaml.safe_dump(settings))
        command = ["-m", "accelerate.commands.launch", "--config_file", str(launch_config)] + command
    elif device == "cuda":
        environment["CUDA_VISIBLE_DEVICES"] = environment.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    completed = subprocess.run([sys.executable] + command, capture_output=True, text=True, timeout=900,
                               env=environment, cwd=tmp_path, check=False)
    assert completed.returncode == 0, f"{name}: exit {completed.returncode}\n{completed.stderr[-4000:]}"
    return output, completed.stdout + completed.stderr


def assert_one_job(printed: str, reports: str) -> None:
    """What two processes printed is one job's: its report said once (a line starting ``reports``), no traceback,
    and no word from transformers that the processes train apart."""
    assert len([line for line in printed.splitlines() if line.startswith(reports)]) == 1, printed[-3000:]
    assert "Traceback" not in printed and "parallel_mode" not in printed, printed[-3000:]


def training_logs(job: str, output: Path) -> dict[int, dict]:
    if job == "pretrain":
        history = json.loads((output / "pretrain_summary.json").read_text())["log_history"]
    else:
        history = json.loads((output / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry for entry in history if "loss" in entry}


def largest_relative_difference(reference: dict[int, dict], other: dict[int, dict]) -> float:
    assert sorted(reference) == sorted(other) == list(range(1, STEPS + 1))
    return max(abs(other[step]["loss"] - reference[step]["loss"]) / abs(reference[step]["loss"]) for step in reference)


def assert_same_final_model(single: Path, double: Path) -> None:
    """The two-process run saved a FAT5 model with the one-process run's weights (float32 sums in another order, far
    below 1e-4 after 4 steps)."""
    assert isinstance(AutoModelForSeq2SeqLM.from_pretrained(double), FAT5ForConditionalGeneration)
    weights_one = load_file(single / "model.safetensors")
    weights_two = load_file(double / "model.safetensors")
    assert weights_one.keys() == weights_two.keys()
    for name, value in weights_one.items():
        torch.testing.assert_close(weights_two[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_two_processes_train_like_one_that_accumulates_two_batches(tokenizer_dir, tmp_path):
    """Rank r of 2 takes batches r, r + 2, ... (see above), so a 2-process step sees the two batches that one process
    accumulates in a step of gradient_accumulation_steps 2: with the loss a sum over `num_items_in_batch` counted
    across ranks, the averaged gradients are the same sum, and so are every later step's weights and loss. Plain
    torchrun, the config saying nothing of the CPU: the job trains its tokenizer once (the second run loads the one
    the first kept), on the main process, which alone reports."""
    config = pretrain_config(tokenizer_dir, accumulation=2)
    config["tokenizer"] = {"vocab_size": 400, "num_sentinels": 16}
    del config["training"]["use_cpu"]
    single, _ = run_job("pretrain", tmp_path, "one-process", config)
    config["training"]["gradient_accumulation_steps"] = 1
    double, printed = run_job("pretrain", tmp_path, "two-processes", config, "torchrun")
    assert_one_job(printed, "model and tokenizer saved to")
    assert len([line for line in printed.splitlines() if line.startswith(("training a", "tokenizer:"))]) == 1

    one, two = training_logs("pretrain", single), training_logs("pretrain", double)
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    losses = [one[step]["loss"] for step in one]
    assert max(losses) - min(losses) > 0.05, f"the weights must move for the comparison to mean anything: {losses}"
    # the runs differ only in the order of float32 sums (gradients added in one process or all-reduced over two),
    # some 1e-7 of a value; Adam over 4 steps keeps that far below 1e-4. Sharing out the batches wrongly (one
    # batch twice, a rank's batch unweighted by the other's tokens) changes a step's loss by percents.
    for step in one:
        for key in ("loss", "ce_loss", "z_loss"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-4), (step, key)
        # packed batches differ in size: the job's padding share needs both ranks' tokens and slots
        assert two[step]["padding_fraction"] == pytest.approx(one[step]["padding_fraction"], abs=2e-4), step

    assert_same_final_model(single, double)
    assert sorted(path.name for path in double.iterdir() if path.name.startswith(".")) == []


def test_two_processes_finetune_like_one_that_accumulates_two_batches(tiny_model, tmp_path):
    """`fat5 finetune` on the DataCollatorForSeq2Seq path: padded batches, the loss a sum over the labelled tokens of
    both ranks (`num_items_in_batch`), the checkpoint and the final model written by the main process."""
    single, _ = run_job("finetune", tmp_path, "one-process", finetune_config(tiny_model, accumulation=2))
    double, printed = run_job("finetune", tmp_path, "two-processes", finetune_config(tiny_model, accumulation=1),
                              "ddp")
    assert_one_job(printed, "model: ")

    one, two = training_logs("finetune", single), training_logs("finetune", double)
    losses = [one[step]["loss"] for step in sorted(one)]
    assert max(losses) - min(losses) > 0.05, f"the weights must move for the comparison to mean anything: {losses}"
    # as for pretraining: float32 sums in another order, far below 1e-4 after 4 steps
    assert largest_relative_difference(one, two) < 1e-4
    for step in one:
        # padded batches differ in width: the job's padding share needs both ranks' tokens and slots
        assert two[step]["padding_fraction"] == pytest.approx(one[step]["padding_fraction"], abs=2e-4), step

    assert_same_final_model(single, double)
    # the same job again over it, under plain torchrun, the config saying nothing of the CPU: one job again, whose
    # model replaces the first
    config = finetune_config(tiny_model, accumulation=1)
    del config["training"]["use_cpu"]
    again, printed = run_job("finetune", tmp_path, "two-processes", config, "torchrun", arguments=("--overwrite",))
    assert_one_job(printed, "model: ")
    assert_same_final_model(single, again)
    assert sorted(path.name for path in again.iterdir() if path.name.startswith(".")) == []


# ----------------------------------------------------------------------------------------------- two GPUs

SHIPPED_CONFIGS = ("ddp", "fsdp", "deepspeed_zero2")
# Largest relative difference, over the logged steps, between the loss of 2 GPUs x 1 batch and 1 GPU accumulating
# the same 2 batches, both with bf16 (training.bf16: true). DDP keeps the one-GPU arithmetic batch by batch (autocast:
# float32 weights cast to bf16 for each product); the runs differ only in the order of float32 gradient sums and the
# attention backward's float32 atomics, 1e-7 of a value, which reach a bf16 weight only where they flip its rounding
# (one bf16 step is 2^-8 = 0.39% of a value): 5e-3 leaves room for a few such flips over the steps. FSDP (its bf16
# MixedPrecisionPolicy: bf16 parameters, so a bf16 residual stream, and a bf16 reduce-scatter) and DeepSpeed's bf16
# mode (bf16 weights, float32 master copy) round every activation and gradient once more than autocast does, a
# relative 2^-9 each, averaged over the thousands of tokens of a loss: 3e-2. The one-batch control run, a wrong share
# of the batches, must be at least three times as far off.
BF16_TOLERANCE = {"ddp": 5e-3, "fsdp": 3e-2, "deepspeed_zero2": 3e-2}


def job_config(job: str, tokenizer_dir: Path, model_dir: Path, accumulation: int, device: str) -> dict:
    if job == "pretrain":
        return pretrain_config(tokenizer_dir, accumulation, device)
    return finetune_config(model_dir, accumulation, device)


@pytest.fixture(scope="module")
def one_gpu_runs(tmp_path_factory, tokenizer_dir, tiny_model):
    """``runs(job)``: the 1-GPU reference (2 batches accumulated a step) and control (1 batch a step) of a job, run on
    first use and shared by the shipped configs."""
    folder = tmp_path_factory.mktemp("one-gpu")
    runs = {}

    def get(job: str) -> tuple[Path, Path]:
        if job not in runs:
            runs[job] = tuple(
                run_job(job, folder, f"{job}-{name}", job_config(job, tokenizer_dir, tiny_model, accumulation, "cuda"),
                        device="cuda")[0]
                for name, accumulation in (("accumulate-2", 2), ("one-batch", 1))
            )
        return runs[job]

    return get


def evaluation_loss(model_dir: Path) -> float:
    """The float32 loss of a saved model, loaded on the CPU of this one process, on a fixed batch of the speeches."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert isinstance(model, FAT5ForConditionalGeneration)
    batch = tokenizer(DOCUMENTS[:8], max_length=48, truncation=True, padding=True, return_tensors="pt")
    labels = batch["input_ids"][:, :16].masked_fill(batch["attention_mask"][:, :16] == 0, -100)
    with torch.no_grad():
        return model(**batch, labels=labels).loss.item()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs: `accelerate launch` of 2 processes")
@pytest.mark.parametrize("accelerate_config", SHIPPED_CONFIGS)
@pytest.mark.parametrize("job", ["pretrain", "finetune"])
def test_two_gpus_train_like_one_that_accumulates_two_batches(job, accelerate_config, one_gpu_runs, tokenizer_dir,
                                                              tiny_model, tmp_path):
    """Each shipped accelerate config on 2 GPUs: the job ends, its model folder is a plain FAT5 model that loads in
    one process, and its loss follows the 1-GPU run that accumulates the two batches of a step."""
    pytest.importorskip("datasets", reason="fat5 pretrain and fat5 finetune read their data through `datasets`")
    if accelerate_config == "deepspeed_zero2":
        pytest.importorskip("deepspeed",
                            reason="examples/accelerate/deepspeed_zero2.yaml needs `pip install deepspeed`")
    reference, control = one_gpu_runs(job)
    config = job_config(job, tokenizer_dir, tiny_model, accumulation=1, device="cuda")
    double, _ = run_job(job, tmp_path, f"{job}-{accelerate_config}", config, accelerate_config, device="cuda")

    one, two = training_logs(job, reference), training_logs(job, double)
    tolerance = BF16_TOLERANCE[accelerate_config]
    deviation = largest_relative_difference(one, two)
    # one batch a step instead of two: what training on the wrong share of the data looks like
    wrong_share = largest_relative_difference(one, training_logs(job, control))
    assert deviation <= tolerance, f"{accelerate_config}: the loss is {deviation:.2e} off the 1-GPU run's"
    # on the CPU (float32) the one-batch run is 4-5% off at its farthest step: bf16 noise must stay well inside that
    assert deviation < wrong_share / 3, f"{accelerate_config}: {deviation:.2e} off, a wrong share {wrong_share:.2e}"

    saved = load_file(double / "model.safetensors")
    expected = load_file(reference / "model.safetensors")
    assert ({name: value.shape for name, value in saved.items()}
            == {name: value.shape for name, value in expected.items()})
    assert evaluation_loss(double) == pytest.approx(evaluation_loss(reference), rel=tolerance)
    assert not list(double.glob(".final-model.tmp*"))


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_a_gathered_state_dict_saves_the_folder_one_process_saves(tie_word_embeddings, tmp_path):
    """FSDP hands the Trainer's save a gathered state dict whose tied weights are copies, not one shared tensor:
    the final folder must still hold each weight once, as the model's own save_pretrained writes it, and load
    back to the same model."""
    from fat5 import FAT5Config
    from fat5.trainer.trainer import FAT5Trainer, FAT5TrainingArguments

    torch.manual_seed(0)
    model = FAT5ForConditionalGeneration(FAT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        tie_word_embeddings=tie_word_embeddings))
    model.save_pretrained(tmp_path / "one-process")
    trainer = FAT5Trainer(model=model, args=FAT5TrainingArguments(output_dir=str(tmp_path), report_to="none"))
    gathered = {name: value.clone() for name, value in model.state_dict().items()}
    assert "encoder.embed_tokens.weight" in gathered
    trainer._save(str(tmp_path / "gathered"), state_dict=gathered)

    saved, expected = load_file(tmp_path / "gathered" / "model.safetensors"), load_file(
        tmp_path / "one-process" / "model.safetensors")
    assert sorted(saved) == sorted(expected)
    reloaded = FAT5ForConditionalGeneration.from_pretrained(tmp_path / "gathered")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], value, rtol=0, atol=0, msg=name)


FSDP_WORKER = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from fat5 import FAT5Config, FAT5ForConditionalGeneration
from fat5.modeling_fat5 import FAT5Block

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for position_encoding in sys.argv[1:]:
    torch.manual_seed(0)
    config = FAT5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4, dropout_rate=0.0,
                        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
                        position_encoding=position_encoding)
    sharded = FAT5ForConditionalGeneration(config)
    whole = FAT5ForConditionalGeneration(config)
    whole.load_state_dict(sharded.state_dict())
    inputs = dict(input_ids=torch.randint(2, 64, (2, 16)), labels=torch.randint(2, 64, (2, 8)))
    whole(**inputs).loss.backward()
    for module in sharded.modules():
        if isinstance(module, FAT5Block):
            fully_shard(module, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    loss = sharded(**inputs).loss
    loss.backward()
    # elementwise, with an absolute floor: some gradients vanish analytically (a bias constant over the keys moves no
    # softmax) and are float32 noise of 1e-7 on both sides
    differing = [
        name for (name, parameter), reference in zip(sharded.named_parameters(), whole.parameters())
        if not torch.allclose(parameter.grad.full_tensor(), reference.grad, rtol=1e-4, atol=1e-6)
    ]
    if dist.get_rank() == 0:
        print("RESULT", position_encoding, loss.item(), whole(**inputs).loss.item(), ",".join(differing) or "-")
# both ranks tear gloo down together: one rank destroying its group while the other still runs aborted it once
dist.barrier()
dist.destroy_process_group()
"""
FSDP_POSITION_ENCODINGS = ["t5", "fire"]


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory) -> dict[str, list[str]]:
    """(sharded loss, unsharded loss, the parameters whose gradients differ) for each position encoding, from one
    launch of two processes (each launch starts three, which import torch)."""
    worker = tmp_path_factory.mktemp("fsdp") / "fsdp_worker.py"
    worker.write_text(FSDP_WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), str(worker), *FSDP_POSITION_ENCODINGS]
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment, check=False)
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = [line.split()[1:] for line in completed.stdout.splitlines() if line.startswith("RESULT")]
    return {position_encoding: rest for position_encoding, *rest in results}


@pytest.mark.parametrize("position_encoding", FSDP_POSITION_ENCODINGS)
def test_fsdp_per_block_gives_the_unsharded_loss_and_gradients(position_encoding, fsdp_results):
    """The later blocks read the first block's position encoding (T5's table, FIRE's bias): under FSDP, with one unit
    per block, it must reach them as a tensor, since the first block's parameters are sharded again after it ran."""
    sharded_loss, whole_loss, differing_gradients = fsdp_results[position_encoding]
    assert float(sharded_loss) == pytest.approx(float(whole_loss), rel=1e-5)
    assert differing_gradients == "-"


@pytest.mark.parametrize(
    "name, distributed_type",
    [("single_gpu", "NO"), ("ddp", "MULTI_GPU"), ("fsdp", "FSDP"), ("deepspeed_zero2", "DEEPSPEED")],
)
def test_shipped_accelerate_configs_load_and_save_plain_models(name, distributed_type):
    # accelerate's own loader validates the fields; the sharded ones must name FAT5's block and save whole models.
    from accelerate.commands.config.config_args import load_config_from_file

    from fat5 import modeling_fat5

    config = load_config_from_file(str(REPO / "examples" / "accelerate" / f"{name}.yaml"))
    assert config.distributed_type == distributed_type
    # what the README's "Several GPUs" says of them: the precision comes from the training section (bf16: true), as
    # on one GPU, except under FSDP, whose bf16 policy casts the parameters it gathers
    assert config.mixed_precision == ("bf16" if distributed_type == "FSDP" else "no")
    if distributed_type == "FSDP":
        block = getattr(modeling_fat5, config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"])
        assert issubclass(block, torch.nn.Module)
        assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_reshard_after_forward"] is True  # full shard
    if distributed_type == "DEEPSPEED":
        assert config.deepspeed_config["zero_stage"] == 2  # parameters unsharded: save_model writes them whole
        assert config.deepspeed_config["offload_optimizer_device"] == "none"


def _trainer_state(fsdp_state_dict_type=None, zero_optimization=None):
    from types import SimpleNamespace

    state = SimpleNamespace(
        fsdp_plugin=SimpleNamespace(state_dict_type=fsdp_state_dict_type),
        deepspeed_plugin=SimpleNamespace(deepspeed_config={"zero_optimization": zero_optimization or {}}),
    )
    return SimpleNamespace(
        is_fsdp_enabled=fsdp_state_dict_type is not None,
        is_deepspeed_enabled=zero_optimization is not None,
        accelerator=SimpleNamespace(state=state),
    )


@pytest.mark.parametrize(
    "trainer_options, match",
    [
        ({"fsdp_state_dict_type": "StateDictType.FULL_STATE_DICT"}, None),
        ({"fsdp_state_dict_type": "StateDictType.SHARDED_STATE_DICT"}, "FULL_STATE_DICT"),
        ({"zero_optimization": {"stage": 2}}, None),
        ({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}, None),
        ({"zero_optimization": {"stage": 3}}, "zero3_save_16bit_model"),
        ({}, None),
    ],
)
def test_sharded_final_saves_are_refused_before_training(trainer_options, match):
    from fat5.errors import FAT5Error
    from fat5.trainer.trainer import require_full_state_dict

    trainer = _trainer_state(**trainer_options)
    if match is None:
        require_full_state_dict(trainer)
    else:
        with pytest.raises(FAT5Error, match=match):
            require_full_state_dict(trainer)


def test_benchmark_counts_the_flops_of_packed_examples_each_against_itself():
    from types import SimpleNamespace

    from helpers import benchmark_module

    distributed = benchmark_module("distributed")
    # row 0 packs examples of 3 and 2 encoder tokens (targets of 2 and 1), row 1 one of 4 (target of 3)
    batch = {
        "segment_ids": [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]],
        "decoder_segment_ids": [[1, 1, 2, 0], [1, 1, 1, 0]],
        "labels": [[5, 6, 7, -100], [5, 6, 7, -100]],
    }
    config = SimpleNamespace(num_heads=2, d_kv=4, num_layers=3, num_decoder_layers=2)
    flops, tokens = distributed.batch_flops(batch, {"encoder": 10, "decoder": 20, "lm_head": 5}, config)
    assert tokens == 9 + 6
    dense = 6 * (10 * 9 + (20 + 5) * 6)  # 1440
    # 4·H·D = 32 per layer and query-key pair: encoder 3 layers x (9 + 4 + 16); decoder 2 layers x (causal self
    # L_d^2 / 2 + cross L_d·L_e) = (2 + 6) + (0.5 + 2) + (4.5 + 12); forward + backward 3.5 x forward
    attention = 3.5 * (32 * 3 * 29 + 32 * 2 * 27)  # 15792
    assert flops == dense + attention == 17232


def test_benchmark_runs_the_config_with_only_what_a_benchmark_changes(tmp_path):
    """distributed.py's derived YAML: the given config whole, the steps, logging, saving, evaluation and the shared
    tokenizer changed, and a valid `fat5 pretrain` config (the package's own check); --tiny: the built-in default."""
    from types import SimpleNamespace

    import yaml
    from helpers import benchmark_module

    from fat5.trainer.pretrain_config import load_pretrain_config
    from fat5.trainer.pretraining import CONFIG_DIR

    distributed = benchmark_module("distributed")
    source = CONFIG_DIR / "pretrain_minipile.yaml"
    args = SimpleNamespace(tiny=False, config=str(source), steps=7, logging_steps=2, tokens_per_gpu=None,
                           set=["training.learning_rate=0.001"])
    config = distributed.job_config(args, tmp_path / "tokenizer")
    original = yaml.safe_load(source.read_text())
    assert config["model"] == original["model"] and config["data"] == original["data"]
    assert config["tokenizer"] == {**original["tokenizer"], "path": str(tmp_path / "tokenizer")}
    training = config["training"]
    assert (training["max_steps"], training["logging_steps"], training["learning_rate"]) == (7, 2, 1e-3)
    assert (training["save_strategy"], training["eval_strategy"], training["report_to"]) == ("no", "no", "none")
    assert training["optim"] == original["training"]["optim"] and training["bf16"] is True
    settings = load_pretrain_config(yaml.safe_load(yaml.safe_dump(config)))
    assert settings.training["max_steps"] == 7

    tiny = distributed.job_config(SimpleNamespace(tiny=True, config=None, steps=3, logging_steps=1, tokens_per_gpu=512,
                                                  set=[]), None)
    assert "model" not in tiny and "tokenizer" not in tiny  # the built-in default's, beneath
    assert tiny["data"]["tokens_per_batch"] == 512 and tiny["training"]["use_cpu"] is True
    assert load_pretrain_config(tiny).training["max_steps"] == 3
