"""`python -m chatloom.cli`: the `chatloom` command."""
import sys

from chatloom.cli.main import main

sys.exit(main())
