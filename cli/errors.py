"""The CLI's error a user can fix."""

from __future__ import annotations


class CliError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""
