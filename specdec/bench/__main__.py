import sys

from specdec.bench.run import main

sys.exit(main())
