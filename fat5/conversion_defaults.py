"""The defaults of converting and bundling that `fat5 convert`, `export-hf` and `bundle` show in their ``--help``,
kept apart from `fat5.conversion` and `fat5.hub_upload` so that the help needs neither torch nor transformers."""

# the largest relative error of the converted model's logits (and hidden states) the verification accepts
DEFAULT_TOLERANCE = 1e-4
# safetensors shards above this size, as transformers' save_pretrained takes it
DEFAULT_MAX_SHARD_SIZE = "5GB"
