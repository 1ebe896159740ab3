"""``python -m dgt config``: print the table of every DGT_* setting (Markdown)."""
import argparse
import sys

from .config import markdown_table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgt")
    parser.add_argument("what", choices=["config"], help="config: the table of DGT_* settings")
    parser.parse_args(argv)
    sys.stdout.write(markdown_table() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
