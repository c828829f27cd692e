"""`python -m ffnquant`: the `ffnquant` command."""

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while Python was still loading the command line module: one line, no traceback
    import sys

    print("ffnquant: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
