"""`python -m durable_rlm.cli`: the `drlm` command, where the console script is not installed."""

from durable_rlm.cli import main

main()
