"""The relay benchmark of issue 10: ``python -m bench.run`` (see bench/README.md)."""
