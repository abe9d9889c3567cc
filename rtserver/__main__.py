"""`python -m rtserver ...`: the same as the `rtserver` command."""

from .cli import main

raise SystemExit(main())
