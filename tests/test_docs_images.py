"""The docs' pictures are made by one committed command, ``python docs/img/make_images.py``, and are what it
makes from today's report code and results.

``docs/img/images.json`` records, per picture, the SHA-256 of the PNG the command wrote, of the report code
that rendered it and of the results it shows. The default suite checks the first two (a picture replaced by
hand, or report code changed since the picture was made, fails); the slow suite reruns the picture's runs and
checks the third (report.png's runs are the tutorial's: tests/test_docs_pages.py checks them after running
the tutorial).
"""

import importlib.util
import json
import re

import pytest
from conftest import ROOT
from doc_blocks import commands, page_blocks

IMAGES = ROOT / "docs" / "img"
REMAKE = "run `python docs/img/make_images.py {name}` (it needs Chromium) and commit what it writes"


def maker():
    spec = importlib.util.spec_from_file_location("make_images", IMAGES / "make_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recorded() -> dict:
    return json.loads((IMAGES / "images.json").read_text())


def test_every_picture_in_the_docs_is_one_the_command_makes():
    shown = set()
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        shown |= set(re.findall(r"\]\((?:\.\./)*(?:docs/)?img/([\w.-]+)\)", page.read_text()))
    assert shown == set(maker().PICTURES) == {p.name for p in IMAGES.glob("*.png")} == set(recorded())


def test_each_picture_is_the_png_the_command_wrote():
    for name, record in recorded().items():
        assert maker().file_digest(IMAGES / name) == record["png_sha256"], (
            f"docs/img/{name} is not the picture make_images.py wrote; " + REMAKE.format(name=name)
        )


def test_each_picture_was_rendered_by_today_s_report_code():
    today = maker().sources_digest()
    for name, record in recorded().items():
        assert record["sources_sha256"] == today, (
            f"the report code (fl_lightning/report/) or make_images.py changed since docs/img/{name} was made; "
            + REMAKE.format(name=name)
        )


def test_the_report_picture_is_made_by_the_tutorial_s_commands():
    tutorial = page_blocks((ROOT / "docs/tutorial.md").read_text())
    shown = [words for block in tutorial if block.language == "bash" for words in commands(block.code)]
    for command in maker().TUTORIAL:
        assert command.split() in shown, f"docs/tutorial.md no longer runs {command!r}, which report.png shows"


def results_are_recorded(name: str, folder) -> None:
    """The results under ``folder`` (runs made by the picture's commands) are those the picture shows, as this
    CPU's kernels give them; where none are recorded for its kernels, the test ends here, skipped."""
    module = maker()
    roots, kernels = module.PICTURES[name][1], module.kernels()
    results = recorded()[name]["results_sha256"]
    if kernels not in results:
        pytest.skip(
            f"docs/img/images.json records {name}'s results for {', '.join(sorted(results))} kernels, not this "
            f"CPU's ({kernels}): `python docs/img/make_images.py --results_only {name}` adds them"
        )
    assert module.results_digest(folder, roots) == results[kernels], (
        f"the runs give other results than docs/img/{name} shows; " + REMAKE.format(name=name)
    )


@pytest.mark.slow
def test_the_table_picture_shows_today_s_results(tmp_path):
    module = maker()
    folder = module.clone_root(tmp_path)
    module.run_commands(module.PICTURES["report_table.png"][0], folder)
    results_are_recorded("report_table.png", folder)
