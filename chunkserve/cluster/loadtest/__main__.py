import sys

from chunkserve.cluster.loadtest.cli import main

sys.exit(main())
