"""The one exception type for mistakes a user can make and fix, and what reading a damaged file raises."""

import zipfile


class UserError(Exception):
    """Bad input from the user: the scripts print its message as one line and exit with code 2."""


# What numpy raises on a damaged .npy or .npz (missing, empty, truncated, not numpy's format): `np.load` gives
# EOFError for an empty file and zipfile.BadZipFile for a truncated .npz, neither an OSError nor a ValueError.
NUMPY_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile)


def first_line(exc: BaseException) -> str:
    """An exception's message in one line, for an `error:` line: its first non-empty line, else its type's name
    (an empty file makes torch.load raise a bare EOFError)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
