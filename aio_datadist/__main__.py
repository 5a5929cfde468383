"""``python -m aio_datadist``: the ``aio-datadist`` command."""

import sys

from aio_datadist.cli import main

sys.exit(main())
