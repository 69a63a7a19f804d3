"""``python -m xl.convert SRC OUT`` (:mod:`xl.convert.cli`)."""

from xl.convert.cli import main

main()
