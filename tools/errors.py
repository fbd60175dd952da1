"""The one exception type for mistakes a user can make and fix."""


class UserError(Exception):
    """Bad input from the user: the scripts print its message as one line and exit with code 2."""
