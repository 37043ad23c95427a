"""Recipe families: ``base:`` inheritance, per-role ``models`` merging, one reference shape, the README tables."""

import pytest
import yaml
from conftest import ROOT, run_cli

from fl_lightning.federation.errors import ConfigError
from fl_lightning.run.recipes import base_files, load_recipe, merge, paper_recipes, readme

KD = "fl_lightning.strategies.OnDeviceKD"


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_merge_goes_key_by_key_and_replaces_lists_scalars_and_other_classes():
    base = {
        "rounds": 10,
        "models": {"aux": {"builder": "resnet20", "args": {"width": 0.25}}, "target": {"builder": "resnet20"}},
        "strategy": {"class_path": KD, "init_args": {"temperature": 3.0, "kd_weight": 0.5}},
        "population": {"tiers": [{"name": "a"}, {"name": "b"}]},
    }
    override = {
        "rounds": 20,
        "models": {"aux": {"args": {"width": 0.5}}},
        "strategy": {"class_path": "fl_lightning.strategies.FedAvg", "init_args": {"roles": ["aux"]}},
        "population": {"tiers": [{"name": "c"}]},
    }
    assert merge(base, override) == {
        "rounds": 20,
        "models": {"aux": {"builder": "resnet20", "args": {"width": 0.5}}, "target": {"builder": "resnet20"}},
        "strategy": {"class_path": "fl_lightning.strategies.FedAvg", "init_args": {"roles": ["aux"]}},
        "population": {"tiers": [{"name": "c"}]},
    }
    same_class = merge(base, {"strategy": {"class_path": KD, "init_args": {"kd_weight": 1.0}}})
    assert same_class["strategy"] == {"class_path": KD, "init_args": {"temperature": 3.0, "kd_weight": 1.0}}
    # a base that leaves the class open takes the recipe's class and keeps its own init_args, class first
    data = merge({"data": {"init_args": {"download": True}}}, {"data": {"class_path": "X"}})["data"]
    assert list(data.items()) == [("class_path", "X"), ("init_args", {"download": True})]


def test_bases_resolve_relative_to_their_file_in_order_and_the_reference_stays_with_its_file(tmp_path):
    _write(tmp_path / "_base/a.yaml", "rounds: 5\nseed: 1\nreference: {paper: A}\n")
    _write(tmp_path / "_base/b.yaml", "base: a.yaml\nseed: 2\neval_every: 3\n")
    _write(tmp_path / "_base/c.yaml", "eval_every: 4\nmonitor: x\n")
    recipe = _write(tmp_path / "r.yaml", "base: [_base/b.yaml, _base/c.yaml]\nmonitor: y\n")
    assert load_recipe(recipe) == {"rounds": 5, "seed": 2, "eval_every": 4, "monitor": "y"}
    assert base_files(recipe) == [(tmp_path / f"_base/{n}.yaml").resolve() for n in "bac"]
    assert load_recipe(tmp_path / "_base/a.yaml")["reference"] == {"paper": "A"}


def test_loops_missing_bases_and_malformed_base_keys_are_refused_in_one_sentence(tmp_path):
    _write(tmp_path / "x.yaml", "base: y.yaml\n")
    _write(tmp_path / "y.yaml", "base: [x.yaml]\n")
    with pytest.raises(ConfigError, match=r"builds on itself \(.*x.yaml -> .*y.yaml -> .*x.yaml\)"):
        load_recipe(tmp_path / "x.yaml")
    _write(tmp_path / "m.yaml", "base: gone.yaml\n")
    with pytest.raises(ConfigError, match=r"base recipe .*gone.yaml named in .*m.yaml does not exist"):
        load_recipe(tmp_path / "m.yaml")
    with pytest.raises(ConfigError, match=r"recipe .*nowhere.yaml does not exist"):
        load_recipe(tmp_path / "nowhere.yaml")
    _write(tmp_path / "n.yaml", "base: {a: 1}\n")
    with pytest.raises(ConfigError, match="must be a file name or a list of file names"):
        load_recipe(tmp_path / "n.yaml")


def test_flrun_reports_a_loop_as_one_line_with_exit_status_2(tmp_path, capsys):
    _write(tmp_path / "x.yaml", "base: x.yaml\nrounds: 1\n")
    assert run_cli("fit", "--config", str(tmp_path / "x.yaml")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "builds on itself" in err and "Traceback" not in err


def _parse(*argv):
    from fl_lightning.cli.commands import fit_parser

    parser = fit_parser()
    return parser, parser.parse_args(list(argv))


def test_a_variant_changes_one_role_and_keeps_the_other_and_prints_the_merged_recipe(tmp_path):
    variant = _write(
        tmp_path / "v.yaml",
        f"base: {ROOT / 'recipes/ondevice_kd_cifar10.yaml'}\n"
        "models: {aux: {args: {width: 0.5}}}\n"
        "strategy: {init_args: {temperature: 2.0}}\n",
    )
    parser, cfg = _parse("--config", str(variant))
    printed = yaml.safe_load(parser.dump(cfg))
    assert printed["models"] == {
        "aux": {"builder": "resnet20", "args": {"width": 0.5}},
        "target": {"builder": "resnet20", "args": {"width": 1.0}},
    }
    assert printed["strategy"]["init_args"]["temperature"] == 2.0
    assert printed["strategy"]["init_args"]["kd_weight"] == 0.5  # inherited
    assert printed["rounds"] == 400 and printed.get("reference") is None  # the cell belongs to the base's file
    assert [str(p) for p in cfg.config] == [str(variant)]


def test_a_later_config_file_and_a_role_option_change_one_role_only(tmp_path):
    tweak = _write(tmp_path / "tweak.yaml", "models: {target: {args: {width: 0.5}}}\n")
    recipe = str(ROOT / "recipes/ondevice_kd_cifar10.yaml")
    _, cfg = _parse("--config", recipe, "--config", str(tweak), "--models.aux.args", "{width: 0.75}")
    assert {role: (spec.builder, spec.args) for role, spec in cfg.models.items()} == {
        "aux": ("resnet20", {"width": 0.75}),
        "target": ("resnet20", {"width": 0.5}),
    }


@pytest.mark.parametrize(
    "name", ["velo_cifar10_iid_cvae4", "strong_only_cifar10", "merged_codist_cifar100_ph4700_outdomain"]
)
def test_a_variant_parses_as_its_merged_text_written_out_in_full(tmp_path, name):
    merged = _write(
        tmp_path / f"{name}.yaml", yaml.safe_dump(load_recipe(ROOT / f"recipes/{name}.yaml"), sort_keys=False)
    )
    parser, variant = _parse("--config", str(ROOT / f"recipes/{name}.yaml"))
    _, written = _parse("--config", str(merged))
    assert "base" not in merged.read_text() and parser.dump(variant) == parser.dump(written)


def test_every_base_is_used_and_no_runnable_recipe_restates_the_defaults():
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    used = {base for recipe in recipes for base in base_files(recipe)}
    bases = sorted((ROOT / "recipes/_base").glob("*.yaml"))
    assert len(bases) >= 30
    assert [b.name for b in bases if b.resolve() not in used] == []
    restated = []
    for path in [*recipes, *bases]:
        text = path.read_text()
        restated += [path.name for needle in ("accelerator: auto", "data_dir: data") if needle in text]
    assert restated == []


def test_every_paper_recipe_has_the_one_reference_shape():
    rows = paper_recipes()
    assert len(rows) >= 141
    for path, reference in rows:
        assert set(reference) <= {"paper", "table", "row", "column", "metrics", "stds", "setup", "departures"}, (
            path.name
        )
    by_name = {path.name: reference for path, reference in rows}
    assert by_name["fedadam_cifar100_ph3100.yaml"]["metrics"] == {"large/test_acc": 0.2476, "small/test_acc": 0.3184}


def test_a_reference_in_another_shape_is_refused(tmp_path):
    from fl_lightning.run.recipes import check_reference

    old = {"paper": "p", "table": "t", "column": "c", "metric": "m", "value": 0.5}
    with pytest.raises(ConfigError, match=r"unknown keys \['metric', 'value'\] / lacks \['metrics'\]"):
        check_reference(old, tmp_path / "r.yaml")
    stray = {"paper": "p", "table": "t", "column": "c", "metrics": {"m": 0.5}, "stds": {"n": 0.1}}
    with pytest.raises(ConfigError, match="names metrics that `reference.metrics` lacks"):
        check_reference(stray, tmp_path / "r.yaml")
    # null: a cell the paper prints no number for ("-"); a spread must still be a number
    check_reference({"paper": "p", "table": "t", "column": "c", "metrics": {"m": None}}, tmp_path / "r.yaml")
    no_std = {"paper": "p", "table": "t", "column": "c", "metrics": {"m": None}, "stds": {"m": None}}
    with pytest.raises(ConfigError, match=r"`reference.stds` in .* must map metric names to the paper's numbers\.$"):
        check_reference(no_std, tmp_path / "r.yaml")
    with pytest.raises(ConfigError, match=r"numbers \(null where the paper prints none\)"):
        check_reference({"paper": "p", "table": "t", "column": "c", "metrics": {"m": "93%"}}, tmp_path / "r.yaml")
    # the set-up numbers: numbers or printed forms (19K, <0.05%); departures: a reason per number
    cell = {"paper": "p", "table": "t", "column": "c", "metrics": {"m": 0.5}}
    check_reference(
        {**cell, "setup": {"clients": 100, "message_numbers/aux": "19K"}, "departures": {"clients": "why"}},
        tmp_path / "r.yaml",
    )
    with pytest.raises(ConfigError, match="`reference.setup` in .* must map set-up quantities to the paper's numbers"):
        check_reference({**cell, "setup": {"clients": [100]}}, tmp_path / "r.yaml")
    with pytest.raises(ConfigError, match="`reference.departures` in .* must map set-up quantities to the reason"):
        check_reference({**cell, "departures": {"clients": 3}}, tmp_path / "r.yaml")


def test_the_committed_readme_is_the_generated_one():
    current = (ROOT / "recipes/README.md").read_text()
    assert readme(current) == current, "recipes/README.md is stale: run `python -m fl_lightning.run.recipes readme`"
    assert (
        "| Table 4 | CIFAR-10, Proposed | target/test_acc | 0.6243 (std 0.001) | `ondevice_kd_cifar10.yaml` |"
        in current
    )


def test_readme_tables_follow_the_reference_blocks(tmp_path):
    from fl_lightning.run.recipes import README_BEGIN, README_END

    _write(tmp_path / "_base/s.yaml", "rounds: 1\n")
    _write(
        tmp_path / "b.yaml",
        "base: _base/s.yaml\nreference: {paper: P2, table: T1, column: '|x|', metrics: {a/acc: 0.5, b/acc: 0.25}}\n",
    )
    _write(
        tmp_path / "a.yaml",
        "reference: {paper: P1, table: T9, row: R, column: c, metrics: {m: 0.1, n: 0.3}, stds: {m: 0.02}}\n",
    )
    _write(tmp_path / "c.yaml", "reference: {paper: P1, table: T10, row: A, column: c, metrics: {m: null}}\n")
    _write(tmp_path / "d.yaml", "reference: {paper: P1, table: T9, row: A, column: c, metrics: {m: 0.2}}\n")
    _write(tmp_path / "digits.yaml", "rounds: 3\n")  # no reference: not a paper cell
    header = "| table | cell | metric | paper's value | recipe |\n|---|---|---|---|---|\n"
    # by table (T9 before T10), row and column; null is a cell without the paper's number
    assert readme(f"intro\n{README_BEGIN}\nold rows\n{README_END}\noutro\n", tmp_path) == (
        f"intro\n{README_BEGIN}\n\n"
        f"## P1\n\n{header}| T9 | A, c | m | 0.2 | `d.yaml` |\n| T9 | R, c | m | m 0.1 (std 0.02), n 0.3 | `a.yaml` |\n"
        "| T10 | A, c | m | no number | `c.yaml` |\n\n"
        f"## P2\n\n{header}| T1 | \\|x\\| | a/acc | a/acc 0.5, b/acc 0.25 | `b.yaml` |\n\n"
        f"{README_END}\noutro\n"
    )
    with pytest.raises(ConfigError, match="lacks the markers"):
        readme("no markers", tmp_path)
