"""`python -m tigon.runtime ...` (and `torchrun ... -m tigon.runtime ...`): the `tigon` command."""

import sys

from tigon.runtime.cli import main

sys.exit(main())
