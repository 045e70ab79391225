"""gqakit.eval"""
