"""The command line (click): the ``dedup-relay`` group, ``serve`` and the admin commands.

The only package that imports click.
"""
