"""``python -m cgx``: the CGX_* variables, their values in effect and who set them.
Exits with status 1, after the table, where a value is not valid.
``python -m cgx --markdown``: the table of docs/configuration.md."""

import sys

from cgx.config import describe, markdown_table

if sys.argv[1:] == ["--markdown"]:
    print(markdown_table())
else:
    table, problems = describe()
    print(table)
    for problem in problems:
        print(problem, file=sys.stderr)
    sys.exit(1 if problems else 0)
