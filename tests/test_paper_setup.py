"""benchmarks/paper_setup.py: the papers' set-up numbers each recipe states, measured and compared."""

import importlib.util
import os
import re
import sys

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def paper_setup():
    spec = importlib.util.spec_from_file_location("paper_setup", ROOT / "benchmarks/paper_setup.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_printed_number_matches_within_one_unit_of_its_last_digit(paper_setup):
    value = paper_setup.Value.parse
    assert value(0.16).holds(0.1640625, exact=False) and value(0.16).holds(0.150, exact=False)
    assert not value(0.16).holds(0.171875, exact=False)  # 176 bytes (labels both ways) would not match
    assert value("19K").holds(18_832, exact=False) and not value("19K").holds(17_900, exact=False)
    assert value("274K").holds(274_384, exact=False)
    assert value("10.00").holds(10.0005, exact=False) and not value("10.00").holds(10.02, exact=False)
    assert value("<0.05%").holds(0.000468, exact=False) and not value("<0.05%").holds(0.0005, exact=False)
    assert value(110).holds(110, exact=False) and not value(110).holds(111, exact=False)  # integers exactly
    assert value(1.0).holds(1.0, exact=True) and not value(1.0).holds(1.05, exact=True)  # a set value equals
    with pytest.raises(ValueError, match="not a number the check reads"):
        value("about 20")


def _recipe(tmp_path, name, text):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_verdicts_match_departure_mismatch_and_stale_notes(paper_setup, tmp_path):
    base = ROOT / "recipes/fd_cifar10_heterogeneous.yaml"
    reference = "reference: {paper: p, table: t, column: c, metrics: {personal/test_acc: 0.9}"
    path = _recipe(
        tmp_path,
        "cell",
        f"base: {base}\n{reference},\n"
        "  setup: {clients: 10, rounds: 100, lr: 0.01, mib/cnn1: '10.00', models.cnn1.builder: 1},\n"
        "  departures: {rounds: the recipe runs 500 (a test), lr: stale, batch_size: not stated}}\n",
    )
    recipe = paper_setup.Recipe(path, None)
    # fd_cifar10_heterogeneous's own and its bases' numbers come first, this file's on top
    assert recipe.numbers["clients"] == 10 and recipe.numbers["classes_per_client"] == 2
    assert recipe.notes["mib/cnn4"].startswith("the CNN-4 of Table 2's layer sizes")
    lines = {line.quantity: line for line in paper_setup.check_recipe(recipe)}
    assert lines["clients"].verdict == "match" and lines["mib/cnn1"].verdict == "match"
    assert lines["mib/cnn1"].measured == pytest.approx(2_621_558 * 4 / 2**20)
    assert (lines["rounds"].verdict, lines["rounds"].why) == ("documented departure", "the recipe runs 500 (a test)")
    assert lines["lr"].verdict == "STALE NOTE" and lines["lr"].failed  # the note says it departs; it does not
    assert lines["batch_size"].verdict == "STALE NOTE"  # a note on a number nobody states
    assert lines["models.cnn1.builder"].verdict == "MISMATCH"  # "fedgh_cnn1" is not 1
    assert lines["mib/cnn4"].verdict == "documented departure"
    unknown = _recipe(tmp_path, "unknown", f"base: {base}\n{reference}, setup: {{speed: 3}}}}\n")
    [line] = [x for x in paper_setup.check_recipe(paper_setup.Recipe(unknown, None)) if x.quantity == "speed"]
    assert line.verdict == "MISMATCH" and "does not measure it" in line.why


def test_data_sizes_come_from_the_real_layout(paper_setup):
    """Paper 002's federated CIFAR-100 at its real size: 315 clients of 100 images, 13,500 for the server."""
    recipe = paper_setup.Recipe(ROOT / "recipes/merged_codist_cifar100_ph4700_indomain.yaml", None)
    measured = {name: paper_setup.measure(recipe, name)[0] for name in recipe.numbers}
    assert measured["pool_examples"] == 31_500 and measured["server_examples"] == 13_500
    assert measured["held_out_examples"] == 5_000 and measured["examples/high"] == 4_700
    assert measured["params/small"] == 109_348 and measured["params/large"] == 410_084


@pytest.mark.slow  # a spawned process and three tiny CIFAR/MNIST runs; each method's traffic has a fast test
def test_the_ci_sample_checks_traffic_payloads_and_sizes_and_passes(paper_setup, capsys):
    """The sample: FD's traffic by paper 004's count (a two-round run on tiny CIFAR-10 files), FedMD's by paper
    000's with its documented departure, DS-FL's message size per public example (paper 001's Table 2)."""
    assert paper_setup.main(["--check", "--sample"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line for line in out.splitlines() if len(line.split()) > 2}
    assert re.search(
        r"paper\s+0.16\s+measured\s+0.164062\s+match$", rows[("fd_cifar10_heterogeneous", "comm/kib_per_client_round")]
    )
    assert (
        "documented departure (the paper counts the n = 10 public images"
        in rows[("fedmd_mnist_homogeneous", "numbers_up_per_client_round")]
    )
    assert re.search(r"measured\s+100\s+documented", rows[("fedmd_mnist_homogeneous", "numbers_up_per_client_round")])
    assert re.search(
        r"paper\s+10\s+measured\s+10\s+match$", rows[("dsfl_cifar10_table2", "numbers_up_per_public_example")]
    )
    assert re.search(r"0 failing$", out.strip())


def test_recipes_of_one_family_share_a_shape_and_other_methods_do_not(paper_setup):
    def shape(name):
        return paper_setup.shape(paper_setup.Recipe(ROOT / f"recipes/{name}.yaml", None).resolved)

    assert shape("velo_cifar10_iid_cvae1") == shape("velo_cifar10_iid_cvae10")  # the CVAE's size: a number
    assert shape("velo_cifar10_iid_cvae1") != shape("velo_cifar10_noniid_cvae1")  # another partitioner
    assert shape("fd_cifar10_n10_c100") != shape("fd_cifar100_n10_c100")  # another data set


@pytest.mark.slow
def test_every_paper_recipe_s_numbers_and_partition_hold_without_a_run(paper_setup):
    """Every stated number that needs no run (sizes, counts, rates, the real-size partition) of every paper
    recipe; the traffic numbers, measured in runs, are the ``full`` tier's (next test) and the CI sample's."""
    lines = paper_setup.run_check(None, run=False)
    assert len({line.recipe for line in lines}) == len(paper_setup.paper_recipe_paths(None))
    assert sum(line.quantity == paper_setup.PARTITION for line in lines) > 200

    # traffic, and the unlabeled share of a data set whose layout only a run gives (FEMNIST's writers), need a run
    def needs_run(line) -> bool:
        return line.quantity in paper_setup.RUN_QUANTITIES or (
            line.quantity.endswith("_share") and line.measured is None
        )

    assert sum(map(needs_run, lines)) < 100
    failing = [f"{x.recipe} {x.quantity}: {x.verdict} {x.why}" for x in lines if x.failed and not needs_run(x)]
    assert failing == []


@pytest.mark.full
def test_every_paper_recipe_states_no_undocumented_mismatch_and_the_docs_table_is_current(paper_setup, capsys):
    """Every stated number of every paper recipe, traffic measured in runs included; of the recipes whose numbers
    need no run, one of each shape runs its round (the rest differ in numbers only). The full check, every
    recipe's round, is `python benchmarks/paper_setup.py --check` (about twice as long)."""
    lines = paper_setup.run_check(None, run=True, one_per_shape=True)
    ran = [line.measured for line in lines if line.quantity == "runs one round"]
    assert ran.count("yes") > 60 and ran.count("shape ran") > 60
    failing = [f"{line.recipe} {line.quantity}: {line.verdict} {line.why}" for line in lines if line.failed]
    assert failing == []
    docs = (ROOT / "docs/algorithms.md").read_text()
    assert f"{paper_setup.BEGIN}\n{paper_setup.summary_table(lines)}\n{paper_setup.END}" in docs, (
        "docs/algorithms.md's paper-setup table is stale: run `python benchmarks/paper_setup.py --write`"
    )


def test_imdb_recipes_partition_the_real_reviews_with_the_papers_remedy(paper_setup, tmp_path):
    """Dirichlet(0.1) over 50 clients and two classes leaves a client without a review in nearly every draw; the
    recipes take paper 001's remedy (alpha 0.2, no empty client), reported against Table 11's 0.1."""
    recipe = paper_setup.Recipe(ROOT / "recipes/weak_only_imdb.yaml", None)
    assert paper_setup.partition_line(recipe).verdict == "match"
    assert len(recipe.layout.clients) == 50 and sum(len(c.train) for c in recipe.layout.clients) == 25_000
    [alpha] = [line for line in paper_setup.check_recipe(recipe) if line.quantity == "dirichlet_alpha"]
    assert (alpha.paper, alpha.measured, alpha.verdict) == (0.1, 0.2, "documented departure")
    table_11 = _recipe(
        tmp_path,
        "alpha01",
        f"base: {ROOT / 'recipes/weak_only_imdb.yaml'}\n"
        "data: {init_args: {partitioner: {init_args: {alpha: 0.1, max_tries: 100}}}}\n",
    )
    line = paper_setup.partition_line(paper_setup.Recipe(table_11, None))
    assert line.verdict == "MISMATCH" and "did not give all 50 clients at least 1 examples" in line.why


def _set_global_state() -> tuple[int, int]:
    """What a recipe's run may leave behind: a seed (here, in the process that calls it)."""
    import torch

    torch.manual_seed(1234)
    return os.getpid(), torch.initial_seed()


@pytest.mark.slow  # four spawned processes, each importing torch
def test_recipes_are_checked_in_spawned_processes_replaced_after_a_few_recipes(paper_setup):
    """What a recipe's check sets ends with its process, which serves a bounded number of checks; the parent has
    run torch first, as a test session has: a forked child of such a process could hang on the thread pool."""
    torch = pytest.importorskip("torch")
    torch.ones(256, 256) @ torch.ones(256, 256)  # the parent's thread pool has run
    before = torch.initial_seed()
    first, second = paper_setup.isolated(_set_global_state), paper_setup.isolated(_set_global_state)
    assert first[1] == second[1] == 1234 and len({first[0], second[0], os.getpid()}) == 3
    assert torch.initial_seed() == before
    with paper_setup.isolated_pool(2) as pool:
        pids = [pool.submit(_set_global_state).result()[0] for _ in range(3)]
        with pytest.raises(ZeroDivisionError):  # an error in the recipe's process reaches the caller
            pool.submit(divmod, 1, 0).result()
    assert pids[0] == pids[1] != pids[2] and os.getpid() not in pids


@pytest.mark.slow
def test_htfl_practical_cifar100_traffic_is_the_posters(paper_setup, capsys):
    """LG-FedAvg's heads and FML's memes, two rounds of HtFLlib's 20 clients on tiny CIFAR-100 files: the FedKTL
    poster's numbers per round (1.03M and 18.50M each way)."""
    assert paper_setup.main(["--check", "--recipes", "htfl_lg_fedavg_cifar100_prac", "htfl_fml_cifar100_prac"]) == 0
    out = capsys.readouterr().out
    fml = r"htfl_fml_cifar100_prac\s+numbers_up_per_round\s+paper\s+18.50M\s+measured\s+1.84942e\+07\s+match"
    heads = r"htfl_lg_fedavg_cifar100_prac\s+numbers_down_per_round\s+paper\s+1.03M\s+measured\s+1.026e\+06\s+match"
    assert re.search(fml, out) and re.search(heads, out)
