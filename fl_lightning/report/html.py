"""The reports' HTML pages, rendered from the Jinja2 templates in ``templates/`` with autoescape on: every
value a template shows is text, never markup, whichever file it came from (a run handed over by someone
else may hold ``<script>`` in any field)."""

from __future__ import annotations

import base64
from functools import cache
from pathlib import Path

from ..federation.files import atomic_write

TEMPLATES = Path(__file__).parent / "templates"


@cache
def environment():
    """The one template environment: autoescape on for every template, an undefined name an error."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,  # a misspelt field fails the report instead of showing nothing
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["base64"] = lambda data: base64.b64encode(data).decode()
    return env


def write_page(template: str, path: Path, **context) -> None:
    """Renders ``template`` with ``context`` into ``path``."""
    atomic_write(path, environment().get_template(template).render(**context) + "\n")
