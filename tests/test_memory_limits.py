"""Memory a run cannot have: models whose weights alone exceed what the process may allocate are refused before any
is built, and an allocation that fails anyway, while a model or a client's own state is made, is one sentence naming
the role and the size.

Each case runs in a process whose address space is limited (RLIMIT_AS, as ``ulimit -v`` or a job scheduler sets it)
to what it holds once torch is imported plus 2 GB, so the limit is the same on every machine; its models need 8 GB.
"""

import json
import os
import subprocess
import sys
import textwrap

import yaml
from conftest import ROOT, TINY

HEADROOM = 2 << 30
# 27 million hidden units: 64 * 27e6 + 27e6 * 10 weights of 4 bytes, about 8 GB
HUGE = 27_000_000

LIMITED = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path

    import torch  # noqa: F401 - imported before the limit is set: what it maps is not the run's
    import fl_lightning.cli.commands  # noqa: F401
    import fl_lightning.run.fit  # noqa: F401

    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    size = int(status["VmSize"].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + {headroom}, resource.RLIM_INFINITY))
    """
).format(headroom=HEADROOM)


def limited(tmp_path, body: str, trusted: str = "conftest") -> subprocess.CompletedProcess:
    """Runs ``body`` after LIMITED in a fresh process (the tests' folder and ``tmp_path`` importable, the modules
    ``trusted`` trusted for model builders)."""
    return subprocess.run(
        [sys.executable, "-c", LIMITED + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}:{tmp_path}", "FLRUN_TRUSTED_MODULES": trusted},
        timeout=600,
        check=False,
    )


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def fit_in_limit(tmp_path, models: dict, trusted: str = "conftest") -> tuple[subprocess.CompletedProcess, str]:
    recipe = json.loads(json.dumps(TINY))
    recipe.update(rounds=1, models=models)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    body = f"""
    from fl_lightning.cli.commands import main
    sys.exit(main(["fit", "--config", "r.yaml", "--output_dir", "{tmp_path / "run"}"]))
    """
    result = limited(tmp_path, body, trusted)
    return result, one_line(result)


def test_models_whose_weights_exceed_the_address_space_limit_are_refused_before_any_is_built(tmp_path):
    result, line = fit_in_limit(tmp_path, {"global": {"builder": "digits_mlp", "args": {"hidden": HUGE}}})
    assert result.returncode == 2
    size = (64 * HUGE + HUGE + HUGE * 10 + 10) * 4 // 2**20  # digits_mlp's weights and biases, by hand
    assert line.startswith(
        f"flrun fit: error: the run's models need at least {size:,} MB for their weights alone (role 'global', "
        f"digits_mlp: {size:,} MB), but "
    )
    assert line.endswith(
        " MB are left under this process's address-space limit (RLIMIT_AS, ulimit -v); use smaller models "
        "(models.<role>.args), or run where more memory is free."
    )
    left = int(line.split("), but ")[1].split(" MB")[0].replace(",", ""))
    assert 0 < left <= HEADROOM // 2**20
    assert not (tmp_path / "run").exists()  # refused before the run folder was written


def test_a_model_that_cannot_be_allocated_is_named_with_its_role_and_size(tmp_path):
    """A user's builder is not sized in advance (its code runs once): its allocation fails, and the sentence names
    the role, the builder and the size the allocator was asked for, not the user's code (nothing of theirs broke)."""
    (tmp_path / "bigmod.py").write_text(
        textwrap.dedent(
            f"""
            from torch import nn
            from fl_lightning.models import FeatureClassifier

            def build(num_classes=10):
                return FeatureClassifier(nn.Sequential(nn.Flatten(), nn.Linear(64, {HUGE})), nn.Linear({HUGE}, 10),
                                         {HUGE}, num_classes)
            """
        )
    )
    result, line = fit_in_limit(tmp_path, {"global": {"builder": "bigmod.build"}}, trusted="bigmod")
    assert result.returncode == 2
    first = 64 * HUGE * 4 // 2**20  # the first Linear's weight: the allocation that fails
    assert line.startswith(
        f"flrun fit: error: there was not enough memory for the model of role 'global' (builder bigmod.build) "
        f"({first:,} MB); "
    )
    assert line.endswith(
        " MB are left under this process's address-space limit (RLIMIT_AS, ulimit -v); use a smaller model "
        "(models.<role>.args), or run where more memory is free."
    )


def test_a_client_state_that_cannot_be_allocated_names_the_client_role_and_size(tmp_path):
    """A personalized method's clients each make their own model: the one that no longer fits is named."""
    hidden = 2_000_000  # about 600 MB a model
    body = f"""
    from conftest import method_env
    from fl_lightning.federation.errors import ConfigError
    from fl_lightning.federation.population import Tier
    from fl_lightning.models import ModelSpec
    from fl_lightning.strategies import FedAvg

    models = {{"global": ModelSpec("digits_mlp", {{"hidden": {hidden}}})}}
    server = method_env(FedAvg(), models, [Tier("all", ["global"])], num_clients=8)
    states = []
    try:
        for client in range(8):
            states.append(server.initial_weights("global", client))
    except ConfigError as err:
        print(len(states), err)
    """
    result = limited(tmp_path, body)
    assert result.returncode == 0, result.stderr
    made, _, sentence = result.stdout.strip().partition(" ")
    assert 0 < int(made) < 8, result.stdout  # some clients' states fit, the next did not
    size = (64 * hidden + hidden + hidden * 10 + 10) * 4 // 2**20  # the model's weights and biases
    assert sentence.startswith(
        f"there was not enough memory for client {made}'s own model of role 'global' ({size:,} MB); "
    ), sentence
    assert sentence.endswith(
        "keep fewer clients' states in memory (runtime.client_state_memory_mb) or use a smaller model, or run where "
        "more memory is free."
    )
