"""gqakit.convert"""
