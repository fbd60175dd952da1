"""The one exception type for mistakes a user can make and fix, how its messages name the user's options (the
command line's flags, or the Python API's arguments), and what reading a damaged file raises."""

import contextlib
import contextvars
import importlib
import importlib.metadata
import re
import zipfile
from collections.abc import Callable, Iterator, Mapping

from tools.threads import wait_for_background_imports


class UserError(Exception):
    """Bad input from the user: the scripts print its message as one line and exit with code 2."""


# How a caller other than the command line names an option: the argument a flag becomes (written `name=value`
# with a value, as it is when it holds "="), or a function from the flag's value (None: none given) to the words.
Word = str | Callable[[object], str]
_WORDS: contextvars.ContextVar[Mapping[str, Word] | None] = contextvars.ContextVar("option_words", default=None)


def option(flag: str, value: object = None) -> str:
    """The option `flag` (given `value`) for a message: `--flag value`, or within `spoken_as` the caller's words."""
    words = _WORDS.get()
    word = None if words is None else words.get(flag)
    if word is None:
        return flag if value is None else f"{flag} {value}"
    if callable(word):
        return word(value)
    return word if value is None or "=" in word else f"{word}={value!r}"


@contextlib.contextmanager
def spoken_as(words: Mapping[str, Word]) -> Iterator[None]:
    """Within the block (and its ContextThreadPool workers), messages name options in `words` (flag -> `Word`)."""
    token = _WORDS.set(words)
    try:
        yield
    finally:
        _WORDS.reset(token)


# What numpy raises on a damaged .npy or .npz (missing, empty, truncated, not numpy's format): `np.load` gives
# EOFError for an empty file and zipfile.BadZipFile for a truncated .npz, neither an OSError nor a ValueError.
NUMPY_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile)


def first_line(exc: BaseException) -> str:
    """An exception's first non-empty line, else its type's name (torch.load's bare EOFError on an empty file)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def key_list(keys, limit: int = 8, separator: str = ", ") -> str:
    """Names for an error line: the first `limit`, and how many more (a message never lists thousands of keys)."""
    keys = [str(key) for key in keys]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return separator.join(keys[:limit]) + more


def error_summary(exc: BaseException, lines: int = 2, limit: int = 300) -> str:
    """A library's error in one short line: its type and first `lines` lines, cut at `limit` characters."""
    text = " ".join([line.strip() for line in str(exc).splitlines() if line.strip()][:lines]) or "no message"
    return f"{type(exc).__name__}: {text if len(text) <= limit else text[:limit - 3] + '...'}"


def optional_module(name: str, needed_by: str, pip_name: str, extra: str, called: str | None = None, also: str = ""):
    """An optional extra's module, imported when first needed (after the background imports); missing, one error
    line naming what needs it and how to install it. Only the module itself missing reads "not installed"."""
    wait_for_background_imports()
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or name != exc.name and not name.startswith(exc.name + "."):
            raise _broken(name, called or pip_name, exc) from exc
        raise UserError(f"{needed_by} needs {called or pip_name}, which is not installed; run `pip install {pip_name}` "
                        f"(or install this project with the [{extra}] extra){also}") from None
    except Exception as exc:
        raise mismatched_torchvision(exc) or _broken(name, called or pip_name, exc) from exc


# What importing (or first using) a torchvision built for another torch release raises: its compiled operators
# do not register ("operator torchvision::nms does not exist" from `import torchvision`), or its ops refuse.
TORCHVISION_MISMATCH = re.compile(r"operator torchvision::\w+ does not exist|PyTorch and torchvision versions are "
                                  r"incompatible")


def mismatched_torchvision(exc: BaseException) -> UserError | None:
    """One line for a torchvision that does not match the installed torch; None for any other error."""
    if not TORCHVISION_MISMATCH.search(str(exc)):
        return None
    versions = {}
    for package in ("torch", "torchvision"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "(version unknown)"
    return UserError(f"torchvision {versions['torchvision']} does not match torch {versions['torch']} "
                     f"({first_line(exc)}): torch and torchvision are built for each other and must be installed as "
                     f"a pair; run `pip install --upgrade torch torchvision` (the two together), or install the "
                     f"torchvision release made for torch {versions['torch']} (https://github.com/pytorch/vision"
                     f"#installation)")


def import_torchvision(name: str = "torchvision"):
    """torchvision (or its module `name`), imported where first needed; one that does not match torch is one line."""
    wait_for_background_imports()
    try:
        return importlib.import_module(name)
    except Exception as exc:
        mismatch = mismatched_torchvision(exc)
        if mismatch is None:
            raise
        raise mismatch from None


def _broken(name: str, what: str, exc: BaseException) -> UserError:
    return UserError(f"{what} is installed but failed to import ({name}): {first_line(exc)}; "
                     f"reinstall it, or run `python -c 'import {name}'` to see the whole error")
