"""What the verifiers bridge's modules share: where a record's dataset row is kept, its error, and a
message as a plain dict."""

from __future__ import annotations

from rlsys.errors import UserError

ROW_KEY = "verifiers_row"  # a record's metadata: (split, index) of its dataset row


class VerifiersTaskError(UserError):
    """task.verifiers cannot be loaded or used; the message says what to change."""


def plain_message(message) -> dict:
    """A message as a JSON-able dict (a dataset row's, or a vf.Message the environment returned)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    return {key: value for key, value in dict(message).items() if value is not None}
