"""``dedup-relay example config|dashboard|alerts|systemd``: the operator files that travel with the
package, printed to stdout byte for byte as the repository holds them: the example settings
(config/dedup-relay.example.toml), the Grafana dashboard, the Prometheus alert rules and the
systemd unit. An installed relay needs no checkout to start from them::

    dedup-relay example config > /etc/dedup-relay/relay.toml
"""

from __future__ import annotations

import sys
from importlib import resources

import click

# what each name prints: a file of the package's operator_files/ (links to the repository's
# files in a checkout; copies of them in a wheel or an sdist)
EXAMPLES = {
    "config": "config.toml",
    "dashboard": "dashboard.json",
    "alerts": "alerts.yml",
    "systemd": "systemd.service",
}


def example_bytes(name: str) -> bytes:
    """The bytes of the operator file ``name`` (a key of :data:`EXAMPLES`). Raises KeyError for
    an unknown name, OSError when the package lacks the file."""
    return resources.files("relay").joinpath("operator_files", EXAMPLES[name]).read_bytes()


def register(main: click.Group) -> None:
    """Add ``example`` to the ``dedup-relay`` group."""

    @main.command(epilog="config: every setting with an example value; dashboard: Grafana JSON; "
                         "alerts: Prometheus rules; systemd: the hardened unit.")
    @click.argument("name", type=click.Choice(list(EXAMPLES)))
    def example(name: str) -> None:
        """Print an operator file that ships with the relay (NAME: config, dashboard, alerts or
        systemd) to stdout, as the repository holds it."""
        sys.stdout.buffer.write(example_bytes(name))
        sys.stdout.buffer.flush()
