"""Every exception a library raises while loading a user's model or tokenizer, mapped in one place.

transformers, tokenizers, safetensors, gguf, llama.cpp, torch and lm-eval each fail on a bad file
in their own way: a config.json field of the wrong type (a validation error of a strict
dataclass), a tokenizer file that is not one (tokenizers' plain `Exception`), a truncated
safetensors (`SafetensorError`), a GGUF whose header lies (`ValueError`, `struct.error`,
`IndexError`), an unknown `dtype=` (`AttributeError` from `getattr(torch, ...)`), a model type
whose optional packages are missing (`ImportError`), a model class given an argument it does not
take (`TypeError`). `loading(what, path)` wraps a load and turns each into one `BadInput` line
naming what was loaded, the path and the library's own first line, so the CLI exits 2 with no
traceback (`--debug` still shows the chained one).

What passes unchanged: evalkit's own errors (already one line), running out of memory (a
`MemoryError` or torch's `OutOfMemoryError`: not the file's fault, exit 1 as an internal error
names it), and a KeyboardInterrupt. Used by `engines.resolve.load` (every engine's model load,
the tokenizers the engines load inside it included), the hf resolver's config read, the
converted-model cache's conversion, the needle task's tokenizer and the sweep's config read.
Does not: decide whether a file is fit (the engines' resolvers and `paths.check_input_path` do).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from evalkit.errors import BadInput, EvalkitError

MAX_REASON = 240  # characters of the library's message kept in the one line
_PASS = ("OutOfMemoryError",)  # torch.OutOfMemoryError (a RuntimeError): memory, not the file


def reason(exc: BaseException) -> str:
    """The library's own message on one line, with its type: `ValueError: ...`, at most MAX_REASON characters.

    >>> reason(ValueError("bad field:\\n  not an int"))
    'ValueError: bad field: not an int'
    """
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = text if len(text) <= MAX_REASON else text[: MAX_REASON - 1] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextlib.contextmanager
def loading(what: str, path: str | os.PathLike | None = None) -> Iterator[None]:
    """Run a load of `what` (at `path`, when it is a local file or folder); any exception a
    library raises is one BadInput line naming both (see the module docstring for what passes).

    >>> with loading("tokenizer", "/m"):
    ...     raise Exception("data did not match any variant of untagged enum ModelWrapper")
    Traceback (most recent call last):
    ...
    evalkit.errors.BadInput: cannot load the tokenizer /m: Exception: data did not match any variant of untagged enum ModelWrapper
    """
    where = f"the {what} {path}" if path is not None else f"the {what}"
    try:
        yield
    except EvalkitError:
        raise
    except ImportError as exc:
        missing = f" ({exc.name})" if getattr(exc, "name", None) else ""
        raise BadInput(f"cannot load {where}: it needs a package that is not installed{missing}: "
                       f"{reason(exc)}") from exc
    except Exception as exc:
        if isinstance(exc, MemoryError) or type(exc).__name__ in _PASS:
            raise
        raise BadInput(f"cannot load {where}: {reason(exc)}") from exc
