"""The `dlbatch` commands: `main` (argument parsing, error handling) and one module per
group of commands (`jobs`: run/status/compact, `cluster`: submit/logs/stop with its
`preflight`, `solver`: plan/simulate/profile). Heavy imports stay inside the command
functions so that `dlbatch --help` answers at once."""
from dlbatch.cli.main import EXIT_FAILED, EXIT_INVALID, EXIT_OK, build_parser, entry, main

__all__ = ["EXIT_FAILED", "EXIT_INVALID", "EXIT_OK", "build_parser", "entry", "main"]
