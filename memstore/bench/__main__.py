"""``python -m memstore.bench``: the same as ``memstore bench``."""

import sys

from memstore.bench import main

sys.exit(main())
