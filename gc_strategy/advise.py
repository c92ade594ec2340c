"""``python -m gc_strategy.advise``: the advisor's documented command line
(:mod:`gc_strategy.tools.advise`)."""

from .tools.advise import main

if __name__ == "__main__":
    main()
