"""parse_args: the command line every forge app shares."""

import argparse
import sys
from collections.abc import Sequence

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
    try:
        config = load_config(schema, args.config, args.overrides)
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if args.print_config:
        sys.stdout.write(config_to_yaml(config))
        parser.exit(0)
    return config
