import sys

from cluster.loadtest.cli import main

sys.exit(main())
