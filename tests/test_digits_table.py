"""benchmarks/digits_table.py: writes a paper's digits table between its markers, and --check re-runs rows."""

import importlib.util
import re

import pytest
import torch
from conftest import ROOT

BLOCK = "<!-- digits-table paper-002/table-1: seeds 0 1 2; rounds recipe -->\nnot yet\n<!-- end of digits-table -->"


@pytest.fixture(scope="module")
def digits_table():
    spec = importlib.util.spec_from_file_location("digits_table", ROOT / "benchmarks/digits_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def written(digits_table, tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs") / "algorithms.md"
    docs.write_text(f"intro\n\n{BLOCK}\n\noutro\n")
    assert (
        digits_table.main(["--write", "--tables", "paper-002", "--rounds", "1", "--seeds", "0", "--docs", str(docs)])
        == 0
    )
    return docs


def _row(text, label):
    return next(line for line in text.splitlines() if line.startswith(f"| {label} |"))


def test_write_fills_the_block_with_one_row_per_method_and_records_seeds_and_rounds(written, tmp_path):
    from fl_lightning.cli.commands import fit_from_argv

    text = written.read_text()
    kernels = torch.backends.cpu.get_cpu_capability()  # the CPU kernels' vector instructions, recorded
    assert text.startswith(f"intro\n\n<!-- digits-table paper-002/table-1: seeds 0; rounds 1; kernels {kernels} -->\n")
    assert text.endswith("<!-- end of digits-table -->\n\noutro\n") and "not yet" not in text
    # the FedAdam row holds the values of the same run made directly
    summary = fit_from_argv(
        ["--config", str(ROOT / "recipes/digits_fedadam.yaml"), "--seed", "0", "--rounds", "1"]
        + ["--eval_every", "1", "--output_dir", str(tmp_path / "run"), "--runtime.progress", "false"]
    )
    large, small = summary["final"]["large/test_acc"], summary["final"]["small/test_acc"]
    assert _row(text, "FedAdam") == (
        f"| FedAdam | `digits_fedadam` | {large:.3f} ({large:.3f}) | {small:.3f} ({small:.3f}) |"
    )
    assert _row(text, "MergedCodist").startswith("| MergedCodist | `digits_merged_codist` | ")


def test_ranking_line_follows_the_written_means(written):
    text = written.read_text()
    means = {}
    for label in ("FedAdam", "MergedCodist", "PeriodicCodist"):
        cells = _row(text, label).split(" | ")[2:]
        means[label] = [float(re.match(r"([\d.]+)", c).group(1)) for c in cells]
    parts = []
    for i, metric in enumerate(("large/test_acc", "small/test_acc")):
        rivals = [m for m in ("FedAdam", "MergedCodist") if means[m][i] >= means["PeriodicCodist"][i]]
        verdict = "holds" if not rivals else f"fails ({', '.join(rivals)} as high or higher)"
        parts.append(f"PeriodicCodist above every other row ({metric}): {verdict}")
    assert f"Ranking (means over seeds): {'; '.join(parts)}." in text


def test_check_passes_on_the_written_rows_and_fails_on_a_changed_value(digits_table, written, tmp_path, capsys):
    assert digits_table.main(["--check", "--rows", "FedAdam", "--docs", str(written)]) == 0
    assert "1 of 1 rows reproduce." in capsys.readouterr().err
    changed = tmp_path / "changed.md"
    row = _row(written.read_text(), "FedAdam")
    value = row.split(" | ")[2].split(" ")[0]
    wrong = f"{float(value) + 0.001:.3f}"
    changed.write_text(written.read_text().replace(row, row.replace(value, wrong, 1)))
    assert digits_table.main(["--check", "--rows", "FedAdam", "--docs", str(changed)]) == 1
    err = capsys.readouterr().err
    assert "paper-002/table-1 FedAdam:" in err and f"docs:  | FedAdam | `digits_fedadam` | {wrong}" in err


def test_write_rows_remeasures_the_named_rows_only_and_redoes_the_ranking(digits_table, written, tmp_path):
    changed = tmp_path / "rows.md"
    text = written.read_text()
    fedadam, merged = _row(text, "FedAdam"), _row(text, "MergedCodist")
    # the docs claim FedAdam at 0.999 on both columns: the ranking line says PeriodicCodist fails
    fake = "| FedAdam | `digits_fedadam` | 0.999 (0.999) | 0.999 (0.999) |"
    stale = text.replace(fedadam, fake)
    stale = re.sub(r"Ranking \(means over seeds\): .*\.", "Ranking (means over seeds): stale.", stale)
    changed.write_text(stale)
    assert digits_table.main(["--write", "--rows", "FedAdam", "--docs", str(changed)]) == 0
    after = changed.read_text()
    assert _row(after, "FedAdam") == fedadam and _row(after, "MergedCodist") == merged  # re-measured; untouched
    ranking = next(line for line in text.splitlines() if line.startswith("Ranking"))
    assert ranking in after and "stale" not in after  # as --write wrote it from the same rows
    assert digits_table.main(["--write", "--rows", "no such row", "--docs", str(changed)]) == 1


def test_a_block_of_other_kernels_is_neither_checked_nor_extended_here(digits_table, written, tmp_path, capsys):
    """A block measured with other CPU kernels (AVX2 here on AVX-512, or the other way) gives other last digits
    by design: --check says so and exits 2 instead of failing every row, --write --rows leaves the block."""
    other = "AVX2" if digits_table.kernels() != "AVX2" else "AVX512"
    marker = next(line for line in written.read_text().splitlines() if line.startswith("<!-- digits-table"))
    assert marker.endswith(f"; kernels {digits_table.kernels()} -->")  # --write recorded this CPU's
    elsewhere = tmp_path / "elsewhere.md"
    text = written.read_text().replace(marker, marker.replace(digits_table.kernels(), other))
    elsewhere.write_text(text)
    assert digits_table.main(["--check", "--rows", "FedAdam", "--docs", str(elsewhere)]) == 2
    err = capsys.readouterr().err
    assert f"paper-002/table-1 was measured with {other} kernels and this CPU's PyTorch kernels are" in err
    assert digits_table.main(["--write", "--rows", "FedAdam", "--docs", str(elsewhere)]) == 1  # no row written
    assert elsewhere.read_text() == text and "--write --tables paper-002/table-1" in capsys.readouterr().err


def test_check_without_a_generated_row_fails_and_write_needs_the_markers(digits_table, tmp_path, capsys):
    docs = tmp_path / "algorithms.md"
    docs.write_text(f"{BLOCK}\n")
    assert digits_table.main(["--check", "--docs", str(docs)]) == 1
    assert "run --write first" in capsys.readouterr().err
    docs.write_text("no markers\n")
    with pytest.raises(SystemExit, match="has no block for paper-002/table-1"):
        digits_table.main(["--write", "--tables", "paper-002", "--rounds", "1", "--seeds", "0", "--docs", str(docs)])


def test_a_method_with_no_digits_recipe_of_the_set_up_runs_as_a_variant_of_it(digits_table):
    """paper 004's FD row is digits_fedgh with FD swapped in: the run is FD's, on FedGH's clients."""
    _, recipe, overrides, _ = next(r for r in digits_table.TABLES["paper-004/table-3"][2] if r[0] == "FD")
    assert recipe == "digits_fedgh" and set(overrides) == {"strategy"}
    summary, derived = digits_table.run_once(recipe, overrides, seed=0, rounds=1)
    assert "personal/test_acc" in summary["final"]
    # FD's traffic, not FedGH's: in round 1 each client's 2 labels' logits and labels up, no teacher yet down
    assert derived[digits_table.KIB] == pytest.approx(2 * 11 * 4 / 1024)


def test_the_htfllib_table_adds_a_method_in_one_line_with_its_cost_columns(digits_table, monkeypatch):
    """A row is one line; a method not built yet is listed, not run; the cost columns are per client and round."""
    title, columns, rows = digits_table.TABLES["htfllib/suite"]
    assert columns == ["personal/test_acc", digits_table.KIB, digits_table.GFLOPS]
    local = next(r for r in rows if r[0] == "Local")
    unbuilt = ("FedX", "digits_fedx", None, columns)
    monkeypatch.setitem(digits_table.TABLES, "htfllib/suite", (title, columns, [local, unbuilt]))
    text = digits_table.comparison_table("htfllib/suite", seeds=[0], rounds=1)
    summary, _ = digits_table.run_once(local[1], local[2], seed=0, rounds=1)
    gflops = summary["compute"]["train_flops"] / 15 / 1e9  # one round, all 15 clients of digits_fedgh
    assert summary["compute"]["train_flops"] > 0
    acc = summary["final"]["personal/test_acc"]
    assert _row(text, "Local") == (
        f"| Local | `digits_fedgh` with its strategy changed | {acc:.3f} ({acc:.3f}) | 0.00 (0.00) "  # sends nothing
        f"| {gflops:.3f} ({gflops:.3f}) |"
    )
    assert "Not yet implemented: FedX." in text and "Ranking: not enough rows measured." in text


def test_write_rows_adds_a_new_recipes_row_to_the_every_recipe_block_in_name_order(digits_table, tmp_path):
    docs = tmp_path / "algorithms.md"
    header = "| recipe | metric | final: mean ± std (per seed) | other accuracies (mean) |\n|---|---|---|---|"
    kept = ["| quickstart | global/test_acc | 0.5 (0.5) |  |", "| digits_fedgh | personal/test_acc | 0.5 (0.5) |  |"]
    docs.write_text(
        f"<!-- digits-table all-digits-recipes: seeds 0; rounds 1; kernels {digits_table.kernels()} -->\n"
        "Every digits recipe:\n\n"
        f"{header}\n{kept[0]}\n{kept[1]}\n<!-- end of digits-table -->\n"
    )
    assert digits_table.main(["--write", "--tables", "all-digits", "--rows", "digits_fd", "--docs", str(docs)]) == 0
    rows = [line for line in docs.read_text().splitlines() if line.startswith("| ") and "| metric |" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| quickstart", "| digits_fd", "| digits_fedgh"]
    assert rows[0] == kept[0] and rows[2] == kept[1]  # the rows not named are not re-measured
    assert rows[1] == digits_table.recipe_row("digits_fd", [0], 1)  # measured as --write measures it
