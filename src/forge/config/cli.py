"""parse_args: the command line every forge app shares."""

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from forge.config.dump import config_to_yaml
from forge.config.errors import ConfigError
from forge.config.loader import Schema, load_config


def parse_args(
    schema: type[Schema], argv: Sequence[str] | None = None, description: str | None = None
) -> Schema:
    """`app --config PATH [--print-config] [KEY=VALUE | ~KEY ...]` -> a validated `schema` instance.

    A config error exits with status 2 and the problems on stderr, without a traceback:
    the user needs the list of mistakes, not forge's call stack.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", metavar="PATH", help="YAML config file")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override a key (trainer.optimizer.lr=1e-5), or delete one (~trainer.optimizer.weight_decay)",
    )
    # Intermixed, so that overrides may come before or after the options.
    args = parser.parse_intermixed_args(argv)
    make_user_code_importable(args.config)
    try:
        config = load_config(schema, args.config, args.overrides)
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if args.print_config:
        sys.stdout.write(config_to_yaml(config))
        parser.exit(0)
    return config


def make_user_code_importable(config_path: str | None) -> None:
    """Puts the directory the app runs from and the config file's directory first on the import
    path, here and (through ``PYTHONPATH``) in every process the run starts on this host.

    They hold a user's own rewards, environments and agents, which a config names by import
    path (``mypkg.rewards:score``): validating the config imports them here, and the actors that
    call them import them in their own processes.
    """
    directories = [os.getcwd()]
    if config_path is not None:
        directories.append(str(Path(config_path).resolve().parent))
    for directory in reversed(directories):
        if directory not in sys.path:
            sys.path.insert(0, directory)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*directories, *inherited]))
