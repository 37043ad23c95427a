"""``flrun models``: the registered model builders with their parameter counts, answered from the bundled
builders' catalog (``fl_lightning/models/catalog.json``) without importing torch or building a model."""

from __future__ import annotations

from pathlib import Path

from .parsers import CommandParser

# the bundled builders' counts, written by `python -m fl_lightning.models.catalog` (read here without importing
# the models package, which imports torch)
MODEL_CATALOG = Path(__file__).resolve().parents[1] / "models" / "catalog.json"


def run_models(argv: list[str]) -> int:
    """Lists every registered builder in its paper configuration (its defaults): the bundled ones from their
    catalog (no torch import, no model built), installed entry points by name; ``--count`` builds them all."""
    import json

    parser = CommandParser(
        prog="flrun models",
        description="The registered model builders with their parameter counts.",
    )
    parser.add_argument("--json", action="store_true", help="print the list as JSON")
    parser.add_argument("--count", action="store_true", help="build every builder and count (installed ones too)")
    try:
        args = parser.parse_args(argv)  # an unknown option is refused, not ignored
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.count:
        from ..models import registered_models
        from ..models.catalog import count

        rows = count(registered_models())
    else:
        rows = json.loads(MODEL_CATALOG.read_text())
        rows += _installed_builders({row["name"] for row in rows})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<26} {'parameters':>12} {'trainable':>12} {'MiB':>9}  description")
    for row in rows:
        if row["parameters"] is None:  # an installed package's builder: counted when built
            print(f"{row['name']:<26} {'?':>12} {'?':>12} {'?':>9}  {row['doc']}")
            continue
        print(f"{row['name']:<26} {row['parameters']:>12,} {row['trainable']:>12,} {row['size_mb']:9.2f}  {row['doc']}")
    return 0


def _installed_builders(bundled: set[str]) -> list[dict]:
    """Builders installed packages declare (entry points), by name only: loading them imports their code."""
    from importlib.metadata import entry_points

    points = [p for p in entry_points(group="fl_lightning.models") if p.name not in bundled]
    return [
        {"name": p.name, "parameters": None, "trainable": None, "size_mb": None, "doc": f"from {p.value} (--count)"}
        for p in sorted(points, key=lambda p: p.name)
    ]
