"""gqakit.eval: perplexity, decode speed and task accuracy (`gqakit eval`; from Python, `gqakit.evaluate`)."""
