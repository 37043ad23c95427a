"""The bundled builders in their paper configurations (their defaults): name, parameter counts and the first
line of their docstring, kept in ``catalog.json`` beside this file. ``flrun models`` prints that file, so it
answers without importing torch or building any model; ``flrun models --count`` builds every builder instead
(installed entry points included).

    python -m fl_lightning.models.catalog            # rewrite catalog.json from the builders
    python -m fl_lightning.models.catalog --check    # exit 1 when it differs from them (tests/test_cli.py)
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

from ..federation.files import atomic_write

CATALOG = Path(__file__).with_name("catalog.json")


def count(builders: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per builder: built with its defaults (pretrained ones without loading their weights)."""
    rows = []
    for name, builder in builders.items():
        random_init = {"random_init": True} if "random_init" in inspect.signature(builder).parameters else {}
        model = builder(**random_init)
        params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        doc = (builder.__doc__ or "").strip().splitlines()[0]
        rows.append(
            {"name": name, "parameters": params, "trainable": trainable, "size_mb": params * 4 / 2**20, "doc": doc}
        )
    return rows


def bundled() -> list[dict[str, Any]]:
    """The rows of this package's own builders (not installed entry points)."""
    from .registry import _BUILDERS, import_bundled

    import_bundled()
    own = {name: fn for name, fn in sorted(_BUILDERS.items()) if fn.__module__.startswith("fl_lightning.")}
    return count(own)


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):  # an unknown option would rewrite the catalog instead of checking it
        sys.stderr.write("usage: python -m fl_lightning.models.catalog [--check]\n")
        return 2
    fresh = json.dumps(bundled(), indent=1) + "\n"
    if "--check" in argv:
        if CATALOG.read_text() != fresh:
            sys.stderr.write(f"{CATALOG} is out of date: run `python -m fl_lightning.models.catalog`.\n")
            return 1
        return 0
    atomic_write(CATALOG, fresh)
    sys.stdout.write(f"wrote {CATALOG}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
