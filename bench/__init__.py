"""The relay benchmark: ``python -m bench.run`` (see bench/README.md)."""
