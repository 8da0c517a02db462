"""`python -m dspark_jax.cli` (or `python -m dspark_jax`): the `dspark-jax` console script
without the installed launcher."""

import sys

from dspark_jax.cli import main

sys.exit(main())
