"""The one exception type for mistakes a user can make and fix, how its messages name the user's options (the
command line's flags, or the Python API's arguments), and what reading a damaged file raises."""

import contextlib
import contextvars
import importlib
import zipfile
from typing import Callable, Iterator, Mapping, Union

from tools.threads import wait_for_background_imports


class UserError(Exception):
    """Bad input from the user: the scripts print its message as one line and exit with code 2."""


# How a caller other than the command line names an option: the argument a flag becomes (written `name=value`
# with a value, as it is when it holds "="), or a function from the flag's value (None: none given) to the words.
Word = Union[str, Callable[[object], str]]
_WORDS: contextvars.ContextVar[Mapping[str, Word] | None] = contextvars.ContextVar("option_words", default=None)


def option(flag: str, value: object = None) -> str:
    """The option `flag` (given `value`) as the current caller sets it, for a message: `--flag value` on the
    command line; within `spoken_as(words)`, the caller's own words for it (tools.api's, for `benchmark()`)."""
    words = _WORDS.get()
    word = None if words is None else words.get(flag)
    if word is None:
        return flag if value is None else f"{flag} {value}"
    if callable(word):
        return word(value)
    return word if value is None or "=" in word else f"{word}={value!r}"


@contextlib.contextmanager
def spoken_as(words: Mapping[str, Word]) -> Iterator[None]:
    """Within the block (and the toolkit's worker threads it starts: tools.threads.ContextThreadPool), messages
    name options in `words` (a mapping from flag to `Word`)."""
    token = _WORDS.set(words)
    try:
        yield
    finally:
        _WORDS.reset(token)


# What numpy raises on a damaged .npy or .npz (missing, empty, truncated, not numpy's format): `np.load` gives
# EOFError for an empty file and zipfile.BadZipFile for a truncated .npz, neither an OSError nor a ValueError.
NUMPY_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile)


def first_line(exc: BaseException) -> str:
    """An exception's message in one line, for an `error:` line: its first non-empty line, else its type's name
    (an empty file makes torch.load raise a bare EOFError)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def optional_module(name: str, needed_by: str, pip_name: str, extra: str, called: str | None = None, also: str = ""):
    """An optional extra's module, imported when first needed; without it, one error line: what needs it (named
    `called`, default its pip name) and the command that installs it, then `also` (what else the user can do).

    Only the module itself missing reads "not installed"; any other failure (a dependency of it missing, a broken
    install) says the module is installed but failed to import, with the failure's first line. The model
    libraries imported in the background (tools.threads.import_in_background) are finished first, so that two
    threads never import them at once (Python would hand one a half-initialised module)."""
    wait_for_background_imports()
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or name != exc.name and not name.startswith(exc.name + "."):
            raise _broken(name, called or pip_name, exc) from exc
        raise UserError(f"{needed_by} needs {called or pip_name}, which is not installed; run `pip install {pip_name}` "
                        f"(or install this project with the [{extra}] extra){also}") from None
    except Exception as exc:  # noqa: BLE001 (an installed module's own failure, whatever it raises, is named)
        raise _broken(name, called or pip_name, exc) from exc


def _broken(name: str, what: str, exc: BaseException) -> UserError:
    return UserError(f"{what} is installed but failed to import ({name}): {first_line(exc)}; "
                     f"reinstall it, or run `python -c 'import {name}'` to see the whole error")
