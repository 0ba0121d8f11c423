"""python -m harness.store: the kvbench-results console script, without installing it."""

import sys

from harness.store.cli import main

sys.exit(main())
