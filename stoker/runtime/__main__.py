import sys

from stoker.runtime.trainer import main

sys.exit(main())
