"""Why ``torch.load`` refused a file, in one sentence.

``torch.load(weights_only=True)`` wraps its reason between advice to load the file with code execution allowed
(which is not ours to give for a file we refuse) and a pointer to its documentation; for a hostile pickle the
reason is the global it would not build. :func:`load_failure` keeps the reason alone.
"""

from __future__ import annotations

import re

# The name torch's weights-only unpickler quotes when it refuses a global ("... GLOBAL posix.system whose module
# posix is blocked", "Unsupported global: GLOBAL __main__.Thing was not an allowed global by default").
REFUSED_GLOBAL = re.compile(r"\bGLOBAL (\S+?)\.?(?:\s|$)")
WRAPPER = "Weights only load failed."
DOCS = "Check the documentation of torch.load"


def load_failure(err: BaseException) -> str:
    """The reason in ``err`` (raised by ``torch.load``) as one sentence without torch's advice."""
    text = str(err)
    named = REFUSED_GLOBAL.search(text)
    if named:
        return f"it names {named.group(1)}, which is code rather than data; torch.load (weights_only) does not run it"
    if text.startswith(WRAPPER):  # the reason is the paragraph before torch's pointer to its documentation
        paragraphs = [" ".join(p.split()) for p in text.split(DOCS)[0].split("\n\n")]
        reasons = [p for p in paragraphs if p and not p.startswith(WRAPPER)]
        text = reasons[-1] if reasons else text.removeprefix(WRAPPER)
    first = " ".join(re.split(r"\.\s|\n", text.strip())[0].split()).rstrip(".")  # what failed; the rest: why it may
    return first if " " in first else f"{type(err).__name__} {first}".strip()  # a bare KeyError's key, EOFError's ''
