"""Self-contained Hub folders for FAT5 models (flattened remote code, `auto_map`, model card) and pushing them.

Python: `bundle(model_dir, out, ...)`, `push(folder, repo_id, ...)`, `validate_bundle(folder)`. Command line:
`fat5 bundle` and `fat5 push` (`fat5.commands.hub`).
"""

from .bundle import BundleError, BundleResult, bundle, flatten_remote_code, validate_bundle
from .model_card import build_model_card
from .push import PushError, push

__all__ = [
    "BundleError",
    "BundleResult",
    "PushError",
    "build_model_card",
    "bundle",
    "flatten_remote_code",
    "push",
    "validate_bundle",
]
