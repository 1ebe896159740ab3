"""``python -m dgt config [--update FILE]``: print the table of every DGT_* setting (Markdown),
or rewrite it in place between the ``<!-- knobs:start -->`` / ``<!-- knobs:end -->`` markers."""
import argparse
import re
import sys

from .config import markdown_table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgt")
    parser.add_argument("what", choices=["config"], help="config: the table of DGT_* settings")
    parser.add_argument("--update", metavar="FILE", help="rewrite the table inside FILE")
    args = parser.parse_args(argv)
    table = markdown_table() + "\n"
    if not args.update:
        sys.stdout.write(table)
        return 0
    with open(args.update, encoding="utf-8") as f:
        text = f.read()
    pattern = re.compile(r"(<!-- knobs:start -->\n).*?(<!-- knobs:end -->)", re.S)
    if not pattern.search(text):
        sys.stderr.write(f"{args.update} has no <!-- knobs:start/end --> markers\n")
        return 1
    with open(args.update, "w", encoding="utf-8") as f:
        f.write(pattern.sub(lambda m: m.group(1) + table + m.group(2), text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
