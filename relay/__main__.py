"""``python -m relay``: the same command line as ``dedup-relay``."""

from relay.cli.group import main

main()
