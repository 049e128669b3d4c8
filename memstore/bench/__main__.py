"""``python -m memstore.bench [FLAGS]``: the same as ``memstore bench [FLAGS]``."""

import sys

from memstore.bench import main

sys.exit(main())
