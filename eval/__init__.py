"""gqakit.eval: perplexity, decode speed and task accuracy (`gqakit eval`; from Python, `gqakit.evaluate`)."""

# The built-in measurements register themselves on import, so every reader of a results file
# (eval.results) knows their blocks, as it knows any registered measurement's.
from gqakit.eval import measures  # noqa: E402,F401
