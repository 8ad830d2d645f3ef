"""benchmarks/gemm.py's list of a training step's products, against the linear layers of a FAT5 model."""

import pytest
import torch
from helpers import benchmark_module


@pytest.fixture(scope="module")
def gemm_benchmark():
    return benchmark_module("gemm")


def test_step_products_cover_every_linear_layer_three_times(gemm_benchmark):
    from fat5 import FAT5Config, FAT5ForConditionalGeneration

    shape = {"d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2, "num_decoder_layers": 3, "num_heads": 4}
    model = FAT5ForConditionalGeneration(FAT5Config(**shape, vocab_size=96, feed_forward_proj="gated-gelu",
                                                    tie_word_embeddings=False))
    rows, encoder_width, decoder_width = 3, 40, 24
    encoder, decoder = rows * encoder_width, rows * decoder_width
    expected = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            # the cross-attention's keys and values project the encoder's output
            on_encoder = name.startswith("encoder.") or ".EncDecAttention.k" in name or ".EncDecAttention.v" in name
            expected += 6 * module.weight.numel() * (encoder if on_encoder else decoder)
    products = gemm_benchmark.step_products(shape, 96, rows, encoder_width, decoder_width)
    assert sum(2 * m * k * n * count for (m, k, n), count in products.items()) == expected
