"""The error FAT5 raises for a user's mistake: the `fat5` command prints its message, without a traceback."""


class FAT5Error(Exception):
    """A problem with what the user asked for (a wrong path, config, checkpoint or argument)."""
