"""The one exception type that the CLI turns into a one-line message and exit code 2."""


class UserFacingError(Exception):
    """An error caused by the user's input; the CLI prints its one-line message and exits with code 2."""
