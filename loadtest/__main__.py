"""`python -m loadtest <command>`: the same as the radixserve-loadtest console script."""

from loadtest.cli import main

main()
