"""``python -m functional_dw demo [options]`` (also the ``functional-dw`` console script)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: functional-dw demo [--help] [options]\n\n"
            "commands:\n  demo    run the MoE expert-MLP demo on the CPU reference backend"
        )
        return 0 if argv else 2
    if argv[0] != "demo":
        print(f"functional-dw: unknown command {argv[0]!r}; try `functional-dw demo --help`", file=sys.stderr)
        return 2
    from .demo import main as demo

    return demo(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
