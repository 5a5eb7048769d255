"""The console's refusal of a request (:class:`ConsoleError`): a status and a sentence."""

from __future__ import annotations


class ConsoleError(Exception):
    """A request the console refuses: ``status`` (an HTTP status) and a sentence for the
    page."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
