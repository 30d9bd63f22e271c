"""`python -m dlbatch.cli ...`: the `dlbatch` command (what `dlbatch submit` runs on a cluster)."""
from dlbatch.cli.main import entry

entry()
