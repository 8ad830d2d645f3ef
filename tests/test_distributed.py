"""Several processes: the packed UL2 batches are dealt out to the ranks, and `fat5 pretrain` under `accelerate launch`
on two CPU processes (gloo) trains exactly like one process that accumulates two batches per step.

accelerate 1.15 turns FSDP on only on accelerators (a `--cpu` launch is plain data parallel), so the shipped FSDP
configuration is exercised by benchmarks/distributed.py on GPUs; here, torch's own FSDP2 shards every FAT5Block on
two CPU processes, as that configuration's auto-wrap does, and must give the unsharded model's loss and gradients.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.data_loader import prepare_data_loader
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoModelForSeq2SeqLM

from fat5 import FAT5ForConditionalGeneration
from fat5.trainer.collator import UL2DataCollator
from fat5.trainer.packing import PlannedDataset, UL2PackedBatchSampler
from fat5.trainer.tokenizer import load_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "shakespeare_speeches.jsonl"
DOCUMENTS = [json.loads(line)["document"] for line in DATA.read_text(encoding="utf-8").splitlines()]
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


def pretrain_config(tokenizer_dir, accumulation: int) -> dict:
    return {
        "model": {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_heads": 4, "num_layers": 1},
        "tokenizer": {"path": str(tokenizer_dir)},
        "data": {"path": str(DATA), "text_column": "document", "max_input_length": 64, "max_target_length": 32,
                 "tokens_per_batch": 256},
        "training": {"max_steps": STEPS, "gradient_accumulation_steps": accumulation, "logging_steps": 1,
                     "warmup_steps": 0, "learning_rate": 3e-3, "eval_strategy": "no", "save_strategy": "no",
                     "use_cpu": True, "disable_tqdm": True, "dataloader_num_workers": 0},
    }


def run_pretrain(tmp_path: Path, name: str, config: dict, processes: int) -> Path:
    config_file = tmp_path / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    output = tmp_path / name
    command = ["-m", "fat5.cli", "pretrain", str(config_file), "--output-dir", str(output)]
    if processes > 1:
        # the shipped DDP config on the CPU: accelerate's `--cpu` flag alone would start one process, but a
        # MULTI_GPU config with use_cpu starts them all through torchrun, and they meet over gloo
        accelerate_config = yaml.safe_load((REPO / "examples" / "accelerate" / "ddp.yaml").read_text())
        accelerate_config.update(num_processes=processes, use_cpu=True, main_process_port=_free_port())
        accelerate_config.pop("gpu_ids")
        (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(accelerate_config))
        accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
        command = [accelerate, "launch", "--config_file", str(tmp_path / "accelerate.yaml")] + command
    else:
        command = [sys.executable] + command
    # one thread per process: two processes share the two cores of a CI machine
    environment = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment, cwd=tmp_path,
                               check=False)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return output


def training_logs(output: Path) -> dict[int, dict]:
    summary = json.loads((output / "pretrain_summary.json").read_text())
    return {entry["step"]: entry for entry in summary["log_history"] if "loss" in entry}


def test_two_processes_train_like_one_that_accumulates_two_batches(tokenizer_dir, tmp_path):
    """Rank r of 2 takes batches r, r + 2, ... (see above), so a 2-process step sees the two batches that one process
    accumulates in a step of gradient_accumulation_steps 2: with the loss a sum over `num_items_in_batch` counted
    across ranks, the averaged gradients are the same sum, and so are every later step's weights and loss."""
    single = run_pretrain(tmp_path, "one-process", pretrain_config(tokenizer_dir, accumulation=2), processes=1)
    double = run_pretrain(tmp_path, "two-processes", pretrain_config(tokenizer_dir, accumulation=1), processes=2)

    one, two = training_logs(single), training_logs(double)
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

    model = AutoModelForSeq2SeqLM.from_pretrained(double)
    assert isinstance(model, FAT5ForConditionalGeneration)
    weights_one = load_file(single / "model.safetensors")
    weights_two = load_file(double / "model.safetensors")
    assert weights_one.keys() == weights_two.keys()
    for name, value in weights_one.items():
        torch.testing.assert_close(weights_two[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert not (double / ".final-model.tmp").exists()


FSDP_WORKER = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from fat5 import FAT5Config, FAT5ForConditionalGeneration
from fat5.modeling_fat5 import FAT5Block

dist.init_process_group("gloo")
torch.manual_seed(0)
config = FAT5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4, dropout_rate=0.0,
                    feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
                    position_encoding=sys.argv[1])
sharded = FAT5ForConditionalGeneration(config)
whole = FAT5ForConditionalGeneration(config)
whole.load_state_dict(sharded.state_dict())
inputs = dict(input_ids=torch.randint(2, 64, (2, 16)), labels=torch.randint(2, 64, (2, 8)))
whole(**inputs).loss.backward()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
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
    print("RESULT", loss.item(), whole(**inputs).loss.item(), ",".join(differing) or "-")
# both ranks tear gloo down together: one rank destroying its group while the other still runs aborted it once
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("position_encoding", ["t5", "fire"])
def test_fsdp_per_block_gives_the_unsharded_loss_and_gradients(position_encoding, tmp_path):
    """The later blocks read the first block's position encoding (T5's table, FIRE's bias): under FSDP, with one unit
    per block, it must reach them as a tensor, since the first block's parameters are sharded again after it ran."""
    worker = tmp_path / "fsdp_worker.py"
    worker.write_text(FSDP_WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), str(worker), position_encoding]
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment, check=False)
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = next(line for line in completed.stdout.splitlines() if line.startswith("RESULT"))
    sharded_loss, whole_loss, differing_gradients = result.split()[1:]
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
    if distributed_type == "FSDP":
        block = getattr(modeling_fat5, config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"])
        assert issubclass(block, torch.nn.Module)
        assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
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
