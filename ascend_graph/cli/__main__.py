"""``python -m ascend_graph.cli``: the ``ascend-graph`` command."""

import sys

from . import main

sys.exit(main())
