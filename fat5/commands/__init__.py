"""The `fat5` subcommands, one module per area: each ``add_*_command(s)(subparsers)`` registers its options and sets
``func(args) -> int``, the handler that calls the area's Python API and prints what it did. `fat5.cli` assembles them.
"""
