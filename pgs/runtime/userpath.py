"""What a path a user gave (a spec, a data file, a model or tokenizer folder) must be before
anything opens it, said in one line.

A path that is not a regular file where a file is read would fail late and badly: ``/dev/zero``
is read forever, a FIFO blocks the reader until someone writes into it (forever), a loop of
symbolic links or a NUL byte raise a raw ``OSError`` / ``ValueError``.  :func:`problem` finds
each with one ``stat`` (which follows links) and names it; the callers (``read_toml``, the
spec's path fields) raise it as their own error with the field or the file in front.
"""

from __future__ import annotations

import errno
import os
import stat

#: the kinds of file a spec or data path must not name, by ``stat`` type
SPECIAL = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
           (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
MISSING = "missing"
FOLDER = "a folder"
FILE = "a file"


def problem(path: str | os.PathLike, kind: str = "file", folder_ok: bool = False) -> str | None:
    """Why ``path`` cannot be read as a ``kind`` (``"file"``: a regular file, or with ``folder_ok``
    a folder; ``"folder"``), or None when it can.  ``MISSING``, ``FOLDER`` and ``FILE`` are
    returned as such, for the caller's own wording; anything else is a phrase ("a FIFO (named
    pipe)", "a loop of symbolic links", "not readable (permission denied)", ...)."""
    text = os.fspath(path)
    if "\0" in text:
        return "a path with a NUL byte in it"
    try:
        info = os.stat(text)
    except FileNotFoundError:
        return MISSING
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "a loop of symbolic links"
        if err.errno == errno.EACCES:
            return "not reachable (permission denied on a folder above it)"
        if err.errno == errno.ENOTDIR:
            return MISSING
        return f"not readable ({err.strerror or err})"
    if stat.S_ISDIR(info.st_mode):
        if kind == "file" and not folder_ok:
            return FOLDER
        if not os.access(text, os.R_OK | os.X_OK):
            return "a folder that cannot be read (permission denied)"
        return None
    if kind == "folder":
        return FILE
    for test, name in SPECIAL:
        if test(info.st_mode):
            return f"{name}, not a regular file"
    if not os.access(text, os.R_OK):
        return "not readable (permission denied)"
    return None
