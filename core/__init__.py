"""Pieces shared by convert, uptrain and eval: errors, output folders, model cards, loading."""
