"""Every method the package exports has its section in docs/algorithms.md: the page a user reads to learn where
a method follows its paper and where its official code."""

import inspect
import re

from conftest import ROOT

import fl_lightning.strategies as strategies
from fl_lightning.strategies.base import Strategy


def exported_methods():
    found = [getattr(strategies, name) for name in strategies.__all__]
    return [cls for cls in found if inspect.isclass(cls) and issubclass(cls, Strategy) and not inspect.isabstract(cls)]


def sections():
    """Each ``## `` heading of the page with the strategy files it names in backticks."""
    headings = re.findall(r"^## (.+)$", (ROOT / "docs" / "algorithms.md").read_text(), flags=re.MULTILINE)
    return {
        heading: {name.rsplit("/", 1)[-1] for name in re.findall(r"`([\w/]+\.py)`", heading)} for heading in headings
    }


def test_every_exported_method_has_a_section_naming_it_and_its_file():
    listed = sections()
    missing = []
    for cls in exported_methods():
        file = inspect.getfile(cls).rsplit("/", 1)[-1]
        if not any(file in files and cls.name in heading for heading, files in listed.items()):
            missing.append(f"{cls.name} ({file})")
    assert not missing, f"docs/algorithms.md lacks a '## <name> — `strategies/<file>.py`' section for {missing}"
    assert len(exported_methods()) >= 28


def test_the_check_reads_the_page_s_headings():
    listed = sections()
    assert listed["FedAvg (baseline) — `strategies/fedavg.py`"] == {"fedavg.py"}
    codist = next(files for heading, files in listed.items() if heading.startswith("PeriodicCodist and MergedCodist"))
    assert codist == {"periodic_codist.py", "merged_codist.py"}
