"""``python -m fcsd.cli`` (and ``torchrun ... -m fcsd.cli``): the ``fcsd`` command."""

import sys

from fcsd.cli import main

sys.exit(main())
