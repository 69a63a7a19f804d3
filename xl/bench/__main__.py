"""``python -m xl.bench``: the throughput benchmark (:mod:`xl.bench.throughput`)."""

from xl.bench.throughput import main

main()
