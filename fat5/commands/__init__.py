"""The `fat5` subcommands, one module per area. The console entry, `fat5_command`, lists them with their help lines
and creates each one's parser; the function it names here (``configure_<command>(parser)``) adds the options and
sets ``func(args) -> int``, the handler that calls the area's Python API and prints what it did.
"""
