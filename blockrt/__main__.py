"""`python -m blockrt ...`: the command line (blockrt.cli)."""

from blockrt.cli import main

raise SystemExit(main())
