"""`python -m gqakit ...` and `accelerate launch -m gqakit uptrain CONFIG.yaml`."""

from gqakit.cli import main

if __name__ == "__main__":
    main()
