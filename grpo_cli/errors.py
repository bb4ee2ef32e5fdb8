"""The one exception type that the CLI turns into a one-line message and exit code 2."""


class UserFacingError(Exception):
    """An error caused by the user's input; the CLI prints its one-line message and exits with code 2."""


class RunStopped(Exception):
    """A run that stopped early on purpose (a signal, diverging numbers) after saving its work.

    The CLI prints the one-line message and exits with `exit_code` (non-zero), without a traceback.
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
