"""The one exception type for mistakes a user can make and fix, and what reading a damaged file raises."""

import zipfile


class UserError(Exception):
    """Bad input from the user: the scripts print its message as one line and exit with code 2."""


# What numpy raises on a damaged .npy or .npz (missing, empty, truncated, not numpy's format): `np.load` gives
# EOFError for an empty file and zipfile.BadZipFile for a truncated .npz, neither an OSError nor a ValueError.
NUMPY_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile)
