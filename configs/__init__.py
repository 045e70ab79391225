"""gqakit.configs"""
