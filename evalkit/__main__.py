"""`python -m evalkit ...` (also `accelerate launch -m evalkit run ...`)."""

from evalkit.cli import main

if __name__ == "__main__":
    main()
