"""FAT5's kernels inside other libraries' models. ``transformers_t5``: transformers' own T5, mT5 and UMT5.

Not remote code: these modules are never shipped with a model, and no remote-code file imports them.
"""
