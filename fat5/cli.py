"""`python -m fat5.cli COMMAND ...`: the `fat5` command run as a module, as `accelerate launch -m fat5.cli` starts
it on every process. The command itself (its table, parser and error handling) is the console entry,
`fat5_command`, which stays importable without torch."""

import sys

from fat5_command import main

if __name__ == "__main__":
    sys.exit(main())
