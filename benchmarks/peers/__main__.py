import sys

from benchmarks.peers.run import main

if __name__ == "__main__":
    sys.exit(main())
