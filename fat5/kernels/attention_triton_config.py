"""Launch configurations of FAT5's Triton attention kernels: tile shapes, warps and stages per architecture and head
dim, the tuning hook the benchmarks set, and what the launchers ask of them."""

import functools
from dataclasses import dataclass

import torch

from .launch import multiprocessors


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of one kernel. ``block_m`` tiles queries, ``block_n`` keys;
    ``max_registers`` caps the registers per thread (Triton's ``maxnreg``) so that more programs share an SM."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    max_registers: int | None = None


# Per architecture and padded head dim. Hopper entries were chosen by the sweep in benchmarks/attention.py
# (--sweep) on an H100; the Ampere ones follow the shapes FlashAttention-2 uses there and are untested.
_CONFIGS = {
    "sm90": {
        # 128 registers: four programs per SM instead of two; the near tiles' gather spills a few (8) registers
        "forward": {16: LaunchConfig(64, 64, 4, 3, 128), 32: LaunchConfig(64, 64, 4, 3, 128),
                    64: LaunchConfig(64, 64, 4, 3, 128), 128: LaunchConfig(64, 64, 4, 2),
                    256: LaunchConfig(64, 32, 4, 2)},
        "decode": {16: LaunchConfig(16, 64, 4, 4), 32: LaunchConfig(16, 64, 4, 4), 64: LaunchConfig(16, 64, 4, 4),
                   128: LaunchConfig(16, 64, 4, 4), 256: LaunchConfig(16, 32, 4, 3)},
        "dkdv": {16: LaunchConfig(64, 64, 4, 3), 32: LaunchConfig(64, 64, 4, 3), 64: LaunchConfig(64, 64, 4, 3),
                 128: LaunchConfig(64, 128, 8, 2), 256: LaunchConfig(32, 64, 4, 2)},
        "dq": {16: LaunchConfig(64, 64, 4, 3), 32: LaunchConfig(64, 64, 4, 3), 64: LaunchConfig(64, 64, 4, 3),
               128: LaunchConfig(128, 64, 8, 3), 256: LaunchConfig(64, 32, 4, 2)},
    },
    "sm80": {
        "forward": {16: LaunchConfig(128, 64, 4, 3), 32: LaunchConfig(128, 64, 4, 3), 64: LaunchConfig(128, 64, 4, 3),
                    128: LaunchConfig(128, 32, 8, 2), 256: LaunchConfig(64, 32, 4, 1)},
        "decode": {16: LaunchConfig(16, 128, 4, 3), 32: LaunchConfig(16, 128, 4, 3), 64: LaunchConfig(16, 128, 4, 3),
                   128: LaunchConfig(16, 64, 4, 3), 256: LaunchConfig(16, 32, 4, 2)},
        "dkdv": {16: LaunchConfig(32, 64, 4, 2), 32: LaunchConfig(32, 64, 4, 2), 64: LaunchConfig(64, 128, 8, 2),
                 128: LaunchConfig(64, 64, 8, 2), 256: LaunchConfig(16, 32, 4, 1)},
        "dq": {16: LaunchConfig(64, 64, 4, 2), 32: LaunchConfig(64, 64, 4, 2), 64: LaunchConfig(128, 64, 8, 2),
               128: LaunchConfig(128, 32, 8, 2), 256: LaunchConfig(32, 32, 4, 1)},
    },
}
# fp32 inputs use exact ("ieee") dot products: small tiles keep them in registers and shared memory
_FP32_CONFIG = LaunchConfig(32, 32, 4, 2)
_FP32_DECODE_CONFIG = LaunchConfig(16, 32, 4, 2)
# under TRITON_INTERPRET=1 small tiles keep the tests' tiny shapes multi-block (and the interpreter fast)
_INTERPRETER_CONFIG = LaunchConfig(16, 16, 1, 1)

# Tuning hook for benchmarks/attention.py: {"forward" | "decode" | "dkdv" | "dq": LaunchConfig} wins over the tables.
CONFIG_OVERRIDES: dict = {}
# The dk/dv kernel's unmasked near T5 tiles read their bias whole from a per-head bank of tiles (``_t5_bias_bank``)
# instead of gathering it per score where ``_dkdv_uses_t5_bias_bank`` allows; False gathers everywhere (the tests
# compare both paths, which give bitwise the same results).
T5_BIAS_BANK = True
# dq by fp32 atomics from the dk/dv kernel up to this head dim; above it (and under deterministic algorithms) dq has its
# own kernel: at head_dim 128 the extra product and accumulator in the dk/dv kernel cost more than the separate pass
# (H100, benchmarks/results/archive/attention_sweep.json).
FUSED_DQ_MAX_HEAD_DIM = 64


def padded_head_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def launch_config(kind: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    if kind in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES[kind]
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    if dtype == torch.float32:
        return _FP32_DECODE_CONFIG if kind == "decode" else _FP32_CONFIG
    return _CONFIGS[_architecture(device.index)][kind][head_dim]


@functools.cache
def _architecture(device_index) -> str:
    major, _ = torch.cuda.get_device_capability(device_index)
    return "sm90" if major >= 9 else "sm80"


def kernel_multiprocessors(device: torch.device) -> int:
    return multiprocessors(device, interpreter_count=4)


def launch_kwargs(config: LaunchConfig, device: torch.device) -> dict:
    kwargs = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.max_registers is not None:
        kwargs["maxnreg"] = config.max_registers
    return kwargs


def input_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"
