import pytest

from fat5 import FAT5Config


def test_defaults_follow_t5():
    config = FAT5Config()
    assert (config.d_model, config.num_heads, config.d_kv, config.num_decoder_layers) == (512, 8, 64, 6)
    assert config.tie_word_embeddings and config.scale_decoder_outputs
    assert config.effective_attention_scale == 1.0
    assert config.hidden_size == 512 and config.num_attention_heads == 8


def test_v11_is_untied_and_unscaled_and_survives_a_round_trip(tmp_path):
    config = FAT5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_decoder_layers=3)
    assert config.is_gated_act and config.dense_act_fn == "gelu_new"
    config.save_pretrained(tmp_path)
    loaded = FAT5Config.from_pretrained(tmp_path)
    assert not loaded.tie_word_embeddings and not loaded.scale_decoder_outputs
    assert loaded.num_decoder_layers == 3


def test_attention_scale_none_means_inverse_sqrt_head_dim():
    assert FAT5Config(attention_scale=None, d_kv=16).effective_attention_scale == 0.25


@pytest.mark.parametrize(
    "field, value",
    [
        ("d_model", 0),
        ("num_heads", -1),
        ("d_kv", 2.5),
        ("feed_forward_proj", "gated-swirl"),
        ("feed_forward_proj", "fast-gelu-gated"),
        ("position_encoding", "sinusoidal"),
        ("attention_backend", "cuda"),
        ("relative_attention_num_buckets", 7),
        ("relative_attention_max_distance", 8),
        ("dropout_rate", 1.0),
        ("label_smoothing", -0.1),
        ("z_loss", -1e-4),
        ("attention_scale", 0),
        ("rope_theta", -1.0),
        ("fire_init_c", 0.0),
        ("fire_init_threshold", -512.0),
        ("tie_word_embeddings", "false"),
        ("scale_decoder_outputs", 1),
        ("position_bias_per_layer", "yes"),
        ("use_fused_cross_entropy", None),
        ("use_fused_rms_norm", "no"),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        FAT5Config(**{field: value})


def test_rope_needs_an_even_head_dim():
    with pytest.raises(ValueError, match="d_kv"):
        FAT5Config(position_encoding="rope", d_kv=33)
