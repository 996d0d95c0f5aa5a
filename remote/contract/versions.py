"""The library versions the worker runs on: the range it accepts and the releases CI tests.
Stdlib only: the worker's pre-flight refuses a host outside the range, and ``hosts check`` (the
orchestrator) says whether a host's version is one CI tests.

Why a range at all: decoding depends on transformers' cache API (the cache keyword, the layout of
linear-attention layers; :mod:`remote.target.cache`), which changes between minor releases.
Below 5.14 the hybrid (Gated DeltaNet) cache this worker rolls back is missing or different;
6.x is unreleased. Inside the range, pre-flight also runs :func:`remote.target.cache.self_test`
on the host's own installation, so an untested release is checked before it is trusted.
"""
from __future__ import annotations

import re

TRANSFORMERS_MIN = "5.14"        # inclusive
TRANSFORMERS_BELOW = "6"         # exclusive
# CI runs the whole suite on the first (the constraints file .ci/constraints.txt pins it) and the
# hybrid-decoding tests on the second, the oldest release accepted (.ci/run's second pass).
TRANSFORMERS_TESTED = ("5.25.0", "5.14.1")


def parse(version: str) -> tuple[int, ...]:
    """``"5.25.0"`` -> ``(5, 25, 0)``; pre-release and local parts (``rc1``, ``+cpu``) are dropped."""
    parts = []
    for piece in str(version).split("+")[0].split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
    return tuple(parts)


def installed_versions(distributions) -> dict[str, str | None]:
    """``{distribution: version}`` of those installed for this interpreter (package metadata, no
    import); None for one that is not installed."""
    from importlib import metadata

    out = {}
    for dist in distributions:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def transformers_range() -> str:
    return f">={TRANSFORMERS_MIN},<{TRANSFORMERS_BELOW}"


def transformers_problem(version: str | None) -> str | None:
    """Why the worker refuses this installed transformers version, or None when it is in range."""
    if not version:
        return "transformers is not installed"
    if not parse(TRANSFORMERS_MIN) <= parse(version) < parse(TRANSFORMERS_BELOW):
        return (f"transformers {version} is outside the range the worker supports ({transformers_range()}; "
                f"tested: {', '.join(TRANSFORMERS_TESTED)})")
    return None


def transformers_status(version: str | None) -> str:
    """``tested``, ``untested`` (in range: pre-flight's self-test decides) or ``unsupported``."""
    if transformers_problem(version):
        return "unsupported"
    return "tested" if parse(version) in {parse(v) for v in TRANSFORMERS_TESTED} else "untested"
