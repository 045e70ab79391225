"""gqakit's benchmark scripts. Run each from the repository root as `python -m bench.NAME`;
what they share is in `bench.common`, and docs/benchmarks.md gives every command with its results."""
