"""T5-family checkpoints <-> FAT5, verified numerically against transformers' own classes.

Python: `convert(src, out, ...)` and `export_hf(fat5_dir, out, ...)`. Command line: `fat5 convert` and
`fat5 export-hf` (`fat5.commands.convert`).
"""

from ..output_folder import atomic_directory
from .checkpoint import ConversionError
from .convert import ConversionResult, convert, export_hf, map_state_dict

__all__ = [
    "ConversionError",
    "ConversionResult",
    "atomic_directory",
    "convert",
    "export_hf",
    "map_state_dict",
]
