"""``python -m cgx``: the CGX_* variables, their values in effect and who set them.
Exits with status 1, after the table, where a value is not valid or a CGX_* variable
set is not one cgx reads. ``python -m cgx --markdown``: the table of
docs/configuration.md."""

import argparse
import sys

from cgx.config import describe, markdown_table

parser = argparse.ArgumentParser(
    prog="python -m cgx",
    description="The CGX_* variables (docs/configuration.md): the value each takes in this environment, "
                "who set it (default or environment) and what it accepts. Exits with status 1 where a value "
                "is not valid or a CGX_* variable set is not one cgx reads (a misspelt name, say).")
parser.add_argument("--markdown", action="store_true", help="print the table of docs/configuration.md instead")
args = parser.parse_args()
if args.markdown:
    print(markdown_table())
else:
    table, problems = describe()
    print(table)
    for problem in problems:
        print(problem, file=sys.stderr)
    sys.exit(1 if problems else 0)
