"""``flrun models``: the registered model builders with their parameter counts, answered from the bundled
builders' catalog (``fl_lightning/models/catalog.json``) without importing torch or building a model."""

from __future__ import annotations

from pathlib import Path

# the bundled builders' counts, written by `python -m fl_lightning.models.catalog` (read here without importing
# the models package, which imports torch)
MODEL_CATALOG = Path(__file__).resolve().parents[1] / "models" / "catalog.json"


def run_models(argv: list[str]) -> int:
    """Lists every registered builder in its paper configuration (its defaults): the bundled ones from their
    catalog (no torch import, no model built), installed entry points by name; ``--count`` builds them all."""
    import json

    if "--count" in argv:
        from ..models import registered_models
        from ..models.catalog import count

        rows = count(registered_models())
    else:
        rows = json.loads(MODEL_CATALOG.read_text())
        rows += _installed_builders({row["name"] for row in rows})
    if "--json" in argv:
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
