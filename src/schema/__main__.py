"""What a config key takes, from the command line:

    python -m src.schema                       # the config groups and their options, each with its _target_
    python -m src.schema model                 # one group's options
    python -m src.schema src.models.gpt.GPT    # a component's keys: name, type, default, help (model=gpt's)
    python -m src.schema --markdown TARGET PREFIX   # the same as a Markdown table (docs/configuration.md's)
"""

import argparse
import sys

import yaml

from src.errors import UsageError
from src.schema.reference import describe, markdown_reference
from src.schema.trusted import CONFIG_ROOT

GROUPS = ("model", "data", "objective", "optimizer", "scheduler")


def options(group: str) -> str:
    """A group's options (config/GROUP/NAME.yaml) and the _target_ each names."""
    rows = []
    for file in sorted((CONFIG_ROOT / group).glob("*.yaml")):
        target = (yaml.safe_load(file.read_text(encoding="utf-8")) or {}).get("_target_", "")
        rows.append((f"{group}={file.stem}", target))
    width = max(len(option) for option, _ in rows)
    return "\n".join(f"{option:<{width}}  {target}" for option, target in rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.schema", description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", nargs=2, metavar=("TARGET", "PREFIX"), help="a component's keys as a table")
    parser.add_argument("what", nargs="?", help=f"a group ({', '.join(GROUPS)}) or a _target_ (src.models.gpt.GPT)")
    args = parser.parse_args(argv)
    try:
        if args.markdown:
            print(markdown_reference(*args.markdown))
        elif args.what is None:
            print("\n\n".join(options(group) for group in GROUPS))
            print("\nEach option's keys: python -m src.schema TARGET (the trainer's: src.schema.trainer.TrainerConfig)")
        elif args.what in GROUPS:
            print(options(args.what))
        else:
            print(describe(args.what))
    except UsageError as error:
        print(f"python -m src.schema: {error}\nGive a group ({', '.join(GROUPS)}) or a _target_ such as "
              "src.models.gpt.GPT (python -m src.schema lists every option's)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
