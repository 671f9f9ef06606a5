"""`python -m loka_compile`: see loka_compile/cli.py."""

from loka_compile.cli import main

raise SystemExit(main())
