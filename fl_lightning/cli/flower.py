"""``flrun flower --config RECIPE [--supernodes N] [--simulation] [FIT_OPTIONS]``: a recipe as Flower apps.

Every option but the two of this command is ``flrun fit``'s (the recipe, ``--output_dir``, ``--seed``, ...). With
``--simulation`` the apps run on Flower's simulation engine; without it, on a loopback deployment this command
starts and ends: a SuperLink and N SuperNodes as processes on 127.0.0.1, the run submitted to the SuperLink.
"""

from __future__ import annotations

from ..run.arguments import UserError

USAGE = """usage: flrun flower -c RECIPE [--supernodes N] [--simulation] [--KEY VALUE ...]

Runs a recipe as a Flower ServerApp and ClientApp: the server runs the strategy's rounds
and aggregation, each SuperNode the clients whose id modulo N is its partition id, with the
same Fabric loop and numbers as `flrun fit`. The run folder gets flrun fit's files.

options:
  --supernodes N   SuperNodes (default 2)
  --simulation     on Flower's simulation engine, in this process and its workers; without
                   it, a loopback deployment: a SuperLink and N SuperNodes on 127.0.0.1
  every other option is flrun fit's: -c/--config, --output_dir, --seed, --rounds, ..."""


def split_options(argv: list[str]) -> tuple[list[str], int, bool]:
    """``flrun fit``'s options, the number of SuperNodes and whether to simulate."""
    fit_args, supernodes, simulation = [], 2, False
    args = iter(argv)
    for arg in args:
        if arg == "--simulation":
            simulation = True
        elif arg == "--supernodes" or arg.startswith("--supernodes="):
            value = arg.partition("=")[2] if "=" in arg else next(args, "")
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"--supernodes takes a whole number of SuperNodes of at least 1, got {value!r}.")
            supernodes = int(value)
        else:
            fit_args.append(arg)
    return fit_args, supernodes, simulation


def run_flower(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    fit_args, supernodes, simulation = split_options(argv)
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise UserError('flrun flower needs Flower: pip install -e ".[flower]" (or pip install flwr).') from None
    from ..flower.launch import run_loopback, run_simulated
    from ..run.arguments import parse_fit

    _, init, _ = parse_fit(fit_args)  # a mistake in the recipe is answered before anything starts
    from ..flower.apps import check_deployable

    check_deployable(init)
    summary = run_simulated(fit_args, supernodes) if simulation else run_loopback(fit_args, supernodes)
    from ..tracking.progress import run_summary

    print(run_summary(summary))
    return 0
