import sys

from memstore.cli import main

sys.exit(main())
