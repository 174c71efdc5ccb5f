"""`python -m src.schema TARGET` lists a component's config keys; `--markdown TARGET PREFIX` prints them as a table."""

import sys

from src.schema.reference import describe, markdown_reference

if sys.argv[1] == "--markdown":
    print(markdown_reference(sys.argv[2], sys.argv[3]))
else:
    print(describe(sys.argv[1]))
